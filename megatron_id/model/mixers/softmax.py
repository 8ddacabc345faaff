"""Softmax baseline: causal multi-head attention with RoPE. With model.window (the W layers of a
hybrid, model/pattern.py) each query sees itself and the window - 1 tokens before it, and the
KV cache keeps only those: a constant-size state once full.

Grouped-query attention (model.n_kv_heads, Llama's): k_proj and v_proj make n_kv_heads heads,
each read by G = n_heads / n_kv_heads consecutive query heads (query head i reads kv head i // G,
HF's repeat_kv); keys and values are cached at n_kv_heads and repeated (repeat_interleave) just
before each attention call, so the cache is G times smaller (a call over the cache on CPU reads
it in place instead, bit for bit the same: `cached_attention`). Without it (G = 1) nothing is
repeated: the same ops as multi-head attention. Under TP a rank's n_heads / TP contiguous query
heads read exactly its n_kv_heads / TP key/value heads (k_proj, v_proj are cut by output
features like q_proj). model.qkv_bias (Qwen2's) adds biases to q, k and v (zero at init).

Full sequences go through ops/attention.causal_attention: SDPA's causal kernel without packed
documents or a window, else FlexAttention (CUDA) or the blockwise form (CPU), never a dense
[N, N] mask. Prefill after a cache, decode and left padding use SDPA with an explicit mask over
the cached keys (at most [N, window + N] with a window).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.attention import causal_attention, visible
from ..layers import Linear, apply_rope, left_padding
from ..roles import COLUMN_PARALLEL, ROW_PARALLEL
from ..rope import Rope
from ..spec import kv_heads, mixer_module
from .decode import AttentionStatic, DecodeFacts, attention_step


def repeat_kv(k: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """Each key/value head repeated `groups` times in place along the heads' `dim` (kv head j
    becomes heads j G .. j G + G - 1: HF's repeat_kv); groups 1 returns `k` itself."""
    return k if groups == 1 else k.repeat_interleave(groups, dim=dim)


# SDPA's enable_gqa (torch >= 2.5; setup.py allows 2.3, and an export runs on the user's torch)
_SDPA_GQA = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 5)


def cached_attention(q, k, v, groups: int, mask=None):
    """SDPA of q [B, H, N, Dh] over the cached keys and values k, v [B, L, Hkv, Dh] (the
    cache's layout), query head i reading kv head i // groups. On CPU, SDPA's enable_gqa reads
    each kv head for its G query heads in place: the same kernel and the same numbers, bit for
    bit (tests/test_gqa.py), as on the repeated copy, without the G-times copy of the whole cache
    each decoded token would otherwise make. Elsewhere (CUDA, where enable_gqa changes which
    kernel runs, hence the bits; an older torch) the cache is repeated as before."""
    if groups > 1 and _SDPA_GQA and q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                              enable_gqa=True)
    kt, vt = (repeat_kv(t, groups, 2).transpose(1, 2) for t in (k, v))   # [B, H, L, Dh]
    return F.scaled_dot_product_attention(q, kt, vt, attn_mask=mask)


