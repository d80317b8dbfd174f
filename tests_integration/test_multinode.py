"""Multi-node: two torchrun invocations on loopback train like one invocation with all ranks.

Each invocation is one "node" of 2 workers (``--nnodes 2 --nproc-per-node 2``); they meet
through torchrun's c10d rendezvous on 127.0.0.1, which hands out global ranks 0..3 and the
store tessera's launcher builds its groups on. The job is the 4-rank hybrid (pipeline 2 x 1D
tensor 2), so the pipeline's point-to-point traffic and the tensor all-reduces both cross the
"node" boundary or not depending on the rank order the rendezvous picks: the result must not
depend on it.
"""

from __future__ import annotations

from pathlib import Path

from conftest import JOB_TIMEOUT
from torchrun_jobs import (
    STEPS,
    WORLD,
    Final,
    final_line,
    finish,
    free_port,
    job_env,
    start,
    torchrun_command,
)

NODES = 2


def test_two_invocations_match_one(reference: Final, tmp_path: Path) -> None:
    """Both nodes exit 0, and the final training and test losses equal the reference bitwise."""
    launcher = [
        f"--nnodes={NODES}",
        f"--nproc-per-node={WORLD // NODES}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id=tessera-multinode-{tmp_path.name}",
    ]
    nodes = [start(torchrun_command(launcher, []), job_env(), tmp_path) for _ in range(NODES)]
    outputs = []
    for node, process in enumerate(nodes):
        code, output = finish(process, JOB_TIMEOUT)
        assert code == 0, f"node {node} failed ({code}):\n{output[-6000:]}"
        outputs.append(output)
    got = final_line("\n".join(outputs))  # printed by the display rank, on one of the nodes
    assert got.step == STEPS
    assert got == reference, f"two nodes: {got}, one invocation: {reference}"
