"""Every parameter tessera splits has DTensor placements on its mode's mesh (issue 38, point 1).

For transformers' GPT-2 parallelized under each tensor mode: each parameter's ShardInfo reads
as placements (``tessera.context.placements_of``), the placements read back as the same
ShardInfo, and the parameter as a ``DTensor`` (``as_dtensor``) gathers to the very tensor the
single-process model holds (in its original form: ``FullForm``). An activation split for the
mode's layers reads as a DTensor too, and torch's operators on it compute one process's
numbers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

#: name -> the ``tensor`` block of the parallel config.
LAYOUTS: dict[str, dict[str, Any]] = {
    "1d": dict(size=2, mode="1d"),
    "2d": dict(size=4, mode="2d"),
    "2.5d": dict(size=8, mode="2.5d", depth=2),
    "3d": dict(size=8, mode="3d"),
    "sequence": dict(size=2, mode="sequence"),
}


def _placements_describe_every_parameter(tensor: dict[str, Any]) -> int:
    from hf_models import gpt2_lm

    from tessera.context import (
        as_dtensor,
        create_context,
        get_full_form,
        get_shard_info,
        grad_placements_of,
        placements_of,
        shard_info_of_placements,
    )
    from tessera.layers import parallelize

    ctx = create_context(dict(parallel=dict(tensor=tensor)), timeout=60.0)
    try:
        whole = dict(gpt2_lm().named_parameters())
        model = parallelize(gpt2_lm(), context=ctx)
        count = 0
        for name, param in model.named_parameters():
            info = get_shard_info(param)
            if info is not None:
                placements = placements_of(info, ctx)
                back = shard_info_of_placements(info.global_shape, placements, ctx)
                assert (back.offsets, back.local_shape) == (info.offsets, info.local_shape), name
                partial = [type(p).__name__ for p in grad_placements_of(info, ctx)]
                assert ("Partial" in partial) == bool(info.partial_grad_modes), name
            full = as_dtensor(param, ctx).full_tensor()
            form = get_full_form(param)  # tessera's own form of fused parts, transposed Conv1D
            full = form.to_original(full) if form is not None else full
            torch.testing.assert_close(full, whole[name].detach(), rtol=0, atol=0, msg=name)
            count += 1
        _activations_read_as_dtensors(ctx)
        return count
    finally:
        ctx.destroy()


def _activations_read_as_dtensors(ctx: Any) -> None:
    """An activation split as the mode's layers take it is a DTensor of the whole one; a
    function no plan converts (a layer norm over its split features) computes under
    DTensor's propagation to one process's result instead of normalizing a block."""
    import torch.nn.functional as F

    from tessera.layers import activation_as_dtensor, split_activation

    x = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(5))  # [b, s, h]
    dt = activation_as_dtensor(split_activation(x, ctx), ctx)
    torch.testing.assert_close(dt.full_tensor(), x, rtol=0, atol=0)
    normed = F.layer_norm(dt, (16,))
    torch.testing.assert_close(normed.full_tensor(), F.layer_norm(x, (16,)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_parameter_reads_as_placements_and_gathers_whole(dist: Any, layout: str) -> None:
    tensor = LAYOUTS[layout]
    counts = dist.run(
        _placements_describe_every_parameter, world_size=tensor["size"], args=(tensor,),
        timeout=240.0,
    )  # fmt: skip
    assert counts[0] > 0 and all(c == counts[0] for c in counts)
