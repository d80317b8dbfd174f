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
        if mode != "1d":
            wrong = torch.randn(*x.shape[:-1], x.shape[-1] + 1)
            out["linear width"] = _message(lambda: linear(wrong))
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
    if mode != "1d":
        assert "expected the local block to have size" in got["linear width"]
