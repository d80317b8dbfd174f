import sys

import pytest

from tessera.pipeline import (
    Action,
    ActionKind,
    InterleavedPipelineSchedule,
    TimelineEvent,
    ZeroBubbleSchedule,
    plot_timeline,
    simulate,
)


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_plot_writes_a_file(tmp_path, suffix):
    result = simulate(ZeroBubbleSchedule(4), 2, {"F": 1, "B": 1, "W": 1})
    out = plot_timeline(result, tmp_path / f"zb{suffix}", title="ZB-H1 p=2 m=4")
    data = out.read_bytes()
    assert len(data) > 1000
    if suffix == ".png":
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
    else:
        assert b"<svg" in data


def test_plot_accepts_recorded_events_with_comm(tmp_path):
    events = [
        TimelineEvent(0.0, 0.01, 0, Action(ActionKind.F, 0)),
        TimelineEvent(0.01, 0.012, 0, Action(ActionKind.SEND_F, 0)),
        TimelineEvent(0.012, 0.02, 1, Action(ActionKind.F, 0, 1)),
    ]
    out = plot_timeline(events, tmp_path / "sub" / "run.png", time_unit="s")
    assert out.stat().st_size > 1000


def test_plot_interleaved(tmp_path):
    result = simulate(InterleavedPipelineSchedule(4, 2), 2)
    assert plot_timeline(result, tmp_path / "i.svg").stat().st_size > 1000


def test_plot_rejects_other_formats(tmp_path):
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        plot_timeline([], tmp_path / "t.pdf")


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"tessera-pipeline\[plot\]"):
        plot_timeline([], tmp_path / "t.png")


def test_timeline_event_checks_order():
    with pytest.raises(ValueError, match="ends before it starts"):
        TimelineEvent(2.0, 1.0, 0, Action(ActionKind.F, 0))
    assert TimelineEvent(1.0, 2.5, 0, Action(ActionKind.F, 0)).duration == 1.5
