"""The chunked interdomain / S4D core as Triton kernels: forward and backward, for CUDA.

The algorithm and the parameter-only tables are chunked.py's (`chunk_tables`, `_segment`, read
that docstring first); the kernels fuse what the PyTorch form does in many small launches.
Following flash-linear-attention's chunk kernels (Yang et al.; chunk_fwd_h / chunk_fwd_o /
chunk_bwd_dh), two kinds of kernel split the work:

  * a sequential walk over the chunks, one program per (batch, head, block of state columns),
    carrying the stacked state S = [S_re ; S_im] [2M, D] in registers:
        forward   S_{c+1} = lambda^T (.) S_c + add_in @ z_c          (writes every S_c)
        backward  dS_c    = conj(lambda^T) (.) dS_{c+1} + dS_c(local) (and dz_c, d add_in, d lambda)
    The key and value halves of the state never mix in the carry, so each input (k, v) walks
    on its own.
  * a fully parallel kernel over (batch, head, chunk) for the outputs (forward) and for every
    per-chunk gradient (backward), which recomputes the chunk's intermediates from its entering
    state instead of storing them.
The intra-chunk sums over j are matmuls with the lag kernel K [T, 2M] after the [T, T] scores
are re-indexed by lag (chunked.lag_to_position; here `tl.gather` on the tile), so every
contraction is a `tl.dot` and no negative power of lambda is formed (stable for any Delta).

Memory: the forward keeps its inputs and the entering state only; the backward recomputes the
chunk states with the forward walk (one extra cheap kernel) rather than storing them.

Precision: inputs may be bf16, fp16 or fp32; everything is loaded as fp32 and accumulated in
fp32 (tables come from chunk_tables in float64, cast to fp32). Dots run in IEEE fp32
[our choice until a GPU measures TF32 against the accuracy tests: DOT_PRECISION].
Shapes the kernels want (powers of two, >= 16 for tl.dot) are reached by zero padding in
`triton_chunked_core`: padded modes, key and value columns contribute exactly zero.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

if not hasattr(tl, "gather"):   # an older triton: the PyTorch forms are used instead (chunked.py)
    raise ImportError(f"the Triton core needs triton >= 3.3 (tl.gather); this is triton {triton.__version__}")

DOT_PRECISION = "ieee"
MIN_DOT = 16   # tl.dot needs every dimension >= 16


def _dims(t: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(t))


def kernel_chunk(chunk_size: int) -> int:
    """The chunk the kernels run: model.chunk_size when it is a power of two >= 16, else the
    next such size (the chunked algorithm is exact for every chunk size)."""
    return _dims(chunk_size)


# ----------------------------------------------------------------- the chunk-to-chunk walks

@triton.jit
def _walk_program(add_ptr, lam_re_ptr, lam_im_ptr, H,
                  T: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """What both walks load first: this program's (batch, head, block of D columns), the
    chunk's input-to-state table add_in [2M, T] and the carry lambda^T, re and im apart."""
    bh, db = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    m = tl.arange(0, M)
    t = tl.arange(0, T)
    d = db * BD + tl.arange(0, BD)
    a_re = tl.load(add_ptr + h * 2 * M * T + m[:, None] * T + t[None, :])
    a_im = tl.load(add_ptr + h * 2 * M * T + (M + m[:, None]) * T + t[None, :])
    l_re = tl.load(lam_re_ptr + h * M + m)[:, None]
    l_im = tl.load(lam_im_ptr + h * M + m)[:, None]
    return bh, b, h, m, t, d, a_re, a_im, l_re, l_im, m[:, None] * D + d[None, :], (M + m[:, None]) * D + d[None, :]


