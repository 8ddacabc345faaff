"""The LM head and its vocabulary-parallel cross entropy fused and chunked over tokens
(train.fused_lm_head_loss): the loss of logits = h W^T without ever holding the [T, V_local]
logits of a micro-batch (at 4K tokens and GPT-2's vocabulary those are 823 MB in float32, and
today's path keeps a softmax of that size for backward and makes a gradient of it there).

    loss = fused_lm_head_loss(h, weight, target, group, vocab_size, loss_mask)
    # the same number and gradients (h, weight) as the reference, today's unfused path:
    loss = naive_lm_head_loss(h, weight, target, group, vocab_size, loss_mask)
         = masked_mean(vocab_parallel_cross_entropy(F.linear(h, weight), target, group, vocab_size), loss_mask)

h [..., d] is the head's input as its matmul sees it, i.e. inside the tensor-parallel region
(`lm_head_loss` applies the head's own input mapping: copy_to_region, or with sequence
parallelism the gather along the sequence); weight [V_local, d] this rank's vocabulary rows,
from vocab_start = TP rank x V_local, rows at or beyond `vocab_size` being padding (masked, as
in the unfused loss); target [...] token ids; loss_mask [...] 0/1 or None. The result is the
masked mean over tokens (masked_mean below: the mean without a mask), a scalar.

Per chunk of C tokens (Megatron's vocab-parallel cross entropy, one chunk at a time):
    z = h_c W^T                        float32 (under autocast the matmul in its dtype, as F.linear)
    m = max_v z                        all-reduce MAX over TP
    s = sum_v exp(z - m), z_y - m      one all-reduce SUM of both (z_y from the shard owning y)
    loss_t = log s - (z_y - m)
and in the same pass the gradient of the returned mean:
    dz = w_t (softmax(z) - onehot(y)),  w_t = mask_t / max(sum mask, 1)  (1/T without a mask)
    dh_c = dz W,   dW += dz^T h_c
Gradient in forward, not recomputed in backward [our choice]: the loss is reduced to a scalar
here, so every token's share of the gradient is known up to the one incoming scalar, and the
head costs the plain path's three matmuls instead of four (Liger-Kernel's fused linear cross
entropy does the same; Apple's Cut Cross-Entropy recomputes the logits blockwise in backward
instead, to keep nothing but the log-sum-exp). What is kept until backward, dh [T, d] (the
size of h) and dW [V_local, d] in float32, are the tensors the plain backward makes anyway.
Backward only scales them by the incoming gradient. Without autograd (evaluation, no_grad) the
gradient work is skipped.

Tensor parallelism: dh is this shard's partial sum; the sum over TP ranks is left to the
mapping in front of h (copy_to_region's all-reduce, or with sequence parallelism the sequence
gather's reduce-scatter), exactly as for ColumnParallelLinear, so both stay consistent.

Precision: the softmax is always float32. Under bf16 autocast h and W are cast to bf16 and
each chunk's logits are a bf16 matmul made float32, as F.linear under autocast does; dz is cast
to bf16 for both gradient matmuls as autograd does for the plain path; the bf16 dW of each
chunk is summed in float32 (the plain path rounds its one whole-batch dW to bf16 once). In
float32 the fused loss and gradients equal the reference's to float rounding (tested < 1e-5
relative; the chunks change only the matmuls' blocking); in bf16 to bf16 rounding (~1e-2).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import mappings
from .layers import group_rank, group_size, vocab_parallel_cross_entropy

# [our choice] a chunk's float32 logits take at most this many elements (64 MiB), in whole
# multiples of 64 tokens: 320 tokens of GPT-2's 50,304 padded columns at TP=1, more per rank
# under TP (fewer columns each). Measured (benchmarks/lm_head_memory.py, 4K tokens, 125M width):
# peak 15x below the unfused path's at the plain path's speed; 128-token chunks were slower
# on the CPU, 1024-token ones no faster in float32 at twice the memory.
CHUNK_ELEMENTS = 16 * 2**20


def default_chunk_size(vocab_local: int) -> int:
    return max(64, CHUNK_ELEMENTS // vocab_local // 64 * 64)


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The loss over the tokens that count (Megatron: sum(loss * mask) / sum(mask)); a
    micro-batch with none counts zero rather than dividing by zero. Here, below training/, so
    that the reference below and training/loss.py share it without parallel/ importing training/."""
    if mask is None:
        return per_token.mean()
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


def naive_lm_head_loss(h, weight, target, group, vocab_size: int, loss_mask=None):
    """The reference: the whole logits, then the vocab-parallel cross entropy (today's path)."""
    return masked_mean(vocab_parallel_cross_entropy(F.linear(h, weight), target, group, vocab_size), loss_mask)


