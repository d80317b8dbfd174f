"""transformers checkpoint folders in and out of ZeRO-3 (FSDP2) and pipeline stages.

``load_pretrained`` / ``save_pretrained`` (tessera-layers) on what the engine and the pipeline
make of a parallelized model, which tessera-layers' own tests cannot build: parameters that
ZeRO-3 turned into DTensors over DATA (loaded after ``initialize``, each data rank reading its
rows of its tensor-parallel block; or loaded before, then sharded), and a pipeline stage of
``pipeline_layers`` (the model's names, GPT-2's head tied to the embedding across the
stages), under 1D and over 2 data replicas (ZeRO-1; only the first replica writes). Each
loaded model equals the single-process one (its logits, or every tensor a stage holds), and
each saved folder loads with transformers' ``from_pretrained`` into the same logits, every
tensor written once. An engine checkpoint of such a run is exported offline, in one process
(tessera-engine's ``export_pretrained``), as a folder ``from_pretrained`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

#: One GPT-2 for every case: Conv1D weights, fused q/k/v, a head tied to the embedding.
CONFIG: dict[str, Any] = dict(
    vocab_size=32,
    n_positions=16,
    n_embd=16,
    n_layer=2,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    bos_token_id=None,
    eos_token_id=None,
)
#: (parallel config, ZeRO stage, load before initialize) per case; 4 ranks each. (ZeRO-3 with
#: a pipeline is refused by the engine.)
#: Without a tensor mode nothing is allocated before load_pretrained: the stages of
#: "data-pipeline-zero1" allocate their own layers only when loaded, and "zero3" reaches
#: initialize on meta (FSDP2 shards it there) and each rank allocates and reads its rows.
CASES: dict[str, tuple[dict[str, Any], int, bool]] = {
    "zero3-1d": (dict(data=2, tensor=dict(size=2, mode="1d")), 3, False),
    "zero3-1d-loaded-before": (dict(data=2, tensor=dict(size=2, mode="1d")), 3, True),
    "pipeline-1d": (dict(pipeline=2, tensor=dict(size=2, mode="1d")), 0, False),
    # build_pipeline_model(num_chunks=2): each rank holds two chunks, a list of stages
    "interleaved-1d": (dict(pipeline=2, tensor=dict(size=2, mode="1d")), 0, False),
    "data-pipeline-zero1": (dict(data=2, pipeline=2), 1, True),
    "zero3": (dict(data=4), 3, False),
}


def _reference() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**CONFIG)).eval()


def _ids() -> torch.Tensor:
    return torch.randint(
        0, CONFIG["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(3)
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The reference GPT-2 as transformers writes it, and a tokenizer beside it.

    One file, no ``lm_head.weight``; a word-level tokenizer trained here, as a downloaded
    folder holds one.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("gpt2") / "checkpoint"
    _reference().save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(["hello world", "tiny words here"], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    return str(folder)


def _load_and_save(case: str, folder: str, out: str) -> int:
    """One case on 4 ranks: built, loaded, compared with one process, saved, reloaded.

    Built on meta and parallelized (a stage of it under a pipeline), ``folder`` loaded before
    or after ``initialize``; the saved folder checked on rank 0.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from tessera.context import ParallelMode, create_context, original_names_of
    from tessera.engine import initialize
    from tessera.layers import (
        gather_full_state_dict,
        gather_logits,
        load_pretrained,
        meta_parameters,
        parallelize,
        parallelize_pretrained,
        pipeline_layers,
        save_pretrained,
    )
    from tessera.pipeline import build_pipeline_model

    parallel, zero, before = CASES[case]
    config = dict(parallel=parallel, num_microbatches=2)
    ctx = create_context(config, timeout=60.0)
    try:
        torch.manual_seed(7)  # the replicas agree before the load (initialize checks them)
        if case == "zero3":  # the class from config.json, on meta, not loaded yet
            model: nn.Module = parallelize_pretrained(folder, load=False, context=ctx)
        else:
            with meta_parameters():  # parallelize allocates the shards of a tensor mode, if any
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
            model = parallelize(model, context=ctx)
        staged = ctx.get_world_size(ParallelMode.PIPELINE) > 1
        if staged:
            chunks = 2 if case.startswith("interleaved") else 1
            model = build_pipeline_model(pipeline_layers(model), num_chunks=chunks, context=ctx)
            assert isinstance(model, list) == (chunks > 1)
        unallocated = "tensor" not in parallel
        assert all(p.is_meta for p in model.parameters()) == unallocated
        if before:
            load_pretrained(model, folder, context=ctx)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        settings = {"zero": {"stage": zero}} if zero else {}
        initialize(model, optimizer, config={**config, **settings}, context=ctx)
        if not before:
            if unallocated:  # FSDP2 sharded it on meta: no rank held the whole model
                assert all(p.is_meta for p in model.parameters())
            load_pretrained(model, folder, context=ctx)
        if zero == 3:
            assert any(type(p).__name__ == "DTensor" for p in model.parameters())
            local = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[operator]
            assert local * ctx.data_size < 1.25 * sum(p.numel() for p in model.parameters())

        ref = _reference()
        if staged:  # every tensor the stage (each chunk) holds, under the model's names
            state = ref.state_dict()
            for part in model if isinstance(model, list) else [model]:
                names = original_names_of([part])
                for name, t in gather_full_state_dict(part, context=ctx).items():
                    assert torch.equal(t, state[names[name]]), name
        else:
            with torch.no_grad():
                logits = gather_logits(model.eval()(_ids()).logits, context=ctx)
                torch.testing.assert_close(logits, ref(_ids()).logits, rtol=1e-5, atol=1e-5)

        target = Path(out) / case
        save_pretrained(model, target, max_shard_size="8KB", context=ctx)
        if ctx.get_local_rank(ParallelMode.GLOBAL) == 0:
            index = json.loads((target / "model.safetensors.index.json").read_text())
            assert sorted(index["weight_map"]) == sorted(
                k for k in ref.state_dict() if k != "lm_head.weight"
            )  # every tensor once, the tied head left out as transformers does
            reloaded = AutoModelForCausalLM.from_pretrained(target).eval()
            with torch.no_grad():
                torch.testing.assert_close(reloaded(_ids()).logits, ref(_ids()).logits, **EXACT)
    finally:
        ctx.destroy()
    return 0


