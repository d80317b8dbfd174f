"""tessera-layers: tensor-parallel layers, communication ops, parallel loss and metric.

Every layer keeps the parameter names and (in full form) the shapes of the plain torch model it
mirrors; ``load_full_state_dict`` / ``gather_full_state_dict`` convert between the two.
The mode-dispatching layers (``Linear``, ``LayerNorm``, ...) build the implementation of the
context's tensor mode (1D, 2D, 2.5D, 3D, sequence), or plain torch without tensor
parallelism. See the package README for the contract every layer keeps.
"""

from tessera.context import FullForm, get_full_form, set_full_form
from tessera.layers.comm.ops import (
    all_to_all,
    broadcast,
    copy_to_group,
    gather_along_dim,
    reduce_from_group,
    reduce_scatter_along_dim,
    split_along_dim,
)
from tessera.layers.conversion import (
    BUILTIN_PLANS,
    ROLES,
    Plan,
    SplitLogits,
    causal_lm_loss,
    gather_logits,
    local_logits,
    meta_parameters,
    original_names,
    parallelize,
    pipeline_layers,
    token_loss,
)
from tessera.layers.conversion.pretrained import parallelize_pretrained
from tessera.layers.cube.classifier import Classifier3D, VocabParallelClassifier3D
from tessera.layers.cube.dropout import Dropout3D, SequenceDropout, ShardedDropout
from tessera.layers.cube.embedding import Embedding3D, VocabParallelEmbedding3D
from tessera.layers.cube.layout import LAYOUTS_3D, Cube, CubeModule, Layout3D, cube_of
from tessera.layers.cube.linear import Linear3D, keep_gathered_operands
from tessera.layers.cube.loss import (
    Accuracy3D,
    CrossEntropyLoss3D,
    VocabParallelAccuracy3D,
    VocabParallelCrossEntropyLoss3D,
)
from tessera.layers.cube.matmul import choose_cube_algorithm, cube_linear
from tessera.layers.cube.norm import LayerNorm3D, RMSNorm3D
from tessera.layers.cube.patch_embedding import PatchEmbedding3D
from tessera.layers.dispatch.activations import (
    activation_as_dtensor,
    activation_placements,
    gather_activation,
    split_activation,
    split_batch,
)
from tessera.layers.dispatch.layers import (
    IMPLEMENTATIONS,
    Accuracy,
    Classifier,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    PatchEmbedding,
    register_implementation,
    unregister_implementation,
)
from tessera.layers.mesh.classifier import (
    Classifier2D,
    Classifier2p5D,
    VocabParallelClassifier2D,
    VocabParallelClassifier2p5D,
)
from tessera.layers.mesh.dropout import Dropout2D, Dropout2p5D
from tessera.layers.mesh.embedding import (
    Embedding2D,
    Embedding2p5D,
    VocabParallelEmbedding2D,
    VocabParallelEmbedding2p5D,
)
from tessera.layers.mesh.layout import Mesh, MeshModule, mesh_of
from tessera.layers.mesh.linear import Linear2D, Linear2p5D
from tessera.layers.mesh.loss import (
    Accuracy2D,
    Accuracy2p5D,
    CrossEntropyLoss2D,
    CrossEntropyLoss2p5D,
    VocabParallelAccuracy2D,
    VocabParallelAccuracy2p5D,
    VocabParallelCrossEntropyLoss2D,
    VocabParallelCrossEntropyLoss2p5D,
)
from tessera.layers.mesh.matmul import choose_algorithm, mesh_linear
from tessera.layers.mesh.norm import LayerNorm2D, LayerNorm2p5D, RMSNorm2D, RMSNorm2p5D
from tessera.layers.mesh.patch_embedding import PatchEmbedding2D, PatchEmbedding2p5D
from tessera.layers.mesh.summa import summa_ab, summa_abt, summa_atb
from tessera.layers.parallel_1d.classifier import Classifier1D, VocabParallelClassifier1D
from tessera.layers.parallel_1d.dropout import Dropout1D
from tessera.layers.parallel_1d.embedding import Embedding1D, VocabParallelEmbedding1D
from tessera.layers.parallel_1d.linear import Linear1DCol, Linear1DRow
from tessera.layers.parallel_1d.norm import LayerNorm1D, RMSNorm1D
from tessera.layers.parallel_1d.patch_embedding import PatchEmbedding1D
from tessera.layers.sequence.attention import AttentionImpl, RingSelfAttention
from tessera.layers.sequence.patch_embedding import SequencePatchEmbedding
from tessera.layers.sequence.replicated import (
    SequenceAccuracy,
    gather_sequence_activation,
    mark_sequence_replicated,
    split_sequence_activation,
)
from tessera.layers.sequence.ring_ops import Ring, ring_av, ring_of, ring_qk
from tessera.layers.shared.accuracy import VocabParallelAccuracy1D, vocab_parallel_argmax
from tessera.layers.shared.base import Module1D, ParallelModule
from tessera.layers.shared.checkpointing import checkpoint
from tessera.layers.shared.context_access import GroupInfo, group_info
from tessera.layers.shared.cross_entropy import (
    VocabParallelCrossEntropyLoss1D,
    vocab_parallel_cross_entropy,
)
from tessera.layers.shared.dense import LinearOutput
from tessera.layers.shared.errors import ModeNotImplementedError
from tessera.layers.shared.head_norm import HeadLayerNorm, HeadRMSNorm
from tessera.layers.shared.initializers import (
    Initializer,
    fan_in_uniform,
    kaiming_uniform,
    normal,
    ones,
    uniform,
    xavier_uniform,
    zeros,
)
from tessera.layers.shared.mode_layers import (
    MODE_LAYERS,
    ModeLayers,
    find_mode_layers,
    register_mode_layers,
)
from tessera.layers.shared.norm_over_group import layer_norm_over_group
from tessera.layers.shared.serial import (
    SerialAccuracy,
    SerialClassifier,
    SerialLinear,
    SerialPatchEmbedding,
)
from tessera.layers.shared.shards import new_parameter, shard_info
from tessera.layers.state.pretrained import (
    PretrainedKeys,
    PretrainedSource,
    load_pretrained,
    mark_pretrained_source,
    save_pretrained,
)
from tessera.layers.state.state_dict import gather_full_state_dict, load_full_state_dict