@triton.jit
def _walk_forward(x_ptr, sx_b, sx_n, sx_h, add_ptr, lam_re_ptr, lam_im_ptr, pow_re_ptr, pow_im_ptr,
                  start_ptr, states_ptr, starts_ptr, N, n_chunks, H,
                  T: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                  PREC: tl.constexpr, DOCS: tl.constexpr):
    """x [B, N, H, D]: one input (k or v); add [H, 2M, T]; lam_* [H, M] (lambda^T);
    pow_* [H, T, M] (lambda^{i+1}); start [B, H, 2M, D]; states [B, H, n + 1, 2M, D]: the state
    entering each chunk, then the exact state after token N (the last chunk may be partial).
    DOCS: starts [B, N] int8 marks tokens that begin a packed document (_document_carry)."""
    bh, b, h, m, t, d, a_re, a_im, l_re, l_im, rows_re, rows_im = _walk_program(
        add_ptr, lam_re_ptr, lam_im_ptr, H, T=T, M=M, D=D, BD=BD)
    s_re = tl.load(start_ptr + bh * 2 * M * D + rows_re)
    s_im = tl.load(start_ptr + bh * 2 * M * D + rows_im)
    out = states_ptr + bh * (n_chunks + 1) * 2 * M * D
    x_base = x_ptr + b * sx_b + h * sx_h + d[None, :]
    for c in range(n_chunks - 1):
        tl.store(out + c * 2 * M * D + rows_re, s_re)
        tl.store(out + c * 2 * M * D + rows_im, s_im)
        z = tl.load(x_base + (c * T + t)[:, None] * sx_n).to(tl.float32)                # [T, BD]
        c_re, c_im = l_re, l_im
        if DOCS:
            keep, last = _document_carry(starts_ptr + b * N + c * T + t, t >= 0)
            z = z * last[:, None]
            c_re, c_im = c_re * keep, c_im * keep
        new_re = c_re * s_re - c_im * s_im + tl.dot(a_re, z, input_precision=PREC)
        s_im = c_im * s_re + c_re * s_im + tl.dot(a_im, z, input_precision=PREC)
        s_re = new_re
    # the last chunk holds `valid` real tokens: shift them to its end, so that add_in's columns
    # (lambda^{T-1-j}) and lambda^valid (instead of lambda^T) give the exact state after token N
    c = n_chunks - 1
    tl.store(out + c * 2 * M * D + rows_re, s_re)
    tl.store(out + c * 2 * M * D + rows_im, s_im)
    valid = N - c * T
    shift = T - valid
    real = t >= shift
    z = tl.load(x_base + (c * T + t - shift)[:, None] * sx_n, mask=real[:, None], other=0.0).to(tl.float32)
    v_re = tl.load(pow_re_ptr + h * T * M + (valid - 1) * M + m)[:, None]
    v_im = tl.load(pow_im_ptr + h * T * M + (valid - 1) * M + m)[:, None]
    if DOCS:
        keep, last = _document_carry(starts_ptr + b * N + c * T + t - shift, real)
        z = z * last[:, None]
        v_re, v_im = v_re * keep, v_im * keep
    new_re = v_re * s_re - v_im * s_im + tl.dot(a_re, z, input_precision=PREC)
    s_im = v_im * s_re + v_re * s_im + tl.dot(a_im, z, input_precision=PREC)
    tl.store(out + n_chunks * 2 * M * D + rows_re, new_re)
    tl.store(out + n_chunks * 2 * M * D + rows_im, s_im)


