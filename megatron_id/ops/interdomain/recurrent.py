"""The recurrent (generation) form: one token at a time with a fixed-size state.

State per head: X in C^{M x P}, P = R + Dv, the same for every prefix length.
The readout never forms U = C X^k or Gam = C X^v: with p = X^k q (M numbers) and
G = C^H C (see ssm.readout_gram), o = Re(r^T X^v) with r = conj(p) G, so one step costs
O(M P + M^2) per head instead of the literal O(M^2 P).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .ssm import complex_dtype_for, contraction_vector, discretize, document_starts, readout_gram, readout_scale


@dataclass
class StepTables:
    """Parameter-only quantities a step needs; build once per forward, reuse for every token."""
    lam: torch.Tensor            # [H, M]
    bbar: torch.Tensor           # [H, M]
    gram: torch.Tensor | None    # [H, M, M] (query readout)
    contraction: torch.Tensor | None  # [H, M] (linear contraction readout)
    hermitian: bool
    scale: float


def step_tables(log_dt, a_log, a_im, c_re, c_im, *, readout="hermitian", c_vec=None,
                dtype=torch.float32) -> StepTables:
    """Built in float64 and cast (they are parameter-only and tiny), as in the chunked form."""
    cdt = complex_dtype_for(dtype)
    log_lam, bbar = discretize(log_dt.double(), a_log.double(), a_im.double())
    c_re, c_im = c_re.double(), c_im.double()
    if c_vec is None:
        gram, contraction = readout_gram(c_re, c_im, readout).to(cdt), None
    else:
        gram, contraction = None, contraction_vector(c_re, c_im, c_vec.double()).to(cdt)
    return StepTables(torch.exp(log_lam).to(cdt), bbar.to(cdt), gram, contraction,
                      readout == "hermitian", readout_scale(a_log.shape[-1]))


def recurrent_step(state, q_t, k_t, v_t, tables: StepTables, start_t=None):
    """One token. state [B, H, M, P] complex; q_t, k_t [B, H, R] (q_t None for contraction);
    v_t [B, H, Dv]; start_t [B] bool or None: rows where this token starts a new document.
    Returns (output [B, H, Dv] or [B, H, P], new state)."""
    R = k_t.shape[-1]
    z = torch.cat([k_t, v_t], dim=-1).to(state.dtype)
    if start_t is not None:
        state = state * (~start_t).to(state.real.dtype)[:, None, None, None]
    state = tables.lam[..., None] * state + tables.bbar[..., None] * z[:, :, None, :]
    if tables.contraction is not None:
        return (tables.contraction[:, None, :] @ state).squeeze(-2).real, state
    p = (state[..., :R] @ q_t.to(state.dtype)[..., None]).squeeze(-1)          # [B, H, M]
    if tables.hermitian:
        p = p.conj()
    r = p[:, :, None, :] @ tables.gram                                         # [B, H, 1, M]
    return (r @ state[..., R:]).squeeze(-2).real * tables.scale, state


def recurrent_interdomain(q, k, v, log_dt, a_log, a_im, c_re, c_im, *, readout="hermitian",
                          c_vec=None, initial_state=None, output_final_state=False, tables=None,
                          seq_idx=None):
    """Run `recurrent_step` over a whole sequence (same signature as the other forms).
    `tables` may be passed in to skip rebuilding them (decode loops); seq_idx as in naive.py."""
    B, N, H, R = k.shape
    if tables is None:
        tables = step_tables(log_dt, a_log, a_im, c_re, c_im, readout=readout, c_vec=c_vec,
                             dtype=k.dtype)
    state = initial_state if initial_state is not None else torch.zeros(
        B, H, a_log.shape[-1], R + v.shape[-1], dtype=tables.lam.dtype, device=k.device)
    starts = document_starts(seq_idx)
    outputs = []
    for t in range(N):
        o, state = recurrent_step(state, None if q is None else q[:, t], k[:, t], v[:, t], tables,
                                  None if starts is None else starts[:, t])
        outputs.append(o)
    out = torch.stack(outputs, dim=1)
    return out, (state if output_final_state else None)
