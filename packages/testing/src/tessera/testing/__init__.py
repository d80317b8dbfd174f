"""tessera.testing: run a test body on N gloo ranks (CPU) in reusable worker processes.

Use the ``dist`` pytest fixture (registered automatically when this package is installed) or a
:class:`DistributedRunner` directly::

    def body():
        t = torch.ones(1) * torch.distributed.get_rank()
        torch.distributed.all_reduce(t)
        return t.item()

    def test_sum(dist):
        assert dist.run(body, world_size=4) == [6.0] * 4
"""

from .errors import RankError, RankTimeoutError
from .ports import free_port
from .runner import (
    DEFAULT_SEED,
    DEFAULT_TIMEOUT,
    MAX_POOLS_ENV,
    TIMEOUT_ENV,
    DistributedRunner,
)
from .seeding import seed_all

__all__ = [
    # harness
    "DistributedRunner",
    "RankError",
    "RankTimeoutError",
    # helpers
    "free_port",
    "seed_all",
    # defaults and knobs
    "DEFAULT_SEED",
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "MAX_POOLS_ENV",
]
