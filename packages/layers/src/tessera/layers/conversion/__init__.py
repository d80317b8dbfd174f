"""Parallelizing models someone else wrote: plans, converters, the model's boundary."""

from .api import SUPPORTED_MODES, parallelize
from .boundary import causal_lm_loss, token_loss
from .meta import meta_parameters
from .plan import BUILTIN_PLANS, ROLES, Plan

__all__ = [
    "BUILTIN_PLANS",
    "ROLES",
    "SUPPORTED_MODES",
    "Plan",
    "causal_lm_loss",
    "meta_parameters",
    "parallelize",
    "token_loss",
]
