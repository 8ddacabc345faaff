"""The decode interface a mixer may offer: the next token of N independent sequences ("slots") on
buffers allocated once and updated in place. inference/fused_decode.py composes the mixers of a
model through it (with the blocks' norms and SwiGLU around them) and reads nothing else of a
mixer; a mixer without it still generates, through its own forward with a state (the eager
decode), as every mixer does (docs/adding-a-mixer.md). Modelled on mamba's Mamba2 mixer
(`allocate_inference_cache`, `step`).

    decode_facts() -> DecodeFacts             what the decoder must know before allocating
    decode_tables(real_update=False)          (tables, static): the parameter-only tensors the
                                              step reads, built once; static: hashable facts
                                              of the step (torch.compile guards on them)
    allocate_decode_state(n_slots, capacity=None, device=None)
                                              {name: [n_slots, ...]} zeroed per-slot buffers
                                              (device="meta": only their sizes)
    load_decode_state(buffers, slot, state)   write the mixer's own prefill state (forward's
                                              return_state, batch 1) into one slot
    decode_step(x, rope, t, static, ...)      x [B, d] (normalised) -> [B, d] for slots 0..B-1;
                                              t: the tables and the buffers (cut to B slots) in
                                              one dict, the buffers updated in place

The step is a plain function of tensors (a staticmethod), so that one torch.compile serves
every layer of a kind. Its two shapes, told apart by DecodeFacts.fixed_size:
    fixed-size state    decode_step(x, rope, t, static, kernel=None)   (kernel: inference/cpu_kernel.py)
    growing KV cache    decode_step(x, rope, t, static, positions, lengths)

The interdomain / S4D-only step, as fixed_state_mixer below: the complex state X [H, M, P]
(P = R + Dv) is kept as real numbers, S [H, P, 2M] with Re and Im of each mode side by side
(S[.., j, 2m] = Re X[m, j], S[.., j, 2m+1] = Im X[m, j]), so that the update is two passes over
a complex view of the same memory and the readout three real matrix products over contiguous
slices (measured on a CPU at 125M width: the stacked [Re X; Im X] layout needed five passes
and twice the time):

    update     X <- lambda X + Bbar z                    (z = [k, v], the token's key and value)
    readout    u = q S_k                                  (2M: Re p, Im p of p = X^k q, interleaved)
               w = u G2                                   (G2: the 2M x 2M real form of r = p' G,
                                                           the conjugation and 1/sqrt(M) folded in)
               o = w S_v^T                                (= Re(r^T X^v))
    contraction readout (S4D-only): o = S e2, e2 = (Re e, -Im e) interleaved   (= Re(e^T X))

The projections that read the same input are one matrix ([q | k | v | g]) and the short convs
of a layer one depthwise tap sum over a [B, C, K] window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..layers import feature_map


@dataclass(frozen=True)
class DecodeFacts:
    """What a decoder must know of a mixer's decode before it allocates anything."""
    name: str                   # what messages call the mixer ("interdomain", "softmax")
    state_keys: tuple           # the keys of forward's state that load_decode_state reads
    fixed_size: bool            # the state keeps its size (static and compiled steps, the C++ core)
    needs_capacity: bool        # a cache of every token: allocate_decode_state needs `capacity`
    rope: tuple | None          # (head dim, theta) of its RoPE; None without


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrent state's real dtype: float64 for float64 models (the tests), float32 otherwise
    (as the model's complex64 state for bf16/fp16/fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rope_rows(x, cos, sin):
    """x [B, H, D] rotated by per-row angles (cos, sin [B, 1, D/2]); the half-split layout of
    model/layers.apply_rope, computed in float32 (or float64) as there."""
    dtype = x.dtype
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


@dataclass(frozen=True)
class FixedStateStatic:
    """An interdomain / S4D-only layer's shape facts (hashable: torch.compile guards on them, and
    layers of one model share them, so one compiled step serves all)."""
    Dh: int
    query: bool
    dual: bool
    rope: bool
    gate: bool
    conv_channels: int
    rotated: int            # RoPE's prefix of the convolved stack (q and k / a), 0 without RoPE
    mapped: int             # the feature map's prefix (q, and k when dual)
    kv_eps: float           # the key and value norms' eps (one: both are normalised at once)
    real_update: bool       # the update in real arithmetic (torch.compile cannot trace complex views)


def fixed_state_mixer(x, rope, t: dict, s: FixedStateStatic):
    """An interdomain or S4D-only mixer for one token of every slot: x [B, d] (normalised) -> its
    output [B, d]; t: the layer's tables and buffers (the conv tail and the state are updated
    in place). A plain function of tensors, so that one torch.compile serves every such layer."""
    B, Dh, C = x.shape[0], s.Dh, s.conv_channels
    y = x @ t["w_in"].T
    tail = t["conv_tail"]
    window = torch.cat([tail, y[:, :C, None]], dim=-1)                              # [B, C, K]
    tail.copy_(window[..., 1:])
    # the convolved projections as one stack [B, n, H, Dh]: [q,] k (dual input) or [q,] a, b (single);
    # RoPE takes a prefix of it (q and k / a), the feature map another (q, and k when dual)
    stack = ((window * t["conv_w"]).sum(-1) + t["conv_b"]).view(B, -1, *t["kv_bias"].shape[1:])
    if s.rotated:
        cos, sin = rope
        turned = rope_rows(stack[:, :s.rotated], cos[:, None], sin[:, None])
        stack = turned if s.rotated == stack.shape[1] else torch.cat([turned, stack[:, s.rotated:]], 1)
    if s.mapped:
        mapped = feature_map(stack[:, :s.mapped])
        stack = mapped if s.mapped == stack.shape[1] else torch.cat([mapped, stack[:, s.mapped:]], 1)
    first = int(s.query)   # the key's place in the stack
    value = stack[:, first + 1] if not s.dual else y[:, C:C + t["kv_bias"][0].numel()].view(B, -1, Dh)
    kv = torch.stack([stack[:, first], value], 1)                                   # [B, 2, H, Dh]
    # both norms at once (model/layers.rms_norm's arithmetic, in float32 or float64)
    work = kv.to(torch.promote_types(kv.dtype, torch.float32))
    kv = (work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + s.kv_eps) * t["kv_norm"]).to(kv.dtype) + t["kv_bias"]
    S = t["state"]
    z = kv.transpose(1, 2).reshape(B, -1, 2 * Dh).to(S.dtype)[..., None]           # [B, H, P, 1]: [k, v]
    if s.real_update:
        re, im = S.view(*S.shape[:-1], -1, 2).unbind(-1)
        lr, li, br, bi = t["lam_re"], t["lam_im"], t["bbar_re"], t["bbar_im"]
        S.copy_(torch.stack([lr * re - li * im + br * z, li * re + lr * im + bi * z], -1).view(S.shape))
    else:   # two passes over the complex view of the same memory
        torch.view_as_complex(S.view(*S.shape[:-1], -1, 2)).mul_(t["lam"]).addcmul_(z.to(t["lam"].dtype), t["bbar"])
    if s.query:
        q = stack[:, 0].to(S.dtype)
        u = q[:, :, None] @ S[:, :, :Dh]                                            # [B, H, 1, 2M]
        o = ((u @ t["g2"]) @ S[:, :, Dh:].transpose(-1, -2)).view(B, -1)            # [B, H Dv]
    else:
        o = (S @ t["e2"]).view(B, -1)                                               # [B, H P]
    o = o.to(x.dtype)
    if s.gate:
        o = o * F.silu(y[:, -o.shape[-1]:])
    return o @ t["o_proj"].T


