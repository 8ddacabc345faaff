"""Tensor-parallel layers (Megatron's, with the process group passed in).

Each holds only its shard of the full parameter and records how that shard was cut (in its
owner's `tp_partitions`, which survives moving the module between devices, and in Megatron's
`tensor_model_parallel` / `partition_dim` parameter attributes that DeepSpeed reads), so
initialisation can draw the full tensor and keep its slice.

    ColumnParallelLinear   weight rows (output features) split, and the bias if any; input copied in
    RowParallelLinear      weight columns (input features) split; output all-reduced
    VocabParallelEmbedding vocabulary rows split; out-of-range ids masked; output all-reduced
    vocab_parallel_cross_entropy  the loss over vocabulary-sharded logits
    vocab_parallel_kl      KL(teacher || student) over vocabulary-sharded logits (distillation)
    PartialGradRMSNorm     a replicated norm whose inputs differ per rank: grads all-reduced

With sequence parallelism, activations outside the TP regions are split along the sequence:
column-parallel inputs arrive already gathered (by a hook on the owning block, see
tensor_parallel.py) and row-parallel outputs are reduce-scattered instead of all-reduced.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model.layers import Embedding, Linear, NormalInit, RMSNorm, rms_norm
from . import mappings


def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


@dataclass(frozen=True)
class TPPartition:
    """How a parameter's local shard was cut from the full tensor."""
    dim: int
    rank: int
    world: int
    full_shape: tuple        # the unpadded full shape (what a TP=1 model holds)
    padded_size: int         # size of `dim` after padding (vocabulary rows), else full size

    def local(self, full: torch.Tensor) -> torch.Tensor:
        pad = self.padded_size - full.shape[self.dim]
        if pad:
            widths = [0, 0] * (full.dim() - 1 - self.dim) + [0, pad]
            full = F.pad(full, widths)
        return full.chunk(self.world, dim=self.dim)[self.rank]


def shard_parameter(module: nn.Module, name: str, dim: int, group, padded_size: int | None = None):
    """Replace module.<name> by this rank's shard (values sliced from the full parameter, or
    an empty meta tensor when the full one lives on the meta device)."""
    full = getattr(module, name)
    part = TPPartition(dim, group_rank(group), group_size(group), tuple(full.shape),
                       padded_size or full.shape[dim])
    if full.is_meta:
        shape = list(full.shape)
        shape[dim] = part.padded_size // part.world
        local = torch.empty(shape, device="meta", dtype=full.dtype)
    else:
        local = part.local(full.detach()).clone()
    param = nn.Parameter(local, requires_grad=full.requires_grad)
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
    setattr(module, name, param)
    if "tp_partitions" not in module.__dict__:
        module.tp_partitions = {}
    module.tp_partitions[name] = part
    return param


class ColumnParallelLinear(NormalInit, nn.Module):
    PARAMETER_ROLES = Linear.PARAMETER_ROLES   # it stands in for a Linear: the same declaration

    def __init__(self, full: nn.Linear, group, *, sequence_parallel=False, padded_out=None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.init_std = full.init_std
        self.weight = full.weight
        shard_parameter(self, "weight", 0, group, padded_out)
        self.bias = full.bias   # None, or cut with the output features (its rows of the weight)
        if self.bias is not None:
            shard_parameter(self, "bias", 0, group, padded_out)

    def forward(self, x):
        if not self.sequence_parallel:   # SP: the input was all-gathered, whose backward reduces
            x = mappings.copy_to_region(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(NormalInit, nn.Module):
    PARAMETER_ROLES = Linear.PARAMETER_ROLES   # it stands in for a Linear: the same declaration

    def __init__(self, full: nn.Linear, group, *, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.init_std = full.init_std
        if full.bias is not None:   # it would be added once after the sum, replicated: not declared so
            raise ValueError("a row-parallel Linear with a bias is not supported (its bias would be replicated "
                             "and added after the sum over ranks); declare the bias-free output projection "
                             "row-parallel, or the layer column-parallel.")
        self.weight = full.weight
        shard_parameter(self, "weight", 1, group)

    def forward(self, x):   # x: this rank's slice of the input features (its heads)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence(y, self.group)
        return mappings.reduce_from_region(y, self.group)


class VocabParallelEmbedding(NormalInit, nn.Module):
    PARAMETER_ROLES = Embedding.PARAMETER_ROLES   # it stands in for a Embedding: the same declaration

    def __init__(self, full: nn.Embedding, group, padded_vocab: int, *, sequence_parallel=False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.init_std = full.init_std
        self.weight = full.weight
        shard_parameter(self, "weight", 0, group, padded_vocab)
        self.vocab_start = group_rank(group) * self.weight.shape[0]

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence(out, self.group)
        return mappings.reduce_from_region(out, self.group)


class PartialGradRMSNorm(RMSNorm):
    """Replicated weight, but each rank sees different inputs (its heads, or its sequence
    shard): the weight passes through copy_to_region, whose backward sums the partial grads."""

    def __init__(self, full: RMSNorm, group):
        super().__init__(full.weight.shape[0], full.eps)
        self.group = group
        self.weight = full.weight

    def forward(self, x):
        return rms_norm(x, mappings.copy_to_region(self.weight, self.group), self.eps)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size):
        logits = logits.float()
        n_local = logits.shape[-1]
        cols = torch.arange(vocab_start, vocab_start + n_local, device=logits.device)
        logits = logits.masked_fill(cols >= vocab_size, float("-inf"))   # vocabulary padding
        peak = logits.max(dim=-1).values
        if group_size(group) > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        logits = logits - peak[..., None]
        local_target = target - vocab_start
        mine = (local_target >= 0) & (local_target < n_local)
        local_target = local_target.masked_fill(~mine, 0)
        picked = logits.gather(-1, local_target[..., None]).squeeze(-1).masked_fill(~mine, 0.0)
        exp = logits.exp()
        total = exp.sum(dim=-1)
        if group_size(group) > 1:
            dist.all_reduce(picked, group=group)
            dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp / total[..., None], local_target, mine)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_target[..., None], -mine[..., None].to(g.dtype))
        return g * grad[..., None], None, None, None, None


def vocab_parallel_cross_entropy(logits_local, target, group, vocab_size: int):
    """Per-token loss from vocabulary-sharded logits [..., V_local]; columns at or beyond
    `vocab_size` (padding) are excluded, so padding never changes the loss."""
    start = group_rank(group) * logits_local.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits_local, target, group, start, vocab_size)