@triton.jit
def _walk_backward(x_ptr, sx_b, sx_n, sx_h, dx_ptr, sd_b, sd_n, sd_h, add_ptr, lam_re_ptr, lam_im_ptr,
                   pow_re_ptr, pow_im_ptr, states_ptr, local_ptr, dend_ptr, dstart_ptr,
                   dadd_ptr, dlam_re_ptr, dlam_im_ptr, dpow_re_ptr, dpow_im_ptr, starts_ptr, N, n_chunks, H,
                   T: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                   PREC: tl.constexpr, DOCS: tl.constexpr):
    """The forward walk's transpose, from the last chunk to the first. g = dL/dS_{c+1}:
        dz_c += add_in^T g             (added into dx, which holds the outputs' part already)
        d add_in += g z_c^T,  d lambda^T += sum_d g conj(S_c),  g <- conj(lambda^T) g + local_c
    local [B, H, n, 2M, D]: dL/dS_c through chunk c's own outputs; dend [B, H, 2M, D]."""
    bh, b, h, m, t, d, a_re, a_im, l_re, l_im, rows_re, rows_im = _walk_program(
        add_ptr, lam_re_ptr, lam_im_ptr, H, T=T, M=M, D=D, BD=BD)
    g_re = tl.load(dend_ptr + bh * 2 * M * D + rows_re)
    g_im = tl.load(dend_ptr + bh * 2 * M * D + rows_im)
    states = states_ptr + bh * (n_chunks + 1) * 2 * M * D
    local = local_ptr + bh * n_chunks * 2 * M * D
    x_base = x_ptr + b * sx_b + h * sx_h + d[None, :]
    dx_base = dx_ptr + b * sd_b + h * sd_h + d[None, :]
    # the last (possibly partial) chunk, as in _walk_forward
    c = n_chunks - 1
    valid = N - c * T
    shift = T - valid
    real = (t >= shift)[:, None]
    s_re = tl.load(states + c * 2 * M * D + rows_re)
    s_im = tl.load(states + c * 2 * M * D + rows_im)
    z = tl.load(x_base + (c * T + t - shift)[:, None] * sx_n, mask=real, other=0.0).to(tl.float32)
    keep = 1.0
    dz = tl.dot(tl.trans(a_re), g_re, input_precision=PREC) + tl.dot(tl.trans(a_im), g_im, input_precision=PREC)
    if DOCS:
        keep, last = _document_carry(starts_ptr + b * N + c * T + t - shift, t >= shift)
        z = z * last[:, None]
        dz = dz * last[:, None]
    dx_last = dx_base + (c * T + t - shift)[:, None] * sd_n
    tl.store(dx_last, tl.load(dx_last, mask=real, other=0.0) + dz, mask=real)
    dadd_re = tl.dot(g_re, tl.trans(z), input_precision=PREC)
    dadd_im = tl.dot(g_im, tl.trans(z), input_precision=PREC)
    v_re = tl.load(pow_re_ptr + h * T * M + (valid - 1) * M + m)[:, None] * keep
    v_im = tl.load(pow_im_ptr + h * T * M + (valid - 1) * M + m)[:, None] * keep
    tl.atomic_add(dpow_re_ptr + h * T * M + (valid - 1) * M + m, tl.sum(g_re * s_re + g_im * s_im, axis=1) * keep)
    tl.atomic_add(dpow_im_ptr + h * T * M + (valid - 1) * M + m, tl.sum(g_im * s_re - g_re * s_im, axis=1) * keep)
    new_re = v_re * g_re + v_im * g_im + tl.load(local + c * 2 * M * D + rows_re)
    g_im = v_re * g_im - v_im * g_re + tl.load(local + c * 2 * M * D + rows_im)
    g_re = new_re
    dl_re = tl.zeros([M], dtype=tl.float32)
    dl_im = tl.zeros([M], dtype=tl.float32)
    for back in range(n_chunks - 1):
        c = n_chunks - 2 - back
        s_re = tl.load(states + c * 2 * M * D + rows_re)
        s_im = tl.load(states + c * 2 * M * D + rows_im)
        z = tl.load(x_base + (c * T + t)[:, None] * sx_n).to(tl.float32)
        dz = tl.dot(tl.trans(a_re), g_re, input_precision=PREC) + tl.dot(tl.trans(a_im), g_im, input_precision=PREC)
        c_re, c_im = l_re, l_im
        keep = 1.0
        if DOCS:
            keep, last = _document_carry(starts_ptr + b * N + c * T + t, t >= 0)
            z = z * last[:, None]
            dz = dz * last[:, None]
            c_re, c_im = c_re * keep, c_im * keep
        dx_here = dx_base + (c * T + t)[:, None] * sd_n
        tl.store(dx_here, tl.load(dx_here) + dz)
        dadd_re += tl.dot(g_re, tl.trans(z), input_precision=PREC)
        dadd_im += tl.dot(g_im, tl.trans(z), input_precision=PREC)
        dl_re += tl.sum(g_re * s_re + g_im * s_im, axis=1) * keep
        dl_im += tl.sum(g_im * s_re - g_re * s_im, axis=1) * keep
        new_re = c_re * g_re + c_im * g_im + tl.load(local + c * 2 * M * D + rows_re)
        g_im = c_re * g_im - c_im * g_re + tl.load(local + c * 2 * M * D + rows_im)
        g_re = new_re
    tl.store(dstart_ptr + bh * 2 * M * D + rows_re, g_re)
    tl.store(dstart_ptr + bh * 2 * M * D + rows_im, g_im)
    tl.atomic_add(dadd_ptr + h * 2 * M * T + m[:, None] * T + t[None, :], dadd_re)
    tl.atomic_add(dadd_ptr + h * 2 * M * T + (M + m[:, None]) * T + t[None, :], dadd_im)
    tl.atomic_add(dlam_re_ptr + h * M + m, dl_re)
    tl.atomic_add(dlam_im_ptr + h * M + m, dl_im)


# ------------------------------------------------------------- per-chunk outputs and grads

@triton.jit
def _document_carry(starts_ptrs, real):
    """For one chunk's tokens (ops/interdomain/chunked.document_masks): keep = 1.0 when no
    document starts in it (the entering state survives the chunk), and last [T]: the tokens
    in the chunk's last document (those that reach the next chunk)."""
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
def _lag_view(x, t, T: tl.constexpr):
    """chunked.lag_to_position on a [T, T] tile: (i, a) -> x[i, i - a], zero where a > i."""
    causal = t[None, :] <= t[:, None]
    return tl.where(causal, tl.gather(x, tl.where(causal, t[:, None] - t[None, :], 0), axis=1), 0.0)


