"""The chunked (training) form of the interdomain mixer: linear in N, built from small matmuls.

Idea as in GLA / flash-linear-attention (Yang et al. 2024): split the sequence into chunks of T
tokens. With S the state entering a chunk and i, j positions inside it (0-based),

    X_i      = lambda^{i+1} (.) S + sum_{j<=i} lambda^{i-j} Bbar (x) z_j
    p_i      = X^k_i q_i       = lambda^{i+1} (.) (S^k q_i) + sum_{j<=i} (q_i . k_j) D_ij
    o_i      = Re(r_i^T X^v_i) = Re((r_i (.) lambda^{i+1})^T S^v) + sum_{j<=i} Re(r_i . D_ij) v_j
    S_next   = lambda^T (.) S + sum_j lambda^{T-1-j} Bbar (x) z_j
    with r_i = p_i' G (see recurrent.py) and D_ij = lambda^{i-j} Bbar (a [T, T, M] table per head).

Every term is a batched matmul over (batch, head, chunk); only the chunk-to-chunk carry of S is
sequential (N/T steps of an elementwise update).

Representation: a complex vector over the M modes is stored as one real vector of 2M numbers,
[re ; im] ("stacked"). A complex product then becomes a single real matmul against a stacked
operand (e.g. Re(a^T b) = [a_re, -a_im] . [b_re ; b_im]). Contiguous real matmuls are what
BLAS and tensor cores are fast at; `.real` / `.imag` views of complex tensors are strided and
fall off the fast path (measured: 2-4x slower on CPU).

Numerical safety [our choice]: the common factorisation lambda^{i-j} = lambda^i lambda^{-j}
overflows once |lambda|^{-T} is large (Delta = 1 gives e^{32} per 64-token chunk at init, and
learned A can make it far worse). We never form a negative power: D_ij is tabulated directly
from the exponent i - j >= 0 (zero above the diagonal), so large Delta only makes entries
underflow towards 0, which is the right answer. All decay tables depend on parameters only
(not on the batch), so they are computed in float64 and cast to the working precision: phases
n * Delta * Im(A) reach 1e5 radians and would lose ~1e-3 in float32.
The core runs in float32 even under bf16 autocast.

Shapes: q, k [B, N, H, R] (q None for the linear contraction readout), v [B, N, H, Dv];
states (in and out) [B, H, M, R + Dv] complex, as in the other forms.
"""
from __future__ import annotations

import torch

from .ssm import complex_dtype_for, contraction_vector, discretize, readout_gram, readout_scale


