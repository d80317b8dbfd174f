"""A transformer as a researcher writes it, with no transformers class and no plan.

A token and a learned position ``nn.Embedding``, blocks of q/k/v/o ``nn.Linear`` around
``F.scaled_dot_product_attention`` and a two-layer MLP, a final norm and a head onto the
vocabulary: what ``parallelize`` must read a plan from by itself. Sized like hf_models.py's
GPT-2 (hidden 16, 4 heads, vocabulary 32) so every layout divides it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers import Plan


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, n_head: int, causal: bool = True) -> None:
        super().__init__()
        self.n_head, self.causal = n_head, causal
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            p(x).view(b, s, self.n_head, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # [b, heads, s, d]
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, n_head: int, causal: bool = True) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, n_head, causal)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainLM(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 16, n_head: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, hidden), nn.Embedding(16, hidden)
        self.blocks = nn.ModuleList(Block(hidden, n_head) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)  # [s]
        x = self.tok_emb(ids) + self.pos_emb(positions)  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))  # [b, s, V]
        return logits


class PatchViT(nn.Module):
    """A ViT as a researcher writes it, as torchvision's is: a patch convolution, a class token
    and positions of its own added in its forward, the blocks called in a loop, a final norm
    and a classifier on the class token. No plan fits it whole; each block gets a features
    plan read from it and is parallelized as a part."""

    def __init__(
        self, hidden: int = 16, n_head: int = 4, layers: int = 2, image: int = 6, patch: int = 2
    ) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, hidden, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, hidden))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, hidden))
        self.blocks = nn.ModuleList(Block(hidden, n_head, causal=False) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 8)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)  # [b, N, h]
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos  # [b, N+1, h]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x)[:, 0])  # [b, C]
        return logits


def plain_lm(seed: int = 0) -> PlainLM:
    """:class:`PlainLM` with weights drawn from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return PlainLM()


#: The plan a user would write for :class:`PlainLM` (what ``parallelize`` reads without it).
PLAIN_PLAN = {
    "tok_emb": "embedding",
    "pos_emb": "position_embedding",
    "blocks.*.attn": "attention",
    "blocks.*.attn.q": "col",
    "blocks.*.attn.k": "col",
    "blocks.*.attn.v": "col",
    "blocks.*.attn.o": "row",
    "blocks.*.fc1": "col",
    "blocks.*.fc2": "row",
    "blocks.*.ln*": "norm",
    "ln_f": "norm",
    "head": "head",
}


