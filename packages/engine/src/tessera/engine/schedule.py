"""How one step's forward and backward run: the ``Schedule`` interface and the plain schedule.

The Engine calls every schedule the same way, so a pipeline schedule of tessera.pipeline
(``PipelineSchedule``, ``InterleavedPipelineSchedule``, ...), ``NonPipelineSchedule`` and a
user's own object plug in alike::

    output, label, loss = schedule.forward_backward_step(
        stage, data_iter, loss_fn, forward_only=False, return_loss=True,
        return_output_label=True)

``stage`` is what runs the forward (a module, a list of model chunks, or the Engine itself);
``loss_fn(output, label)`` returns the loss to backpropagate (the Engine passes one that
applies its loss scaling and gradient-accumulation factor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["LossFn", "NonPipelineSchedule", "StepSchedule", "split_batch", "run_forward"]

#: ``loss_fn(output, label) -> loss``.
LossFn = Callable[[Any, Any], torch.Tensor]


@runtime_checkable
class StepSchedule(Protocol):
    """Anything that runs one step's forward (and backward) over a data iterator."""

    def forward_backward_step(
        self,
        stage: Any,
        data_iter: Iterator[Any],
        loss_fn: LossFn,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, torch.Tensor | None]:
        """Run one step; return ``(output, label, loss)`` (each may be ``None``)."""
        ...


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, labels)`` of one batch: a pair, or a dict with ``"label"``/``"labels"``.

    Raises:
        ValueError: the batch is neither.
    """
    if isinstance(batch, Mapping):
        for key in ("label", "labels"):
            if key in batch:
                inputs = {k: v for k, v in batch.items() if k != key}
                return inputs, batch[key]
        raise ValueError(f"a dict batch needs a 'label' or 'labels' key, got keys {sorted(batch)}")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        "a batch must be (inputs, labels) or a dict with a 'label' key, got "
        f"{type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def run_forward(stage: Callable[..., Any], inputs: Any) -> Any:
    """Call ``stage`` on ``inputs``.

    A tensor as one argument, a tuple/list as positional
    arguments, a dict as keyword arguments.
    """
    if isinstance(inputs, Mapping):
        return stage(**inputs)
    if isinstance(inputs, (tuple, list)):
        return stage(*inputs)
    return stage(inputs)


class NonPipelineSchedule:
    """One forward and one backward over the whole batch, on one rank's whole model.

    The schedule of every job without pipeline parallelism (data, tensor, sequence parallel or
    a single process).
    """

    def forward_backward_step(
        self,
        stage: Any,
        data_iter: Iterator[Any],
        loss_fn: LossFn,
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> tuple[Any, Any, torch.Tensor | None]:
        """Run the forward on the next batch, the loss and (unless ``forward_only``) backward.

        Returns:
            ``(output, label, loss)``: ``output`` and ``label`` are ``None`` unless
            ``return_output_label``; ``loss`` (detached) is ``None`` unless ``return_loss``.
            With ``forward_only`` no graph is kept and the gradients are untouched.
        """
        inputs, label = split_batch(next(data_iter))
        loss: torch.Tensor | None = None
        if forward_only:
            with torch.no_grad():
                output = run_forward(stage, inputs)
                if return_loss:
                    loss = loss_fn(output, label)
        else:
            output = run_forward(stage, inputs)
            loss = loss_fn(output, label)
            torch.autograd.backward(loss)
        if not return_output_label:
            output, label = None, None
        elif isinstance(output, torch.Tensor):
            output = output.detach()
        return output, label, (loss.detach() if (return_loss and loss is not None) else None)
