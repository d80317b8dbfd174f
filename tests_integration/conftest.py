"""The uninterrupted single-invocation run that the multi-node and elastic runs must match."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_jobs import WORLD, Final, final_line, finish, job_env, start, torchrun_command

#: Seconds one torchrun job may take on two busy cores (startup of 4 workers dominates).
JOB_TIMEOUT = 240.0


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Final:
    """One ``torchrun --standalone --nproc-per-node 4`` invocation, no checkpoints, no fault."""
    cwd: Path = tmp_path_factory.mktemp("reference")
    command = torchrun_command(["--standalone", f"--nproc-per-node={WORLD}"], [])
    code, output = finish(start(command, job_env(), cwd), JOB_TIMEOUT)
    assert code == 0, f"the reference run failed ({code}):\n{output[-6000:]}"
    return final_line(output)
