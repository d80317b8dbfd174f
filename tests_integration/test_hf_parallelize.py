"""A transformers model converted by ``parallelize`` trains under the engine like one process.

``examples/hf/train.py`` (transformers' own ``LlamaForCausalLM`` from a small config) under
torchrun: once on one process, once as 2D tensor parallelism on a 2x2 mesh and once as
sequence parallelism (ring attention through transformers' attention registry) on 2 ranks.
Same weights, same batches: every step's loss agrees with the single process to float
rounding, and each run's trained state dict loads back into the transformers class.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import JOB_TIMEOUT
from torchrun_jobs import ROOT, finish, job_env, start

pytest.importorskip("transformers")

HF = ROOT / "examples" / "hf"
STEPS = 6


def run(config: str, nproc: int, tmp_path: Path) -> dict[str, object]:
    """One torchrun job of ``examples/hf/train.py``; its JSON summary."""
    result = tmp_path / f"{config}.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(HF / "train.py"),
        "--config",
        str(HF / "configs" / f"{config}.py"),
        "--quiet",
        "--result",
        str(result),
        "--set=model.kind=llama",
        f"--set=train.steps={STEPS}",
    ]
    code, output = finish(start(command, job_env(), tmp_path), JOB_TIMEOUT)
    assert code == 0, f"{config} failed ({code}):\n{output[-6000:]}"
    assert "loads into LlamaForCausalLM (strict)" in output, output[-3000:]
    summary: dict[str, object] = json.loads(result.read_text())
    return summary


def test_llama_under_2d_and_sequence_matches_one_process(tmp_path: Path) -> None:
    """Every step's loss of 2D and sequence runs equals the single process's (1e-5 relative)."""
    single = run("single", 1, tmp_path)
    for config, nproc in (("2d", 4), ("sequence", 2)):
        got = run(config, nproc, tmp_path)
        assert got["steps"] == single["steps"] == STEPS
        losses, reference = got["losses"], single["losses"]
        assert isinstance(losses, list) and isinstance(reference, list)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        assert worst < 1e-5, f"{config}: losses {losses} vs one process {reference}"
