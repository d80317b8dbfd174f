"""Turn a checkpoint into the unparallel model's state dict, or a transformers checkpoint folder.

Any layout's checkpoint assembles into full tensors (DCP reads every chunk into a tensor of
the global shape) in one process, without a process group. The result is what
``model.state_dict()`` of the single-process model returns, so ``load_state_dict`` takes it:
a tensor held in another form than its original module's (``tessera.context.FullForm``: a
transformers ``Conv1D`` transposed, fused q/k/v) is turned back into that module's form, and
a tensor of layers that restate a model (``pipeline_layers``' stages,
``tessera.context.set_original_names``) is named as that model names it.

``export_pretrained`` writes the same tensors as a transformers checkpoint folder
(``config.json`` and safetensors, sharded with an index past a size: what ``from_pretrained``
reads), reading one tensor at a time. The checkpoint holds tensors only, so the model's class
and config are given; the model is built from them on the meta device, which says its names,
shapes and ties (a tied head is written once, under the name transformers keeps).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.context import TOKENIZER_FILES, FullForm, PretrainedSource, write_pretrained_folder

from .api import MODEL_PREFIX, STATE_JSON
from .blocks import Block
from .comm import Comm
from .files import fsync_dir, read_json, verify_checkpoint
from .planners import METADATA_JSON, metadata_from_json
from .reading import read_blocks

__all__ = ["export_pretrained", "export_torch_state_dict", "main"]


def export_torch_state_dict(
    path: str | os.PathLike[str], out_file: str | os.PathLike[str] | None = None
) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (and ``torch.save`` it to ``out_file``).

    Runs in this process alone (no collective), whatever layout saved the checkpoint.

    Args:
        path: A checkpoint directory.
        out_file: Where to write it (atomically: a temporary file renamed), or ``None``.

    Returns:
        ``{name: full tensor}`` in the dtype it was saved in.

    Raises:
        CheckpointCorruptError: a file of the checkpoint is missing, altered or does not
            decode (named).
    """
    directory = Path(path).absolute()
    verify_checkpoint(directory, Comm.local())
    metadata = metadata_from_json(read_json(directory / METADATA_JSON), directory / METADATA_JSON)
    blocks: dict[str, Block] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(MODEL_PREFIX):
            continue
        assert hasattr(md, "properties") and hasattr(md, "size")
        shape = tuple(int(s) for s in md.size)
        blocks[key] = Block(torch.empty(shape, dtype=md.properties.dtype), shape, (0,) * len(shape))
    read_blocks(directory, blocks, Comm.local())
    state = {key[len(MODEL_PREFIX) :]: b.local for key, b in blocks.items()}
    # tensors of modules converted by parallelize: back to the form the original module held
    saved = read_json(directory / STATE_JSON)
    for name, form in saved.get("stored_forms", {}).items():
        state[name] = FullForm.from_json(form).to_original(state[name])
    # tensors of layers that restate a model (pipeline stages): under the model's names
    originals: dict[str, str] = saved.get("original_names", {})
    state = {originals.get(name, name): tensor for name, tensor in state.items()}
    if out_file is not None:
        out = Path(out_file).absolute()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(out.parent)
    return state


@dataclass(frozen=True)
class _Saved:
    """A model tensor of a checkpoint: its DCP key, dtype and shape, and its original form."""

    key: str
    dtype: torch.dtype
    stored_shape: tuple[int, ...]
    form: FullForm | None

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape in the original module's form."""
        return self.stored_shape if self.form is None else self.form.original_shape


def _saved_model_tensors(directory: Path) -> dict[str, _Saved]:
    """Every model tensor of the checkpoint, under the original model's names (no data read)."""
    metadata = metadata_from_json(read_json(directory / METADATA_JSON), directory / METADATA_JSON)
    saved = read_json(directory / STATE_JSON)
    forms: dict[str, Any] = saved.get("stored_forms", {})
    originals: dict[str, str] = saved.get("original_names", {})
    found: dict[str, _Saved] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(MODEL_PREFIX):
            continue
        assert hasattr(md, "properties") and hasattr(md, "size")
        name = key[len(MODEL_PREFIX) :]
        form = FullForm.from_json(forms[name]) if name in forms else None
        shape = tuple(int(n) for n in md.size)
        found[originals.get(name, name)] = _Saved(key, md.properties.dtype, shape, form)
    return found


