"""The README's demo: the ViT on scikit-learn's digits, single process and hybrid parallel.

    python examples/demo.py [--config hybrid] [--nproc 8] [--steps 66]

Both runs start from the same full weights and read the same batches; the hybrid one runs on
8 CPU processes (gloo): 2 data-parallel replicas x 2 pipeline stages (1F1B) x 1D tensor
parallelism over 2 ranks. Each is launched with torchrun; at the end the two test accuracies
are printed side by side.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launch import run_example

LAYOUTS = {
    "single": "single process",
    "hybrid": "data 2 x pipeline 2 (1F1B) x 1D tensor 2",
    "hybrid_2d": "data 2 x pipeline 2 (1F1B) x 2D tensor 2x2",
    "pipeline_2d": "pipeline 2 (1F1B) x 2D tensor 2x2",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="hybrid", help="a config under examples/vit/configs")
    parser.add_argument("--nproc", type=int, default=8, help="its number of ranks")
    parser.add_argument("--steps", type=int, default=66, help="training steps of both runs")
    args = parser.parse_args()
    start = time.perf_counter()
    print(
        "tessera demo: a Vision Transformer on scikit-learn's digits (1,408 train / 384 test "
        f"images), {args.steps} steps, trained twice from the same initial weights.\n",
        flush=True,
    )
    runs = [("single", 1), (args.config, args.nproc)]
    results = []
    with tempfile.TemporaryDirectory(prefix="tessera-demo-") as tmp:
        for i, (name, nproc) in enumerate(runs, 1):
            print(f"[{i}/2] {LAYOUTS.get(name, name)}: {nproc} process(es)", flush=True)
            results.append(
                run_example(
                    "vit/train.py",
                    f"vit/configs/{name}.py",
                    nproc,
                    Path(tmp) / f"{name}.json",
                    overrides=[f"train.steps={args.steps}"],
                )
            )
            print(flush=True)
    single, hybrid = results
    deviation = max(
        abs(a - b) / abs(b) for a, b in zip(hybrid["losses"], single["losses"], strict=True)
    )
    rows = [
        ("layout", "ranks", "test accuracy", "final loss", "script time", "wall time"),
        *(
            (
                LAYOUTS.get(name, name),
                str(r["world_size"]),
                f"{r['test_accuracy']:.4f}",
                f"{r['losses'][-1]:.4f}",
                f"{r['seconds']:.1f} s",
                f"{r['wall_seconds']:.0f} s",
            )
            for (name, _), r in zip(runs, results, strict=True)
        ),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print("=" * (sum(widths) + 3 * (len(widths) - 1)))
    for row in rows:
        print("   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    print("=" * (sum(widths) + 3 * (len(widths) - 1)))
    print(
        "script time: measured inside the training script (on the rank that prints) from the\n"
        "  start of its main(): launch, model, data, training and test; the clock behind the\n"
        "  '(N s)' each run prints after its test accuracy.\n"
        "wall time: from starting torchrun to its exit, so also process start-up and imports.",
    )
    print(
        f"largest relative difference between the two loss curves over {len(single['losses'])} "
        f"steps: {deviation:.1e}\ndemo finished in {time.perf_counter() - start:.0f} s "
        "(both runs, from the start of this script)",
        flush=True,
    )


if __name__ == "__main__":
    main()
