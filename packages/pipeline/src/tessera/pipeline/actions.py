"""The action model: what one pipeline rank does, as plain data.

A schedule is nothing but, for each pipeline rank, an ordered list of :class:`Action` s. One
executor runs any such list; the simulator runs all ranks' lists on a model of time. Keeping the
schedule as data is what lets GPipe, 1F1B, interleaved 1F1B and zero bubble share one executor,
and lets a test read a schedule as a table.

Virtual stages. With ``num_chunks`` model chunks per rank (interleaved 1F1B, Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"), the
model is cut into ``num_stages * num_chunks`` virtual stages and chunk ``c`` of rank ``r`` is
virtual stage ``v = c * num_stages + r``. Activations flow ``v -> v + 1`` (rank ``r`` to rank
``(r + 1) % num_stages``, so rank ``num_stages - 1`` chunk ``c`` feeds rank 0 chunk ``c + 1``);
gradients flow back ``v -> v - 1``. Without chunks, ``v == r``.

Actions. ``Action(kind, microbatch, chunk)``; ``chunk`` is the local model chunk (0 when the
schedule is not interleaved). Compute kinds:

- ``F``: forward of that microbatch through that chunk;
- ``B``: backward. When the schedule does not split the backward (``splits_backward`` False)
  it is the full backward (input and weight gradients); when it does (zero bubble, Qi et al.
  2023, "Zero Bubble Pipeline Parallelism"), only the gradient with respect to the chunk's input,
  which is what the previous stage waits for;
- ``W``: the weight gradient of that microbatch and chunk (split schedules only).

Communication kinds name the tensor by the *local* compute action it belongs to:

- ``SEND_F(m, c)``: send the output of ``F(m, c)`` to the rank of virtual stage ``v + 1``;
- ``RECV_F(m, c)``: receive the input of ``F(m, c)`` from the rank of virtual stage ``v - 1``;
- ``SEND_B(m, c)``: send the input gradient computed by ``B(m, c)`` to the rank of ``v - 1``;
- ``RECV_B(m, c)``: receive the gradient of ``F(m, c)``'s output from the rank of ``v + 1``.

A list holds communication actions exactly for transfers that cross ranks: with one pipeline
rank and several chunks, chunk ``c`` hands its output to chunk ``c + 1`` locally. Every maximal
run of consecutive communication actions is ONE batch (one ``batch_isend_irecv`` in the
executor): that is how a schedule asks for the fused pairs of Megatron-LM
(``send_forward_recv_backward`` and friends); :func:`split_steps` cuts a list into such steps.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "ActionKind",
    "Action",
    "virtual_stage",
    "stage_of",
    "peer_rank",
    "split_steps",
    "format_actions",
    "parse_actions",
]


class ActionKind(str, enum.Enum):
    """What an :class:`Action` does: compute (F, B, W) or one half of a point-to-point transfer."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        """True for F, B and W."""
        return self in (ActionKind.F, ActionKind.B, ActionKind.W)

    @property
    def is_comm(self) -> bool:
        """True for the four send/receive kinds."""
        return not self.is_compute

    @property
    def is_send(self) -> bool:
        """True for SEND_F and SEND_B."""
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        """True for RECV_F and RECV_B."""
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank.

    Attributes:
        kind: what to do (see the module docstring for the meaning of each kind).
        microbatch: index of the microbatch, ``0 <= microbatch < num_microbatches``.
        chunk: local model chunk, ``0 <= chunk < num_chunks`` (0 when not interleaved).
    """

    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.microbatch < 0 or self.chunk < 0:
            raise ValueError(
                f"action {self.kind.value}: microbatch {self.microbatch} and chunk {self.chunk} "
                "must both be >= 0"
            )

    def __str__(self) -> str:
        """Compact form used in tables: ``F3``, ``B3:1`` (chunk 1), ``SEND_F3``."""
        suffix = f":{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.microbatch}{suffix}"


def virtual_stage(pipeline_rank: int, chunk: int, num_stages: int) -> int:
    """The virtual stage held by ``chunk`` of ``pipeline_rank``: ``chunk * num_stages + rank``."""
    return chunk * num_stages + pipeline_rank


def stage_of(virtual: int, num_stages: int) -> tuple[int, int]:
    """Inverse of :func:`virtual_stage`: the ``(pipeline_rank, chunk)`` holding ``virtual``."""
    return virtual % num_stages, virtual // num_stages


def peer_rank(action: Action, pipeline_rank: int, num_stages: int) -> int:
    """The pipeline rank at the other end of a communication action.

    SEND_F and RECV_B talk to the next virtual stage's rank, RECV_F and SEND_B to the previous
    one's (activations flow forward along the virtual stages, gradients backward).

    Raises:
        ValueError: ``action`` is a compute action.
    """
    if action.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
        return (pipeline_rank + 1) % num_stages
    if action.kind in (ActionKind.RECV_F, ActionKind.SEND_B):
        return (pipeline_rank - 1) % num_stages
    raise ValueError(f"{action} is a compute action; only send/receive actions have a peer")


def split_steps(actions: Iterable[Action]) -> list[tuple[Action, ...]]:
    """Cut an action list into executor steps.

    Each compute action is a step of its own; each maximal run of consecutive communication
    actions is one step, to be issued as one batch of isend/irecv and waited on together.

    Example: ``F1 SEND_F1 RECV_B0 B0`` -> ``[(F1,), (SEND_F1, RECV_B0), (B0,)]``.
    """
    steps: list[tuple[Action, ...]] = []
    batch: list[Action] = []
    for action in actions:
        if action.kind.is_comm:
            batch.append(action)
            continue
        if batch:
            steps.append(tuple(batch))
            batch = []
        steps.append((action,))
    if batch:
        steps.append(tuple(batch))
    return steps


def format_actions(actions: Iterable[Action]) -> str:
    """Space-separated compact form of an action list (see :meth:`Action.__str__`)."""
    return " ".join(str(action) for action in actions)


_TOKEN = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)(?::(\d+))?$")


def parse_actions(text: str | Sequence[str]) -> list[Action]:
    """Parse the compact form written by :func:`format_actions` (handy for hand-written tables).

    Args:
        text: e.g. ``"F0 F1 B0 F2:1 SEND_F2:1"`` or a list of such tokens.

    Raises:
        ValueError: a token is not ``KIND<microbatch>[:<chunk>]``.
    """
    tokens = text.split() if isinstance(text, str) else list(text)
    parsed: list[Action] = []
    for token in tokens:
        match = _TOKEN.match(token)
        if match is None:
            raise ValueError(
                f"cannot parse action {token!r}: expected KIND<microbatch>[:<chunk>] with KIND one "
                f"of {', '.join(kind.value for kind in ActionKind)}"
            )
        kind, microbatch, chunk = match.groups()
        parsed.append(Action(ActionKind(kind), int(microbatch), int(chunk or 0)))
    return parsed
