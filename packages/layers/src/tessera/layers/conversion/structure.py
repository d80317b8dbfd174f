"""A plan read from a model's structure: the usual transformer block, whatever its family.

Most decoder and encoder stacks of the last years share one shape (Vaswani et al. 2017, as
laid out by GPT-2 and its successors): a token embedding, a list of identical blocks, each an
attention module with separate query, key and value projections and an output projection, an
MLP of one or two projections out of the hidden size and one back into it, and norms over the
hidden size; a final norm; a head onto the vocabulary. Megatron-LM's roles follow from that
shape alone (Shoeybi et al. 2019): q, k, v and the MLP's first layers are ``col``, the
attention output and the MLP's last layer ``row``.

:func:`infer_structure` finds that shape in a model nobody wrote a plan for (GPT-Neo, GPT-J,
Phi, ...) and returns the plan's rules, or says why it cannot. It is deliberately strict, because a
module the plan does not know would stay whole and see split activations, silently wrong:

- every module holding parameters must get a role, and so must every parameter-free norm (it
  would normalize over a split hidden dim);
- the q, k and v projections must be separate linear layers with the usual names: a fused
  projection's layout (``[3, heads, d]``, ``[heads, 3, d]``, ...) cannot be read from its
  shape, and splitting the wrong one mixes heads;
- embeddings must be plain ``nn.Embedding`` (a subclass may shift or scale inside its forward)
  and norms ones tessera computes exactly (:func:`~.norms.norm_spec`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .converters import linear_shape
from .embedding_scale import embedding_scale
from .norms import norm_spec
from .per_head_norm import holds_weights_per_head, per_head_norm_spec
from .position_table import is_position_table

__all__ = [
    "QKV_NAMES",
    "OUTPUT_NAMES",
    "StructureReport",
    "holds_matrices",
    "holds_torch_attention",
    "infer_structure",
    "scales_alone",
]

#: Names of separate query, key and value projections, by convention.
QKV_NAMES: tuple[tuple[str, str, str], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("query", "key", "value"),
    ("q", "k", "v"),
    ("wq", "wk", "wv"),
    ("q_lin", "k_lin", "v_lin"),
)
#: Names of an attention's output projection, by convention.
OUTPUT_NAMES = ("o_proj", "out_proj", "dense", "o", "wo", "out_lin", "c_proj")


@dataclass(frozen=True)
class StructureReport:
    """What :func:`infer_structure` found: a plan's parts, or why there is none.

    Attributes:
        rules: ``{pattern: role}`` (None: the model is not the usual block stack).
        reason: why ``rules`` is None (empty otherwise).
        sequence_span: the first block and the final norm, when the norm follows the blocks.
        head: whether a head onto the vocabulary was found (the model's own loss would read
            whole logits).
        features: the model is blocks alone, taking and returning activations ``[b, s, h]``
            (no token embedding, no head): a ``"features"`` plan.
        whole_sequence: why tensor mode ``'sequence'`` must refuse the plan (``Plan``'s).
    """

    rules: dict[str, str] | None
    reason: str = ""
    sequence_span: tuple[str, str] | None = None
    head: bool = False
    features: bool = False
    whole_sequence: str = ""


def _linear_or_none(name: str, module: nn.Module) -> tuple[int, int] | None:
    try:
        shape = linear_shape(name, module, "col")
    except TypeError:
        return None
    return shape.in_features, shape.out_features


def _is_norm(name: str, module: nn.Module, hidden: int) -> bool:
    try:
        spec = norm_spec(name, module)
    except TypeError:
        return False
    return spec.shape == (hidden,)


def _is_head_norm(name: str, module: nn.Module, head_dim: int) -> bool:
    """A norm of each head, with one weight (Qwen3's ``q_norm``) or a weight per head."""
    if not holds_weights_per_head(module):
        return _is_norm(name, module, head_dim) and _owns_parameters(module)
    try:
        per_head_norm_spec(name, module, head_dim)
    except TypeError:
        return False
    return True


def _owns_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def holds_matrices(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter of two or more dims (a linear layer's weight).

    Inferring a plan, such a module needs a role: left out, it would run under DTensor,
    correct but whole on every rank. A user's plan may leave it out (:mod:`.left_out`).
    """
    return any(p.dim() >= 2 for p in module.parameters())


def holds_torch_attention(module: nn.Module) -> bool:
    """Whether ``module`` holds torch's ``nn.MultiheadAttention``.

    Left out of a plan where its input is split, it cannot run under DTensor: torch shards no
    backward of its CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``), so
    it is refused up front, naming the 'attention' role, rather than failing in a backward.
    """
    return any(isinstance(m, nn.MultiheadAttention) for m in module.modules())


def _looks_like_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _join(prefix: str, name: str) -> str:
    """``prefix.name``, or either alone where the other is empty (the model itself)."""
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _children(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_modules():
        yield _join(prefix, name), child


def _blocks_of(module: nn.Module) -> list[nn.Module]:
    """The children of a list of blocks, without the norms an ``nn.Sequential`` ends with.

    ``nn.Sequential(*blocks, nn.LayerNorm(h))``: a final norm called after the blocks.
    """
    blocks = list(module.children())
    if isinstance(module, nn.Sequential):
        while len(blocks) > 1 and _looks_like_norm(blocks[-1]) and not _looks_like_norm(blocks[0]):
            blocks.pop()
    return blocks


def _is_block_list(module: nn.Module, containers: tuple[type[nn.Module], ...]) -> bool:
    """``module`` is one of ``containers`` of blocks of one class, the first holding a linear."""
    blocks = _blocks_of(module)
    if not isinstance(module, containers) or not blocks:
        return False
    holds_linear = any(_linear_or_none(n, m) is not None for n, m in blocks[0].named_modules())
    return len({type(block) for block in blocks}) == 1 and holds_linear


def _block_list(
    model: nn.Module, containers: tuple[type[nn.Module], ...] = (nn.ModuleList,)
) -> str | None:
    """The name of the longest list of blocks of one class holding linear layers.

    ``""`` where it is ``model`` itself (an ``nn.Sequential`` of blocks, ``containers``
    permitting).
    """
    best: tuple[int, str] | None = None
    for name, module in model.named_modules():
        count = len(_blocks_of(module))
        if _is_block_list(module, containers) and (best is None or count > best[0]):
            best = (count, name)
    return None if best is None else best[1]


#: Name parts of a learned position table, told apart from the token embedding by them.
_POSITION_NAMES = ("pos", "wpe", "position")


def _token_embedding(model: nn.Module) -> tuple[str, nn.Embedding] | None:
    """The token embedding: the one ``nn.Embedding`` of the vocabulary size.

    Without a config saying the vocabulary's size (a model someone wrote themselves, with a
    learned position table beside its token table), the token table is the one a head maps
    back onto (a linear layer from its width to its row count), else the one whose name does
    not say position (``pos_emb``, ``wpe``, ``position_embeddings``).
    """
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        and embedding_scale(module) is not None  # plain, or rows times a constant (Gemma's)
        and (vocab is None or module.num_embeddings == vocab)
    ]
    if len(found) > 1 and vocab is None:
        heads = {
            sizes
            for name, module in model.named_modules()
            if (sizes := _linear_or_none(name, module)) is not None
        }
        onto = [(n, m) for n, m in found if (m.embedding_dim, m.num_embeddings) in heads]
        named = [(n, m) for n, m in found if not any(p in n.lower() for p in _POSITION_NAMES)]
        found = onto if len(onto) == 1 else named
    return found[0] if len(found) == 1 else None


def _attention_rules(block: nn.Module, prefix: str, hidden: int) -> dict[str, str] | str:
    """``{name: role}`` of the block's one attention module and its projections, or why not."""
    found: list[dict[str, str]] = []
    for name, module in _children(block, prefix):
        if isinstance(module, nn.MultiheadAttention):  # q, k, v fused, split by heads
            if module.embed_dim != hidden or not module._qkv_same_embed_dim:
                return f"{name} (nn.MultiheadAttention) does not attend over the hidden size"
            found.append({name: "attention"})
            continue
        children = dict(module.named_children())
        for q, k, v in QKV_NAMES:
            if not all(n in children for n in (q, k, v)):
                continue
            outputs = [n for n in OUTPUT_NAMES if n in children]
            if len(outputs) != 1:
                return f"attention {name!r} has q, k, v but no one output projection"
            rules = {name: "attention"}
            widths: set[int] = set()  # what the q, k and v projections make
            for projection in (q, k, v):
                sizes = _linear_or_none(f"{name}.{projection}", children[projection])
                if sizes is None or sizes[0] != hidden:
                    return f"{name}.{projection} is not a linear layer from the hidden size"
                rules[f"{name}.{projection}"] = "col"
                widths.add(sizes[1])
            out = outputs[0]
            sizes = _linear_or_none(f"{name}.{out}", children[out])
            if sizes is None or sizes[1] != hidden:
                return f"{name}.{out} is not a linear layer onto the hidden size"
            rules[f"{name}.{out}"] = "row"
            inside = _inside_attention(module, name, {q, k, v, out}, widths)
            if isinstance(inside, str):
                return inside
            found.append({**rules, **inside})
    if len(found) != 1:
        return (
            f"{prefix} has {len(found)} attention modules with separate q, k and v projections "
            f"(named {' / '.join('/'.join(names) for names in QKV_NAMES)}), expected one"
        )
    return found[0]


def _head_dim(attention: nn.Module) -> int | None:
    """The features of one head, as the attention module or its config says."""
    for value in (
        getattr(attention, "head_dim", None),
        getattr(getattr(attention, "config", None), "head_dim", None),
    ):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _inside_attention(
    attention: nn.Module, name: str, projections: set[str], widths: set[int]
) -> dict[str, str] | str:
    """Roles of what the attention holds besides its four projections, or why there are none.

    Its heads are split, so a parameter of its own or of another submodule would see a share
    of the heads and get a share of its gradient on each rank: the replicas would drift apart.
    Two kinds of module there have a role. A norm of each head's features (one weight for every
    head: Qwen3's ``q_norm``, Phi's ``q_layernorm``; or a weight per head: Cohere's ``q_norm``,
    StableLM's ``q_layernorm``) is a ``head_norm``, whose gradient is summed over the ranks. A
    norm over all the features a q, k or v projection makes (``widths``; OLMo-2's ``q_norm``)
    is a ``norm`` over the split features, its statistics gathered over the ranks.
    """
    if any(True for _ in attention.parameters(recurse=False)):
        return f"attention {name!r} holds parameters of its own"
    head_dim = _head_dim(attention)
    rules: dict[str, str] = {}
    head_norms: list[str] = []  # children taken as a whole: StableLM's list of norms
    for child, module in attention.named_modules():
        if not child or child.split(".")[0] in projections:
            continue
        if any(child.startswith(f"{taken}.") for taken in head_norms):
            continue
        if head_dim is not None and _is_head_norm(child, module, head_dim):
            rules[f"{name}.{child}"] = "head_norm"
            head_norms.append(child)
        elif any(_is_norm(child, module, width) for width in widths - {head_dim}):
            rules[f"{name}.{child}"] = "norm"
        elif _owns_parameters(module) or _looks_like_norm(module):
            return f"no role for {name}.{child} ({type(module).__name__}) inside the attention"
    return rules


def _mlp_rules(block: nn.Module, prefix: str, hidden: int, taken: set[str]) -> dict[str, str] | str:
    """``{name: role}`` of the block's linear layers outside attention: the MLP, or why not."""
    rules: dict[str, str] = {}
    widths: dict[str, int] = {}  # the MLP width each layer makes or takes
    for name, module in _children(block, prefix):
        if name in taken or any(name.startswith(t + ".") for t in taken):
            continue
        sizes = _linear_or_none(name, module)
        if sizes is None:
            continue
        fan_in, fan_out = sizes
        if fan_in == hidden and fan_out != hidden:
            rules[name], widths[name] = "col", fan_out
        elif fan_out == hidden and fan_in != hidden:
            rules[name], widths[name] = "row", fan_in
        else:
            return f"{name} ({fan_in} -> {fan_out}) is neither into nor out of the MLP width"
    roles = list(rules.values())
    if roles.count("row") != 1 or "col" not in roles:
        return f"{prefix}'s MLP is not one or more layers out of the hidden size and one back"
    (row,) = [name for name, role in rules.items() if role == "row"]
    for name, role in rules.items():
        # Another width than what the row layer takes: the MLP does more than an elementwise
        # step between them (a gate and an up projection in one layer, chunked in two), and a
        # plain column split would hand each rank the wrong features. A guess is refused.
        if role == "col" and widths[name] != widths[row]:
            return (
                f"{name} makes {widths[name]} features where {row} takes {widths[row]}: the MLP "
                f"splits {name}'s output (a gate and an up projection in one layer?), which a "
                f"plain column split would mix up; name its role ('gate_up' for [gate; up] "
                "halves)"
            )
    return rules


def _block_rules(block: nn.Module, prefix: str, hidden: int) -> dict[str, str] | str:
    attention = _attention_rules(block, prefix, hidden)
    if isinstance(attention, str):
        return attention
    mlp = _mlp_rules(block, prefix, hidden, set(attention))
    if isinstance(mlp, str):
        return mlp
    (inside,) = [name for name, role in attention.items() if role == "attention"]
    norms = {
        name: "norm"
        for name, module in _children(block, prefix)
        if _is_norm(name, module, hidden) and not name.startswith(inside + ".")
    }
    return {**attention, **mlp, **norms}


def _outer_rules(
    model: nn.Module, blocks: str, token: str, hidden: int, vocab: int
) -> dict[str, str]:
    """Roles of the modules outside the blocks: embeddings, norms, the head."""
    rules = {token: "embedding"}
    for name, module in model.named_modules():
        if not name or name in (blocks, token) or name.startswith(blocks + "."):
            continue
        if is_position_table(module, hidden):  # first: OPT's is an nn.Embedding subclass
            rules[name] = "position_table"
        elif type(module) is nn.Embedding and module.embedding_dim == hidden:
            rules[name] = "position_embedding"
        elif _is_norm(name, module, hidden):
            rules[name] = "norm"
        elif _linear_or_none(name, module) == (hidden, vocab):
            rules[name] = "head"
    return rules


def _unnamed(model: nn.Module, rules: dict[str, str], blocks: str, first: str = "0") -> list[str]:
    """Modules with parameters, or norms, that no rule names or holds (:func:`_needs_role`).

    ``blocks``: the list of blocks (``""``: the model itself), whose first block is ``first``.
    """
    depth = len(blocks.split(".")) if blocks else 0

    def named(name: str) -> bool:
        parts = name.split(".")
        inside = not blocks or name.startswith(blocks + ".")
        if inside and len(parts) > depth + 1:
            parts[depth] = first  # every block is laid out as the first
            name = ".".join(parts)
        return any(name == r or name.startswith(r + ".") for r in rules)

    return [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if name and _needs_role(name, module, rules) and not named(name)
    ]


def _needs_role(name: str, module: nn.Module, rules: dict[str, str]) -> bool:
    """Whether ``module`` must be named by a rule: it holds parameters or is a norm.

    Not one holding only scales and offsets (a layer scale ``[h]``) with nothing converted
    inside it: left out, it runs under DTensor, its parameters replicated (:mod:`.left_out`).
    """
    if _looks_like_norm(module):
        return True
    if not _owns_parameters(module):
        return False
    return not scales_alone(module) or any(r.startswith(name + ".") for r in rules)


def scales_alone(module: nn.Module) -> bool:
    """Whether ``module`` holds only scales and offsets and is no norm (a layer scale ``[h]``).

    A plan may leave such a module out: it runs under DTensor, its parameters replicated
    (:mod:`.left_out`). A norm is named all the same: the mode's own computes it without
    DTensor's gathers, and a family whose plan lacks a norm (GLM's, under GLM-4's) is not
    the model's.
    """
    return not _looks_like_norm(module) and not holds_matrices(module)


def _widths(block: nn.Module) -> list[int]:
    """Widths a block's attention may attend over (``nn.MultiheadAttention``'s, linear inputs)."""
    found = {m.embed_dim for m in block.modules() if isinstance(m, nn.MultiheadAttention)}
    found |= {
        sizes[0] for n, m in block.named_modules() if (sizes := _linear_or_none(n, m)) is not None
    }
    return sorted(found)


def _takes_one_input(module: nn.Module) -> bool:
    """Whether ``module``'s forward has one parameter (the activation) and nothing else."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # a forward without a signature to read
        return False
    return len(parameters) == 1 and all(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters
    )


def _mixes_samples(model: nn.Module, hidden: int) -> bool:
    """Whether ``model``'s output for one sample of dim 0 depends on another sample's input.

    A probe in eval mode (no dropout) on ``[2, 3, hidden]``: the second row's output must not
    move when the first row's input does. A block written for ``[s, b, h]`` (attention over
    dim 0) fails it; a features plan would cut its tokens as if they were the batch.
    """
    params = list(model.parameters())
    if not params or any(p.is_meta for p in params):
        return False  # built on the meta device: nothing to run
    probe = torch.randn(2, 3, hidden, generator=torch.Generator().manual_seed(0))
    probe = probe.to(params[0].dtype).to(params[0].device)
    moved = probe.clone()
    moved[0] += 1.0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            first, second = model(probe), model(moved)
    except Exception:
        return True  # not a block taking [b, s, h]
    finally:
        model.train(was_training)
    if not isinstance(first, torch.Tensor) or not isinstance(second, torch.Tensor):
        return True
    return bool(first.shape != probe.shape or not torch.equal(first[1], second[1]))


def _features_structure(model: nn.Module) -> StructureReport:
    """An ``nn.Sequential`` of the usual blocks (ending with norms or not), or one block alone.

    What a vision model or a researcher's encoder keeps between its own embedding code and
    its own head: torchvision's ``VisionTransformer`` holds its blocks in an ``nn.Sequential``
    (``encoder.layers``) beside a patch convolution, a class token and positions of its own.
    Such a stack takes and returns activations ``[b, s, h]``, so its plan is a features plan,
    and a model around it is converted part by part (:mod:`.parts`). A module with a forward
    of its own around its blocks gets no plan (that code would see split activations:
    positions counted from a chunk, a tuple returned), nor does an ``nn.ModuleList`` (no
    forward): the blocks its loop calls may each get one.

    The forward must take the activation alone (a features plan's boundary splits its first
    argument only: a transformers decoder layer, also given a mask and rotary tables, would
    get them whole), return it, and keep the samples of dim 0 apart (a block written for
    ``[s, b, h]`` would have its tokens cut as the batch). Where an attention is code of its
    own (not ``nn.MultiheadAttention``) the plan refuses tensor mode ``'sequence'``: a
    position it counts (a rotary table from ``x.shape[1]``) would be the chunk's.
    """
    if _owns_parameters(model):  # used in its own forward, which would see split activations
        own = ", ".join(name for name, _ in model.named_parameters(recurse=False))
        return StructureReport(None, f"{type(model).__name__} holds parameters itself ({own})")
    if isinstance(model, nn.ModuleList):
        return StructureReport(None, "a list of blocks without a forward of its own")
    if not _takes_one_input(model):
        return StructureReport(
            None, f"{type(model).__name__}.forward takes more than the activation alone"
        )
    stack = isinstance(model, nn.Sequential) and _is_block_list(model, (nn.Sequential,))
    first, block = next(iter(model.named_children())) if stack else ("", model)
    if not stack and (_linear_or_none("", model) is not None or not _widths(model)):
        return StructureReport(None, "not an nn.Sequential of blocks, nor one block")
    found: dict[str, str] | str = f"no width {type(block).__name__}'s attention attends over"
    hidden = 0
    for hidden in _widths(block):
        found = _block_rules(block, first, hidden)
        if not isinstance(found, str):
            break
    if isinstance(found, str):
        return StructureReport(None, found)
    rules = {("*" + name[len(first) :] if stack else name): r for name, r in found.items()}
    if stack:
        blocks = {n for n, m in model.named_children() if type(m) is type(block)}
        for name, module in model.named_children():  # the norms ending the stack
            if name not in blocks and _is_norm(name, module, hidden):
                rules[name] = "norm"
        outside = {n: r for n, r in rules.items() if not n.startswith("*")}
        unnamed = _unnamed(model, {**outside, **found}, "", first)
    else:
        unnamed = [
            f"{name} ({type(module).__name__})"
            for name, module in model.named_modules()
            if name
            and _needs_role(name, module, found)
            and not any(name == r or name.startswith(r + ".") for r in found)
        ]
    if unnamed:
        return StructureReport(None, f"no role for {', '.join(unnamed[:4])}")
    if _mixes_samples(model, hidden):
        return StructureReport(
            None,
            f"{type(model).__name__} does not keep the samples of dim 0 apart, or does not "
            "return the activation (a features plan takes and returns [b, s, h])",
        )
    modules = dict(model.named_modules())
    own_attention = sorted(
        name
        for name, role in found.items()
        if role == "attention" and not isinstance(modules[name], nn.MultiheadAttention)
    )
    whole = (
        f"its attention {own_attention[0]!r} is code of its own and may count its positions "
        "(a rotary table from x.shape[1]) over the whole sequence"
        if own_attention
        else ""
    )
    return StructureReport(rules, features=True, whole_sequence=whole)


def infer_structure(model: nn.Module) -> StructureReport:
    """The roles of ``model``'s transformer blocks, read from its modules (see the module doc).

    A model without a token embedding may be blocks alone (:func:`_features_structure`).

    Returns:
        A report with the rules, or with ``rules=None`` and the first reason found why the
        model is not the usual block stack.
    """
    embedding = _token_embedding(model)
    if embedding is None:
        alone = _features_structure(model)
        if alone.rules is not None:
            return alone
        return StructureReport(
            None,
            "no single nn.Embedding of the vocabulary size (plain, or scaling its rows), "
            f"and not blocks alone: {alone.reason}",
        )
    token, table = embedding
    hidden, vocab = table.embedding_dim, table.num_embeddings
    blocks = _block_list(model)
    if blocks is None:
        return StructureReport(None, "no nn.ModuleList of identical blocks")
    block0 = f"{blocks}.0"
    found = _block_rules(model.get_submodule(block0), block0, hidden)
    if isinstance(found, str):
        return StructureReport(None, found)
    rules = _outer_rules(model, blocks, token, hidden, vocab)
    rules |= {f"{blocks}.*{name[len(block0) :]}": role for name, role in found.items()}
    unnamed = _unnamed(model, {**rules, **found}, blocks)
    if unnamed:
        return StructureReport(None, f"no role for {', '.join(unnamed[:4])}")
    names = [name for name, _ in model.named_modules()]
    start = names.index(block0)
    final = next(
        (
            n
            for n, role in rules.items()
            if role == "norm"
            and n in names
            and names.index(n) > start
            and not n.startswith(blocks + ".")
        ),
        None,
    )
    span = (block0, final) if final is not None else None
    return StructureReport(rules, sequence_span=span, head="head" in rules.values())
