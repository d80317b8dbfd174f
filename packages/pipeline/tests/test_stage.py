import itertools

import pytest
import torch
from torch import nn

from tessera.context import ParallelMode
from tessera.pipeline import (
    PipelineStage,
    build_pipeline_model,
    build_pipeline_model_from_cfg,
    select_stage_layers,
)
from tessera.registry import ConfigError


class FakeContext:
    """Offers only what the builders read: the pipeline rank and size."""

    def __init__(self, rank, size):
        self.rank, self.size, self.asked = rank, size, []

    def get_local_rank(self, mode):
        self.asked.append(mode)
        return self.rank

    def get_world_size(self, mode):
        self.asked.append(mode)
        return self.size


def mlp(widths):
    layers = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


def test_select_keeps_original_objects_and_full_model_names():
    model = mlp([4, 8, 8, 8, 2])  # 8 layers: Linear, ReLU, ...
    full_names = dict(model.named_parameters())
    seen = []
    for rank in range(2):
        (stage,) = select_stage_layers(model, rank, 2, method="uniform")
        assert isinstance(stage, PipelineStage)
        assert stage.pipeline_rank == rank and stage.virtual_stage == rank
        assert stage.layer_indices == tuple(range(4 * rank, 4 * rank + 4))
        for local, global_index in enumerate(stage.layer_indices):
            assert stage[local] is model[global_index]  # same object, local positional indexing
        for name, param in stage.named_parameters():
            assert full_names[name] is param  # names are the full model's
        assert set(stage.state_dict()) <= set(model.state_dict())
        seen += stage.layer_indices
    assert seen == list(range(8))


def test_stage_forward_equals_full_model():
    torch.manual_seed(0)
    model = mlp([3, 5, 5, 2])
    x = torch.randn(4, 3)
    stages = [select_stage_layers(model, r, 3, method="uniform")[0] for r in range(3)]
    y = x
    for stage in stages:
        y = stage(y)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    assert stages[0].is_first and not stages[0].is_last and stages[2].is_last


def test_parameters_method_balances_parameter_counts():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 1), nn.Linear(1, 1), nn.Linear(1, 1))
    (first,) = select_stage_layers(model, 0, 2)  # 110 params alone vs 11 + 2 + 2
    assert first.layer_indices == (0,)


def test_interleaved_chunks():
    layers = [nn.Linear(2, 2) for _ in range(8)]
    stages = select_stage_layers(layers, 1, 2, num_chunks=2, method="uniform")
    assert [s.layer_indices for s in stages] == [(2, 3), (6, 7)]
    assert [s.virtual_stage for s in stages] == [1, 3]
    assert [s.chunk for s in stages] == [0, 1]
    assert stages[1].is_last and not stages[0].is_first
    assert stages[1][0] is layers[6]
    assert {n for n, _ in stages[1].named_parameters()} == {
        "6.weight",
        "6.bias",
        "7.weight",
        "7.bias",
    }


def test_custom_child_names_are_kept():
    from collections import OrderedDict

    model = nn.Sequential(
        OrderedDict(embed=nn.Linear(2, 2), body=nn.Linear(2, 2), head=nn.Linear(2, 2))
    )
    (last,) = select_stage_layers(model, 1, 2, method=[0, 2, 3])
    assert last.layer_names == ("head",)
    assert set(dict(last.named_parameters())) == {"head.weight", "head.bias"}


def test_errors():
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 virtual stages"):
        select_stage_layers([nn.ReLU()] * 3, 0, 2, num_chunks=2)
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 virtual stages"):
        select_stage_layers([nn.ReLU()] * 3, 0, 4, method=[0, 1, 2, 3, 3])
    with pytest.raises(ValueError, match="unknown partition method 'layers'"):
        select_stage_layers([nn.ReLU()] * 3, 0, 1, method="layers")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="virtual stage 0 would be empty"):
        select_stage_layers([nn.ReLU()] * 3, 0, 2, method=[0, 0, 3])
    with pytest.raises(TypeError, match=r"expected an nn\.Module"):
        select_stage_layers([nn.ReLU(), "relu"], 0, 1)  # type: ignore[list-item]