def _matmul_dtype(h, weight) -> torch.dtype:
    """The dtype F.linear(h, weight) would compute in here: autocast's for float32/16 inputs."""
    device = h.device.type
    try:
        enabled, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    except TypeError:   # torch < 2.4: per-device functions
        cpu = device == "cpu"
        enabled = torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
        dtype = torch.get_autocast_cpu_dtype() if cpu else torch.get_autocast_gpu_dtype()
    if enabled and torch.float64 not in (h.dtype, weight.dtype):
        return dtype
    return torch.promote_types(h.dtype, weight.dtype)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, loss_mask, normalizer, group, vocab_start, vocab_size, chunk, dtype,
                grad_h, grad_w):
        T, d = h.shape
        V = weight.shape[0]
        valid = max(0, min(V, vocab_size - vocab_start))   # local columns that are real vocabulary
        tp = group_size(group) > 1
        with torch.autocast(h.device.type, enabled=False):   # every cast below is explicit
            hm, wm = h.to(dtype), weight.to(dtype)
            if loss_mask is None and normalizer is None:
                mask = token_weight = None   # the mean: every token's weight is 1 / T
            else:   # sum(mask loss) / normalizer, masked_mean's arithmetic by default
                mask = torch.ones(T, device=h.device) if loss_mask is None else loss_mask.to(torch.float32)
                normalizer = mask.sum().clamp_min(1) if normalizer is None else normalizer.to(torch.float32)
                token_weight = mask / normalizer
            losses = torch.empty(T, dtype=torch.float32, device=h.device)
            dh = torch.empty_like(h) if grad_h else None
            # float32 (float64 for float64 inputs, as in tests)
            dw = torch.zeros(V, d, dtype=torch.promote_types(dtype, torch.float32), device=h.device) if grad_w else None
            rows = min(chunk, T)
            z_buf = torch.empty(rows, V, dtype=torch.float32, device=h.device)   # reused by every chunk
            mm_buf = torch.empty(rows, V, dtype=dtype, device=h.device) if dtype != torch.float32 else None
            for s in range(0, T, chunk):
                e = min(s + chunk, T)
                hc, z = hm[s:e], z_buf[:e - s]
                if mm_buf is None:
                    torch.mm(hc, wm.t(), out=z)
                else:
                    z.copy_(torch.mm(hc, wm.t(), out=mm_buf[:e - s]))
                if valid < V:
                    z[:, valid:] = float("-inf")   # vocabulary padding
                peak = z.amax(dim=-1)
                if tp:
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
                z.sub_(peak[:, None])
                local = target[s:e] - vocab_start
                mine = (local >= 0) & (local < V)
                local = local.masked_fill(~mine, 0)
                picked = z.gather(1, local[:, None]).squeeze(1).masked_fill(~mine, 0.0)
                z.exp_()
                stats = torch.stack([picked, z.sum(dim=-1)])
                if tp:
                    dist.all_reduce(stats, group=group)
                picked, total = stats
                losses[s:e] = total.log() - picked
                if not (grad_h or grad_w):
                    continue
                z.div_(total[:, None])                                   # softmax
                z.scatter_add_(1, local[:, None], -mine[:, None].to(z.dtype))   # - onehot(y)
                z.mul_(1.0 / T if token_weight is None else token_weight[s:e, None])
                g = z.to(dtype)
                if grad_h:
                    dh[s:e] = torch.mm(g, wm)
                if grad_w:
                    if g.dtype == dw.dtype:
                        dw.addmm_(g.t(), hc)
                    else:
                        dw += torch.mm(g.t(), hc)
        ctx.grads = (dh, dw)
        ctx.weight_dtype = weight.dtype
        return losses.mean() if mask is None else (losses * mask).sum() / normalizer

    @staticmethod
    def backward(ctx, grad):
        if ctx.grads is None:
            raise RuntimeError("the fused LM-head loss was differentiated twice; its gradients are made in "
                               "forward and used once (retain_graph is not supported).")
        dh, dw = ctx.grads
        ctx.grads = None
        if dh is not None:
            dh.mul_(grad)
        if dw is not None:
            dw = dw.mul_(grad).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None, None, None, None, None


def fused_lm_head_loss(h, weight, target, group, vocab_size: int, loss_mask=None, *, normalizer=None,
                       chunk_size: int | None = None):
    """masked_mean of the vocab-parallel cross entropy of F.linear(h, weight), chunked over the
    tokens (module docstring). h [..., d] inside the TP region, weight [V_local, d] this rank's
    shard, target and loss_mask shaped like h without its last dim. normalizer (a scalar
    tensor, not differentiated): sum(mask x loss) / normalizer instead of the mean over the
    counted tokens (context parallelism: the whole sample's count over C). chunk_size: tokens
    per chunk (default: CHUNK_ELEMENTS float32 logits)."""
    d = h.shape[-1]
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    mask = None if loss_mask is None else loss_mask.reshape(-1)
    grad = torch.is_grad_enabled()
    return _FusedLinearCrossEntropy.apply(
        h.reshape(-1, d), weight, target.reshape(-1), mask, normalizer, group, group_rank(group) * weight.shape[0],
        vocab_size, chunk, _matmul_dtype(h, weight), grad and h.requires_grad, grad and weight.requires_grad)


def lm_head_loss(lm_head, h, target, vocab_size: int, loss_mask=None, *, normalizer=None,
                 chunk_size: int | None = None):
    """The fused loss of the model's LM head (a Linear at TP=1, or the ColumnParallelLinear
    `parallelize` made of it) on the final hidden states h [B, N(/TP with SP), d], i.e. what
    LanguageModel.forward(..., return_hidden=True) returns. h goes through the mapping the head's
    own forward would apply (parallel/layers.py ColumnParallelLinear, and the sequence gather
    that parallelize hooks in front of the head with sequence parallelism), so dh is summed over
    TP as in the unfused path."""
    group = getattr(lm_head, "group", None)
    if getattr(lm_head, "sequence_parallel", False):
        h = mappings.gather_from_sequence(h, group)
    elif group is not None:
        h = mappings.copy_to_region(h, group)
    return fused_lm_head_loss(h, lm_head.weight, target, group, vocab_size, loss_mask, normalizer=normalizer,
                              chunk_size=chunk_size)
