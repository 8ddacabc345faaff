"""The interdomain mixer (and, with both ingredients switched off, the S4D-only control).

Per block (d = width, H heads, Dh = d/H, R = Dh, M modes; spec: shared/docs/interdomain-attention.md):

    q = SC(x W_Q)                      k = SC(x W_K), v = x W_V          (dual_kv_input)
                                       a = SC(x W_a), b = SC(x W_b)      (single input)
    heads; RoPE on q and on k (or a) when `rope`
    q' = xi(q);  k~ = RMSNorm_k(xi(k) or a) + b_k[h];  v~ = RMSNorm_v(v or b) + b_v[h]
    o  = core(q', k~, v~)              the complex S4D state and its readout (ops/interdomain)
    o <- o * SiLU(x W_g)               (output_gate)
    y  = o W_O                         W_O is 2d x d for the linear contraction readout

Parameters of the core per head: log_dt (Delta), a_log/a_im (A), c_re/c_im (C), and c_vec
(the contraction vector c_h, only without query readout). The RMSNorm weights are shared by
all heads, the biases are per head [our choice: it reproduces the paper's parameter counts].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.interdomain import FORMS, recurrent_interdomain, step_tables
from ...ops.interdomain.chunked import (
    block_end_state,
    block_transition,
    chunk_tables,
    core_step,
    recomputes,
    segment_tokens,
)
from ...ops.interdomain.ssm import (
    contraction_vector,
    discretize,
    document_starts,
    readout_gram,
    readout_scale,
    s4d_inv_init,
)
from ...ops.segments import run_in_segments
from ..layers import (
    Linear,
    RMSNorm,
    ShortConv,
    apply_rope,
    feature_map,
    last_document_only,
    left_padding,
    rms_norm,
    short_conv,
)
from ..roles import COLUMN_PARALLEL, ROW_PARALLEL, SSM_PER_HEAD, SSM_SHARED_NORM, WITH_HEADS
from ..rope import Rope
from ..spec import mixer_module
from .decode import DecodeFacts, FixedStateStatic, fixed_state_step, state_dtype


@mixer_module("interdomain", "s4d")   # s4d: this module with both ingredients switched off
class InterdomainMixer(nn.Module):
    # Every parameter's role (model/roles.py); the init of the own ones is initial_value below.
    # Under TP each rank keeps H / TP contiguous heads: the projections into heads are
    # column-parallel (their outputs are head-major), everything per head is cut with its heads.
    PARAMETER_ROLES = {
        "q_proj": COLUMN_PARALLEL, "k_proj": COLUMN_PARALLEL, "v_proj": COLUMN_PARALLEL,
        "a_proj": COLUMN_PARALLEL, "b_proj": COLUMN_PARALLEL, "g_proj": COLUMN_PARALLEL,
        # its input is [Re c.U, Re c.Gam] per head for the contraction readout: heads stay contiguous
        "o_proj": ROW_PARALLEL,
        "q_conv": WITH_HEADS, "k_conv": WITH_HEADS, "a_conv": WITH_HEADS, "b_conv": WITH_HEADS,
        # the SSM's own parameters (optimizer group ssm): Delta, A, C, c_h and the input biases
        # per head; the input norms are shared by all heads, so their grads are summed over TP
        "log_dt": SSM_PER_HEAD, "a_log": SSM_PER_HEAD, "a_im": SSM_PER_HEAD,
        "c_re": SSM_PER_HEAD, "c_im": SSM_PER_HEAD, "c_vec": SSM_PER_HEAD,
        "k_bias": SSM_PER_HEAD, "v_bias": SSM_PER_HEAD,
        "k_norm": SSM_SHARED_NORM, "v_norm": SSM_SHARED_NORM,
    }

    # What the accounting reads (model/accounting.py; docs/adding-a-mixer.md): the core's
    # multiply-adds per token beyond the projections and convs, and the decode state.
    @staticmethod
    def core_macs_per_token(cfg, context: int) -> int:
        """What the chunked form executes (chunk T = chunk_size, including the masked upper
        triangles of its T x T blocks); complex x real counts 2 real multiply-adds, complex x
        complex 4. Independent of the context."""
        T, M = cfg.chunk_size, cfg.state_size
        R = Dv = cfg.d_model // cfg.n_heads
        P = R + Dv
        macs = 2 * M * P + 4 * M * P // T          # chunk's state contribution; carry (per chunk / T)
        if cfg.query_readout:
            macs += 2 * M * R + T * R + 2 * T * M  # p from the entering state; q.k scores; p within chunk
            macs += 4 * M * M                      # r = p' G
            macs += 2 * M * Dv + 2 * T * M + T * Dv  # o from the entering state; Re(W); W v
        else:
            macs += 2 * M * P + T * P              # Re(e^T X) from the entering state; S4D kernel
        return cfg.n_heads * macs

    @staticmethod
    def decode_state_numbers(cfg) -> tuple[int, int]:
        """(fixed, per token of context): real numbers a layer keeps to continue a sequence
        (short-conv tails aside): the complex state [H, M, 2 Dh], whatever the context."""
        return cfg.n_heads * 2 * (2 * (cfg.d_model // cfg.n_heads)) * cfg.state_size, 0

    def __init__(self, cfg, residual_std: float, form: str = "chunked"):
        super().__init__()
        d, H, M = cfg.d_model, cfg.n_heads, cfg.state_size
        self.head_dim, self.state_size = d // H, M
        self.query_readout, self.dual_kv_input = cfg.query_readout, cfg.dual_kv_input
        self.rope, self.rope_spec, self.readout = cfg.rope, Rope.of(cfg), cfg.readout.value
        self.chunk_size, self.form = cfg.chunk_size, form
        self.context_parallel = None   # parallel/context_parallel.py sets it: this rank runs one block
        self.core_impl = cfg.core_impl.value
        std, K, Dh = cfg.init_std, cfg.conv_kernel, d // H
        self.conv_kernel = K

        if self.query_readout:
            self.q_proj, self.q_conv = Linear(d, d, std), ShortConv(d, K)
        if self.dual_kv_input:
            self.k_proj, self.k_conv, self.v_proj = Linear(d, d, std), ShortConv(d, K), Linear(d, d, std)
        else:
            self.a_proj, self.a_conv = Linear(d, d, std), ShortConv(d, K)
            self.b_proj, self.b_conv = Linear(d, d, std), ShortConv(d, K)
        self.k_norm, self.v_norm = RMSNorm(Dh, cfg.norm_eps), RMSNorm(Dh, cfg.norm_eps)
        self.k_bias, self.v_bias = nn.Parameter(torch.zeros(H, Dh)), nn.Parameter(torch.zeros(H, Dh))
        self.log_dt = nn.Parameter(torch.zeros(H))
        self.dt_range = (cfg.dt_min, cfg.dt_max)
        self.a_log, self.a_im = nn.Parameter(torch.zeros(H, M)), nn.Parameter(torch.zeros(H, M))
        self.c_re, self.c_im = nn.Parameter(torch.zeros(H, M, M)), nn.Parameter(torch.zeros(H, M, M))
        out_width = d if self.query_readout else 2 * d   # contraction emits [Re c.U, Re c.Gam] per head
        if not self.query_readout:
            self.c_vec = nn.Parameter(torch.zeros(H, M))
        if cfg.output_gate:
            self.g_proj = Linear(d, out_width, std)
        self.o_proj = Linear(out_width, d, residual_std)

    def initial_value(self, name, shape, generator):
        """Full-size values from `shape` (all heads), so that a tensor-parallel shard can draw
        the full tensor and keep its heads."""
        if name == "log_dt":
            u = torch.rand(shape, generator=generator, dtype=torch.float64)
            low, high = map(math.log, self.dt_range)
            return (low + u * (high - low)).float()
        if name in ("a_log", "a_im"):
            return s4d_inv_init(*shape)[0 if name == "a_log" else 1].float()
        if name == "c_re":   # C = identity at init [our choice]
            return torch.eye(shape[-1]).expand(shape).clone()
        if name == "c_vec":  # contraction vector c_h ~ N(0, 1/M) [our choice]
            return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
        return torch.zeros(shape)   # c_im, k_bias, v_bias

    def core_parameters(self):
        """Arguments of the ops/interdomain forms that are parameters."""
        return self.log_dt, self.a_log, self.a_im, self.c_re, self.c_im

    def _heads(self, x):   # -1 heads: the same code runs on a tensor-parallel shard's heads
        return x.view(*x.shape[:2], -1, self.head_dim)

    FEATURE_PARAMETERS = ("q_conv.weight", "q_conv.bias", "k_conv.weight", "k_conv.bias",
                          "a_conv.weight", "a_conv.bias", "b_conv.weight", "b_conv.bias",
                          "k_norm.weight", "v_norm.weight", "k_bias", "v_bias")

    def feature_parameters(self) -> dict:
        """The parameters between the projections and the core, by name (those this cell has)."""
        own = dict(self.named_parameters())
        return {name: own[name] for name in self.FEATURE_PARAMETERS if name in own}

    def _features(self, x_q, x_k, x_v, conv_in, conv_out, rope_offset, real, params=None, starts=None):
        """The core's inputs from the projections: short convs, RoPE, feature maps, norms and
        biases. conv_out receives the convs' states (for generation). `params` (by name, as
        feature_parameters) replaces the module's own: the recomputing backward's leaves.
        starts [B, N] bool: packed documents (the convs do not reach across a start);
        rope_offset may be [B, N] positions (position ids that restart per document)."""
        # Without `params` the submodules are called, so that their hooks run (ZeRO-3 gathers
        # their partitioned weights in them).
        def only_real(y):   # where(), not a product: nothing computed at a pad can leak
            return y if real is None else torch.where(real.view(*real.shape, *[1] * (y.dim() - 3)), y, 0)

        def conv(name, y):
            if params is None:
                y, conv_out[name] = getattr(self, name)(only_real(y), conv_in.get(name), starts)
            else:
                y, conv_out[name] = short_conv(only_real(y), params[f"{name}.weight"],
                                               params[f"{name}.bias"], conv_in.get(name), starts)
            return self._heads(y)

        def norm(name, y):
            if params is None:
                return getattr(self, name)(y)
            return rms_norm(y, params[f"{name}.weight"], getattr(self, name).eps)

        P = params if params is not None else {"k_bias": self.k_bias, "v_bias": self.v_bias}

        if self.dual_kv_input:
            key, value = conv("k_conv", x_k), self._heads(x_v)
        else:
            key, value = conv("a_conv", x_k), conv("b_conv", x_v)
        if self.rope:
            key = apply_rope(key, rope_offset, self.rope_spec)
        if self.dual_kv_input:
            key = feature_map(key)
        key = only_real(norm("k_norm", key) + P["k_bias"])
        value = only_real(norm("v_norm", value) + P["v_bias"])
        query = None
        if self.query_readout:
            query = conv("q_conv", x_q)
            if self.rope:
                query = apply_rope(query, rope_offset, self.rope_spec)
            query = feature_map(query)
        return query, key, value

    def forward(self, x, state=None, return_state=False, start=None, seq_idx=None, position_ids=None):
        """x [B, N, d]. state {'ssm': [B, H, M, P] complex, 'conv': {...}, 'pos': int} or None.
        start [B] or None: left padding, each row's first real position (counted like 'pos').
        Padded positions leave no trace: their conv inputs, keys and values are zero, so the
        state a row reaches is the one it would reach alone (the update is linear in [k, v]),
        and RoPE counts each row's positions from its first real token.
        seq_idx [B, N] (packed documents, data.reset_attention_mask): the state and the convs
        restart at every document; position_ids [B, N] (data.reset_position_ids): RoPE's."""
        pos = state["pos"] if state else 0
        conv_in = state["conv"] if state else {}
        conv_out = {}
        rope_offset, real = pos, None
        if start is not None:
            real, rope_offset = left_padding(start, pos, x.shape[1])
            real = real[..., None]   # [B, N, 1]: broadcasts over channels
        if position_ids is not None:
            rope_offset = position_ids
        starts = document_starts(seq_idx)

        projected = (self.q_proj(x) if self.query_readout else None,
                     *((self.k_proj(x), self.v_proj(x)) if self.dual_kv_input else
                       (self.a_proj(x), self.b_proj(x))))
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or self.o_proj.weight.requires_grad)
        # (ZeRO-3 partitions parameters and gathers them in each submodule's hooks, which the
        # segments' functional calls bypass: there only the core recomputes, see _core)
        zero3 = hasattr(self.o_proj.weight, "ds_id")
        if self.context_parallel is not None and start is None:   # (data.carry_state: with a state)
            o, ssm = self._context_parallel_core(projected, seq_idx, starts, position_ids, state,
                                                 conv_out if return_state else None)
        elif state is None and start is None and not return_state and self.form == "chunked" and \
                not zero3 and recomputes(self.core_impl, x.shape[1], wants_grad, x):
            o = self._recomputed_core(projected, starts, position_ids)
            ssm = None
        else:
            query, key, value = self._features(*projected, conv_in, conv_out, rope_offset, real, starts=starts)
            o, ssm = self._core(query, key, value, state, return_state, seq_idx)
        o = o.reshape(*x.shape[:2], -1).to(x.dtype)
        if hasattr(self, "g_proj"):
            o = o * F.silu(self.g_proj(x))
        y = self.o_proj(o)
        if not return_state:
            return y
        return y, {"ssm": ssm, "conv": conv_out, "pos": pos + x.shape[1],
                   "tables": state.get("tables") if state else None}

    def _context_parallel_core(self, projected, seq_idx, starts, position_ids, state=None, conv_out=None):
        """This rank's block of a sequence split over the context-parallel group
        (parallel/context_parallel.py): the convs read the previous block's last K-1 inputs, the
        core starts from the state the earlier blocks leave (their end states, combined).
        `state`: what enters the first block (the previous window's, data.carry_state); with
        conv_out, returns the state after the last block, and conv_out receives the last
        block's conv tails (both the same on every rank). Returns (o, that state or None)."""
        cp = self.context_parallel
        block = projected[1].shape[1]
        fresh = cp.fresh_start(seq_idx)   # a document begins at this block's first token
        names = ((("q_conv",) if self.query_readout else ())
                 + (("k_conv",) if self.dual_kv_input else ("a_conv", "b_conv")))
        inputs = ([projected[0]] if self.query_readout else []) + list(projected[1:2 if self.dual_kv_input else 3])
        # [B, 1, K-1]: which of the previous block's last K-1 tokens are in this block's first
        # document (seq_idx counts documents over the whole sample: an equal id is the same one;
        # counts below 2^24 are exact in the float32 the gather carries)
        same_document = None
        if seq_idx is not None:
            before = cp.previous_tail(seq_idx[..., None].float(), self.conv_kernel - 1)[..., 0]
            same_document = (before == seq_idx[:, :1].float()).to(projected[1].dtype)[:, None, :]
        conv_in, width = {}, self.conv_kernel - 1
        last_documents = None   # [B, K-1]: the document ids of the sequence's last K-1 tokens
        if conv_out is not None and seq_idx is not None:
            last_documents = cp.last_tail(seq_idx[..., None].float(), width)[..., 0]
        for name, x in zip(names, inputs):
            tail = cp.previous_tail(x, width).transpose(1, 2)   # [B, C, K-1], the conv's state
            if state is not None:   # the first block continues the previous window (a weight, not a
                # branch on the rank: every rank's backward graph alike, see incoming_state)
                tail = tail + float(cp.rank == 0) * state["conv"][name].to(tail.dtype)
            conv_in[name] = tail if same_document is None else tail * same_document
            if conv_out is not None:   # the whole sequence's tail
                last = cp.last_tail(x, width).transpose(1, 2)
                conv_out[name] = last if last_documents is None else last_document_only(last, last_documents)
        pos = state["pos"] if state else 0
        rope_offset = pos + cp.rank * block if position_ids is None else position_ids
        query, key, value = self._features(*projected, conv_in, {}, rope_offset, None, starts=starts)
        log_dt, a_log, a_im = self.core_parameters()[:3]
        end = block_end_state(key, value, log_dt, a_log, a_im, chunk_size=self.chunk_size, seq_idx=seq_idx)
        survives = None
        if seq_idx is not None:   # the state entering this block reaches its end: no start in it
            survives = ((seq_idx == seq_idx[:, :1]).all(dim=1) & ~fresh).to(end.real.dtype)
        initial = None if state is None else state["ssm"]
        incoming = cp.incoming_state(end, block_transition(log_dt, a_log, a_im, block), survives, initial,
                                     final=conv_out is not None)
        incoming, final = incoming if conv_out is not None else (incoming, None)
        if fresh is not None:
            incoming = incoming * (~fresh).to(incoming.real.dtype)[:, None, None, None]
        o, _ = self._core(query, key, value, {"ssm": incoming}, False, seq_idx)
        return o, final

    def _recomputed_core(self, projected, starts=None, position_ids=None):
        """Features and core from the projections, segment by segment, keeping only the
        projections and each segment's entering state for the backward (ops/segments.py):
        at 16K tokens and 125M width the layer then holds less than causal attention does
        (benchmarks/core_memory.py). Same numbers as _features + _core (tests)."""
        features = self.feature_parameters()
        work = torch.float64 if projected[1].dtype == torch.float64 else torch.float32
        with torch.autocast(device_type=projected[1].device.type, enabled=False):
            tab = chunk_tables(*self.core_parameters(), readout=self.readout,
                               c_vec=getattr(self, "c_vec", None), chunk_size=self.chunk_size, dtype=work)
        names, n_features = tuple(tab), len(features)
        core = core_step(names, self.chunk_size)

        def step(params, window, lo, window_lo, state):
            x_q, x_k, x_v, w_starts, w_positions = window
            query, key, value = self._features(x_q, x_k, x_v, {}, {}, window_lo if w_positions is None else w_positions,
                                               None, params=dict(zip(features, params[:n_features])),
                                               starts=w_starts)
            trim = lo - window_lo   # the halo: tokens the convs needed, not outputs of this segment
            core_in = [None if t is None else t[:, trim:].to(work) for t in (query, key, value)]
            core_in.append(None if w_starts is None else w_starts[:, trim:])
            with torch.autocast(device_type=key.device.type, enabled=False):
                return core(params[n_features:], core_in, lo, lo, state)

        B, H = projected[1].shape[0], self.log_dt.shape[0]
        width = 2 * self.head_dim   # P = R + Dv
        start = projected[1].new_zeros(B, H, 2 * self.state_size, width, dtype=work)
        out, _ = run_in_segments(step, [*features.values(), *tab.values()], [*projected, starts, position_ids], start,
                                 segment_tokens=segment_tokens(self.chunk_size),
                                 halo=self.conv_kernel - 1)
        return out

    def _core(self, query, key, value, state, return_state, seq_idx=None):
        kwargs = dict(readout=self.readout, c_vec=getattr(self, "c_vec", None),
                      initial_state=state["ssm"] if state else None, output_final_state=return_state)
        if seq_idx is not None:
            kwargs["seq_idx"] = seq_idx
        if key.shape[1] == 1 and state:   # decode: reuse the parameter-only tables across tokens
            if state.get("tables") is None:
                state["tables"] = step_tables(*self.core_parameters(), readout=self.readout,
                                              c_vec=kwargs["c_vec"], dtype=key.dtype)
            return recurrent_interdomain(query, key, value, *self.core_parameters(),
                                         tables=state["tables"], **kwargs)
        if self.form == "chunked":
            kwargs.update(chunk_size=self.chunk_size, backward=self.core_impl)
        return FORMS[self.form](query, key, value, *self.core_parameters(), **kwargs)

    # The decode interface (model/mixers/decode.py): inference/fused_decode.py decodes N slots
    # through these alone. The per-slot state is decode.py's real layout of the complex state.
    decode_step = staticmethod(fixed_state_step)

    def _decode_convolved(self) -> list[str]:
        """The projections through a short conv, in the order of the decode step's stack."""
        return (["q"] if self.query_readout else []) + (["k"] if self.dual_kv_input else ["a", "b"])

    def decode_facts(self) -> DecodeFacts:
        return DecodeFacts("interdomain", ("ssm", "conv"), fixed_size=True, needs_capacity=False,
                           rope=(self.head_dim, self.rope_spec) if self.rope else None)

    def decode_tables(self, real_update: bool = False) -> tuple[dict, FixedStateStatic]:
        """The step's parameter-only tensors: one input matrix [q | k | v | g] (the convolved
        projections first: their channels are the conv window's), the convs' taps, the norms and
        biases of k and v, W_O, and the core's tables built in float64 (as ops/interdomain's
        step_tables): lambda and Bbar, and G2 (query readout) or e2 (contraction).
        real_update: for torch.compile, without the complex tables."""
        weight = self.o_proj.weight
        device, sdt = weight.device, state_dtype(weight.dtype)
        M, Dh = self.state_size, self.head_dim
        convolved = self._decode_convolved()
        names = convolved + (["v"] if self.dual_kv_input else []) + (["g"] if hasattr(self, "g_proj") else [])
        widths = [getattr(self, f"{n}_proj").weight.shape[0] for n in names]
        convs = [getattr(self, f"{n}_conv") for n in convolved]
        static = FixedStateStatic(Dh, self.query_readout, self.dual_kv_input, self.rope, hasattr(self, "g_proj"),
                                  sum(widths[:len(convs)]), (int(self.query_readout) + 1) if self.rope else 0,
                                  int(self.query_readout) + int(self.dual_kv_input), self.k_norm.eps, real_update)
        if self.k_norm.eps != self.v_norm.eps:
            raise ValueError(f"the key and value norms' eps differ ({self.k_norm.eps}, {self.v_norm.eps}): "
                             f"the fused step normalises both at once.")
        t = {"w_in": torch.cat([getattr(self, f"{n}_proj").weight for n in names]),
             "conv_w": torch.cat([c.weight[:, 0] for c in convs]),                   # [C, K]
             "conv_b": torch.cat([c.bias for c in convs]),
             "kv_norm": torch.stack([self.k_norm.weight, self.v_norm.weight])[:, None],   # [2, 1, Dh]
             "kv_bias": torch.stack([self.k_bias, self.v_bias]), "o_proj": weight}       # [2, H, Dh]
        t = {k: v.detach() for k, v in t.items()}
        log_dt, a_log, a_im, c_re, c_im = (p.detach().double() for p in self.core_parameters())
        log_lam, bbar = discretize(log_dt, a_log, a_im)
        cdt = torch.complex128 if sdt == torch.float64 else torch.complex64
        lam, bbar = torch.exp(log_lam)[:, None, :], bbar[:, None, :]                # [H, 1, M]
        t.update(lam=lam.to(cdt), bbar=bbar.to(cdt), lam_re=lam.real.to(sdt), lam_im=lam.imag.to(sdt),
                 bbar_re=bbar.real.to(sdt), bbar_im=bbar.imag.to(sdt))
        # stacked index (Re block, then Im block) of each interleaved one: 2m -> m, 2m+1 -> M+m
        order = torch.stack([torch.arange(M), M + torch.arange(M)], -1).flatten()
        if self.query_readout:
            G = readout_gram(c_re, c_im, self.readout) * readout_scale(M)
            s = -1.0 if self.readout == "hermitian" else 1.0   # p' = conj(p) or p
            # [Re r, -Im r] = [Re p, Im p] G2 in stacked order, then both sides interleaved
            g2 = torch.cat([torch.cat([G.real, -G.imag], -1), torch.cat([-s * G.imag, -s * G.real], -1)], -2)
            t["g2"] = g2[:, order][:, :, order].to(sdt)                                # [H, 2M, 2M]
        else:
            e = contraction_vector(c_re, c_im, self.c_vec.detach().double())
            t["e2"] = torch.cat([e.real, -e.imag], -1)[:, order][:, :, None].to(sdt)   # [H, 2M, 1]
        t = {k: v.to(device).contiguous() for k, v in t.items()}   # (.real is a strided view)
        if real_update:
            del t["lam"], t["bbar"]   # (a compiled step is traced without complex tensors)
        return t, static

    def allocate_decode_state(self, n_slots: int, capacity: int | None = None, device=None) -> dict:
        """Per slot, zeroed: the convs' tails [C, K-1] and the state [H, 2 Dh, 2M] (real numbers,
        float32 or float64: decode.state_dtype). capacity: not needed (a fixed size)."""
        weight = self.o_proj.weight
        device = weight.device if device is None else device
        convs = [getattr(self, f"{n}_conv") for n in self._decode_convolved()]
        channels, taps = sum(c.weight.shape[0] for c in convs), convs[0].weight.shape[-1]
        H, M, Dh = self.log_dt.shape[0], self.state_size, self.head_dim
        return {"conv_tail": torch.zeros(n_slots, channels, taps - 1, dtype=weight.dtype, device=device),
                "state": torch.zeros(n_slots, H, 2 * Dh, 2 * M, dtype=state_dtype(weight.dtype), device=device)}

    def load_decode_state(self, buffers: dict, slot: int, state: dict) -> None:
        """forward's state of one sequence ({'ssm', 'conv', 'pos'}, batch 1) into `slot`."""
        X = state["ssm"][0].transpose(-1, -2)   # [H, M, P] -> [H, P, M]
        buffers["state"][slot] = torch.view_as_real(X).reshape(buffers["state"].shape[1:])
        buffers["conv_tail"][slot] = torch.cat([state["conv"][f"{n}_conv"][0] for n in self._decode_convolved()])