class DropPath(nn.Module):
    """Stochastic depth as timm writes it: each sample's branch kept or dropped whole."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        kept = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)  # [b, 1, 1]
        return x * kept / keep


class StochasticDepth(nn.Module):
    """Stochastic depth as torchvision writes it (``torchvision.ops.StochasticDepth``, which the
    pinned torch's environment lacks): a plain tensor of noise, per row or for the batch."""

    def __init__(self, p: float, mode: str = "row") -> None:
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        rows = x.shape[0] if self.mode == "row" else 1
        noise = torch.empty((rows,) + (1,) * (x.dim() - 1), dtype=x.dtype)
        return x * noise.bernoulli_(1.0 - self.p).div_(1.0 - self.p)


class RowNoise(StochasticDepth):
    """The same noise per row under a name of its own, which tessera cannot tell from any
    other random module (a plain tensor drawn per rank, refused where it is left out)."""


class DropPathBlock(Block):
    """:class:`Block` whose two residual branches go through a :class:`DropPath` each."""

    def __init__(self, hidden: int, n_head: int, drop: float) -> None:
        super().__init__(hidden, n_head)
        self.drop1, self.drop2 = DropPath(drop), DropPath(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class ColumnDropPathBlock(DropPathBlock):
    """:class:`DropPathBlock` dropping each sample's MLP hidden layer instead of its output:
    under 1D a column layer's output, split by features in a region forked per rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.fc2(self.drop2(F.gelu(self.fc1(self.ln2(x)))))


class DropPathLM(PlainLM):
    """:class:`PlainLM` of :class:`DropPathBlock` (stochastic depth of ``drop``)."""

    def __init__(self, drop: float = 0.5, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DropPathBlock(16, 4, drop) for _ in range(layers))


class LayerScale(nn.Module):
    """A learned scale of each feature (CaiT's, DINOv2's): no plan names it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Gate(nn.Module):
    """A learned scalar gate (ReZero's), called without an input: ``x + gate() * f(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(0.5))

    def forward(self) -> torch.Tensor:
        return self.alpha.tanh()


class GatedMLP(nn.Module):
    """An MLP added to its input through a :class:`Gate`, or a scalar held by the MLP itself
    (``own_gate``): neither is a module a plan can leave out to run under DTensor."""

    def __init__(self, hidden: int, own_gate: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)
        self.gate = Gate() if not own_gate else None
        self.alpha = nn.Parameter(torch.tensor(0.5)) if own_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate() if self.gate is not None else self.alpha
        return x + gate * self.fc2(F.gelu(self.fc1(x)))


class ScaleNorm(nn.Module):
    """A norm without parameters, as a researcher writes it: mixes every feature of a token."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class Centered(nn.Module):
    """Subtracts each token's mean feature: mixes the features of an MLP's hidden layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)


class TokenMean(nn.Module):
    """Each row's mean over its tokens, ``[b, s, h] -> [b, h]``: mixes the sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1) / x.shape[1]


class SinusoidalPositions(nn.Module):
    """torch tutorial's fixed position encoding, a buffer table added to the tokens, after a
    fixed gain per feature (a buffer the backward multiplies by too), and a ramp over the
    positions the forward makes itself."""

    def __init__(self, hidden: int, max_len: int = 16) -> None:
        super().__init__()
        angle = torch.arange(max_len)[:, None] * torch.exp(
            torch.arange(0, hidden, 2) * (-math.log(10000.0) / hidden)
        )  # [max_len, h/2]
        self.register_buffer("pe", torch.stack((angle.sin(), angle.cos()), -1).flatten(1))
        self.register_buffer("gain", torch.linspace(0.5, 1.5, hidden), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ramp = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)[:, None] / 16  # [s, 1]
        out: torch.Tensor = x * self.gain + self.pe[: x.shape[1]] + ramp
        return out


class SinusoidalTable(SinusoidalPositions):
    """:class:`SinusoidalPositions`' table for ``x``'s positions, ``[1, s, h]``, returned for
    the caller to add: an output made from buffers alone, broadcast over the batch, and a view
    of the buffer (under ``torch.compile`` AOTAutograd rebuilds an output aliasing an input
    with ``as_strided``, which DTensor lacks: left_out.py copies it while traced)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.pe[None, : x.shape[1]]
        return out


class OwnModulesBlock(Block):
    """:class:`Block` normalized by modules without parameters (a :class:`ScaleNorm`, a
    ``nn.LayerNorm`` without affine), each row's mean token added (a pooling that drops a
    dim), its MLP's hidden layer centered, fixed positions added from buffers first (by the
    module, then from a table it returns)."""

    def __init__(self, hidden: int, n_head: int) -> None:
        super().__init__(hidden, n_head)
        self.ln1, self.ln2 = ScaleNorm(), nn.LayerNorm(hidden, elementwise_affine=False)
        self.pool, self.mid = TokenMean(), Centered()
        self.positions, self.table = SinusoidalPositions(hidden), SinusoidalTable(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.positions(x)
        x = x + self.table(x)  # [b, s, h] + [1, s, h]
        x = x + self.attn(self.ln1(x))
        x = x + 0.5 * self.pool(x)[:, None, :]
        return x + self.fc2(self.mid(F.gelu(self.fc1(self.ln2(x)))))


class OwnModulesLM(PlainLM):
    """:class:`PlainLM` of :class:`OwnModulesBlock` returning log-probabilities (a
    ``nn.LogSoftmax`` over the vocabulary): modules no plan names, each mixing what a tensor
    mode splits (features, the MLP's hidden layer, the vocabulary)."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(OwnModulesBlock(16, 4) for _ in range(layers))
        self.log_probs = nn.LogSoftmax(-1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.log_probs(super().forward(ids))
        return out


def own_modules_lm(seed: int = 0, layers: int = 2) -> OwnModulesLM:
    """:class:`OwnModulesLM` of ``layers`` blocks, with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return OwnModulesLM(layers)


#: :data:`PLAIN_PLAN` for :class:`OwnModulesLM`: its blocks' norms are left out.
OWN_MODULES_PLAN = Plan(
    {k: v for k, v in PLAIN_PLAN.items() if k != "blocks.*.ln*"},
    boundary="tokens",
    sequence_span=("blocks.0", "blocks.-1"),
    causal_lm=True,
)


class MaskedTokenMean(nn.Module):
    """Each row's mean over its tokens a mask keeps, ``[b, s, V], [b, s] -> [b, V]``."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        kept = keep[..., None].to(x.dtype)  # [b, s, 1]
        out: torch.Tensor = (x * kept).sum(1) / kept.sum(1)
        return out


class MaskedPoolLM(PlainLM):
    """:class:`PlainLM` whose logits gain each row's mean over its non-padding tokens: a
    module left out taking the model's own mask of the ids, which a tensor mode splitting
    the inputs hands it as this rank's part."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = MaskedTokenMean()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = super().forward(ids)  # [b, s, V]
        out: torch.Tensor = logits + self.pool(logits, ids != 0)[:, None]
        return out


class ProbabilitiesLM(PlainLM):
    """:class:`PlainLM` returning each token's probabilities: a softmax over the vocabulary in
    its own forward, which 1D splits."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).softmax(-1)  # [b, s, V]


class LastTokenLM(PlainLM):
    """:class:`PlainLM` returning the last token's logits, taken in its own forward: under
    'sequence' this rank's last token, of its chunk of the sequence."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids)[:, -1]  # [b, V]


class LastTokenNormLM(PlainLM):
    """:class:`PlainLM` taking the last token before its final norm: under 'sequence' it gives
    this rank's last token, of its chunk of the sequence, to ``ln_f``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)  # [s]
        x = self.tok_emb(ids) + self.pos_emb(positions)  # [b, s, h]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x[:, -1]))  # [b, V]
        return logits


class FunctionalNormBlock(Block):
    """:class:`Block` that normalizes its input in its own forward, with no module: code no
    plan can name, which reads split features as the whole under 2D, 2.5D and 3D.

    ``reshaped``: the squares are taken of ``x`` viewed as ``[b, s, -1, h]``, which
    parallelize's check of the model's own code reads as heads of ``h`` features (the count
    of heads asked for, one), cutting the heads: only ``verify=`` sees the norm over the
    split features."""

    def __init__(self, hidden: int, n_head: int, reshaped: bool) -> None:
        super().__init__(hidden, n_head)
        self.reshaped = reshaped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reshaped:
            mean_square = x.view(*x.shape[:-1], -1, x.shape[-1]).pow(2).mean(-1)  # [b, s, 1]
        else:
            mean_square = x.pow(2).mean(-1, keepdim=True)  # [b, s, 1]
        return super().forward(x * torch.rsqrt(mean_square + 1e-5))


class FunctionalNormLM(PlainLM):
    """:class:`PlainLM` of :class:`FunctionalNormBlock`."""

    def __init__(self, reshaped: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(FunctionalNormBlock(16, 4, reshaped) for _ in range(2))


def functional_norm_lm(seed: int = 0, reshaped: bool = False) -> FunctionalNormLM:
    """:class:`FunctionalNormLM` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return FunctionalNormLM(reshaped)


class MaskedAttention(SelfAttention):
    """:class:`SelfAttention` whose SDPA call masks the padding keys of ``keep`` ``[b, s]``."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        assert keep is not None
        q, k, v = self.heads(x)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed(keep, x.shape[1]))
        return self.o(out.transpose(1, 2).flatten(2))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k and v ``[b, heads, s, d]`` of ``x`` ``[b, s, h]``."""
        b, s, _ = x.shape
        return tuple(
            p(x).view(b, s, self.n_head, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )

    @staticmethod
    def allowed(keep: torch.Tensor, s: int) -> torch.Tensor:
        """``[b, 1, s, s]``: earlier tokens that are not padding."""
        causal = torch.ones(s, s, dtype=torch.bool, device=keep.device).tril()
        return keep[:, None, None, :] & causal


class ScoresAttention(MaskedAttention):
    """:class:`MaskedAttention` computing its scores itself, with no SDPA call."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        assert keep is not None
        q, k, v = self.heads(x)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [b, heads, s, s]
        scores = scores.masked_fill(~self.allowed(keep, x.shape[1]), float("-inf"))
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).flatten(2))


