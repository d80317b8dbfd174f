"""Elastic restart: a rank killed mid-training, torchrun restarts, the run resumes exactly.

Under ``torchrun --max-restarts 1`` rank 1 calls ``os._exit`` after step 3 on the first
attempt (``--kill-rank 1 --kill-at-step 3``; torchrun sets ``TORCHELASTIC_RESTART_COUNT``).
The other ranks must not hang: they lose their peer (gloo reports the closed connection, the
collective timeout of ``--timeout`` bounds it otherwise) and torchrun stops them as soon as
one worker exits non-zero, then starts all four again. ``LoadCheckpointHook`` resumes from
``step_00000002`` (``--checkpoint-interval 2``), steps 3..6 are trained again, and the final
losses equal those of the uninterrupted run bitwise.
"""

from __future__ import annotations

import time
from pathlib import Path

from conftest import JOB_TIMEOUT
from torchrun_jobs import STEPS, WORLD, Final, final_line, finish, job_env, start, torchrun_command


def test_killed_rank_restarts_and_resumes_to_the_same_loss(
    reference: Final, tmp_path: Path
) -> None:
    """One restart, a resume from step 2, and the reference's final losses.

    Runs with torchrun's default rendezvous store, shared across restart attempts: the
    launcher must keep the dead attempt's keys apart from the new one's.
    """
    checkpoints = tmp_path / "checkpoints"
    command = torchrun_command(
        ["--standalone", f"--nproc-per-node={WORLD}", "--max-restarts=1"],
        [
            f"--checkpoint-dir={checkpoints}",
            "--checkpoint-interval=2",
            "--kill-rank=1",
            "--kill-at-step=3",
            "--timeout=30",  # also the rendezvous timeout: workers start unevenly on busy cores
            "--heartbeat=1.0",  # silent 4 s: a restarted worker may stall 2 s on busy cores
        ],
    )
    start_time = time.monotonic()
    code, output = finish(start(command, job_env(), tmp_path), 2 * JOB_TIMEOUT)
    seconds = time.monotonic() - start_time
    assert code == 0, f"the elastic job failed ({code}) after {seconds:.0f} s:\n{output[-6000:]}"
    assert output.count("fault injection: rank 1 exits after step 3") == 1, output[-6000:]
    assert "failed (exitcode: 17) local_rank: 1" in output, output[-6000:]
    assert "resumed from" in output and "step_00000002: step 2, epoch 0, batch 2" in output
    got = final_line(output)
    assert got.step == STEPS
    assert got == reference, f"restarted: {got}, uninterrupted: {reference}"
    # keep_last=2: the final two checkpoints of the second attempt
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000004", "step_00000006"]
