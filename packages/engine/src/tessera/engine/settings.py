"""The engine's keys of a configuration, read once into a typed, validated ``EngineSettings``.

A configuration is a plain mapping that also carries the ``parallel`` block, the pipeline's
``model`` and whatever keys the user's own script reads (``BATCH_SIZE``, ``lr``...). Those
user keys must stay allowed, so an unknown key is not an error by itself; but a key that is
*almost* one the engine reads (``gradient_acumulation``, ``clip_grad_nrom``, a lower-case
``num_micro_batches``) or that belongs inside a block (``sequence_parallel`` at the top level)
would be silently ignored, and the job would train as configured by nobody. Those are
``ConfigError``s that name the key and the one it resembles.

Every value is checked here, before any process group is touched: numbers must be finite and
in range, and each block accepts only its own keys.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.context import ConfigError

from .loss_scaler import DynamicLossScaler

__all__ = [
    "ALIASES",
    "ENGINE_CONFIG_KEYS",
    "NONFINITE_POLICIES",
    "PRECISION_MODES",
    "EngineSettings",
    "read_engine_settings",
]

#: The top-level configuration keys the engine reads (compared across ranks by ``initialize``).
ENGINE_CONFIG_KEYS = (
    "fp16",
    "bf16",
    "zero",
    "gradient_accumulation",
    "clip_grad_norm",
    "gradient_handlers",
    "ddp",
    "schedule",
    "num_microbatches",
    "num_chunks",
    "tensor_shape",
    "NUM_MICRO_BATCHES",
    "NUM_CHUNKS",
    "TENSOR_SHAPE",
    "debug",
    "nonfinite",
    "check_agreement",
    "per_token_loss",
)

#: The pipeline keys, snake_case as the schedules' own arguments, and the upper-case
#: spelling of Colossal-AI's configurations, accepted as an alias so those configs still run.
ALIASES = {
    "num_microbatches": "NUM_MICRO_BATCHES",
    "num_chunks": "NUM_CHUNKS",
    "tensor_shape": "TENSOR_SHAPE",
}

#: Top-level keys other tessera packages read (the context, the pipeline builder).
_OTHER_PACKAGES_KEYS = ("parallel", "model")

#: Keys that belong inside a block: written at the top level they would be ignored.
_NESTED_KEYS = {
    "pipeline": "parallel.pipeline",
    "tensor": "parallel.tensor",
    "sequence_parallel": "parallel.tensor (parallel=dict(tensor=dict(size=N, mode='1d', "
    "sequence_parallel=True)))",
    "init_scale": "fp16",
    "growth_factor": "fp16",
    "backoff_factor": "fp16",
    "growth_interval": "fp16",
    "min_scale": "fp16",
    "max_scale": "fp16",
    "offload": "zero",
}

_FP16_KEYS = (
    "mode",
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
)

#: The modes of ``fp16=dict(mode=...)`` and ``bf16=dict(mode=...)``: ``"torch"`` runs an fp32
#: model under autocast; ``"naive"`` holds the model in the low-precision format with fp32
#: master weights in the optimizer (``master_weights.py``).
PRECISION_MODES = ("torch", "naive")

#: What happens at an optimizer step whose loss or gradients hold inf or NaN.
NONFINITE_POLICIES = ("raise", "skip", "warn")

#: How alike an unknown key must be to a known one to count as its misspelling.
_TYPO_CUTOFF = 0.8


@dataclass(frozen=True)
class EngineSettings:
    """What ``initialize`` builds the Engine from; see its module docstring for each key.

    Attributes:
        autocast_dtype: ``torch.float16``, ``torch.bfloat16`` or ``None``.
        master_dtype: The format the model is held in under master weights (``"naive"``
            mode: ``torch.float16`` or ``torch.bfloat16``), else ``None``.
        loss_scaler: ``DynamicLossScaler`` keywords under fp16, else ``None``.
        zero_stage: 0 (off), 1, 2 or 3.
        zero_offload: CPU offload of the FSDP2 stages.
        gradient_accumulation: Micro-steps per optimizer step.
        clip_grad_norm: Global-norm clipping threshold (0: off).
        gradient_handlers: The ``gradient_handlers`` entries, each a dict with a ``type``.
        ddp: Extra keywords of DistributedDataParallel.
        schedule: The ``schedule`` entry (built from the SCHEDULES registry), or ``None``.
        micro_batches: ``NUM_MICRO_BATCHES`` (``None`` when absent).
        chunks: ``NUM_CHUNKS``.
        tensor_shape: ``TENSOR_SHAPE`` (``None`` when absent).
        debug: The per-step cross-rank checks.
        nonfinite: One of ``NONFINITE_POLICIES``.
        agreement_every: Batch agreement checked on the first step and then every this many
            optimizer steps (0: the first step only; ``None``: never).
        per_token_loss: The criterion returns ``(loss_sum, num_tokens)`` and every token of
            the global step weighs alike.
    """

    autocast_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    loss_scaler: Mapping[str, Any] | None = None
    zero_stage: int = 0
    zero_offload: bool = False
    gradient_accumulation: int = 1
    clip_grad_norm: float = 0.0
    gradient_handlers: tuple[Mapping[str, Any], ...] = ()
    ddp: Mapping[str, Any] = field(default_factory=dict)
    schedule: Mapping[str, Any] | None = None
    micro_batches: int | None = None
    chunks: int = 1
    tensor_shape: Any = None
    debug: bool = False
    nonfinite: str = "raise"
    agreement_every: int | None = 0
    per_token_loss: bool = False


def read_engine_settings(cfg: Mapping[str, Any], *, debug: bool = False) -> EngineSettings:
    """Validate the engine's keys of ``cfg`` and return them typed.

    Args:
        cfg: The whole configuration (user keys of their own are left alone).
        debug: The debug switch as resolved from ``cfg`` and ``$TESSERA_DEBUG``.

    Raises:
        ConfigError: a misspelt or misplaced key, a bad value, or an unsupported combination;
            the message names the key.
    """
    check_misspelt_keys(cfg)
    dtype, master, scaler = _read_precision(cfg)
    stage, offload = _read_zero(cfg)
    if master is not None and stage >= 2:
        key = "fp16" if master == torch.float16 else "bf16"
        raise ConfigError(
            f"{key}.mode 'naive' (fp32 master weights) is not supported with zero.stage {stage} "
            "(FSDP2 shards the model's own parameters); use zero.stage 1, which shards the "
            f"masters and their optimizer state, or {key}=dict(mode='torch') with stage {stage}"
        )
    micro_key = _spelled(cfg, "num_microbatches")
    micro = _read_int(cfg, micro_key, 1) if micro_key in cfg else None
    tensor_shape_key = _spelled(cfg, "tensor_shape")
    return EngineSettings(
        autocast_dtype=dtype,
        master_dtype=master,
        loss_scaler=scaler,
        zero_stage=stage,
        zero_offload=offload,
        gradient_accumulation=_read_int(cfg, "gradient_accumulation", 1),
        clip_grad_norm=_read_clip(cfg),
        gradient_handlers=_read_handlers(cfg),
        ddp=_read_mapping(cfg, "ddp"),
        schedule=_read_schedule(cfg),
        micro_batches=micro,
        chunks=_read_int(cfg, _spelled(cfg, "num_chunks"), 1),
        tensor_shape=cfg.get(tensor_shape_key),
        debug=debug,
        nonfinite=_read_nonfinite(cfg, fp16=scaler is not None),
        agreement_every=_read_agreement(cfg),
        per_token_loss=_read_bool(cfg, "per_token_loss"),
    )


# -- keys ----------------------------------------------------------------------------------------


def check_misspelt_keys(cfg: Mapping[str, Any]) -> None:
    """Refuse a top-level key that is a near miss of a known one, or belongs in a block."""
    known = (*ENGINE_CONFIG_KEYS, *_OTHER_PACKAGES_KEYS)
    canonical = {alias: key for key, alias in ALIASES.items()}
    lowered = {k.lower(): canonical.get(k, k) for k in known}  # suggest the snake_case name
    for key in cfg:
        if not isinstance(key, str) or key in known:
            continue
        if key in _NESTED_KEYS:
            raise ConfigError(
                f"configuration key '{key}' is read only inside {_NESTED_KEYS[key]}; at the top "
                "level it would be ignored: move it into that block"
            )
        close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=_TYPO_CUTOFF)
        if close:
            raise ConfigError(
                f"unknown configuration key '{key}': did you mean '{lowered[close[0]]}'? "
                f"(the engine reads {', '.join(ENGINE_CONFIG_KEYS)}; keys of your own are "
                "allowed when they are not this close to one of these)"
            )


def _spelled(cfg: Mapping[str, Any], key: str) -> str:
    """How ``cfg`` spells ``key``: itself, or its upper-case alias when only that is given.

    Raises:
        ConfigError: both spellings are given, with different values.
    """
    alias = ALIASES[key]
    if key in cfg and alias in cfg and cfg[key] != cfg[alias]:
        raise ConfigError(
            f"{key}={cfg[key]!r} and its alias {alias}={cfg[alias]!r} disagree; give one of them"
        )
    return alias if alias in cfg and key not in cfg else key


def _check_block_keys(block: str, value: Mapping[str, Any], known: Sequence[str]) -> None:
    unknown = [k for k in value if k not in known]
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f"; did you mean '{block}.{close[0]}'?" if close else ""
    raise ConfigError(f"unknown key '{block}.{key}' (known keys: {', '.join(known)}){hint}")


# -- values --------------------------------------------------------------------------------------


def _finite_number(key: str, value: object, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value!r}")
    return float(value)


def _read_int(cfg: Mapping[str, Any], key: str, default: int, minimum: int = 1) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an int >= {minimum}, got {value!r}")
    return value


def _read_mapping(cfg: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a dict, got {value!r}")
    return dict(value)


def _read_clip(cfg: Mapping[str, Any]) -> float:
    return _finite_number("clip_grad_norm", cfg.get("clip_grad_norm", 0.0), minimum=0.0)


def _enabled(key: str, value: object) -> bool:
    """Absent, ``None``, ``False`` or ``dict(mode=None)`` means off; any dict, on."""
    if value is None or value is False:
        return False
    if value is True and key == "bf16":
        return True
    if isinstance(value, Mapping):
        return value.get("mode", "torch") is not None
    if key == "bf16":
        raise ConfigError(
            f"bf16 must be True, False, absent or a dict like dict(mode='naive'), got {value!r}"
        )
    raise ConfigError(f"fp16 must be a dict like dict(mode='torch'), got {value!r}")


def _read_mode(key: str, block: object) -> str:
    """The ``mode`` of an enabled ``fp16`` / ``bf16`` block (``bf16=True`` is ``"torch"``)."""
    mode = block.get("mode", "torch") if isinstance(block, Mapping) else "torch"
    if key == "fp16" and mode == "apex":
        raise ConfigError(
            "fp16.mode 'apex' is not supported: NVIDIA apex is unmaintained; its torch-native "
            "replacement is fp16=dict(mode='torch') (torch.autocast with dynamic loss scaling)"
        )
    if mode not in PRECISION_MODES:
        raise ConfigError(
            f"{key}.mode {mode!r} is not supported; use {key}=dict(mode='torch') (autocast), "
            f"{key}=dict(mode='naive') (the model in {key} with fp32 master weights), or "
            f"{key}=dict(mode=None) for full precision"
        )
    return str(mode)


def _read_precision(
    cfg: Mapping[str, Any],
) -> tuple[torch.dtype | None, torch.dtype | None, Mapping[str, Any] | None]:
    """``(autocast dtype, master-weight dtype, loss-scaler keywords)`` of fp16 / bf16."""
    fp16, bf16 = cfg.get("fp16"), cfg.get("bf16")
    if isinstance(fp16, Mapping):
        _check_block_keys("fp16", fp16, _FP16_KEYS)
    if isinstance(bf16, Mapping):
        if any(k in _FP16_KEYS and k != "mode" for k in bf16):
            scaling = next(k for k in bf16 if k in _FP16_KEYS and k != "mode")
            raise ConfigError(
                f"bf16.{scaling} is a loss-scaling key: bfloat16 has float32's exponent range "
                "and needs no loss scaling (known keys: mode)"
            )
        _check_block_keys("bf16", bf16, ("mode",))
    fp16_on, bf16_on = _enabled("fp16", fp16), _enabled("bf16", bf16)
    if fp16_on and bf16_on:
        raise ConfigError(
            "fp16 and bf16 are both set; choose one mixed-precision mode "
            f"(fp16={fp16!r}, bf16={bf16!r})"
        )
    if bf16_on:
        if _read_mode("bf16", bf16) == "naive":
            return None, torch.bfloat16, None
        return torch.bfloat16, None, None
    if not fp16_on:
        return None, None, None
    assert isinstance(fp16, Mapping)
    naive = _read_mode("fp16", fp16) == "naive"
    kwargs: dict[str, Any] = {}
    for key in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
        if key in fp16:
            kwargs[key] = _finite_number(f"fp16.{key}", fp16[key])
    if "growth_interval" in fp16:
        value = fp16["growth_interval"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"fp16.growth_interval must be an int >= 1, got {value!r}")
        kwargs["growth_interval"] = value
    try:  # its own range checks (init_scale > 0, growth_factor > 1, ...), as ConfigErrors
        DynamicLossScaler(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"fp16: {exc}") from None
    if naive:
        return None, torch.float16, kwargs
    return torch.float16, None, kwargs


def _read_zero(cfg: Mapping[str, Any]) -> tuple[int, bool]:
    zero = cfg.get("zero")
    if zero is None:
        return 0, False
    if not isinstance(zero, Mapping):
        raise ConfigError(f"zero must be a dict like dict(stage=1), got {zero!r}")
    _check_block_keys("zero", zero, ("stage", "offload"))
    stage = zero.get("stage")
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ConfigError(f"zero.stage must be 1, 2 or 3, got {stage!r}")
    offload = zero.get("offload", False)
    if not isinstance(offload, bool):
        raise ConfigError(f"zero.offload must be True or False, got {offload!r}")
    if offload and stage == 1:
        raise ConfigError("zero.offload needs stage 2 or 3 (FSDP2's CPUOffloadPolicy)")
    return int(stage), offload


def _read_handlers(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    entries = cfg.get("gradient_handlers") or ()
    if isinstance(entries, (Mapping, str)) or not isinstance(entries, Sequence):
        raise ConfigError(
            f"gradient_handlers must be a list of dicts like [dict(type='...')], got {entries!r}"
        )
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "type" not in entry:
            raise ConfigError(f"gradient_handlers[{i}] must be a dict with a 'type', got {entry!r}")
    return tuple(entries)


def _read_schedule(cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    schedule = cfg.get("schedule")
    if schedule is None:
        return None
    if not isinstance(schedule, Mapping) or "type" not in schedule:
        raise ConfigError(
            f"schedule must be a dict with a 'type', like dict(type='ZeroBubbleSchedule', "
            f"num_microbatches=4), got {schedule!r}"
        )
    return schedule


def _read_nonfinite(cfg: Mapping[str, Any], *, fp16: bool) -> str:
    # Under fp16 an overflow is expected now and then: the loss scaler skips that step and
    # backs off, which is the "skip" policy.
    policy = cfg.get("nonfinite", "skip" if fp16 else "raise")
    if policy not in NONFINITE_POLICIES:
        raise ConfigError(
            f"nonfinite must be one of {', '.join(repr(p) for p in NONFINITE_POLICIES)}, "
            f"got {policy!r}"
        )
    return str(policy)


def _read_bool(cfg: Mapping[str, Any], key: str) -> bool:
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be True or False, got {value!r}")
    return value


def _read_agreement(cfg: Mapping[str, Any]) -> int | None:
    value = cfg.get("check_agreement", True)
    if value is True:
        return 0
    if value is False or value is None:
        return None
    if isinstance(value, int) and value >= 1:
        return value
    raise ConfigError(
        "check_agreement must be True (check that every rank reads alike on the first step), "
        f"an int N >= 1 (the first step and every N optimizer steps) or False, got {value!r}"
    )
