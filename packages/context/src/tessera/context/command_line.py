"""The command-line flags every launcher reads, for scripts written like Colossal-AI's.

Colossal-AI's programs open with ``parser = colossalai.get_default_parser()`` and pass
``args.backend`` (or ``args.host``, ``args.port``...) to a launcher. The same lines work with
``tessera.context.get_default_parser``; the script adds its own flags to the parser it gets.
"""

from __future__ import annotations

import argparse

__all__ = ["get_default_parser"]


def get_default_parser() -> argparse.ArgumentParser:
    """A parser of the launch flags: ``--config``, ``--host``, ``--port``, and so on.

    The flags are ``--config``, ``--host``, ``--port``, ``--world_size``, ``--rank``,
    ``--local_rank`` and ``--backend``, each ``None`` unless given, so a script can pass them
    on unconditionally. For ``backend``, ``None`` lets the launcher choose from the machine
    (NCCL with GPUs, else gloo), where Colossal-AI defaulted to NCCL and so failed on a
    CPU-only machine. The others are read by :func:`~tessera.context.launch` only
    (``launch_from_torch`` takes them from torchrun's environment). ``--local-rank``, as
    ``torch.distributed.launch`` writes it, is accepted for ``--local_rank``.

    Returns:
        A new ``argparse.ArgumentParser``; add the script's own arguments to it.
    """
    parser = argparse.ArgumentParser(
        description="a tessera training script",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", type=str, default=None, help="path to the config file")
    parser.add_argument("--host", type=str, default=None, help="address of rank 0")
    parser.add_argument("--port", type=int, default=None, help="free port on the host")
    parser.add_argument("--world_size", type=int, default=None, help="number of processes")
    parser.add_argument("--rank", type=int, default=None, help="this process's global rank")
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        default=None,
        help="this process's index on its node",
    )
    parser.add_argument(
        "--backend",
        type=str,
        default=None,
        help="torch.distributed backend (default: nccl with GPUs, else gloo)",
    )
    return parser
