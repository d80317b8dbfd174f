"""``save_checkpoint`` / ``load_checkpoint``: everything a run needs to continue, any layout.

A checkpoint is a directory::

    step_00000100/
      manifest.json      size + sha256 of every other file (written last; see files.py)
      metadata.json      DCP's tensor index as JSON (global shapes, chunks, byte ranges)
      .metadata          the same index pickled by DCP (kept for plain ``dcp.load``; never read)
      __<r>_0.distcp     DCP data: the blocks rank r wrote (one writer per block)
      state.json         step, epoch, layout, param-group settings and optimizer numbers by name
      rank_<r>.pt        rank r's RNG streams, data position, lr scheduler, counters, ``extra``

Tensors (``model/<name>``, ``optim/<name>/<key>``) are saved by torch.distributed.checkpoint
through the block planners, keyed by the full model's names, so they load under any other
data/pipeline/tensor layout of the same model. What is per rank (RNG) is restored only under
the same layout; what is the same on every rank (scheduler, counters, data position) is read
from rank 0's file when the layout changed.

Under master weights (the model in float16/bfloat16, fp32 masters in the optimizer) the
checkpoint holds the masters as the model's weights, under the model's names, and the optimizer
state keyed by those names: the checkpoint is that of an fp32 job, so it loads into an fp32 job,
another layout or another master-weight job exactly. Loading reads into the masters and rounds
them into the model.
"""

from __future__ import annotations

import io
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tessera.context import (
    FullForm,
    ParallelContext,
    ParallelMode,
    get_full_form,
    original_names_of,
)

from ..engine import Engine
from ..master_weights import MasterWeights
from .blocks import Block, block_of, model_tensors, parameter_names, unwrap_modules
from .comm import Comm
from .errors import CheckpointCorruptError, CheckpointError, describe
from .files import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    publish,
    read_json,
    sha256_file,
    temporary_dir,
    verify_checkpoint,
    write_bytes,
    write_json,
)
from .optimizer_state import optimizer_parts, prepare_optimizer_load
from .planners import METADATA_JSON, BlockSavePlanner, metadata_from_json, metadata_to_json
from .reading import quiet_single_process, read_blocks, read_rank_file
from .rng import capture_rng, restore_rng
from .storage import failed_ranks, space_problem, write_failure, write_failure_message

__all__ = [
    "MODEL_PREFIX",
    "STATE_JSON",
    "CheckpointInfo",
    "CheckpointParts",
    "load_checkpoint",
    "save_checkpoint",
]

MODEL_PREFIX = "model/"
STATE_JSON = "state.json"


def rank_file(rank: int) -> str:
    """Name of rank ``rank``'s own file."""
    return f"rank_{rank:05d}.pt"