# [our choice] rows of the KL's float32 work at a time: at most this many elements per
# [rows, V_local] temporary (64 MiB), as the fused LM-head loss's chunks
KL_CHUNK_ELEMENTS = 16 * 2**20


class _VocabParallelKL(torch.autograd.Function):
    """KL(teacher || student) per token over vocabulary-sharded logits, both divided by the
    temperature first; the gradient reaches the student's logits only.

    In chunks of tokens, with the gradient made in forward (as the fused LM-head loss does): the
    per-token gradient of KL is (q - p) / T, q and p the two softmaxes, so forward keeps that one
    [tokens, V_local] tensor for backward to scale by the incoming per-token gradient. The whole-
    batch form kept q and p and made both softmaxes' log, exp and product temporaries of the whole
    batch (~10 float32 [tokens, V_local] tensors at its peak: 14x a 125M teacher's bytes at stage
    logits, issue 57); this one holds one, plus a chunk's temporaries."""

    @staticmethod
    def forward(ctx, student, teacher, group, vocab_start, vocab_size, temperature):
        n_local = student.shape[-1]
        shape = student.shape[:-1]
        s2, t2 = student.reshape(-1, n_local), teacher.reshape(-1, n_local)
        rows = max(1, KL_CHUNK_ELEMENTS // n_local)
        padding = torch.arange(vocab_start, vocab_start + n_local, device=student.device) >= vocab_size
        tp = group_size(group) > 1

        def log_softmax(logits):   # (log-probabilities, probabilities) across the group's shards
            logits = (logits.float() / temperature).masked_fill_(padding, float("-inf"))
            peak = logits.max(dim=-1).values
            if tp:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            logits -= peak[:, None]
            exp = logits.exp()
            total = exp.sum(dim=-1)
            if tp:
                dist.all_reduce(total, group=group)
            return logits.sub_(total.log()[:, None]), exp.div_(total[:, None])
        kl = torch.empty(s2.shape[0], dtype=torch.float32, device=student.device)
        grad = torch.empty(s2.shape, dtype=student.dtype, device=student.device) if ctx.needs_input_grad[0] else None
        for a in range(0, s2.shape[0], rows):
            b = min(a + rows, s2.shape[0])
            log_q, q = log_softmax(s2[a:b])
            log_p, p = log_softmax(t2[a:b])
            # p log(p / q); the padding's 0 x (-inf - -inf) and a teacher probability of exactly 0 count 0
            kl[a:b] = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(dim=-1)
            if grad is not None:
                grad[a:b] = (q - p).div_(temperature)
        if tp:
            dist.all_reduce(kl, group=group)
        ctx.grad = grad
        return kl.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad is None:
            raise RuntimeError("the vocab-parallel KL was differentiated twice; its gradient is made in forward "
                               "and used once (retain_graph is not supported).")
        out, ctx.grad = ctx.grad, None
        out.mul_(grad.reshape(-1, 1).to(out.dtype))
        return out.reshape(*grad.shape, out.shape[-1]), None, None, None, None, None


def vocab_parallel_kl(student_local, teacher_local, group, vocab_size: int, temperature: float = 1.0):
    """Per-token KL(softmax(teacher / T) || softmax(student / T)) from vocabulary-sharded logits
    [..., V_local] (distillation: training/distill.py); padding columns excluded, as in the loss."""
    start = group_rank(group) * student_local.shape[-1]
    return _VocabParallelKL.apply(student_local, teacher_local.detach(), group, start, vocab_size, temperature)


def gather_logits(logits_local, group, vocab_size: int):
    """Full-vocabulary logits on every rank, padding stripped (for evaluation and tests)."""
    return mappings.gather_from_region(logits_local, group, dim=-1)[..., :vocab_size]
