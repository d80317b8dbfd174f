"""The grid: what 2D, 2.5D and 3D layers share, so their common layers are written once.

2D/2.5D (:class:`~tessera.layers.mesh.layout.Mesh`, Xu et al. 2021; Wang et al. 2021) and 3D
(:class:`~tessera.layers.cube.layout.Cube`, Bian et al. 2021) lay an activation ``[b, ..., h]`` out
the same way between blocks: the hidden dim split over one group (ROW / INPUT: the *hidden
axis*), the batch over another (COL or XZ / OUTPUT x WEIGHT: the *batch axis*). A table (an
embedding, a patch embedding's parameters) splits its embedding dim into ``q * q`` blocks over
two groups and is all-gathered over the inner one into the hidden axis's block, with its
gradient summed over the groups that replicate it. :class:`Grid` names those groups;
:class:`GridModule` is the base whose ``grid`` the shared layers (losses, accuracy, patch
embedding, embedding) are written against.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..comm.collectives import all_gather_along
from ..shared.base import ParallelModule
from ..shared.context_access import GroupInfo

__all__ = ["Grid", "GridModule"]


class Grid(Protocol):
    """The groups a layer shared by 2D, 2.5D and 3D needs (provided by ``Mesh`` and ``Cube``)."""

    @property
    def q(self) -> int:
        """The side of the mesh or cube."""
        ...

    @property
    def hidden_axis(self) -> GroupInfo:
        """The group splitting an activation's hidden dim (and vocab-parallel logits' classes)."""
        ...

    @property
    def batch_axis(self) -> GroupInfo:
        """The group an activation's (and the logits', the targets') batch is split over."""
        ...

    @property
    def table_modes(self) -> tuple[str, str]:
        """The two modes splitting a table's embedding dim into ``q * q`` blocks, outer first."""
        ...

    @property
    def table_replicated(self) -> tuple[str, ...]:
        """The modes a table is replicated over (its gradient is summed over them)."""
        ...

    def check_local(
        self, x: torch.Tensor, dim: int, expected: int, what: str, *, name: str = "size"
    ) -> None:
        """``ValueError`` (before any collective) unless ``x.shape[dim] == expected``.

        ``expected = full / q``; ``what`` names the layer, ``name`` what ``full`` is.
        """
        ...

    def gather_table(self, param: torch.Tensor, dim: int) -> torch.Tensor:
        """A table's ``q * q``-split ``dim`` -> the hidden axis's block (``q`` blocks).

        The backward reduce-scatters the gradient and sums it over the replicating groups.
        """
        ...


class GridModule(ParallelModule):
    """Base of the 2D, 2.5D and 3D layers: ``grid`` is their :class:`Grid`."""

    #: Whether :meth:`check_batch_block` still has to look at an input (it looks once).
    check_split_batch: bool = True

    def check_batch_block(self, x: torch.Tensor) -> None:
        """On the first call, refuse the whole batch where the rank's block of it is expected.

        The layers that take the model's input (token ids, images) expect this rank's rows,
        ``[b/B, ...]`` (``split_batch``). Given the whole batch they would compute on all of it
        on every rank of the batch group, silently: the loss and gradients come out ``B``
        times too large. Every rank holding the same input is the sign of it: one small
        all-gather of a fingerprint, at the first call only.

        Raises:
            ValueError: every rank of the batch group got the same input (set
                ``check_split_batch = False`` on the layer if that is intended).
        """
        batch = self.grid.batch_axis
        if not self.check_split_batch or batch.world_size == 1 or x.numel() == 0:
            return
        self.check_split_batch = False
        flat = x.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        shape = torch.tensor([float(n) for n in x.shape], dtype=torch.float64, device=x.device)
        mine = torch.cat([torch.stack([flat.sum(), (flat * weights).sum()]), shape])
        every = all_gather_along(mine, 0, batch.group, batch.world_size).view(batch.world_size, -1)
        if bool((every == every[0]).all()):
            raise ValueError(
                f"{type(self).__name__} got the same input {list(x.shape)} on all "
                f"{batch.world_size} ranks of its batch group: it takes this rank's rows of the "
                "batch, split_batch(x), not the whole batch (which would count every sample "
                f"{batch.world_size} times). If the rows are identical on purpose, set "
                "check_split_batch = False on the layer"
            )

    @property
    def grid(self) -> Grid:
        """This rank's mesh or cube (set by ``MeshModule`` / ``CubeModule``)."""
        raise NotImplementedError(f"{type(self).__name__} has no grid")

    @property
    def owner(self) -> str:
        """The class name, for error messages."""
        return type(self).__name__
