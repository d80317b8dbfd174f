"""A user's own parallel mode, defined outside tessera (the README's example, verbatim).

Lives in its own module so the distributed tests can import it in their worker processes.
"""

from __future__ import annotations

from tessera.context import (
    PROCESS_GROUP_INITIALIZERS,
    ParallelConfig,
    ProcessGroupInitializer,
    global_rank,
)


@PROCESS_GROUP_INITIALIZERS.register
class EmbeddingGroupInitializer(ProcessGroupInitializer):
    """The first and last pipeline stage of each pipeline: they share tied embeddings."""

    modes = ("embedding",)

    def rank_groups(self, config: ParallelConfig) -> dict[str, list[tuple[int, ...]]]:
        last = config.pipeline_size - 1
        groups = []
        for data in range(config.data_size):
            for tensor in range(config.tensor_size):
                first_rank = global_rank(config, data, 0, tensor)
                last_rank = global_rank(config, data, last, tensor)
                groups.append(tuple(sorted({first_rank, last_rank})))
        return {"embedding": groups}


class PairsInitializer(ProcessGroupInitializer):
    """Neighbouring pairs of global ranks, (0, 1), (2, 3), ...; reversed on request."""

    modes = ("pairs", "pairs_reversed")

    def __init__(self, stride: int = 2) -> None:
        self.stride = stride

    def rank_groups(self, config: ParallelConfig) -> dict[str, list[tuple[int, ...]]]:
        world = config.world_size
        pairs = [tuple(range(i, min(i + self.stride, world))) for i in range(0, world, self.stride)]
        return {"pairs": pairs, "pairs_reversed": [tuple(reversed(p)) for p in pairs]}
