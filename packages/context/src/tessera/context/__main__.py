"""``python -m tessera.context COMMAND``: the package's command-line tools.

Commands:
    plan  which data x pipeline x tensor layout fits a model and which is fastest
          (``tessera.context.planner``; ``python -m tessera.context plan --help``)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from tessera.context.planner.cli import main as plan

#: Command name -> its ``main(argv) -> exit code``.
COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"plan": plan}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch ``argv[0]`` to its command; print the commands on an unknown one."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        wanted = (
            f"unknown command {args[0]!r}; " if args and args[0] not in ("-h", "--help") else ""
        )
        print(f"usage: python -m tessera.context {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        print(f"{wanted}commands: plan (which parallel layout to use)", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[args[0]](args[1:])
    except BrokenPipeError:  # the reader (head, less) stopped reading: not a failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
