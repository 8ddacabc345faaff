"""The fused decode step: the next token of B independent sequences ("slots") through every layer,
on buffers allocated once and updated in place (the form a CUDA graph captures), in as few ops
as the math allows. The model's own decode (LanguageModel.forward with states, one token) is the
reference it is tested against (tests/test_fused_decode.py): it rebuilds shapes, concatenates
caches and runs the interdomain core as a chain of small complex ops per layer, so at short
prefixes it is bound by op overhead, not arithmetic (issue 31).

Per slot: its own position (RoPE), its own state in every layer, its own length of KV cache
(softmax layers of hybrids), so a batch holds sequences of different prefix lengths without
padding, and a slot can be refilled while the others go on (continuous batching).

Interdomain / S4D-only layer: the complex state X [H, M, P] (P = R + Dv) is kept as real numbers,
S [H, P, 2M] with Re and Im of each mode side by side (S[.., j, 2m] = Re X[m, j], S[.., j, 2m+1]
= Im X[m, j]), so that the update is two passes over a complex view of the same memory and the
readout three real matrix products over contiguous slices (measured on this CPU at 125M width:
the stacked [Re X; Im X] layout needed five passes and twice the time):

    update     X <- lambda X + Bbar z                    (z = [k, v], the token's key and value)
    readout    u = q S_k                                  (2M: Re p, Im p of p = X^k q, interleaved)
               w = u G2                                   (G2: the 2M x 2M real form of r = p' G,
                                                           the conjugation and 1/sqrt(M) folded in)
               o = w S_v^T                                (= Re(r^T X^v))
    contraction readout (S4D-only): o = S e2, e2 = (Re e, -Im e) interleaved   (= Re(e^T X))

The projections that read the same input are one matrix ([q | k | v | g], FFN's [w1 | w3]),
the short convs of a layer one depthwise tap sum over a [B, C, K] window, and RoPE's angles are
computed once per step for all layers.

On a CPU (float32/float64) everything between a fixed-state layer's two matrix products runs as
one C++ call (inference/cpu_kernel.py, csrc/fixed_state_step.cpp: the state read and written
once); fixed_state_mixer below is its reference and the path elsewhere (GPU, bf16, compile).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..model.layers import feature_map, rms_norm
from ..model.mixers.interdomain import InterdomainMixer
from ..model.mixers.softmax import SoftmaxAttention
from ..ops.interdomain.ssm import contraction_vector, discretize, readout_gram, readout_scale


class FusedDecodeError(UserError, ValueError):
    """A model or a request the fused step cannot take (the message says what to do)."""


def kv_cache_bytes(model, slots: int, capacity: int) -> tuple[int, int]:
    """(bytes, softmax layers) of the KV caches FusedDecoder allocates for `slots` sequences of
    up to `capacity` tokens: K and V per softmax layer, of the window's length for sliding-window
    layers (their size does not grow with `capacity`). Fixed-state layers: none."""
    total, layers = 0, 0
    for block in model.layers:
        mixer = block.mixer
        if not isinstance(mixer, SoftmaxAttention):
            continue
        weight = mixer.o_proj.weight
        heads = weight.shape[1] // mixer.head_dim
        length = mixer.window if mixer.window is not None else capacity
        total += 2 * slots * heads * length * mixer.head_dim * weight.element_size()
        layers += 1
    return total, layers


def available_memory(device) -> tuple[int | None, str]:
    """(bytes free for new tensors, what they are) on `device`: the GPU's free memory, or the
    host's MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    from ..training.agreement import available_host_memory
    return available_host_memory(), "of host memory available"


# the share of the free memory a KV pool may take (the prefill's activations and logits need the rest)
KV_MEMORY_SHARE = 0.8


def slot_bytes(model) -> int:
    """Bytes per slot that do not depend on the context: the recurrent state of every
    interdomain / S4D-only layer (float32 real numbers) and a row of float32 logits."""
    from ..model.accounting import report
    counts = report(model.cfg)
    fixed_layers = sum(not isinstance(block.mixer, SoftmaxAttention) for block in model.layers)
    return 4 * (fixed_layers * (counts.state_per_token_per_layer or 0) + model.lm_head.weight.shape[0])


