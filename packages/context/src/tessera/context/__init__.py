"""tessera-context: the shared vocabulary of tessera's parallelism.

The ``parallel`` configuration (``ParallelConfig``), the process-group layouts of every mode
(``rank_groups``, pure arithmetic), the ``ParallelContext`` that holds the groups, the launchers
that create it, per-mode RNG streams, and ``ShardInfo``, the description of a sharded parameter
that layers write and the engine reads.
"""

from tessera.context.command_line import get_default_parser
from tessera.context.config import TENSOR_MODES, ExtraInitializer, ParallelConfig
from tessera.context.context import (
    DEFAULT_TIMEOUT,
    ConfigLike,
    ParallelContext,
    create_context,
    load_config,
)
from tessera.context.current import get_context, has_context, no_context, set_context
from tessera.context.failures import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_PROGRESS_TIMEOUT,
    FailureBoard,
    FailureMonitor,
    FailureReport,
    RankFailedError,
    is_communication_error,
    is_control_flow,
)
from tessera.context.full_form import (
    FullForm,
    get_full_form,
    grouped,
    parts_in_turn,
    set_full_form,
)
from tessera.context.grad_norm import (
    SplitKey,
    clip_grad_norm,
    combine_norms,
    global_grad_norm,
    group_if_parallel,
    norm_contributions,
    reduce_contributions,
    resolve_context,
)
from tessera.context.gradient_sums import (
    DEFERRED_SUM_ATTR,
    DefersGradientSum,
    defer_gradient_sums,
    deferred_sum_mode,
)
from tessera.context.groups import Membership, ProcessGroups
from tessera.context.initializers import (
    PROCESS_GROUP_INITIALIZERS,
    GlobalInitializer,
    ProcessGroupInitializer,
    SequenceInitializer,
    Tensor1DInitializer,
    Tensor2DInitializer,
    Tensor2p5DInitializer,
    Tensor3DInitializer,
    rank_groups,
)
from tessera.context.launch import (
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
)
from tessera.context.launch_options import LaunchOptions
from tessera.context.layouts import Group, Groups, coordinates, global_rank
from tessera.context.modes import ModeLike, ParallelMode
from tessera.context.original_names import (
    ORIGINAL_NAMES_ATTR,
    original_names_of,
    set_original_names,
)
from tessera.context.placements import (
    PlacementError,
    as_dtensor,
    cut_placements,
    grad_placements_of,
    mesh_axes_of,
    placements_of,
    shard_info_of_placements,
    tensor_mesh_of,
)
from tessera.context.planner import LayoutEstimate, Machine, ModelShape, plan_layouts
from tessera.context.pretrained_folder import (
    INDEX_FILE,
    SAFETENSORS_DTYPES,
    SINGLE_FILE,
    TOKENIZER_FILES,
    PretrainedSource,
    SafetensorsStream,
    copy_tokenizer_files,
    fresh_folder,
    move_into_place,
    plan_pretrained_files,
    shard_size_in_bytes,
    write_config,
    write_index,
    write_pretrained_folder,
)
from tessera.context.seeds import (
    RngStreams,
    derive_seed,
    get_host_rng_state,
    set_host_rng_state,
    set_seed,
)
from tessera.context.shard import ShardInfo, get_shard_info, set_shard_info
from tessera.context.tensor_modes import (
    TENSOR_MODE_PLUGINS,
    TensorMode,
    find_tensor_mode,
    tensor_mode_names,
)
from tessera.context.tensor_modes.one_d import Mode1D
from tessera.context.tensor_modes.sequence import ModeSequence
from tessera.context.tensor_modes.three_d import Mode3D
from tessera.context.tensor_modes.two_d import Mode2D
from tessera.context.tensor_modes.two_p5_d import Mode2p5D
from tessera.context.tied import PIPELINE_SHARED_ATTR, mark_pipeline_shared, pipeline_shared_key
from tessera.registry import ConfigError

__all__ = [
    # configuration
    "ConfigError",
    "ParallelConfig",
    "ExtraInitializer",
    "TENSOR_MODES",
    "ConfigLike",
    "load_config",
    # modes and layouts
    "ParallelMode",
    "ModeLike",
    "Group",
    "Groups",
    "rank_groups",
    "global_rank",
    "coordinates",
    # initializers (the plug point for custom modes) and their registry
    "PROCESS_GROUP_INITIALIZERS",
    "TENSOR_MODE_PLUGINS",
    "TensorMode",
    "find_tensor_mode",
    "tensor_mode_names",
    # a split tensor's layout as DTensor placements
    "PlacementError",
    "as_dtensor",
    "cut_placements",
    "grad_placements_of",
    "mesh_axes_of",
    "placements_of",
    "shard_info_of_placements",
    "tensor_mesh_of",
    "Mode1D",
    "Mode2D",
    "Mode2p5D",
    "Mode3D",
    "ModeSequence",
    "ProcessGroupInitializer",
    "GlobalInitializer",
    "Tensor1DInitializer",
    "Tensor2DInitializer",
    "Tensor2p5DInitializer",
    "Tensor3DInitializer",
    "SequenceInitializer",
    # contexts and launchers; a context's parts
    "ParallelContext",
    "ProcessGroups",
    "Membership",
    "RngStreams",
    "FailureMonitor",
    "create_context",
    "DEFAULT_TIMEOUT",
    "launch",
    "get_default_parser",
    "launch_from_torch",
    "LaunchOptions",
    "launch_from_slurm",
    "launch_from_openmpi",
    "get_context",
    "set_context",
    "has_context",
    "no_context",
    # failures (ParallelContext.guard)
    "RankFailedError",
    "FailureReport",
    "FailureBoard",
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_PROGRESS_TIMEOUT",
    "is_communication_error",
    "is_control_flow",
    # seeds
    "get_host_rng_state",
    "set_host_rng_state",
    "set_seed",
    "derive_seed",
    # shard descriptions
    "ShardInfo",
    "set_shard_info",
    "get_shard_info",
    # the global gradient norm of split parameters (torch.nn.utils.clip_grad_norm_ uses it)
    "clip_grad_norm",
    "global_grad_norm",
    "SplitKey",
    "norm_contributions",
    "combine_norms",
    "reduce_contributions",
    "group_if_parallel",
    "resolve_context",
    # forms of a full tensor other than its original module's
    "FullForm",
    "set_full_form",
    "get_full_form",
    "grouped",
    "parts_in_turn",
    # names a model someone else wrote gives the tensors a restated model holds
    "ORIGINAL_NAMES_ATTR",
    "set_original_names",
    "original_names_of",
    # gradient sums a layer leaves to the training loop
    "DEFERRED_SUM_ATTR",
    "DefersGradientSum",
    "defer_gradient_sums",
    "deferred_sum_mode",
    # transformers checkpoint folders, written tensor by tensor (layers' save, engine's export)
    "PretrainedSource",
    "SafetensorsStream",
    "SAFETENSORS_DTYPES",
    "SINGLE_FILE",
    "INDEX_FILE",
    "shard_size_in_bytes",
    "plan_pretrained_files",
    "write_index",
    "write_config",
    "fresh_folder",
    "move_into_place",
    "write_pretrained_folder",
    "TOKENIZER_FILES",
    "copy_tokenizer_files",
    # weights tied across pipeline stages
    "PIPELINE_SHARED_ATTR",
    "mark_pipeline_shared",
    "pipeline_shared_key",
    # the layout planner (torch-free arithmetic; python -m tessera.context plan)
    "ModelShape",
    "Machine",
    "LayoutEstimate",
    "plan_layouts",
]
