"""Small building blocks shared by every mixer: linear/embedding with a declared init, RMSNorm
(apex-fused on GPU when importable), RoPE, the SiLU feature map and the short causal conv.

Every module with parameters answers `initial_value(name, shape, generator)`: the full-size
initial tensor of that parameter, drawn from its own generator (see init.py). That keeps
initialisation independent of construction order and of any later sharding. Each also declares
in PARAMETER_ROLES what it knows of its parameters' roles (roles.py): their optimizer group. How
they are cut for tensor parallelism is the choice of the module that uses the layer (the mixer
makes its q_proj column-parallel, its o_proj row-parallel).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .roles import DECAY, NO_DECAY
from .rope import Rope

try:  # NVIDIA apex is optional (not on PyPI, CUDA only): fused RMSNorm when importable
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine as _apex_rms_norm
except Exception:  # ImportError, or apex built without its CUDA extensions
    _apex_rms_norm = None


class NormalInit:
    """Mixin for modules whose weight starts as N(0, self.init_std) (and a bias, if any, at zero)."""

    def initial_value(self, name, shape, generator):
        if name == "bias":
            return torch.zeros(shape)
        return torch.randn(shape, generator=generator) * self.init_std

    def reset_parameters(self):
        """torch's own draw at construction, skipped on the meta device (counts, shapes), where it
        draws nothing and cost torch._dynamo's import, ~1.1 s of a command's start: a random fill
        of a meta tensor runs through torch._refs, which imports it."""
        if self.weight.device.type != "meta":
            super().reset_parameters()


class Linear(NormalInit, nn.Linear):
    """nn.Linear with a declared N(0, init_std) weight; without bias unless asked (bias=True:
    zero at init, no weight decay, cut with the output features under column parallelism)."""

    PARAMETER_ROLES = {"weight": DECAY, "bias": NO_DECAY}   # the split: the owner's choice

    def __init__(self, d_in: int, d_out: int, init_std: float, bias: bool = False):
        super().__init__(d_in, d_out, bias=bias)
        self.init_std = init_std


class Embedding(NormalInit, nn.Embedding):
    PARAMETER_ROLES = {"weight": DECAY}

    def __init__(self, vocab: int, dim: int, init_std: float):
        super().__init__(vocab, dim)
        self.init_std = init_std


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 inputs, float64 for float64 (tests compare forms in float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def use_fused_rms_norm(x: torch.Tensor) -> bool:
    return _apex_rms_norm is not None and x.is_cuda


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in float32."""

    PARAMETER_ROLES = {"weight": NO_DECAY}

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def initial_value(self, name, shape, generator):
        return torch.ones(shape)

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_fused_rms_norm(x):
        return _apex_rms_norm(x, weight, weight.shape, eps)
    xf = x.to(compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(xf.dtype)).to(x.dtype)


def apply_rope(x: torch.Tensor, offset, rope) -> torch.Tensor:
    """Rotary embedding on [B, N, H, D] at positions offset..offset+N-1; `offset` is an int, or
    a [B] tensor of per-row offsets (left-padded rows count positions from their first token),
    or a [B, N] tensor of the positions themselves (Megatron's position_ids: packed documents
    that restart their positions, data.reset_position_ids). `rope`: a Rope (model/rope.py: the
    base and a context-extension scaling), or a plain base.

    Half-split layout (pairs i and i + D/2, "rotate_half"), as in GPT-NeoX and HF Llama, so
    exported weights need no permutation. Angles are computed per call: no table, no length cap.
    """
    B, N, H, D = x.shape
    dtype = compute_dtype(x)
    rope = rope if isinstance(rope, Rope) else Rope(float(rope))
    if isinstance(offset, torch.Tensor):
        pos = offset.to(x.device, dtype)
        pos = pos if pos.dim() == 2 else pos[:, None] + torch.arange(N, device=x.device, dtype=dtype)
        cos, sin = rope.angles(pos, D, dtype)                          # [B, N, D/2]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = rope.angles(torch.arange(offset, offset + N, device=x.device, dtype=dtype), D, dtype)   # [N, D/2]
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x.to(dtype).chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def left_padding(start: torch.Tensor, pos: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that begin with padding: start [B] is the position of each row's first real token.
    Returns which of the positions pos..pos+n-1 are real ([B, n] bool) and each row's RoPE
    offset for the first of them ([B]: positions count from the row's first real token)."""
    positions = pos + torch.arange(n, device=start.device)
    return positions[None, :] >= start[:, None], pos - start


def feature_map(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """xi(x) = SiLU(x) / max(||SiLU(x)||_2, eps) per head (last dim)."""
    return F.normalize(F.silu(x), dim=-1, eps=eps)


class ShortConv(nn.Module):
    """Causal depthwise conv1d over channels of [B, N, C], with bias.

    `forward(x, state)` takes the previous K-1 inputs ([B, C, K-1], None = zeros) and returns
    (y, new_state), so one code path serves training, prefill and single-token decode.
    """

    PARAMETER_ROLES = {"weight": DECAY, "bias": NO_DECAY}

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))   # nn.Conv1d layout
        self.bias = nn.Parameter(torch.zeros(channels))

    def initial_value(self, name, shape, generator):
        if name == "bias":
            return torch.zeros(shape)   # [our choice]
        bound = 1 / math.sqrt(self.kernel)   # PyTorch's default Conv1d bound for fan_in = K
        return (torch.rand(shape, generator=generator) * 2 - 1) * bound

    def forward(self, x, state=None, starts=None):
        return short_conv(x, self.weight, self.bias, state, starts)


def short_conv(x, weight, bias, state=None, starts=None):
    """ShortConv's function with explicit weights [C, 1, K] and bias [C] (recomputing backwards
    call it with their own leaves). Returns (y [B, N, C], the last K-1 inputs [B, C, K-1]).
    starts [B, N] bool (packed documents, ops/interdomain/ssm.document_starts): no tap reaches
    back across a document start; the `state` inputs count as the first token's document."""
    B, N, C = x.shape
    K = weight.shape[-1]
    xt = x.transpose(1, 2)
    if state is None:
        state = xt.new_zeros(B, C, K - 1)
    xp = torch.cat([state.to(xt.dtype), xt], dim=-1)
    if starts is None:
        y = F.conv1d(xp, weight.to(xt.dtype), bias.to(xt.dtype), groups=C)
    else:   # tap j reads xp[t + j], K-1-j tokens back: keep it where no start lies in between
        document = F.pad(starts.long().cumsum(-1), (K - 1, 0))           # [B, N + K - 1]
        w = weight.to(xt.dtype)[:, 0]                                    # [C, K]
        y = bias.to(xt.dtype)[:, None]
        for j in range(K):
            same = (document[:, j:j + N] == document[:, K - 1:]).to(xt.dtype)[:, None, :]
            y = y + w[:, j, None] * xp[..., j:j + N] * same
        tail = last_document_only(xp[..., xp.shape[-1] - (K - 1):], document[:, xp.shape[-1] - (K - 1):])
        return y.transpose(1, 2), tail
    return y.transpose(1, 2), xp[..., xp.shape[-1] - (K - 1):]


def last_document_only(tail: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """A conv tail [B, C, K-1] the next call continues from, zero where its token is not in the
    last document (documents [B, K-1]: each token's document id): a document that starts in the
    last K-1 tokens must not be read back across by the next window (short_conv, and the context
    parallel tail of the interdomain mixer)."""
    return tail * (documents == documents[:, -1:]).to(tail.dtype)[:, None]
