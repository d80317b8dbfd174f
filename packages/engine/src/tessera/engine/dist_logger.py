"""A logger that knows its rank: with N processes, a message is written by the chosen ranks only.

Every rank runs the same training script, so an unfiltered ``print`` shows each line N times.
``DistributedLogger`` wraps a stdlib ``logging.Logger`` and drops the record unless the calling
rank is among ``ranks`` (default: rank 0 only); ``ranks=None`` on a call lets every rank write,
prefixed with its rank.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

__all__ = ["DistributedLogger", "disable_existing_loggers", "get_dist_logger"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_loggers: dict[str, DistributedLogger] = {}


def _global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class DistributedLogger:
    """Rank-filtered logging.

    Args:
        name: Name of the underlying ``logging.Logger``.
        ranks: Global ranks that write by default.
        level: Initial level of the underlying logger.
    """

    def __init__(self, name: str, ranks: Sequence[int] = (0,), level: int = logging.INFO) -> None:
        self._logger = logging.getLogger(name)
        self._logger.setLevel(level)
        self._logger.propagate = False
        if not any(getattr(h, "_tessera_stream", False) for h in self._logger.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT))
            handler._tessera_stream = True  # type: ignore[attr-defined]
            self._logger.addHandler(handler)
        self.ranks: tuple[int, ...] = tuple(ranks)

    @property
    def logger(self) -> logging.Logger:
        """The wrapped stdlib logger (add handlers or filters to it)."""
        return self._logger

    def set_level(self, level: int | str) -> None:
        """Set the level of the underlying logger."""
        self._logger.setLevel(level)

    def log_to_file(self, path: str | os.PathLike[str], mode: str = "a") -> None:
        """Also write this rank's records to ``path`` (one file per rank: put the rank in it)."""
        file = Path(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(file, mode=mode)
        handler.setFormatter(logging.Formatter(_FORMAT))
        self._logger.addHandler(handler)

    def should_log(self, ranks: Sequence[int] | None = ()) -> bool:
        """Whether this rank writes a record sent to ``ranks`` (``()``: the default ranks)."""
        if ranks is None:
            return True
        chosen = tuple(ranks) or self.ranks
        return _global_rank() in chosen

    def _log(self, level: int, message: str, ranks: Sequence[int] | None) -> None:
        if self.should_log(ranks):
            if ranks is None:
                message = f"[rank {_global_rank()}] {message}"
            self._logger.log(level, message)

    def debug(self, message: str, ranks: Sequence[int] | None = ()) -> None:
        """Log at DEBUG on ``ranks`` (``()``: the default ranks; ``None``: every rank)."""
        self._log(logging.DEBUG, message, ranks)

    def info(self, message: str, ranks: Sequence[int] | None = ()) -> None:
        """Log at INFO on ``ranks`` (``()``: the default ranks; ``None``: every rank)."""
        self._log(logging.INFO, message, ranks)

    def warning(self, message: str, ranks: Sequence[int] | None = ()) -> None:
        """Log at WARNING on ``ranks`` (``()``: the default ranks; ``None``: every rank)."""
        self._log(logging.WARNING, message, ranks)

    def error(self, message: str, ranks: Sequence[int] | None = ()) -> None:
        """Log at ERROR on ``ranks`` (``()``: the default ranks; ``None``: every rank)."""
        self._log(logging.ERROR, message, ranks)


def get_dist_logger(name: str = "tessera", ranks: Sequence[int] | None = None) -> DistributedLogger:
    """The process-wide DistributedLogger called ``name`` (created on first use).

    Args:
        name: Logger name.
        ranks: If given, replaces the ranks that write by default.
    """
    logger = _loggers.get(name)
    if logger is None:
        logger = _loggers[name] = DistributedLogger(name, ranks if ranks is not None else (0,))
    elif ranks is not None:
        logger.ranks = tuple(ranks)
    return logger


def disable_existing_loggers(
    include: Sequence[str] | None = None, exclude: Sequence[str] = ("tessera",)
) -> None:
    """Quiet the loggers other libraries created: only their warnings and errors still show.

    Imported libraries log INFO lines on every rank (N copies each), burying the training's
    own. Colossal-AI's programs call this first; it raises the level of every logger that
    exists now to WARNING, except tessera's (``exclude``) and their children. A logger made
    later is not affected.

    Args:
        include: Only these logger names (and their children); ``None``: every existing one.
        exclude: Names (and their children) left as they are.
    """

    def under(name: str, roots: Sequence[str]) -> bool:
        return any(name == root or name.startswith(root + ".") for root in roots)

    for name in list(logging.root.manager.loggerDict):
        if under(name, exclude) or (include is not None and not under(name, include)):
            continue
        logger = logging.root.manager.loggerDict[name]
        if isinstance(logger, logging.Logger):  # not a PlaceHolder of a dotted name's parent
            logger.setLevel(logging.WARNING)
