"""The chunked (training) form of the interdomain mixer: linear in N, built from small matmuls.

Idea as in GLA / flash-linear-attention (Yang et al. 2024): split the sequence into chunks of T
tokens. With S the state entering a chunk and i, j positions inside it (0-based),

    X_i      = lambda^{i+1} (.) S + sum_{j<=i} lambda^{i-j} Bbar (x) z_j
    p_i      = X^k_i q_i       = lambda^{i+1} (.) (S^k q_i) + sum_{j<=i} (q_i . k_j) D_ij
    o_i      = Re(r_i^T X^v_i) = Re((r_i (.) lambda^{i+1})^T S^v) + sum_{j<=i} Re(r_i . D_ij) v_j
    S_next   = lambda^T (.) S + sum_j lambda^{T-1-j} Bbar (x) z_j
    with r_i = p_i' G (see recurrent.py) and D_ij = lambda^{i-j} Bbar = K_{i-j}.

Every term is a batched matmul over (batch, head, chunk); only the chunk-to-chunk carry of S is
sequential (N/T steps of an elementwise update). The two sums over j are matmuls with the lag
kernel K [T, 2M] once the [T, T] scores are indexed by lag instead of by j (`lag_to_position`):
no [T, T, M] table is formed, and K's gradient is one large matmul too.

Representation: a complex vector over the M modes is stored as one real vector of 2M numbers,
[re ; im] ("stacked"). A complex product then becomes a single real matmul against a stacked
operand (e.g. Re(a^T b) = [a_re, -a_im] . [b_re ; b_im]). Contiguous real matmuls are what
BLAS and tensor cores are fast at; `.real` / `.imag` views of complex tensors are strided and
fall off the fast path (measured: 2-4x slower on CPU).

Numerical safety [our choice]: the common factorisation lambda^{i-j} = lambda^i lambda^{-j}
overflows once |lambda|^{-T} is large (Delta = 1 gives e^{32} per 64-token chunk at init, and
learned A can make it far worse). We never form a negative power: D_ij = K_{i-j} comes from
the lag kernel K_l = lambda^l Bbar, l >= 0, applied to scores re-indexed by lag
(`lag_to_position`), so large Delta only makes entries underflow towards 0, which is the right
answer. All decay tables depend on parameters only (not on the batch), so they are computed
in float64 and cast to the working precision: phases n * Delta * Im(A) reach 1e5 radians and
would lose ~1e-3 in float32.
The core runs in float32 even under bf16 autocast.

Two ways to differentiate the same forward (`backward=`, config model.core_impl):
- "autograd": all chunks at once, autograd keeps every intra-chunk tensor (p, r, scores and
  their lag forms: ~3.6 GB at 16K tokens for one 125M-width layer).
- "recompute": the sequence runs in segments of SEGMENT_CHUNKS chunks through
  ops/segments.run_in_segments, which keeps only the inputs and the state entering each
  segment and, in the backward, recomputes one segment at a time and carries the state
  gradient backwards (flash-linear-attention's chunk-kernel structure with segments of several
  chunks, so every op stays a batched matmul). The mixer runs its feature maps, convs and norms
  inside the same segments (model/mixers/interdomain.py), so a layer keeps its projections and
  little else. "auto": recompute from RECOMPUTE_FROM_TOKENS tokens on, when a gradient is wanted.

Shapes: q, k [B, N, H, R] (q None for the linear contraction readout), v [B, N, H, Dv];
states (in and out) [B, H, M, R + Dv] complex, as in the other forms.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import warnings
from collections import OrderedDict

import torch

from ..segments import run_in_segments
from .ssm import complex_dtype_for, contraction_vector, discretize, document_starts, readout_gram, readout_scale


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


def chunk_tables(log_dt, a_log, a_im, c_re, c_im, *, readout, c_vec, chunk_size: int,
                 dtype: torch.dtype) -> dict:
    """Parameter-only tables for one chunk (T = chunk_size), exact to the working precision,
    all real and differentiable (the recomputing backward passes them through as inputs).

    lag      [H, T, 2M]     stack(lambda^l Bbar) for lags l = 0..T-1 (input at j -> position j+l)
    add_in   [H, 2M, T]     stack(lambda^{T-1-j} Bbar) over modes (input j -> chunk end)
    lam_re, lam_im [H, M, 1] lambda^T                (carry of the state across one chunk)
    pow_re, pow_im [H, T, M] lambda^{i+1}            (entering state -> position i)
    query readout:        gram [H, 2M, 2M], the real form of r_c = conj(p' G)
    contraction readout:  entering [H, T, 2M] (state -> output at i), kernel [H, T, T] (S4D's)
    """
    cdt = complex_dtype_for(dtype)
    log_lam, bbar = discretize(log_dt.double(), a_log.double(), a_im.double())
    n = torch.arange(chunk_size + 1, dtype=torch.float64, device=log_lam.device)
    powers = torch.exp(n[None, :, None] * log_lam[:, None, :])          # lambda^0..lambda^T
    lag = stack(powers[:, :chunk_size] * bbar[:, None, :]).to(dtype)    # [H, T, 2M]
    pow_in = powers[:, 1:].to(cdt)
    lam_T = powers[:, -1].to(cdt)
    tab = dict(lag=lag, add_in=lag.flip(1).transpose(1, 2).contiguous(),
               lam_re=lam_T.real[..., None].contiguous(), lam_im=lam_T.imag[..., None].contiguous(),
               pow_re=pow_in.real.contiguous(), pow_im=pow_in.imag.contiguous())
    if c_vec is None:
        gram = readout_gram(c_re.double(), c_im.double(), readout).to(cdt)   # [H, M, M]
        tab["gram"] = complex_matrix(gram, conj_in=readout == "hermitian", conj_out=True)
    else:
        e = contraction_vector(c_re.double(), c_im.double(), c_vec.double()).to(cdt)
        tab["entering"] = conj_stacked(stack(e[:, None, :] * pow_in))
        kernel_by_lag = (lag @ conj_stacked(stack(e))[..., None])[..., 0]   # [H, T]: S4D's kernel
        tab["kernel"] = lag_to_position(kernel_by_lag[:, None, :].expand(-1, chunk_size, -1))
    return tab


_TABLES: OrderedDict = OrderedDict()   # inference's chunk tables by the parameters' values (inference_tables)
TABLES_KEPT = 256


def inference_tables(log_dt, a_log, a_im, c_re, c_im, *, readout, c_vec, chunk_size: int,
                     dtype: torch.dtype) -> dict:
    """chunk_tables, kept between calls when no gradient is wanted (serving and generation read
    prompts in many short calls: at d 256, M 64 the tables took 1.3 ms of a layer's 7.6 for a
    55-token read). Keyed on the parameters' values themselves (their bytes, hashed: ~5 KB a
    layer), not on their identity or version counter, which an in-place write through `.data`
    (DeepSpeed's ZeRO does them) leaves unchanged: a stale table is impossible. With a
    gradient wanted, the tables are built as before (they are in the graph); on a GPU too (hashing
    would copy the parameters to the host, a synchronisation, at every call)."""
    params = [t for t in (log_dt, a_log, a_im, c_re, c_im, c_vec) if t is not None]
    if params[0].device.type != "cpu" or torch.is_grad_enabled() and any(t.requires_grad for t in params):
        return chunk_tables(log_dt, a_log, a_im, c_re, c_im, readout=readout, c_vec=c_vec, chunk_size=chunk_size,
                            dtype=dtype)
    digest = hashlib.blake2b(digest_size=16)
    for t in params:
        digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        digest.update(str((t.dtype, tuple(t.shape))).encode())
    key = (digest.digest(), readout, c_vec is None, chunk_size, dtype, params[0].device)
    tab = _TABLES.get(key)
    if tab is None:
        with torch.no_grad():
            tab = chunk_tables(log_dt, a_log, a_im, c_re, c_im, readout=readout, c_vec=c_vec,
                               chunk_size=chunk_size, dtype=dtype)
        _TABLES[key] = tab
        while len(_TABLES) > TABLES_KEPT:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return tab


def lag_to_position(x: torch.Tensor) -> torch.Tensor:
    """[..., T, T] indexed (i, a) -> (i, i - a), zero where a > i. The map is its own inverse on
    the lower triangle, so it turns scores s_ij into s_i,lag and lag weights back into W_ij.

    It is why no [T, T, M] decay table exists: sum_j s_ij lambda^{i-j} Bbar = sum_l s_i,l K_l is
    one matmul of the lag-indexed scores with the lag kernel K (and W_ij = Re(r_i . K_{i-j}) is
    r @ K^T read back by lag), so every contraction is a large matmul over (chunk, position)
    instead of T^2 tiny ones, and the kernel's gradient is one matmul too."""
    T = x.shape[-1]
    i = torch.arange(T, device=x.device)
    index = torch.where(i[None, :] <= i[:, None], i[:, None] - i[None, :], T)   # T: the zero column
    padded = torch.nn.functional.pad(x, (0, 1))
    return padded.gather(-1, index.expand(*x.shape[:-1], T))


def _to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, N, H, D] -> [B, H, n_chunks, T, D] contiguous, zero-padded at the end."""
    B, N, H, D = x.shape
    n = -(-N // chunk_size)
    x = torch.nn.functional.pad(x.to(dtype), (0, 0, 0, 0, 0, n * chunk_size - N))
    return x.view(B, n, chunk_size, H, D).permute(0, 3, 1, 2, 4).contiguous()


def _starts_to_chunks(starts: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, N] bool -> [B, n_chunks, T], padded with False (padding joins the last document)."""
    B, N = starts.shape
    n = -(-N // chunk_size)
    return torch.nn.functional.pad(starts, (0, n * chunk_size - N)).view(B, n, chunk_size)


def _from_chunks(x: torch.Tensor, N: int) -> torch.Tensor:
    B, H, n, T, D = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, n * T, H, D)[:, :N]


def _rotate(state: torch.Tensor, w_re: torch.Tensor, w_im: torch.Tensor) -> torch.Tensor:
    """Complex elementwise product along the stacked mode dim (-2) of a state [.., 2M, P]."""
    re, im = state.chunk(2, dim=-2)
    return torch.cat([w_re * re - w_im * im, w_im * re + w_re * im], dim=-2)


def _carry(added: torch.Tensor, tab: dict, state: torch.Tensor, keep=None):
    """States entering each chunk, [B, H, c, 2M, P], and the state after the last chunk, from
    each chunk's own contribution `added` [B, H, c, 2M, P] and the state before the first.
    keep [B, 1, c, 1, 1] (packed documents): 0 where a document starts inside the chunk, so the
    state before it is forgotten."""
    entering = []
    for i, chunk_added in enumerate(added.unbind(dim=2)):   # unbind: one backward op, not one per chunk
        entering.append(state)
        carried = _rotate(state, tab["lam_re"], tab["lam_im"])
        state = (carried if keep is None else carried * keep[:, :, i]) + chunk_added
    return torch.stack(entering, dim=2), state


def document_masks(starts: torch.Tensor, dtype: torch.dtype) -> dict:
    """Per-chunk masks of packed documents from starts [B, c, T] bool (ssm.document_starts in
    chunks). With `local` the number of starts up to each position inside its chunk:
    enter [B, 1, c, T, 1]  the state entering the chunk reaches position i (no start at <= i)
    same  [B, 1, c, T, T]  positions i and j are in one document (pairs inside the chunk)
    keep  [B, 1, c, 1, 1]  the entering state survives the whole chunk (no start in it)
    last  [B, 1, c, T, 1]  token j is in the chunk's last document (it reaches the next chunk)
    Only positions inside the chunk are compared, so the masks need no token before it: a
    segment of chunks is self-contained (the recomputing backward relies on that)."""
    local = starts.cumsum(-1)[:, None]                                       # [B, 1, c, T]
    as_float = lambda m: m.to(dtype)
    return dict(enter=as_float(local == 0)[..., None],
                same=as_float(local[..., :, None] == local[..., None, :]),
                keep=as_float(local[..., -1] == 0)[..., None, None],
                last=as_float(local == local[..., -1:])[..., None])


def _segment(tab: dict, qc, kc, vc, start, *, valid=None, docs=None):
    """One run of consecutive chunks: qc, kc [B, H, c, T, R] (qc None for the contraction
    readout), vc [B, H, c, T, Dv], start [B, H, 2M, P] (stacked) the state before them.
    Returns (out [B, H, c, T, Dv or P], the stacked state after them). `valid` < T: only the
    first `valid` tokens of the last chunk are real; the returned state is then exact (the
    carry over the zero padding would have decayed it). docs: document_masks(...) or None
    (None computes exactly what it did before packed documents existed)."""
    R, M = kc.shape[-1], tab["pow_re"].shape[-1]
    masked = (lambda x, name: x) if docs is None else (lambda x, name: x * docs[name])
    z = torch.cat([kc, vc], dim=-1)                                         # [B, H, c, T, P]
    entering, end = _states(tab, z, start, valid, docs)
    if qc is None:
        out = masked(tab["entering"][:, None] @ entering, "enter") + masked(tab["kernel"][:, None], "same") @ z
    else:
        B, H, c, T, _ = kc.shape
        S_k, S_v = entering.split([R, z.shape[-1] - R], dim=-1)   # split: no zero-filled grads
        w_re, w_im = tab["pow_re"][:, None], tab["pow_im"][:, None]         # [H, 1, T, M]
        p = masked(mul_stacked(qc @ S_k.transpose(-1, -2), w_re, w_im), "enter")   # from entering state
        scores = lag_to_position(masked(qc @ kc.transpose(-1, -2), "same"))   # [B, H, c, T, T(lag)]
        p = p + (scores.view(B, H, c * T, T) @ tab["lag"]).view(p.shape)   # within the chunk
        # r_c = conj(r) with r = p' G (p' = conj(p) for the hermitian readout), stacked
        r_c = p.view(B, H, c * T, 2 * M) @ tab["gram"]                      # [B, H, cT, 2M]
        # Re(W_ij) = Re(r_i . lambda^{i-j} Bbar), computed by lag and read back by position
        weights = masked(lag_to_position((r_c @ tab["lag"].transpose(-1, -2)).view(B, H, c, T, T)), "same")
        # Re((r . lambda^{i+1})^T S^v): [conj(r lambda)] . [S_re ; S_im] along the modes
        out = masked(mul_stacked(r_c.view(p.shape), w_re, -w_im) @ S_v, "enter")
        out = (out + weights @ vc) * readout_scale(M)
    return out, end


def _states(tab: dict, z, start, valid=None, docs=None):
    """The stacked states entering each chunk [B, H, c, 2M, P] and the state after the last
    real token, from z = [k, v] in chunks [B, H, c, T, P] (see _segment for valid and docs)."""
    z_out = z if docs is None else z * docs["last"]                         # what reaches the next chunk
    added = tab["add_in"][:, None] @ z_out                                  # [B, H, c, 2M, P]
    entering, end = _carry(added, tab, start, None if docs is None else docs["keep"])
    if valid is not None and valid < z.shape[-2]:
        T = z.shape[-2]
        w_re, w_im = (tab[k][:, valid - 1, :, None] for k in ("pow_re", "pow_im"))   # lambda^valid
        carried = _rotate(entering[:, :, -1], w_re, w_im)
        end = (carried if docs is None else carried * docs["keep"][:, :, -1]) + \
            tab["add_in"][..., T - valid:] @ z_out[:, :, -1, :valid]
    return entering, end


def block_end_state(k, v, log_dt, a_log, a_im, *, chunk_size=64, seq_idx=None):
    """The state after a block of tokens when it starts from zero, [B, H, M, R + Dv] complex,
    without any output (context parallelism's first pass, parallel/context_parallel.py): the
    carry alone, linear in k and v."""
    B, N, H, R = k.shape
    M = a_log.shape[-1]
    work = torch.float64 if k.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=k.device.type, enabled=False):
        eye = torch.eye(M, dtype=work, device=k.device).expand(H, M, M)   # no readout is formed
        tab = chunk_tables(log_dt, a_log, a_im, eye, torch.zeros_like(eye), readout="plain", c_vec=None,
                           chunk_size=chunk_size, dtype=work)
        z = torch.cat([_to_chunks(k, chunk_size, work), _to_chunks(v, chunk_size, work)], dim=-1)
        starts = document_starts(seq_idx)
        docs = None if starts is None else document_masks(_starts_to_chunks(starts, chunk_size), work)
        start = z.new_zeros(B, H, 2 * M, z.shape[-1])
        _, end = _states(tab, z, start, N - (z.shape[2] - 1) * chunk_size, docs)
        return unstack(end, dim=-2)


