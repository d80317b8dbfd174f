"""How one step's forward and backward run: the ``StepSchedule`` interface and its makers.

The Engine calls every schedule the same way, two methods and no flags::

    output, label, loss = schedule.train_step(stage, data_iter, loss_fn, keep_outputs=True)
    output, label, loss = schedule.eval_step(stage, data_iter, loss_fn, keep_outputs=True)

``stage`` is what runs the forward (a module, a list of model chunks, or the Engine itself);
``loss_fn(output, label)`` returns the loss to backpropagate (the Engine passes one that
applies its loss scaling and gradient-accumulation factor); ``eval_step`` takes ``None`` for no
loss. :class:`NonPipelineSchedule` is the one-forward-one-backward schedule of every job
without pipeline parallelism; :class:`tessera.pipeline.PipelineRunner` runs a pipeline plan
(1F1B, interleaved, GPipe, zero bubble) through the same two methods. :func:`as_step_schedule`
turns what a user or a config gives (a runner, a pipeline plan, an object of the older
``forward_backward_step`` interface) into one of these.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from tessera.context import ParallelContext
from tessera.pipeline import PipelineRunner, Schedule

__all__ = [
    "LossFn",
    "NonPipelineSchedule",
    "StepSchedule",
    "as_step_schedule",
    "split_batch",
    "run_forward",
]

#: ``loss_fn(output, label) -> loss``.
LossFn = Callable[[Any, Any], torch.Tensor]

#: ``(output, label, loss)``, each possibly None.
StepResult = tuple[Any, Any, torch.Tensor | None]


@runtime_checkable
class StepSchedule(Protocol):
    """Anything that runs one step's forwards (and backwards) over a data iterator."""

    def train_step(
        self, stage: Any, data_iter: Iterator[Any], loss_fn: LossFn, *, keep_outputs: bool = True
    ) -> StepResult:
        """Forward, loss and backward of the next batch; ``(output, label, loss)``.

        ``output`` and ``label`` are None unless ``keep_outputs``; ``loss`` is detached.
        """
        ...

    def eval_step(
        self,
        stage: Any,
        data_iter: Iterator[Any],
        loss_fn: LossFn | None,
        *,
        keep_outputs: bool = True,
    ) -> StepResult:
        """Forward (and loss, when ``loss_fn`` is given) of the next batch, no graph kept."""
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


def _kept(output: Any, label: Any, keep_outputs: bool) -> tuple[Any, Any]:
    if not keep_outputs:
        return None, None
    return (output.detach() if isinstance(output, torch.Tensor) else output), label


class NonPipelineSchedule:
    """One forward and one backward over the whole batch, on one rank's whole model.

    The schedule of every job without pipeline parallelism (data, tensor, sequence parallel or
    a single process).
    """

    def train_step(
        self, stage: Any, data_iter: Iterator[Any], loss_fn: LossFn, *, keep_outputs: bool = True
    ) -> StepResult:
        """Run the forward on the next batch, the loss and its backward.

        Returns:
            ``(output, label, loss)``: ``output`` and ``label`` are None unless
            ``keep_outputs``; ``loss`` is detached.
        """
        inputs, label = split_batch(next(data_iter))
        output = run_forward(stage, inputs)
        loss = loss_fn(output, label)
        torch.autograd.backward(loss)
        output, label = _kept(output, label, keep_outputs)
        return output, label, loss.detach()

    def eval_step(
        self,
        stage: Any,
        data_iter: Iterator[Any],
        loss_fn: LossFn | None,
        *,
        keep_outputs: bool = True,
    ) -> StepResult:
        """Run the forward (and the loss, with a ``loss_fn``) under ``torch.no_grad``.

        No graph is kept and the gradients are untouched.
        """
        inputs, label = split_batch(next(data_iter))
        with torch.no_grad():
            output = run_forward(stage, inputs)
            loss = loss_fn(output, label) if loss_fn is not None else None
        output, label = _kept(output, label, keep_outputs)
        return output, label, loss


class _ForwardBackwardStep:
    """An object of the older interface, seen through the new one.

    The older interface: ``forward_backward_step(stage, data_iter, loss_fn, forward_only,
    return_loss, return_output_label)``.
    """

    def __init__(self, inner: Any, context: ParallelContext | None) -> None:
        self.inner = inner
        # such an object found its groups through a ``context`` keyword, when it took one
        self._extra = {"context": context} if _accepts_keyword(inner, "context") else {}

    def train_step(
        self, stage: Any, data_iter: Iterator[Any], loss_fn: LossFn, *, keep_outputs: bool = True
    ) -> StepResult:
        result: StepResult = self.inner.forward_backward_step(
            stage, data_iter, loss_fn, False, True, keep_outputs, **self._extra
        )
        return result

    def eval_step(
        self,
        stage: Any,
        data_iter: Iterator[Any],
        loss_fn: LossFn | None,
        *,
        keep_outputs: bool = True,
    ) -> StepResult:
        given: LossFn = loss_fn if loss_fn is not None else _no_loss
        result: StepResult = self.inner.forward_backward_step(
            stage, data_iter, given, True, loss_fn is not None, keep_outputs, **self._extra
        )
        return result

    def __getattr__(self, name: str) -> Any:  # the wrapped object's own attributes
        return getattr(self.inner, name)


def _accepts_keyword(inner: Any, name: str) -> bool:
    try:
        params = inspect.signature(inner.forward_backward_step).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _no_loss(output: Any, label: Any) -> torch.Tensor:
    raise RuntimeError("no loss_fn was given for this evaluation step")


def as_step_schedule(schedule: Any, context: ParallelContext | None = None) -> StepSchedule:
    """What the Engine runs for ``schedule``.

    Args:
        schedule: None (one forward, one backward: :class:`NonPipelineSchedule`); an object
            with ``train_step`` and ``eval_step`` (used as it is); a pipeline plan,
            :class:`tessera.pipeline.Schedule` (run by a :class:`tessera.pipeline.PipelineRunner`
            on ``context``); or an object of the older ``forward_backward_step`` interface (run
            through it, with a ``DeprecationWarning``).
        context: the parallel context a pipeline plan runs on (None: the current one).

    Raises:
        TypeError: ``schedule`` is none of these; the message names what is missing.
    """
    if schedule is None:
        return NonPipelineSchedule()
    if isinstance(schedule, Schedule):
        return PipelineRunner(schedule, context=context)
    if callable(getattr(schedule, "train_step", None)) and callable(
        getattr(schedule, "eval_step", None)
    ):
        return schedule  # type: ignore[no-any-return]
    if callable(getattr(schedule, "forward_backward_step", None)):
        warnings.warn(
            f"{type(schedule).__name__} offers only forward_backward_step(stage, data_iter, "
            "loss_fn, forward_only, return_loss, return_output_label); give it train_step("
            "stage, data_iter, loss_fn, *, keep_outputs) and eval_step(stage, data_iter, "
            "loss_fn, *, keep_outputs) instead, the interface the Engine calls",
            DeprecationWarning,
            stacklevel=3,
        )
        return _ForwardBackwardStep(schedule, context)
    raise TypeError(
        f"a schedule must be a tessera.pipeline.Schedule or offer train_step(stage, data_iter, "
        f"loss_fn, *, keep_outputs) and eval_step(...); {type(schedule).__name__} has neither"
    )
