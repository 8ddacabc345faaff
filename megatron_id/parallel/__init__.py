"""Parallelism applied from outside the model: the layout validator (layout), process groups
(state), autograd mappings, tensor-parallel layers, and `parallelize` with its checkpoint
split/merge rules."""
from .layers import (
    ColumnParallelLinear,
    PartialGradRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
    vocab_parallel_cross_entropy,
)
from .layout import LayoutError, check_layout, check_model_split, check_sizes, padded_vocab_size
from .state import initialize_model_parallel
from .tensor_parallel import merge_state_dicts, parallelize, partition_dim, split_state_dict

__all__ = ["ColumnParallelLinear", "LayoutError", "PartialGradRMSNorm", "RowParallelLinear",
           "VocabParallelEmbedding", "check_layout", "check_model_split", "check_sizes", "gather_logits",
           "initialize_model_parallel", "merge_state_dicts", "padded_vocab_size", "parallelize",
           "partition_dim", "split_state_dict", "vocab_parallel_cross_entropy"]
