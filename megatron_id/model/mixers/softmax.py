"""Softmax baseline: causal multi-head attention with RoPE through SDPA; no GQA."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import Linear, apply_rope, left_padding
from ..roles import COLUMN_PARALLEL, ROW_PARALLEL


class SoftmaxAttention(nn.Module):
    # (model/roles.py) under TP each rank keeps whole heads: q, k, v by output features
    PARAMETER_ROLES = {"q_proj": COLUMN_PARALLEL, "k_proj": COLUMN_PARALLEL, "v_proj": COLUMN_PARALLEL,
                       "o_proj": ROW_PARALLEL}

    def __init__(self, cfg, residual_std: float):
        super().__init__()
        d = cfg.d_model
        self.head_dim, self.rope, self.rope_theta = d // cfg.n_heads, cfg.rope, cfg.rope_theta
        self.q_proj, self.k_proj, self.v_proj = (Linear(d, d, cfg.init_std) for _ in range(3))
        self.o_proj = Linear(d, d, residual_std)
        self.context_parallel = None   # parallel/context_parallel.py sets it: this rank runs one block

    def forward(self, x, state=None, return_state=False, start=None, seq_idx=None, position_ids=None):
        """x [B, N, d]. state: the KV cache {'k', 'v': [B, L, H, Dh], 'pos': L} or None.
        start [B] or None: left padding, each row's first real position: no query sees a padded
        key, and RoPE counts each row's positions from its first real token.
        seq_idx [B, N] (packed documents, data.reset_attention_mask): attention is causal within
        each document only (block-diagonal); position_ids [B, N]: RoPE's positions."""
        B, N, _ = x.shape
        if self.context_parallel is not None and state is None and start is None and not return_state:
            return self._context_parallel_forward(x, seq_idx, position_ids)
        if seq_idx is not None and (state or start is not None):
            raise ValueError("packed documents (seq_idx) are for whole sequences: not with a KV cache "
                             "or left padding")
        shape = (B, N, -1, self.head_dim)   # -1 heads: runs unchanged on a TP shard's heads
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        pos = state["pos"] if state else 0
        rope_offset = pos if start is None else left_padding(start, pos, N)[1]
        if position_ids is not None:
            rope_offset = position_ids
        if self.rope:
            q, k = apply_rope(q, rope_offset, self.rope_theta), apply_rope(k, rope_offset, self.rope_theta)
        if state:
            k, v = torch.cat([state["k"], k], dim=1), torch.cat([state["v"], v], dim=1)
        if seq_idx is not None:   # [B, 1, N, N]: causal and within one document
            causal = torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
            mask, causal = (causal & (seq_idx[:, :, None] == seq_idx[:, None, :]))[:, None], False
        elif start is not None:   # causal, minus padded keys; a padded query keeps its own key (no empty row)
            query_pos = pos + torch.arange(N, device=x.device)
            key_pos = torch.arange(pos + N, device=x.device)
            causal = key_pos[None, :] <= query_pos[:, None]
            mask = (causal & (key_pos[None, None, :] >= start[:, None, None])) | (key_pos == query_pos[:, None])
            mask, causal = mask[:, None], False   # [B, 1, N, L]: the same for every head
        elif pos == 0 or N == 1:
            mask, causal = None, N > 1
        else:   # continuing a prefix: query i sees keys 0..pos+i (bottom-right aligned)
            mask = torch.ones(N, pos + N, dtype=torch.bool, device=x.device).tril(pos)
            causal = False
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=causal)
        y = self.o_proj(o.transpose(1, 2).reshape(B, N, -1))   # -1: local heads under TP
        return (y, {"k": k, "v": v, "pos": pos + N}) if return_state else y

    def _context_parallel_forward(self, x, seq_idx, position_ids):
        """This rank's block of queries against the keys and values of every block up to its
        own, all-gathered (parallel/context_parallel.py; the simple scheme, no ring)."""
        cp = self.context_parallel
        B, L, _ = x.shape
        shape = (B, L, -1, self.head_dim)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        if self.rope:
            offset = cp.rank * L if position_ids is None else position_ids
            q, k = apply_rope(q, offset, self.rope_theta), apply_rope(k, offset, self.rope_theta)
        seen = (cp.rank + 1) * L   # keys of later blocks are never attended to
        k_all = cp.gather(k)[:cp.rank + 1].transpose(0, 1).reshape(B, seen, *k.shape[2:])
        v_all = cp.gather(v)[:cp.rank + 1].transpose(0, 1).reshape(B, seen, *v.shape[2:])
        query_pos = cp.rank * L + torch.arange(L, device=x.device)
        mask = torch.arange(seen, device=x.device)[None, :] <= query_pos[:, None]   # [L, seen]
        if seq_idx is not None:
            docs = cp.gather(seq_idx)[:cp.rank + 1].transpose(0, 1).reshape(B, seen)
            mask = mask & (seq_idx[:, :, None] == docs[:, None, :])
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),
                                           attn_mask=mask if mask.dim() == 2 else mask[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))
