"""A transformers model under every layout next to one process: loss curves side by side.

    python examples/hf/parity.py [--model gpt2|llama|...|cohere] [--kv-heads N]
        [--steps 20] [--configs 1d 2d ...]

Each layout is launched with torchrun (``examples/hf/train.py``) from the same weights on the
same batches; the table gives each run's final test loss and the largest relative difference
of its per-step training losses from the single-process run's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launch import run_example
from models import KINDS

#: config -> ranks
LAYOUTS = {
    "1d": 2,
    "1d_sp": 2,
    "2d": 4,
    "2p5d": 8,
    "3d": 8,
    "sequence": 2,
    "data_2d": 8,
    "zero3_1d": 4,
    "pipeline_1d": 4,  # GPT-2: its tied head on the last stage, a copy of the embedding
    "pipeline_2d": 8,
    "pipeline_sequence": 4,  # every stage holds this rank's chunk of the tokens
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="gpt2",
        choices=KINDS,
    )
    parser.add_argument(
        "--kv-heads", type=int, help="key/value heads (default half the query heads; 1: MQA)"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--configs", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    overrides = [f"model.kind={args.model}", f"train.steps={args.steps}"]
    if args.kv_heads is not None:
        overrides.append(f"model.kv_heads={args.kv_heads}")
    with tempfile.TemporaryDirectory(prefix="tessera-hf-") as tmp:

        def run(config: str, nproc: int) -> dict[str, object]:
            result = Path(tmp) / f"{config}.json"
            return run_example(
                "hf/train.py", f"hf/configs/{config}.py", nproc, result, overrides, quiet=True
            )

        single = run("single", 1)
        rows = [
            (name, nproc, run(name, nproc))
            for name, nproc in LAYOUTS.items()
            if name in args.configs
        ]
    base = single["losses"]
    assert isinstance(base, list)
    kv = "" if args.kv_heads is None else f" with {args.kv_heads} key/value heads"
    base_loss = f"single process test loss {single['test_loss']:.6f}"
    print(f"\n{args.model}{kv}, {args.steps} steps: {base_loss}")
    print(f"{'layout':>11} {'ranks':>5} {'test loss':>10} {'max rel. diff of losses':>24}")
    for name, nproc, result in rows:
        losses = result["losses"]
        assert isinstance(losses, list)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, base, strict=True))
        print(f"{name:>11} {nproc:>5} {result['test_loss']:>10.6f} {worst:>24.2e}")


if __name__ == "__main__":
    main()
