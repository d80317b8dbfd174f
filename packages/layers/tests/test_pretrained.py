"""transformers checkpoint folders: loaded one tensor at a time into a parallelized model built
on the meta device, and written back from it so that ``from_pretrained`` reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import gpt2_lm, llama_lm, token_ids
from torch import nn
from tp_reference import TOL

from tessera.context import ParallelMode, create_context
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
    the logits one process's; saved back, ``from_pretrained`` computes them too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ctx = create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)
    try:
        for name, folder in folders.items():
            ref = _reference(name)
            if name == "gpt2":  # by hand: build on meta, parallelize, load
                with meta_parameters():
                    empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
                model = parallelize(empty, context=ctx)
                load_pretrained(model, folder)
            else:  # in one line, the class from config.json
                model = parallelize_pretrained(folder, context=ctx)
            model.eval()
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
            save_pretrained(model, target, max_shard_size="8KB" if name == "gpt2" else "5GB")
            if ctx.get_local_rank(ParallelMode.GLOBAL) == 0:
                _check_saved(target, name, ref, sharded=name == "gpt2")
    finally:
        ctx.destroy()
    return 0


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
