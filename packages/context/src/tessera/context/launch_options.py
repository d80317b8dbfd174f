"""``LaunchOptions``: how a process joins the job, declared once for every launcher.

``launch``, ``launch_from_torch``, ``launch_from_slurm`` and ``launch_from_openmpi`` differ only
in where they read the rank, the world size and the rendezvous address; the rest (backend,
seed, collective and rendezvous timeouts, heartbeats) is this one object, passed as
``options=`` or spelled as keywords (``launch_from_torch(config, seed=7)``), checked on
construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, TypedDict

from .context import _check_heartbeat_interval, as_timedelta
from .failures import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_PROGRESS_TIMEOUT

__all__ = ["LaunchKeywords", "LaunchOptions"]


class LaunchKeywords(TypedDict, total=False):
    """The keywords every launcher takes, one per field of :class:`LaunchOptions`."""

    backend: str | None
    seed: int
    timeout: float | timedelta | None
    heartbeat_interval: float | None
    progress_timeout: float | None
    rendezvous_timeout: float | timedelta | None


@dataclass(frozen=True)
class LaunchOptions:
    """How every launcher joins the job.

    Attributes:
        backend: ``'nccl'`` or ``'gloo'`` (or another backend torch knows); default NCCL when
            CUDA is available, else gloo.
        seed: Base seed (see ``ParallelContext.reseed``).
        timeout: Seconds or timedelta for every collective (default ``DEFAULT_TIMEOUT``, five
            minutes), and for the rendezvous unless ``rendezvous_timeout`` is given. A rank
            waiting on a failed peer raises ``RankFailedError`` at the latest when its
            collective times out; on a dead or stopped peer much sooner, from the heartbeats.
        heartbeat_interval: Seconds between heartbeats in the rendezvous store, which let the
            other ranks name a rank that died without raising, and abort the groups when a rank
            stops answering for three intervals; None or 0 turns them off.
        progress_timeout: Seconds a rank may go without a progress mark (a step, a batch
            read) while another rank is past it before every rank names it as stalled (its
            heartbeat may still beat: a read hung on a dead NFS server); None or 0 turns it off.
        rendezvous_timeout: Seconds or timedelta the rendezvous waits for every rank (default
            ``timeout`` when given, else 30 minutes): processes may start far apart, while
            collectives can then run under a short ``timeout``.

    Raises:
        ValueError: a field out of range (naming it), at construction.
    """

    backend: str | None = None
    seed: int = 1024
    timeout: float | timedelta | None = None
    heartbeat_interval: float | None = DEFAULT_HEARTBEAT_INTERVAL
    progress_timeout: float | None = DEFAULT_PROGRESS_TIMEOUT
    rendezvous_timeout: float | timedelta | None = None

    def __post_init__(self) -> None:
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise ValueError(
                f"backend must be a backend name such as 'nccl' or 'gloo', got {self.backend!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        as_timedelta(self.timeout)  # raises ValueError naming the value
        if self.rendezvous_timeout is not None:
            try:
                as_timedelta(self.rendezvous_timeout)
            except ValueError as err:
                raise ValueError(f"rendezvous_{err}") from None
        _check_heartbeat_interval(self.heartbeat_interval)
        _check_heartbeat_interval(self.progress_timeout, "progress_timeout")

    @classmethod
    def resolve(
        cls, options: LaunchOptions | None, keywords: Mapping[str, Any], launcher: str
    ) -> LaunchOptions:
        """``options`` (default: the defaults) with ``keywords`` applied over it.

        Raises:
            TypeError: ``options`` is not a LaunchOptions (a backend passed positionally, as
                the launchers once took it), or a keyword is not a launch option.
        """
        if options is not None and not isinstance(options, LaunchOptions):
            raise TypeError(
                f"{launcher}: options must be a LaunchOptions, got {options!r}; pass backend, "
                "seed, timeout, heartbeat_interval, progress_timeout and rendezvous_timeout as "
                "keywords"
            )
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(keywords) - set(names))
        if unknown:
            raise TypeError(
                f"{launcher}() got unexpected keyword arguments {unknown}; the launch options "
                f"are {', '.join(names)}"
            )
        return replace(options if options is not None else cls(), **keywords)