def stack(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """complex [..., M, ...] -> real [..., 2M, ...] as [re ; im] along `dim`."""
    return torch.cat([x.real, x.imag], dim=dim)


def unstack(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    re, im = x.chunk(2, dim=dim)
    return torch.complex(re.contiguous(), im.contiguous())


def conj_stacked(x: torch.Tensor) -> torch.Tensor:
    """[re ; im] -> [re ; -im] along the last dim: the row that takes Re(x^T y) against [y_re ; y_im]."""
    re, im = x.chunk(2, dim=-1)
    return torch.cat([re, -im], dim=-1)


def mul_stacked(x: torch.Tensor, w_re: torch.Tensor, w_im: torch.Tensor) -> torch.Tensor:
    """Elementwise complex product of stacked x [..., 2M] with w = w_re + i w_im [..., M]."""
    re, im = x.chunk(2, dim=-1)
    return torch.cat([re * w_re - im * w_im, re * w_im + im * w_re], dim=-1)


def complex_matrix(G: torch.Tensor, conj_in: bool = False, conj_out: bool = False) -> torch.Tensor:
    """Real [2M, 2M] form of right-multiplication by complex G: stack(p) @ it = stack(p @ G).
    conj_in / conj_out fold a conjugation of p / of the result into the matrix (free: it is
    parameter-only, while conjugating the batch-sized p or r would cost a pass over memory)."""
    top, bottom = torch.cat([G.real, G.imag], -1), torch.cat([-G.imag, G.real], -1)
    if conj_in:
        bottom = -bottom
    mat = torch.cat([top, bottom], -2)
    if conj_out:
        mat = torch.cat([mat[..., :G.shape[-1]], -mat[..., G.shape[-1]:]], -1)
    return mat


def decay_tables(log_dt, a_log, a_im, chunk_size: int, dtype: torch.dtype):
    """Parameter-only tables for one chunk (T = chunk_size), exact to the working precision.

    pow_in   [H, T, M]  complex  lambda^{i+1}           (entering state -> position i)
    pow_re, pow_im [H, T, M] real  its real and imaginary parts, contiguous
    add_in   [H, 2M, T] real     stack(lambda^{T-1-j} Bbar) over modes (input j -> chunk end)
    lam_T    [H, M]     complex  lambda^T
    decay    [H, T, T, 2M] real  stack(lambda^{i-j} Bbar) for j <= i, else 0
    log_lam, bbar [H, M] complex128, for a partial last chunk.
    """
    cdt = complex_dtype_for(dtype)
    log_lam, bbar = discretize(log_dt.double(), a_log.double(), a_im.double())
    n = torch.arange(chunk_size + 1, dtype=torch.float64, device=log_lam.device)
    powers = torch.exp(n[None, :, None] * log_lam[:, None, :])          # lambda^0..lambda^T
    lag_kernel = stack(powers[:, :chunk_size] * bbar[:, None, :]).to(dtype)  # [H, T(lag), 2M]
    i = torch.arange(chunk_size, device=log_lam.device)
    lag = i[:, None] - i[None, :]
    decay = lag_kernel[:, lag.clamp(min=0)] * (lag >= 0).to(dtype)[None, :, :, None]
    pow_in = powers[:, 1:].to(cdt)
    return dict(pow_in=pow_in, pow_re=pow_in.real.contiguous(), pow_im=pow_in.imag.contiguous(),
                add_in=lag_kernel.flip(1).transpose(1, 2).contiguous(), lam_T=powers[:, -1].to(cdt),
                decay=decay, log_lam=log_lam, bbar=bbar)


def _to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, N, H, D] -> [B, H, n_chunks, T, D] contiguous, zero-padded at the end."""
    B, N, H, D = x.shape
    n = -(-N // chunk_size)
    x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, 0, 0, n * chunk_size - N))
    return x.view(B, n, chunk_size, H, D).permute(0, 3, 1, 2, 4).contiguous()


def _from_chunks(x: torch.Tensor, N: int) -> torch.Tensor:
    B, H, n, T, D = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, n * T, H, D)[:, :N]


def _carry(added: torch.Tensor, lam_T: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """States entering each chunk, [B, H, n, 2M, P], from each chunk's own contribution
    `added` [B, H, n, 2M, P] and the state before the first chunk [B, H, 2M, P]."""
    lr, li = lam_T.real[..., None], lam_T.imag[..., None]        # [H, M, 1]
    entering = []
    for chunk_added in added.unbind(dim=2):   # unbind: one backward op, not one per chunk
        entering.append(state)
        re, im = state.chunk(2, dim=-2)
        state = torch.cat([lr * re - li * im, li * re + lr * im], dim=-2) + chunk_added
    return torch.stack(entering, dim=2)


def chunked_interdomain(q, k, v, log_dt, a_log, a_im, c_re, c_im, *, readout="hermitian",
                        c_vec=None, initial_state=None, output_final_state=False, chunk_size=64):
    B, N, H, R = k.shape
    M = a_log.shape[-1]
    work = torch.float64 if k.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=k.device.type, enabled=False):
        tab = decay_tables(log_dt, a_log, a_im, chunk_size, work)
        kc, vc = _to_chunks(k, chunk_size, work), _to_chunks(v, chunk_size, work)
        z = torch.cat([kc, vc], dim=-1)                                     # [B, H, n, T, P]

        # 1. what each chunk adds to the state, all chunks at once; 2. carry across chunks
        added = tab["add_in"][None, :, None] @ z                           # [B, H, n, 2M, P]
        start = stack(initial_state, dim=-2).to(work) if initial_state is not None else \
            z.new_zeros(B, H, 2 * M, z.shape[-1])
        entering = _carry(added, tab["lam_T"], start)                       # [B, H, n, 2M, P]

        pow_in = tab["pow_in"][None, :, None]                               # [1, H, 1, T, M]
        decay = tab["decay"]                                                # [H, T, T, 2M]
        if q is None:
            e = contraction_vector(c_re.double(), c_im.double(), c_vec.double()).to(pow_in.dtype)
            out = conj_stacked(stack(e[None, :, None, None, :] * pow_in)) @ entering
            kernel = torch.einsum("hm,hijm->hij", conj_stacked(stack(e)), decay)  # S4D kernel
            out = out + kernel[None, :, None] @ z
        else:
            qc = _to_chunks(q, chunk_size, work)
            S_k, S_v = entering.split([R, z.shape[-1] - R], dim=-1)   # split: no zero-filled grads
            w_re, w_im = tab["pow_re"][None, :, None], tab["pow_im"][None, :, None]
            p = mul_stacked(qc @ S_k.transpose(-1, -2), w_re, w_im)        # from entering state
            scores = qc @ kc.transpose(-1, -2)                              # [B, H, n, T, T]
            p = p + torch.einsum("bhcij,hijm->bhcim", scores, decay)        # within the chunk
            # r_c = conj(r) with r = p' G (p' = conj(p) for the hermitian readout), stacked
            gram = readout_gram(c_re.double(), c_im.double(), readout).to(pow_in.dtype)  # [H, M, M]
            gram = complex_matrix(gram, conj_in=readout == "hermitian", conj_out=True)
            r_c = (p.flatten(2, 3) @ gram).view(p.shape)                    # [B, H, n, T, 2M]
            # Re((r . lambda^{i+1})^T S^v): [conj(r lambda)] . [S_re ; S_im] along the modes
            out = mul_stacked(r_c, w_re, -w_im) @ S_v
            weights = torch.einsum("bhcim,hijm->bhcij", r_c, decay)         # Re(W)
            out = (out + weights @ vc) * readout_scale(M)
        out = _from_chunks(out, N)

        if not output_final_state:
            return out, None
        n_chunks = z.shape[2]
        valid = N - (n_chunks - 1) * chunk_size
        last = unstack(entering[:, :, -1], dim=-2)
        # the carry ran over zero padding, which would decay the state: redo the last chunk
        lag = torch.arange(valid - 1, -1, -1, dtype=torch.float64, device=k.device)
        weights_in = stack(torch.exp(lag[None, :, None] * tab["log_lam"][:, None, :])
                           * tab["bbar"][:, None, :]).to(work)              # [H, valid, 2M]
        state = torch.exp(valid * tab["log_lam"]).to(last.dtype)[..., None] * last + \
            unstack(weights_in.transpose(-1, -2)[None] @ z[:, :, -1, :valid], dim=-2)
        return out, state
