"""The literal per-token recurrence of the interdomain mixer: documentation first, speed never.

Per head (M modes, key width R, value width Dv, P = R + Dv), for t = 1..N:

    z_t     = [k_t ; v_t]                                  (already normed + biased)
    X_t     = lambda (.) X_{t-1} + Bbar (x) z_t             X in C^{M x P}, X_0 = 0
    [U|Gam] = C X_t                                        U in C^{M x R}, Gam in C^{M x Dv}
    query readout:        o_t = Re( sum_j conj(q_t . U[j]) Gam[j] ) / sqrt(M)   (hermitian)
                          (readout='plain' drops the conj)
    linear contraction:   o_t = [ Re(c^T U), Re(c^T Gam) ]                         (q is None)

Shapes: q, k [B, N, H, R], v [B, N, H, Dv]; returns (out [B, N, H, Dv] (or [B, N, H, P]),
the final state X [B, H, M, P] when output_final_state, else None).
This costs O(M^2 P) per head and token (the paper's form); `recurrent.py` and `chunked.py`
compute the same numbers in O(M P + M^2) and in chunks.
"""
from __future__ import annotations

import torch

from .ssm import complex_dtype_for, discretize, document_starts, readout_scale


def naive_interdomain(q, k, v, log_dt, a_log, a_im, c_re, c_im, *, readout="hermitian",
                      c_vec=None, initial_state=None, output_final_state=False, seq_idx=None):
    """seq_idx [B, N] (packed documents, Megatron's reset_attention_mask): the state restarts
    from zero wherever seq_idx changes from the previous token (see ssm.document_starts)."""
    B, N, H, R = k.shape
    M = a_log.shape[-1]
    cdt = complex_dtype_for(k.dtype)
    log_lam, bbar = discretize(log_dt, a_log, a_im)
    lam, bbar = torch.exp(log_lam).to(cdt), bbar.to(cdt)
    C = torch.complex(c_re, c_im).to(cdt)
    X = initial_state if initial_state is not None else \
        torch.zeros(B, H, M, R + v.shape[-1], dtype=cdt, device=k.device)
    starts = document_starts(seq_idx)
    outputs = []
    for t in range(N):
        z = torch.cat([k[:, t], v[:, t]], dim=-1).to(cdt)               # [B, H, P]
        if starts is not None:                                           # a new document: forget
            X = X * (~starts[:, t]).to(X.real.dtype)[:, None, None, None]
        X = lam[..., None] * X + bbar[..., None] * z[:, :, None, :]      # [B, H, M, P]
        U, Gam = C @ X[..., :R], C @ X[..., R:]                          # [B, H, M, R], [B, H, M, Dv]
        if q is None:
            c = c_vec.to(cdt)[:, None, :]                                # [H, 1, M]
            outputs.append(torch.cat([(c @ U).real, (c @ Gam).real], dim=-1).squeeze(-2))
        else:
            s = U @ q[:, t].to(cdt)[..., None]                           # [B, H, M, 1]: q . U[j]
            w = s.conj() if readout == "hermitian" else s
            outputs.append((w * Gam).sum(dim=-2).real * readout_scale(M))
    out = torch.stack(outputs, dim=1)
    return out, (X if output_final_state else None)