def _read_tensor(directory: Path, saved: _Saved) -> torch.Tensor:
    """One full tensor of the checkpoint, in its original form (DCP reads only its chunks)."""
    shape = saved.stored_shape
    block = Block(torch.empty(shape, dtype=saved.dtype), shape, (0,) * len(shape))
    read_blocks(directory, {saved.key: block}, Comm.local())
    return block.local if saved.form is None else saved.form.to_original(block.local)


def _model_on_meta(model: Any, config: Any) -> nn.Module:
    """The transformers model ``model`` names, built on the meta device (no memory).

    ``model``: a module (used as it is), a class (with ``config``), a transformers config
    (the class its ``architectures`` names) or a folder holding ``config.json``.
    """
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, str | os.PathLike):
        where = Path(model)
        if not where.exists():
            raise FileNotFoundError(
                f"export_pretrained: {where} does not exist (a folder "
                "holding the model's config.json, or the file)"
            )
        from transformers import AutoConfig

        model = AutoConfig.from_pretrained(str(where))
    if isinstance(model, type):
        cls: Any = model
        if config is None:
            raise ValueError(f"export_pretrained: {cls.__name__} needs its config (config=)")
    else:
        import transformers

        config = model
        names = list(getattr(config, "architectures", None) or [])
        cls = getattr(transformers, names[0], None) if names else None
        if cls is None:
            raise ValueError(
                f"export_pretrained: the config names the architectures {names}, no class of "
                "transformers: pass the model class (and config=)"
            )
    with torch.device("meta"):
        built = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    if not isinstance(built, nn.Module):
        raise TypeError(f"export_pretrained: {cls.__name__} built a {type(built).__name__}")
    return built


def _written_model(trained: nn.Module, write_as: Any) -> nn.Module:
    """The model of class ``write_as`` on meta, with ``trained``'s config.

    ``write_as``: a class, its transformers name, or ``"base"`` (``trained``'s base model's).
    """
    if write_as == "base":
        cls: Any = type(getattr(trained, "base_model", trained))
    elif isinstance(write_as, str):
        import transformers

        cls = getattr(transformers, write_as, None)
        if cls is None:
            raise ValueError(f"export_pretrained: write_as={write_as!r}: transformers has none")
    else:
        cls = write_as
    config = getattr(trained, "config", None)
    with torch.device("meta"):
        built = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    if not isinstance(built, nn.Module):
        raise TypeError(f"export_pretrained: {cls.__name__} built a {type(built).__name__}")
    return built


def _under_base(saved: dict[str, _Saved], prefix: str, written: nn.Module) -> dict[str, _Saved]:
    """The tensors of the trained model's base model, named as the base model names them.

    Where ``written`` is the base model (its keys lack ``prefix``, the checkpoint's have it),
    the keys under ``prefix.`` lose it and the others (the head) are left out; otherwise the
    keys stay as they are (another head on the same base: what does not match is named).
    """
    own = set(written.state_dict())
    head = f"{prefix}." if prefix else ""
    if not head or any(k in own for k in saved) or any(k.startswith(head) for k in own):
        return saved
    return {k.removeprefix(head): v for k, v in saved.items() if k.startswith(head)}


def _matches(key: str, patterns: Sequence[str]) -> bool:
    return any(re.search(p, key) for p in patterns)


def _few(keys: list[str], n: int = 8) -> str:
    return f"{keys[:n]}{f' and {len(keys) - n} more' if len(keys) > n else ''}"


