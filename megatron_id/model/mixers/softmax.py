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

    def forward(self, x, state=None, return_state=False, start=None):
        """x [B, N, d]. state: the KV cache {'k', 'v': [B, L, H, Dh], 'pos': L} or None.
        start [B] or None: left padding, each row's first real position: no query sees a padded
        key, and RoPE counts each row's positions from its first real token."""
        B, N, _ = x.shape
        shape = (B, N, -1, self.head_dim)   # -1 heads: runs unchanged on a TP shard's heads
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        pos = state["pos"] if state else 0
        rope_offset = pos if start is None else left_padding(start, pos, N)[1]
        if self.rope:
            q, k = apply_rope(q, rope_offset, self.rope_theta), apply_rope(k, rope_offset, self.rope_theta)
        if state:
            k, v = torch.cat([state["k"], k], dim=1), torch.cat([state["v"], v], dim=1)
        if start is not None:   # causal, minus padded keys; a padded query keeps its own key (no empty row)
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
