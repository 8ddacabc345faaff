"""Softmax baseline: causal multi-head attention with RoPE through SDPA; no GQA."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import Linear, apply_rope
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

    def forward(self, x, state=None, return_state=False):
        """x [B, N, d]. state: the KV cache {'k', 'v': [B, L, H, Dh], 'pos': L} or None."""
        B, N, _ = x.shape
        shape = (B, N, -1, self.head_dim)   # -1 heads: runs unchanged on a TP shard's heads
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        pos = state["pos"] if state else 0
        if self.rope:
            q, k = apply_rope(q, pos, self.rope_theta), apply_rope(k, pos, self.rope_theta)
        if state:
            k, v = torch.cat([state["k"], k], dim=1), torch.cat([state["v"], v], dim=1)
        if pos == 0 or N == 1:
            mask, causal = None, N > 1
        else:   # continuing a prefix: query i sees keys 0..pos+i (bottom-right aligned)
            mask = torch.ones(N, pos + N, dtype=torch.bool, device=x.device).tril(pos)
            causal = False
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=causal)
        y = self.o_proj(o.transpose(1, 2).reshape(B, N, -1))   # -1: local heads under TP
        return (y, {"k": k, "v": v, "pos": pos + N}) if return_state else y
