"""``get_default_parser``: the first line of Colossal-AI's programs, under tessera's name."""

from __future__ import annotations

import tessera.context as context


def test_default_parser_reads_the_launch_flags_and_defaults_to_none() -> None:
    parser = context.get_default_parser()
    args = parser.parse_args([])
    assert vars(args) == dict.fromkeys(
        ("config", "host", "port", "world_size", "rank", "local_rank", "backend")
    )  # backend None: the launcher picks NCCL or gloo from the machine
    args = parser.parse_args(
        ["--backend", "gloo", "--port", "29500", "--local-rank", "1", "--config", "c.py"]
    )
    assert (args.backend, args.port, args.local_rank, args.config) == ("gloo", 29500, 1, "c.py")
    parser.add_argument("--epochs", type=int, default=2)  # a script adds its own
    assert parser.parse_args(["--rank", "3"]).epochs == 2
