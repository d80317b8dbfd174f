"""transformers checkpoint folders: loaded into a parallelized model built on the meta device,
each rank reading only its own slices, and written back from it so that ``from_pretrained``
reads them (every rank raising if the writer fails)."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import gpt2_lm, llama_lm, token_ids
from torch import nn
from tp_reference import TOL

from tessera.context import (
    FullForm,
    ParallelMode,
    ShardInfo,
    create_context,
    set_full_form,
    set_shard_info,
)
from tessera.layers import (
    gather_full_state_dict,
    gather_logits,
    load_pretrained,
    meta_parameters,
    parallelize,
    parallelize_pretrained,
    save_pretrained,
)

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

#: Llama with one key/value head: repeated on the ranks splitting heads under 1d and 2d.
LLAMA_KV = dict(num_key_value_heads=1)


def _reference(name: str) -> nn.Module:
    """The single-process model whose checkpoint ``name`` is: GPT-2 in fp32 (Conv1D, fused
    q/k/v, a tied head), Llama in bf16 (its weights rounded to bf16, held in fp32)."""
    if name == "gpt2":
        return gpt2_lm().eval()
    model = llama_lm(**LLAMA_KV).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """GPT-2 as one fp32 file; Llama in bf16, sharded into several files with an index."""
    root = tmp_path_factory.mktemp("checkpoints")
    gpt2_lm().save_pretrained(root / "gpt2")
    _reference("llama").to(torch.bfloat16).save_pretrained(root / "llama", max_shard_size="8KB")
    assert (root / "llama" / "model.safetensors.index.json").is_file()
    return {"gpt2": str(root / "gpt2"), "llama": str(root / "llama")}


def _load_and_save(tensor: dict[str, Any], folders: dict[str, str], out: str) -> int:
    """Each checkpoint into a model built on meta and parallelized (GPT-2 by hand, Llama by
    ``parallelize_pretrained``, its bf16 turned fp32): the gathered state equals the original,
    the logits one process's; saved back (Llama by transformers' own ``model.save_pretrained``,
    which writes the gathered checkpoint too), ``from_pretrained`` computes them too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ctx = create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)
    try:
        for name, folder in folders.items():
            ref = _reference(name)
            with _counting_reads() as read:
                if name == "gpt2":  # by hand: build on meta, parallelize, load
                    with meta_parameters():
                        config = AutoConfig.from_pretrained(folder)
                        empty = AutoModelForCausalLM.from_config(config)
                    model = parallelize(empty, context=ctx)
                    load_pretrained(model, folder)
                else:  # in one line, the class from config.json
                    model = parallelize_pretrained(folder, context=ctx)
            model.eval()
            _check_reads(read, model, ref)
            gathered, expected = gather_full_state_dict(model), ref.state_dict()
            assert list(gathered) == list(expected)
            for key, t in expected.items():
                assert torch.equal(gathered[key], t), key
            ids = token_ids()
            with torch.no_grad():
                logits = gather_logits(model(ids).logits, context=ctx)
                torch.testing.assert_close(logits, ref(ids).logits, **TOL)

            # sharded where the checkpoint was one file, and the reverse
            target = Path(out) / f"{tensor['mode']}-{name}"
            if name == "gpt2":
                save_pretrained(model, target, max_shard_size="8KB")
            else:  # transformers' own method, on every rank: the same gathered checkpoint
                with pytest.raises(ValueError, match=r"push_to_hub=True is not supported"):
                    model.save_pretrained(target, push_to_hub=True)
                # accelerate's pattern: every rank, its own flag and a pickle writer (unused)
                main = ctx.get_local_rank(ParallelMode.GLOBAL) == 0
                model.save_pretrained(target, is_main_process=main, save_function=torch.save)
            if ctx.get_local_rank(ParallelMode.GLOBAL) == 0:
                _check_saved(target, name, ref, sharded=name == "gpt2")
    finally:
        ctx.destroy()
    return 0


