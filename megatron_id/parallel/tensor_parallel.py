"""Tensor parallelism applied from outside to the single-device model (torchtitan style).

One table says how every parameter is cut (`partition_dim`); `parallelize` uses it to shard a
model in place, and `split_state_dict` / `merge_state_dicts` use it for checkpoints, so the
three can never disagree. Parameter names do not change.

Where heads are sharded, per mixer (H heads, each rank keeps H / TP contiguous heads):
  interdomain / s4d   q, k, v (or a, b) and the gate: column-parallel (outputs are head-major)
                      short convs: their channels (= the heads' channels)
                      k_bias, v_bias, log_dt (Delta), a_log / a_im (A), c_re / c_im (C), c_vec: dim 0
                      k_norm, v_norm: replicated, shared by all heads, grads summed over TP
                      o_proj: row-parallel (its 2d-wide input for the linear contraction
                      readout is [Re c.U, Re c.Gamma] per head, so heads stay contiguous)
  softmax             q, k, v column-parallel; o_proj row-parallel
  SwiGLU              w1, w3 column-parallel; w2 row-parallel
  embed / lm_head     vocabulary rows, padded to a multiple of make_vocab_size_divisible_by x TP
Sequence parallelism (optional): norms and residuals work on sequence shards; the input of
each mixer, SwiGLU and the LM head is all-gathered by a forward pre-hook, and row-parallel
outputs are reduce-scattered.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig, ffn_hidden_size
from ..model.layers import Linear, RMSNorm
from . import mappings
from .layers import (ColumnParallelLinear, PartialGradRMSNorm, RowParallelLinear,
                     VocabParallelEmbedding, group_size, shard_parameter)
from .state import ParallelConfigError

COLUMN_PARALLEL = {"q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "w1", "w3", "lm_head"}
ROW_PARALLEL = {"o_proj", "w2"}
HEAD_PARAMETERS = {"k_bias", "v_bias", "log_dt", "a_log", "a_im", "c_re", "c_im", "c_vec"}
CHANNEL_SHARDED = {"q_conv", "k_conv", "a_conv", "b_conv"}   # short convs: weight and bias dim 0
VOCAB_PARAMETERS = {"embed.weight", "lm_head.weight"}
HEAD_SHARED_NORMS = {"k_norm", "v_norm"}


def partition_dim(name: str) -> int | None:
    """The dim along which parameter `name` (a model state-dict key) is split; None = replicated."""
    parts = name.split(".")
    leaf, owner = parts[-1], (parts[-2] if len(parts) > 1 else "")
    if owner in COLUMN_PARALLEL or owner in CHANNEL_SHARDED or owner == "embed":
        return 0
    if owner in ROW_PARALLEL:
        return 1
    if leaf in HEAD_PARAMETERS:
        return 0
    return None


def padded_vocab_size(cfg: ModelConfig, tp: int) -> int:
    """Megatron's rule: pad to a multiple of make_vocab_size_divisible_by x TP (0: no padding)."""
    if cfg.make_vocab_size_divisible_by == 0:
        return cfg.vocab_size
    multiple = cfg.make_vocab_size_divisible_by * tp
    return math.ceil(cfg.vocab_size / multiple) * multiple


def check_divisibility(cfg: ModelConfig, tp: int) -> None:
    """Everything TP splits must split evenly; raise before any computation otherwise."""
    problems = []
    if cfg.n_heads % tp:
        problems.append(f"model.n_heads={cfg.n_heads} is not divisible by tensor parallel size {tp} "
                        f"(each rank keeps whole heads); use a TP size that divides {cfg.n_heads}")
    if ffn_hidden_size(cfg) % tp:
        problems.append(f"the SwiGLU hidden size {ffn_hidden_size(cfg)} is not divisible by tensor "
                        f"parallel size {tp}; set model.ffn_hidden to a multiple of {tp}")
    if padded_vocab_size(cfg, tp) % tp:
        problems.append(f"model.vocab_size={cfg.vocab_size} is not divisible by tensor parallel size "
                        f"{tp} and vocabulary padding is off (model.make_vocab_size_divisible_by=0); "
                        f"set model.make_vocab_size_divisible_by=128 (Megatron's default) to pad")
    if problems:
        raise ParallelConfigError("; ".join(problems) + ".")


def _gather_sequence_hook(group):
    def hook(module, args, kwargs):
        return (mappings.gather_from_sequence(args[0], group), *args[1:]), kwargs
    return hook


