"""Parameter count, recurrent state and training FLOPs of a config (what `megatron-id params` prints).

Parameters are counted by building the model on the meta device (no memory, exact). FLOPs
count multiply-adds as 2 FLOPs, per token, for the forward pass, and training = 3 x forward
(backward ~ 2 x forward). Conventions:
- matmuls: 2 x every weight a token passes through (all blocks + lm_head; the embedding is a
  lookup); short convs 2 K d each; norms and elementwise work are not counted.
- softmax core: 4 L d per layer for a context of L = seq_length (QK^T and AV over the full
  context, no causal discount: the PaLM/Megatron MFU convention).
- interdomain / s4d core: the multiply-adds the chunked form executes (chunk T = chunk_size,
  including the masked upper triangles of its T x T blocks); complex x real counts 2 real
  multiply-adds, complex x complex 4.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .language_model import LanguageModel
from .layers import Linear, ShortConv


@dataclass
class ModelReport:
    parameters: int
    non_embedding_parameters: int
    state_per_token_per_layer: int | None   # fixed-size state (real numbers); None for softmax
    kv_cache_per_token_per_layer: int | None  # softmax: real numbers per token of context
    forward_flops_per_token: int
    training_flops_per_token: int


def build_on_meta(cfg: ModelConfig) -> LanguageModel:
    with torch.device("meta"):
        return LanguageModel(cfg, seed=None)


def count_parameters(cfg: ModelConfig) -> int:
    return sum(p.numel() for p in build_on_meta(cfg).parameters())


def interdomain_core_macs_per_token_per_head(cfg: ModelConfig) -> int:
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
    return macs


def mixer_forward_flops_per_token(cfg: ModelConfig, context: int | None = None) -> int:
    """Forward FLOPs per token of one mixer layer (projections, convs, core), same conventions.
    `context` is the softmax context length (default seq_length)."""
    from .mixers import build_mixer
    with torch.device("meta"):
        mixer = build_mixer(cfg, residual_std=cfg.init_std)
    macs = sum(m.weight.numel() for m in mixer.modules() if isinstance(m, (Linear, ShortConv)))
    if cfg.mixer.value == "softmax":
        macs += 2 * (context or cfg.seq_length) * cfg.d_model
    else:
        macs += cfg.n_heads * interdomain_core_macs_per_token_per_head(cfg)
    return 2 * macs


def report(cfg: ModelConfig) -> ModelReport:
    model = build_on_meta(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.embed.weight.numel()
    d, H = cfg.d_model, cfg.n_heads
    ffn_and_head = sum(m.weight.numel() for name, m in model.named_modules()
                       if isinstance(m, Linear) and ".mixer." not in f".{name}.")
    flops = 2 * ffn_and_head + cfg.n_layers * mixer_forward_flops_per_token(cfg)
    if cfg.mixer.value == "softmax":
        state, kv = None, 2 * d
    else:
        state, kv = H * 2 * (2 * (d // H)) * cfg.state_size, None
    return ModelReport(n_params, n_params - n_embed, state, kv, flops, 3 * flops)