@contextlib.contextmanager
def _counting_reads() -> Iterator[Counter[str]]:
    """``safetensors.safe_open`` counting, per key, the elements read out of the files."""
    import safetensors

    real = safetensors.safe_open
    read: Counter[str] = Counter()

    class Slice:
        def __init__(self, key: str, inner: Any) -> None:
            self.key, self.inner = key, inner

        def get_shape(self) -> list[int]:
            return list(self.inner.get_shape())

        def __getitem__(self, index: Any) -> torch.Tensor:
            t = self.inner[index]
            read[self.key] += t.numel()
            return t

    class Open:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real(*args, **kwargs)

        def __enter__(self) -> Open:
            self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.inner.keys())

        def get_slice(self, key: str) -> Slice:
            return Slice(key, self.inner.get_slice(key))

        def get_tensor(self, key: str) -> torch.Tensor:
            t = self.inner.get_tensor(key)
            read[key] += t.numel()
            return t

    safetensors.safe_open = Open
    try:
        yield read
    finally:
        safetensors.safe_open = real


def _check_reads(read: Counter[str], model: nn.Module, ref: nn.Module) -> None:
    """Each tensor's elements read from the files are exactly this rank's block of it, and
    the split ones (q/k/v fused in GPT-2's transposed ``Conv1D``, the vocabulary, the MLP)
    are less than the whole."""
    own, whole = model.state_dict(), ref.state_dict()
    assert read and all(n == own[key].numel() for key, n in read.items()), {
        key: (n, own[key].numel()) for key, n in read.items() if n != own[key].numel()
    }
    split = [key for key in read if read[key] < whole[key].numel()]
    assert any("attn" in k for k in split) and any("mlp" in k for k in split), split


def _check_saved(folder: Path, name: str, ref: nn.Module, *, sharded: bool) -> None:
    from transformers import AutoModelForCausalLM

    files = sorted(p.name for p in folder.iterdir())
    assert ("model.safetensors.index.json" in files) == sharded, files
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp left
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(reloaded) is type(ref)
    state = reloaded.state_dict()
    assert all(torch.equal(state[k], t) for k, t in ref.state_dict().items()), name
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref(ids).logits, **TOL)


@pytest.mark.parametrize("tensor", [dict(size=2, mode="1d"), dict(size=4, mode="2d")])
def test_load_and_save_under_tensor_layouts(
    dist, checkpoints: dict[str, str], tmp_path: Path, tensor: dict[str, Any]
) -> None:
    args = (tensor, checkpoints, str(tmp_path))
    dist.run(_load_and_save, world_size=tensor["size"], args=args, timeout=180.0)


def _gpt2_state() -> dict[str, torch.Tensor]:
    """GPT-2's checkpoint tensors as transformers writes them (the tied head left out)."""
    state = {k: t.clone() for k, t in gpt2_lm().state_dict().items()}
    del state["lm_head.weight"]
    return state