def export_pretrained(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    model: Any,
    *,
    config: Any = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    tokenizer_from: str | os.PathLike[str] | bool | None = None,
    write_as: Any = None,
) -> Path:
    """Write a checkpoint's model as a transformers checkpoint folder, one tensor at a time.

    Runs in this process alone (no collective, no GPU), whatever layout saved the checkpoint:
    each tensor is read whole (DCP assembles it from every rank's chunks), turned back into
    its module's form (``FullForm``: GPT-2's ``Conv1D``, fused q/k/v) and name (a pipeline
    stage's layers), and streamed into its safetensors file, so the process holds one tensor
    at a time. ``out`` gets ``config.json`` (and the generation config) and
    ``model.safetensors`` or, past ``max_shard_size``, numbered files with a
    ``model.safetensors.index.json``; transformers' ``from_pretrained`` loads it. Tied
    parameters are written once, under the name transformers keeps (GPT-2's head is left out).
    The folder is written beside ``out`` and renamed into place once complete. Tokenizer files
    are not part of a checkpoint: those of the folder the run started from are copied beside
    the weights (``tokenizer_from``; by default the folder ``model`` names, when it is one), so
    ``AutoTokenizer.from_pretrained(out)`` works.

    Args:
        path: A checkpoint directory (written by ``save_checkpoint``).
        out: The folder to write.
        model: Which transformers model the checkpoint holds: its class
            (``GPT2LMHeadModel``, or an auto class such as ``AutoModelForCausalLM``) with
            ``config=``, its config (the class its ``architectures`` names), a folder holding
            its ``config.json`` (the folder the run started from), or a model instance (on the
            meta device is fine). It is built on the meta device: its names, shapes and ties
            are checked against the checkpoint's.
        config: The transformers config, when ``model`` is a class.
        max_shard_size: The largest file, in bytes or as ``"5GB"``, ``"500MiB"``.
        dtype: Write the floating tensors in this dtype (default: as saved, fp32 master
            weights under mixed precision).
        tokenizer_from: A folder whose tokenizer files (``tokenizer.json``, ``vocab.json``,
            ``merges.txt``, ``spiece.model``, ...: ``tessera.context.TOKENIZER_FILES``) are
            copied into ``out``, atomically with the weights; it must hold one. Default: the
            folder ``model`` names, if it is one (whatever tokenizer files it holds, maybe
            none); ``False``: none.
        write_as: Write another class than the checkpoint's model: a transformers class, its
            name, or ``"base"`` (the model's base class). Its names, shapes and ties are
            checked as the model's are; a base model (``GPT2Model`` from a ``GPT2LMHeadModel``
            run) is written from the tensors under the model's ``base_model_prefix``
            (``transformer.``, stripped), the head left out.

    Returns:
        The folder.

    Raises:
        CheckpointCorruptError: a file of the checkpoint is missing, altered or does not
            decode (named).
        KeyError: the model's keys and the checkpoint's differ (naming both sides).
        ValueError: a tensor has another shape than the model's (naming it and both
            shapes), or the class cannot be told from ``model``.
        FileNotFoundError: ``tokenizer_from`` is no folder or holds no tokenizer file.
    """
    directory = Path(path).absolute()
    trained = _model_on_meta(model, config)
    template = trained if write_as is None else _written_model(trained, write_as)
    source = PretrainedSource.of(template)
    verify_checkpoint(directory, Comm.local())
    saved = _saved_model_tensors(directory)
    if template is not trained:
        saved = _under_base(saved, PretrainedSource.of(trained).base_model_prefix, template)

    own = template.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}  # tied parameters: one tensor, several names
    for name, t in own.items():
        groups.setdefault(id(t), []).append(name)
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    reads: dict[str, _Saved] = {}
    missing: list[str] = []
    wrong: list[str] = []
    for names in groups.values():
        present = [n for n in names if n in saved]
        if not present:
            if not all(_matches(n, source.ignore_missing) for n in names):
                missing.append(names[0])
            continue
        kept = ([n for n in names if n not in source.tied_keys] or names)[0]
        entry = saved[present[0]]
        expected = tuple(own[kept].shape)
        if entry.shape != expected:
            wrong.append(f"{present[0]!r}: {list(entry.shape)}, expected {list(expected)}")
        written = dtype if dtype is not None and entry.dtype.is_floating_point else entry.dtype
        tensors.append((kept, written, entry.shape))
        reads[kept] = entry
    unexpected = [k for k in saved if k not in own and not _matches(k, source.ignore_unexpected)]
    if missing or unexpected:
        raise KeyError(
            f"export_pretrained: {directory} does not hold a {source.class_name}: missing keys "
            f"{_few(missing)}, unexpected keys {_few(unexpected)}"
        )
    if wrong:
        raise ValueError(
            f"export_pretrained: {len(wrong)} tensors of {directory} have other shapes than "
            f"{source.class_name}'s: {'; '.join(wrong[:8])}{' ...' if len(wrong) > 8 else ''}"
        )
    tokenizer: str | os.PathLike[str] | None = None
    if tokenizer_from is None and isinstance(model, str | os.PathLike) and Path(model).is_dir():
        tokenizer = model  # the folder the run started from: its tokenizer, if it has one
    elif tokenizer_from is not None and not isinstance(tokenizer_from, bool):
        tokenizer = tokenizer_from
    elif tokenizer_from is True:
        raise ValueError("export_pretrained: tokenizer_from=True: name the folder")
    return write_pretrained_folder(
        out,
        tensors,
        lambda key: _read_tensor(directory, reads[key]),
        source,
        max_shard_size=max_shard_size,
        tokenizer_from=tokenizer,
        tokenizer_required=tokenizer is not model,
        caller="export_pretrained",
    )


