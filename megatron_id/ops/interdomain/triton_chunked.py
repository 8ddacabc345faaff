"""The chunked interdomain / S4D core as Triton kernels: forward and backward, for CUDA.

The algorithm and the parameter-only tables are chunked.py's (`chunk_tables`, `_segment`, read
that docstring first); the kernels fuse what the PyTorch form does in many small launches.
Following flash-linear-attention's chunk kernels (Yang et al.; chunk_fwd_h / chunk_fwd_o /
chunk_bwd_dh / chunk_bwd_dv / chunk_bwd_dqkwg), the work is split so that no kernel holds
more than a few [64, 64] tiles at once (the budget is the GPU's shared memory per block:
232,448 B on H100/H200, 166,912 B on A100; resources.py checks every kernel against it):

  * sequential walks over the chunks, one program per (batch, head, block of modes, block of
    state columns): modes never mix in the carry, so blocking over M as well as D gives a
    1.3B micro-batch (B 1, H 32) hundreds of programs.
        _walk_forward    S_{c+1} = lambda^T (.) S_c + add_in @ z_c          (writes every S_c)
        _walk_backward   G_c = local_c + conj(lambda^T) (.) G_{c+1}          (elementwise only)
    where G_c = dL/dS_c and local_c is dL/dS_c through chunk c's own outputs.
  * fully parallel kernels over (batch, head, chunk), each recomputing what it needs of the
    chunk from its entering state instead of storing it:
        _query_forward       the query readout's outputs
        _query_backward_dv   value side: dv, dS_v (local), du, d weights -> dr (stored)
        _query_backward_dq   query side from dr: dq, dk, dS_k (local), d scores, da
        _contraction_forward / _contraction_backward   the S4D (linear contraction) readout
        _carry_backward      what the carry adds: dz_c += add_in^T G_{c+1}, d add_in, d lambda^T
    Key and value widths (R, Dv) are looped over in blocks of COLUMN_BLOCK columns, so a
    wider head (760M: 96) costs more steps, not more shared memory.
The intra-chunk sums over j are matmuls with the lag kernel K [T, 2M] after the [T, T] scores
are re-indexed by lag (chunked.lag_to_position; here `tl.gather` on the tile), so every
contraction is a `tl.dot` and no negative power of lambda is formed (stable for any Delta).

Determinism: no atomics. Every parameter-table gradient is written per program (per chunk)
into its own slot and summed by torch in a fixed order, so two backward passes on the same
inputs give bitwise equal gradients.

Memory: the forward keeps its inputs only; the backward recomputes the chunk states with the
forward walk, and holds per-chunk fp32 buffers while it runs (states and their gradients,
dr and p, the tables' per-chunk partial gradients: about 5 KB per token and head at M = 64).

Precision [our choice, measured: docs/gpu.md "Dot precision"]: inputs may be bf16, fp16 or
fp32; tiles are loaded as fp32, every dot accumulates in fp32 and the state is fp32. The dot
operands run on tensor cores (`dot_precision`): "tf32" for bf16 training (autocast) and 16-bit
inputs (bf16 and fp16 values are exact in tf32; of the computed operands, states, p and r,
tf32 keeps 2 more bits than bf16: 2e-3 against 4e-3 relative error at the 1.3B head shape);
"tf32x3" (three tf32 products, 1e-6) for float32 inputs outside autocast, as PyTorch's default
float32 matmul precision asks. "ieee" (no tensor cores: spills) and "bf16" are selectable
(MEGATRON_ID_DOT_PRECISION) for measurements. Under the interpreter (TRITON_INTERPRET=1) the
operands are rounded the way the tensor cores round them (_dot), so the CPU tests measure each
precision's real error.
Shapes the kernels want (powers of two >= 16; widths above 64 in blocks of 32 or 64) are
reached by zero padding in `triton_chunked_core`: padded modes, key and value columns
contribute exactly zero.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

if not hasattr(tl, "gather"):   # an older triton: the PyTorch forms are used instead (chunked.py)
    raise ImportError(f"the Triton core needs triton >= 3.3 (tl.gather); this is triton {triton.__version__}")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_EMULATE_ROUNDING = tl.constexpr(INTERPRET)   # read inside _dot (a kernel sees constexpr globals only)
PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16")
MIN_DOT = 16        # tl.dot needs every dimension >= 16
# [our choice, from resources.py's figures at the 1.3B head shape, tf32, sm_90, 8 warps]: key
# and value columns in blocks of 32 rather than 64 spill 556 instead of 1,120 bytes per thread
# in the heaviest kernel (_query_backward_dv) for the same shared memory, and compile in half
# the time
COLUMN_BLOCK = 32


def dot_precision(dtypes, autocast: bool) -> str:
    """The dot precision for inputs of these dtypes (module docstring): "tf32" under autocast
    or with any 16-bit input; for float32 inputs outside autocast, PyTorch's own setting
    decides (torch.get_float32_matmul_precision: "highest", the default, -> "tf32x3"; "high" or
    "medium" -> "tf32"). MEGATRON_ID_DOT_PRECISION (one of PRECISIONS) overrides, for
    measurements."""
    forced = os.environ.get("MEGATRON_ID_DOT_PRECISION")
    if forced:
        if forced not in PRECISIONS:
            raise ValueError(f"MEGATRON_ID_DOT_PRECISION={forced!r}: expected one of {', '.join(PRECISIONS)}")
        return forced
    if autocast or any(d in (torch.bfloat16, torch.float16) for d in dtypes):
        return "tf32"
    return "tf32x3" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _pow2(t: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(t))


def kernel_chunk(chunk_size: int) -> int:
    """The chunk the kernels run: model.chunk_size when it is a power of two >= 16, else the
    next such size (the chunked algorithm is exact for every chunk size)."""
    return _pow2(chunk_size)


def padded_width(d: int) -> tuple[int, int]:
    """(padded width, column block) of a key or value width d: a power of two >= 16 up to
    COLUMN_BLOCK, then a multiple of it, looped over in blocks of COLUMN_BLOCK (96 stays 96)."""
    if d <= COLUMN_BLOCK:
        p = _pow2(d)
        return p, p
    return -(-d // COLUMN_BLOCK) * COLUMN_BLOCK, COLUMN_BLOCK


@dataclass(frozen=True)
class Shape:
    """Everything a launch specialises on (the kernels' constexprs), from the padded sizes."""
    T: int          # chunk
    M: int          # modes (padded)
    R: int          # key width (padded); the contraction readout: the k input's width
    DV: int         # value width (padded)
    BR: int         # column blocks of the per-chunk kernels
    BDV: int
    query: bool     # query readout (else the linear contraction)
    prec: str

    def walk_blocks(self, D: int) -> tuple[int, int]:
        """(modes, columns) per walk program: small blocks, many programs (B 1 x H 32 at 1.3B
        gets 256 programs per walk)."""
        return min(self.M, 32), min(D, 32)


def kernel_shape(T: int, M: int, R: int, Dv: int, query: bool, prec: str) -> Shape:
    """The Shape of a core call with these (unpadded) sizes and dot precision."""
    Rp, BR = padded_width(R)
    Dp, BDV = padded_width(Dv)
    return Shape(T=kernel_chunk(T), M=_pow2(M), R=Rp, DV=Dp, BR=BR, BDV=BDV, query=query, prec=prec)


# ----------------------------------------------------------------------- dots and precision

@triton.jit
def _round_bf16(x):
    """x rounded to bfloat16 (nearest even) and back to fp32, as cvt.rn.bf16.f32 does."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _trunc_tf32(x):
    """x as the tensor cores read an fp32 operand in tf32 mode: the low 13 mantissa bits dropped."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a @ b, fp32 accumulation, operands in PREC. Under the interpreter (which computes every
    dot exactly in fp32) the operands are rounded first, so the tests see PREC's error."""
    if _EMULATE_ROUNDING:
        if PREC == "bf16":
            out = tl.dot(_round_bf16(a), _round_bf16(b), input_precision="ieee")
        elif PREC == "tf32":
            out = tl.dot(_trunc_tf32(a), _trunc_tf32(b), input_precision="ieee")
        elif PREC == "tf32x3":
            a_hi = _trunc_tf32(a)
            b_hi = _trunc_tf32(b)
            out = tl.dot(a_hi, b_hi, input_precision="ieee") + \
                tl.dot(a_hi, _trunc_tf32(b - b_hi), input_precision="ieee") + \
                tl.dot(_trunc_tf32(a - a_hi), b_hi, input_precision="ieee")
        else:
            out = tl.dot(a, b, input_precision="ieee")
    else:
        if PREC == "bf16":
            out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        elif PREC == "tf32x3":
            a_hi = _trunc_tf32(a)
            b_hi = _trunc_tf32(b)
            out = tl.dot(a_hi, b_hi, input_precision="tf32")
            out = tl.dot(a_hi, b - b_hi, out, input_precision="tf32")
            out = tl.dot(a - a_hi, b_hi, out, input_precision="tf32")
        else:
            out = tl.dot(a, b, input_precision=PREC)
    return out