def _write(folder: Path, state: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_plain_model_loads_base_checkpoint_and_strict_errors_name_keys(tmp_path: Path) -> None:
    ref = gpt2_lm()
    ref.transformer.save_pretrained(tmp_path / "base")  # GPT2Model: keys without 'transformer.'
    model = gpt2_lm(seed=5)
    assert load_pretrained(model, tmp_path / "base").missing == []
    assert all(torch.equal(model.state_dict()[k], t) for k, t in ref.state_dict().items())

    missing = _gpt2_state()
    del missing["transformer.ln_f.bias"]
    with pytest.raises(KeyError, match=r"missing keys \['transformer\.ln_f\.bias'\]"):
        load_pretrained(model, _write(tmp_path / "missing", missing))
    keys = load_pretrained(model, tmp_path / "missing", strict=False)
    assert keys.missing == ["transformer.ln_f.bias"] and keys.unexpected == []

    extra = {**_gpt2_state(), "extra.weight": torch.zeros(2)}
    with pytest.raises(KeyError, match=r"unexpected keys \['extra\.weight \(model\.safetensors\)"):
        load_pretrained(model, _write(tmp_path / "extra", extra))

    bad = {**_gpt2_state(), "transformer.h.0.mlp.c_fc.weight": torch.zeros(3, 3)}
    shape = r"'transformer\.h\.0\.mlp\.c_fc\.weight' in model\.safetensors: \[3, 3\], expected"
    with pytest.raises(ValueError, match=shape + r" \[16, 64\]"):
        load_pretrained(model, _write(tmp_path / "bad", bad))

    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor"):
        load_pretrained(model, tmp_path)
    (tmp_path / "index").mkdir()
    index = {"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "index" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"lists \['model-00001-of-00002\.safetensors'\]"):
        load_pretrained(model, tmp_path / "index")


def test_a_model_on_meta_is_allocated_by_the_load(tmp_path: Path) -> None:
    """Without a tensor mode nothing allocates a meta model before ``load_pretrained``: it
    allocates what the model holds (ties and the optimizer's parameters kept) and reads it;
    what the checkpoint lacks is initialized from the module's name, not the generator."""
    ref = gpt2_lm()
    ref.save_pretrained(tmp_path / "full")
    with meta_parameters():
        model = gpt2_lm(seed=5)
    params = list(model.parameters())
    load_pretrained(model, tmp_path / "full")
    assert list(model.parameters()) == params and all(not p.is_meta for p in params)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(torch.equal(model.state_dict()[k], t) for k, t in ref.state_dict().items())
    ids = token_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0.0, atol=0.0)

    state = _gpt2_state()
    del state["transformer.wpe.weight"]  # a position table drawn at random when initialized
    folder = _write(tmp_path / "no-positions", state)
    drawn = []
    for seed in (1, 2):  # as two ranks' own generators would differ
        with meta_parameters():
            model = gpt2_lm(distinct=False)
        torch.manual_seed(seed)
        keys = load_pretrained(model, folder, strict=False)
        assert keys.missing == ["transformer.wpe.weight"]
        drawn.append(model.transformer.wpe.weight.detach())
    assert torch.equal(drawn[0], drawn[1]) and float(drawn[0].std()) > 0


def _whole_modules_alike() -> int:
    """A module ``parallelize`` keeps whole, built on meta, starts equal on every tensor rank
    although the ranks' generators differ (the runner seeds each rank apart)."""
    ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), timeout=60.0)
    try:
        with meta_parameters():
            model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8))
        parallelize(model, {"0": "col", "1": "row"}, context=ctx)
        kept = torch.cat([model[2].weight.detach().flatten(), model[2].bias.detach()])
        everyone = [torch.empty_like(kept) for _ in range(2)]
        torch.distributed.all_gather(everyone, kept, group=ctx.get_group(ParallelMode.TENSOR))
        assert torch.equal(everyone[0], everyone[1]) and float(kept.std()) > 0
    finally:
        ctx.destroy()
    return 0


def test_whole_modules_built_on_meta_start_alike_on_every_rank(dist) -> None:
    dist.run(_whole_modules_alike, world_size=2, timeout=60.0)


