"""Cheap checks that the examples still work, run by ``nox -s demo`` before the demo itself.

No process group is started: every config file must load and describe a valid layout for
the world size its own ``torchrun --nproc-per-node N`` line names; the ViT and the GPT, built
without tessera's context (plain torch), must take a training step with a finite loss; and the
qkv layout conversion for ring self-attention must match an explicit per-head permutation.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent
sys.path[:0] = [str(EXAMPLES), str(EXAMPLES / "vit"), str(EXAMPLES / "gpt")]

from toolkit.transformer import to_ring_layout  # noqa: E402

from tessera.context import ParallelConfig  # noqa: E402
from tessera.registry import Config  # noqa: E402

NPROC = re.compile(r"--nproc-per-node[ =](\d+)")


def check_configs() -> int:
    count = 0
    for path in sorted(EXAMPLES.glob("*/configs/*.py")):
        match = NPROC.search(path.read_text())
        if match is None:
            raise AssertionError(f"{path}: no 'torchrun --nproc-per-node N' line in its comment")
        world = int(match.group(1))
        cfg = Config.from_file(path)
        parallel = ParallelConfig.from_dict(cfg.get("parallel"), world)
        if parallel.world_size != world:
            raise AssertionError(f"{path}: world size {parallel.world_size} != {world}")
        count += 1
    return count


def check_vit() -> float:
    import importlib

    vit = importlib.import_module("model")
    data = importlib.import_module("data")
    train, test = data.digits()
    if (len(train), len(test)) != (data.NUM_TRAIN, data.NUM_TEST):
        raise AssertionError(f"digits split is {len(train)} / {len(test)}")
    torch.manual_seed(0)
    model = vit.build_vit()
    images, labels = train.tensors[0][:16], train.tensors[1][:16]
    loss = vit.ViTLoss()(model(images), labels)
    loss.backward()
    correct, total = vit.ViTAccuracy()(model(images).detach(), labels)
    if not (math.isfinite(loss.item()) and total == 16 and 0 <= int(correct) <= 16):
        raise AssertionError(f"ViT step: loss {loss.item()}, accuracy {correct}/{total}")
    del sys.modules["model"], sys.modules["data"]
    return float(loss.item())


def check_gpt() -> float:
    import importlib

    sys.path.remove(str(EXAMPLES / "vit"))
    gpt = importlib.import_module("model")
    data = importlib.import_module("data")
    text = data.corpus()
    vocab = data.CharVocab(text)
    if vocab.decode(vocab.encode(text[:200])) != text[:200] or vocab.size % 16:
        raise AssertionError("character vocabulary does not round-trip or is not padded")
    train, _ = data.windows(vocab.encode(text), 16, 4)
    torch.manual_seed(0)
    model = gpt.build_gpt(vocab.size, seq_len=16, hidden=32)
    inputs, targets = train.tensors[0][:4], train.tensors[1][:4]
    loss = gpt.GPTLoss()(model(inputs), targets)
    loss.backward()
    sample = gpt.generate(model.eval(), vocab.encode("def "), 8, 16, len(vocab.chars))
    if not math.isfinite(loss.item()) or sample.shape != (12,):
        raise AssertionError(f"GPT step: loss {loss.item()}, sample shape {tuple(sample.shape)}")
    return float(loss.item())


def check_ring_layout() -> None:
    heads, d, hidden = 2, 3, 6
    weight = torch.arange(3 * hidden * hidden, dtype=torch.float32).view(3 * hidden, hidden)
    converted = to_ring_layout({"1.attn.qkv.weight": weight}, heads)["1.attn.qkv.weight"]
    for h in range(heads):
        for part in range(3):  # q, k, v
            ours = weight[(h * 3 + part) * d : (h * 3 + part + 1) * d]
            ring = converted[(part * heads + h) * d : (part * heads + h + 1) * d]
            if not torch.equal(ours, ring):
                raise AssertionError(f"to_ring_layout: head {h}, part {part} misplaced")


def main() -> None:
    configs = check_configs()
    vit_loss = check_vit()
    gpt_loss = check_gpt()
    check_ring_layout()
    print(
        f"examples ok: {configs} configs valid for their world sizes; ViT step loss "
        f"{vit_loss:.3f}, GPT step loss {gpt_loss:.3f}; ring qkv layout matches"
    )


if __name__ == "__main__":
    main()