def block_transition(log_dt, a_log, a_im, n_tokens: int) -> torch.Tensor:
    """lambda^n [H, M] complex (float64 exponent, as every table): what a state becomes over n
    tokens with no input."""
    log_lam, _ = discretize(log_dt.double(), a_log.double(), a_im.double())
    return torch.exp(n_tokens * log_lam)


def core_step(names: tuple, chunk_size: int):
    """The chunked core as a `run_in_segments` step (ops/segments.py): params are the chunk
    tables (in `names` order), the window is (q, k, v) token-major, the state is stacked."""
    def step(params, window, lo, window_lo, state):
        q, k, v, starts = window
        dtype = k.dtype
        chunks = [None if x is None else _to_chunks(x, chunk_size, dtype) for x in (q, k, v)]
        valid = k.shape[1] - (chunks[1].shape[2] - 1) * chunk_size   # exact state after the last token
        docs = None if starts is None else document_masks(_starts_to_chunks(starts, chunk_size), dtype)
        out, end = _segment(dict(zip(names, params)), *chunks, state, valid=valid, docs=docs)
        return _from_chunks(out, k.shape[1]), end
    return step


# [our choice, measured with benchmarks/core_memory.py on 2 CPU cores, 125M width]: the
# recomputing backward costs one more forward. Against the layer before it existed it took
# 1.35x / 1.13x / 1.07-1.19x / 1.04x the time at 2K / 4K / 8K / 16K tokens (large tensors are
# memory-bound, one segment stays in cache), so "auto" recomputes from 16K tokens per sequence,
# where it is within 10%; below, model.core_impl=recompute trades that time for 1/4 the memory.
RECOMPUTE_FROM_TOKENS = 16384
SEGMENT_CHUNKS = 4   # 256 tokens per segment at T = 64: 4 and 8 measured alike, 16 slower


