"""Inputs of the wrong dtype, device or size: errors naming the layer, expected and actual.

One context per mode (1D on 2 ranks, 2D on 4, 3D on 8); each body feeds bad inputs to a few
layers and returns the messages; nothing reaches a collective, so every rank raises alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tessera.layers as L
from tessera.context import create_context

SIZES = {"1d": 2, "2d": 4, "3d": 8}


def _message(fn: Any) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _bad_inputs(mode: str) -> dict[str, str]:
    parallel = {"tensor": {"size": SIZES[mode], "mode": mode}}
    ctx = create_context({"parallel": parallel}, timeout=60, heartbeat_interval=0)
    try:
        kind = {"parallel": "col"} if mode != "2d" else {}
        linear = L.Linear(8, 8, context=ctx, **kind)
        norm = L.LayerNorm(8, context=ctx)
        embedding = L.Embedding(16, 8, context=ctx)
        x = L.split_activation(torch.randn(8, 2, 8), context=ctx)
        ids = L.split_batch(torch.randint(0, 16, (8, 2)), context=ctx)
        out = {
            "linear ok": _message(lambda: linear(x)),
            "embedding ok": _message(lambda: embedding(ids)),
            "linear float64": _message(lambda: linear(x.double())),
            "linear ids": _message(lambda: linear(ids)),
            "linear meta": _message(lambda: linear(x.to("meta"))),
            "norm float16": _message(lambda: norm(x.half())),
            "embedding float": _message(lambda: embedding(ids.float())),
            "shape": str(list(x.shape)),
        }
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out["linear autocast"] = _message(lambda: linear(x))
        wrong = torch.randn(*x.shape[:-1], x.shape[-1] + 1)
        out["linear width"] = _message(lambda: linear(wrong))
        out["wrong shape"] = str(list(wrong.shape))
        if mode == "1d":  # what a row-parallel layer, and the heads, expect
            row = L.Linear(8, 8, parallel="row", context=ctx)
            whole = L.Linear(8, 8, parallel="row", parallel_input=False, context=ctx)
            out["row full"] = _message(lambda: row(x))  # the whole input where a split is due
            out["row ok"] = _message(lambda: row(x[..., :4]))
            out["row whole"] = _message(lambda: whole(x[..., :4]))
            for vocab in (False, True):
                head = L.Classifier(8, 6 if not vocab else 4, vocab_parallel=vocab, context=ctx)
                out[f"head {vocab}"] = _message(lambda h=head: h(wrong))  # type: ignore[misc]
        return out
    finally:
        ctx.destroy()


@pytest.mark.parametrize("mode", ["1d", "2d", "3d"])
def test_wrong_inputs_name_the_layer_and_what_was_expected(dist: Any, mode: str) -> None:
    results = dist.run(_bad_inputs, world_size=SIZES[mode], args=(mode,), timeout=240)
    assert all(r == results[0] for r in results)  # every rank raises alike
    got = results[0]
    shape = got["shape"]
    assert got["linear ok"] == "no error" and got["embedding ok"] == "no error"
    assert got["linear autocast"] == "no error"
    assert (
        f"input {shape} float64 on cpu has dtype float64, expected float32"
        in (got["linear float64"])
    )
    assert "has dtype int64, expected float32" in got["linear ids"]
    assert "is on device meta, but the layer's parameters are on cpu" in got["linear meta"]
    assert (
        f"input {shape} float16 on cpu has dtype float16, expected float32" in (got["norm float16"])
    )
    assert "must hold integer indices (int64 or int32)" in got["embedding float"]
    for key in ("linear float64", "linear meta", "norm float16", "embedding float"):
        assert got[key].split(":")[0].strip(), key  # starts with the layer's class name
    width = got["linear width"]  # the layer, the expected size and its arithmetic, the shape
    wrong = f"got shape {got['wrong shape']}"
    if mode == "1d":
        assert width == (
            "Linear1DCol(8, 8): expected the input's last dim to be in_features = 8 (a "
            f"column-parallel input holds every feature), {wrong}"
        )
        assert got["row ok"] == "no error"
        assert got["row full"] == (
            "Linear1DRow(8, 8): expected the input's last dim to be in_features 8 / tensor size "
            "2 = 4 (a row-parallel input is split along its features, e.g. the output of a "
            "column-parallel layer; pass parallel_input=False to give the whole input), got "
            f"shape {shape}"
        )
        assert got["row whole"].startswith(
            "Linear1DRow(8, 8): expected the input's last dim to be in_features = 8 "
            "(parallel_input=False: the whole input), got shape"
        )
        assert got["head False"].startswith("Classifier1D(8, 6): expected the input's last dim")
        assert got["head True"].startswith("VocabParallelClassifier1D(8, 4): expected the input")
        assert all(wrong in got[f"head {v}"] for v in (False, True))
    else:
        name = "Linear2D" if mode == "2d" else "Linear3D"
        assert width.startswith(
            f"{name}(8, 8): expected the input's last dim to be in_features 8 / q 2 = 4 (the "
            f"local block of a {mode} activation"
        )
        assert width.endswith(wrong)
