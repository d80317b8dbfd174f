"""Real gloo runs of every schedule: same loss and same gradients as the unsplit model.

Each ``dist.run`` call builds one context and checks many cases (the machine is small). Every
rank builds the full model from the same seed; the reference is that model run on the whole
batch in one process; each rank compares its stage's gradients, by full-model parameter name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from tessera.context import ParallelMode, create_context
from tessera.pipeline import (
    Action,
    ActionKind,
    GPipeSchedule,
    InterleavedPipelineSchedule,
    PipelineRunner,
    PipelineSchedule,
    Schedule,
    ZeroBubbleSchedule,
    build_pipeline_model,
    gather_timeline,
    plot_timeline,
    simulate,
    split_steps,
)

ATOL = 1e-6  # fp32; gradients here are O(0.1..1)


def make_mlp(seed: int = 0) -> nn.Sequential:
    """Eight layers, so that 4 ranks x 2 chunks get one each (some without parameters)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
            nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3),
        )  # fmt: skip


def make_data(batch: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 5, generator=g), torch.randn(batch, 3, generator=g)


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).mean()


def reference(model: nn.Module, inputs: Any, labels: Any, loss_fn: Callable[..., Any]) -> Any:
    ref = copy.deepcopy(model)
    out = ref(inputs)
    loss = loss_fn(out, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    return out.detach() if isinstance(out, torch.Tensor) else out, loss.detach(), grads


def stages_of(stage: Any) -> list[nn.Module]:
    return [stage] if isinstance(stage, nn.Module) else list(stage)


def grad_diff(stage: Any, ref_grads: dict[str, torch.Tensor], scale: float = 1.0) -> float:
    """Largest |grad - scale * ref| over this rank's parameters (inf when one is missing)."""
    worst = 0.0
    for module in stages_of(stage):
        for name, param in module.named_parameters():
            if param.grad is None:
                return float("inf")
            want = scale * ref_grads[name]
            worst = max(worst, (param.grad - want).abs().max().item())
    return worst


def zero_grads(stage: Any) -> None:
    for module in stages_of(stage):
        module.zero_grad(set_to_none=True)


SCHEDULES: dict[str, Callable[[int], tuple[Schedule, int]]] = {
    "gpipe": lambda m: (GPipeSchedule(m), 1),
    "1f1b": lambda m: (PipelineSchedule(m), 1),
    "zero_bubble": lambda m: (ZeroBubbleSchedule(m), 1),
    "interleaved": lambda m: (InterleavedPipelineSchedule(m, 2), 2),
}


def _every_schedule(p: int) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict(pipeline=p)), timeout=60)
    rank = ctx.get_local_rank(ParallelMode.PIPELINE)
    report: dict[str, Any] = {}
    try:
        x, y = make_data(batch=8)
        for name, factory in SCHEDULES.items():
            for m in (4, 8):
                schedule, chunks = factory(m)
                model = make_mlp(seed=m)
                _, ref_loss, ref_grads = reference(model, x, y, mse)
                stage = build_pipeline_model(model, chunks, method="uniform", context=ctx)
                runner = PipelineRunner(schedule, context=ctx)
                out, label, loss = runner.train_step(stage, iter([(x, y)]), mse)
                first = runner.last_run
                assert first is not None
                case: dict[str, Any] = {
                    "grad": grad_diff(stage, ref_grads),
                    "exchanged_first": first.exchanged_metadata,
                    "peak_live": first.peak_live,
                    "peak_activations": first.peak_activations,
                }
                if rank == p - 1:
                    case["loss"] = abs(loss.item() - ref_loss.item())
                    case["label_is_batch"] = label is y
                    case["output"] = (out - copy.deepcopy(model)(x)).abs().max().item()
                else:
                    case["others_none"] = (out, label, loss) == (None, None, None)
                # Second step, same shapes: metadata comes from the cache, grads accumulate,
                # and the receives are posted ahead of their batches (gloo).
                comm = runner._comm_for(ctx)
                case["prefetched_first"] = comm.prefetched
                runner.train_step(stage, iter([(x, y)]), mse)
                assert runner.last_run is not None
                case["exchanged_second"] = runner.last_run.exchanged_metadata
                case["prefetched_second"] = comm.prefetched - case["prefetched_first"]
                case["receives"] = sum(
                    a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)
                    for a in schedule.actions(rank, p)
                )
                case["grad_twice"] = grad_diff(stage, ref_grads, scale=2.0)
                simulated = simulate(schedule, p).peak_activations[rank]
                case["simulated_peak"] = simulated
                report[f"{name}/m{m}"] = case
    finally:
        ctx.destroy()
    return report


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_matches_the_unsplit_model(dist: Any, p: int) -> None:
    results = dist.run(_every_schedule, world_size=p, args=(p,), timeout=240)
    for rank, report in enumerate(results):
        assert set(report) == {f"{n}/m{m}" for n in SCHEDULES for m in (4, 8)}
        for key, case in report.items():
            assert case["grad"] <= ATOL * 10, (rank, key, case)
            assert case["grad_twice"] <= ATOL * 20, (rank, key, case)
            assert case["exchanged_first"] is True and case["exchanged_second"] is False
            # every receive of the second step was posted ahead, none of the first
            assert case["prefetched_first"] == 0, (rank, key)
            assert case["prefetched_second"] == case["receives"] > 0, (rank, key)
            # The executor holds exactly what the simulator's memory model says.
            assert case["peak_activations"] == case["simulated_peak"], (rank, key, case)
            if rank == p - 1:
                assert case["loss"] <= 1e-6 and case["output"] <= 1e-6 and case["label_is_batch"]
            else:
                assert case["others_none"]
        m = 8
        assert report[f"1f1b/m{m}"]["peak_live"] == p - rank  # 1F1B: p - r, never m
        assert report[f"gpipe/m{m}"]["peak_live"] == m
        assert report[f"zero_bubble/m{m}"]["peak_live"] <= p