@dataclass
class CheckpointParts:
    """What a checkpoint saves and restores when there is no Engine (or more than it holds).

    Attributes:
        model: The module, or this pipeline rank's chunks (DDP wrappers are looked through).
        optimizer: Its optimizer (also ZeroRedundancyOptimizer or an FSDP2 one).
        lr_scheduler: Anything with ``state_dict``/``load_state_dict``.
        dataloader: A loader from ``get_dataloader`` (its position is saved).
        engine: Its counters and loss scaler are saved.
        context: The ParallelContext (default: the engine's, else the current one).
        master_weights: The fp32 masters of a low-precision model (the engine's): saved as the
            model's weights, and ``optimizer`` is over them.
    """

    model: nn.Module | Sequence[nn.Module]
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    dataloader: Any = None
    engine: Engine | None = None
    context: ParallelContext | None = None
    master_weights: MasterWeights | None = None

    @classmethod
    def of(
        cls,
        engine_or_parts: Engine | CheckpointParts,
        lr_scheduler: Any = None,
        dataloader: Any = None,
    ) -> CheckpointParts:
        """Parts of an Engine (or a copy of parts) with the scheduler and loader added."""
        if isinstance(engine_or_parts, Engine):
            engine = engine_or_parts
            parts = cls(
                engine.module,
                engine.optimizer,
                engine=engine,
                context=engine.context,
                master_weights=engine.master_weights,
            )
        elif isinstance(engine_or_parts, CheckpointParts):
            parts = CheckpointParts(**vars(engine_or_parts))
        else:
            raise TypeError(
                f"expected an Engine or CheckpointParts, got {type(engine_or_parts).__name__}"
            )
        if lr_scheduler is not None:
            parts.lr_scheduler = lr_scheduler
        if dataloader is not None:
            parts.dataloader = dataloader
        return parts


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``load_checkpoint`` found.

    Attributes:
        path: The checkpoint directory.
        step: The ``step`` it was saved with.
        epoch: The ``epoch`` it was saved with.
        extra: The ``extra`` it was saved with (this rank's, or rank 0's after a relayout).
        same_layout: Saved under the same parallel layout (then the RNG streams were restored).
        dataloader: The saved data position (``ResumableDataLoader.state_dict()``), if any.
    """

    path: Path
    step: int
    epoch: int
    extra: Any
    same_layout: bool
    dataloader: dict[str, Any] | None


def stored_forms(modules: Sequence[nn.Module]) -> dict[str, dict[str, Any]]:
    """``name -> FullForm`` (as JSON) of the model's tensors held in another form.

    Another form than the module they were converted from held (``tessera.context.FullForm``).
    Read from the model's own tensors (an fp32 master copy carries no marks).
    """
    return {
        name: form.to_json()
        for name, t in model_tensors(modules)
        if (form := get_full_form(t)) is not None
    }


def _form_text(form: dict[str, Any] | None) -> str:
    return "of its module" if form is None else repr(FullForm.from_json(form))


def _model_tensors(
    parts: CheckpointParts, modules: Sequence[nn.Module]
) -> list[tuple[str, torch.Tensor]]:
    """The model's state-dict entries, each parameter replaced by its fp32 master if it has one."""
    masters = parts.master_weights
    if masters is None:
        return list(model_tensors(modules))
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in model_tensors(modules):
        master = masters.master_of(t)
        out.append((name, t if master is None else master))
    return out


def _parameter_names(
    parts: CheckpointParts, modules: Sequence[nn.Module]
) -> dict[int, tuple[str, nn.Parameter]]:
    """``id -> (name, tensor)`` of what the optimizer holds: the parameters, or their masters."""
    names = parameter_names(modules)
    masters = parts.master_weights
    if masters is None:
        return names
    out: dict[int, tuple[str, nn.Parameter]] = {}
    for name, p in names.values():
        master = masters.master_of(p)
        target = p if master is None else master
        out[id(target)] = (name, target)
    return out


def _layout(comm: Comm) -> dict[str, Any]:
    ctx = comm.context
    if ctx is None:
        return {"world_size": comm.world_size, "data": comm.world_size, "pipeline": 1,
                "tensor": 1, "tensor_mode": None, "tensor_depth": 1}  # fmt: skip
    c = ctx.config
    return {
        "world_size": ctx.world_size,
        "data": c.data_size,
        "pipeline": c.pipeline_size,
        "tensor": c.tensor_size,
        "tensor_mode": c.tensor_mode,
        "tensor_depth": getattr(c, "tensor_depth", 1),
    }


def _pipeline_rank(comm: Comm) -> int:
    ctx = comm.context
    if ctx is not None and ctx.is_initialized(ParallelMode.PIPELINE):
        return ctx.get_local_rank(ParallelMode.PIPELINE)
    return 0