def segment_tokens(chunk_size: int) -> int:
    """Tokens per segment of the recomputing backward (read at call time: tests change it)."""
    return SEGMENT_CHUNKS * chunk_size


def recomputes(backward: str, n_tokens: int, wants_grad: bool, x: torch.Tensor | None = None) -> bool:
    """Whether `backward` (auto / autograd / recompute / triton) means the recomputing backward
    of the PyTorch form. `x`: a tensor on the core's device, for auto's choice of the kernel."""
    if backward == "auto":
        return wants_grad and n_tokens >= RECOMPUTE_FROM_TOKENS and not (x is not None and uses_triton("auto", x))
    return backward == "recompute"


_TRITON_IMPORT_ERROR: list = []   # why _triton_kernels() found no kernels, for auto's warning


def _triton_kernels():
    """ops/interdomain/triton_chunked.py, or None where triton is not installed (CPU installs)
    or the module is not there (Hugging Face exports bundle only the PyTorch forms; importlib
    rather than an import statement, which transformers would look for in the bundle)."""
    try:
        return importlib.import_module(".triton_chunked", __package__)
    except (ImportError, TypeError) as error:   # TypeError: no package (a flattened bundle)
        if not _TRITON_IMPORT_ERROR:
            _TRITON_IMPORT_ERROR.append(str(error).splitlines()[0] if isinstance(error, ImportError)
                                        else "the Triton kernels are not part of this copy of the model code")
        return None