# ------------------------------------------------------------------------- packed documents

@triton.jit
def _document_carry(starts_ptrs, real):
    """For one chunk's tokens (ops/interdomain/chunked.document_masks): keep = 1.0 when no
    document starts in it (the entering state survives the chunk), and last [T]: the tokens
    in the chunk's last document (those that reach the next chunk). starts are all zero when
    the batch has no packed documents: keep and last are then ones."""
    local = tl.cumsum(tl.load(starts_ptrs, mask=real, other=0).to(tl.int32), axis=0)
    keep = (tl.max(local, axis=0) == 0).to(tl.float32)
    return keep, (local == tl.max(local, axis=0)).to(tl.float32)


@triton.jit
def _document_pairs(starts_ptrs, real):
    """enter [T]: the entering state reaches token i (no start at <= i in the chunk);
    same [T, T]: tokens i and j are in one document."""
    local = tl.cumsum(tl.load(starts_ptrs, mask=real, other=0).to(tl.int32), axis=0)
    return (local == 0).to(tl.float32), (local[:, None] == local[None, :]).to(tl.float32)


@triton.jit
def _lag_view(x, t):
    """chunked.lag_to_position on a [T, T] tile: (i, a) -> x[i, i - a], zero where a > i."""
    causal = t[None, :] <= t[:, None]
    return tl.where(causal, tl.gather(x, tl.where(causal, t[:, None] - t[None, :], 0), axis=1), 0.0)


# ----------------------------------------------------------------- the chunk-to-chunk walks
# Offsets: every program id and chunk counter is int64 before it meets a stride, so no
# product passes 2^31 (a 1.3B micro-batch of 1M tokens has 2^36-byte state buffers).

