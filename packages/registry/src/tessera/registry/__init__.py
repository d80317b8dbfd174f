"""tessera-registry: named component registries, ``build`` from config, and ``Config``.

The bottom of tessera's dependency graph, standard library only: importing it never imports
torch or any tessera implementation package. Components arrive through packaging entry points
(group ``tessera.<registry>``) on the first lookup.
"""

from tessera.registry.builder import DEFAULT_KEY_REGISTRIES, build
from tessera.registry.builtin import (
    LAYERS,
    LOSSES,
    LR_SCHEDULERS,
    MODELS,
    OPTIMIZERS,
    Component,
)
from tessera.registry.config import Config
from tessera.registry.errors import ConfigError
from tessera.registry.registry import Registry

__all__ = [
    # core types
    "Registry",
    "Config",
    "ConfigError",
    "Component",
    # building
    "build",
    "DEFAULT_KEY_REGISTRIES",
    # the named registries
    "LAYERS",
    "MODELS",
    "OPTIMIZERS",
    "LR_SCHEDULERS",
    "LOSSES",
]
