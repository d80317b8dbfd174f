"""Colossal-AI's pipeline tutorial (ResNet, BatchNorm) in tessera's spelling, with its parity check.

    torchrun --nproc-per-node 2 examples/resnet_pipeline/train.py [--chunks 2] [--tensor-shape]

The tutorial's lines map one to one: ``colossalai.get_default_parser`` ->
``tessera.context.get_default_parser``, ``colossalai.launch_from_torch`` ->
``tessera.context.launch_from_torch``, ``colossalai.builder.build_pipeline_model`` ->
``tessera.pipeline.build_pipeline_model``, ``colossalai.logging`` and
``colossalai.nn.lr_scheduler`` -> ``tessera.engine``, ``colossalai.initialize`` ->
``tessera.engine.initialize``. The model is a small ResNet (BasicBlocks, BatchNorm) as one
``nn.Sequential``, the data random CIFAR-shaped images, so it runs in seconds on CPUs.

After the steps every rank checks its stage against one process that trains the same full model
on the same batches, accumulating the same microbatches: parameters and BatchNorm statistics
must agree. The full model is built right after seeding, on every rank alike: built from each
rank's own stream, the stages would be parts of different models.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tessera.context import get_default_parser, launch_from_torch
from tessera.engine import LinearWarmupLR, disable_existing_loggers, get_dist_logger, initialize
from tessera.pipeline import build_pipeline_model

BATCH_SIZE, NUM_MICRO_BATCHES, STEPS = 8, 4, 3


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (He et al. 2016)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )
            if stride != 1 or inplanes != planes
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.downsample(x))


def resnet(num_classes: int = 10) -> nn.Sequential:
    """A small ResNet as a sequence of layers, each taking the previous one's output."""
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU()),
        BasicBlock(8, 8),
        BasicBlock(8, 16, stride=2),
        BasicBlock(16, 16),
        BasicBlock(16, 32, stride=2),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes)),
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH_SIZE, 3, 32, 32, generator=g),
            torch.randint(0, 10, (BATCH_SIZE,), generator=g),
        )
        for _ in range(STEPS)
    ]


def reference(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
    """One process: the same microbatches, their mean loss's gradients accumulated."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = LinearWarmupLR(optimizer, STEPS, warmup_steps=1)
    criterion = nn.CrossEntropyLoss()
    model.train()
    for x, y in data:
        optimizer.zero_grad()
        for xm, ym in zip(x.chunk(NUM_MICRO_BATCHES), y.chunk(NUM_MICRO_BATCHES), strict=True):
            (criterion(model(xm), ym) / NUM_MICRO_BATCHES).backward()
        optimizer.step()
        scheduler.step()
    return model


def main() -> None:
    parser = get_default_parser()
    parser.add_argument("--chunks", type=int, default=1, help="NUM_CHUNKS (2: interleaved)")
    parser.add_argument("--tensor-shape", action="store_true", help="declare TENSOR_SHAPE")
    args = parser.parse_args()
    disable_existing_loggers()
    config = dict(NUM_MICRO_BATCHES=NUM_MICRO_BATCHES, parallel=dict(pipeline=2))
    if args.tensor_shape:
        if args.chunks != 1:
            raise SystemExit("--tensor-shape: every cut must send one shape; use --chunks 1")
        config["TENSOR_SHAPE"] = (BATCH_SIZE // NUM_MICRO_BATCHES, 16, 16, 16)  # after block 2
    ctx = launch_from_torch(config, backend=args.backend)
    logger = get_dist_logger()

    torch.manual_seed(0)  # the same full model on every rank (and for the reference)
    model = resnet()
    full = copy.deepcopy(model)
    method = [0, 3, 6] if args.chunks == 1 else "uniform"
    model = build_pipeline_model(model, num_chunks=args.chunks, method=method, verbose=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    lr_scheduler = LinearWarmupLR(optimizer, STEPS, warmup_steps=1)
    engine, _, _, lr_scheduler = initialize(
        model, optimizer, nn.CrossEntropyLoss(), lr_scheduler=lr_scheduler
    )

    data = batches()
    engine.train()
    for step, (x, y) in enumerate(data):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(iter([(x, y)]))
        engine.step()
        lr_scheduler.step()
        if loss is not None:
            logger.info(f"step {step}: loss {loss.item():.4f}", ranks=None)

    want = reference(full, data).state_dict()
    got = model.state_dict()
    worst = max((got[k].double() - want[k].double()).abs().max().item() for k in got)
    bitwise = all(torch.equal(got[k], want[k]) for k in got)
    logger.info(
        f"{len(got)} tensors of this stage vs one process: max |diff| {worst:.2e}, "
        f"bitwise equal: {bitwise}",
        ranks=None,
    )
    assert worst < 1e-5, f"the pipeline drifted from one process by {worst}"
    ctx.destroy()


if __name__ == "__main__":
    main()