@triton.jit
def _query_chunk(q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, v_ptr, sv_b, sv_n, sv_h,
                 states_k_ptr, states_v_ptr, lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, starts_ptr,
                 N, n_chunks, b, h, bh, c,
                 T: tl.constexpr, M: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
                 PREC: tl.constexpr, DOCS: tl.constexpr):
    """One chunk of the query readout (chunked._segment), its inputs loaded and its
    intermediates computed, for _query_forward and (recomputed) _query_backward: with
    a = q S_k^T, w = lambda^{i+1},
        p = a (.) w + lag(q k^T) @ K,   r = p @ gram,   W = lag(r @ K^T),
        out = (Re((r (.) conj w)^T S_v) + W v) * scale.
    DOCS (packed documents): the entering-state terms only reach tokens before the chunk's
    first document start (enter), and pairs (i, j) only count within one document (same);
    a, u, scores and weights come back masked (enter and same are ones without DOCS)."""
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    r_ = tl.arange(0, R)
    d = tl.arange(0, DV)
    tok = (c * T + t)[:, None]
    real = tok < N
    q = tl.load(q_ptr + b * sq_b + tok * sq_n + h * sq_h + r_[None, :], mask=real, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * sk_b + tok * sk_n + h * sk_h + r_[None, :], mask=real, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * sv_b + tok * sv_n + h * sv_h + d[None, :], mask=real, other=0.0).to(tl.float32)
    Sk = states_k_ptr + (bh * (n_chunks + 1) + c) * 2 * M * R
    Sv = states_v_ptr + (bh * (n_chunks + 1) + c) * 2 * M * DV
    sk_re = tl.load(Sk + m[:, None] * R + r_[None, :])
    sk_im = tl.load(Sk + (M + m[:, None]) * R + r_[None, :])
    sv_re = tl.load(Sv + m[:, None] * DV + d[None, :])
    sv_im = tl.load(Sv + (M + m[:, None]) * DV + d[None, :])
    w_re = tl.load(pow_re_ptr + h * T * M + t[:, None] * M + m[None, :])
    w_im = tl.load(pow_im_ptr + h * T * M + t[:, None] * M + m[None, :])
    lag_re = tl.load(lag_ptr + h * T * 2 * M + t[:, None] * 2 * M + m[None, :])
    lag_im = tl.load(lag_ptr + h * T * 2 * M + t[:, None] * 2 * M + M + m[None, :])
    G = gram_ptr + h * 4 * M * M
    g_rr = tl.load(G + m[:, None] * 2 * M + m[None, :])
    g_ri = tl.load(G + m[:, None] * 2 * M + M + m[None, :])
    g_ir = tl.load(G + (M + m[:, None]) * 2 * M + m[None, :])
    g_ii = tl.load(G + (M + m[:, None]) * 2 * M + M + m[None, :])

    a_re = tl.dot(q, tl.trans(sk_re), input_precision=PREC)
    a_im = tl.dot(q, tl.trans(sk_im), input_precision=PREC)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    enter = tl.full([T], 1.0, tl.float32)
    same = tl.full([T, T], 1.0, tl.float32)
    if DOCS:
        enter, same = _document_pairs(starts_ptr + b * N + c * T + t, t < N - c * T)
        a_re, a_im, qk = a_re * enter[:, None], a_im * enter[:, None], qk * same
    scores = _lag_view(qk, t, T)
    p_re = a_re * w_re - a_im * w_im + tl.dot(scores, lag_re, input_precision=PREC)
    p_im = a_re * w_im + a_im * w_re + tl.dot(scores, lag_im, input_precision=PREC)
    r_re = tl.dot(p_re, g_rr, input_precision=PREC) + tl.dot(p_im, g_ir, input_precision=PREC)
    r_im = tl.dot(p_re, g_ri, input_precision=PREC) + tl.dot(p_im, g_ii, input_precision=PREC)
    u_re = r_re * w_re + r_im * w_im
    u_im = r_im * w_re - r_re * w_im
    weights = _lag_view(tl.dot(r_re, tl.trans(lag_re), input_precision=PREC) +
                        tl.dot(r_im, tl.trans(lag_im), input_precision=PREC), t, T)
    if DOCS:
        u_re, u_im, weights = u_re * enter[:, None], u_im * enter[:, None], weights * same
    return (q, k, v, sk_re, sk_im, sv_re, sv_im, w_re, w_im, lag_re, lag_im, g_rr, g_ri, g_ir, g_ii,
            a_re, a_im, scores, p_re, p_im, r_re, r_im, u_re, u_im, weights, enter, same)


@triton.jit
def _query_forward(q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, v_ptr, sv_b, sv_n, sv_h,
                   out_ptr, so_b, so_n, so_h, states_k_ptr, states_v_ptr,
                   lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, scale, starts_ptr, N, n_chunks, H,
                   T: tl.constexpr, M: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
                   PREC: tl.constexpr, DOCS: tl.constexpr):
    """The outputs of one chunk of the query readout (_query_chunk)."""
    bh, c = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    (q, k, v, sk_re, sk_im, sv_re, sv_im, w_re, w_im, lag_re, lag_im, g_rr, g_ri, g_ir, g_ii,
     a_re, a_im, scores, p_re, p_im, r_re, r_im, u_re, u_im, weights, enter, same) = _query_chunk(
        q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, v_ptr, sv_b, sv_n, sv_h, states_k_ptr, states_v_ptr,
        lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, starts_ptr, N, n_chunks, b, h, bh, c,
        T=T, M=M, R=R, DV=DV, PREC=PREC, DOCS=DOCS)
    o = tl.dot(u_re, sv_re, input_precision=PREC) + tl.dot(u_im, sv_im, input_precision=PREC) + \
        tl.dot(weights, v, input_precision=PREC)
    tok = (c * T + tl.arange(0, T))[:, None]
    tl.store(out_ptr + b * so_b + tok * so_n + h * so_h + tl.arange(0, DV)[None, :], o * scale, mask=tok < N)