def _tokenizer(folder: Path) -> Path:
    """A word-level tokenizer trained here, saved in ``folder`` as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(["hello world", "tiny words here"], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    return folder


def test_save_copies_the_tokenizer_files_beside_the_weights(tmp_path: Path) -> None:
    """``tokenizer_from``: the folder's tokenizer files written with the weights, so that
    ``AutoTokenizer.from_pretrained`` reads the saved folder; a folder without any is refused
    before anything is written."""
    from transformers import AutoTokenizer

    start = _tokenizer(tmp_path / "start")
    save_pretrained(gpt2_lm(), tmp_path / "out", tokenizer_from=start)
    text = "hello tiny world unknown"
    ids = AutoTokenizer.from_pretrained(start)(text)["input_ids"]
    assert (
        len(set(ids)) == 4
        and AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"] == ids
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer file"):
        save_pretrained(gpt2_lm(), tmp_path / "bad", tokenizer_from=tmp_path / "empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out", "start"]


#: (tessera's full shape, the number of blocks each split dim is cut into, the stored form)
FORMS = [
    ((8, 6), {0: 2, 1: 3}, None),  # a 2D tile
    ((8, 6), {0: 2, 1: 3}, FullForm((6, 8), transposed=True)),  # GPT-2's Conv1D
    ((3, 4, 6), {1: 2, 2: 2}, FullForm((12, 6))),  # fused parts of equal size
    ((3, 4, 6), {1: 2, 2: 2}, FullForm((6, 12), transposed=True)),  # GPT-2's c_attn
    ((3, 4), {1: 2}, FullForm((12,))),  # its bias
    ((4, 2, 6, 5), {2: 3}, FullForm((4, 12, 5))),  # experts' gate_up_proj
    ((16, 6), {0: 4, 1: 2}, FullForm((16, 6), sections=(8, 4, 4))),  # q/k/v by group
    ((16, 6), {0: 8}, FullForm((6, 16), transposed=True, sections=(8, 4, 4))),  # half groups
    ((18,), {0: 3}, FullForm((18,), sections=(6, 6, 6))),
]


@pytest.mark.parametrize(("shape", "blocks", "form"), FORMS)
def test_every_block_reads_only_its_elements(
    tmp_path: Path, shape: tuple[int, ...], blocks: dict[int, int], form: FullForm | None
) -> None:
    """Each rank's block of each form, loaded (bf16 into fp32) from the slices of the file that
    hold its elements and nothing more, equals the whole tensor converted and cut."""
    stored = torch.randn(form.original_shape if form else shape).bfloat16()
    folder = _write(tmp_path / "checkpoint", {"w": stored})
    whole = form.from_original(stored.float(), shape) if form else stored.float()
    for ranks in itertools.product(*(range(n) for n in blocks.values())):
        splits = {d: [(f"mode{d}", r, n)] for (d, n), r in zip(blocks.items(), ranks, strict=True)}
        info = ShardInfo.from_split(shape, splits)
        module = nn.Module()
        module.w = nn.Parameter(torch.empty(info.local_shape))
        set_shard_info(module.w, info)
        if form is not None:
            set_full_form(module.w, form)
        with _counting_reads() as read:
            load_pretrained(module, folder)
        assert torch.equal(module.w.detach(), whole[info.slices]), ranks
        assert dict(read) == {"w": module.w.numel()}, ranks


def _every_form_under_fsdp2(folder: str) -> int:
    """Each form's block, a DTensor sharded over 2 data ranks as ZeRO-3 (FSDP2) holds it: each
    rank reads the elements of its rows of the block and nothing more, written in place."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu")
    rank = torch.distributed.get_rank()
    for i, (shape, blocks, form) in enumerate(FORMS):
        torch.manual_seed(i)  # the same tensor on both ranks
        stored = torch.randn(form.original_shape if form else shape).bfloat16()
        path = _write(Path(folder) / f"rank{rank}-form{i}", {"w": stored})
        whole = form.from_original(stored.float(), shape) if form else stored.float()
        splits = {d: [(f"mode{d}", n - 1, n)] for d, n in blocks.items()}  # the last block
        info = ShardInfo.from_split(shape, splits)
        module = nn.Module()
        module.w = nn.Parameter(torch.zeros(info.local_shape))
        fully_shard(module, mesh=mesh)
        set_shard_info(module.w, info)  # as the engine's ZeRO-3 carries them over
        if form is not None:
            set_full_form(module.w, form)
        with _counting_reads() as read:
            load_pretrained(module, path)
        assert torch.equal(module.w.full_tensor(), whole[info.slices]), (i, rank)
        local = module.w.to_local().numel()
        assert dict(read) == ({"w": local} if local else {}), (i, rank, dict(read))
    return 0


