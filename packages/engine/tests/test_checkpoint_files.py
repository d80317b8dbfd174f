"""Crash safety, checksums, no unpickling, export, hooks: one process each (no process group)."""

from __future__ import annotations

import datetime
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_testlib import make_data, make_model
from torch import nn
from torch.utils.data import TensorDataset

from tessera.engine import (
    HOOKS,
    BaseHook,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointParts,
    Engine,
    LoadCheckpointHook,
    LRSchedulerHook,
    SaveCheckpointHook,
    Trainer,
    export_torch_state_dict,
    get_dataloader,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)


def _trained(steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    x, y = make_data()
    for _ in range(steps):
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _save(path: Path, step: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, opt, sched = _trained(step)
    save_checkpoint(path, CheckpointParts(model, opt, sched), step=step, extra={"note": "hi"})
    return model, opt


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = make_model(5)
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def test_round_trip_model_optimizer_scheduler_extra(tmp_path: Path) -> None:
    model, opt = _save(tmp_path / "c")
    model2, opt2, sched2 = _fresh()
    info = load_checkpoint(tmp_path / "c", CheckpointParts(model2, opt2, sched2))
    assert (info.step, info.extra, info.same_layout) == (3, {"note": "hi"}, True)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
        for key, value in opt.state[a].items():
            assert torch.equal(value, opt2.state[b][key]), key
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.005
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    assert sched2.last_epoch == 3
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == sorted(
        [".metadata", "__0_0.distcp", "manifest.json", "metadata.json", "rank_00000.pt",
         "state.json"]
    )  # fmt: skip
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_strict_names_the_missing_and_the_mismatched(tmp_path: Path) -> None:
    _save(tmp_path / "c")
    bigger = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 5))
    with pytest.raises(CheckpointError, match=r"2\.weight: the checkpoint holds global shape"):
        load_checkpoint(tmp_path / "c", CheckpointParts(bigger))
    extra = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.Linear(3, 3))
    with pytest.raises(CheckpointError, match=r"3\.weight .* is not in the checkpoint"):
        load_checkpoint(tmp_path / "c", CheckpointParts(extra))
    before = [p.detach().clone() for p in extra.parameters()]
    load_checkpoint(tmp_path / "c", CheckpointParts(extra), strict=False)
    assert torch.equal(list(extra.parameters())[-1], before[-1])  # left as it was
    assert not torch.equal(next(iter(extra.parameters())), before[0])  # loaded


@pytest.mark.parametrize(
    ("victim", "damage", "message"),
    [
        ("__0_0.distcp", "flip", "sha256"),
        ("rank_00000.pt", "truncate", "truncated"),
        ("state.json", "delete", "missing"),
        ("manifest.json", "delete", "manifest.json is missing"),
    ],
)
def test_corrupted_checkpoint_names_the_file(
    tmp_path: Path, victim: str, damage: str, message: str
) -> None:
    path = tmp_path / "c"
    _save(path)
    target = path / victim
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    else:
        target.unlink()
    model, opt, _ = _fresh()
    with pytest.raises(CheckpointCorruptError, match=message) as err:
        load_checkpoint(path, CheckpointParts(model, opt))
    assert victim in str(err.value)
    with pytest.raises(CheckpointCorruptError):
        export_torch_state_dict(path)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch PWNED",))