@triton.jit
def _query_backward(q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, v_ptr, sv_b, sv_n, sv_h,
                    do_ptr, sdo_b, sdo_n, sdo_h, states_k_ptr, states_v_ptr,
                    lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, scale,
                    dq_ptr, dk_ptr, dv_ptr, local_k_ptr, local_v_ptr,
                    dlag_ptr, dpow_re_ptr, dpow_im_ptr, dgram_ptr, starts_ptr, N, n_chunks, H,
                    T: tl.constexpr, M: tl.constexpr, R: tl.constexpr, DV: tl.constexpr,
                    PREC: tl.constexpr, DOCS: tl.constexpr):
    """Every gradient of one chunk of _query_forward, its intermediates recomputed, in reverse
    order of the forward. dq, dk, dv [B, N, H, .] fp32 contiguous (dk, dv: the outputs' part;
    _walk_backward adds the carry's); local_* [B, H, n, 2M, .]: dL/d(entering state) through
    this chunk's outputs; the table gradients are summed over (batch, chunk) atomically."""
    bh, c = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    r_ = tl.arange(0, R)
    d = tl.arange(0, DV)
    tok = (c * T + t)[:, None]
    real = tok < N
    # recompute the forward (a, u, scores and weights carry the document masks, as there)
    (q, k, v, sk_re, sk_im, sv_re, sv_im, w_re, w_im, lag_re, lag_im, g_rr, g_ri, g_ir, g_ii,
     a_re, a_im, scores, p_re, p_im, r_re, r_im, u_re, u_im, weights, enter, same) = _query_chunk(
        q_ptr, sq_b, sq_n, sq_h, k_ptr, sk_b, sk_n, sk_h, v_ptr, sv_b, sv_n, sv_h, states_k_ptr, states_v_ptr,
        lag_ptr, pow_re_ptr, pow_im_ptr, gram_ptr, starts_ptr, N, n_chunks, b, h, bh, c,
        T=T, M=M, R=R, DV=DV, PREC=PREC, DOCS=DOCS)
    do = tl.load(do_ptr + b * sdo_b + tok * sdo_n + h * sdo_h + d[None, :], mask=real, other=0.0).to(tl.float32)
    do = do * scale
    tm = h * T * M + t[:, None] * M + m[None, :]
    tl2m = h * T * 2 * M + t[:, None] * 2 * M + m[None, :]
    gm = h * 4 * M * M + m[:, None] * 2 * M + m[None, :]
    do_state = do
    dw_pos = tl.dot(do, tl.trans(v), input_precision=PREC)
    if DOCS:
        do_state, dw_pos = do * enter[:, None], dw_pos * same
    # out = (u_re S_v,re + u_im S_v,im) [enter] + W [same] v
    L = (bh * n_chunks + c) * 2 * M
    tl.store(local_v_ptr + L * DV + m[:, None] * DV + d[None, :], tl.dot(tl.trans(u_re), do, input_precision=PREC))
    tl.store(local_v_ptr + L * DV + (M + m[:, None]) * DV + d[None, :], tl.dot(tl.trans(u_im), do, input_precision=PREC))
    du_re = tl.dot(do_state, tl.trans(sv_re), input_precision=PREC)
    du_im = tl.dot(do_state, tl.trans(sv_im), input_precision=PREC)
    tl.store(dv_ptr + ((b * N + tok) * H + h) * DV + d[None, :], tl.dot(tl.trans(weights), do, input_precision=PREC),
             mask=real)
    dweights = _lag_view(dw_pos, t, T)   # by lag (the map is its own inverse)
    # W = lag(r K^T) and u = r (.) conj(w)
    dr_re = tl.dot(dweights, lag_re, input_precision=PREC) + du_re * w_re - du_im * w_im
    dr_im = tl.dot(dweights, lag_im, input_precision=PREC) + du_re * w_im + du_im * w_re
    dlag_re = tl.dot(tl.trans(dweights), r_re, input_precision=PREC)
    dlag_im = tl.dot(tl.trans(dweights), r_im, input_precision=PREC)
    dw_re = du_re * r_re + du_im * r_im
    dw_im = du_re * r_im - du_im * r_re
    # r = p @ gram
    dp_re = tl.dot(dr_re, tl.trans(g_rr), input_precision=PREC) + tl.dot(dr_im, tl.trans(g_ri), input_precision=PREC)
    dp_im = tl.dot(dr_re, tl.trans(g_ir), input_precision=PREC) + tl.dot(dr_im, tl.trans(g_ii), input_precision=PREC)
    tl.atomic_add(dgram_ptr + gm, tl.dot(tl.trans(p_re), dr_re, input_precision=PREC))
    tl.atomic_add(dgram_ptr + gm + M, tl.dot(tl.trans(p_re), dr_im, input_precision=PREC))
    tl.atomic_add(dgram_ptr + gm + 2 * M * M, tl.dot(tl.trans(p_im), dr_re, input_precision=PREC))
    tl.atomic_add(dgram_ptr + gm + 2 * M * M + M, tl.dot(tl.trans(p_im), dr_im, input_precision=PREC))
    # p = a (.) w + lag(q k^T) @ K
    dscores = _lag_view(tl.dot(dp_re, tl.trans(lag_re), input_precision=PREC) +
                        tl.dot(dp_im, tl.trans(lag_im), input_precision=PREC), t, T)
    dp_state_re, dp_state_im = dp_re, dp_im
    if DOCS:
        dscores = dscores * same
        dp_state_re, dp_state_im = dp_re * enter[:, None], dp_im * enter[:, None]
    dlag_re += tl.dot(tl.trans(scores), dp_re, input_precision=PREC)
    dlag_im += tl.dot(tl.trans(scores), dp_im, input_precision=PREC)
    tl.atomic_add(dlag_ptr + tl2m, dlag_re)
    tl.atomic_add(dlag_ptr + tl2m + M, dlag_im)
    dw_re += dp_re * a_re + dp_im * a_im   # a is masked already: no term where the state is cut
    dw_im += dp_im * a_re - dp_re * a_im
    tl.atomic_add(dpow_re_ptr + tm, dw_re)
    tl.atomic_add(dpow_im_ptr + tm, dw_im)
    da_re = dp_state_re * w_re + dp_state_im * w_im
    da_im = dp_state_im * w_re - dp_state_re * w_im
    # a = q S_k^T
    tl.store(local_k_ptr + L * R + m[:, None] * R + r_[None, :], tl.dot(tl.trans(da_re), q, input_precision=PREC))
    tl.store(local_k_ptr + L * R + (M + m[:, None]) * R + r_[None, :], tl.dot(tl.trans(da_im), q, input_precision=PREC))
    dq = tl.dot(dscores, k, input_precision=PREC) + tl.dot(da_re, sk_re, input_precision=PREC) + \
        tl.dot(da_im, sk_im, input_precision=PREC)
    tl.store(dq_ptr + ((b * N + tok) * H + h) * R + r_[None, :], dq, mask=real)
    tl.store(dk_ptr + ((b * N + tok) * H + h) * R + r_[None, :],
             tl.dot(tl.trans(dscores), q, input_precision=PREC), mask=real)


