"""Engine overhead against a plain PyTorch loop, in one process.

Same model, same data, same optimizer; the two loops alternate round by round so drifts of the
machine (other processes, clock boosts) hit both alike. Prints the per-step median of each and
the ratio engine / plain (goal: <= 1.03). No timed assertion: this is a measurement.

    python benchmarks/bench_engine.py [--steps 40] [--rounds 7] [--hidden 512]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from tessera.engine import Engine


def make_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(hidden, 4 * hidden),
        nn.GELU(),
        nn.Linear(4 * hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, 10),
    )


def plain_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loss_fn: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()


def engine_step(engine: Engine, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    engine.zero_grad()
    engine.execute_schedule(iter([batch]))
    engine.step()


def timed(fn: Callable[[], None], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(args.batch, args.hidden, generator=g).to(device),
            torch.randint(0, 10, (args.batch,), generator=g).to(device),
        )
        for _ in range(args.steps)
    ]
    plain_model = make_model(args.hidden).to(device)
    plain_opt = torch.optim.Adam(plain_model.parameters(), lr=1e-3)
    engine_model = make_model(args.hidden).to(device)
    engine = Engine(
        engine_model, torch.optim.Adam(engine_model.parameters(), lr=1e-3), nn.CrossEntropyLoss()
    )
    loss_fn = nn.CrossEntropyLoss()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    plain_model.train()
    engine.train()
    for batch in batches[:5]:  # warm-up (allocator, kernels, Adam state)
        plain_step(plain_model, plain_opt, loss_fn, batch)
        engine_step(engine, batch)
    sync()
    # Alternate step by step (and swap who goes first every round): on a shared machine a
    # burst of load then hits both loops alike; the medians discard the outliers.
    plain_t: list[float] = []
    engine_t: list[float] = []
    for r in range(args.rounds):
        for i, batch in enumerate(batches):
            first_plain = (r + i) % 2 == 0
            for is_plain in (first_plain, not first_plain):
                if is_plain:
                    plain_t.append(
                        timed(lambda b=batch: plain_step(plain_model, plain_opt, loss_fn, b), sync)
                    )
                else:
                    engine_t.append(timed(lambda b=batch: engine_step(engine, b), sync))
    p, e = statistics.median(plain_t), statistics.median(engine_t)
    p_min, e_min = min(plain_t), min(engine_t)
    print(
        f"device {device}, hidden {args.hidden}, batch {args.batch}, "
        f"{args.steps} steps x {args.rounds} rounds"
    )
    print(f"plain PyTorch loop : {p * 1e3:8.3f} ms/step (median)")
    print(f"tessera Engine     : {e * 1e3:8.3f} ms/step (median)")
    print(f"ratio engine/plain : {e / p:.3f} (medians), {e_min / p_min:.3f} (minima)  goal <= 1.03")


if __name__ == "__main__":
    main()
