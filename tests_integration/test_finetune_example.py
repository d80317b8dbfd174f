"""examples/finetune/ from a checkpoint folder to a checkpoint folder equals one process.

A small GPT-2 and its locally trained tokenizer (examples/finetune/make_checkpoint.py) stand in
for a download. The script fine-tunes it on the standard library's sources in one process,
under 2D (stopped after 2 of 4 steps and resumed by a second job, as a preempted run is) and
under data x pipeline x 1D (8 ranks); each job checks that ``from_pretrained`` of its saved
folder measures the run's eval perplexity, and here the folders' tensors are compared with the
single-process fine-tune's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import JOB_TIMEOUT
from torchrun_jobs import ROOT, finish, job_env, start

EXAMPLE = ROOT / "examples" / "finetune"
#: A short run: 4 steps of 8 windows of 32 tokens, a checkpoint every 2 steps.
SETTINGS = (
    "train.steps=4",
    "train.batch_size=8",
    "train.checkpoint_interval=2",
    "train.log_interval=2",
    "data.seq_len=32",
    "data.max_chars=40000",
    "data.eval_windows=8",
)


@pytest.fixture(scope="module")
def downloaded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in download: config, safetensors and tokenizer files."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        from make_checkpoint import make_checkpoint
    finally:
        sys.path.remove(str(EXAMPLE))
    return make_checkpoint(tmp_path_factory.mktemp("download") / "gpt2", positions=32)


def _finetune(config: str, ranks: int, folder: Path, out: Path, *extra: str) -> str:
    """One torchrun job of the example; its output (the job must succeed)."""
    overrides = [f"checkpoint={folder}", f"output={out}", *SETTINGS, *extra]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        str(EXAMPLE / "finetune.py"),
        "--config",
        str(EXAMPLE / "configs" / f"{config}.py"),
        "--quiet",
        "--result",
        str(out / "result.json"),
        *(arg for item in overrides for arg in ("--set", item)),
    ]
    code, output = finish(start(command, job_env(), out.parent), JOB_TIMEOUT)
    assert code == 0, f"the {config} fine-tune failed ({code}):\n{output[-6000:]}"
    return output


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def single(downloaded: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same fine-tune in one process; its run folder."""
    out = tmp_path_factory.mktemp("single") / "run"
    output = _finetune("single", 1, downloaded, out)
    assert "tokens/s" in output and "MFU" in output, output[-3000:]
    assert "from_pretrained" in output, output[-3000:]
    return out


@pytest.mark.parametrize(
    ("config", "ranks", "stop_after"), [("2d", 4, 2), ("data_pipeline_1d", 8, None)]
)
def test_a_parallel_finetune_saves_the_single_process_weights(
    config: str, ranks: int, stop_after: int | None, downloaded: Path, single: Path, tmp_path: Path
) -> None:
    """The saved folder's tensors equal one process's (fp32, 4 AdamW steps); it loads whole."""
    out = tmp_path / "run"
    if stop_after is not None:  # preempted after step 2: the second job resumes there
        first = _finetune(config, ranks, downloaded, out, f"train.stop_after={stop_after}")
        assert f"stopped after step {stop_after}" in first, first[-3000:]
        assert not (out / "model").exists()
    output = _finetune(config, ranks, downloaded, out)
    if stop_after is not None:
        assert f"resumed from {out / 'checkpoints'}" in output, output[-3000:]

    reference, tuned = _weights(single / "model"), _weights(out / "model")
    assert sorted(tuned) == sorted(reference)
    original = _weights(downloaded)
    assert any(not torch.equal(reference[k], original[k]) for k in reference)  # it trained
    # AdamW divides each element's step by its own gradient's scale, so an element whose
    # gradient is near zero turns rounding into up to lr (1e-3) a step: 1e-4 still catches any
    # step taken differently (the worst element seen: 1.2e-5; the rest below 2e-6)
    for name, tensor in reference.items():
        torch.testing.assert_close(tuned[name], tensor, rtol=1e-4, atol=1e-4, msg=name)
    result = json.loads((out / "result.json").read_text())
    expected = json.loads((single / "result.json").read_text())
    assert result["steps"] == expected["steps"] == 4
    assert result["eval_perplexity"] == pytest.approx(expected["eval_perplexity"], rel=1e-5)
    assert {p.name for p in (out / "model").iterdir()} >= {"config.json", "tokenizer.json"}
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