@triton.jit
def _contraction_chunk(x_ptr, sx_b, sx_n, sx_h, states_ptr, ent_ptr, kern_ptr, N, n_chunks, b, h, bh, c,
                       T: tl.constexpr, M: tl.constexpr, D: tl.constexpr):
    """One chunk's input x [T, D], entering state (re, im) and the readout tables E [T, 2M] and
    Kern [T, T] of the contraction readout, with the index tiles the backward's atomics reuse."""
    t = tl.arange(0, T)
    m = tl.arange(0, M)
    d = tl.arange(0, D)
    tok = (c * T + t)[:, None]
    real = tok < N
    x = tl.load(x_ptr + b * sx_b + tok * sx_n + h * sx_h + d[None, :], mask=real, other=0.0).to(tl.float32)
    S = states_ptr + (bh * (n_chunks + 1) + c) * 2 * M * D
    s_re = tl.load(S + m[:, None] * D + d[None, :])
    s_im = tl.load(S + (M + m[:, None]) * D + d[None, :])
    et = h * T * 2 * M + t[:, None] * 2 * M + m[None, :]
    kt = h * T * T + t[:, None] * T + t[None, :]
    return (t, m, d, tok, real, x, s_re, s_im, et, tl.load(ent_ptr + et), tl.load(ent_ptr + et + M), kt,
            tl.load(kern_ptr + kt))


@triton.jit
def _contraction_forward(x_ptr, sx_b, sx_n, sx_h, out_ptr, so_b, so_n, so_h, states_ptr,
                         ent_ptr, kern_ptr, starts_ptr, N, n_chunks, H,
                         T: tl.constexpr, M: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
                         DOCS: tl.constexpr):
    """Linear contraction readout for one input (k or v) and chunk: out = E @ S_c + Kern @ x_c,
    E = tab["entering"] [H, T, 2M], Kern = tab["kernel"] [H, T, T] (S4D's causal kernel)."""
    bh, c = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t, m, d, tok, real, x, s_re, s_im, et, e_re, e_im, kt, kern = _contraction_chunk(
        x_ptr, sx_b, sx_n, sx_h, states_ptr, ent_ptr, kern_ptr, N, n_chunks, b, h, bh, c, T=T, M=M, D=D)
    if DOCS:
        enter, same = _document_pairs(starts_ptr + b * N + c * T + t, t < N - c * T)
        e_re, e_im, kern = e_re * enter[:, None], e_im * enter[:, None], kern * same
    o = tl.dot(e_re, s_re, input_precision=PREC) + tl.dot(e_im, s_im, input_precision=PREC) + \
        tl.dot(kern, x, input_precision=PREC)
    tl.store(out_ptr + b * so_b + tok * so_n + h * so_h + d[None, :], o, mask=real)