def _rank_payload(parts: CheckpointParts, comm: Comm, extra: Any) -> bytes:
    """This rank's own file, checked to load back with ``weights_only=True``."""
    payload = {
        "rng": capture_rng(comm.context),
        "engine": parts.engine.progress_state_dict() if parts.engine is not None else None,
        "lr_scheduler": (
            parts.lr_scheduler.state_dict() if parts.lr_scheduler is not None else None
        ),
        "dataloader": _loader_state(parts.dataloader),
        "extra": extra,
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # the message of torch's weights-only unpickler names the type
        raise CheckpointError(
            "extra / lr_scheduler state must hold only tensors, numbers, strings and "
            f"containers of them (it must load with weights_only=True): {exc}"
        ) from exc
    return data


def _loader_state(loader: Any) -> dict[str, Any] | None:
    if loader is None:
        return None
    state_dict = getattr(loader, "state_dict", None)
    if not callable(state_dict):
        raise CheckpointError(
            f"the dataloader ({type(loader).__name__}) has no state_dict(): build it with "
            "tessera.engine.get_dataloader to save its position"
        )
    state = state_dict()
    assert isinstance(state, dict)
    return state


def _collisions(gathered: list[dict[str, Any]]) -> list[str]:
    """Names held by two pipeline stages: they would overwrite each other in the checkpoint."""
    holders: dict[str, set[int]] = {}
    for g in gathered:
        for name in g["names"]:
            holders.setdefault(name, set()).add(g["stage"])
    return [
        f"{name} is held by pipeline stages {sorted(stages)}: name stage parameters as in the "
        "full model (tessera.pipeline.build_pipeline_model does)"
        for name, stages in sorted(holders.items())
        if len(stages) > 1
    ]


def _raise_all(problems: list[str], what: str, corrupt: Sequence[str] = ()) -> None:
    """Raise one error listing every problem (the same lists on every rank: gathered).

    ``CheckpointCorruptError`` when a file does not decode (``corrupt``), else
    ``CheckpointError`` when the checkpoint does not fit the parts (``problems``).
    """
    unique = list(dict.fromkeys([*corrupt, *problems]))
    if unique:
        shown = unique[:20]
        more = f"\n  ... and {len(unique) - 20} more" if len(unique) > 20 else ""
        error = CheckpointCorruptError if corrupt else CheckpointError
        raise error(f"{what}:\n  " + "\n  ".join(shown) + more)


def _agree_corrupt(comm: Comm, corrupt: list[str], what: str) -> None:
    """Raise ``CheckpointCorruptError`` on every rank if any rank found a file at fault."""
    _raise_all([], what, [e for found in comm.all_gather(corrupt) for e in found])


def _check_step_boundary(engine: Engine | None) -> None:
    """Refuse a save between optimizer steps: the accumulated gradients are not saved.

    The same on every rank (every rank counts the same micro-steps), so it is agreed like any
    other description error. Carrying the gradients instead would hold each data rank's own
    unreduced sums, valid only under the same layout; a checkpoint is meant to reshard.
    """
    if engine is None:
        return
    every = engine.gradient_accumulation
    done = engine.micro_step % every
    if done:
        raise CheckpointError(
            f"cannot save in the middle of gradient accumulation: micro-step {engine.micro_step}"
            f" is {done} of the {every} micro-steps of an optimizer step ({engine.micro_step} % "
            f"{every} = {done}), and the gradients accumulated since the last optimizer step "
            "are not part of a checkpoint, so a resume would silently lose them. Save after "
            "the engine.step() that completes an optimizer step (engine.micro_step % "
            "engine.gradient_accumulation == 0); SaveCheckpointHook waits for it by itself"
        )


def save_checkpoint(
    path: str | os.PathLike[str],
    engine_or_parts: Engine | CheckpointParts,
    step: int = 0,
    epoch: int = 0,
    extra: Any = None,
    *,
    lr_scheduler: Any = None,
    dataloader: Any = None,
) -> Path:
    """Save a checkpoint that loads under any parallel layout of the same model.

    Every rank of the job must call it (collective). The directory appears at ``path`` only
    once complete (written under a hidden temporary name, then renamed); an existing
    checkpoint at ``path`` is replaced only then. With an Engine, only at an optimizer-step
    boundary: between the micro-steps of gradient accumulation it raises (the accumulated
    gradients are not saved, so a resume would differ).

    Args:
        path: The checkpoint directory to create (its parent is created if needed; on a
            file system every rank sees).
        engine_or_parts: An Engine (model, optimizer, counters, loss scaler) or
            CheckpointParts.
        step: Recorded (the Trainer passes its global step).
        epoch: Recorded.
        extra: Anything of tensors, numbers, strings and containers, per rank.
        lr_scheduler: Saved with the rest (also ``CheckpointParts.lr_scheduler``).
        dataloader: Its position is saved (a loader from ``get_dataloader``).

    Returns:
        The published directory.

    Raises:
        CheckpointError: on every rank, when any rank cannot describe its state (also: the
            engine is between the micro-steps of an optimizer step), when the
            free space is less than the last checkpoint's size (before anything is written),
            or when a write fails (a full disk: the path, the errno where known and the
            bytes needed are named). A failed save removes its temporary folder.
        tessera.context.RankFailedError: another rank failed in the middle of the save (it is
            named; the save runs in the context's guard ``"checkpoint.save"``).
    """
    parts = CheckpointParts.of(engine_or_parts, lr_scheduler, dataloader)
    comm = Comm(parts.context)
    with comm.guard("checkpoint.save"):
        return _save(Path(path).absolute(), parts, comm, step, epoch, extra)


def _save(
    final: Path, parts: CheckpointParts, comm: Comm, step: int, epoch: int, extra: Any
) -> Path:
    """``save_checkpoint`` inside its guard."""
    # 1. A fresh temporary directory, named by rank 0, if the last checkpoint's size fits.
    token, setup_error = None, None
    if comm.is_coordinator:
        token = uuid.uuid4().hex[:12]
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            setup_error = space_problem(final)
            if setup_error is None:
                temporary_dir(final, token).mkdir()
        except OSError as exc:
            setup_error = f"cannot create a temporary directory next to {final}: {exc}"
    token, setup_error = comm.broadcast((token, setup_error))
    if setup_error is not None:
        raise CheckpointError(setup_error)
    assert token is not None
    tmp = temporary_dir(final, token)
    try:
        return _write(final, tmp, token, parts, comm, step, epoch, extra)
    except BaseException:
        # Every rank (one that died cannot): a failed save must not hold the space a retry
        # needs. Nothing here was published, so no complete checkpoint is touched.
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(
    final: Path,
    tmp: Path,
    token: str,
    parts: CheckpointParts,
    comm: Comm,
    step: int,
    epoch: int,
    extra: Any,
) -> Path:
    """Write the checkpoint into ``tmp`` and publish it as ``final`` (the body of ``_save``)."""
    # 2. What this rank holds; every rank learns every rank's problems before any DCP call.
    modules = unwrap_modules(parts.model)
    errors: list[str] = []
    blocks: dict[str, Block] = {}
    names: list[str] = []
    forms: dict[str, dict[str, Any]] = {}
    originals: dict[str, str] = {}
    values: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    payload = b""
    try:
        _check_step_boundary(parts.engine)
        for name, tensor in _model_tensors(parts, modules):
            blocks[MODEL_PREFIX + name] = block_of(name, tensor)
            names.append(name)
        forms = stored_forms(modules)
        originals = original_names_of(modules)
        if parts.optimizer is not None:
            oblocks, values, settings = optimizer_parts(
                parts.optimizer, _parameter_names(parts, modules)
            )
            blocks.update(oblocks)
        payload = _rank_payload(parts, comm, extra)
    except CheckpointError as exc:
        errors.append(str(exc))
    gathered: list[dict[str, Any]] = comm.all_gather(
        {
            "errors": errors,
            "names": names,
            "forms": forms,
            "originals": originals,
            "stage": _pipeline_rank(comm),
            "values": values,
            "settings": settings,
            "optimizer": parts.optimizer is not None,
        }
    )
    # Every rank holds the same gathered list, so every rank raises the same error.
    _raise_all([e for g in gathered for e in g["errors"]] + _collisions(gathered),
               f"cannot save checkpoint {final}")  # fmt: skip

    # 3. Tensors through DCP (deduplicated, validated: no overlap, no hole), then own files.
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, overwrite=False)
    try:
        with quiet_single_process(comm):
            metadata = dcp_save(
                {key: b.local for key, b in blocks.items()},
                storage_writer=writer,
                planner=BlockSavePlanner(blocks),
                process_group=comm.group,
                no_dist=not comm.distributed,
            )
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        # DCP gathers every rank's write failures and raises on every rank alike.
        failure = write_failure(exc)
        if failure is None:
            raise
        message = write_failure_message(final, failure, tmp, failed_ranks(exc))
        raise CheckpointError(message) from exc
    writing = tmp / rank_file(comm.rank)
    write_error: list[str] = []
    try:
        write_bytes(writing, payload)
        if comm.is_coordinator:
            writing = tmp / METADATA_JSON
            write_json(writing, metadata_to_json(metadata))
            writing = tmp / STATE_JSON
            _write_state(writing, comm, gathered, step, epoch)
    except OSError as exc:  # e.g. the disk filled up: said on every rank, below
        write_error.append(write_failure_message(final, exc, writing))

    # 4. Checksums (files shared among the ranks), manifest, atomic publication by rank 0.
    # Rank 0 lists the directory only after every rank says its own file is written: a slower
    # rank's file would otherwise be missing from the manifest, so nothing would ever verify it.
    comm.agree(write_error, f"checkpoint {final} was not saved", CheckpointError)
    written = comm.all_gather(rank_file(comm.rank))
    listing = comm.broadcast(sorted(p.name for p in tmp.iterdir()) if comm.is_coordinator else [])
    _raise_all(
        [f"{tmp / name} was written but is not in the directory" for name in written
         if name not in listing],
        f"cannot save checkpoint {final}",
    )  # fmt: skip
    return _publish(final, tmp, token, comm, listing, step, epoch)