@triton.jit
def _walk_program(n_chunks, H, D, T: tl.constexpr, M: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """A walk program's (batch x head) id, int64, the chunk count as int64, batch and head, its
    modes m, the chunk's positions t, its state columns d and the offsets of its block of the
    stacked [2M, D] state (re rows, im rows)."""
    bh = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    d = tl.program_id(2).to(tl.int64) * BD + tl.arange(0, BD)
    return (bh, n_chunks.to(tl.int64), bh // H, bh % H, m, tl.arange(0, T), d,
            m[:, None] * D + d[None, :], (M + m[:, None]) * D + d[None, :])


@triton.jit(do_not_specialize=["N", "n_chunks", "H"])
def _walk_forward(x_ptr, sx_b, sx_n, sx_h, add_ptr, lam_re_ptr, lam_im_ptr, pow_re_ptr, pow_im_ptr,
                  start_ptr, states_ptr, starts_ptr, N, n_chunks, H, D,
                  T: tl.constexpr, M: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """x [B, N, H, D]: one input (k or v); add [H, 2M, T]; lam_* [H, M] (lambda^T);
    pow_* [H, T, M] (lambda^{i+1}); start [B, H, 2M, D]; states [B, H, n + 1, 2M, D]: the state
    entering each chunk, then the exact state after token N (the last chunk may be partial).
    starts [B, N] int8 marks tokens that begin a packed document (_document_carry)."""
    bh, n64, b, h, m, t, d, rows_re, rows_im = _walk_program(n_chunks, H, D, T=T, M=M, BM=BM, BD=BD)
    a_re = tl.load(add_ptr + h * 2 * M * T + m[:, None] * T + t[None, :])
    a_im = tl.load(add_ptr + h * 2 * M * T + (M + m[:, None]) * T + t[None, :])
    l_re = tl.load(lam_re_ptr + h * M + m)[:, None]
    l_im = tl.load(lam_im_ptr + h * M + m)[:, None]
    s_re = tl.load(start_ptr + bh * 2 * M * D + rows_re)
    s_im = tl.load(start_ptr + bh * 2 * M * D + rows_im)
    out = states_ptr + bh * (n64 + 1) * 2 * M * D
    x_base = x_ptr + b * sx_b + h * sx_h + d[None, :]
    for c in range(0, n64 - 1):
        tl.store(out + c * 2 * M * D + rows_re, s_re)
        tl.store(out + c * 2 * M * D + rows_im, s_im)
        keep, last = _document_carry(starts_ptr + b * N + c * T + t, t >= 0)
        z = tl.load(x_base + (c * T + t)[:, None] * sx_n).to(tl.float32) * last[:, None]    # [T, BD]
        new_re = keep * (l_re * s_re - l_im * s_im) + _dot(a_re, z, PREC)
        s_im = keep * (l_im * s_re + l_re * s_im) + _dot(a_im, z, PREC)
        s_re = new_re
    # the last chunk holds `valid` real tokens: shift them to its end, so that add_in's columns
    # (lambda^{T-1-j}) and lambda^valid (instead of lambda^T) give the exact state after token N
    c = n64 - 1
    tl.store(out + c * 2 * M * D + rows_re, s_re)
    tl.store(out + c * 2 * M * D + rows_im, s_im)
    valid = N - c * T
    shift = T - valid
    real = t >= shift
    keep, last = _document_carry(starts_ptr + b * N + c * T + t - shift, real)
    z = tl.load(x_base + (c * T + t - shift)[:, None] * sx_n, mask=real[:, None], other=0.0).to(tl.float32)
    z = z * last[:, None]
    v_re = tl.load(pow_re_ptr + h * T * M + (valid - 1) * M + m)[:, None] * keep
    v_im = tl.load(pow_im_ptr + h * T * M + (valid - 1) * M + m)[:, None] * keep
    new_re = v_re * s_re - v_im * s_im + _dot(a_re, z, PREC)
    s_im = v_im * s_re + v_re * s_im + _dot(a_im, z, PREC)
    tl.store(out + n64 * 2 * M * D + rows_re, new_re)
    tl.store(out + n64 * 2 * M * D + rows_im, s_im)


@triton.jit(do_not_specialize=["N", "n_chunks", "H"])
def _walk_backward(grad_ptr, dend_ptr, dstart_ptr, lam_re_ptr, lam_im_ptr, pow_re_ptr, pow_im_ptr,
                   starts_ptr, N, n_chunks, H, D,
                   T: tl.constexpr, M: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    """The forward walk's transpose, from the last chunk to the first, elementwise:
        G_c = local_c + conj(f_c) (.) G_{c+1},   G_n = dend,  f_c = keep_c lambda^T
    (lambda^valid for the last chunk). grad [B, H, n, 2M, D] holds local_c on entry and
    G_{c+1} on exit (in place: _carry_backward reads it); dstart = G_0."""
    bh, n64, b, h, m, t, d, rows_re, rows_im = _walk_program(n_chunks, H, D, T=T, M=M, BM=BM, BD=BD)
    g_re = tl.load(dend_ptr + bh * 2 * M * D + rows_re)
    g_im = tl.load(dend_ptr + bh * 2 * M * D + rows_im)
    grads = grad_ptr + bh * n64 * 2 * M * D
    valid = N - (n64 - 1) * T
    l_re = tl.load(lam_re_ptr + h * M + m)[:, None]
    l_im = tl.load(lam_im_ptr + h * M + m)[:, None]
    v_re = tl.load(pow_re_ptr + h * T * M + (valid - 1) * M + m)[:, None]
    v_im = tl.load(pow_im_ptr + h * T * M + (valid - 1) * M + m)[:, None]
    for back in range(0, n64):
        c = n64 - 1 - back
        shift = tl.where(c == n64 - 1, T - valid, 0)
        keep, _ = _document_carry(starts_ptr + b * N + c * T + t - shift, t >= shift)
        f_re = tl.where(c == n64 - 1, v_re, l_re) * keep
        f_im = tl.where(c == n64 - 1, v_im, l_im) * keep
        loc_re = tl.load(grads + c * 2 * M * D + rows_re)
        loc_im = tl.load(grads + c * 2 * M * D + rows_im)
        tl.store(grads + c * 2 * M * D + rows_re, g_re)
        tl.store(grads + c * 2 * M * D + rows_im, g_im)
        new_re = loc_re + f_re * g_re + f_im * g_im
        g_im = loc_im + f_re * g_im - f_im * g_re
        g_re = new_re
    tl.store(dstart_ptr + bh * 2 * M * D + rows_re, g_re)
    tl.store(dstart_ptr + bh * 2 * M * D + rows_im, g_im)


@triton.jit(do_not_specialize=["N", "n_chunks", "H"])
def _carry_backward(x_ptr, sx_b, sx_n, sx_h, dx_ptr, add_ptr, states_ptr, grad_ptr, starts_ptr,
                    dadd_ptr, dfac_ptr, N, n_chunks, H, D,
                    T: tl.constexpr, M: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """What the carry S_{c+1} = f_c (.) S_c + add_in @ (last_c z_c) adds to the gradients, for
    one chunk, with G = G_{c+1} from _walk_backward:
        dx_c += last_c add_in^T G         (dx [B, N, H, D] fp32 contiguous: the outputs' part in)
        dadd [B, H, n, 2M, T] = G (last_c z_c)^T,   dfac [B, H, n, 2M] = sum_d G conj(S_c) keep_c
    (re and im stacked); torch sums them over batch and chunks (no atomics: deterministic)."""
    bh, c, n64, b, h = _chunk_program(n_chunks, H)
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    valid = tl.minimum(N - c * T, T)
    shift = T - valid    # the last chunk's tokens sit at its end (_walk_forward)
    real = t >= shift
    tok = c * T + t - shift
    keep, last = _document_carry(starts_ptr + b * N + tok, real)
    a_re = tl.load(add_ptr + h * 2 * M * T + m[:, None] * T + t[None, :])        # [M, T]
    a_im = tl.load(add_ptr + h * 2 * M * T + (M + m[:, None]) * T + t[None, :])
    da_re = tl.zeros([M, T], dtype=tl.float32)
    da_im = tl.zeros([M, T], dtype=tl.float32)
    df_re = tl.zeros([M], dtype=tl.float32)
    df_im = tl.zeros([M], dtype=tl.float32)
    S = states_ptr + (bh * (n64 + 1) + c) * 2 * M * D
    G = grad_ptr + (bh * n64 + c) * 2 * M * D
    for block in range(0, D.to(tl.int64) // BD):
        d = block * BD + tl.arange(0, BD)
        rows_re = m[:, None] * D + d[None, :]
        rows_im = (M + m[:, None]) * D + d[None, :]
        g_re = tl.load(G + rows_re)
        g_im = tl.load(G + rows_im)
        s_re = tl.load(S + rows_re)
        s_im = tl.load(S + rows_im)
        z = tl.load(x_ptr + b * sx_b + tok[:, None] * sx_n + h * sx_h + d[None, :], mask=real[:, None],
                    other=0.0).to(tl.float32) * last[:, None]                      # [T, BD]
        dz = (_dot(tl.trans(a_re), g_re, PREC) + _dot(tl.trans(a_im), g_im, PREC)) * last[:, None]
        dx = dx_ptr + ((b * N + tok[:, None]) * H + h) * D + d[None, :]
        tl.store(dx, tl.load(dx, mask=real[:, None], other=0.0) + dz, mask=real[:, None])
        da_re += _dot(g_re, tl.trans(z), PREC)
        da_im += _dot(g_im, tl.trans(z), PREC)
        df_re += tl.sum(g_re * s_re + g_im * s_im, axis=1)
        df_im += tl.sum(g_im * s_re - g_re * s_im, axis=1)
    part = (bh * n64 + c) * 2 * M
    tl.store(dadd_ptr + part * T + m[:, None] * T + t[None, :], da_re)
    tl.store(dadd_ptr + part * T + (M + m[:, None]) * T + t[None, :], da_im)
    tl.store(dfac_ptr + part + m, df_re * keep)
    tl.store(dfac_ptr + part + M + m, df_im * keep)


# ------------------------------------------------------------- the query readout per chunk

@triton.jit
def _query_scores(q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, states_k_ptr, starts_ptr,
                  N, n64, b, h, bh, c, R,
                  T: tl.constexpr, M: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
    """The key side of one chunk (chunked._segment), R in blocks of BR columns:
    a = q S_k^T [T, M] re and im (masked by enter), scores = lag(q k^T (.) same) [T, T],
    with the document masks enter [T] and same [T, T]."""
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    tok = (c * T + t)[:, None]
    real = tok < N
    Sk = states_k_ptr + (bh * (n64 + 1) + c) * 2 * M * R
    a_re = tl.zeros([T, M], dtype=tl.float32)
    a_im = tl.zeros([T, M], dtype=tl.float32)
    qk = tl.zeros([T, T], dtype=tl.float32)
    for block in range(0, R.to(tl.int64) // BR):
        r_ = block * BR + tl.arange(0, BR)
        q = tl.load(q_ptr + b * sq_b + tok * sq_n + h * sq_h + r_[None, :], mask=real, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * sk_b + tok * sk_n + h * sk_h + r_[None, :], mask=real, other=0.0).to(tl.float32)
        a_re += _dot(q, tl.trans(tl.load(Sk + m[:, None] * R + r_[None, :])), PREC)
        a_im += _dot(q, tl.trans(tl.load(Sk + (M + m[:, None]) * R + r_[None, :])), PREC)
        qk += _dot(q, tl.trans(k), PREC)
    enter, same = _document_pairs(starts_ptr + b * N + c * T + t, t < N - c * T)
    return a_re * enter[:, None], a_im * enter[:, None], _lag_view(qk * same, t), enter, same


@triton.jit
def _query_readout(a_re, a_im, scores, lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, h,
                   T: tl.constexpr, M: tl.constexpr, PREC: tl.constexpr):
    """From the key side to the readout vector: with w = lambda^{i+1}, K the lag kernel,
        p = a (.) w + scores @ K,   r = p @ gram   ([T, M] re and im each)."""
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    tm = h * T * M + t[:, None] * M + m[None, :]
    w_re = tl.load(pow_re_ptr + tm)
    w_im = tl.load(pow_im_ptr + tm)
    lag = lag_ptr + h * T * 2 * M + t[:, None] * 2 * M + m[None, :]
    p_re = a_re * w_re - a_im * w_im + _dot(scores, tl.load(lag), PREC)
    p_im = a_re * w_im + a_im * w_re + _dot(scores, tl.load(lag + M), PREC)
    G = gram_ptr + h * 4 * M * M + m[:, None] * 2 * M + m[None, :]
    r_re = _dot(p_re, tl.load(G), PREC) + _dot(p_im, tl.load(G + 2 * M * M), PREC)
    r_im = _dot(p_re, tl.load(G + M), PREC) + _dot(p_im, tl.load(G + 2 * M * M + M), PREC)
    return p_re, p_im, r_re, r_im


@triton.jit
def _query_weights(r_re, r_im, enter, same, lag_ptr, pow_re_ptr, pow_im_ptr, h,
                   T: tl.constexpr, M: tl.constexpr, PREC: tl.constexpr):
    """u = r (.) conj(w) (the entering state's readout, masked by enter) and
    W = lag(r @ K^T) (.) same (the pairs inside the chunk)."""
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    tm = h * T * M + t[:, None] * M + m[None, :]
    w_re = tl.load(pow_re_ptr + tm)
    w_im = tl.load(pow_im_ptr + tm)
    lag = lag_ptr + h * T * 2 * M + t[:, None] * 2 * M + m[None, :]
    u_re = (r_re * w_re + r_im * w_im) * enter[:, None]
    u_im = (r_im * w_re - r_re * w_im) * enter[:, None]
    weights = _lag_view(_dot(r_re, tl.trans(tl.load(lag)), PREC) + _dot(r_im, tl.trans(tl.load(lag + M)), PREC), t)
    return u_re, u_im, weights * same


@triton.jit
def _chunk_program(n_chunks, H):
    """A per-chunk program's (batch x head, chunk) ids, int64 before they meet a stride, the
    chunk count as int64, and the batch and head."""
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    return bh, c, n_chunks.to(tl.int64), bh // H, bh % H


@triton.jit
def _query_recompute(q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, states_k_ptr, lag_ptr, pow_re_ptr,
                     pow_im_ptr, gram_ptr, starts_ptr, N, n64, b, h, bh, c, R,
                     T: tl.constexpr, M: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
    """A chunk of the query readout from its inputs up to r (_query_scores, _query_readout)."""
    a_re, a_im, scores, enter, same = _query_scores(
        q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, states_k_ptr, starts_ptr, N, n64, b, h, bh, c, R,
        T=T, M=M, BR=BR, PREC=PREC)
    p_re, p_im, r_re, r_im = _query_readout(a_re, a_im, scores, lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, h,
                                            T=T, M=M, PREC=PREC)
    return a_re, a_im, scores, enter, same, p_re, p_im, r_re, r_im


@triton.jit(do_not_specialize=["N", "n_chunks", "H"])
def _query_forward(q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, v_ptr, sv_b, sv_n, sv_h,
                   out_ptr, so_b, so_n, so_h, states_k_ptr, states_v_ptr,
                   lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, scale, starts_ptr, N, n_chunks, H, R, DV,
                   T: tl.constexpr, M: tl.constexpr, BR: tl.constexpr, BDV: tl.constexpr, PREC: tl.constexpr):
    """One chunk of the query readout: out = (Re((r (.) conj w)^T S_v) + W v) * scale, Dv in
    blocks of BDV columns."""
    bh, c, n64, b, h = _chunk_program(n_chunks, H)
    a_re, a_im, scores, enter, same, p_re, p_im, r_re, r_im = _query_recompute(
        q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, states_k_ptr, lag_ptr, pow_re_ptr, pow_im_ptr,
        gram_ptr, starts_ptr, N, n64, b, h, bh, c, R, T=T, M=M, BR=BR, PREC=PREC)
    u_re, u_im, weights = _query_weights(r_re, r_im, enter, same, lag_ptr, pow_re_ptr, pow_im_ptr, h,
                                         T=T, M=M, PREC=PREC)
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    tok = (c * T + t)[:, None]
    real = tok < N
    Sv = states_v_ptr + (bh * (n64 + 1) + c) * 2 * M * DV
    for block in range(0, DV.to(tl.int64) // BDV):
        d = block * BDV + tl.arange(0, BDV)
        v = tl.load(v_ptr + b * sv_b + tok * sv_n + h * sv_h + d[None, :], mask=real, other=0.0).to(tl.float32)
        o = _dot(u_re, tl.load(Sv + m[:, None] * DV + d[None, :]), PREC) + \
            _dot(u_im, tl.load(Sv + (M + m[:, None]) * DV + d[None, :]), PREC) + _dot(weights, v, PREC)
        tl.store(out_ptr + b * so_b + tok * so_n + h * so_h + d[None, :], o * scale, mask=real)


@triton.jit(do_not_specialize=["N", "n_chunks", "H"])
def _query_backward_dv(q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, v_ptr, sv_b, sv_n, sv_h,
                       do_ptr, sdo_b, sdo_n, sdo_h, states_k_ptr, states_v_ptr,
                       lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, scale,
                       dv_ptr, local_v_ptr, p_ptr, dr_ptr, dlag_ptr, dpow_ptr, starts_ptr, N, n_chunks, H, R, DV,
                       T: tl.constexpr, M: tl.constexpr, BR: tl.constexpr, BDV: tl.constexpr,
                       PREC: tl.constexpr):
    """The value side of one chunk's backward, the forward recomputed up to W:
        out = (u_re S_v,re + u_im S_v,im) + W v      (u masked by enter, W by same; * scale)
        local_v = u^T do,  dv = W^T do,  du = do S_v^T,  dW = lag(do v^T (.) same)
        dr = dW @ K + du (.) w   (W = lag(r K^T), u = r (.) conj w)
    Writes dv (the outputs' part) [B, N, H, Dv], local_v [B, H, n, 2M, Dv], and per chunk
    [B, H, n, T, 2M]: p and dr (for _query_backward_dq and the gram gradient), and this side's
    parts of d lag (dW^T r) and d pow (du (.) conj-rotated r)."""
    bh, c, n64, b, h = _chunk_program(n_chunks, H)
    a_re, a_im, scores, enter, same, p_re, p_im, r_re, r_im = _query_recompute(
        q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, states_k_ptr, lag_ptr, pow_re_ptr, pow_im_ptr,
        gram_ptr, starts_ptr, N, n64, b, h, bh, c, R, T=T, M=M, BR=BR, PREC=PREC)
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    part = (bh * n64 + c) * T * 2 * M + t[:, None] * 2 * M + m[None, :]
    tl.store(p_ptr + part, p_re)     # stored now: p is not needed here again
    tl.store(p_ptr + part + M, p_im)
    u_re, u_im, weights = _query_weights(r_re, r_im, enter, same, lag_ptr, pow_re_ptr, pow_im_ptr, h,
                                         T=T, M=M, PREC=PREC)
    tok = (c * T + t)[:, None]
    real = tok < N
    Sv = states_v_ptr + (bh * (n64 + 1) + c) * 2 * M * DV
    L = local_v_ptr + (bh * n64 + c) * 2 * M * DV
    du_re = tl.zeros([T, M], dtype=tl.float32)
    du_im = tl.zeros([T, M], dtype=tl.float32)
    dw_pos = tl.zeros([T, T], dtype=tl.float32)
    for block in range(0, DV.to(tl.int64) // BDV):
        d = block * BDV + tl.arange(0, BDV)
        do = tl.load(do_ptr + b * sdo_b + tok * sdo_n + h * sdo_h + d[None, :], mask=real, other=0.0)
        do = do.to(tl.float32) * scale
        v = tl.load(v_ptr + b * sv_b + tok * sv_n + h * sv_h + d[None, :], mask=real, other=0.0).to(tl.float32)
        tl.store(L + m[:, None] * DV + d[None, :], _dot(tl.trans(u_re), do, PREC))
        tl.store(L + (M + m[:, None]) * DV + d[None, :], _dot(tl.trans(u_im), do, PREC))
        tl.store(dv_ptr + ((b * N + tok) * H + h) * DV + d[None, :], _dot(tl.trans(weights), do, PREC), mask=real)
        du_re += _dot(do, tl.trans(tl.load(Sv + m[:, None] * DV + d[None, :])), PREC)
        du_im += _dot(do, tl.trans(tl.load(Sv + (M + m[:, None]) * DV + d[None, :])), PREC)
        dw_pos += _dot(do, tl.trans(v), PREC)
    # the masks again rather than kept across the loop (a [T, T] tile less to hold)
    enter, same = _document_pairs(starts_ptr + b * N + c * T + t, t < N - c * T)
    du_re, du_im = du_re * enter[:, None], du_im * enter[:, None]
    dweights = _lag_view(dw_pos * same, t)   # by lag (the map is its own inverse)
    tl.store(dlag_ptr + part, _dot(tl.trans(dweights), r_re, PREC))
    tl.store(dlag_ptr + part + M, _dot(tl.trans(dweights), r_im, PREC))
    tl.store(dpow_ptr + part, du_re * r_re + du_im * r_im)
    tl.store(dpow_ptr + part + M, du_re * r_im - du_im * r_re)
    tm = h * T * M + t[:, None] * M + m[None, :]
    w_re = tl.load(pow_re_ptr + tm)
    w_im = tl.load(pow_im_ptr + tm)
    lag = lag_ptr + h * T * 2 * M + t[:, None] * 2 * M + m[None, :]
    tl.store(dr_ptr + part, _dot(dweights, tl.load(lag), PREC) + du_re * w_re - du_im * w_im)
    tl.store(dr_ptr + part + M, _dot(dweights, tl.load(lag + M), PREC) + du_re * w_im + du_im * w_re)


@triton.jit(do_not_specialize=["N", "n_chunks", "H"])
def _query_backward_dq(q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, states_k_ptr,
                       lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, dr_ptr,
                       dq_ptr, dk_ptr, local_k_ptr, dlag_ptr, dpow_ptr, starts_ptr, N, n_chunks, H, R,
                       T: tl.constexpr, M: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
    """The query side of one chunk's backward, from dr (_query_backward_dv):
        dp = dr @ gram^T,  d scores = lag(dp K^T) (.) same,  da = dp (.) conj w (masked by enter)
        local_k = da^T q,  dq = d scores @ k + da @ S_k,  dk = d scores^T q
    and this side's parts of d lag (scores^T dp) and d pow (dp (.) a), into their own
    [B, H, n, T, 2M] slots (the value side's are summed with them by torch)."""
    bh, c, n64, b, h = _chunk_program(n_chunks, H)
    a_re, a_im, scores, enter, same = _query_scores(
        q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, states_k_ptr, starts_ptr, N, n64, b, h, bh, c, R,
        T=T, M=M, BR=BR, PREC=PREC)
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    part = (bh * n64 + c) * T * 2 * M + t[:, None] * 2 * M + m[None, :]
    dr_re = tl.load(dr_ptr + part)
    dr_im = tl.load(dr_ptr + part + M)
    G = gram_ptr + h * 4 * M * M + m[:, None] * 2 * M + m[None, :]    # r = p @ gram
    dp_re = _dot(dr_re, tl.trans(tl.load(G)), PREC) + _dot(dr_im, tl.trans(tl.load(G + M)), PREC)
    dp_im = _dot(dr_re, tl.trans(tl.load(G + 2 * M * M)), PREC) + _dot(dr_im, tl.trans(tl.load(G + 2 * M * M + M)),
                                                                       PREC)
    lag = lag_ptr + h * T * 2 * M + t[:, None] * 2 * M + m[None, :]   # p = a (.) w + lag(q k^T) @ K
    dscores = _lag_view(_dot(dp_re, tl.trans(tl.load(lag)), PREC) + _dot(dp_im, tl.trans(tl.load(lag + M)), PREC),
                        t) * same
    tl.store(dlag_ptr + part, _dot(tl.trans(scores), dp_re, PREC))
    tl.store(dlag_ptr + part + M, _dot(tl.trans(scores), dp_im, PREC))
    tl.store(dpow_ptr + part, dp_re * a_re + dp_im * a_im)   # a is masked already: no term where the state is cut
    tl.store(dpow_ptr + part + M, dp_im * a_re - dp_re * a_im)
    tm = h * T * M + t[:, None] * M + m[None, :]
    w_re = tl.load(pow_re_ptr + tm)
    w_im = tl.load(pow_im_ptr + tm)
    da_re = (dp_re * w_re + dp_im * w_im) * enter[:, None]
    da_im = (dp_im * w_re - dp_re * w_im) * enter[:, None]
    tok = (c * T + t)[:, None]
    real = tok < N
    Sk = states_k_ptr + (bh * (n64 + 1) + c) * 2 * M * R
    L = local_k_ptr + (bh * n64 + c) * 2 * M * R
    for block in range(0, R.to(tl.int64) // BR):
        r_ = block * BR + tl.arange(0, BR)
        q = tl.load(q_ptr + b * sq_b + tok * sq_n + h * sq_h + r_[None, :], mask=real, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * sk_b + tok * sk_n + h * sk_h + r_[None, :], mask=real, other=0.0).to(tl.float32)
        tl.store(L + m[:, None] * R + r_[None, :], _dot(tl.trans(da_re), q, PREC))
        tl.store(L + (M + m[:, None]) * R + r_[None, :], _dot(tl.trans(da_im), q, PREC))
        dq = _dot(dscores, k, PREC) + _dot(da_re, tl.load(Sk + m[:, None] * R + r_[None, :]), PREC) + \
            _dot(da_im, tl.load(Sk + (M + m[:, None]) * R + r_[None, :]), PREC)
        tl.store(dq_ptr + ((b * N + tok) * H + h) * R + r_[None, :], dq, mask=real)
        tl.store(dk_ptr + ((b * N + tok) * H + h) * R + r_[None, :], _dot(tl.trans(dscores), q, PREC), mask=real)


# ---------------------------------------------------- the linear contraction readout (S4D)

@triton.jit
def _contraction_chunk(ent_ptr, kern_ptr, starts_ptr, N, b, h, c, T: tl.constexpr, M: tl.constexpr):
    """One chunk's index tiles, document masks and readout tables: E = tab["entering"]
    [T, 2M] (re, im; masked by enter) and Kern = tab["kernel"] [T, T] (masked by same)."""
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    tok = (c * T + t)[:, None]
    real = tok < N
    enter, same = _document_pairs(starts_ptr + b * N + c * T + t, t < N - c * T)
    et = h * T * 2 * M + t[:, None] * 2 * M + m[None, :]
    e_re = tl.load(ent_ptr + et) * enter[:, None]
    e_im = tl.load(ent_ptr + et + M) * enter[:, None]
    kern = tl.load(kern_ptr + h * T * T + t[:, None] * T + t[None, :]) * same
    return t, m, tok, real, enter, same, e_re, e_im, kern


@triton.jit(do_not_specialize=["N", "n_chunks", "H"])
def _contraction_forward(x_ptr, sx_b, sx_n, sx_h, out_ptr, so_b, so_n, so_h, states_ptr,
                         ent_ptr, kern_ptr, starts_ptr, N, n_chunks, H, D,
                         T: tl.constexpr, M: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """Linear contraction readout for one input (k or v) and chunk: out = E @ S_c + Kern @ x_c,
    E = tab["entering"] [H, T, 2M] (masked by enter), Kern = tab["kernel"] [H, T, T] (S4D's
    causal kernel, masked by same)."""
    bh, c, n64, b, h = _chunk_program(n_chunks, H)
    t, m, tok, real, enter, same, e_re, e_im, kern = _contraction_chunk(ent_ptr, kern_ptr, starts_ptr, N, b, h, c,
                                                                        T=T, M=M)
    S = states_ptr + (bh * (n64 + 1) + c) * 2 * M * D
    for block in range(0, D.to(tl.int64) // BD):
        d = block * BD + tl.arange(0, BD)
        x = tl.load(x_ptr + b * sx_b + tok * sx_n + h * sx_h + d[None, :], mask=real, other=0.0).to(tl.float32)
        o = _dot(e_re, tl.load(S + m[:, None] * D + d[None, :]), PREC) + \
            _dot(e_im, tl.load(S + (M + m[:, None]) * D + d[None, :]), PREC) + _dot(kern, x, PREC)
        tl.store(out_ptr + b * so_b + tok * so_n + h * so_h + d[None, :], o, mask=real)


@triton.jit(do_not_specialize=["N", "n_chunks", "H"])
def _contraction_backward(x_ptr, sx_b, sx_n, sx_h, do_ptr, sdo_b, sdo_n, sdo_h, states_ptr,
                          ent_ptr, kern_ptr, dx_ptr, local_ptr, dent_ptr, dkern_ptr, starts_ptr, N, n_chunks, H, D,
                          T: tl.constexpr, M: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
    """local = E^T do [B, H, n, 2M, D], dx = Kern^T do (the outputs' part), and per chunk
    dent [B, H, n, T, 2M] = do S^T, dkern [B, H, n, T, T] = do x^T (masked as in the forward)."""
    bh, c, n64, b, h = _chunk_program(n_chunks, H)
    t, m, tok, real, enter, same, e_re, e_im, kern = _contraction_chunk(ent_ptr, kern_ptr, starts_ptr, N, b, h, c,
                                                                        T=T, M=M)
    S = states_ptr + (bh * (n64 + 1) + c) * 2 * M * D
    L = local_ptr + (bh * n64 + c) * 2 * M * D
    de_re = tl.zeros([T, M], dtype=tl.float32)
    de_im = tl.zeros([T, M], dtype=tl.float32)
    dkern = tl.zeros([T, T], dtype=tl.float32)
    for block in range(0, D.to(tl.int64) // BD):
        d = block * BD + tl.arange(0, BD)
        x = tl.load(x_ptr + b * sx_b + tok * sx_n + h * sx_h + d[None, :], mask=real, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + b * sdo_b + tok * sdo_n + h * sdo_h + d[None, :], mask=real, other=0.0).to(tl.float32)
        tl.store(L + m[:, None] * D + d[None, :], _dot(tl.trans(e_re), do, PREC))
        tl.store(L + (M + m[:, None]) * D + d[None, :], _dot(tl.trans(e_im), do, PREC))
        tl.store(dx_ptr + ((b * N + tok) * H + h) * D + d[None, :], _dot(tl.trans(kern), do, PREC), mask=real)
        de_re += _dot(do, tl.trans(tl.load(S + m[:, None] * D + d[None, :])), PREC)
        de_im += _dot(do, tl.trans(tl.load(S + (M + m[:, None]) * D + d[None, :])), PREC)
        dkern += _dot(do, tl.trans(x), PREC)
    part = (bh * n64 + c) * T * 2 * M + t[:, None] * 2 * M + m[None, :]
    tl.store(dent_ptr + part, de_re * enter[:, None])
    tl.store(dent_ptr + part + M, de_im * enter[:, None])
    tl.store(dkern_ptr + (bh * n64 + c) * T * T + t[:, None] * T + t[None, :], dkern * same)


# ------------------------------------------------------------------------ launching them

# [our choice] num_warps 4 or 8, autotuned per shape on CUDA (resources.py compiles every entry
# for sm_80 and sm_90; 8 warps spill less in most kernels, 4 in a few). num_stages stays 1: the
# only loops of the per-chunk kernels run over 1-4 column blocks, where software pipelining
# would add shared memory for at most three prefetches; a GPU measures whether an entry with
# num_stages=2 pays (one line here, and resources.py checks it). Kernels that update a buffer
# in place list it: the autotuner restores it between its trial runs.
CONFIGS = [dict(num_warps=4, num_stages=1), dict(num_warps=8, num_stages=1)]
KERNELS = {   # name -> (jit function, buffers updated in place)
    "walk_forward": (_walk_forward, ()),
    "walk_backward": (_walk_backward, ("grad_ptr",)),
    "carry_backward": (_carry_backward, ("dx_ptr",)),
    "query_forward": (_query_forward, ()),
    "query_backward_dv": (_query_backward_dv, ()),
    "query_backward_dq": (_query_backward_dq, ()),
    "contraction_forward": (_contraction_forward, ()),
    "contraction_backward": (_contraction_backward, ()),
}
# the shape: any of these a kernel takes (the autotuner skips the others; it adds the dtypes)
AUTOTUNE_KEY = ["T", "M", "D", "R", "DV", "BM", "BD", "BR", "BDV", "PREC"]


def _tuned(name: str):
    fn, in_place = KERNELS[name]
    if INTERPRET:   # one config: the interpreter ignores warps and stages, and cannot time
        return fn
    return triton.autotune(configs=[triton.Config({}, **c) for c in CONFIGS], key=AUTOTUNE_KEY,
                           restore_value=list(in_place))(fn)


_LAUNCHERS: dict = {}
_capture: list | None = None   # planned_launches records (name, grid, args, constexprs) here


def launch(name: str, grid: tuple, *args, **constexprs) -> None:
    """Launch kernel `name` on the device of its tensors (not the current one: eval with
    --device cuda:1), or record the launch for resources.py."""
    if _capture is not None:
        _capture.append((name, grid, args, constexprs))
        return
    if name not in _LAUNCHERS:
        _LAUNCHERS[name] = _tuned(name)
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    if device.type == "cuda":
        with torch.cuda.device(device):
            _LAUNCHERS[name][grid](*args, **constexprs)
    else:
        _LAUNCHERS[name][grid](*args, **constexprs)


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _walk(x, tab, start, sh: Shape, starts):
    """States [B, H, n + 1, 2M, D] (fp32) of one input x [B, N, H, D] from start [B, H, 2M, D]."""
    B, N, H, D = x.shape
    n = -(-N // sh.T)
    BM, BD = sh.walk_blocks(D)
    states = x.new_empty(B, H, n + 1, 2 * sh.M, D, dtype=torch.float32)
    launch("walk_forward", (B * H, sh.M // BM, D // BD), x, *_strides(x), tab["add_in"], tab["lam_re"],
           tab["lam_im"], tab["pow_re"], tab["pow_im"], start, states, starts, N, n, H, D,
           T=sh.T, M=sh.M, BM=BM, BD=BD, PREC=sh.prec)
    return states


def _walk_back(x, dx, tab, states, grad, dend, sh: Shape, starts, grads, BD: int):
    """dL/d(start) of one input; grad holds local_c on entry (G_{c+1} after); adds the carry's
    part to dx and the tables' gradients to `grads`. BD: the input's column block."""
    B, N, H, D = x.shape
    n = grad.shape[2]
    walk_m, walk_d = sh.walk_blocks(D)
    dstart = torch.empty_like(dend)
    launch("walk_backward", (B * H, sh.M // walk_m, D // walk_d), grad, dend, dstart, tab["lam_re"], tab["lam_im"],
           tab["pow_re"], tab["pow_im"], starts, N, n, H, D, T=sh.T, M=sh.M, BM=walk_m, BD=walk_d)
    dadd = x.new_empty(B, H, n, 2 * sh.M, sh.T, dtype=torch.float32)
    dfac = x.new_empty(B, H, n, 2 * sh.M, dtype=torch.float32)
    launch("carry_backward", (B * H, n), x, *_strides(x), dx, tab["add_in"], states, grad, starts, dadd, dfac,
           N, n, H, D, T=sh.T, M=sh.M, BD=BD, PREC=sh.prec)
    grads["add_in"] += dadd.sum((0, 2))
    M = sh.M
    carry = dfac[:, :, :-1].sum((0, 2))          # chunks that carry lambda^T
    grads["lam_re"] += carry[:, :M]
    grads["lam_im"] += carry[:, M:]
    valid = N - (n - 1) * sh.T                   # the last chunk carries lambda^valid
    last = dfac[:, :, -1].sum(0)
    grads["pow_re"][:, valid - 1] += last[:, :M]
    grads["pow_im"][:, valid - 1] += last[:, M:]
    return dstart


QUERY_TABLES = ("lag", "add_in", "lam_re", "lam_im", "pow_re", "pow_im", "gram")
CONTRACTION_TABLES = ("lag", "add_in", "lam_re", "lam_im", "pow_re", "pow_im", "entering", "kernel")


class _TritonCore(torch.autograd.Function):
    """(q or None, k, v, start stacked [B, H, 2M, R + Dv], starts [B, N] int8, *tables)
    -> (out fp32, end state). Every dimension already padded to the kernels' shapes
    (triton_chunked_core does it)."""

    @staticmethod
    def forward(ctx, spec, q, k, v, start, starts, *tables):
        sh, scale, names = spec
        tab = dict(zip(names, tables))
        B, N, H, R = k.shape
        Dv, M = v.shape[-1], sh.M
        n = -(-N // sh.T)
        start_k, start_v = (s.contiguous() for s in start.split([R, Dv], dim=-1))
        states_k, states_v = _walk(k, tab, start_k, sh, starts), _walk(v, tab, start_v, sh, starts)
        if q is None:
            out = k.new_empty(B, N, H, R + Dv, dtype=torch.float32)
            for x, states, part, BD in ((k, states_k, out[..., :R], sh.BR), (v, states_v, out[..., R:], sh.BDV)):
                launch("contraction_forward", (B * H, n), x, *_strides(x), part, *_strides(part), states,
                       tab["entering"], tab["kernel"], starts, N, n, H, x.shape[-1], T=sh.T, M=M, BD=BD,
                       PREC=sh.prec)
        else:
            out = k.new_empty(B, N, H, Dv, dtype=torch.float32)
            launch("query_forward", (B * H, n), q, *_strides(q), k, *_strides(k), v, *_strides(v),
                   out, *_strides(out), states_k, states_v, tab["lag"], tab["pow_re"], tab["pow_im"],
                   tab["gram"], scale, starts, N, n, H, R, Dv, T=sh.T, M=M, BR=sh.BR, BDV=sh.BDV,
                   PREC=sh.prec)
        end = torch.cat([states_k[:, :, -1], states_v[:, :, -1]], dim=-1)
        ctx.spec, ctx.has_q = spec, q is not None
        ctx.save_for_backward(*(x for x in (q, k, v) if x is not None), starts, start_k, start_v, *tables)
        return out, end

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dend):
        sh, scale, names = ctx.spec
        saved = list(ctx.saved_tensors)
        q = saved.pop(0) if ctx.has_q else None
        k, v, starts, start_k, start_v, *tables = saved
        tab = dict(zip(names, tables))
        B, N, H, R = k.shape
        Dv, M, T = v.shape[-1], sh.M, sh.T
        n = -(-N // T)
        # recompute the chunk states (cheaper than keeping [B, H, n, 2M, P] per layer)
        states_k, states_v = _walk(k, tab, start_k, sh, starts), _walk(v, tab, start_v, sh, starts)
        width = (R + Dv) if q is None else Dv
        dout = k.new_zeros(B, N, H, width, dtype=torch.float32) if dout is None else \
            (dout if dout.stride(-1) == 1 else dout.contiguous())
        if dend is None:
            dend = k.new_zeros(B, H, 2 * M, R + Dv, dtype=torch.float32)
        grads = {name: torch.zeros_like(t, dtype=torch.float32) for name, t in tab.items()}
        dk = k.new_empty(B, N, H, R, dtype=torch.float32)
        dv = v.new_empty(B, N, H, Dv, dtype=torch.float32)
        local_k = k.new_empty(B, H, n, 2 * M, R, dtype=torch.float32)
        local_v = k.new_empty(B, H, n, 2 * M, Dv, dtype=torch.float32)
        dq = None
        chunk_part = lambda: k.new_empty(B, H, n, T, 2 * M, dtype=torch.float32)
        if q is None:
            for x, states, part, dx, local, BD in ((k, states_k, dout[..., :R], dk, local_k, sh.BR),
                                                   (v, states_v, dout[..., R:], dv, local_v, sh.BDV)):
                dent, dkern = chunk_part(), k.new_empty(B, H, n, T, T, dtype=torch.float32)
                launch("contraction_backward", (B * H, n), x, *_strides(x), part, *_strides(part), states,
                       tab["entering"], tab["kernel"], dx, local, dent, dkern, starts, N, n, H, x.shape[-1],
                       T=T, M=M, BD=BD, PREC=sh.prec)
                grads["entering"] += dent.sum((0, 2))   # per-chunk partials over batch and chunks
                grads["kernel"] += dkern.sum((0, 2))
        else:
            dq = torch.empty_like(dk)
            p, dr, dlag_v, dpow_v, dlag_k, dpow_k = (chunk_part() for _ in range(6))
            launch("query_backward_dv", (B * H, n), q, *_strides(q), k, *_strides(k), v, *_strides(v),
                   dout, *_strides(dout), states_k, states_v, tab["lag"], tab["pow_re"], tab["pow_im"],
                   tab["gram"], scale, dv, local_v, p, dr, dlag_v, dpow_v, starts, N, n, H, R, Dv,
                   T=T, M=M, BR=sh.BR, BDV=sh.BDV, PREC=sh.prec)
            launch("query_backward_dq", (B * H, n), q, *_strides(q), k, *_strides(k), states_k,
                   tab["lag"], tab["pow_re"], tab["pow_im"], tab["gram"], dr, dq, dk, local_k,
                   dlag_k, dpow_k, starts, N, n, H, R, T=T, M=M, BR=sh.BR, PREC=sh.prec)
            grads["lag"] += dlag_v.sum((0, 2)) + dlag_k.sum((0, 2))   # per-chunk partials, fixed order
            dpow = dpow_v.sum((0, 2)) + dpow_k.sum((0, 2))
            grads["pow_re"] += dpow[..., :M]
            grads["pow_im"] += dpow[..., M:]
            # r = p @ gram over every token: one matmul per head (cuBLAS, deterministic)
            grads["gram"] += torch.einsum("bhti,bhtj->hij", p.view(B, H, n * T, 2 * M), dr.view(B, H, n * T, 2 * M))
        dend_k, dend_v = (g.contiguous() for g in dend.float().split([R, Dv], dim=-1))
        dstart_k = _walk_back(k, dk, tab, states_k, local_k, dend_k, sh, starts, grads, sh.BR)
        dstart_v = _walk_back(v, dv, tab, states_v, local_v, dend_v, sh, starts, grads, sh.BDV)
        dstart = torch.cat([dstart_k, dstart_v], dim=-1)
        cast = lambda g, x: None if x is None else g.to(x.dtype)
        return (None, cast(dq, q), cast(dk, k), cast(dv, v), dstart, None,
                *(grads[name].to(tab[name].dtype) for name in names))


def _pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def _pad_modes(x: torch.Tensor, dim: int, M: int, Mp: int) -> torch.Tensor:
    """Stacked [.., re (M) ; im (M), ..] along dim -> [.., re (Mp) ; im (Mp), ..], zeros between."""
    if M == Mp:
        return x
    re, im = x.split(M, dim=dim)
    return torch.cat([_pad_to(re, dim, Mp), _pad_to(im, dim, Mp)], dim=dim)


def _unpad_modes(x: torch.Tensor, dim: int, M: int, Mp: int) -> torch.Tensor:
    if M == Mp:
        return x
    re, im = x.split(Mp, dim=dim)
    return torch.cat([re.narrow(dim, 0, M), im.narrow(dim, 0, M)], dim=dim)


def core_shape(q, k, v, M: int, chunk_size: int, autocast: bool) -> Shape:
    """The kernels' Shape for a core call (M modes, q None: the contraction readout), after
    checking that they can launch on the tensors' device at it (check_launchable: raises
    KernelUnavailable). chunked.py calls it before building the chunk tables."""
    sh = kernel_shape(chunk_size, M, k.shape[-1], v.shape[-1], q is not None,
                      dot_precision([x.dtype for x in (q, k, v) if x is not None], autocast))
    check_launchable(sh, k.shape[2], (None if q is None else q.dtype, k.dtype, v.dtype), k.device)
    return sh


def triton_chunked_core(q, k, v, tab: dict, start: torch.Tensor, chunk_size: int, scale: float,
                        starts: torch.Tensor | None = None, autocast: bool = False, shape: Shape | None = None):
    """The core on CUDA (or under TRITON_INTERPRET=1): chunked._segment's numbers for the whole
    sequence. q, k [B, N, H, R] (q None: contraction readout), v [B, N, H, Dv], any float
    dtype; tab from chunk_tables(chunk_size=T) with T a power of two >= 16; start stacked
    [B, H, 2M, R + Dv]. Returns (out fp32 [B, N, H, Dv] or [B, N, H, R + Dv], stacked end state).

    M, R and Dv are zero-padded to the kernels' shapes (padded_width): padded modes have zero
    tables (no input, no decay, no readout), padded key columns add nothing to q . k, padded
    value columns are cut from the output; padding is differentiable, so gradients come back
    to the unpadded tensors. starts [B, N] bool (ssm.document_starts) or None: packed documents
    (None runs the same kernels with no start anywhere: every mask is ones). autocast: the
    caller ran under autocast (the dot precision follows it, dot_precision). shape: core_shape's
    result when the caller has it already."""
    T = chunk_size
    if k.shape[1] == 0:
        raise ValueError("the Triton core needs at least one token")
    if T != _pow2(T):
        raise ValueError(f"the Triton core needs a chunk size that is a power of two >= {MIN_DOT}, got {T}")
    B, N, H, R = k.shape
    Dv, M = v.shape[-1], tab["pow_re"].shape[-1]
    sh = shape or core_shape(q, k, v, M, T, autocast)
    Rp, Dp, Mp = sh.R, sh.DV, sh.M
    names = QUERY_TABLES if q is not None else CONTRACTION_TABLES
    padded = {
        "lag": _pad_modes(tab["lag"], -1, M, Mp), "add_in": _pad_modes(tab["add_in"], -2, M, Mp),
        "lam_re": _pad_to(tab["lam_re"][..., 0], -1, Mp), "lam_im": _pad_to(tab["lam_im"][..., 0], -1, Mp),
        "pow_re": _pad_to(tab["pow_re"], -1, Mp), "pow_im": _pad_to(tab["pow_im"], -1, Mp)}
    if q is not None:
        padded["gram"] = _pad_modes(_pad_modes(tab["gram"], -1, M, Mp), -2, M, Mp)
    else:
        padded["entering"] = _pad_modes(tab["entering"], -1, M, Mp)
        padded["kernel"] = tab["kernel"]
    tables = [padded[name].float().contiguous() for name in names]
    q_p = None if q is None else _pad_to(q, -1, Rp)
    k_p, v_p = _pad_to(k, -1, Rp), _pad_to(v, -1, Dp)
    ensure = lambda x: x if x is None or x.stride(-1) == 1 else x.contiguous()
    q_p, k_p, v_p = ensure(q_p), ensure(k_p), ensure(v_p)
    s_k, s_v = start.split([R, Dv], dim=-1)
    start_p = _pad_modes(torch.cat([_pad_to(s_k, -1, Rp), _pad_to(s_v, -1, Dp)], -1), -2, M, Mp).float()
    starts = torch.zeros(B, N, dtype=torch.int8, device=k.device) if starts is None else \
        starts.to(torch.int8).contiguous()
    out, end = _TritonCore.apply((sh, float(scale), names), q_p, k_p, v_p, start_p.contiguous(), starts, *tables)
    if q is None:
        out = torch.cat([out[..., :R], out[..., Rp:Rp + Dv]], dim=-1)
    else:
        out = out[..., :Dv]
    end = torch.cat([end[..., :R], end[..., Rp:Rp + Dv]], dim=-1)
    return out, _unpad_modes(end, -2, M, Mp)


# ------------------------------------------------------------ can the kernels launch here?

class KernelUnavailable(RuntimeError):
    """A kernel of the core cannot launch here (shared memory over the GPU's limit, a compile
    error, an unsupported GPU); the one-line message names the kernel, the shape and the limit."""


class _Saved:
    """What autograd's ctx gives _TritonCore.forward/backward, for planned_launches."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def describe(sh: Shape) -> str:
    readout = "query readout" if sh.query else "contraction readout"
    return f"T={sh.T} M={sh.M} R={sh.R} Dv={sh.DV} ({readout}, {sh.prec} dots)"


def planned_launches(sh: Shape, H: int, dtypes, device, B: int = 1) -> list:
    """Every launch (name, grid, args, constexprs) of one forward + backward of a core call at
    this shape, head count and input dtypes (q or None, k, v), recorded instead of run: what
    check_launchable compiles on a GPU and resources.py compiles for one on this machine.
    A two-chunk sequence stands for any length (lengths are not specialised)."""
    global _capture
    N, T, M = sh.T + 1, sh.T, sh.M
    zeros = lambda *size, dtype=torch.float32: torch.zeros(*size, dtype=dtype, device=device)
    q = zeros(B, N, H, sh.R, dtype=dtypes[0]) if sh.query else None
    k, v = zeros(B, N, H, sh.R, dtype=dtypes[1]), zeros(B, N, H, sh.DV, dtype=dtypes[2])
    names = QUERY_TABLES if sh.query else CONTRACTION_TABLES
    sizes = dict(lag=(H, T, 2 * M), add_in=(H, 2 * M, T), lam_re=(H, M), lam_im=(H, M), pow_re=(H, T, M),
                 pow_im=(H, T, M), gram=(H, 2 * M, 2 * M), entering=(H, T, 2 * M), kernel=(H, T, T))
    start = zeros(B, H, 2 * M, sh.R + sh.DV)
    starts = zeros(B, N, dtype=torch.int8)
    _capture = []
    try:
        ctx = _Saved()
        with torch.no_grad():
            out, end = _TritonCore.forward(ctx, (sh, 1.0, names), q, k, v, start, starts,
                                           *(zeros(*sizes[name]) for name in names))
            _TritonCore.backward(ctx, torch.zeros_like(out), torch.zeros_like(end))
        return _capture
    finally:
        _capture = None


_LAUNCHABLE: dict = {}


def check_launchable(sh: Shape, H: int, dtypes, device: torch.device) -> None:
    """Raise KernelUnavailable unless every kernel of a forward + backward at this shape can
    launch on `device` with at least one of CONFIGS (the autotuner skips the others). Compiles
    them once per shape (the launches reuse the compiled kernels); CPU (interpreter): nothing
    to check."""
    key = (sh, H, tuple(dtypes), str(device))
    if key not in _LAUNCHABLE:
        _LAUNCHABLE[key] = _launch_problem(sh, H, dtypes, device)
    if _LAUNCHABLE[key]:
        raise KernelUnavailable(_LAUNCHABLE[key])


def _gpu(device: torch.device) -> tuple[str, int, int] | None:
    """(name, major, minor) of a CUDA device, None for any other (tests simulate a GPU here)."""
    if device.type != "cuda":
        return None
    return (torch.cuda.get_device_name(device), *torch.cuda.get_device_capability(device))


def _load(name: str, grid, args, config: dict, constexprs: dict) -> None:
    """Compile one kernel for the current GPU and load it, as its first launch would: raises
    OutOfResources (shared memory over the limit), PTXASError, CompilationError, ..."""
    KERNELS[name][0].warmup(*args, grid=grid, **config, **constexprs)._init_handles()


def _launch_problem(sh: Shape, H: int, dtypes, device: torch.device) -> str | None:
    gpu = _gpu(device)
    if gpu is None:
        return None
    gpu_name, major, minor = gpu
    gpu = f"{gpu_name} (sm_{major}{minor})"
    if major < 8:
        return f"the Triton core needs an sm_80 or newer GPU (tensor-core tf32 dots); this is {gpu}"
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for name, grid, args, constexprs in planned_launches(sh, H, dtypes, device):
            failures = []
            for config in CONFIGS:
                try:
                    _load(name, grid, args, config, constexprs)
                    break
                except Exception as error:   # OutOfResources, PTXASError, CompilationError, ...
                    failures.append(f"num_warps={config['num_warps']}: {str(error).splitlines()[0]}")
            else:
                return f"Triton kernel {name} at {describe(sh)} cannot launch on {gpu}: " + "; ".join(failures)
    return None