@triton.jit
def _contraction_backward(x_ptr, sx_b, sx_n, sx_h, do_ptr, sdo_b, sdo_n, sdo_h, states_ptr,
                          ent_ptr, kern_ptr, dx_ptr, local_ptr, dent_ptr, dkern_ptr, starts_ptr, N, n_chunks, H,
                          T: tl.constexpr, M: tl.constexpr, D: tl.constexpr, PREC: tl.constexpr,
                          DOCS: tl.constexpr):
    bh, c = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    t, m, d, tok, real, x, s_re, s_im, et, e_re, e_im, kt, kern = _contraction_chunk(
        x_ptr, sx_b, sx_n, sx_h, states_ptr, ent_ptr, kern_ptr, N, n_chunks, b, h, bh, c, T=T, M=M, D=D)
    do = tl.load(do_ptr + b * sdo_b + tok * sdo_n + h * sdo_h + d[None, :], mask=real, other=0.0).to(tl.float32)
    do_state = do
    dkern = tl.dot(do, tl.trans(x), input_precision=PREC)
    if DOCS:   # out = (E @ S) [enter] + (Kern [same]) @ x
        enter, same = _document_pairs(starts_ptr + b * N + c * T + t, t < N - c * T)
        do_state, kern, dkern = do * enter[:, None], kern * same, dkern * same
    L = local_ptr + (bh * n_chunks + c) * 2 * M * D
    tl.store(L + m[:, None] * D + d[None, :], tl.dot(tl.trans(e_re), do_state, input_precision=PREC))
    tl.store(L + (M + m[:, None]) * D + d[None, :], tl.dot(tl.trans(e_im), do_state, input_precision=PREC))
    tl.store(dx_ptr + ((b * N + tok) * H + h) * D + d[None, :], tl.dot(tl.trans(kern), do, input_precision=PREC),
             mask=real)
    tl.atomic_add(dent_ptr + et, tl.dot(do_state, tl.trans(s_re), input_precision=PREC))
    tl.atomic_add(dent_ptr + et + M, tl.dot(do_state, tl.trans(s_im), input_precision=PREC))
    tl.atomic_add(dkern_ptr + kt, dkern)


# ------------------------------------------------------------------------ launching them

def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _block(D: int) -> int:
    return min(64, D)


def _docs(starts, like):
    """The kernels' (starts pointer, DOCS flag): any tensor stands in when there are none."""
    return (like, False) if starts is None else (starts, True)