@mixer_module("softmax")
class SoftmaxAttention(nn.Module):
    # (model/roles.py) under TP each rank keeps whole heads: q, k, v by output features (their
    # biases with them), so a rank's query heads and the key/value heads they read stay together
    PARAMETER_ROLES = {"q_proj": COLUMN_PARALLEL, "k_proj": COLUMN_PARALLEL, "v_proj": COLUMN_PARALLEL,
                       "o_proj": ROW_PARALLEL}

    @staticmethod
    def core_macs_per_token(cfg, context: int) -> int:
        """QK^T and AV over the whole context seen, no causal discount (the PaLM/Megatron MFU
        convention); a window caps the context. Every query head does them, so GQA (fewer
        key/value heads) does not change them."""
        window = cfg.window
        return 2 * (context if window is None else min(context, window)) * cfg.d_model

    @staticmethod
    def decode_state_numbers(cfg) -> tuple[int, int]:
        """(fixed, per token of context): the KV cache, 2 n_kv_heads d_h per token (2 d without
        GQA); with a window, the full window counted as fixed."""
        window, per_token = cfg.window, 2 * kv_heads(cfg) * (cfg.d_model // cfg.n_heads)
        return (0, per_token) if window is None else (per_token * window, 0)

    def __init__(self, cfg, residual_std: float, form: str = "chunked"):
        """form: how recurrent mixers run full sequences; attention has one form (ignored)."""
        super().__init__()
        d = cfg.d_model
        self.head_dim, self.rope, self.rope_spec = d // cfg.n_heads, cfg.rope, Rope.of(cfg)
        self.window = cfg.window   # None: every earlier token
        d_kv = kv_heads(cfg) * self.head_dim   # d without GQA
        self.q_proj = Linear(d, d, cfg.init_std, bias=cfg.qkv_bias)
        self.k_proj, self.v_proj = (Linear(d, d_kv, cfg.init_std, bias=cfg.qkv_bias) for _ in range(2))
        self.o_proj = Linear(d, d, residual_std)
        self.context_parallel = None   # parallel/context_parallel.py sets it: this rank runs one block

    def forward(self, x, state=None, return_state=False, start=None, seq_idx=None, position_ids=None):
        """x [B, N, d]. state: the KV cache {'k', 'v': [B, L, Hkv, Dh], 'pos': tokens seen} or None
        (with a window, L <= window: the cache holds the last L of the 'pos' tokens seen; Hkv:
        the key/value heads, n_kv_heads, or n_heads without GQA).
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
            q, k = apply_rope(q, rope_offset, self.rope_spec), apply_rope(k, rope_offset, self.rope_spec)
        if state:
            k, v = torch.cat([state["k"], k], dim=1), torch.cat([state["v"], v], dim=1)
        groups = q.shape[2] // k.shape[2]   # query heads per key/value head (1: no GQA)
        qt = q.transpose(1, 2)
        if not state and start is None:   # a whole sequence (training, a first prefill)
            kt, vt = (repeat_kv(t, groups, 2).transpose(1, 2) for t in (k, v))   # [B, H, L, Dh]; the cache keeps Hkv
            o = causal_attention(qt, kt, vt, seq_idx, self.window)
        else:   # continuing a cache, or left padding: the mask over the cached and new keys
            query_pos = pos + torch.arange(N, device=x.device)
            key_pos = torch.arange(pos + N - k.shape[1], pos + N, device=x.device)   # the cache's
            mask = visible(query_pos, key_pos, window=self.window)                   # [N, L]
            if start is not None:   # minus padded keys; a padded query keeps its own key (no empty row)
                mask = (mask & (key_pos[None, None, :] >= start[:, None, None])) | \
                    (key_pos[None, :] == query_pos[:, None])
                mask = mask[:, None]                                                 # [B, 1, N, L]
            # one new token sees every cached key unless the window cuts the cache (decided by
            # shapes: no device sync per decoded token)
            sees_all = N == 1 and start is None and (self.window is None or k.shape[1] <= self.window)
            o = cached_attention(qt, k, v, groups, None if sees_all else mask)   # the cache stays at Hkv
        y = self.o_proj(o.transpose(1, 2).reshape(B, N, -1))   # -1: local heads under TP
        if not return_state:
            return y
        if self.window is not None:   # the next query sees at most window - 1 of these
            k, v = k[:, -self.window:], v[:, -self.window:]
        return y, {"k": k, "v": v, "pos": pos + N}

    # The decode interface (model/mixers/decode.py): inference/fused_decode.py decodes N slots
    # through these alone. The per-slot state is a KV cache of `capacity` tokens, or of the
    # window (a ring: decode.attention_step).
    decode_step = staticmethod(attention_step)

    def decode_facts(self) -> DecodeFacts:
        return DecodeFacts("softmax", ("k", "v"), fixed_size=False, needs_capacity=self.window is None,
                           rope=(self.head_dim, self.rope_spec) if self.rope else None)

    def decode_tables(self, real_update: bool = False) -> tuple[dict, AttentionStatic]:
        """One input matrix [q | k | v] (with GQA its k and v parts are n_kv_heads heads), its
        bias with model.qkv_bias, and W_O (real_update: only for fixed-size states)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        t = {"w_in": torch.cat([p.weight for p in projections]).detach(), "o_proj": self.o_proj.weight.detach()}
        if self.q_proj.bias is not None:
            t["b_in"] = torch.cat([p.bias for p in projections]).detach()
        kv_width = self.k_proj.weight.shape[0]   # this rank's key/value heads x Dh
        return t, AttentionStatic(self.head_dim, self.rope, self.window, self.q_proj.weight.shape[0] // kv_width)

    def allocate_decode_state(self, n_slots: int, capacity: int | None = None, device=None) -> dict:
        """K and V [n_slots, Hkv, length, Dh] (Hkv: the key/value heads), zeroed: length the
        window, or `capacity` (the most tokens a sequence reaches) without one."""
        weight = self.k_proj.weight
        if self.window is not None:
            capacity = self.window
        if capacity is None:
            raise ValueError("a softmax layer's KV cache needs a capacity: give the most tokens a "
                             "sequence reaches (prompt + new tokens).")
        k = torch.zeros(n_slots, weight.shape[0] // self.head_dim, capacity, self.head_dim, dtype=weight.dtype,
                        device=weight.device if device is None else device)
        return {"k": k, "v": torch.zeros_like(k)}

    def load_decode_state(self, buffers: dict, slot: int, state: dict) -> None:
        """forward's KV cache of one sequence ({'k', 'v', 'pos'}, batch 1) into `slot`'s ring."""
        k, v, pos = state["k"][0], state["v"][0], state["pos"]   # [L, H, Dh]: the last L of pos tokens
        L, capacity = k.shape[0], buffers["k"].shape[2]
        if L > capacity:
            raise ValueError(f"a prefix of {pos} tokens does not fit a KV cache of {capacity}: "
                             f"give a larger capacity.")
        where = torch.arange(pos - L, pos, device=k.device) % capacity
        buffers["k"][slot, :, where] = k.transpose(0, 1)
        buffers["v"][slot, :, where] = v.transpose(0, 1)

    def _context_parallel_forward(self, x, seq_idx, position_ids):
        """This rank's block of queries against the keys and values of every block up to its
        own, all-gathered (parallel/context_parallel.py; the simple scheme, no ring)."""
        cp = self.context_parallel
        B, L, _ = x.shape
        shape = (B, L, -1, self.head_dim)
        q, k, v = self.q_proj(x).view(shape), self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        groups = q.shape[2] // k.shape[2]   # (the key/value heads are gathered before they are repeated)
        if self.rope:
            offset = cp.rank * L if position_ids is None else position_ids
            q, k = apply_rope(q, offset, self.rope_spec), apply_rope(k, offset, self.rope_spec)
        seen = (cp.rank + 1) * L   # keys of later blocks are never attended to
        k_all = cp.gather(k)[:cp.rank + 1].transpose(0, 1).reshape(B, seen, *k.shape[2:])
        v_all = cp.gather(v)[:cp.rank + 1].transpose(0, 1).reshape(B, seen, *v.shape[2:])
        query_pos = cp.rank * L + torch.arange(L, device=x.device)
        mask = visible(query_pos, torch.arange(seen, device=x.device), window=self.window)   # [L, seen]
        if seq_idx is not None:
            docs = cp.gather(seq_idx)[:cp.rank + 1].transpose(0, 1).reshape(B, seen)
            mask = mask & (seq_idx[:, :, None] == docs[:, None, :])
        k_all, v_all = repeat_kv(k_all, groups, 2), repeat_kv(v_all, groups, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),
                                           attn_mask=mask if mask.dim() == 2 else mask[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))
