"""``PipelineChunks``: a rank's model chunks under the interleaved schedule, usable as a model.

``build_pipeline_model(..., num_chunks=v)`` gives a rank ``v`` stages. Colossal-AI returned them
as an ``nn.ModuleList``, so a training script's next line, ``Adam(model.parameters())``, worked;
tessera returned a plain list, and that line failed with no hint. An ``nn.ModuleList`` here
would break every caller that tells one stage from its chunks with ``isinstance(model,
nn.Module)`` (the engine, the runner, checkpoints, users' loops), and would name parameters
``"0.3.weight"`` instead of the full model's ``"3.weight"``. So the chunks stay a list, chunk 0
first, and answer the ``nn.Module`` calls a script makes on a model: ``parameters``,
``named_parameters`` (the full model's names), ``buffers``, ``state_dict``, ``train``,
``eval``, ``to``, ``zero_grad``; ``as_module_list()`` gives a real ``nn.ModuleList``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .stage import PipelineStage

__all__ = ["PipelineChunks"]


class PipelineChunks(list["PipelineStage"]):
    """This rank's chunks (``PipelineStage`` modules), chunk 0 first.

    Chunks hold disjoint layers named as in the full model, so their parameter and state-dict
    names never collide; a tensor two chunks share is yielded once, as ``nn.Module`` does.
    """

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Every chunk's parameters under the full model's names."""
        seen: set[int] = set()
        for chunk in self:
            for name, p in chunk.named_parameters(prefix, recurse, remove_duplicate):
                if remove_duplicate and id(p) in seen:
                    continue
                seen.add(id(p))
                yield name, p

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Every chunk's parameters (what an optimizer is built on)."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every chunk's buffers under the full model's names."""
        seen: set[int] = set()
        for chunk in self:
            for name, b in chunk.named_buffers(prefix, recurse, remove_duplicate):
                if remove_duplicate and id(b) in seen:
                    continue
                seen.add(id(b))
                yield name, b

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        """Every chunk's buffers (BatchNorm's running statistics...)."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def state_dict(self) -> dict[str, Any]:
        """The chunks' state dicts merged: a subset of the full model's keys."""
        merged: dict[str, Any] = OrderedDict()
        for chunk in self:
            merged.update(chunk.state_dict())
        return merged

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Load each chunk's keys from ``state`` (e.g. :meth:`state_dict`'s output).

        Raises:
            RuntimeError: under ``strict``, a key of ``state`` that no chunk holds, or a
                chunk's missing key (torch's own message names it).
        """
        owned: set[str] = set()
        for chunk in self:
            keys = chunk.state_dict().keys()
            owned.update(keys)
            chunk.load_state_dict({k: state[k] for k in keys if k in state}, strict=strict)
        extra = sorted(set(state) - owned)
        if strict and extra:
            raise RuntimeError(
                f"PipelineChunks.load_state_dict: keys {extra[:5]} are in no chunk of this rank"
            )

    def train(self, mode: bool = True) -> PipelineChunks:
        """Every chunk to training mode (or evaluation with ``mode=False``)."""
        for chunk in self:
            chunk.train(mode)
        return self

    def eval(self) -> PipelineChunks:
        """Every chunk to evaluation mode."""
        return self.train(False)

    def to(self, *args: Any, **kwargs: Any) -> PipelineChunks:
        """Move or cast every chunk (``nn.Module.to``'s arguments)."""
        for chunk in self:
            chunk.to(*args, **kwargs)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every chunk's gradients."""
        for chunk in self:
            chunk.zero_grad(set_to_none)

    def as_module_list(self) -> nn.ModuleList:
        """The chunks in an ``nn.ModuleList`` (parameter names then gain a ``"<chunk>."``)."""
        return nn.ModuleList(self)
