"""tessera-pipeline: partitioning, schedules as action tables, p2p, one runner, a simulator."""

from tessera.pipeline.actions import (
    Action,
    ActionKind,
    format_actions,
    parse_actions,
    peer_rank,
    split_steps,
    stage_of,
    virtual_stage,
)
from tessera.pipeline.backward_split import (
    WeightGradWork,
    backward_input,
    backward_weight,
    full_backward,
)
from tessera.pipeline.chunks import PipelineChunks
from tessera.pipeline.dataflow import make_deadlock_free
from tessera.pipeline.errors import DeadlockError, ScheduleError
from tessera.pipeline.executor import LossFn, PipelineExecutor, StepLinks, StepOptions
from tessera.pipeline.gpipe import GPipeSchedule
from tessera.pipeline.interleaved import InterleavedPipelineSchedule
from tessera.pipeline.one_f_one_b import PipelineSchedule
from tessera.pipeline.p2p import (
    CommContext,
    PayloadMeta,
    PipelineComm,
    TensorMeta,
    Transfer,
    check_message_order,
    link_of,
    message_tag,
)
from tessera.pipeline.partition import (
    check_boundaries,
    partition_balanced,
    partition_uniform,
    stage_ranges,
)
from tessera.pipeline.payload import (
    Spec,
    batch_size_of,
    concat_microbatches,
    flatten_payload,
    payload_signature,
    split_microbatches,
    unflatten_payload,
)
from tessera.pipeline.plot import plot_timeline
from tessera.pipeline.recording import RunRecord, gather_timeline
from tessera.pipeline.runner import PipelineRunner, StepOutput
from tessera.pipeline.schedule import Schedule
from tessera.pipeline.simulator import (
    DEFAULT_COSTS,
    SimulationResult,
    simulate,
    simulate_table,
)
from tessera.pipeline.stage import (
    PartitionMethod,
    PipelineRankSource,
    PipelineStage,
    build_pipeline_model,
    build_pipeline_model_from_cfg,
    describe_partition,
    partition_layers,
    select_stage_layers,
)
from tessera.pipeline.table import ActionTable, add_communication, check_actions
from tessera.pipeline.timeline import TimelineEvent, events_of_rank, timeline_span
from tessera.pipeline.zero_bubble import ZeroBubbleSchedule

__all__ = [
    # partitioning and this rank's part of the model
    "partition_uniform",
    "partition_balanced",
    "check_boundaries",
    "stage_ranges",
    "PartitionMethod",
    "PipelineRankSource",
    "PipelineStage",
    "partition_layers",
    "select_stage_layers",
    "build_pipeline_model",
    "build_pipeline_model_from_cfg",
    "describe_partition",
    "PipelineChunks",
    # action model
    "Action",
    "ActionKind",
    "virtual_stage",
    "stage_of",
    "peer_rank",
    "split_steps",
    "format_actions",
    "parse_actions",
    # schedules: plans, as immutable action tables
    "Schedule",
    "ActionTable",
    "ScheduleError",
    "add_communication",
    "check_actions",
    "make_deadlock_free",
    "GPipeSchedule",
    "PipelineSchedule",
    "InterleavedPipelineSchedule",
    "ZeroBubbleSchedule",
    # payloads and microbatches
    "Spec",
    "flatten_payload",
    "unflatten_payload",
    "batch_size_of",
    "split_microbatches",
    "concat_microbatches",
    "payload_signature",
    # point-to-point communication
    "CommContext",
    "TensorMeta",
    "PayloadMeta",
    "Transfer",
    "PipelineComm",
    "link_of",
    "message_tag",
    "check_message_order",
    # the runner, one step's executor and the split backward
    "PipelineRunner",
    "StepOutput",
    "LossFn",
    "PipelineExecutor",
    "StepLinks",
    "StepOptions",
    "WeightGradWork",
    "backward_input",
    "backward_weight",
    "full_backward",
    "RunRecord",
    "gather_timeline",
    # simulator and timeline
    "DEFAULT_COSTS",
    "DeadlockError",
    "SimulationResult",
    "simulate",
    "simulate_table",
    "TimelineEvent",
    "events_of_rank",
    "timeline_span",
    "plot_timeline",
]