def _triton_core():
    kernels = _triton_kernels()
    return None if kernels is None else kernels.triton_chunked_core


_WARNED: set = set()


def _fall_back(reason: str) -> None:
    """core_impl=auto on a GPU without a usable kernel: say why, once per reason."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"model.core_impl=auto: {reason}; the interdomain core uses the PyTorch "
                      "chunked form instead (slower, more memory)", RuntimeWarning, stacklevel=3)


def _kernel_candidate(x: torch.Tensor) -> bool:
    """Tensors auto gives the Triton kernel: CUDA, below float64 (tests widen it to the
    interpreter's CPU tensors)."""
    return x.is_cuda and x.dtype != torch.float64


def uses_triton(backward: str, x: torch.Tensor) -> bool:
    """auto: the Triton kernel for CUDA tensors below float64 when triton is installed (it keeps
    only its inputs for the backward, so it is also the memory-lean path there; a GPU without
    triton warns once); triton: always, with a clear error where it cannot run. Whether the
    kernels fit this GPU at the call's shape is checked at the call (chunked_interdomain)."""
    if backward == "auto":
        if not _kernel_candidate(x):
            return False
        if _triton_core() is None:
            _fall_back(f"no Triton kernels ({_TRITON_IMPORT_ERROR[0] if _TRITON_IMPORT_ERROR else 'not found'}; "
                       "pip install 'megatron-id[triton]' for triton >= 3.3)")
            return False
        return True
    if backward != "triton":
        return False
    if _triton_core() is None:
        raise ValueError("model.core_impl=triton needs the triton package, version 3.3 or newer: pip "
                         "install 'megatron-id[triton]' (or choose model.core_impl=auto)")
    if x.dtype == torch.float64:
        raise ValueError("model.core_impl=triton computes in float32; float64 inputs need "
                         "model.core_impl=autograd or recompute")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"model.core_impl=triton needs CUDA tensors (got {x.device}); on a CPU "
                         "set TRITON_INTERPRET=1 before starting Python (slow: for tests) or "
                         "choose model.core_impl=auto")
    return True