def _check_sequence_length(tp):
    def hook(module, args):
        n = args[0].shape[1]
        if n % tp:
            raise ValueError(f"sequence parallelism splits the sequence over {tp} ranks, but this "
                             f"batch has sequence length {n}; use a length divisible by {tp} "
                             f"(e.g. model.seq_length) or parallel.sequence_parallel=false.")
    return hook


def parallelize(model: nn.Module, group, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard a LanguageModel over `group` in place (its weights, if materialised, are sliced;
    on the meta device only shapes change: call model.initialize afterwards).

    The model's own forward is unchanged: it then returns vocabulary-sharded logits, for
    `vocab_parallel_cross_entropy` or `gather_logits`. With sequence parallelism the input
    sequence length must be divisible by the TP size.
    """
    cfg, tp = model.cfg, group_size(group)
    check_divisibility(cfg, tp)
    vocab = padded_vocab_size(cfg, tp)
    sp = sequence_parallel
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if name == "embed":
                setattr(parent, name, VocabParallelEmbedding(child, group, vocab, sequence_parallel=sp))
            elif isinstance(child, Linear) and name in COLUMN_PARALLEL:
                setattr(parent, name, ColumnParallelLinear(
                    child, group, sequence_parallel=sp, padded_out=vocab if name == "lm_head" else None))
            elif isinstance(child, Linear) and name in ROW_PARALLEL:
                setattr(parent, name, RowParallelLinear(child, group, sequence_parallel=sp))
            elif isinstance(child, RMSNorm) and (name in HEAD_SHARED_NORMS or sp):
                setattr(parent, name, PartialGradRMSNorm(child, group))
            elif name in CHANNEL_SHARDED:
                shard_parameter(child, "weight", 0, group)
                shard_parameter(child, "bias", 0, group)
        for pname, _ in list(parent.named_parameters(recurse=False)):
            if pname in HEAD_PARAMETERS:
                shard_parameter(parent, pname, 0, group)
    if sp:
        model.embed.register_forward_pre_hook(_check_sequence_length(tp))
        for block in model.layers:
            block.mixer.register_forward_pre_hook(_gather_sequence_hook(group), with_kwargs=True)
            block.ffn.register_forward_pre_hook(_gather_sequence_hook(group), with_kwargs=True)
        model.lm_head.register_forward_pre_hook(_gather_sequence_hook(group), with_kwargs=True)
    if cfg.tie_embeddings:   # both were sharded alike (vocabulary rows, same padding): share again
        model.lm_head.weight = model.embed.weight
    model.tp_group, model.sequence_parallel = group, sp
    return model


# ---------------------------------------------------------------- checkpoints

def split_state_dict(full: dict, cfg: ModelConfig, tp: int) -> list[dict]:
    """A TP=1 state dict -> one state dict per TP rank (vocabulary padded for this TP)."""
    check_divisibility(cfg, tp)
    vocab = padded_vocab_size(cfg, tp)
    shards = [{} for _ in range(tp)]
    for name, tensor in full.items():
        dim = partition_dim(name)
        if dim is None:
            for shard in shards:
                shard[name] = tensor.clone()
            continue
        if name in VOCAB_PARAMETERS:
            if tensor.shape[0] != cfg.vocab_size:
                raise ValueError(f"{name} has {tensor.shape[0]} rows but model.vocab_size is "
                                 f"{cfg.vocab_size}: pass an unpadded TP=1 state dict.")
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, vocab - tensor.shape[0]))
        for shard, piece in zip(shards, tensor.chunk(tp, dim=dim)):
            shard[name] = piece.clone()
    return shards


def merge_state_dicts(shards: list[dict], cfg: ModelConfig) -> dict:
    """One state dict per TP rank -> the TP=1 state dict (vocabulary padding stripped).
    Replicated tensors must agree across ranks; a mismatch is an error, not a silent pick."""
    names = list(shards[0])
    for i, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(names):
            raise ValueError(f"TP rank {i} has different keys from rank 0: "
                             f"{sorted(set(shard) ^ set(names))[:5]}")
    full = {}
    for name in names:
        dim = partition_dim(name)
        if dim is None:
            for i, shard in enumerate(shards[1:], start=1):
                if not torch.equal(shard[name], shards[0][name]):
                    raise ValueError(f"replicated tensor '{name}' differs between TP rank 0 and "
                                     f"rank {i}; the shards do not come from one consistent model.")
            full[name] = shards[0][name].clone()
        else:
            full[name] = torch.cat([shard[name] for shard in shards], dim=dim)
            if name in VOCAB_PARAMETERS:
                full[name] = full[name][:cfg.vocab_size].clone()
    return full