def _write_state(
    path: Path, comm: Comm, gathered: list[dict[str, Any]], step: int, epoch: int
) -> None:
    """Rank 0 writes ``state.json``: what every rank described, merged."""
    all_values: dict[str, Any] = {}
    all_settings: dict[str, Any] = {}
    for g in gathered:
        all_values.update(g["values"])
        all_settings.update(g["settings"])
    write_json(
        path,
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": int(step),
            "epoch": int(epoch),
            "layout": _layout(comm),
            "model_keys": sorted({n for g in gathered for n in g["names"]}),
            "stored_forms": {n: f for g in gathered for n, f in sorted(g["forms"].items())},
            "original_names": {n: o for g in gathered for n, o in sorted(g["originals"].items())},
            "has_optimizer": any(g["optimizer"] for g in gathered),
            "param_groups": all_settings,
            "optimizer_values": all_values,
            "torch_version": torch.__version__,
        },
    )


def _publish(
    final: Path,
    tmp: Path,
    token: str,
    comm: Comm,
    listing: list[str],
    step: int,
    epoch: int,
) -> Path:
    """Checksums (each rank a share of the files), the manifest, rank 0's rename."""
    digests = {
        name: {"bytes": (tmp / name).stat().st_size, "sha256": sha256_file(tmp / name)}
        for i, name in enumerate(listing)
        if i % comm.world_size == comm.rank
    }
    everyone = comm.all_gather(digests)
    publish_error: str | None = None
    if comm.is_coordinator:
        files: dict[str, Any] = {}
        for d in everyone:
            files.update(d)
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": int(step),
            "epoch": int(epoch),
            "files": files,
        }
        try:
            write_json(tmp / MANIFEST, manifest)
        except OSError as exc:
            publish_error = write_failure_message(final, exc, tmp / MANIFEST)
        if publish_error is None:
            try:
                publish(tmp, final, token)
            except (OSError, CheckpointError) as exc:
                publish_error = f"cannot publish checkpoint {final}: {exc}"
    publish_error = comm.broadcast(publish_error)
    if publish_error is not None:
        raise CheckpointError(publish_error)
    return final