def fixed_state_mixer_kernel(x, rope, t: dict, s: FixedStateStatic, kernel):
    """fixed_state_mixer with everything between its two matrix products (conv, RoPE, feature
    maps, norms, the state update and the readout) as one C++ call (inference/cpu_kernel.py)."""
    return fixed_state_between_kernel(x @ t["w_in"].T, rope, t, s, kernel) @ t["o_proj"].T


def fixed_state_between_kernel(y, rope, t: dict, s: FixedStateStatic, kernel, rows=None):
    """The C++ call alone: y = x W_in^T [B, C + ...] -> the input of W_O (for a caller that runs the
    two matrix products its own way: the vLLM plugin, on vLLM's prepacked CPU GEMM). rows (int64
    [B], optional): row b's slot in t's buffers, which may then be any slots of strided views
    (vLLM's state pages, updated in place); without it, row b is slot b."""
    cos, sin = rope if s.rotated else (None, None)
    return kernel(y, t["conv_tail"], t["conv_w"], t["conv_b"], cos, sin, t["kv_norm"], t["kv_bias"],
                  t["lam_re"], t["lam_im"], t["bbar_re"], t["bbar_im"], t["g2"] if s.query else t["e2"], t["state"],
                  s.rotated, s.mapped, s.query, s.dual, s.gate, s.kv_eps, rows)


