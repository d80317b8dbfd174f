"""``FullForm``: how a parameter's full form maps back to the tensor its original model held.

tessera keeps every parameter in a form that ``ShardInfo`` can describe and that is the same
for every layout: torch's ``[out, in]`` for a linear weight, ``[fused, out/fused, in]`` for a
fused one (q, k and v in one matmul). A model written by someone else may hold the same
numbers differently: transformers' GPT-2 ``Conv1D`` stores ``[in, out]`` with q, k and v side
by side. tessera-layers' ``parallelize`` records the original form on each parameter it converts, so
``gather_full_state_dict`` returns tensors that load into the original class exactly and
``load_full_state_dict`` takes the original model's state dict as it is.

A fused projection whose parts differ in size (grouped-query attention's q, k and v in one
matmul, Phi-3's ``qkv_proj``) cannot be cut into equal ``[fused, out/fused, in]`` parts. tessera
holds it with its rows *interleaved by group* instead: the output rows of every part are cut into
``G`` equal groups (``G`` the greatest common divisor of the parts' sizes) and the tessera form
lists group 0 of every part, then group 1 of every part, and so on. A contiguous block of that
form, which is what a column split gives each rank, then holds the same fraction of every part
(whole heads of q with exactly the key/value heads they attend with), and the form is the same
for every layout, so checkpoints reshard.

It lives here, with ``ShardInfo``, because the engine reads it too, without knowing any layer:
checkpoints record each parameter's form, load a tensor only into a parameter of the same
form, and export the original form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "FULL_FORM_ATTR",
    "FullForm",
    "get_full_form",
    "grouped",
    "parts_in_turn",
    "set_full_form",
]

#: The attribute under which ``set_full_form`` stores the description on a parameter.
FULL_FORM_ATTR = "_tessera_full_form"


@dataclass(frozen=True)
class FullForm:
    """The original model's form of a parameter whose tessera full form differs.

    Attributes:
        original_shape: The shape the original module held (e.g. ``[in, 3 h]`` for a GPT-2
            ``Conv1D``).
        transposed: The original is the transpose of the tessera form flattened to two dims
            (``Conv1D`` stores ``[in, out]`` where tessera holds ``[out, in]``).
        sections: The sizes of the parts of the output dim (dim 0 of ``[out, in]`` and of a
            bias ``[out]``) that tessera holds interleaved by group (see the module
            docstring); ``()``: none.
    """

    original_shape: tuple[int, ...]
    transposed: bool = False
    sections: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.sections and (len(self.sections) < 2 or min(self.sections) < 1):
            raise ValueError(f"sections must be two or more positive sizes, got {self.sections}")

    def to_original(self, full: torch.Tensor) -> torch.Tensor:
        """The tessera full tensor in the original form (a new contiguous tensor)."""
        if self.sections:
            rows = self.original_shape[1] if self.transposed else self.original_shape[0]
            full = parts_in_turn(full.reshape(rows, -1), self.sections, dim=0)
        if self.transposed:
            rows, cols = self.original_shape
            return full.reshape(cols, rows).t().contiguous()
        return full.reshape(self.original_shape).clone()

    def from_original(self, original: torch.Tensor, full_shape: tuple[int, ...]) -> torch.Tensor:
        """The original tensor in tessera's full form ``full_shape``.

        Raises:
            ValueError: ``original`` does not have :attr:`original_shape`.
        """
        if tuple(original.shape) != self.original_shape:
            raise ValueError(
                f"expected the original shape {list(self.original_shape)}, got "
                f"{list(original.shape)}"
            )
        t = original.t() if self.transposed else original
        if self.sections:
            t = grouped(t.reshape(t.shape[0], -1), self.sections, dim=0)
        return t.reshape(full_shape)

    def to_json(self) -> dict[str, Any]:
        """The form as plain JSON (a checkpoint's ``state.json`` records it)."""
        return {
            "original_shape": list(self.original_shape),
            "transposed": self.transposed,
            "sections": list(self.sections),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FullForm:
        """The form :meth:`to_json` wrote."""
        return cls(
            tuple(int(s) for s in data["original_shape"]),
            bool(data["transposed"]),
            tuple(int(s) for s in data.get("sections", ())),
        )


def set_full_form(param: torch.Tensor, form: FullForm) -> None:
    """Record ``form`` on ``param`` (read by the full state dict functions and checkpoints)."""
    setattr(param, FULL_FORM_ATTR, form)


def get_full_form(param: torch.Tensor) -> FullForm | None:
    """The :class:`FullForm` recorded on ``param``, or ``None`` (the forms agree)."""
    form = getattr(param, FULL_FORM_ATTR, None)
    return form if isinstance(form, FullForm) else None


def parts_in_turn(x: torch.Tensor, sections: tuple[int, ...], dim: int = -1) -> torch.Tensor:
    """Features interleaved by group along ``dim`` -> the same features, part after part.

    ``x.shape[dim]`` may be any whole number of groups (a rank's share of the output).
    """
    groups = math.gcd(*sections)
    widths = [s // groups for s in sections]  # one group's features of each part
    moved = x.movedim(dim, -1)
    by_group = moved.reshape(
        *moved.shape[:-1], moved.shape[-1] // sum(widths), sum(widths)
    )  # [.., G', u]
    pieces = torch.split(by_group, widths, dim=-1)  # each [..., G', s_i/G]
    return torch.cat([p.flatten(-2) for p in pieces], dim=-1).movedim(-1, dim)


def grouped(x: torch.Tensor, sections: tuple[int, ...], dim: int = -1) -> torch.Tensor:
    """The inverse of :func:`parts_in_turn`: whole parts along ``dim`` -> interleaved by group."""
    groups = math.gcd(*sections)
    moved = x.movedim(dim, -1)
    pieces = torch.split(moved, list(sections), dim=-1)  # each [..., s_i]
    by_group = torch.cat(
        [p.reshape(*p.shape[:-1], groups, -1) for p in pieces], dim=-1
    )  # [.., G, u]
    return by_group.flatten(-2).movedim(-1, dim)
