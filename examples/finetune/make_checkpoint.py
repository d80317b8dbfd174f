"""A stand-in for a downloaded checkpoint: a small GPT-2 and its own tokenizer, in one folder.

    python examples/finetune/make_checkpoint.py gpt2-small-standin

Nothing can be downloaded here, so this writes what a download would hold: ``config.json`` and
``model.safetensors`` from transformers' ``save_pretrained`` (random weights), and a byte-level
BPE tokenizer trained locally with the ``tokenizers`` package on the Python standard library's
source (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``), so that
``AutoTokenizer.from_pretrained(folder)`` and ``AutoModelForCausalLM.from_pretrained(folder)``
work as they would on a real one. Dropout is off unless ``--dropout`` says otherwise: the tests
compare a parallel fine-tune with one process, which dropout's masks would draw apart.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch

__all__ = ["make_checkpoint", "stdlib_sources"]

#: The tokenizer's end-of-text token, GPT-2's spelling.
EOS = "<|endoftext|>"


def stdlib_sources(limit: int | None = None) -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted (the first ``limit``)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return files[:limit] if limit is not None else files


def _train_tokenizer(vocab_size: int) -> object:
    """A byte-level BPE of ``vocab_size`` tokens (``EOS`` first), trained on stdlib sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (f.read_text(encoding="utf-8", errors="replace") for f in stdlib_sources(40))
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=EOS, eos_token=EOS, unk_token=EOS, model_max_length=1024
    )


def make_checkpoint(
    folder: str | os.PathLike[str],
    *,
    vocab_size: int = 512,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    positions: int = 128,
    dropout: float = 0.0,
    seed: int = 0,
) -> Path:
    """Write a GPT-2 of random weights and a tokenizer into ``folder``; returns the folder.

    ``vocab_size`` must divide by the tensor ranks that split the vocabulary (512: any of
    1, 2, 4, 8).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = _train_tokenizer(vocab_size)
    eos = tokenizer.convert_tokens_to_ids(EOS)  # type: ignore[attr-defined]
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=positions,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    with torch.random.fork_rng():  # the caller's generator stays as it was
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    out = Path(folder)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where to write the checkpoint")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args()
    out = make_checkpoint(
        args.folder,
        vocab_size=args.vocab_size,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        dropout=args.dropout,
    )
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