def _tokenizer_of(config: str) -> str | bool:
    """The ``--config`` folder, if it holds a tokenizer file (else ``False``: none copied)."""
    where = Path(config)
    return config if any((where / name).is_file() for name in TOKENIZER_FILES) else False


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tessera.engine.export CHECKPOINT OUT [--config FOLDER ...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m tessera.engine.export",
        description="Write a tessera checkpoint (any parallel layout) as the plain torch state "
        "dict of the unparallel model (model.load_state_dict(torch.load(OUT))), or with "
        "--config as a transformers checkpoint folder (from_pretrained(OUT)).",
    )
    parser.add_argument("checkpoint", help="checkpoint directory (written by save_checkpoint)")
    parser.add_argument(
        "out", help="output file (torch.save of {name: tensor}), or folder with --config"
    )
    parser.add_argument(
        "--config",
        metavar="FOLDER",
        help="the model's config.json, or the folder holding it (the run's starting "
        "checkpoint): write a transformers checkpoint folder",
    )
    parser.add_argument(
        "--model-class",
        metavar="NAME",
        help="the transformers class (default: the config's architectures)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="largest file (default 5GB)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="write floating tensors so")
    parser.add_argument(
        "--write-as",
        metavar="NAME",
        help="write this transformers class instead (e.g. GPT2Model from a GPT2LMHeadModel "
        "run: the base model's tensors, the prefix 'transformer.' stripped, the head left "
        "out), or 'base' for the model's base class",
    )
    tokenizer = parser.add_mutually_exclusive_group()
    tokenizer.add_argument(
        "--tokenizer",
        metavar="FOLDER",
        help="copy this folder's tokenizer files beside the weights (default: those of the "
        "--config folder, if any)",
    )
    tokenizer.add_argument("--no-tokenizer", action="store_true", help="copy no tokenizer files")
    args = parser.parse_args(argv)
    if args.config is not None:
        model: Any = args.config
        config = None
        if args.model_class is not None:
            import transformers

            model = getattr(transformers, args.model_class, None)
            if model is None:
                parser.error(f"--model-class: transformers has no {args.model_class}")
            config = transformers.AutoConfig.from_pretrained(args.config)
        folder = export_pretrained(
            args.checkpoint,
            args.out,
            model,
            config=config,
            max_shard_size=args.max_shard_size,
            dtype=None if args.dtype is None else _DTYPES[args.dtype],
            write_as=args.write_as,
            tokenizer_from=False
            if args.no_tokenizer
            else args.tokenizer or _tokenizer_of(args.config),
        )
        files = sorted(p.name for p in folder.iterdir())
        print(f"wrote {folder}: {', '.join(files)}", file=sys.stderr)
        return 0
    if any(a is not None for a in (args.model_class, args.dtype, args.tokenizer, args.write_as)):
        parser.error(
            "--model-class, --dtype, --tokenizer and --write-as need --config (a transformers "
            "folder)"
        )
    state = export_torch_state_dict(args.checkpoint, args.out)
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({numel} values) to {args.out}", file=sys.stderr)
    return 0
