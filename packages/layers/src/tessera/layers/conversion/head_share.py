"""``HeadShareConfig``: a transformers config as one attention module of a rank sees it.

An attention module converted by ``parallelize`` runs this rank's share of the heads, and some
read their head counts from the config at run time (Phi-3 finds where k starts in its fused
projection from ``config.num_attention_heads``). The config is shared by every layer and the
model, so it cannot be changed; and a copy would stop following it: a later
``model.set_attn_implementation("sdpa")`` would reach the model's mask builders but not the
attention, which would keep running eager on a mask built for sdpa (not causal), silently. So
the module gets a view: the head counts are this rank's, every other read and every write goes
to the shared config. Key/value heads fewer than the ranks are repeated, one on each rank.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["HEAD_COUNTS", "HeadShareConfig"]

#: The head counts of a transformers config that the view divides.
HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


class HeadShareConfig:
    """``shared`` with its head counts divided by ``share`` (see the module docstring).

    Args:
        shared: The model's config.
        share: How many ranks split the heads.
    """

    def __init__(self, shared: object, share: int) -> None:
        aliases: Mapping[str, str] = getattr(shared, "attribute_map", None) or {}
        counts: dict[str, int] = {}
        for name in HEAD_COUNTS:
            value = getattr(shared, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                counts[name] = max(value // share, 1)  # fewer key/value heads: one, repeated
                if name in aliases:  # GPT-2 stores num_attention_heads as n_head
                    counts[aliases[name]] = counts[name]
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_counts", counts)

    _shared: object
    _counts: dict[str, int]

    def __getattr__(self, name: str) -> object:
        """This rank's head count, or the shared config's attribute."""
        if name.startswith("__") and name.endswith("__"):  # copy and pickle: this object's own
            raise AttributeError(name)
        if name in ("_counts", "_shared"):  # not set yet (a copy being restored)
            raise AttributeError(name)
        # ``_counts`` and ``_shared`` are found by the ordinary lookup (the instance's
        # ``__dict__``), which ``torch.compile`` traces; ``object.__getattribute__`` it cannot
        counts: dict[str, int] = self._counts
        if name in counts:
            return counts[name]
        return getattr(self._shared, name)

    def __setattr__(self, name: str, value: object) -> None:
        """Writes reach the shared config (the model's, which every layer reads)."""
        setattr(self._shared, name, value)

    def __repr__(self) -> str:
        counts = object.__getattribute__(self, "_counts")
        shared = object.__getattribute__(self, "_shared")
        return f"HeadShareConfig({type(shared).__name__}, {counts})"
