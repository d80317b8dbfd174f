"""The planner's table: one row per layout, the fitting ones first."""

from __future__ import annotations

from collections.abc import Sequence

from .machine import Machine
from .rank import LayoutEstimate
from .shapes import ModelShape
from .units import format_bytes, format_seconds

__all__ = ["format_header", "format_rows"]

_COLUMNS = (
    ("#", ">3"),
    ("data", ">4"),
    ("pipe", ">4"),
    ("tensor", "<12"),
    ("zero", ">4"),
    ("ckpt", "<4"),
    ("mb", ">3"),
    ("params", ">10"),
    ("grads", ">10"),
    ("optim", ">10"),
    ("activ", ">10"),
    ("work", ">10"),
    ("total", ">10"),
    ("comm/step", ">10"),
    ("calls", ">6"),
    ("step", ">9"),
)


def format_header(
    shape: ModelShape, world: int, memory_budget: int, machine: Machine, dtype: str, source: str
) -> str:
    """What was planned: the model, the job and the machine model (``source`` says whence)."""
    model = (
        f"{shape.layers} layers, hidden {shape.hidden}, heads {shape.heads}, seq {shape.seq}, "
        f"vocab {shape.vocab}, batch {shape.batch}"
    )
    if shape.ffn != 4 * shape.hidden:
        model += f", ffn {shape.ffn}"
    if shape.key_value_heads != shape.heads:
        model += f", {shape.key_value_heads} key/value heads"
    kind = [
        "gated MLP" if shape.gated_mlp else "",
        "RMSNorm" if shape.norm == "rmsnorm" else "",
        "rotary" if shape.positions == "rotary" else "",
        _biases(shape),
        "untied head" if not shape.tied_head and shape.vocab else "",
    ]
    if any(kind):
        model += ", " + ", ".join(k for k in kind if k)
    return (
        f"model: {model} ({shape.parameters / 1e9:.2f} B parameters), {dtype}, Adam\n"
        f"job: {world} ranks, {format_bytes(memory_budget)} each\n"
        f"machine ({source}): {machine.flops:.3g} flop/s, {machine.bandwidth:.3g} B/s, "
        f"{machine.latency:.3g} s per collective, {machine.backend}"
    )


def format_rows(estimates: Sequence[LayoutEstimate], first: int = 1, why: bool = False) -> str:
    """A table of ``estimates`` numbered from ``first``; ``why`` adds the reasons column.

    Bytes are per rank (its peak; ``comm/step``: bytes it contributes to collectives in one
    step), ``mb`` the microbatches, ``calls`` its collective calls per step, ``step`` the
    estimated step time.
    """
    names = [name for name, _ in _COLUMNS] + (["why not"] if why else [])
    specs = [spec for _, spec in _COLUMNS] + (["<"] if why else [])
    lines = [_line(names, specs)]
    lines.append("-" * len(lines[0]))
    for i, e in enumerate(estimates, start=first):
        layout, memory = e.layout, e.memory
        cells = [
            str(i),
            str(layout.data),
            str(layout.pipeline),
            layout.tensor_name,
            str(layout.zero),
            "on" if layout.checkpoint else "off",
            str(e.microbatches),
            format_bytes(memory.parameters),
            format_bytes(memory.gradients),
            format_bytes(memory.optimizer),
            format_bytes(memory.activations),
            format_bytes(memory.workspace),
            format_bytes(memory.total),
            format_bytes(e.comm_bytes),
            str(e.collectives),
            format_seconds(e.step_seconds),
        ]
        if why:
            cells.append("; ".join(e.problems))
        lines.append(_line(cells, specs))
    return "\n".join(line.rstrip() for line in lines)


def _line(cells: Sequence[str], specs: Sequence[str]) -> str:
    return " ".join(f"{cell:{spec}}" for cell, spec in zip(cells, specs, strict=True))


def _biases(shape: ModelShape) -> str:
    """The header's word on biases: ``""`` (all), ``"no biases"``, or the layers that have one."""
    if shape.biases is True:
        return ""
    if not shape.biases:
        return "no biases"
    return f"biases on {', '.join(shape.biases)}"
