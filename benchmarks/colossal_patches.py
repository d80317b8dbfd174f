"""Colossal-AI's legacy tensor-parallel layers on CPU + gloo (a helper of bench_colossal.py).

``colossalai`` (0.5.0, from the package index; installed by ``nox -s bench`` into the bench
environment only, never a dependency of a tessera package) keeps the 2D / 2.5D / 3D layers of
Xu et al., Wang et al. and Bian et al. under ``colossalai.legacy.nn``. They are written for
CUDA. Everything below patches the *running process* only, touching no installed file:

1. Import stubs. ``colossalai.nn`` imports every optimizer at import time, among them the GaLore
   optimizers, which import ``galore_torch`` and ``bitsandbytes`` (a 125 MB CUDA library). The
   legacy layers only need ``colossalai.nn.init``: stub modules stand in for ``galore_torch``
   and the two GaLore modules of colossalai, so neither library is installed. (Stubbing
   ``bitsandbytes`` itself would not do: peft and transformers probe for it with
   ``importlib.util.find_spec`` and would then try to use it.)
2. Accelerator: ``set_accelerator("cpu")``, so ``get_accelerator().get_current_device()`` (where
   the layers and SUMMA allocate their buffers) is the CPU even on a machine with a GPU.
3. Seed manager: ``SeedManager.add_seed`` / ``set_mode`` save and restore
   ``torch.cuda``'s RNG state (the layers initialise their weights inside
   ``with seed(ParallelMode.TENSOR)``). Patched to do the same with the CPU generator.
   (``ParallelContext.set_seed`` adds the seeds only ``if torch.cuda.is_available()``; here they
   are added directly.)
4. Global context: ``colossalai.legacy.launch`` would call ``init_process_group`` itself and
   ``torch.cuda.set_device``. Instead the default (gloo) group that the worker already holds is
   registered as ``ParallelMode.GLOBAL`` and ``init_parallel_groups()`` builds the mode's groups
   (data, model, tensor, and 2D / 2.5D / 3D) with gloo, as ``launch`` does.

The 3D layers' ``synchronize()`` (``torch.cuda.default_stream().synchronize()``) is never called:
their gradient hooks wait for their asynchronous reductions themselves.
"""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["available", "init_legacy_context", "legacy_nn"]

#: Modules replaced by stubs, with the names their importers take from them.
_STUBS: dict[str, tuple[str, ...]] = {
    "galore_torch": ("GaLoreAdafactor", "GaLoreAdamW"),
    "colossalai.nn.optimizer.galore": (
        "GaLoreAdamW8bit",
        "GaLoreProjector",
        "make_low_rank_buffer",
        "get_galore_param_groups",
    ),
    "colossalai.nn.optimizer.distributed_galore": ("DistGaloreAwamW",),
}


def available() -> str | None:
    """``None`` if colossalai is installed, else why not (without importing it)."""
    if importlib.util.find_spec("colossalai") is None:
        return "colossalai is missing (not installed in this environment)"
    return None


def _unavailable(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{name} is stubbed out by benchmarks/colossal_patches.py")

    return type(name, (), {"__init__": refuse}) if name[0].isupper() else refuse


def _install_stubs() -> None:
    for module_name, names in _STUBS.items():
        if module_name in sys.modules:
            continue
        stub = types.ModuleType(module_name)
        stub.__doc__ = "stub installed by benchmarks/colossal_patches.py"
        for name in names:
            setattr(stub, name, _unavailable(name))
        sys.modules[module_name] = stub


def _patch_seed_manager() -> None:
    from colossalai.legacy.context.random.seed_manager import SeedManager

    def set_mode(self: Any, parallel_mode: Any) -> None:
        if self._current_mode is not None:
            self._seed_states[self._current_mode] = torch.get_rng_state()
        self._current_mode = parallel_mode
        if parallel_mode is not None:
            torch.set_rng_state(self._seed_states[parallel_mode])

    def add_seed(self: Any, parallel_mode: Any, seed: int, overwrite: bool = False) -> None:
        if not overwrite and parallel_mode in self._seed_states:
            raise AssertionError(f"The seed for {parallel_mode} has been added")
        current = torch.get_rng_state()
        torch.manual_seed(seed)
        self._seed_states[parallel_mode] = torch.get_rng_state()
        self._seeds[parallel_mode] = seed
        torch.set_rng_state(current)

    SeedManager.set_mode = set_mode
    SeedManager.add_seed = add_seed


def legacy_nn() -> types.ModuleType:
    """``colossalai.legacy.nn``, imported with the stubs and patches above in place."""
    _install_stubs()
    with warnings.catch_warnings():
        # torch.cuda.amp.custom_fwd / custom_bwd are deprecated (a warning per decorated op);
        # apex and tensornvme (CUDA kernels, async checkpoints) are not installed.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", "Please install", UserWarning)
        import colossalai.legacy.nn as legacy
    # Its collectives call torch.distributed's old names, deprecated in favour of *_single.
    warnings.filterwarnings(
        "ignore",
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        FutureWarning,
    )
    from colossalai.accelerator import set_accelerator

    set_accelerator("cpu")
    _patch_seed_manager()
    return legacy


def init_legacy_context(mode: str, size: int, depth: int | None = None, seed: int = 1024) -> Any:
    """Colossal-AI's global context for tensor ``mode`` over the whole (gloo) default group.

    Call after ``dist.init_process_group("gloo", ...)`` on every rank, in the same order as the
    other group-creating calls. Returns the global context (``gpc``).
    """
    legacy_nn()
    from colossalai.legacy.context import ParallelMode
    from colossalai.legacy.context.random import add_seed, set_mode
    from colossalai.legacy.core import global_context as gpc

    rank, world = dist.get_rank(), dist.get_world_size()
    tensor: dict[str, Any] = dict(size=size, mode=mode)
    if depth is not None:
        tensor["depth"] = depth
    gpc._register_dist(
        rank, world, dist.GroupMember.WORLD, None, list(range(world)), ParallelMode.GLOBAL
    )
    gpc.add_global_rank(ParallelMode.GLOBAL, rank)
    gpc.load_config(dict(parallel=dict(tensor=tensor)))
    gpc.init_parallel_groups()
    add_seed(ParallelMode.DATA, seed)
    add_seed(ParallelMode.TENSOR, seed + gpc.get_local_rank(ParallelMode.TENSOR))
    set_mode(ParallelMode.DATA)
    return gpc
