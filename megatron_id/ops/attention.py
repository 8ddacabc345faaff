"""Causal softmax attention with packed documents and/or a sliding window, without a dense
[N, N] mask.

Layout [B, H, N, D] (SDPA's). A query at position i sees key j when

    j <= i                                   (causal)
    seq_idx[j] == seq_idx[i]                 (packed documents, data.reset_attention_mask)
    i - j < window                           (sliding window, model.window: itself and the
                                              window - 1 tokens before it)

Three forms compute it:
  - `masked_attention`: the reference, SDPA with the dense boolean mask ([B, 1, N, N]: O(N^2)
    memory, and on GPUs no flash kernel). What the softmax mixer did before (tests compare).
  - `blockwise_attention` (CPU, and CUDA without FlexAttention): queries in blocks of
    `block` tokens, each against only the keys it can see (from the earliest document start or
    window start of the block's queries to the block's end), through SDPA with that block's
    small mask. Forward keeps only q, k, v; backward recomputes one block at a time (the
    recomputation of ops/segments.py, at attention's scale), so memory is O(N x block) for a
    document as long as the sequence and O(N x (window + block)) with a window, not O(N^2).
  - `flex_attention_form` (CUDA): FlexAttention with a block mask built from the same rule
    (torch.nn.attention.flex_attention; compiled: a fused kernel that skips masked blocks).
    On CPU it runs unfused (tests check its mask against the reference there).
`causal_attention` picks: no documents and no window -> SDPA is_causal (flash where it exists;
unchanged from before); else FlexAttention on CUDA when available, the blockwise form otherwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 256   # queries per block of the blockwise form [our choice: 256 x a 16K document
              # is 16 MB of float mask per head group, and SDPA's per-call cost stays amortised]


def visible(query_pos, key_pos, q_doc=None, k_doc=None, window: int | None = None):
    """The attention rule as a boolean mask: [.., Nq, Nk] from positions [Nq], [Nk] and the
    document indices [B, Nq], [B, Nk] (None: one document)."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask = mask & (query_pos[:, None] - key_pos[None, :] < window)
    if q_doc is not None:
        mask = mask[None] & (q_doc[:, :, None] == k_doc[:, None, :])
    return mask


def masked_attention(q, k, v, seq_idx=None, window=None):
    """The reference: one SDPA call with the dense [B, 1, N, N] (or [N, N]) mask."""
    N = q.shape[2]
    pos = torch.arange(N, device=q.device)
    mask = visible(pos, pos, seq_idx, seq_idx, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask if mask.dim() == 2 else mask[:, None])


def document_first(seq_idx: torch.Tensor) -> torch.Tensor:
    """[B, N] -> [B, N]: the position where each token's document begins (documents are
    contiguous runs of one seq_idx value)."""
    N = seq_idx.shape[1]
    pos = torch.arange(N, device=seq_idx.device).expand_as(seq_idx)
    change = torch.ones_like(seq_idx, dtype=torch.bool)
    change[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return torch.where(change, pos, 0).cummax(dim=1).values


def _blocks(N: int, block: int, first: torch.Tensor | None, window: int | None):
    """(s, e, lo) per query block [s, e): keys lo..e-1 hold every key its queries can see."""
    for s in range(0, N, block):
        e = min(s + block, N)
        lo = 0 if first is None else int(first[:, s].min())
        if window is not None:
            lo = max(lo, s - window + 1)
        yield s, e, lo


def _block_attention(q, k, v, seq_idx, window, s, e, lo):
    pos = torch.arange(lo, e, device=q.device)
    docs = None if seq_idx is None else seq_idx[:, lo:e]
    mask = visible(pos[s - lo:], pos, None if docs is None else docs[:, s - lo:], docs, window)
    return F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, lo:e], v[:, :, lo:e],
                                          attn_mask=mask if mask.dim() == 2 else mask[:, None])