EXACT: dict[str, float] = dict(rtol=0.0, atol=0.0)


@pytest.mark.parametrize("case", list(CASES))
def test_load_and_save_under_zero3_and_pipeline(
    dist: Any, checkpoint: str, tmp_path: Path, case: str
) -> None:
    """Each case loads like one process and saves a folder ``from_pretrained`` reads."""
    dist.run(_load_and_save, world_size=4, args=(case, checkpoint, str(tmp_path)), timeout=120.0)


def _train_and_checkpoint(folder: str, path: str) -> dict[str, Any] | None:
    """GPT-2 from ``folder`` trained one step by the engine, checkpointed: 2 replicas x 1D.

    1D on 2 ranks (GPT-2's ``Conv1D`` held transposed, q/k/v fused), replicated over 2 data
    ranks so that the 4 ranks of the module's other cases run it.

    Returns (rank 0) the gathered weights (the original class's names and forms) and the
    parallel model's logits after the step.
    """
    from tessera.context import ParallelMode, create_context
    from tessera.engine import initialize, save_checkpoint
    from tessera.layers import gather_full_state_dict, gather_logits, parallelize_pretrained

    config = dict(parallel=dict(data=2, tensor=dict(size=2, mode="1d")))
    ctx = create_context(config, timeout=60.0)
    try:
        model = parallelize_pretrained(folder, context=ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, *_ = initialize(model, optimizer, config=config, context=ctx)
        engine.zero_grad()
        engine.backward(engine(_ids(), labels=_ids()).loss)
        engine.step()
        save_checkpoint(path, engine, step=1)
        full = gather_full_state_dict(model, context=ctx)
        with torch.no_grad():
            logits = gather_logits(model.eval()(_ids()).logits, context=ctx)
        root = ctx.get_local_rank(ParallelMode.GLOBAL) == 0
    finally:
        ctx.destroy()
    return dict(full=full, logits=logits) if root else None


def test_export_an_engine_checkpoint_offline(dist: Any, checkpoint: str, tmp_path: Path) -> None:
    """An engine checkpoint exported in this process, without a context, as a transformers folder.

    Written by 2 replicas x 1D; from_pretrained's logits equal the trained weights' and the
    parallel model's.
    """
    from safetensors import safe_open
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, GPT2Model

    from tessera.engine import export_pretrained
    from tessera.engine.export import main

    saved = tmp_path / "step_00000001"
    trained, *_ = dist.run(
        _train_and_checkpoint, world_size=4, args=(checkpoint, str(saved)), timeout=120.0
    )
    ref = GPT2LMHeadModel(GPT2Config.from_pretrained(checkpoint)).eval()
    ref.load_state_dict(trained["full"])
    with torch.no_grad():
        expected = ref(_ids()).logits
    torch.testing.assert_close(expected, trained["logits"], rtol=1e-5, atol=1e-5)
    assert not torch.equal(
        ref.transformer.h[0].attn.c_attn.weight,
        _reference().state_dict()["transformer.h.0.attn.c_attn.weight"],
    )  # the step changed it

    # the command: the class from the starting folder's config.json, sharded past 8 KB
    assert (
        main([str(saved), str(tmp_path / "cli"), "--config", checkpoint, "--max-shard-size", "8KB"])
        == 0
    )
    index = json.loads((tmp_path / "cli" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(
        k for k in ref.state_dict() if k != "lm_head.weight"
    )
    # the function: a class and its config, in bf16
    config = GPT2Config.from_pretrained(checkpoint)
    export_pretrained(
        saved, tmp_path / "bf16", GPT2LMHeadModel, config=config, dtype=torch.bfloat16
    )
    for out, exact in (("cli", EXACT), ("bf16", dict(rtol=0.05, atol=0.05))):
        reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / out).eval()
        with torch.no_grad():
            logits = reloaded.float()(_ids()).logits
        torch.testing.assert_close(logits, expected, **exact)
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    # the starting folder's tokenizer beside the weights (by default, from --config's folder)
    text = "hello tiny world unknown"
    ids = AutoTokenizer.from_pretrained(checkpoint)(text)["input_ids"]
    assert len(set(ids)) == 4
    assert AutoTokenizer.from_pretrained(tmp_path / "cli")(text)["input_ids"] == ids
    assert not (tmp_path / "bf16" / "tokenizer.json").exists()  # a class names no folder

    # the base model of the LM run: 'transformer.' stripped, the head left out
    base = tmp_path / "base"
    assert main([str(saved), str(base), "--config", checkpoint, "--write-as", "GPT2Model"]) == 0
    assert json.loads((base / "config.json").read_text())["architectures"] == ["GPT2Model"]
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(ref.transformer.state_dict())
    with torch.no_grad():
        hidden = GPT2Model.from_pretrained(base).eval()(_ids()).last_hidden_state
        torch.testing.assert_close(hidden, ref.transformer(_ids()).last_hidden_state, **EXACT)

    deeper = GPT2Config.from_pretrained(checkpoint, n_layer=3)  # not the trained model
    with pytest.raises(KeyError, match=r"missing keys \['transformer\.h\.2\.ln_1\.weight'"):
        export_pretrained(saved, tmp_path / "deeper", GPT2LMHeadModel, config=deeper)
    assert not (tmp_path / "deeper").exists()