def _saved_tensors(directory: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    metadata = metadata_from_json(read_json(directory / METADATA_JSON), directory / METADATA_JSON)
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key, md in metadata.state_dict_metadata.items():
        assert hasattr(md, "properties") and hasattr(md, "size")
        out[key] = (md.properties.dtype, tuple(int(s) for s in md.size))
    return out


def load_checkpoint(
    path: str | os.PathLike[str],
    engine_or_parts: Engine | CheckpointParts,
    strict: bool = True,
    *,
    lr_scheduler: Any = None,
    dataloader: Any = None,
    verify: bool = True,
) -> CheckpointInfo:
    """Load a checkpoint saved under any layout into this layout's parts, in place.

    Every rank of the job must call it (collective). The files are first checked against the
    manifest; nothing is unpickled (tensor data with ``weights_only=True``, metadata from JSON).
    Every failure is raised on every rank alike, before any rank moves on to a collective its
    peers will not join: the ranks agree after reading their files, after reading the tensors
    and after restoring the rest.

    Args:
        path: A checkpoint directory written by ``save_checkpoint``.
        engine_or_parts: What to fill (see ``save_checkpoint``).
        strict: Every tensor of the model must be in the checkpoint and every model tensor of
            the checkpoint in the model (checked over all ranks together); a scheduler or
            loader given must have saved state. Else missing entries are left as they are.
        lr_scheduler: Restored with the rest.
        dataloader: Its position is restored (its next iteration resumes there).
        verify: Check the checksums first (``False`` only right after ``latest_checkpoint``
            verified the same directory).

    Returns:
        The step, epoch and ``extra`` recorded.

    Raises:
        CheckpointCorruptError: a file is missing, truncated, altered or does not decode
            (named); nothing was changed when it is found before the tensor data is read
            (checksums, ``state.json``, ``metadata.json``, the rank files).
        CheckpointError: keys or shapes do not match the model (named); nothing was changed.
        tessera.context.RankFailedError: another rank failed in the middle of the load (it is
            named; the load runs in the context's guard ``"checkpoint.load"``).
    """
    parts = CheckpointParts.of(engine_or_parts, lr_scheduler, dataloader)
    comm = Comm(parts.context)
    with comm.guard("checkpoint.load"):
        return _load(Path(path).absolute(), parts, comm, strict, verify)


@dataclass
class _Found:
    """What one rank read and matched before any tensor is read (the parts are untouched)."""

    corrupt: list[str] = field(default_factory=list)  # files that do not decode
    errors: list[str] = field(default_factory=list)  # the checkpoint does not fit the parts
    names: list[str] = field(default_factory=list)
    blocks: dict[str, Block] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    own: dict[str, Any] = field(default_factory=dict)
    own_path: Path | None = None
    same_layout: bool = False
    step: int = 0
    epoch: int = 0
    finish_optimizer: Callable[[], None] | None = None


def _load(
    directory: Path, parts: CheckpointParts, comm: Comm, strict: bool, verify: bool
) -> CheckpointInfo:
    """``load_checkpoint`` inside its guard: read, agree, read tensors, agree, restore, agree."""
    what = f"cannot load {directory}"
    if verify:
        verify_checkpoint(directory, comm)
    found = _read_own_files(directory, comm)
    if not found.corrupt:
        _match(directory, parts, strict, found)
    gathered = comm.all_gather(
        {"corrupt": found.corrupt, "errors": found.errors, "names": found.names}
    )
    corrupt = [e for g in gathered for e in g["corrupt"]]
    problems = [e for g in gathered for e in g["errors"]]
    if strict and not corrupt:
        present = {n for g in gathered for n in g["names"]}
        unexpected = sorted(set(found.state.get("model_keys", [])) - present)
        if unexpected:
            problems.append(f"the checkpoint holds tensors the model lacks: {unexpected[:10]}")
    _raise_all(problems, what, corrupt)

    errors: list[str] = []
    try:
        read_blocks(directory, found.blocks, comm)
    except CheckpointCorruptError as exc:
        errors.append(str(exc))
    _agree_corrupt(comm, errors, what)
    _agree_corrupt(comm, _restore(directory, parts, comm, found), what)
    return CheckpointInfo(
        path=directory,
        step=found.step,
        epoch=found.epoch,
        extra=found.own.get("extra"),
        same_layout=found.same_layout,
        dataloader=found.own.get("dataloader"),
    )


def _read_own_files(directory: Path, comm: Comm) -> _Found:
    """``state.json``, the tensor index and this rank's own file (rank 0's after a relayout)."""
    found = _Found()
    try:
        found.state = read_json(directory / STATE_JSON)
        try:
            found.step = int(found.state.get("step", 0))
            found.epoch = int(found.state.get("epoch", 0))
        except (TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{directory / STATE_JSON}: {describe(exc)}") from exc
        found.same_layout = found.state.get("layout") == _layout(comm)
        found.own_path = directory / rank_file(comm.rank if found.same_layout else 0)
        found.own = read_rank_file(found.own_path)
    except CheckpointCorruptError as exc:
        found.corrupt.append(str(exc))
    return found


def _match(directory: Path, parts: CheckpointParts, strict: bool, found: _Found) -> None:
    """The blocks to read into, and what does not fit (``found.errors``) or decode."""
    try:
        saved = _saved_tensors(directory)
        modules = unwrap_modules(parts.model)
        forms = stored_forms(modules)
        for name, tensor in _model_tensors(parts, modules):
            found.names.append(name)
            key = MODEL_PREFIX + name
            block = block_of(name, tensor)
            if key not in saved:
                if strict:
                    found.errors.append(f"{name} (global shape {list(block.global_shape)}) is "
                                        "not in the checkpoint")  # fmt: skip
                continue
            # (a checkpoint written before forms were recorded has no entry to compare)
            saved_forms = found.state.get("stored_forms")
            saved_form = saved_forms.get(name) if saved_forms is not None else None
            if saved_forms is not None and saved_form != forms.get(name):
                found.errors.append(
                    f"{name}: the checkpoint holds it in the form {_form_text(saved_form)}, this "
                    f"model in the form {_form_text(forms.get(name))} (convert the model as the "
                    "one that saved it was, e.g. with the same parallelize plan; "
                    "export_torch_state_dict gives the original form)"
                )
                continue
            saved_shape = saved[key][1]
            if saved_shape != block.global_shape:
                found.errors.append(
                    f"{name}: the checkpoint holds global shape {list(saved_shape)}, the model "
                    f"{list(block.global_shape)}"
                )
                continue
            found.blocks[key] = block
        if parts.optimizer is not None:
            if not found.state.get("has_optimizer"):
                if strict:
                    found.errors.append("the checkpoint holds no optimizer state")
            else:
                oblocks, found.finish_optimizer, oerrors = prepare_optimizer_load(
                    parts.optimizer,
                    _parameter_names(parts, modules),
                    saved,
                    found.state.get("optimizer_values", {}),
                    found.state.get("param_groups", {}),
                    strict,
                )
                found.errors.extend(oerrors)
                found.blocks.update(oblocks)
        if strict and parts.lr_scheduler is not None and found.own.get("lr_scheduler") is None:
            found.errors.append("the checkpoint holds no lr scheduler state")
        if strict and parts.dataloader is not None and found.own.get("dataloader") is None:
            found.errors.append("the checkpoint holds no data loader position")
    except CheckpointCorruptError as exc:
        found.corrupt.append(str(exc))
    except CheckpointError as exc:
        found.errors.append(str(exc))
    except Exception as exc:  # what state.json / metadata.json say is not what tessera writes
        found.corrupt.append(
            f"{directory / STATE_JSON} and {directory / METADATA_JSON} do not describe state "
            f"these parts can take: {describe(exc)}"
        )


def _restore(directory: Path, parts: CheckpointParts, comm: Comm, found: _Found) -> list[str]:
    """Hand the optimizer its state and restore this rank's own file; returns what failed."""
    failed: list[str] = []
    if parts.master_weights is not None:  # the masters were read: round them into the model
        parts.master_weights.copy_to_model()
    try:
        if found.finish_optimizer is not None:
            found.finish_optimizer()
    except Exception as exc:
        failed.append(f"{directory / STATE_JSON}: the optimizer state does not restore: "
                      f"{describe(exc)}")  # fmt: skip
    own = found.own
    try:
        if parts.engine is not None and own.get("engine") is not None:
            parts.engine.load_progress_state_dict(own["engine"])
        if parts.lr_scheduler is not None and own.get("lr_scheduler") is not None:
            parts.lr_scheduler.load_state_dict(own["lr_scheduler"])
        loader_state = own.get("dataloader")
        if parts.dataloader is not None and loader_state is not None:
            parts.dataloader.load_state_dict(loader_state)
        if found.same_layout and own.get("rng") is not None:
            restore_rng(own["rng"], comm.context)
    except Exception as exc:
        failed.append(f"{found.own_path}: its state does not restore: {describe(exc)}")
    return failed
