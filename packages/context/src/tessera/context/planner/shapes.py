"""``ModelShape``: the few numbers of a GPT-style transformer that the planner's formulas read.

The planner models a stack of pre-LN transformer blocks (LayerNorm, fused qkv, softmax
attention, output projection, LayerNorm, two-layer MLP with GeLU), a token and a position
embedding, a final LayerNorm and an output head tied to the token embedding: the model of
Megatron-LM (Shoeybi et al. 2019) and of every tessera example. ``vocab=0`` leaves the
embeddings and the head out, which is what the benchmarks measure (blocks alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.registry import ConfigError

__all__ = ["ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    """A transformer's shape and its global batch.

    Attributes:
        layers: Transformer blocks.
        hidden: Model width ``h``.
        heads: Attention heads; ``hidden`` must be divisible by it.
        seq: Sequence length ``s`` (tokens per sample).
        vocab: Vocabulary size ``V``; 0 means no embedding and no head (blocks only).
        batch: Global batch ``b`` in samples, summed over data-parallel replicas.
        ffn_multiple: MLP width as a multiple of ``hidden`` (4 in GPT and BERT).
        dropout: Whether dropout is active (p > 0): its masks and the attention dropout's
            output are then saved for the backward (Korthikanti et al. 2022, section 4.1).

    Raises:
        ConfigError: a field is not a positive int (``vocab`` may be 0), or ``hidden`` is not
            divisible by ``heads``; the message starts with the field's name.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int
    ffn_multiple: int = 4
    dropout: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "batch", "ffn_multiple"):
            _check_count(name, getattr(self, name), minimum=1)
        _check_count("vocab", self.vocab, minimum=0)
        if self.hidden % self.heads != 0:
            raise ConfigError(
                f"hidden {self.hidden} is not divisible by heads {self.heads} "
                f"({self.hidden} % {self.heads} = {self.hidden % self.heads}); every head needs "
                "hidden / heads features"
            )

    @property
    def ffn(self) -> int:
        """The MLP's inner width ``F = ffn_multiple * hidden``."""
        return self.ffn_multiple * self.hidden

    @property
    def block_weights(self) -> int:
        """Weight-matrix elements of one block: qkv ``3h^2``, proj ``h^2``, MLP ``2hF``."""
        h = self.hidden
        return 4 * h * h + 2 * h * self.ffn

    @property
    def block_vectors(self) -> int:
        """Bias and LayerNorm elements of one block: biases ``5h + F``, two LayerNorms ``4h``."""
        return 9 * self.hidden + self.ffn

    @property
    def embedding_parameters(self) -> int:
        """Token and position tables and the final LayerNorm (0 with ``vocab=0``)."""
        if self.vocab == 0:
            return 0
        return (self.vocab + self.seq) * self.hidden + 2 * self.hidden

    @property
    def parameters(self) -> int:
        """Every parameter of the model once (the head is tied to the token table)."""
        return self.layers * (self.block_weights + self.block_vectors) + self.embedding_parameters

    def block_forward_flops(self, samples: int) -> int:
        """Floating-point operations of one block's forward over ``samples`` sequences.

        Two per multiply-add: ``2 T (4h^2 + 2hF)`` in the four linear layers and ``4 T s h``
        in ``Q K^T`` and ``P V`` (the count behind Narayanan et al. 2021's FLOPs estimate,
        "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
        ``T = samples * s``.
        Element-wise work (softmax, GeLU, LayerNorm) is left out: it is memory-bound and small.
        """
        tokens = samples * self.seq
        return 2 * tokens * self.block_weights + 4 * tokens * self.seq * self.hidden

    def head_forward_flops(self, samples: int) -> int:
        """The output head's forward, ``2 T h V`` (0 with ``vocab=0``)."""
        return 2 * samples * self.seq * self.hidden * self.vocab


def _check_count(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; ``layers=True`` is a typo, not a count.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "positive int" if minimum == 1 else f"int >= {minimum}"
        raise ConfigError(f"{name} must be a {kind}, got {value!r}")
