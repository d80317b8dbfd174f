"""The ``tessera.layers`` entry points name every public layer, and only layers.

The registry lists and resolves layer names from the package metadata alone, without importing
torch, so the names are declared in pyproject.toml. This test keeps that list and the package's
``__all__`` from drifting apart: a layer added without its entry point would be unknown to
``LAYERS.get`` and to ``type="..."`` in a config.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from torch import nn

import tessera.layers as layers
from tessera.registry import LAYERS

#: Public classes that are bases to build layers on, not layers a config builds.
BASES = {"ParallelModule", "Module1D", "MeshModule", "CubeModule"}


def _declared() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="tessera.layers")}


def test_every_public_layer_class_has_an_entry_point() -> None:
    classes = {
        name
        for name in layers.__all__
        if isinstance(getattr(layers, name), type) and issubclass(getattr(layers, name), nn.Module)
    }
    missing = sorted(classes - BASES - set(_declared()))
    assert not missing, f"add to packages/layers/pyproject.toml's tessera.layers: {missing}"


def test_every_entry_point_is_a_public_name_of_the_package() -> None:
    for name, value in _declared().items():
        assert value == f"tessera.layers:{name}", (name, value)
        assert name in layers.__all__, name
        assert LAYERS.get(name) is getattr(layers, name)