def _walk(x, tab, start, T, starts):
    """States [B, H, n + 1, 2M, D] (fp32) of one input x [B, N, H, D] from start [B, H, 2M, D]."""
    B, N, H, D = x.shape
    M = tab["pow_re"].shape[-1]
    n = -(-N // T)
    states = x.new_empty(B, H, n + 1, 2 * M, D, dtype=torch.float32)
    starts, docs = _docs(starts, x)
    _walk_forward[(B * H, D // _block(D))](
        x, *_strides(x), tab["add_in"], tab["lam_re"], tab["lam_im"], tab["pow_re"], tab["pow_im"],
        start, states, starts, N, n, H, T=T, M=M, D=D, BD=_block(D), PREC=DOT_PRECISION, DOCS=docs)
    return states


def _walk_back(x, dx, tab, states, local, dend, grads, T, starts):
    B, N, H, D = x.shape
    M = tab["pow_re"].shape[-1]
    dstart = torch.empty_like(dend)
    starts, docs = _docs(starts, x)
    _walk_backward[(B * H, D // _block(D))](
        x, *_strides(x), dx, *_strides(dx), tab["add_in"], tab["lam_re"], tab["lam_im"],
        tab["pow_re"], tab["pow_im"], states, local, dend, dstart, grads["add_in"], grads["lam_re"],
        grads["lam_im"], grads["pow_re"], grads["pow_im"], starts, N, states.shape[2] - 1, H,
        T=T, M=M, D=D, BD=_block(D), PREC=DOT_PRECISION, DOCS=docs)
    return dstart


QUERY_TABLES = ("lag", "add_in", "lam_re", "lam_im", "pow_re", "pow_im", "gram")
CONTRACTION_TABLES = ("lag", "add_in", "lam_re", "lam_im", "pow_re", "pow_im", "entering", "kernel")


class _TritonCore(torch.autograd.Function):
    """(q or None, k, v, start stacked [B, H, 2M, R + Dv], starts [B, N] int8 or None, *tables)
    -> (out fp32, end state). Every dimension already padded to the kernels' shapes
    (triton_chunked_core does it)."""

    @staticmethod
    def forward(ctx, spec, q, k, v, start, starts, *tables):
        T, scale, names = spec
        tab = dict(zip(names, tables))
        B, N, H, R = k.shape
        Dv, M = v.shape[-1], tab["pow_re"].shape[-1]
        n = -(-N // T)
        start_k, start_v = (s.contiguous() for s in start.split([R, Dv], dim=-1))
        states_k, states_v = _walk(k, tab, start_k, T, starts), _walk(v, tab, start_v, T, starts)
        starts_ptr, docs = _docs(starts, k)
        if q is None:
            out = k.new_empty(B, N, H, R + Dv, dtype=torch.float32)
            for x, states, part in ((k, states_k, out[..., :R]), (v, states_v, out[..., R:])):
                _contraction_forward[(B * H, n)](x, *_strides(x), part, *_strides(part), states,
                                                 tab["entering"], tab["kernel"], starts_ptr, N, n, H,
                                                 T=T, M=M, D=x.shape[-1], PREC=DOT_PRECISION, DOCS=docs)
        else:
            out = k.new_empty(B, N, H, Dv, dtype=torch.float32)
            _query_forward[(B * H, n)](q, *_strides(q), k, *_strides(k), v, *_strides(v), out, *_strides(out),
                                       states_k, states_v, tab["lag"], tab["pow_re"], tab["pow_im"],
                                       tab["gram"], scale, starts_ptr, N, n, H, T=T, M=M, R=R, DV=Dv,
                                       PREC=DOT_PRECISION, DOCS=docs)
        end = torch.cat([states_k[:, :, -1], states_v[:, :, -1]], dim=-1)
        ctx.spec, ctx.has_q, ctx.has_starts = spec, q is not None, starts is not None
        ctx.save_for_backward(*(x for x in (q, k, v, starts) if x is not None), start_k, start_v, *tables)
        return out, end

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dend):
        T, scale, names = ctx.spec
        saved = list(ctx.saved_tensors)
        q = saved.pop(0) if ctx.has_q else None
        k, v = saved.pop(0), saved.pop(0)
        starts = saved.pop(0) if ctx.has_starts else None
        start_k, start_v, *tables = saved
        tab = dict(zip(names, tables))
        B, N, H, R = k.shape
        Dv, M = v.shape[-1], tab["pow_re"].shape[-1]
        n = -(-N // T)
        # recompute the chunk states (cheaper than keeping [B, H, n, 2M, P] per layer)
        states_k, states_v = _walk(k, tab, start_k, T, starts), _walk(v, tab, start_v, T, starts)
        starts_ptr, docs = _docs(starts, k)
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
        if q is None:
            for x, states, part, dx, local in ((k, states_k, dout[..., :R], dk, local_k),
                                               (v, states_v, dout[..., R:], dv, local_v)):
                _contraction_backward[(B * H, n)](x, *_strides(x), part, *_strides(part), states,
                                                  tab["entering"], tab["kernel"], dx, local,
                                                  grads["entering"], grads["kernel"], starts_ptr, N, n, H,
                                                  T=T, M=M, D=x.shape[-1], PREC=DOT_PRECISION, DOCS=docs)
        else:
            dq = torch.empty_like(dk)
            _query_backward[(B * H, n)](q, *_strides(q), k, *_strides(k), v, *_strides(v),
                                        dout, *_strides(dout), states_k, states_v, tab["lag"],
                                        tab["pow_re"], tab["pow_im"], tab["gram"], scale,
                                        dq, dk, dv, local_k, local_v, grads["lag"], grads["pow_re"],
                                        grads["pow_im"], grads["gram"], starts_ptr, N, n, H,
                                        T=T, M=M, R=R, DV=Dv, PREC=DOT_PRECISION, DOCS=docs)
        dend_k, dend_v = (g.contiguous() for g in dend.float().split([R, Dv], dim=-1))
        dstart_k = _walk_back(k, dk, tab, states_k, local_k, dend_k, grads, T, starts)
        dstart_v = _walk_back(v, dv, tab, states_v, local_v, dend_v, grads, T, starts)
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


def triton_chunked_core(q, k, v, tab: dict, start: torch.Tensor, chunk_size: int, scale: float,
                        starts: torch.Tensor | None = None):
    """The core on CUDA (or under TRITON_INTERPRET=1): chunked._segment's numbers for the whole
    sequence. q, k [B, N, H, R] (q None: contraction readout), v [B, N, H, Dv], any float
    dtype; tab from chunk_tables(chunk_size=T) with T a power of two >= 16; start stacked
    [B, H, 2M, R + Dv]. Returns (out fp32 [B, N, H, Dv] or [B, N, H, R + Dv], stacked end state).

    M, R and Dv are zero-padded to the kernels' shapes (powers of two, >= 16): padded modes have
    zero tables (no input, no decay, no readout), padded key columns add nothing to q . k, padded
    value columns are cut from the output; padding is differentiable, so gradients come back
    to the unpadded tensors. starts [B, N] bool (ssm.document_starts) or None: packed documents."""
    T = chunk_size
    if k.shape[1] == 0:
        raise ValueError("the Triton core needs at least one token")
    if T != _dims(T):
        raise ValueError(f"the Triton core needs a chunk size that is a power of two >= {MIN_DOT}, got {T}")
    B, N, H, R = k.shape
    Dv, M = v.shape[-1], tab["pow_re"].shape[-1]
    Rp, Dp, Mp = _dims(R), _dims(Dv), _dims(M)
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
    starts = None if starts is None else starts.to(torch.int8).contiguous()
    out, end = _TritonCore.apply((T, float(scale), names), q_p, k_p, v_p, start_p.contiguous(), starts, *tables)
    if q is None:
        out = torch.cat([out[..., :R], out[..., Rp:Rp + Dv]], dim=-1)
    else:
        out = out[..., :Dv]
    end = torch.cat([end[..., :R], end[..., Rp:Rp + Dv]], dim=-1)
    return out, _unpad_modes(end, -2, M, Mp)