class _BlockwiseAttention(torch.autograd.Function):
    """Forward block by block keeping nothing but q, k, v (and seq_idx); backward recomputes
    each block's attention and takes its gradients, one block at a time."""

    @staticmethod
    def forward(ctx, q, k, v, seq_idx, window, block):
        first = None if seq_idx is None else document_first(seq_idx)
        out = torch.cat([_block_attention(q, k, v, seq_idx, window, s, e, lo)
                         for s, e, lo in _blocks(q.shape[2], block, first, window)], dim=2)
        ctx.save_for_backward(q, k, v, seq_idx)
        ctx.window, ctx.block, ctx.first = window, block, first
        device = q.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, seq_idx = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        device, enabled, dtype = ctx.autocast
        for s, e, lo in _blocks(q.shape[2], ctx.block, ctx.first, ctx.window):
            qb, kb, vb = (t.detach().requires_grad_() for t in (q[:, :, s:e], k[:, :, lo:e], v[:, :, lo:e]))
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                pos = torch.arange(lo, e, device=q.device)
                docs = None if seq_idx is None else seq_idx[:, lo:e]
                mask = visible(pos[s - lo:], pos, None if docs is None else docs[:, s - lo:], docs, ctx.window)
                out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask if mask.dim() == 2 else mask[:, None])
            gq, gk, gv = torch.autograd.grad(out, (qb, kb, vb), grad[:, :, s:e].to(out.dtype))
            dq[:, :, s:e] += gq
            dk[:, :, lo:e] += gk
            dv[:, :, lo:e] += gv
        return dq, dk, dv, None, None, None


def blockwise_attention(q, k, v, seq_idx=None, window=None, block: int = BLOCK):
    """Equal to masked_attention (same SDPA per block), in O(N x block) memory."""
    if torch.compiler.is_compiling():   # under torch.compile: an eager island (its block bounds are data)
        return _eager_island()(q, k, v, seq_idx, window, block)
    return _blockwise_attention(q, k, v, seq_idx, window, block)


_ISLAND = {}


def _eager_island():
    """torch.compiler.disable(_blockwise_attention), made when first traced rather than as a
    decorator: the decorator imports torch._dynamo when this module is imported, ~1.1 s of the
    start of every command that builds a model. (The first trace breaks its graph once more, here.)"""
    if "fn" not in _ISLAND:
        _ISLAND["fn"] = torch.compiler.disable(_blockwise_attention)
    return _ISLAND["fn"]


def _blockwise_attention(q, k, v, seq_idx, window, block):
    if not (q.requires_grad or k.requires_grad or v.requires_grad) or not torch.is_grad_enabled():
        first = None if seq_idx is None else document_first(seq_idx)
        return torch.cat([_block_attention(q, k, v, seq_idx, window, s, e, lo)
                          for s, e, lo in _blocks(q.shape[2], block, first, window)], dim=2)
    return _BlockwiseAttention.apply(q, k, v, seq_idx, window, block)


_COMPILED_FLEX = {}


def flex_attention_form(q, k, v, seq_idx=None, window=None, compiled: bool = True):
    """FlexAttention with the rule as a block mask: on CUDA a fused kernel that never forms
    the [N, N] scores and skips whole blocks the rule masks (compiled once per process)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, _, N, _ = q.shape

    def rule(b, h, qi, ki):
        keep = ki <= qi
        if window is not None:
            keep = keep & (qi - ki < window)
        if seq_idx is not None:
            keep = keep & (seq_idx[b, qi] == seq_idx[b, ki])
        return keep
    # compiled on CUDA: evaluating the rule eagerly would form the [B, N, N] grid once
    mask = create_block_mask(rule, B if seq_idx is not None else None, None, N, N, device=q.device,
                             _compile=compiled)
    if not compiled:
        return flex_attention(q, k, v, block_mask=mask)
    if "flex" not in _COMPILED_FLEX:
        _COMPILED_FLEX["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX["flex"](q, k, v, block_mask=mask)


def flex_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def causal_attention(q, k, v, seq_idx=None, window=None):
    """[B, H, N, D] causal attention under the rule above, in the cheapest exact form here."""
    if seq_idx is None and (window is None or window >= q.shape[2]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)
    if flex_available(q.device):
        return flex_attention_form(q, k, v, seq_idx, window)
    return blockwise_attention(q, k, v, seq_idx, window)