__all__ = [
    # models someone else wrote
    "parallelize",
    "Plan",
    "ROLES",
    "BUILTIN_PLANS",
    "causal_lm_loss",
    "token_loss",
    "gather_logits",
    "local_logits",
    "SplitLogits",
    "meta_parameters",
    "pipeline_layers",
    "original_names",
    "FullForm",
    "get_full_form",
    "set_full_form",
    # mode-dispatching layers
    "Linear",
    "LayerNorm",
    "Embedding",
    "PatchEmbedding",
    "Classifier",
    "Dropout",
    "CrossEntropyLoss",
    "Accuracy",
    "IMPLEMENTATIONS",
    "MODE_LAYERS",
    "activation_as_dtensor",
    "activation_placements",
    "ModeLayers",
    "find_mode_layers",
    "register_mode_layers",
    "register_implementation",
    "unregister_implementation",
    "ModeNotImplementedError",
    # 1D (Megatron-LM)
    "Linear1DCol",
    "Linear1DRow",
    "LinearOutput",
    "Embedding1D",
    "VocabParallelEmbedding1D",
    "Classifier1D",
    "VocabParallelClassifier1D",
    "LayerNorm1D",
    "RMSNorm1D",
    "HeadLayerNorm",
    "HeadRMSNorm",
    "Dropout1D",
    "PatchEmbedding1D",
    "VocabParallelCrossEntropyLoss1D",
    "VocabParallelAccuracy1D",
    # 2D (SUMMA, Xu et al. 2021)
    "Linear2D",
    "LayerNorm2D",
    "RMSNorm2D",
    "Embedding2D",
    "VocabParallelEmbedding2D",
    "PatchEmbedding2D",
    "Classifier2D",
    "VocabParallelClassifier2D",
    "Dropout2D",
    "CrossEntropyLoss2D",
    "VocabParallelCrossEntropyLoss2D",
    "Accuracy2D",
    "VocabParallelAccuracy2D",
    # 2.5D (Tesseract, Wang et al. 2021)
    "Linear2p5D",
    "LayerNorm2p5D",
    "RMSNorm2p5D",
    "Embedding2p5D",
    "VocabParallelEmbedding2p5D",
    "PatchEmbedding2p5D",
    "Classifier2p5D",
    "VocabParallelClassifier2p5D",
    "Dropout2p5D",
    "CrossEntropyLoss2p5D",
    "VocabParallelCrossEntropyLoss2p5D",
    "Accuracy2p5D",
    "VocabParallelAccuracy2p5D",
    # 3D (Bian et al. 2021)
    "Linear3D",
    "LayerNorm3D",
    "RMSNorm3D",
    "Embedding3D",
    "VocabParallelEmbedding3D",
    "PatchEmbedding3D",
    "Classifier3D",
    "VocabParallelClassifier3D",
    "Dropout3D",
    "CrossEntropyLoss3D",
    "VocabParallelCrossEntropyLoss3D",
    "Accuracy3D",
    "VocabParallelAccuracy3D",
    "Cube",
    "CubeModule",
    "Layout3D",
    "LAYOUTS_3D",
    "cube_of",
    "cube_linear",
    "choose_cube_algorithm",
    # sequence parallelism (Li et al. 2021; DeepSpeed-Ulysses)
    "RingSelfAttention",
    "AttentionImpl",
    "SequencePatchEmbedding",
    "SequenceDropout",
    "SequenceAccuracy",
    "ShardedDropout",
    "Ring",
    "ring_of",
    "ring_qk",
    "ring_av",
    "mark_sequence_replicated",
    "split_sequence_activation",
    "gather_sequence_activation",
    # plain layers torch lacks
    "SerialClassifier",
    "SerialLinear",
    "SerialPatchEmbedding",
    "SerialAccuracy",
    # functional loss and metric
    "vocab_parallel_cross_entropy",
    "vocab_parallel_argmax",
    # communication ops (autograd)
    "copy_to_group",
    "reduce_from_group",
    "split_along_dim",
    "gather_along_dim",
    "reduce_scatter_along_dim",
    "all_to_all",
    "broadcast",
    # SUMMA products (autograd), the 2D / 2.5D linear product and the distributed LayerNorm
    "choose_algorithm",
    "mesh_linear",
    "summa_ab",
    "summa_abt",
    "summa_atb",
    "layer_norm_over_group",
    # state dicts and activations
    "load_full_state_dict",
    "gather_full_state_dict",
    "load_pretrained",
    "parallelize_pretrained",
    "save_pretrained",
    "PretrainedKeys",
    "PretrainedSource",
    "mark_pretrained_source",
    "split_activation",
    "gather_activation",
    "split_batch",
    # checkpointing
    "checkpoint",
    # building blocks for new modes
    "ParallelModule",
    "Module1D",
    "Mesh",
    "MeshModule",
    "mesh_of",
    "GroupInfo",
    "group_info",
    "shard_info",
    "new_parameter",
    # initializers
    "Initializer",
    "kaiming_uniform",
    "fan_in_uniform",
    "normal",
    "uniform",
    "ones",
    "zeros",
    "xavier_uniform",
    "keep_gathered_operands",
]
