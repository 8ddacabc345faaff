"""The complex S4D core shared by every form of the interdomain mixer.

Shapes (one convention everywhere): H heads, M modes.
  log_dt [H], a_log [H, M], a_im [H, M], c_re / c_im [H, M, M].

    A_m      = -exp(a_log[m]) + i a_im[m]
    Delta    = exp(log_dt)                       (one step size per head)
    lambda_m = exp(Delta A_m)                    (|lambda| < 1 always)
    Bbar_m   = (lambda_m - 1) / A_m              (zero-order hold, unit B) [our choice]

The readout mixing C (complex M x M per head) enters the fast forms only through
G = C^H C (hermitian readout) or C^T C (plain readout); see `readout_gram`.
"""
from __future__ import annotations

import math

import torch


def complex_dtype_for(real_dtype: torch.dtype) -> torch.dtype:
    """complex128 for float64 inputs, complex64 otherwise (bf16/fp16 never reach the core)."""
    return torch.complex128 if real_dtype == torch.float64 else torch.complex64


def s4d_inv_init(n_heads: int, state_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """S4D-Inv initialisation (Gu et al. 2022): a_log = log(1/2), a_im[m] = (M/pi)(M/(2m+1) - 1)."""
    m = torch.arange(state_size, dtype=torch.float64)
    a_im = (state_size / math.pi) * (state_size / (2 * m + 1) - 1)
    a_log = torch.full((state_size,), math.log(0.5), dtype=torch.float64)
    return a_log.expand(n_heads, -1).clone(), a_im.expand(n_heads, -1).clone()


def continuous_modes(a_log: torch.Tensor, a_im: torch.Tensor) -> torch.Tensor:
    """A = -exp(a_log) + i a_im, [H, M] complex."""
    return torch.complex(-torch.exp(a_log), a_im)


def discretize(log_dt: torch.Tensor, a_log: torch.Tensor, a_im: torch.Tensor):
    """Return (log_lambda, bbar), both [H, M] complex, in the precision of the parameters.

    log_lambda = Delta * A is returned (not lambda) so that callers can form exact powers
    lambda^n = exp(n log_lambda) without repeated multiplication.
    """
    A = continuous_modes(a_log, a_im)
    log_lam = torch.exp(log_dt)[:, None] * A
    bbar = torch.expm1(log_lam) / A
    return log_lam, bbar


def readout_gram(c_re: torch.Tensor, c_im: torch.Tensor, readout: str) -> torch.Tensor:
    """G with o = Re(r^T X^v), r = p' G, p' = conj(p) (hermitian) or p (plain). [H, M, M] complex.

    hermitian: o = Re((C p)^H (C X^v)) = Re(conj(p)^T C^H C X^v)  ->  G = C^H C
    plain:     o = Re((C p)^T (C X^v)) = Re(p^T C^T C X^v)        ->  G = C^T C
    """
    C = torch.complex(c_re, c_im)
    left = C.conj() if readout == "hermitian" else C
    return left.transpose(-1, -2) @ C


def contraction_vector(c_re: torch.Tensor, c_im: torch.Tensor, c_vec: torch.Tensor) -> torch.Tensor:
    """e = C^T c, so that Re(c^T [U | Gamma]) = Re(c^T C X) = Re(e^T X). [H, M] complex."""
    C = torch.complex(c_re, c_im)
    return (c_vec.to(C.dtype)[:, None, :] @ C).squeeze(-2)


def readout_scale(state_size: int) -> float:
    """Fixed output scale 1/sqrt(M) of the query readout [our choice, as the spec suggests].

    The readout sums M complex products of roughly independent modes, so unscaled it grows
    like sqrt(M) (measured at 125M width, unit-RMS input, init weights: RMS 0.25 / 0.44 / 0.79
    for M = 16 / 64 / 256). With 1/sqrt(M) the output RMS is ~0.05 for every M; what remains
    below one is the state's own size (~sqrt(Delta) at the init Delta range), which training
    moves. tests/test_interdomain_forms.py::test_readout_scale_makes_output_independent_of_M.
    """
    return 1.0 / math.sqrt(state_size)


def document_starts(seq_idx: torch.Tensor | None) -> torch.Tensor | None:
    """[B, N] document index per token (packed samples; Mamba's seq_idx) -> [B, N] bool, True
    where a new document starts: the state is zeroed before that token is absorbed. Token 0
    never starts one: an initial state (a previous call's) continues into its document."""
    if seq_idx is None:
        return None
    starts = torch.zeros(seq_idx.shape, dtype=torch.bool, device=seq_idx.device)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return starts