# --------------------------------------------------------------------------- payloads


class DictIn(nn.Module):
    """Reads a dict payload; passes an integer tensor and a non-grad float tensor along."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.lin(batch["x"]) * batch["scale"])
        return {"h": h, "ids": batch["ids"], "scale": batch["scale"]}


class DictMid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.lin(payload["h"])) + payload["ids"].unsqueeze(-1).float() * 0.01
        return {"h": h, "ids": payload["ids"], "scale": payload["scale"]}


class ToTuple(nn.Module):
    """Dict -> tuple (h, aux, ids): aux is float and does not require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, payload: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        aux = payload["h"].detach() * 2.0  # flows forward, no gradient comes back
        return torch.tanh(self.lin(payload["h"])), aux, payload["ids"]


class TupleMid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, payload: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        h, aux, ids = payload
        return torch.tanh(self.lin(h) + 0.1 * aux), aux, ids


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 2)

    def forward(self, payload: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        h, aux, ids = payload
        return {"y": self.lin(h + aux.mean(dim=-1, keepdim=True)), "ids": ids}


def make_structured(seed: int = 3) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            DictIn(),
            DictMid(),
            DictMid(),
            ToTuple(),
            TupleMid(),
            TupleMid(),
            TupleMid(),
            TupleOut(),
        )


def structured_data(batch: int = 8) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    inputs = {
        "x": torch.randn(batch, 5, generator=g),
        "ids": torch.arange(batch),
        "scale": torch.rand(batch, 1, generator=g) + 0.5,
    }
    return inputs, torch.randn(batch, 2, generator=g)


def dict_loss(output: dict[str, torch.Tensor], label: torch.Tensor) -> torch.Tensor:
    return ((output["y"] - label) ** 2).mean()