def chunked_interdomain(q, k, v, log_dt, a_log, a_im, c_re, c_im, *, readout="hermitian",
                        c_vec=None, initial_state=None, output_final_state=False, chunk_size=64,
                        backward="auto", segment_chunks=None, seq_idx=None):
    """backward: "autograd" (all chunks at once, every intermediate kept), "recompute" (memory
    bounded by one segment of `segment_chunks` chunks), "triton" (the fused kernels of
    triton_chunked.py, float32 accumulation for any input dtype) or "auto" (triton for CUDA
    tensors when it is installed; otherwise recompute from RECOMPUTE_FROM_TOKENS tokens on, and
    only when a gradient is needed). seq_idx [B, N]: packed documents, as in naive.py."""
    if backward not in ("auto", "autograd", "recompute", "triton"):
        raise ValueError(f"backward={backward!r}: expected 'auto', 'autograd', 'recompute' or 'triton'")
    B, N, H, R = k.shape
    M = a_log.shape[-1]
    work = torch.float64 if k.dtype == torch.float64 else torch.float32
    if N > 0 and uses_triton(backward, k):
        kernels = _triton_kernels()
        # the kernel's chunk: the configured one when tl.dot can take it (a power of two >= 16),
        # else the next that can; every chunk size computes the same function
        T = kernels.kernel_chunk(chunk_size)
        autocast = torch.is_autocast_enabled(k.device.type)   # the dot precision follows it
        try:   # whether the kernels launch here at this shape (cached), before any table is built
            shape = kernels.core_shape(q, k, v, M, T, autocast)
        except kernels.KernelUnavailable as error:
            if backward == "triton":
                raise ValueError(f"model.core_impl=triton: {error} (model.core_impl=auto falls back "
                                 "to the PyTorch form)") from None
            _fall_back(str(error))   # then the PyTorch form below, as auto chooses it there
        else:
            with torch.autocast(device_type=k.device.type, enabled=False):
                tab = chunk_tables(log_dt, a_log, a_im, c_re, c_im, readout=readout, c_vec=c_vec,
                                   chunk_size=T, dtype=torch.float32)
                start = stack(initial_state, dim=-2).float() if initial_state is not None else \
                    k.new_zeros(B, H, 2 * M, R + v.shape[-1], dtype=torch.float32)
                out, end = kernels.triton_chunked_core(q, k, v, tab, start, T, readout_scale(M),
                                                       starts=document_starts(seq_idx), shape=shape)
            return out, (unstack(end, dim=-2) if output_final_state else None)
    with torch.autocast(device_type=k.device.type, enabled=False):
        tab = inference_tables(log_dt, a_log, a_im, c_re, c_im, readout=readout, c_vec=c_vec,
                               chunk_size=chunk_size, dtype=work)
        start = stack(initial_state, dim=-2).to(work) if initial_state is not None else \
            k.new_zeros(B, H, 2 * M, R + v.shape[-1], dtype=work)
        n_chunks = -(-N // chunk_size)
        valid = N - (n_chunks - 1) * chunk_size if output_final_state else None
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, initial_state, *tab.values()))
        starts = document_starts(seq_idx)
        if recomputes(backward, N, wants_grad):
            names = tuple(tab)
            out, end = run_in_segments(core_step(names, chunk_size), list(tab.values()),
                                       [None if x is None else x.to(work) for x in (q, k, v)] + [starts], start,
                                       segment_tokens=segment_chunks * chunk_size if segment_chunks
                                       else segment_tokens(chunk_size))
        else:
            kc, vc = _to_chunks(k, chunk_size, work), _to_chunks(v, chunk_size, work)
            qc = None if q is None else _to_chunks(q, chunk_size, work)
            docs = None if starts is None else document_masks(_starts_to_chunks(starts, chunk_size), work)
            out, end = _segment(tab, qc, kc, vc, start, valid=valid, docs=docs)
            out = _from_chunks(out, N)
        return out, (unstack(end, dim=-2) if output_final_state else None)
