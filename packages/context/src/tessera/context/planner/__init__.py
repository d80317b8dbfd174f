"""The layout planner: which data x pipeline x tensor layout fits a model, and which is fastest.

Torch-free arithmetic from the papers behind each mode (Megatron-LM 1d, SUMMA 2d, Tesseract
2.5d, 3d, ZeRO, activation memory after Korthikanti et al. 2022), one module per job:

==============  ==============================================================
module          job
==============  ==============================================================
``shapes``      ``ModelShape``: the transformer's numbers and its flops
``layouts``     ``Layout``; which layouts exist and why one cannot run
``precision``   bytes per parameter, gradient, optimizer state, activation
``memory``      per-rank bytes of parameters, gradients, optimizer, activations
``comm``        the collectives of a step; bytes contributed and on the wire
``machine``     ``Machine`` (flop/s, bandwidth, latency) and ``calibrate()``
``rank``        ``plan_layouts``: estimate every layout, fitting ones fastest first
``table``       the printed table
``cli``         ``python -m tessera.context plan``
==============  ==============================================================

Example::

    from tessera.context import ModelShape, plan_layouts

    shape = ModelShape(layers=24, hidden=2048, heads=16, seq=1024, vocab=50304, batch=16)
    best = plan_layouts(shape, world=16, memory_budget=16 * 2**30, dtype="fp16")[0]
    best.layout.parallel()  # the parallel = dict(...) block for tessera
"""

from .comm import Collective
from .layouts import MODES, Layout, enumerate_layouts, layout_problems
from .machine import DEFAULT_MACHINE, Machine, calibrate
from .memory import MemoryBreakdown
from .precision import DTYPES, Precision, precision_for
from .rank import LayoutEstimate, estimate_layout, plan_layouts
from .shapes import ModelShape
from .units import parse_bytes

__all__ = [
    "ModelShape",
    "Layout",
    "MODES",
    "DTYPES",
    "enumerate_layouts",
    "layout_problems",
    "Machine",
    "DEFAULT_MACHINE",
    "calibrate",
    "Precision",
    "precision_for",
    "MemoryBreakdown",
    "Collective",
    "LayoutEstimate",
    "estimate_layout",
    "plan_layouts",
    "parse_bytes",
]
