"""Bytes per parameter and per activation element under each training precision.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 3.1) count mixed-precision Adam as ``2 + 2 + K`` bytes per parameter: fp16
parameters and gradients, and ``K = 12`` bytes of optimizer state (fp32 master copy, momentum,
variance). In fp32 the parameters are their own masters: ``4 + 4 + 8``.

tessera's engine keeps fp32 masters beside half-precision parameters only with ZeRO stage 0
or 1 (``fp16=dict(mode="naive")``); under stages 2 and 3 FSDP2 shards the model's own
parameters, so mixed precision there is autocast over fp32 parameters (``4 + 4 + 8``) with
half-precision activations. The planner follows what the engine accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.registry import ConfigError

__all__ = ["DTYPES", "Precision", "precision_for"]

#: The ``dtype`` values the planner knows.
DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16")

#: LayerNorm statistics and the cross-entropy's logits stay fp32 under every precision.
FP32 = 4


@dataclass(frozen=True)
class Precision:
    """Bytes of each kind of training state.

    Attributes:
        dtype: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        parameter: Bytes per parameter as the model holds it.
        gradient: Bytes per gradient element.
        optimizer: Bytes of Adam state per parameter (two moments, plus fp32 masters).
        activation: Bytes per saved activation element (the compute dtype).
    """

    dtype: str
    parameter: int
    gradient: int
    optimizer: int
    activation: int


def precision_for(dtype: str, zero: int) -> Precision:
    """The bytes of ``dtype`` training with Adam under ZeRO stage ``zero``.

    Raises:
        ConfigError: ``dtype`` is not one of ``DTYPES``.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype == "fp32":
        return Precision(dtype, FP32, FP32, 2 * FP32, FP32)
    if zero >= 2:  # autocast over fp32 parameters (FSDP2 takes no master copies)
        return Precision(dtype, FP32, FP32, 2 * FP32, 2)
    return Precision(dtype, 2, 2, 3 * FP32, 2)
