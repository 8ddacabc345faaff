"""Parallelism applied from outside the model: process groups (state), autograd mappings,
tensor-parallel layers, and `parallelize` with its checkpoint split/merge rules."""
from .layers import (ColumnParallelLinear, PartialGradRMSNorm, RowParallelLinear,
                     VocabParallelEmbedding, gather_logits, vocab_parallel_cross_entropy)
from .state import ParallelConfigError, check_parallel_sizes, initialize_model_parallel
from .tensor_parallel import (check_divisibility, merge_state_dicts, padded_vocab_size,
                              parallelize, partition_dim, split_state_dict)

__all__ = ["ColumnParallelLinear", "PartialGradRMSNorm", "ParallelConfigError", "RowParallelLinear",
           "VocabParallelEmbedding", "check_divisibility", "check_parallel_sizes", "gather_logits",
           "initialize_model_parallel", "merge_state_dicts", "padded_vocab_size", "parallelize",
           "partition_dim", "split_state_dict", "vocab_parallel_cross_entropy"]
