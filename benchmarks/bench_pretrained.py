"""``load_pretrained``: each rank's peak memory while loading a checkpoint, against its shard.

A transformers GPT-2 checkpoint (random weights, fp32, about 165 MB: hidden 768, 5 blocks,
vocabulary 8192) is written once into a temporary folder. Then, on 4 spawned gloo ranks under
``1d`` and ``2d``, every rank builds the model on the meta device, parallelizes it (only its
shards are allocated) and loads the folder two ways, each measured as the rise of the
process's peak resident memory during the load (``VmHWM`` of ``/proc/self/status``, reset
by writing ``5`` to ``/proc/self/clear_refs`` just before):

* ``load_pretrained(model, folder)``: each rank reads only the slices of its blocks;
* the old way, ``load_full_state_dict(model, state)`` with the whole state dict read first
  (``safetensors.torch.load_file``), as docs/parallelize.md showed before.

The sliced load runs first in each process (the old way, reusing the little heap it freed,
rises a little less than alone: conservative). Printed per rank: its shard (the bytes of the
tensors it holds, allocated by ``parallelize`` before the load), each load's peak rise, the
peak over the shard and the sliced rise over the checkpoint's largest tensor. The goal is a
sliced load's peak within its shard plus one tensor (the pages of the file a read touches
count as resident while the file is open, so ``load_pretrained`` opens it per tensor; a
column block touches every page of its tensor: 2d's embedding, split by columns, rises by
about 1.1 of the largest tensor); the old way's rise is the whole checkpoint. Prints, asserts
nothing.

    python benchmarks/bench_pretrained.py [--layers 5] [--hidden 768]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from meters import run_ranks

WORLD = 4
LAYOUTS = {"1d": dict(size=WORLD, mode="1d"), "2d": dict(size=WORLD, mode="2d")}
MIB = 2**20


def config(layers: int, hidden: int) -> Any:
    """A GPT-2 config: Conv1D weights, fused q/k/v, a head tied to the embedding."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=8192,
        n_positions=256,
        n_embd=hidden,
        n_layer=layers,
        n_head=12,
        bos_token_id=None,
        eos_token_id=None,
    )


def write_checkpoint(folder: Path, layers: int, hidden: int) -> tuple[int, int]:
    """The checkpoint, with random weights; its size and its largest tensor, in bytes."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(config(layers, hidden))
    model.save_pretrained(folder)
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    return (folder / "model.safetensors").stat().st_size, max(sizes)


def _status(field: str) -> int:
    """A ``/proc/self/status`` field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_rise(load: Any) -> tuple[int, float]:
    """The rise of the peak resident memory during ``load()`` and its seconds."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    start = time.perf_counter()
    load()
    seconds = time.perf_counter() - start
    return _status("VmHWM") - base, seconds


def rank_loads(
    rank: int, world: int, port: int, folder: str, tensor: dict[str, Any]
) -> dict[str, Any]:
    """One rank: build on meta, parallelize, load both ways; its shard and both peak rises.

    The sliced load first: memory a load frees stays in the allocator's heap (resident), and
    the old way, reusing the little the sliced load freed, rises a little less than it would
    alone (the comparison is conservative).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from tessera.context import create_context
    from tessera.layers import load_full_state_dict, load_pretrained, meta_parameters, parallelize

    ctx = create_context(dict(parallel=dict(tensor=tensor)))
    try:
        with meta_parameters():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        model = parallelize(model, context=ctx)
        held = {id(t): t for t in model.state_dict(keep_vars=True).values()}
        shard = sum(t.numel() * t.element_size() for t in held.values())

        def whole() -> None:
            state = load_file(str(Path(folder) / "model.safetensors"))
            state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: left out
            load_full_state_dict(model, state)
            del state

        sliced = _peak_rise(lambda: load_pretrained(model, folder))
        old = _peak_rise(whole)
        return dict(shard=shard, sliced=sliced, old=old)
    finally:
        ctx.destroy()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root) / "gpt2"
        size, largest = write_checkpoint(folder, args.layers, args.hidden)
        print(
            f"GPT-2 checkpoint: {size / MIB:.0f} MiB fp32 ({args.layers} blocks, hidden "
            f"{args.hidden}); largest tensor {largest / MIB:.1f} MiB; {WORLD} ranks"
        )
        print(
            f"{'layout':<7}{'rank':>5}{'shard':>9}{'sliced':>9}{'old way':>9}"
            f"{'peak/shard: sliced':>20}{'old':>6}{'sliced/largest':>16}{'old/sliced':>12}"
            f"{'seconds: sliced':>17}{'old':>6}"
        )
        for name, tensor in LAYOUTS.items():
            for rank, r in enumerate(run_ranks(rank_loads, WORLD, str(folder), tensor)):
                shard, (new, new_s), (old, old_s) = r["shard"], r["sliced"], r["old"]
                print(
                    f"{name:<7}{rank:>5}{shard / MIB:>8.1f}M{new / MIB:>8.1f}M{old / MIB:>8.1f}M"
                    f"{(shard + new) / shard:>20.2f}{(shard + old) / shard:>6.2f}"
                    f"{new / largest:>16.2f}{old / max(new, 1):>12.2f}{new_s:>17.2f}{old_s:>6.2f}"
                )
    print(
        "shard: the bytes this rank holds (allocated by parallelize before the load); sliced, "
        "old way: the rise of its peak resident memory (VmHWM) during load_pretrained, and "
        "during reading the whole state dict + load_full_state_dict; peak/shard: (shard + "
        "rise) / shard; sliced/largest: the sliced load's rise in the checkpoint's largest "
        "tensors (the goal: at most 1)"
    )


if __name__ == "__main__":
    main()