def check_kv_pool(model, slots: int, capacity: int, device, options: str, fix: str) -> None:
    """Refuse, before allocating, a decode pool (the KV caches of softmax layers, the recurrent
    states, the logits of a step) larger than KV_MEMORY_SHARE of the memory available on
    `device`: on a CPU torch hands out the pages lazily and the out-of-memory killer ends the
    process later, without a word. `options` names what sized it, `fix` what to lower."""
    kv, layers = kv_cache_bytes(model, slots, capacity)
    per_slot = slot_bytes(model)
    need = kv + slots * per_slot
    free, where = available_memory(device)
    if free is None or need <= KV_MEMORY_SHARE * free:
        return
    budget = KV_MEMORY_SHARE * free
    per_token = kv_cache_bytes(model, 1, 2)[0] - kv_cache_bytes(model, 1, 1)[0]   # grows with the context
    fixed = kv_cache_bytes(model, 1, 0)[0] + per_slot                              # per slot, any context
    tokens = int((budget - slots * fixed) // (per_token * slots)) if per_token else 0
    fitting_slots = int(budget // (fixed + per_token * capacity)) if fixed + per_token * capacity else 0
    if per_token and tokens >= 2:
        hint = f" (at most {tokens:,} tokens fit with {slots} slot(s))"
    elif fitting_slots >= 1:
        hint = f" (at most {fitting_slots:,} slot(s) fit)"
    else:
        hint = ""
    rest = slots * per_slot
    what = (f"the KV cache of the model's {layers} softmax layer(s) would take {kv / 2**30:,.1f} GiB ({kv:,} bytes, "
            f"allocated at start)" + (f" and the recurrent states and logits {rest / 2**30:,.1f} GiB more"
                                      if rest >= 0.05 * 2**30 else "")
            if kv else f"the recurrent states and logits of {slots:,} slot(s) would take {need / 2**30:,.1f} GiB "
                       f"({need:,} bytes, allocated at start)")
    raise FusedDecodeError(f"{options}: {what}, more than {KV_MEMORY_SHARE:.0%} of the {free / 2**30:,.1f} GiB "
                           f"{where}. {fix}{hint}.")


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The recurrent state's real dtype: float64 for float64 models (the tests), float32 otherwise
    (as the model's complex64 state for bf16/fp16/fp32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rope(x, cos, sin):
    """x [B, H, D] rotated by per-row angles (cos, sin [B, 1, D/2]); the half-split layout of
    model/layers.apply_rope, computed in float32 (or float64) as there."""
    dtype = x.dtype
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def _swiglu_residual(h, norm, eps, w13, w2):
    """h + SwiGLU(RMSNorm(h)) with the SwiGLU's w1 and w3 as one matrix [w1 | w3]."""
    a, b = (rms_norm(h, norm, eps) @ w13.T).chunk(2, dim=-1)
    return h + (F.silu(a) * b) @ w2.T


@dataclass(frozen=True)
class _Static:
    """A fixed-state layer's shape facts (hashable: torch.compile guards on them, and layers of
    one model share them, so one compiled step serves all)."""
    Dh: int
    query: bool
    dual: bool
    rope: bool
    gate: bool
    conv_channels: int
    rotated: int            # RoPE's prefix of the convolved stack (q and k / a), 0 without RoPE
    mapped: int             # the feature map's prefix (q, and k when dual)
    eps: tuple              # mixer norm, k and v norms, ffn norm
    real_update: bool       # the update in real arithmetic (torch.compile cannot trace complex views)


def fixed_state_mixer(x, rope, t: dict, s: _Static):
    """An interdomain or S4D-only mixer for one token of every slot: x [B, d] (normalised) -> its
    output [B, d]; t: the layer's weights and buffers (the conv tail and the state are updated
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
        turned = _rope(stack[:, :s.rotated], cos[:, None], sin[:, None])
        stack = turned if s.rotated == stack.shape[1] else torch.cat([turned, stack[:, s.rotated:]], 1)
    if s.mapped:
        mapped = feature_map(stack[:, :s.mapped])
        stack = mapped if s.mapped == stack.shape[1] else torch.cat([mapped, stack[:, s.mapped:]], 1)
    first = int(s.query)   # the key's place in the stack
    value = stack[:, first + 1] if not s.dual else y[:, C:C + t["kv_bias"][0].numel()].view(B, -1, Dh)
    kv = torch.stack([stack[:, first], value], 1)                                   # [B, 2, H, Dh]
    # both norms at once (model/layers.rms_norm's arithmetic, in float32 or float64)
    work = kv.to(torch.promote_types(kv.dtype, torch.float32))
    kv = (work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + s.eps[1]) * t["kv_norm"]).to(kv.dtype) + t["kv_bias"]
    S = t["state"]
    z = kv.transpose(1, 2).reshape(B, -1, 2 * Dh).to(S.dtype)[..., None]           # [B, H, P, 1]: [k, v]
    if s.real_update:
        re, im = S.view(*S.shape[:-1], -1, 2).unbind(-1)
        lr, li, br, bi = t["lam_re"], t["lam_im"], t["bbar_re"], t["bbar_im"]
        S.copy_(torch.stack([lr * re - li * im + br * z, li * re + lr * im + bi * z], -1).view(S.shape))
    else:   # two passes over the complex view of the same memory
        t["complex_state"].mul_(t["lam"]).addcmul_(z.to(t["lam"].dtype), t["bbar"])
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


def fixed_state_mixer_kernel(x, rope, t: dict, s: _Static, kernel):
    """fixed_state_mixer with everything between its two matrix products (conv, RoPE, feature
    maps, norms, the state update and the readout) as one C++ call (inference/cpu_kernel.py)."""
    cos, sin = rope if s.rotated else (None, None)
    o = kernel(x @ t["w_in"].T, t["conv_tail"], t["conv_w"], t["conv_b"], cos, sin, t["kv_norm"], t["kv_bias"],
               t["lam_re"], t["lam_im"], t["bbar_re"], t["bbar_im"], t["g2"] if s.query else t["e2"], t["state"],
               s.rotated, s.mapped, s.query, s.dual, s.gate, s.eps[1])
    return o @ t["o_proj"].T


def fixed_state_block(h, rope, t: dict, s: _Static, kernel=None):
    """The whole block (mixer and SwiGLU, with their norms and residuals): h [B, d] -> [B, d];
    kernel: the C++ core (cpu_kernel.fixed_state_step_kernel()), None for the torch ops."""
    x = rms_norm(h, t["mixer_norm"], s.eps[0])
    h = h + (fixed_state_mixer(x, rope, t, s) if kernel is None else fixed_state_mixer_kernel(x, rope, t, s, kernel))
    return _swiglu_residual(h, t["ffn_norm"], s.eps[2], t["w13"], t["w2"])


class _InterdomainLayer:
    """One interdomain (or S4D-only) block's weights, tables and buffers for `slots` rows."""

    def __init__(self, block, slots: int, real_update: bool):
        mixer = block.mixer
        weight = mixer.o_proj.weight
        self.dtype, device = weight.dtype, weight.device
        sdt = _state_dtype(self.dtype)
        H, M, Dh = mixer.log_dt.shape[0], mixer.state_size, mixer.head_dim
        self.M, self.Dh, self.theta = M, Dh, mixer.rope_theta
        self.rope = mixer.rope
        # one input matrix: the convolved projections first (their channels are the conv window's)
        self.convolved = (["q"] if mixer.query_readout else []) + (["k"] if mixer.dual_kv_input else ["a", "b"])
        plain = (["v"] if mixer.dual_kv_input else []) + (["g"] if hasattr(mixer, "g_proj") else [])
        names = self.convolved + plain
        widths = [getattr(mixer, f"{n}_proj").weight.shape[0] for n in names]
        convs = [getattr(mixer, f"{n}_conv") for n in self.convolved]
        self.static = _Static(Dh, mixer.query_readout, mixer.dual_kv_input, mixer.rope, hasattr(mixer, "g_proj"),
                              sum(widths[:len(convs)]),
                              (int(mixer.query_readout) + 1) if mixer.rope else 0,
                              int(mixer.query_readout) + int(mixer.dual_kv_input),
                              (block.mixer_norm.eps, mixer.k_norm.eps, block.ffn_norm.eps), real_update)
        if mixer.k_norm.eps != mixer.v_norm.eps:
            raise FusedDecodeError(f"the key and value norms' eps differ ({mixer.k_norm.eps}, {mixer.v_norm.eps}): "
                                   f"the fused step normalises both at once.")
        t = {"mixer_norm": block.mixer_norm.weight, "ffn_norm": block.ffn_norm.weight,
             "w_in": torch.cat([getattr(mixer, f"{n}_proj").weight for n in names]),
             "conv_w": torch.cat([c.weight[:, 0] for c in convs]),                   # [C, K]
             "conv_b": torch.cat([c.bias for c in convs]),
             "kv_norm": torch.stack([mixer.k_norm.weight, mixer.v_norm.weight])[:, None],   # [2, 1, Dh]
             "kv_bias": torch.stack([mixer.k_bias, mixer.v_bias]), "o_proj": mixer.o_proj.weight,   # [2, H, Dh]
             "w13": torch.cat([block.ffn.w1.weight, block.ffn.w3.weight]), "w2": block.ffn.w2.weight}
        t = {k: v.detach() for k, v in t.items()}
        # the parameter-only tables, built in float64 (as ops/interdomain.recurrent.step_tables)
        log_dt, a_log, a_im, c_re, c_im = (p.detach().double() for p in mixer.core_parameters())
        log_lam, bbar = discretize(log_dt, a_log, a_im)
        cdt = torch.complex128 if sdt == torch.float64 else torch.complex64
        lam, bbar = torch.exp(log_lam)[:, None, :], bbar[:, None, :]                # [H, 1, M]
        t.update(lam=lam.to(cdt), bbar=bbar.to(cdt), lam_re=lam.real.to(sdt), lam_im=lam.imag.to(sdt),
                 bbar_re=bbar.real.to(sdt), bbar_im=bbar.imag.to(sdt))
        # stacked index (Re block, then Im block) of each interleaved one: 2m -> m, 2m+1 -> M+m
        order = torch.stack([torch.arange(M), M + torch.arange(M)], -1).flatten()
        if mixer.query_readout:
            G = readout_gram(c_re, c_im, mixer.readout) * readout_scale(M)
            s = -1.0 if mixer.readout == "hermitian" else 1.0   # p' = conj(p) or p
            # [Re r, -Im r] = [Re p, Im p] G2 in stacked order, then both sides interleaved
            g2 = torch.cat([torch.cat([G.real, -G.imag], -1), torch.cat([-s * G.imag, -s * G.real], -1)], -2)
            t["g2"] = g2[:, order][:, :, order].to(sdt)                                # [H, 2M, 2M]
        else:
            e = contraction_vector(c_re, c_im, mixer.c_vec.detach().double())
            t["e2"] = torch.cat([e.real, -e.imag], -1)[:, order][:, :, None].to(sdt)   # [H, 2M, 1]
        t = {k: v.to(device).contiguous() for k, v in t.items()}   # (.real is a strided view)
        t["conv_tail"] = torch.zeros(slots, self.static.conv_channels, t["conv_w"].shape[-1] - 1, dtype=self.dtype,
                                     device=device)
        t["state"] = torch.zeros(slots, H, 2 * Dh, 2 * M, dtype=sdt, device=device)
        t["complex_state"] = torch.view_as_complex(t["state"].view(slots, H, 2 * Dh, M, 2))   # the same memory
        if real_update:
            del t["complex_state"], t["lam"], t["bbar"]   # (a compiled step is traced without them)
        self.tensors = t

    def load(self, slot: int, state: dict) -> None:
        """A prefill's state of one sequence (the mixer's {'ssm', 'conv', 'pos'}, batch 1)."""
        X = state["ssm"][0].transpose(-1, -2)   # [H, M, P] -> [H, P, M]
        self.tensors["state"][slot] = torch.view_as_real(X).reshape(self.tensors["state"].shape[1:])
        self.tensors["conv_tail"][slot] = torch.cat([state["conv"][f"{n}_conv"][0] for n in self.convolved])

    def clear(self, slot: int) -> None:
        self.tensors["state"][slot].zero_()
        self.tensors["conv_tail"][slot].zero_()

    def move(self, source: int, target: int) -> None:
        self.tensors["state"][target] = self.tensors["state"][source]
        self.tensors["conv_tail"][target] = self.tensors["conv_tail"][source]

    def first(self, n: int) -> dict:
        """The tensors with the per-slot buffers cut to slots 0..n-1 (views: updates land in place)."""
        if n == self.tensors["state"].shape[0]:
            return self.tensors
        return {**self.tensors, **{k: self.tensors[k][:n] for k in ("state", "conv_tail", "complex_state")
                                   if k in self.tensors}}


class _SoftmaxLayer:
    """One softmax (or sliding-window) attention block: a KV cache per slot of `capacity` tokens
    (the window for W layers, written as a ring: attention does not care about the order of
    its keys, and RoPE is applied before they are cached)."""

    def __init__(self, block, slots: int, capacity: int | None):
        mixer = block.mixer
        weight = mixer.o_proj.weight
        self.dtype, device = weight.dtype, weight.device
        self.Dh, self.rope, self.theta, self.window = mixer.head_dim, mixer.rope, mixer.rope_theta, mixer.window
        self.w_in = torch.cat([mixer.q_proj.weight, mixer.k_proj.weight, mixer.v_proj.weight]).detach()
        self.o_proj = mixer.o_proj.weight.detach()
        self.norms = (block.mixer_norm.weight.detach(), block.mixer_norm.eps, block.ffn_norm.weight.detach(),
                      block.ffn_norm.eps)
        self.w13 = torch.cat([block.ffn.w1.weight, block.ffn.w3.weight]).detach()
        self.w2 = block.ffn.w2.weight.detach()
        if self.window is not None:
            capacity = self.window
        if capacity is None:
            raise FusedDecodeError("a softmax layer's KV cache needs a capacity: give the most tokens a "
                                   "sequence reaches (prompt + new tokens).")
        self.capacity = capacity
        H = weight.shape[1] // self.Dh
        self.k = torch.zeros(slots, H, capacity, self.Dh, dtype=self.dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def load(self, slot: int, state: dict) -> None:
        k, v, pos = state["k"][0], state["v"][0], state["pos"]   # [L, H, Dh]: the last L of pos tokens
        L = k.shape[0]
        if L > self.capacity:
            raise FusedDecodeError(f"a prefix of {pos} tokens does not fit a KV cache of {self.capacity}: "
                                   f"give a larger capacity.")
        where = torch.arange(pos - L, pos, device=k.device) % self.capacity
        self.k[slot, :, where] = k.transpose(0, 1)
        self.v[slot, :, where] = v.transpose(0, 1)

    def clear(self, slot: int) -> None:
        pass   # the lengths decide which keys are seen; stale ones are overwritten first

    def move(self, source: int, target: int) -> None:
        self.k[target] = self.k[source]
        self.v[target] = self.v[source]

    def __call__(self, h, rope, positions, lengths: list[int]):
        """The whole block: h [B, d] -> [B, d]."""
        mixer_norm, mixer_eps, ffn_norm, ffn_eps = self.norms
        h = h + self.mixer(rms_norm(h, mixer_norm, mixer_eps), rope, positions, lengths)
        return _swiglu_residual(h, ffn_norm, ffn_eps, self.w13, self.w2)

    def mixer(self, x, rope, positions, lengths: list[int]):
        """x [B, d] (normalised) -> the attention's output [B, d]; positions [B] (this token's);
        lengths: keys each row sees after this token (host ints: no device sync per step)."""
        B = x.shape[0]
        q, k, v = (x @ self.w_in.T).view(B, 3, -1, self.Dh).unbind(1)              # [B, H, Dh]
        if self.rope:
            q, k = _rope(q, *rope), _rope(k, *rope)
        where = positions % self.capacity
        rows = torch.arange(B, device=x.device)
        self.k[rows, :, where] = k
        self.v[rows, :, where] = v
        L = max(lengths)
        mask = None
        if min(lengths) != L:
            mask = (torch.arange(L, device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None])
            mask = mask[:, None, None, :]
        o = F.scaled_dot_product_attention(q[:, :, None], self.k[:B, :, :L], self.v[:B, :, :L], attn_mask=mask)
        return o.reshape(B, -1) @ self.o_proj.T


class FusedDecoder:
    """Decode `slots` sequences at once with the fused step.

        decoder = FusedDecoder(model, slots=8, capacity=4096)
        logits, states = model(prompt, return_states=True)      # prefill (chunked), batch 1
        decoder.load(0, states, position=len(prompt))
        logits = decoder.step(tokens)                            # [slots] -> [slots, V]

    A step advances slots 0..n-1 (n = len(tokens)); the others wait, at no cost. `move` copies a
    sequence to another slot, so that a scheduler can keep the running ones first.
    capacity: the most tokens (prompt + generated) a sequence may reach, for the KV caches of
    softmax layers (hybrids); fixed-state models need none. compile: the interdomain / S4D-only
    blocks through torch.compile (one compiled function for all of them; the first step
    compiles, seconds to a minute). kernel: how the interdomain / S4D-only core runs: "cpp" one
    C++ call per layer (inference/cpu_kernel.py; CPU, float32/float64, built on first use),
    "torch" the torch ops, "auto" (the default) "cpp" where it applies and builds, else "torch";
    `self.kernel` says which was taken."""

    KERNELS = ("auto", "cpp", "torch")

    def __init__(self, model, slots: int = 1, capacity: int | None = None, compile: bool = False,
                 kernel: str = "auto"):
        if slots < 1:
            raise FusedDecodeError(f"slots={slots}: at least 1.")
        if kernel not in self.KERNELS:
            raise FusedDecodeError(f"kernel={kernel!r}: one of {', '.join(self.KERNELS)}.")
        why = fused_decode_refusal(model)
        if why:
            raise FusedDecodeError(f"{why}: decode this model with the model's own step (decode='eager').")
        self.slots, self.capacity = slots, capacity
        device = model.lm_head.weight.device
        if capacity is not None:   # before allocating (serve names its own options earlier)
            check_kv_pool(model, slots, capacity, device, f"{slots} sequence(s) of up to {capacity:,} tokens (prompt "
                          f"+ new tokens)", "Ask for fewer tokens (--max-new-tokens) or fewer sequences at once "
                          "(--batch-size)")
        self.layers = [_SoftmaxLayer(block, slots, capacity) if isinstance(block.mixer, SoftmaxAttention)
                       else _InterdomainLayer(block, slots, real_update=compile) for block in model.layers]
        self.block = torch.compile(fixed_state_block, dynamic=False) if compile else fixed_state_block
        self.core, self.kernel = self._kernel(kernel, device, model.lm_head.weight.dtype, compile)
        # RoPE's inverse frequencies, one table per (head dim, theta) in use
        self.rope_tables = {}
        for layer in self.layers:
            if layer.rope:
                dtype = torch.promote_types(layer.dtype, torch.float32)
                self.rope_tables[(layer.Dh, layer.theta)] = layer.theta ** (
                    -torch.arange(0, layer.Dh, 2, device=device, dtype=dtype) / layer.Dh)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        self.lengths = [0] * slots      # host copy of positions (no device sync per step)
        self.embed, self.lm_head = model.embed.weight.detach(), model.lm_head.weight.detach()
        self.norm_w, self.norm_eps = model.norm.weight.detach(), model.norm.eps
        self.unbounded = any(isinstance(layer, _SoftmaxLayer) and layer.window is None for layer in self.layers)

    def _kernel(self, wanted: str, device, dtype, compile: bool):
        """(the C++ core or None, "cpp" or "torch") for kernel=`wanted`."""
        if wanted == "torch" or not any(isinstance(layer, _InterdomainLayer) for layer in self.layers):
            return None, "torch"
        why = ("compile=True runs the torch ops through torch.compile" if compile else
               f"the model is on {device.type}, not the CPU" if device.type != "cpu" else
               f"the model is {dtype}, not float32 or float64" if dtype not in (torch.float32, torch.float64)
               else None)
        if why is None:
            from .cpu_kernel import fixed_state_step_kernel
            core = fixed_state_step_kernel()
            if core is not None:
                return core, "cpp"
            why = "the C++ kernel could not be built (the warning above says why)"
        if wanted == "cpp":
            raise FusedDecodeError(f"kernel='cpp' is not available here: {why}; use kernel='auto' or 'torch'.")
        return None, "torch"

    def load(self, slot: int, states: list, position: int) -> None:
        """Put a prefilled sequence into `slot`: `states` from model(prompt, return_states=True)
        (batch 1), `position` the tokens it holds."""
        if not 0 <= slot < self.slots:
            raise FusedDecodeError(f"slot {slot}: this decoder has slots 0 to {self.slots - 1}.")
        if len(states) != len(self.layers):
            raise FusedDecodeError(f"{len(states)} layer states for a model of {len(self.layers)} layers.")
        if self.unbounded and position >= self.capacity:
            raise FusedDecodeError(f"a prefix of {position} tokens leaves no room in a KV cache of "
                                   f"{self.capacity} tokens: give a larger capacity.")
        for i, (layer, state) in enumerate(zip(self.layers, states)):
            wanted = {"k", "v"} if isinstance(layer, _SoftmaxLayer) else {"ssm", "conv"}
            if not isinstance(state, dict) or not wanted <= set(state):
                got = sorted(state) if isinstance(state, dict) else type(state).__name__
                raise FusedDecodeError(f"layer {i}'s state has {got}, not the {sorted(wanted)} of its "
                                       f"{type(layer).__name__.strip('_').replace('Layer', '').lower()} mixer: "
                                       f"the states of another model?")
        with torch.no_grad():
            for layer, state in zip(self.layers, states):
                layer.load(slot, state)
        self.positions[slot] = position
        self.lengths[slot] = position

    def clear(self, slot: int) -> None:
        """Empty `slot` (its states zeroed, its position 0) for the next sequence."""
        for layer in self.layers:
            layer.clear(slot)
        self.positions[slot] = 0
        self.lengths[slot] = 0

    def move(self, source: int, target: int) -> None:
        """Copy slot `source`'s sequence into slot `target` (continuous batching keeps the running
        sequences in the first slots, so that a step computes only those)."""
        with torch.no_grad():
            for layer in self.layers:
                layer.move(source, target)
        self.positions[target] = self.positions[source]
        self.lengths[target] = self.lengths[source]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [n] (the next input token of slots 0..n-1, n <= slots) -> logits [n, V] after them.
        The other slots are left as they are (and cost nothing)."""
        n = tokens.shape[0] if tokens.dim() == 1 else 0
        if not 1 <= n <= self.slots:
            raise FusedDecodeError(f"step takes one token for each of the first n slots: shape (n,) with n from "
                                   f"1 to {self.slots}, not {tuple(tokens.shape)}.")
        if self.unbounded and max(self.lengths[:n]) >= self.capacity:
            raise FusedDecodeError(f"a sequence reached the KV cache's capacity of {self.capacity} tokens.")
        positions = self.positions[:n]
        rope = {}
        for (Dh, theta), inv_freq in self.rope_tables.items():
            angles = positions.to(inv_freq.dtype)[:, None] * inv_freq                # [n, D/2]
            rope[(Dh, theta)] = (angles.cos()[:, None, :], angles.sin()[:, None, :])
        lengths = [length + 1 for length in self.lengths[:n]]
        h = self.embed[tokens]
        for layer in self.layers:
            angles = rope.get((layer.Dh, layer.theta)) if layer.rope else None
            if isinstance(layer, _SoftmaxLayer):
                seen = lengths if layer.window is None else [min(m, layer.window) for m in lengths]
                h = layer(h, angles, positions, seen)
            else:
                h = self.block(h, angles, layer.first(n), layer.static, self.core)
        positions += 1
        self.lengths[:n] = lengths
        return rms_norm(h, self.norm_w, self.norm_eps) @ self.lm_head.T


def fused_decode_refusal(model) -> str | None:
    """Why `model` has no fused decode step (None: it has one)."""
    for i, block in enumerate(model.layers):
        if not isinstance(block.mixer, (InterdomainMixer, SoftmaxAttention)):
            return f"layer {i}'s mixer ({type(block.mixer).__name__}) has no fused decode step"
    return None
