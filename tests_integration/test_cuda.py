"""The CUDA + NCCL path, on a machine with a GPU: one process per GPU, as on the CPU.

Every other test runs on CPU + gloo. On a machine with a GPU these run the examples under
torchrun with the backend tessera picks there (NCCL, ``cuda:<local_rank>``) and compare them
with the same job on the CPU (``CUDA_VISIBLE_DEVICES=""``): a tensor created on the wrong
device, an RNG state of the wrong generator or a checkpoint that does not load back onto the
GPU fails here. Without a GPU the module is skipped: CI machines have none.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import JOB_TIMEOUT
from torchrun_jobs import ROOT, final_line, finish, job_env, start

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HF_TRAIN = ROOT / "examples" / "hf" / "train.py"
HF_SINGLE = ROOT / "examples" / "hf" / "configs" / "single.py"
VIT_TRAIN = ROOT / "examples" / "vit" / "train.py"
VIT_SINGLE = ROOT / "examples" / "vit" / "configs" / "single.py"
STEPS = 10


def _torchrun(launcher: Sequence[str], script: Path, config: Path, *args: str) -> list[str]:
    """``python -m torch.distributed.run --standalone LAUNCHER SCRIPT --config CONFIG ARGS``."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", *launcher]
    return [*head, str(script), "--config", str(config), "--quiet", *args]


def _hf_run(tmp_path: Path, kind: str, env: dict[str, str], name: str) -> dict[str, object]:
    result = tmp_path / f"{name}.json"
    command = _torchrun(
        ["--nproc-per-node=1"],
        HF_TRAIN,
        HF_SINGLE,
        f"--result={result}",
        f"--set=model.kind={kind}",
        f"--set=train.steps={STEPS}",
    )
    code, output = finish(start(command, env, tmp_path), JOB_TIMEOUT)
    assert code == 0, f"{name} failed ({code}):\n{output[-6000:]}"
    loaded: dict[str, object] = json.loads(result.read_text())
    return loaded


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_transformers_model_trains_on_the_gpu_as_on_the_cpu(tmp_path: Path, kind: str) -> None:
    """The engine and `parallelize` on cuda:0 under NCCL give the CPU's losses (fp32)."""
    gpu = _hf_run(tmp_path, kind, job_env(), "gpu")
    cpu = _hf_run(tmp_path, kind, job_env(CUDA_VISIBLE_DEVICES=""), "cpu")
    assert gpu["device"] == "cuda:0" and cpu["device"] == "cpu", (gpu, cpu)
    gpu_losses, cpu_losses = gpu["losses"], cpu["losses"]
    assert isinstance(gpu_losses, list) and isinstance(cpu_losses, list)
    assert len(gpu_losses) == len(cpu_losses) == STEPS
    worst = max(abs(g - c) / abs(c) for g, c in zip(gpu_losses, cpu_losses, strict=True))
    assert worst < 1e-4, (worst, gpu_losses, cpu_losses)


def test_fp16_on_the_gpu_resumes_after_a_crash_to_the_same_loss(tmp_path: Path) -> None:
    """fp16 autocast with loss scaling, a checkpoint on the GPU, a restart: the same losses.

    The checkpoint holds CUDA tensors, the loss scaler's state and the CUDA generator's state;
    the restarted job must load them back onto the GPU and continue bitwise.
    """
    fp16 = ("--max-steps=6", "--set=fp16.mode=torch")
    plain = _torchrun(["--nproc-per-node=1"], VIT_TRAIN, VIT_SINGLE, *fp16)
    code, output = finish(start(plain, job_env(), tmp_path), JOB_TIMEOUT)
    assert code == 0, f"the uninterrupted fp16 run failed ({code}):\n{output[-6000:]}"
    reference = final_line(output)

    checkpoints = tmp_path / "checkpoints"
    crashing = _torchrun(
        ["--nproc-per-node=1", "--max-restarts=1"],
        VIT_TRAIN,
        VIT_SINGLE,
        *fp16,
        f"--checkpoint-dir={checkpoints}",
        "--checkpoint-interval=2",
        "--kill-rank=0",
        "--kill-at-step=3",
    )
    code, output = finish(start(crashing, job_env(), tmp_path), 2 * JOB_TIMEOUT)
    assert code == 0, f"the restarted fp16 run failed ({code}):\n{output[-6000:]}"
    assert "step_00000002: step 2, epoch 0, batch 2" in output, output[-6000:]
    assert final_line(output) == reference


def test_more_processes_than_gpus_is_a_clear_error_on_every_rank(tmp_path: Path) -> None:
    """NCCL needs one GPU per process: every rank says so at launch, none waits or hangs."""
    nproc = torch.cuda.device_count() + 1
    command = _torchrun([f"--nproc-per-node={nproc}"], HF_TRAIN, HF_SINGLE)
    code, output = finish(start(command, job_env(), tmp_path), JOB_TIMEOUT)
    assert code != 0
    expected = f"{nproc} processes on this node but it has {nproc - 1} CUDA device(s)"
    assert expected in output, output[-6000:]
