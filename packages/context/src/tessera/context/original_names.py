"""The names a model someone else wrote gives its tensors, kept by modules that restate it.

A pipeline needs a model as a sequence of layers, so tessera-layers' ``pipeline_layers`` restates
a transformers model as ``[embed, layer0, ..., head]``: the same tensors under other names
(``embed.wte.weight`` for GPT-2's ``transformer.wte.weight``), and a head tied to the embedding
under a name of its own on the last stage. Each such layer carries a map from its own
state-dict names to the original model's, and the engine, which knows no layer, reads it
through :func:`original_names_of`: checkpoints record it, and ``export_torch_state_dict``
writes the original names, so the export loads into the original class. The mark lives here,
below tessera-layers and tessera-engine, as the tensors' ``FullForm`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

__all__ = ["ORIGINAL_NAMES_ATTR", "original_names_of", "set_original_names"]

#: The attribute :func:`set_original_names` sets on a module.
ORIGINAL_NAMES_ATTR = "_tessera_original_names"


def set_original_names(module: nn.Module, names: Mapping[str, str]) -> None:
    """Record ``{name in module's state dict: name in the original model}`` on ``module``.

    Raises:
        ValueError: a name is not an entry of ``module``'s state dict, or two entries get the
            same original name.
    """
    own = set(module.state_dict(keep_vars=True))
    unknown = sorted(set(names) - own)
    if unknown:
        raise ValueError(
            f"set_original_names: {unknown[:4]} are not in the state dict of "
            f"{type(module).__name__} (its entries include {sorted(own)[:4]})"
        )
    seen: dict[str, str] = {}
    for name, original in names.items():
        if original in seen:
            raise ValueError(
                f"set_original_names: {seen[original]!r} and {name!r} of "
                f"{type(module).__name__} would both be {original!r}"
            )
        seen[original] = name
    setattr(module, ORIGINAL_NAMES_ATTR, dict(names))


def original_names_of(modules: Iterable[nn.Module]) -> dict[str, str]:
    """``{state-dict name: original name}`` of every marked entry of ``modules``.

    A module's state-dict names, prefixed by where the marked module sits inside it. Entries no
    mark names keep their own names (a model that was never restated has none).
    """
    found: dict[str, str] = {}
    for root in modules:
        for prefix, module in root.named_modules():
            names: Mapping[str, str] | None = getattr(module, ORIGINAL_NAMES_ATTR, None)
            for name, original in (names or {}).items():
                found[f"{prefix}.{name}" if prefix else name] = original
    return found