def fixed_state_step(x, rope, t: dict, s: FixedStateStatic, kernel=None):
    """The interdomain mixer's decode_step: the torch ops, or the C++ core where `kernel` is given."""
    return fixed_state_mixer(x, rope, t, s) if kernel is None else fixed_state_mixer_kernel(x, rope, t, s, kernel)


@dataclass(frozen=True)
class AttentionStatic:
    """A softmax (or sliding-window) layer's step facts."""
    Dh: int
    rope: bool
    window: int | None      # the most keys a query sees (the ring's length); None: all
    groups: int = 1         # query heads per key/value head (grouped-query attention; 1: none)


def attention_step(x, rope, t: dict, s: AttentionStatic, positions, lengths: list[int]):
    """Softmax attention for one token of every slot: x [B, d] (normalised) -> [B, d]; positions
    [B] (this token's); lengths: tokens each row holds after this one (host ints: no device sync
    per step). The KV cache t["k"], t["v"] [B, Hkv, capacity, Dh] is a ring (the window for W
    layers): attention does not care about the order of its keys, and RoPE is applied before
    they are cached. t["w_in"] is [q | k | v] (t["b_in"] its bias, if any). Grouped-query
    attention (s.groups = G > 1): the G query heads of a key/value head are consecutive, so they
    attend as G queries of one head ([B, Hkv, G, Dh] against its keys), nothing repeated."""
    B = x.shape[0]
    k_cache, v_cache = t["k"], t["v"]
    capacity = k_cache.shape[2]
    seen = lengths if s.window is None else [min(m, s.window) for m in lengths]
    y = x @ t["w_in"].T if "b_in" not in t else torch.addmm(t["b_in"], x, t["w_in"].T)
    if s.groups == 1:
        q, k, v = y.view(B, 3, -1, s.Dh).unbind(1)                               # [B, H, Dh]
    else:
        q, k, v = y.view(B, -1, s.Dh).split([s.groups * k_cache.shape[1], k_cache.shape[1], k_cache.shape[1]], 1)
    if s.rope:
        q, k = rope_rows(q, *rope), rope_rows(k, *rope)
    where = positions % capacity
    rows = torch.arange(B, device=x.device)
    k_cache[rows, :, where] = k
    v_cache[rows, :, where] = v
    L = max(seen)
    mask = None
    if min(seen) != L:
        mask = (torch.arange(L, device=x.device)[None, :] < torch.tensor(seen, device=x.device)[:, None])
        mask = mask[:, None, None, :]
    queries = q[:, :, None] if s.groups == 1 else q.reshape(B, -1, s.groups, s.Dh)   # [B, Hkv, G, Dh]
    o = F.scaled_dot_product_attention(queries, k_cache[:B, :, :L], v_cache[:B, :, :L], attn_mask=mask)
    return o.reshape(B, -1) @ t["o_proj"].T