def _payloads(p: int) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict(pipeline=p)), timeout=60)
    rank = ctx.get_local_rank(ParallelMode.PIPELINE)
    report: dict[str, Any] = {}
    try:
        inputs, labels = structured_data()
        for name in ("1f1b", "zero_bubble", "interleaved"):
            schedule, chunks = SCHEDULES[name](4)
            model = make_structured()
            ref_out, ref_loss, ref_grads = reference(model, inputs, labels, dict_loss)
            stage = build_pipeline_model(model, chunks, method="uniform", context=ctx)
            out, _, loss = PipelineRunner(schedule, context=ctx).train_step(
                stage, iter([(inputs, labels)]), dict_loss
            )
            case = {"grad": grad_diff(stage, ref_grads)}
            if rank == p - 1:
                case["loss"] = abs(loss.item() - ref_loss.item())
                case["output"] = (out["y"] - ref_out["y"]).abs().max().item()
                case["ids"] = torch.equal(out["ids"], inputs["ids"])
            report[name] = case
    finally:
        ctx.destroy()
    return report


@pytest.mark.parametrize("p", [2, 4])
def test_dict_and_tuple_payloads_with_non_grad_tensors(dist: Any, p: int) -> None:
    results = dist.run(_payloads, world_size=p, args=(p,), timeout=240)
    for rank, report in enumerate(results):
        for name, case in report.items():
            assert case["grad"] <= ATOL * 10, (rank, name, case)
            if rank == p - 1:
                assert case["loss"] <= 1e-6 and case["output"] <= 1e-6 and case["ids"]


# --------------------------------------------------------------------------- forward only,
# tensor_shape, errors, timeline, memory


