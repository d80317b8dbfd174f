"""Parallelizing models someone else wrote: plans, converters, the model's boundary."""

from .api import SUPPORTED_MODES, parallelize
from .boundary import causal_lm_loss, gather_logits, token_loss
from .families import BUILTIN_PLANS
from .meta import meta_parameters
from .plan import ROLES, Plan
from .split_logits import SplitLogits, local_logits
from .stages import original_names, pipeline_layers

__all__ = [
    "BUILTIN_PLANS",
    "ROLES",
    "SUPPORTED_MODES",
    "SplitLogits",
    "Plan",
    "causal_lm_loss",
    "gather_logits",
    "local_logits",
    "meta_parameters",
    "original_names",
    "parallelize",
    "pipeline_layers",
    "token_loss",
]