def test_build_pipeline_model_reads_the_context():
    model = mlp([4, 4, 4])
    ctx = FakeContext(1, 2)
    stage = build_pipeline_model(model, method="uniform", context=ctx)
    assert isinstance(stage, PipelineStage)
    assert stage.layer_indices == (2, 3)
    assert ctx.asked == [ParallelMode.PIPELINE, ParallelMode.PIPELINE]
    chunks = build_pipeline_model([nn.ReLU()] * 4, num_chunks=2, context=FakeContext(0, 2))
    assert isinstance(chunks, list) and [c.layer_indices for c in chunks] == [(0,), (2,)]


def layer_cfgs():
    return [
        dict(type=nn.Linear, in_features=4, out_features=16),
        dict(type=nn.ReLU),
        dict(type=nn.Linear, in_features=16, out_features=4),
        dict(type=nn.ReLU),
        dict(type=nn.Linear, in_features=4, out_features=4),
        dict(type=nn.Linear, in_features=4, out_features=4),
    ]


def test_build_from_cfg_builds_only_this_ranks_layers():
    cfg = dict(type="ModelFromConfig", layers_cfg=layer_cfgs())
    stage = build_pipeline_model_from_cfg(cfg, context=FakeContext(1, 2))
    # parameter counts 80, 0, 68, 0, 20, 20: the best cut is [80, 0 | 68, 0, 20, 20] (max 108;
    # cutting after the 68 gives 148); the zero-weight ReLU stays with the layer before it.
    assert stage.layer_indices == (2, 3, 4, 5)
    assert isinstance(stage[0], nn.Linear) and stage[0].in_features == 16
    assert all(p.device.type == "cpu" for p in stage.parameters())
    assert set(dict(stage.named_parameters())) == {
        "2.weight", "2.bias", "4.weight", "4.bias", "5.weight", "5.bias"
    }  # fmt: skip


def test_build_from_cfg_counting_draws_no_random_numbers():
    cfg = dict(layers_cfg=layer_cfgs())
    torch.manual_seed(3)
    by_params = build_pipeline_model_from_cfg(cfg, context=FakeContext(1, 2))
    torch.manual_seed(3)
    explicit = build_pipeline_model_from_cfg(cfg, method=[0, 2, 6], context=FakeContext(1, 2))
    for a, b in zip(by_params.parameters(), explicit.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_build_from_cfg_interleaved_and_errors():
    chunks = build_pipeline_model_from_cfg(
        dict(layers_cfg=layer_cfgs()[:4]), num_chunks=2, method="uniform", context=FakeContext(0, 2)
    )
    assert [c.layer_indices for c in chunks] == [(0,), (2,)]
    with pytest.raises(ConfigError, match="layers_cfg: expected a list"):
        build_pipeline_model_from_cfg(dict(type="X"), context=FakeContext(0, 1))
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 virtual stages"):
        build_pipeline_model_from_cfg(dict(layers_cfg=layer_cfgs()[:2]), context=FakeContext(0, 3))
    with pytest.raises(ConfigError):
        build_pipeline_model_from_cfg(
            dict(layers_cfg=[dict(type=nn.Linear, in_features=2)]), context=FakeContext(0, 1)
        )


def test_chunks_answer_module_calls_and_verbose_prints_the_partition(capsys):
    from tessera.pipeline import PipelineChunks

    model = mlp([4, 8, 8, 8, 2])  # 8 layers, params 40, 0, 72, 0, 72, 0, 18, 0
    chunks = build_pipeline_model(
        model, num_chunks=2, method="uniform", context=FakeContext(1, 2), verbose=True
    )
    assert isinstance(chunks, PipelineChunks) and isinstance(chunks, list)
    assert [c.layer_indices for c in chunks] == [(2, 3), (6, 7)]  # indexable as before
    names = [n for n, _ in chunks.named_parameters()]
    assert names == ["2.weight", "2.bias", "6.weight", "6.bias"]  # the full model's names
    assert len(list(torch.optim.Adam(chunks.parameters()).param_groups[0]["params"])) == 4
    assert list(chunks.state_dict()) == names
    assert not any(c.training for c in chunks.eval())
    out = capsys.readouterr().out
    assert "into 2 stages x 2 chunks, by uniform" in out
    assert "virtual stage 1: rank 1, chunk 0, layers 2..3 (2..3), 72 parameters" in out
    assert "virtual stage 3: rank 1, chunk 1, layers 6..7 (6..7), 18 parameters" in out
    build_pipeline_model(model, method="uniform", context=FakeContext(0, 2))
    assert capsys.readouterr().out == ""  # quiet unless asked
