"""Error rendering and pickling, without processes."""

from __future__ import annotations

import pickle

from tessera.testing import RankError, RankTimeoutError, free_port


def test_rank_error_lists_every_failure_and_unfinished_rank() -> None:
    err = RankError(
        "mod.fn",
        4,
        {2: "Traceback...\nValueError: b", 0: "Traceback...\nKeyError: a"},
        {0: KeyError("a"), 2: "ValueError('b')"},
        unfinished=[3, 1],
        stacks={1: 'File "x.py", line 3 in fn'},
    )
    text = str(err)
    assert text.startswith("2 of 4 rank(s) failed in mod.fn (failed ranks: [0, 2])")
    assert text.index("--- rank 0 traceback ---") < text.index("--- rank 2 traceback ---")
    assert "ranks [1, 3] had not finished" in text
    assert "--- rank 1 was at ---" in text
    clone = pickle.loads(pickle.dumps(err))
    assert str(clone) == text


def test_timeout_error_names_ranks() -> None:
    err = RankTimeoutError("mod.fn", 3, 2.5, [2, 0])
    assert isinstance(err, TimeoutError)
    assert err.finished == [1]
    assert "did not finish within 2.5 s on ranks [0, 2] of world size 3" in str(err)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_free_port_is_a_port() -> None:
    assert 0 < free_port() < 65536