def _evaluation_shapes_errors(p: int, tmp: str) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict(pipeline=p), TENSOR_SHAPE=[2, 8]), timeout=60)
    plain = create_context(dict(parallel=dict(pipeline=p)), timeout=60)
    rank = ctx.get_local_rank(ParallelMode.PIPELINE)
    report: dict[str, Any] = {}
    try:
        x, y = make_data(batch=8)
        model = make_mlp(seed=5)
        ref_out = copy.deepcopy(model)(x).detach()
        ref_loss = mse(ref_out, y)

        # forward_only: outputs and loss equal, gradients untouched (None and preset ones).
        stage = build_pipeline_model(model, 1, method="uniform", context=plain)
        params = list(stage.parameters())
        if params:
            params[0].grad = torch.full_like(params[0], 3.0)
        out, label, loss = PipelineRunner(PipelineSchedule(4), context=plain).eval_step(
            stage, iter([(x, y)]), mse
        )
        report["fo_grads_untouched"] = all(
            (q.grad is None) if i else bool((q.grad == 3.0).all()) for i, q in enumerate(params)
        )
        if rank == p - 1:
            report["fo_out"] = (out - ref_out).abs().max().item()
            report["fo_loss"] = abs(loss.item() - ref_loss.item())
            report["fo_label"] = label is y
        # forward_only without a loss_fn returns outputs and no loss.
        out, _, loss = PipelineRunner(PipelineSchedule(4), context=plain).eval_step(
            stage, iter([(x, y)])
        )
        if rank == p - 1:
            report["fo_noloss"] = loss is None and (out - ref_out).abs().max().item() <= 1e-6
        zero_grads(stage)

        # TENSOR_SHAPE from the config: no metadata is exchanged, numerics unchanged.
        # The first and last layers change the width, so cut where every boundary is 8 wide.
        model = make_mlp(seed=6)
        _, ref_loss, ref_grads = reference(model, x, y, mse)
        bounds = [0, 2, 4, 6, 8][: p + 1] if p == 4 else [0, 4, 8]
        stage = build_pipeline_model(model, 1, method=bounds, context=ctx)
        for name, schedule in (("1f1b", PipelineSchedule(4)), ("zb", ZeroBubbleSchedule(4))):
            zero_grads(stage)
            runner = PipelineRunner(schedule, context=ctx)
            _, _, loss = runner.train_step(stage, iter([(x, y)]), mse)
            assert runner.last_run is not None
            report[f"shape_{name}_exchanged"] = runner.last_run.exchanged_metadata
            report[f"shape_{name}_grad"] = grad_diff(stage, ref_grads)
            if rank == p - 1:
                report[f"shape_{name}_loss"] = abs(loss.item() - ref_loss.item())
        # tensor_shape given to the schedule (no config key needed).
        zero_grads(stage)
        runner = PipelineRunner(PipelineSchedule(4, tensor_shape=(2, 8)), context=plain)
        runner.train_step(stage, iter([(x, y)]), mse)
        assert runner.last_run is not None
        report["shape_arg_exchanged"] = runner.last_run.exchanged_metadata
        report["shape_arg_grad"] = grad_diff(stage, ref_grads)

        # Errors come before any communication, on every rank, and leave the pipeline usable.
        errors = []
        try:
            PipelineRunner(PipelineSchedule(3), context=plain).train_step(
                stage, iter([(x, y)]), mse
            )
        except ValueError as exc:
            errors.append(str(exc))
        try:
            PipelineRunner(InterleavedPipelineSchedule(3, 2), context=plain).train_step(
                build_pipeline_model(make_mlp(), 2, method="uniform", context=plain),
                iter([(torch.zeros(6, 5), torch.zeros(6, 3))]),
                mse,
            )
        except ValueError as exc:
            errors.append(str(exc))
        report["errors"] = errors

        # A recorded timeline, gathered from every rank and drawn.
        zero_grads(stage)
        schedule = ZeroBubbleSchedule(4)
        runner = PipelineRunner(schedule, context=plain)
        runner.train_step(stage, iter([(x, y)]), mse, record_timeline=True)
        assert runner.last_run is not None
        events = gather_timeline(runner.last_run, plain)
        report["timeline_ranks"] = sorted({e.rank for e in events})
        report["timeline_actions"] = len(events)
        report["timeline_expected"] = sum(len(schedule.actions(r, p)) for r in range(p))
        report["timeline_ordered"] = all(e.end >= e.start >= 0 for e in events)
        if rank == 0:
            path = f"{tmp}/measured.png"
            plot_timeline(events, path, num_stages=p, time_unit="s")
            report["plot"] = path

        # Measured activation memory: 1F1B holds fewer bytes than GPipe on rank 0.
        peaks = {}
        for name, sched in (("gpipe", GPipeSchedule(8)), ("1f1b", PipelineSchedule(8))):
            zero_grads(stage)
            runner = PipelineRunner(sched, context=plain)
            runner.train_step(stage, iter([(x, y)]), mse, track_memory=True)
            assert runner.last_run is not None
            peaks[name] = (runner.last_run.peak_activation_bytes, runner.last_run.peak_live)
        report["peaks"] = peaks
        torch_dist.barrier()
    finally:
        ctx.destroy()
        plain.destroy()
    return report


@pytest.mark.parametrize("p", [2, 4])
def test_forward_only_tensor_shape_errors_timeline_memory(dist: Any, p: int, tmp_path: Any) -> None:
    results = dist.run(
        _evaluation_shapes_errors, world_size=p, args=(p, str(tmp_path)), timeout=240
    )
    for rank, report in enumerate(results):
        assert report["fo_grads_untouched"]
        if rank == p - 1:
            assert report["fo_out"] <= 1e-6 and report["fo_loss"] <= 1e-6 and report["fo_label"]
            assert report["fo_noloss"]
            assert report["shape_1f1b_loss"] <= 1e-6 and report["shape_zb_loss"] <= 1e-6
        for key in ("shape_1f1b", "shape_zb", "shape_arg"):
            assert report[f"{key}_exchanged"] is False
            assert report[f"{key}_grad"] <= ATOL * 10, (rank, key, report)
        divisible, interleaved = report["errors"]
        assert "(8)" in divisible and "(3)" in divisible and "8 % 3 = 2" in divisible
        assert f"3 % {p} = 3" in interleaved if p == 4 else "3 % 2 = 1" in interleaved
        assert report["timeline_ranks"] == list(range(p))
        assert report["timeline_actions"] == report["timeline_expected"]
        assert report["timeline_ordered"]
        (gpipe_bytes, gpipe_live), (ofob_bytes, ofob_live) = (
            report["peaks"]["gpipe"],
            report["peaks"]["1f1b"],
        )
        assert gpipe_live == 8 and ofob_live == p - rank
        assert ofob_bytes < gpipe_bytes or gpipe_bytes == 0  # stages without saved tensors
    assert (tmp_path / "measured.png").stat().st_size > 0