def test_loading_never_unpickles_the_dcp_metadata(tmp_path: Path) -> None:
    """A crafted pickle in .metadata (with a matching manifest) is never executed."""
    path = tmp_path / "c"
    model, _ = _save(path)
    (path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    manifest = json.loads((path / "manifest.json").read_text())
    from tessera.engine.checkpoint.files import sha256_file

    size = (path / ".metadata").stat().st_size
    manifest["files"][".metadata"] = {"bytes": size, "sha256": sha256_file(path / ".metadata")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        model2, opt2, _ = _fresh()
        load_checkpoint(path, CheckpointParts(model2, opt2))
        export_torch_state_dict(path)
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "PWNED").exists()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


_KILLED_SAVE = """
import os, sys, time
import torch
from torch import nn
from tessera.engine import CheckpointParts, save_checkpoint

root = sys.argv[1]
torch.manual_seed(0)
save_checkpoint(root + "/step_00000001", CheckpointParts(nn.Linear(4, 4)), step=1)
big = nn.Linear(1024, 1024)  # 4 MiB of weights
real_fsync = os.fsync
def stalled_fsync(fd):
    print("WRITING", flush=True)  # the data file is written, not yet synced or published
    time.sleep(120)
os.fsync = stalled_fsync
save_checkpoint(root + "/step_00000001", CheckpointParts(big), step=2)  # overwrite: killed
print("NOT KILLED", flush=True)
"""


def test_kill_9_during_save_leaves_previous_checkpoint_intact(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", proc.stderr.read() if proc.stderr else line
        tmp_dirs = [p for p in tmp_path.iterdir() if p.name.startswith(".step_00000001.tmp-")]
        assert len(tmp_dirs) == 1
        assert any(f.stat().st_size > 4_000_000 for f in tmp_dirs[0].iterdir())  # mid-save
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # the previous checkpoint is intact, loadable, and the newest good one
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    model = nn.Linear(4, 4)
    info = load_checkpoint(tmp_path / "step_00000001", CheckpointParts(model))
    assert info.step == 1
    torch.manual_seed(0)
    assert torch.equal(model.weight, nn.Linear(4, 4).weight)
    # the unfinished save is garbage for the next prune
    removed = prune_checkpoints(tmp_path, keep_last=1)
    assert [p.name for p in removed] == [tmp_dirs[0].name]


def test_latest_checkpoint_skips_corrupt_and_unfinished(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _save(tmp_path / f"step_{step:08d}", step)
    (tmp_path / ".step_00000004.tmp-abc123").mkdir()  # a save that never finished
    data = tmp_path / "step_00000003" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"
    assert verify_checkpoint(tmp_path / "step_00000002")["step"] == 2


def test_export_cli_writes_a_plain_state_dict(tmp_path: Path) -> None:
    model, _ = _save(tmp_path / "c")
    out = tmp_path / "plain.pt"
    subprocess.run(
        [sys.executable, "-m", "tessera.engine.export", str(tmp_path / "c"), str(out)],
        check=True,
        timeout=120,
    )
    plain = make_model(9)
    plain.load_state_dict(torch.load(out, weights_only=True))
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_tensor_held_in_another_form_loads_only_into_that_form_and_exports_as_its_module(
    tmp_path: Path,
) -> None:
    """A weight held transposed (a Conv1D's): where the shapes agree only the form tells."""
    from tessera.context import FullForm, set_full_form

    model, _ = _save(tmp_path / "plain")  # no forms: loads and exports as before
    converted = make_model(1)
    name, weight = next((n, p) for n, p in converted.named_parameters() if p.dim() == 2)
    form = FullForm((weight.shape[1], weight.shape[0]), transposed=True)  # the module's [in, out]
    set_full_form(weight, form)
    save_checkpoint(tmp_path / "converted", CheckpointParts(converted))
    recorded = json.loads((tmp_path / "converted" / "state.json").read_text())["stored_forms"]
    assert recorded == {name: form.to_json()}
    held = re.escape(repr(form))
    with pytest.raises(CheckpointError, match=rf"{name}: the checkpoint holds it in the form "
                       rf"{held}, this model in the form of its module"):  # fmt: skip
        load_checkpoint(tmp_path / "converted", CheckpointParts(make_model(2)))
    with pytest.raises(CheckpointError, match=rf"{name}: the checkpoint holds it in the form of "
                       rf"its module, this model in the form {held}"):  # fmt: skip
        load_checkpoint(tmp_path / "plain", CheckpointParts(converted))
    same = make_model(3)
    set_full_form(dict(same.named_parameters())[name], form)
    load_checkpoint(tmp_path / "converted", CheckpointParts(same))  # the same form: loads
    for a, b in zip(converted.parameters(), same.parameters(), strict=True):
        assert torch.equal(a, b)
    exported = export_torch_state_dict(tmp_path / "converted")  # the module's own form
    for key, tensor in converted.state_dict().items():
        assert torch.equal(exported[key], tensor.t() if key == name else tensor), key
    assert set(export_torch_state_dict(tmp_path / "plain")) == set(model.state_dict())


def test_layers_restating_a_model_export_under_the_model_names(tmp_path: Path) -> None:
    """A stage of pipeline layers saves under its own names and exports under the model's."""
    from tessera.context import set_original_names

    model = make_model(0)
    restated = nn.Sequential()
    restated.add_module("body", model)  # the same tensors, their names prefixed
    names = {name: f"model.{name}" for name in model.state_dict()}
    set_original_names(model, names)
    save_checkpoint(tmp_path / "c", CheckpointParts(restated))
    recorded = json.loads((tmp_path / "c" / "state.json").read_text())["original_names"]
    assert recorded == {f"body.{name}": original for name, original in names.items()}
    load_checkpoint(tmp_path / "c", CheckpointParts(restated))  # loads under its own names
    exported = export_torch_state_dict(tmp_path / "c")
    assert set(exported) == set(names.values())
    for name, tensor in model.state_dict().items():
        assert torch.equal(exported[names[name]], tensor), name
    with pytest.raises(ValueError, match=r"\['extra'\] are not in the state dict of"):
        set_original_names(model, {"extra": "x"})
    first, second = list(model.state_dict())[:2]
    with pytest.raises(ValueError, match=rf"'{first}' and '{second}' of .* would both be 'w'"):
        set_original_names(model, {first: "w", second: "w"})


class _Losses(BaseHook):
    def __init__(self) -> None:
        super().__init__(priority=50)
        self.losses: dict[int, float] = {}

    def after_train_iter(self, trainer: Trainer, output: Any, label: Any, loss: Any) -> None:
        self.losses[trainer.global_step] = float(loss.item())


def _fit(directory: Path, max_steps: int | None, resume: bool, seed: int) -> dict[int, float]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    x, y = make_data(n=20, seed=4)
    loader = get_dataloader(TensorDataset(x, y), shuffle=True, batch_size=3)  # 7 per epoch
    trainer = Trainer(Engine(model, opt, nn.CrossEntropyLoss()))
    losses = _Losses()
    hooks: list[BaseHook] = [
        LRSchedulerHook(sched, by_epoch=False),
        losses,
        SaveCheckpointHook(directory, interval=4, keep_last=2),
    ]
    if resume:
        hooks.append(LoadCheckpointHook(directory))
    trainer.fit(loader, epochs=3, max_steps=max_steps, hooks=hooks, display_progress=False)
    return losses.losses


def test_hooks_keep_last_and_resume_exactly_in_one_process(tmp_path: Path) -> None:
    full = _fit(tmp_path / "a", None, resume=False, seed=0)
    assert len(full) == 21
    kept = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert kept == ["step_00000016", "step_00000020"]  # keep_last=2 of 4, 8, ..., 20
    _fit(tmp_path / "b", 10, resume=False, seed=0)  # "killed" after step 10, saved at 8
    resumed = _fit(tmp_path / "b", None, resume=True, seed=123)  # other init, other RNG
    assert sorted(resumed) == list(range(9, 22))
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # bitwise


def test_hooks_are_registered() -> None:
    assert HOOKS.get("SaveCheckpointHook") is SaveCheckpointHook
    assert HOOKS.get("LoadCheckpointHook") is LoadCheckpointHook


def test_data_position_survives_a_change_of_batch_layout(tmp_path: Path) -> None:
    """3 batches of 4 consumed = 12 samples = 6 batches of 2 under another loader."""
    ds = TensorDataset(torch.arange(40))
    loader = get_dataloader(ds, shuffle=True, batch_size=4)
    loader.sampler.set_epoch(2)  # type: ignore[attr-defined]
    it = iter(loader)
    seen = [next(it)[0] for _ in range(3)]
    state = loader.state_dict()
    other = get_dataloader(ds, shuffle=True, batch_size=2)
    other.load_state_dict(state)
    rest = torch.cat([b for (b,) in other])
    full_order = torch.cat([*seen, *(b for (b,) in it)])
    assert torch.equal(torch.cat([*seen, rest]), full_order)
    assert other.batches_consumed == 20


# ---------------------------------------------------------------- a crash while overwriting


class _Crash(BaseException):
    """The process stops here (no handler runs: a kill, a power cut)."""


def _linear_save(path: Path, step: int) -> nn.Linear:
    torch.manual_seed(step)
    model = nn.Linear(2, 2)
    save_checkpoint(path, CheckpointParts(model), step=step)
    return model


@pytest.mark.parametrize(
    ("crash", "survivor"),
    [("first_rename", 1), ("between_renames", 1), ("removing_the_old", 2)],
)
def test_a_crash_while_overwriting_keeps_a_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash: str, survivor: int
) -> None:
    """Overwrite ``step_00000005`` (step 1) with step 2, crashing at each point of ``publish``."""
    _linear_save(tmp_path / "step_00000004", 0)  # older: pruned
    name = tmp_path / "step_00000005"
    _linear_save(name, 1)
    renames = 0
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        nonlocal renames
        if Path(src).parent != tmp_path:  # not a directory that publish moves
            real_rename(src, dst)
            return
        renames += 1
        if crash == "first_rename" and renames == 1:
            raise _Crash
        real_rename(src, dst)
        if crash == "between_renames" and renames == 1:
            raise _Crash

    def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        raise _Crash

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", rename)
        patch.setattr(os, "replace", rename)
        if crash == "removing_the_old":
            patch.setattr(shutil, "rmtree", rmtree)
        with pytest.raises(_Crash):
            _linear_save(name, 2)
    assert renames == (1 if crash != "removing_the_old" else 2)

    def check() -> Path:
        found = latest_checkpoint(tmp_path)
        assert found is not None, sorted(p.name for p in tmp_path.iterdir())
        model = nn.Linear(2, 2)
        assert load_checkpoint(found, CheckpointParts(model)).step == survivor
        torch.manual_seed(survivor)
        assert torch.equal(model.weight, nn.Linear(2, 2).weight)
        return found

    found = check()
    prune_checkpoints(tmp_path, keep_last=1)
    assert check() == found  # the pruning kept it
    assert not (tmp_path / "step_00000004").exists()
    assert len(list(tmp_path.iterdir())) == 1, sorted(p.name for p in tmp_path.iterdir())


def test_pruning_keeps_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _linear_save(tmp_path / f"step_{step:08d}", step)
    data = tmp_path / "step_00000003" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])  # step 3 is newest but incomplete
    removed = prune_checkpoints(tmp_path, keep_last=1)
    assert [p.name for p in removed] == ["step_00000001"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"


# ---------------------------------------------------------------- a file that does not decode


def _rewrite_manifest(path: Path, name: str) -> None:
    """Make the manifest match ``name`` again, as a tampering or a bad copy tool would."""
    from tessera.engine.checkpoint.files import sha256_file

    manifest = json.loads((path / "manifest.json").read_text())
    target = path / name
    manifest["files"][name] = {"bytes": target.stat().st_size, "sha256": sha256_file(target)}
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("victim", "damage"),
    [
        ("rank_00000.pt", "refused"),  # the weights-only unpickler says no
        ("__0_0.distcp", "garbage"),  # DCP's CheckpointException, a BaseException
        ("metadata.json", "no_storage"),
        ("state.json", "a_list"),
        ("rank_00000.pt", "missing_unverified"),
    ],
)
def test_every_load_failure_is_a_corrupt_error_naming_the_file(
    tmp_path: Path, victim: str, damage: str
) -> None:
    path = tmp_path / "c"
    _save(path)
    target = path / victim
    if damage == "refused":
        torch.save({"rng": datetime.date(2024, 1, 1)}, target)
    elif damage == "garbage":
        target.write_bytes(bytes((b + 1) % 256 for b in target.read_bytes()))
    elif damage == "no_storage":
        metadata = json.loads(target.read_text())
        del metadata["storage"]
        target.write_text(json.dumps(metadata))
    elif damage == "a_list":
        target.write_text("[]")
    if damage == "missing_unverified":
        target.unlink()
    else:
        _rewrite_manifest(path, victim)
    model, opt, sched = _fresh()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointCorruptError) as err:
        load_checkpoint(
            path, CheckpointParts(model, opt, sched), verify=damage != "missing_unverified"
        )
    assert str(target) in str(err.value)
    if victim != "__0_0.distcp":  # found before any tensor was read: nothing changed
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert not opt.state and sched.last_epoch == 0
    else:
        with pytest.raises(CheckpointCorruptError, match=victim):
            export_torch_state_dict(path)
