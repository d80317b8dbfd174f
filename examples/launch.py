"""Run an example under torchrun in a subprocess and read back its result (demo, convergence)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["EXAMPLES", "run_example"]

EXAMPLES = Path(__file__).resolve().parent


def run_example(
    script: str,
    config: str,
    nproc: int,
    result: Path,
    overrides: Sequence[str] = (),
    quiet: bool = False,
) -> dict[str, Any]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N script --config ...``.

    The child's output goes straight to this terminal (progress bars included). Returns the
    JSON the script wrote to ``result``, plus ``wall_seconds`` (launch included).
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(EXAMPLES / script),
        "--config",
        str(EXAMPLES / config),
        "--result",
        str(result),
        *(f"--set={o}" for o in overrides),
        *(["--quiet"] if quiet else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    result.unlink(missing_ok=True)
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env)
    summary: dict[str, Any] = json.loads(result.read_text())
    summary["wall_seconds"] = time.perf_counter() - start
    return summary