# --------------------------------------------------------------------------- receives posted
# ahead in a user's schedule; zero bubble with a tied fused weight


class GPipeThenOneFOneB(Schedule):
    """Rank 0 runs every forward first (GPipe), the others 1F1B.

    Made deadlock-free, the last rank's list then receives two activations in one batch
    (``RECV_F1 RECV_F2``): two receives of one stream, of which only the first was posted ahead.
    """

    def compute_actions(self, pipeline_rank: int, num_stages: int) -> list[Action]:
        m = self.num_microbatches
        if pipeline_rank == 0:
            return [Action(ActionKind.F, i) for i in range(m)] + [
                Action(ActionKind.B, i) for i in range(m)
            ]
        return [Action(kind, i) for i in range(m) for kind in (ActionKind.F, ActionKind.B)]


class TiedAbove(nn.Module):
    """A linear layer whose weight a matmul uses again above it (on the input path)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.lin.weight


def _user_schedule_and_tied(p: int) -> dict[str, Any]:
    ctx = create_context(dict(parallel=dict(pipeline=p)), timeout=30)
    rank = ctx.get_local_rank(ParallelMode.PIPELINE)
    report: dict[str, Any] = {}
    try:
        x, y = make_data(batch=8)
        model = make_mlp()
        _, _, ref_grads = reference(model, x, y, mse)
        for shape in (None, (2, 8)):
            schedule = GPipeThenOneFOneB(4, tensor_shape=shape)
            stage = build_pipeline_model(copy.deepcopy(model), 1, method="uniform", context=ctx)
            same_stream = any(
                len(receives) != len(set(receives))
                for step in split_steps(schedule.actions(rank, p))
                for receives in [[(a.kind, a.chunk) for a in step if not a.kind.is_compute]]
            )
            runner = PipelineRunner(schedule, context=ctx)
            for _ in range(2):  # without tensor_shape, the second step posts receives ahead
                runner.train_step(stage, iter([(x, y)]), mse)
            report[f"user/{shape}"] = (grad_diff(stage, ref_grads, scale=2.0), same_stream)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            # uniform over 2 ranks: [Linear, Tanh] | [TiedAbove, Linear], a stage with inputs
            tied = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), TiedAbove(), nn.Linear(8, 3))
        _, _, ref_grads = reference(tied, x, y, mse)
        stage = build_pipeline_model(tied, 1, method="uniform", context=ctx)
        report["tied_here"] = any(isinstance(m, TiedAbove) for m in stage.modules())
        PipelineRunner(ZeroBubbleSchedule(4), context=ctx).train_step(stage, iter([(x, y)]), mse)
        report["zero_bubble_tied"] = grad_diff(stage, ref_grads)
    finally:
        ctx.destroy()
    return report


def test_user_schedule_with_two_receives_of_a_stream_in_one_batch(dist: Any) -> None:
    # Before the fix the stream's next receive was posted again after the batch: it took the
    # following microbatch's message and the last receive waited for a message never sent.
    # Zero bubble: W started at the matmul ran the fused layer again and kept its rows twice.
    results = dist.run(_user_schedule_and_tied, world_size=2, args=(2,), timeout=180)
    for rank, report in enumerate(results):
        for key, value in report.items():
            if key.startswith("user/"):
                diff, same_stream = value
                assert diff <= ATOL * 20, (rank, key, diff)
                assert same_stream == (rank == 1), (rank, key)
            elif key == "tied_here":
                assert value == (rank == 1)
            else:
                assert value <= ATOL * 10, (rank, key, value)
