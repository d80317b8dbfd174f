"""Sequence parallelism (Li et al. 2021): every rank holds all weights and a chunk of tokens.

``replicated`` (parameters whose gradients are partial), ``attention`` (ring or all-to-all
self-attention), ``ring_ops`` (the ring's two products) and the patch embedding of a chunk.
"""
