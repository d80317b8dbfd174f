"""``ModelShape``: the few numbers of a transformer that the planner's formulas read.

The default is a stack of pre-LN GPT blocks (LayerNorm, fused qkv, softmax attention, output
projection, LayerNorm, two-layer MLP with GeLU, biases everywhere), a token and a position
embedding, a final LayerNorm and an output head tied to the token embedding: the model of
Megatron-LM (Shoeybi et al. 2019) and of every tessera example. The fields after ``dropout``
describe the other decoders people train today (Llama, Mistral, Qwen2: grouped-query attention
with ``kv_heads`` key/value heads, separate q/k/v projections, a gated MLP, RMSNorm, rotary
positions, no biases, an untied head), and :meth:`ModelShape.from_config` reads them from a
transformers ``config.json``. ``vocab=0`` leaves the embeddings and the head out, which is what
the benchmarks measure (blocks alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from tessera.registry import ConfigError

__all__ = ["BlockLinear", "ModelShape"]

#: ``model_type`` values :meth:`ModelShape.from_config` reads.
_GPT2_TYPES = ("gpt2",)
_NEOX_TYPES = ("gpt_neox",)
_LLAMA_TYPES = ("llama", "mistral", "qwen2")

Norm = Literal["layernorm", "rmsnorm"]
#: The names of a block's linear layers (:attr:`BlockLinear.name`).
_LINEAR_NAMES = ("qkv", "q", "k", "v", "proj", "fc1", "gate", "up", "fc2")
Positions = Literal["learned", "rotary"]


@dataclass(frozen=True)
class BlockLinear:
    """One linear layer of a block, as the tensor modes split it.

    Attributes:
        name: ``qkv``, ``q``, ``k``, ``v``, ``proj``, ``fc1``, ``gate``, ``up``, ``fc2``.
        n_in: Input features.
        n_out: Output features this layer computes when its heads are split over the ranks
            asked for (:meth:`ModelShape.block_linears`): key/value heads fewer than those
            ranks are repeated, one per rank, so ``k`` and ``v`` grow.
        column: Split by output features under 1d (Megatron-LM's column-parallel layer);
            otherwise by input features (row-parallel), its bias whole.
        repeated: Its heads are repeated over the ranks (``k`` and ``v``, or a fused ``qkv``,
            with fewer key/value heads than ranks): tessera's ``RepeatedHeads`` keeps the
            weight (and bias) whole on every rank, ``held`` elements, each rank computing its
            heads from it.
        held: The whole weight's elements of a ``repeated`` layer (0 otherwise).
        bias: Whether it has a bias (``out`` elements; a ``repeated`` layer's is whole).
    """

    name: str
    n_in: int
    n_out: int
    column: bool
    repeated: bool = False
    held: int = 0
    bias: bool = True

    @property
    def weights(self) -> int:
        """Elements of its weight matrix."""
        return self.n_in * self.n_out


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
        kv_heads: Key/value heads (grouped-query attention, Ainslie et al. 2023); ``None``:
            as many as ``heads``. ``heads`` must be divisible by it.
        ffn_width: The MLP's inner width ``F`` when it is no multiple of ``hidden`` (Llama's
            11008 at hidden 4096); ``None``: ``ffn_multiple * hidden``.
        gated_mlp: A gated MLP (``down(act(gate(x)) * up(x))``, Shazeer 2020's SwiGLU): three
            matrices instead of two.
        biases: Which linear layers have biases: all (``True``), none (``False``), or those
            named (:attr:`BlockLinear.name`: Qwen2's ``("q", "k", "v")``).
        norm: ``"layernorm"`` (weight and bias) or ``"rmsnorm"`` (weight only).
        positions: ``"learned"`` (a position table ``[s, h]``) or ``"rotary"`` (no parameters).
        tied_head: Whether the output head shares the token table.
        fused_qkv: Whether q, k and v are one linear layer (GPT-2's ``c_attn``) or three.
        max_positions: Rows of a learned position table (GPT-2's ``n_positions``); ``None``:
            ``seq``.

    Raises:
        ConfigError: a field is not a positive int (``vocab`` may be 0), ``hidden`` is not
            divisible by ``heads``, or ``heads`` by ``kv_heads``; the message starts with the
            field's name.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    batch: int
    ffn_multiple: int = 4
    dropout: bool = False
    kv_heads: int | None = None
    ffn_width: int | None = None
    gated_mlp: bool = False
    biases: bool | tuple[str, ...] = True
    norm: Norm = "layernorm"
    positions: Positions = "learned"
    tied_head: bool = True
    fused_qkv: bool = True
    max_positions: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "batch", "ffn_multiple"):
            _check_count(name, getattr(self, name), minimum=1)
        _check_count("vocab", self.vocab, minimum=0)
        for name in ("kv_heads", "ffn_width", "max_positions"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name), minimum=1)
        _check_choice("norm", self.norm, ("layernorm", "rmsnorm"))
        if not isinstance(self.biases, bool | tuple):
            raise ConfigError(
                f"biases must be True, False or a tuple of layer names, got {self.biases!r}"
            )
        if not isinstance(self.biases, bool):
            for name in self.biases:
                _check_choice("biases", name, _LINEAR_NAMES)
        _check_choice("positions", self.positions, ("learned", "rotary"))
        if self.hidden % self.heads != 0:
            raise ConfigError(
                f"hidden {self.hidden} is not divisible by heads {self.heads} "
                f"({self.hidden} % {self.heads} = {self.hidden % self.heads}); every head needs "
                "hidden / heads features"
            )
        if self.heads % self.key_value_heads != 0:
            raise ConfigError(
                f"kv_heads {self.key_value_heads} does not divide heads {self.heads} "
                f"({self.heads} % {self.key_value_heads} = {self.heads % self.key_value_heads}); "
                "every key/value head serves the same number of query heads"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, object], *, seq: int, batch: int) -> ModelShape:
        """The shape of a transformers decoder from its ``config.json`` (as a dict).

        ``model_type`` says which block it is: ``gpt2`` (``n_layer``, ``n_embd``, ``n_head``,
        ``n_inner``, ``n_positions``; a tied head), ``gpt_neox`` (Pythia's:
        ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``intermediate_size``,
        ``attention_bias``, ``tie_word_embeddings``; GPT-2's block with rotary positions and
        an untied head unless tied, its parallel residual counted as GPT-2's sequential one,
        which saves one ``[T, h]`` more per block where the norms are torch's and share their
        input: without tensor parallelism and under 1D) or one of the Llama family (``llama``,
        ``mistral``, ``qwen2``: ``num_hidden_layers``, ``hidden_size``,
        ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``,
        ``attention_bias``, ``mlp_bias``, ``tie_word_embeddings``; a gated MLP, RMSNorm,
        rotary positions, separate q/k/v, an untied head unless tied; ``attention_bias`` puts
        biases on q, k, v and the output projection, ``mlp_bias`` on the MLP's three, and
        Qwen2 has them on q, k and v alone).

        Args:
            config: The config's keys and values.
            seq: Sequence length to plan for (the config gives only the longest).
            batch: Global batch in samples.

        Raises:
            ConfigError: another ``model_type`` (its block would be counted wrong: experts,
                other head sizes, other layouts), a ``head_dim`` other than hidden / heads,
                or a key the block needs missing; the message names it.
        """

        def get(*names: str, default: object = None) -> object:
            for name in names:
                if name in config and config[name] is not None:
                    return config[name]
            if default is None:
                raise ConfigError(
                    f"config has none of {', '.join(names)}: the planner reads it from a "
                    "transformers config.json of GPT-2, GPT-NeoX or the Llama family"
                )
            return default

        kind = config.get("model_type")
        if kind not in (*_GPT2_TYPES, *_NEOX_TYPES, *_LLAMA_TYPES):
            raise ConfigError(
                f"config model_type {kind!r} is not one the planner reads ("
                f"{', '.join(_GPT2_TYPES + _NEOX_TYPES + _LLAMA_TYPES)}): its block may hold "
                "experts, other "
                "head sizes or other layers; give its numbers as --layers, --hidden, --heads, "
                "--vocab instead"
            )
        hidden = _as_int(get("hidden_size", "n_embd"))
        heads = _as_int(get("num_attention_heads", "n_head"))
        common = {
            "layers": _as_int(get("num_hidden_layers", "n_layer")),
            "hidden": hidden,
            "heads": heads,
            "seq": seq,
            "vocab": _as_int(get("vocab_size")),
            "batch": batch,
            "dropout": False,
        }
        if kind in _GPT2_TYPES:
            inner = get("n_inner", default=0)
            return cls(
                **common,  # type: ignore[arg-type]
                ffn_width=_as_int(inner) if inner else None,
                max_positions=_as_int(get("n_positions")),
                tied_head=bool(get("tie_word_embeddings", default=True)),
            )
        if kind in _NEOX_TYPES:
            return cls(
                **common,  # type: ignore[arg-type]
                ffn_width=_as_int(get("intermediate_size")),
                biases=True if get("attention_bias", default=True) else ("fc1", "fc2"),
                positions="rotary",
                tied_head=bool(get("tie_word_embeddings", default=False)),
            )
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim != hidden // heads:
            raise ConfigError(
                f"config head_dim {head_dim} is not hidden_size / num_attention_heads "
                f"({hidden} / {heads} = {hidden // heads}): the planner's heads have "
                "hidden / heads features"
            )
        return cls(
            **common,  # type: ignore[arg-type]
            kv_heads=_as_int(get("num_key_value_heads", default=heads)),
            ffn_width=_as_int(get("intermediate_size")),
            gated_mlp=True,
            biases=_llama_biases(
                qwen2=kind == "qwen2",
                attention=bool(get("attention_bias", default=False)),
                mlp=bool(get("mlp_bias", default=False)),
            ),
            norm="rmsnorm",
            positions="rotary",
            tied_head=bool(get("tie_word_embeddings", default=False)),
            fused_qkv=False,
        )

    @property
    def key_value_heads(self) -> int:
        """``kv_heads``, or ``heads`` when it is ``None``."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def position_rows(self) -> int:
        """Rows of the learned position table (0 with rotary positions)."""
        if self.positions == "rotary":
            return 0
        return self.seq if self.max_positions is None else self.max_positions

    @property
    def head_dim(self) -> int:
        """Features of one head, ``h / heads``."""
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        """The MLP's inner width ``F`` (``ffn_width``, else ``ffn_multiple * hidden``)."""
        return self.ffn_width if self.ffn_width is not None else self.ffn_multiple * self.hidden

    def block_linears(self, heads_split: int = 1) -> tuple[BlockLinear, ...]:
        """The block's linear layers, with the heads split over ``heads_split`` ranks.

        Key/value heads fewer than ``heads_split`` are repeated so that each rank holds one
        (tessera's ``RepeatedHeads``): ``k`` and ``v`` then compute ``heads_split`` heads,
        from whole weights on every rank; fused, the whole ``qkv`` weight is held, its query
        rows too.
        """
        h, f, d = self.hidden, self.ffn, self.head_dim
        kv = d * max(self.key_value_heads, heads_split)
        repeated = self.key_value_heads < heads_split
        if self.fused_qkv:  # repeats held in the whole fused weight, query rows and all
            held = h * (h + 2 * d * self.key_value_heads) if repeated else 0
            attention = [BlockLinear("qkv", h, h + 2 * kv, True, repeated, held)]
        else:
            held = h * d * self.key_value_heads if repeated else 0
            attention = [
                BlockLinear("q", h, h, True),
                *(BlockLinear(n, h, kv, True, repeated, held) for n in ("k", "v")),
            ]
        inner = ("gate", "up") if self.gated_mlp else ("fc1",)
        linears = (
            *attention,
            BlockLinear("proj", h, h, False),
            *(BlockLinear(name, h, f, True) for name in inner),
            BlockLinear("fc2", f, h, False),
        )
        return tuple(replace(x, bias=self.has_bias(x.name)) for x in linears)

    def has_bias(self, linear: str) -> bool:
        """Whether the block's linear layer ``linear`` has a bias (see ``biases``).

        A fused ``qkv`` has one where ``biases`` names q.
        """
        if isinstance(self.biases, bool):
            return self.biases
        return linear in self.biases or (linear == "qkv" and "q" in self.biases)

    @property
    def block_weights(self) -> int:
        """Weight-matrix elements of one block (``4h^2 + 2hF`` for GPT)."""
        return sum(linear.weights for linear in self.block_linears())

    @property
    def norm_vectors(self) -> int:
        """Elements of one norm: weight and bias ``2h`` (LayerNorm) or weight ``h`` (RMSNorm)."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    @property
    def block_vectors(self) -> int:
        """Bias and norm elements of one block (biases ``5h + F``, two LayerNorms ``4h``)."""
        biases = sum(linear.n_out for linear in self.block_linears() if linear.bias)
        return biases + 2 * self.norm_vectors

    @property
    def embedding_parameters(self) -> int:
        """Token (and position) tables, an untied head and the final norm (0 with ``vocab=0``)."""
        if self.vocab == 0:
            return 0
        tables = (1 if self.tied_head else 2) * self.vocab * self.hidden
        return tables + self.position_rows * self.hidden + self.norm_vectors

    @property
    def parameters(self) -> int:
        """Every parameter of the model once."""
        return self.layers * (self.block_weights + self.block_vectors) + self.embedding_parameters

    def block_forward_flops(self, samples: int) -> int:
        """Floating-point operations of one block's forward over ``samples`` sequences.

        Two per multiply-add: ``2 T W`` in the linear layers (``W`` their weights, ``4h^2 +
        2hF`` for GPT) and ``4 T s h`` in ``Q K^T`` and ``P V`` (the count behind Narayanan
        et al. 2021's FLOPs estimate, "Efficient Large-Scale Language Model Training on GPU
        Clusters Using Megatron-LM"), ``T = samples * s``. Element-wise work (softmax, GeLU,
        norms, rotary) is left out: it is memory-bound and small.
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


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _as_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config value {value!r} is not an int")
    return value


def _llama_biases(*, qwen2: bool, attention: bool, mlp: bool) -> bool | tuple[str, ...]:
    """The Llama family's biases (``ModelShape.biases``).

    ``attention_bias`` puts them on q, k, v and the output, ``mlp_bias`` on the MLP's three;
    Qwen2 has them on q, k and v alone.
    """
    names: tuple[str, ...] = ("q", "k", "v") if qwen2 else ()
    names += ("q", "k", "v", "proj") if attention and not qwen2 else ()
    names += ("gate", "up", "fc2") if mlp else ()
    if len(names) == 7:
        return True
    return names or False