def test_every_block_under_zero3_reads_only_its_rows(dist, tmp_path: Path) -> None:
    dist.run(_every_form_under_fsdp2, world_size=2, args=(str(tmp_path),), timeout=60.0)


def test_a_block_not_written_in_place_is_assembled(tmp_path: Path) -> None:
    """A parameter that is not one contiguous tensor gets its block assembled, then copied."""
    stored = torch.randn(6, 12)
    folder = _write(tmp_path / "checkpoint", {"w": stored})
    form = FullForm((6, 12), transposed=True, sections=(4, 4, 4))
    info = ShardInfo.from_split((12, 6), {0: [("mode0", 1, 2)]})
    module = nn.Module()
    module.w = nn.Parameter(torch.empty(6, 6).t())  # not contiguous
    set_shard_info(module.w, info)
    set_full_form(module.w, form)
    load_pretrained(module, folder)
    assert torch.equal(module.w.detach(), form.from_original(stored, (12, 6))[info.slices])


def test_plain_model_saves_in_another_dtype_and_replaces_a_folder(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    ref = gpt2_lm()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.txt").write_text("from an earlier run")
    save_pretrained(ref, tmp_path / "out", dtype=torch.bfloat16, max_shard_size="4KiB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (tmp_path / "out" / "stale.txt").exists()
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as transformers
    for file in files:
        with safe_open(str(tmp_path / "out" / file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                assert torch.equal(f.get_tensor(key), ref.state_dict()[key].bfloat16()), key
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert reloaded.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"max_shard_size '5 parsecs' is not a size"):
        save_pretrained(ref, tmp_path / "other", max_shard_size="5 parsecs")


def _save_fails_on_the_writer(folder: str) -> int:
    """Rank 0 cannot write (the folder's parent is a file; then a full disk in mid-file):
    it raises its OSError, the other rank a RuntimeError naming it, neither waits, and a later
    save works (the ranks stayed in step)."""
    import torch.distributed as torch_dist

    from tessera.context import SafetensorsStream

    ctx = create_context(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), timeout=60.0)
    try:
        model = parallelize(gpt2_lm(), context=ctx)
        rank = ctx.get_local_rank(ParallelMode.GLOBAL)
        root = Path(folder)
        if rank == 0:
            (root / "a-file").write_text("not a folder")
        torch_dist.barrier()
        raised = OSError if rank == 0 else RuntimeError
        with pytest.raises(raised, match=r"a-file|Not a directory|File exists"):
            save_pretrained(model, root / "a-file" / "out")

        real = SafetensorsStream.write
        written: list[str] = []

        def full_disk(self: Any, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
            if written:
                raise OSError(errno.ENOSPC, "No space left on device")
            written.append(key)
            real(self, key, tensor, dtype)

        SafetensorsStream.write = full_disk  # type: ignore[method-assign]
        try:
            with pytest.raises(raised, match=r"No space left on device"):
                save_pretrained(model, root / "out", max_shard_size="8KB")
        finally:
            SafetensorsStream.write = real  # type: ignore[method-assign]
        assert written == (["transformer.wte.weight"] if rank == 0 else [])
        assert sorted(p.name for p in root.iterdir()) == ["a-file"]  # no folder, no temp left
        torch_dist.barrier()  # both looked before rank 0 starts the next save's temp folder

        save_pretrained(model, root / "out")
        assert (root / "out" / "model.safetensors").is_file()
    finally:
        ctx.destroy()
    return 0


def test_a_failed_write_raises_on_every_rank(dist, tmp_path: Path) -> None:
    dist.run(_save_fails_on_the_writer, world_size=2, args=(str(tmp_path),), timeout=120.0)
