from __future__ import annotations

import time

import pytest
from engine_testlib import LogCapture

from tessera.engine import MultiTimer, Timer, get_dist_logger


def test_timer_accumulates_and_rejects_misuse() -> None:
    t = Timer(synchronize=False)
    with pytest.raises(RuntimeError, match="without start"):
        t.stop()
    t.start()
    time.sleep(0.01)
    first = t.stop()
    t.start()
    with pytest.raises(RuntimeError, match="twice"):
        t.start()
    t.stop()
    assert first >= 0.009
    assert t.count == 2
    assert t.elapsed() >= first
    assert t.mean() == pytest.approx(t.elapsed() / 2)
    t.reset()
    assert t.count == 0 and t.elapsed() == 0.0


def test_multitimer_named_and_disabled() -> None:
    timers = MultiTimer(synchronize=False)
    with timers.time("fwd"):
        time.sleep(0.005)
    with timers.time("fwd"):
        pass
    assert timers.names() == ["fwd"]
    assert timers.get("fwd").count == 2
    assert timers.summary()["fwd"] >= 0.004
    off = MultiTimer(enabled=False)
    with off.time("x"):
        pass
    assert off.stop("x") == 0.0
    assert off.names() == []


def test_dist_logger_writes_on_chosen_ranks_only() -> None:
    logger = get_dist_logger("tessera-test-logger")
    assert get_dist_logger("tessera-test-logger") is logger
    cap = LogCapture()
    logger.logger.addHandler(cap)
    logger.info("default ranks")  # this process is rank 0: written
    logger.info("other rank", ranks=[1])  # not this rank: dropped
    logger.warning("all ranks", ranks=None)
    get_dist_logger("tessera-test-logger", ranks=[3])
    logger.info("now rank 3 only")
    assert cap.messages == ["default ranks", "[rank 0] all ranks"]


def test_disable_existing_loggers_quiets_other_libraries_only() -> None:
    import logging

    from tessera.engine import disable_existing_loggers

    other, child = logging.getLogger("seedlib"), logging.getLogger("seedlib.io")
    ours = logging.getLogger("tessera.seed-test")
    saved = {
        name: lg.level
        for name, lg in logging.root.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
    }
    try:
        for lg in (other, child, ours):
            lg.setLevel(logging.INFO)
        disable_existing_loggers(include=["seedlib.io"])
        assert (other.level, child.level) == (logging.INFO, logging.WARNING)
        disable_existing_loggers()
        assert other.level == logging.WARNING and not other.isEnabledFor(logging.INFO)
        assert ours.level == logging.INFO  # tessera's own are excluded
        assert logging.getLogger("seedlib.later").level == logging.NOTSET  # made afterwards
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
        for lg in (other, child, ours):
            lg.setLevel(logging.NOTSET)
