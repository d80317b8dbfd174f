"""Drawing a timeline (simulated or recorded) as a PNG or SVG Gantt chart.

Needs matplotlib, the optional extra ``tessera-pipeline[plot]``; it is imported only when a plot
is drawn. No pyplot and no global backend switch: the figure is drawn with the Agg canvas
directly, so this works on machines without a display and leaves the user's backend alone.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from tessera.pipeline.actions import ActionKind
from tessera.pipeline.simulator import SimulationResult
from tessera.pipeline.timeline import TimelineEvent, timeline_span

__all__ = ["plot_timeline"]

# One colour per kind; chunks are told apart by shade (later chunks lighter).
_COLOURS = {
    ActionKind.F: (0.20, 0.45, 0.75),
    ActionKind.B: (0.25, 0.60, 0.30),
    ActionKind.W: (0.90, 0.55, 0.15),
}
_COMM_COLOUR = (0.55, 0.55, 0.55)


def _shade(colour: tuple[float, float, float], chunk: int, num_chunks: int) -> tuple[float, ...]:
    mix = 0.55 * chunk / max(num_chunks - 1, 1)
    return tuple(c + (1.0 - c) * mix for c in colour)


def _load_matplotlib() -> tuple[Any, Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(
            "plot_timeline needs matplotlib; install it with: pip install 'tessera-pipeline[plot]'"
        ) from exc
    return Figure, FigureCanvasAgg, Patch


def plot_timeline(
    source: SimulationResult | Sequence[TimelineEvent],
    path: str | pathlib.Path,
    title: str | None = None,
    *,
    num_stages: int | None = None,
    time_unit: str = "time",
) -> pathlib.Path:
    """Draw one row per pipeline rank (rank 0 on top), one bar per action, and save it.

    Compute bars are coloured by kind (F blue, B green, W orange; later chunks lighter) and
    labelled with the microbatch (``3`` or ``3:1`` for chunk 1); communication events, when a
    recorded timeline has them, are thin grey bars along the bottom of the row. Gaps are bubbles.

    Args:
        source: a :class:`SimulationResult` or timeline events (e.g. recorded by the executor).
        path: output file; the format follows the suffix (``.png`` or ``.svg``).
        title: figure title.
        num_stages: rows to draw; defaults to the result's stage count or the highest rank + 1.
        time_unit: label of the time axis (e.g. ``"s"`` for a recorded run).

    Returns:
        ``path`` as a Path.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: the suffix is neither ``.png`` nor ``.svg``.
    """
    out = pathlib.Path(path)
    if out.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"plot_timeline writes .png or .svg files, got {out.name!r}")
    if isinstance(source, SimulationResult):
        events: Sequence[TimelineEvent] = source.timeline
        rows = source.num_stages if num_stages is None else num_stages
    else:
        events = list(source)
        rows = (
            num_stages if num_stages is not None else 1 + max((e.rank for e in events), default=0)
        )
    figure_cls, canvas_cls, patch_cls = _load_matplotlib()
    begin, finish = timeline_span(events)
    num_chunks = 1 + max((e.action.chunk for e in events), default=0)

    figure = figure_cls(
        figsize=(max(6.0, min(24.0, 0.35 * len(events) / max(rows, 1) + 4)), 0.6 * rows + 1.2)
    )
    canvas_cls(figure)
    axes = figure.add_subplot(1, 1, 1)
    span = max(finish - begin, 1e-12)
    for event in events:
        kind = event.action.kind
        y = rows - 1 - event.rank
        if kind.is_compute:
            colour = _shade(_COLOURS[kind], event.action.chunk, num_chunks)
            axes.barh(
                y,
                event.duration,
                left=event.start - begin,
                height=0.8,
                color=colour,
                edgecolor="black",
                linewidth=0.4,
            )
            if event.duration > 0.02 * span:
                label = str(event.action.microbatch)
                if event.action.chunk:
                    label += f":{event.action.chunk}"
                axes.text(
                    event.start - begin + event.duration / 2,
                    y,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        else:
            axes.barh(
                y - 0.35, event.duration, left=event.start - begin, height=0.1, color=_COMM_COLOUR
            )
    axes.set_yticks(range(rows))
    axes.set_yticklabels([f"rank {rows - 1 - y}" for y in range(rows)])
    axes.set_xlim(0, span)
    axes.set_ylim(-0.6, rows - 0.4)
    axes.set_xlabel(time_unit)
    handles = [
        patch_cls(facecolor=_COLOURS[kind], edgecolor="black", linewidth=0.4, label=kind.value)
        for kind in (ActionKind.F, ActionKind.B, ActionKind.W)
        if any(e.action.kind is kind for e in events)
    ]
    if handles:
        axes.legend(handles=handles, loc="center left", bbox_to_anchor=(1.005, 0.5), fontsize=8)
    if title:
        axes.set_title(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, bbox_inches="tight")
    return out