class MaskedBlock(Block):
    """:class:`Block` whose attention masks padding."""

    def __init__(self, hidden: int, n_head: int, attention: type[MaskedAttention]) -> None:
        super().__init__(hidden, n_head)
        self.attn = attention(hidden, n_head)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), keep)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PaddedPoolLM(PlainLM):
    """:class:`PlainLM` over a padded batch (``attention_mask`` 1: a token, 0: padding): its
    attention masks the padding keys, and each token's logits add its row's mean hidden state
    over the tokens kept, computed in the model's own forward beside the hidden states."""

    def __init__(self, attention: type[MaskedAttention] = MaskedAttention) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MaskedBlock(16, 4, attention) for _ in range(2))

    def forward(  # type: ignore[override]
        self, ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        keep = attention_mask.bool()  # [b, s]
        positions = torch.arange(ids.shape[1], device=ids.device)  # [s]
        x = self.tok_emb(ids) + self.pos_emb(positions)  # [b, s, h]
        for block in self.blocks:
            x = block(x, keep)
        h = self.ln_f(x)
        kept = keep[..., None].to(h.dtype)  # [b, s, 1]
        pooled = (h * kept).sum(1, keepdim=True) / kept.sum(1, keepdim=True)  # [b, 1, h]
        logits: torch.Tensor = self.head(h + pooled)  # [b, s, V]
        return logits


def padded_pool_lm(
    seed: int = 0, attention: type[MaskedAttention] = MaskedAttention
) -> PaddedPoolLM:
    """:class:`PaddedPoolLM` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return PaddedPoolLM(attention)


#: :data:`PLAIN_PLAN` as a :class:`Plan` spanning the blocks (1D sequence parallelism).
PLAIN_SPAN_PLAN = Plan(
    PLAIN_PLAN, boundary="tokens", sequence_span=("blocks.0", "blocks.-1"), causal_lm=True
)


def torch_encoder(seed: int = 0, batch_first: bool = True) -> nn.TransformerEncoder:
    """torch's own ``nn.TransformerEncoder``: 2 post-norm layers of 4 heads and a final norm,
    no dropout, sized as :class:`PlainLM` (hidden 16)."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=True)


class TorchEncoderLM(nn.Module):
    """A causal LM built from torch's ``nn.TransformerEncoder`` (pre-norm layers), a token and
    a learned position ``nn.Embedding``, a final norm and a head: no plan given, so
    ``parallelize`` reads one from its structure. ``attention_mask`` (1: a token, 0: padding)
    becomes the encoder's ``src_key_padding_mask``."""

    def __init__(self, vocab: int = 32, hidden: int = 16, n_head: int = 4) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, hidden), nn.Embedding(16, hidden)
        layer = nn.TransformerEncoderLayer(
            hidden, n_head, 2 * hidden, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(
        self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        length = ids.shape[1]
        positions = torch.arange(length, device=ids.device)  # [s]
        x = self.tok_emb(ids) + self.pos_emb(positions)  # [b, s, h]
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        padding = None if attention_mask is None else attention_mask == 0  # True: padding
        x = self.encoder(x, mask=causal, is_causal=True, src_key_padding_mask=padding)
        logits: torch.Tensor = self.head(self.ln_f(x))  # [b, s, V]
        return logits


def torch_encoder_lm(seed: int = 0) -> TorchEncoderLM:
    """:class:`TorchEncoderLM` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return TorchEncoderLM()


def torch_decoder(seed: int = 0) -> nn.TransformerDecoder:
    """torch's own ``nn.TransformerDecoder``: 2 pre-norm layers of 4 heads (self- and
    cross-attention) and a final norm, no dropout, hidden 16."""
    torch.manual_seed(seed)
    layer = nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)
    return nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(16))


def torch_transformer(seed: int = 0) -> nn.Transformer:
    """torch's own ``nn.Transformer``: one encoder and one decoder layer of 4 heads (and their
    final norms), no dropout, hidden 16."""
    torch.manual_seed(seed)
    return nn.Transformer(16, 4, 1, 1, 32, dropout=0.0, batch_first=True)
