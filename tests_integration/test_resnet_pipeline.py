"""The seed's pipeline tutorial as its reader ports it (examples/resnet_pipeline/) runs.

One torchrun job of 2 ranks, 1F1B over 4 microbatches of a small BatchNorm ResNet: the script
itself compares each stage's parameters and BatchNorm statistics after 3 steps with one process
training the same model on the same microbatches, and exits non-zero if they drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import JOB_TIMEOUT
from torchrun_jobs import ROOT, finish, job_env, start


def test_the_pipeline_tutorial_matches_one_process(tmp_path: Path) -> None:
    """Both stages end within 1e-5 of one process (bitwise on CPU), as the script checks."""
    script = ROOT / "examples" / "resnet_pipeline" / "train.py"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
    ]
    code, output = finish(start(command, job_env(), tmp_path), JOB_TIMEOUT)
    assert code == 0, f"the tutorial's program failed ({code}):\n{output[-6000:]}"
    assert output.count("tensors of this stage vs one process") == 2, output[-3000:]
