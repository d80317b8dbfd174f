"""Position modules that compute their rows in a forward of their own: kept whole, under 1D.

Two kinds of position module outside the blocks compute their rows themselves, which a
tessera embedding would not:

* XGLM adds sinusoidal positions (Vaswani et al. 2017, section 3.5): a module holding a
  ``[positions, h]`` table as a buffer and no parameters;
* OPT learns a table whose rows are read two places past each position (``nn.Embedding``
  subclass ``OPTLearnedPositionalEmbedding``, Zhang et al. 2022), from the position ids or
  from the attention mask's running count.

Under 1D such a module runs as it is: the activations its positions are added to are whole
(or split along the sequence only after the embeddings), and so are the ids and the mask it
reads, so a learned table's gradient is whole and the same on every rank. Under 2D, 2.5D and 3D
the ids, the mask and the position ids reach it as this rank's rows (under 3D as layout "z"'s,
not the tokens' "y"), and from its output alone positions shared by the batch cannot be told
from one sample's: a split there could add another sample's positions, and a learned table's
gradient would be this rank's part, without an error. Under ``sequence`` each rank gets global
position ids, which a module counting positions from the mask does not read. So every mode
but 1D refuses the role when the model is parallelized.

A module is taken for one (:func:`is_position_table`) when it is an ``nn.Embedding`` of the
hidden size with a forward of its own, or when it holds no parameters and a floating-point
buffer of its own of two or more dims whose rows have the hidden size: integer position ids
(BERT's ``position_ids``) and rotary tables (rows of a head's size) are not.
"""

from __future__ import annotations

from torch import nn

__all__ = ["is_position_table", "table_width"]


def is_position_table(module: nn.Module, hidden: int) -> bool:
    """Whether ``module`` computes positions of ``hidden`` features in a forward of its own.

    Read from the module alone (see the module docstring), so a plan inferred from a model's
    structure can give it the role.

    Args:
        module: A module outside the model's blocks.
        hidden: The model's hidden size.
    """
    if isinstance(module, nn.Embedding):
        return module.embedding_dim == hidden and type(module).forward is not nn.Embedding.forward
    if any(True for _ in module.parameters()):
        return False
    return table_width(module) == hidden


def table_width(module: nn.Module) -> int | None:
    """The features of each row of ``module``'s table (``None``: it holds no table).

    An ``nn.Embedding``'s, or its own first floating-point buffer of two or more dims.
    """
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    tables = [b for b in module.buffers(recurse=False) if b.is_floating_point() and b.dim() >= 2]
    return tables[0].shape[-1] if tables else None
