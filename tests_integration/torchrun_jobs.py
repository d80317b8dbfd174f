"""Start the ViT example under torchrun in a subprocess, bounded in time, and read its result.

The integration tests run real ``torchrun`` jobs (one or two invocations, restarts included),
so every call has a wall-clock limit: on expiry the whole process group of the launcher (its
agent and every worker) is killed and the test fails with the output so far, never a hang.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "vit" / "train.py"
#: The 4-rank hybrid: pipeline 2 (1F1B) x 1D tensor 2.
CONFIG = ROOT / "examples" / "vit" / "configs" / "pipeline_1d.py"
WORLD = 4
STEPS = 6  # --max-steps: the lr schedule is the config's (66 steps), only the run is short

FINAL = re.compile(r"^final: step (\d+) loss (\S+) test_loss (\S+)$", re.MULTILINE)


@dataclass(frozen=True)
class Final:
    """The display rank's last line: ``final: step N loss L test_loss T``."""

    step: int
    loss: float
    test_loss: float


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def job_env(**extra: str) -> dict[str, str]:
    """This environment, one thread per worker, unbuffered output, plus ``extra``."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def torchrun_command(launcher_args: Sequence[str], script_args: Sequence[str]) -> list[str]:
    """``python -m torch.distributed.run LAUNCHER_ARGS train.py --config ... SCRIPT_ARGS``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher_args,
        str(TRAIN),
        "--config",
        str(CONFIG),
        "--quiet",
        "--max-steps",
        str(STEPS),
        *script_args,
    ]


def start(command: Sequence[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    """Start ``command`` in its own session, so a timeout can kill all of its workers."""
    return subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """Wait at most ``timeout`` seconds; on expiry kill the whole session and raise."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(
            f"torchrun did not finish within {timeout:g} s (killed); output:\n{output[-6000:]}"
        ) from None
    return process.returncode, output


def final_line(output: str) -> Final:
    """The ``final:`` line of a job's output; fails naming the output when there is none."""
    found = FINAL.findall(output)
    assert len(found) == 1, f"expected one 'final:' line, got {len(found)}:\n{output[-6000:]}"
    step, loss, test_loss = found[0]
    return Final(int(step), float(loss), float(test_loss))
