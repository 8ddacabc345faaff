"""Parameter count, recurrent state and training FLOPs of a config (what `megatron-id params` prints).

Parameters are counted by building the model on the meta device (no memory, exact). FLOPs
count multiply-adds as 2 FLOPs, per token, for the forward pass, and training = 3 x forward
(backward ~ 2 x forward). Conventions:
- matmuls: 2 x every weight a token passes through (all blocks + lm_head; the embedding is a
  lookup); short convs 2 K d each; norms and elementwise work are not counted.
- the core of each mixer (what is not a projection or a conv) as its module declares it
  (core_macs_per_token beside the mixer's code): softmax 4 L d per layer for a context of
  L = seq_length (QK^T and AV over the full context, no causal discount: the PaLM/Megatron MFU
  convention; a sliding-window layer's L is min(seq_length, model.window)); interdomain / s4d
  the multiply-adds the chunked form executes (chunk T = chunk_size, including the masked upper
  triangles of its T x T blocks; complex x real counts 2 real multiply-adds, complex x complex 4).
- hybrids (model.layer_pattern): each layer counted as its own mixer.
- the decode state: each mixer's decode_state_numbers (fixed, per token of context); a softmax
  layer's KV cache is 2 n_kv_heads d_h numbers per token (2 d without grouped-query attention).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .language_model import LanguageModel
from .layers import Linear, ShortConv
from .mixers import MIXERS, InterdomainMixer, build_mixer
from .pattern import layer_config, layer_letters, layer_mixer
from .spec import ModelConfig, ffn_hidden_size, kv_heads


@dataclass
class ModelReport:
    parameters: int
    non_embedding_parameters: int
    state_per_token_per_layer: int | None   # an interdomain / S4D layer's fixed state (real numbers); None without one
    kv_cache_per_token_per_layer: int | None  # a softmax layer's KV cache per token of context; None without one
    forward_flops_per_token: int
    training_flops_per_token: int
    # the whole model's decode state (real numbers, short-conv tails aside): fixed_state, plus
    # decode_state_per_token for each token of context (the KV caches of A layers; W layers'
    # caches count as fixed, at their full window)
    fixed_state: int = 0
    decode_state_per_token: int = 0
    layer_pattern: str = ""                   # one letter per layer (model/pattern.py)

    def decode_state(self, context: int) -> int:
        """Real numbers the model holds to continue after `context` tokens."""
        return self.fixed_state + self.decode_state_per_token * context


def build_on_meta(cfg: ModelConfig) -> LanguageModel:
    with torch.device("meta"):
        return LanguageModel(cfg, seed=None)


def count_parameters(cfg: ModelConfig) -> int:
    return sum(p.numel() for p in build_on_meta(cfg).parameters())


def mixer_forward_flops_per_token(cfg: ModelConfig, context: int | None = None, layer: int = 0) -> int:
    """Forward FLOPs per token of mixer layer `layer`: its projections and convs, plus the core
    its module declares (core_macs_per_token), same conventions. `context` is the context a
    token attends over (default seq_length; attention counts it, a fixed state does not)."""
    kind, layer_cfg = layer_mixer(cfg, layer), layer_config(cfg, layer)
    with torch.device("meta"):
        mixer = build_mixer(layer_cfg, residual_std=cfg.init_std, kind=kind)
    macs = sum(m.weight.numel() for m in mixer.modules() if isinstance(m, (Linear, ShortConv)))
    macs += type(mixer).core_macs_per_token(layer_cfg, context or cfg.seq_length)
    return 2 * macs


def layer_flops_per_token(cfg: ModelConfig) -> list[int]:
    """Forward FLOPs per token of each block (its mixer and its SwiGLU): what the pipeline
    balances its stages by (parallel/layout.stage_layers)."""
    ffn = 2 * 3 * cfg.d_model * ffn_hidden_size(cfg)
    return [mixer_forward_flops_per_token(cfg, layer=i) + ffn for i in range(cfg.n_layers)]


def report(cfg: ModelConfig) -> ModelReport:
    model = build_on_meta(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.embed.weight.numel()
    d = cfg.d_model
    ffn_and_head = sum(m.weight.numel() for name, m in model.named_modules()
                       if isinstance(m, Linear) and ".mixer." not in f".{name}.")
    letters = layer_letters(cfg)
    per_kind = {}   # each kind of layer costs the same wherever it is
    for i, letter in enumerate(letters):
        if letter not in per_kind:
            per_kind[letter] = mixer_forward_flops_per_token(cfg, layer=i)
    flops = 2 * ffn_and_head + sum(per_kind[c] for c in letters)
    fixed = per_token = 0
    for i in range(len(letters)):
        layer_fixed, layer_per_token = MIXERS[layer_mixer(cfg, i)].decode_state_numbers(layer_config(cfg, i))
        fixed, per_token = fixed + layer_fixed, per_token + layer_per_token
    # the two per-layer figures `megatron-id params` prints
    state = InterdomainMixer.decode_state_numbers(cfg)[0] if set(letters) & set("IS") else None
    kv = 2 * kv_heads(cfg) * (d // cfg.n_heads) if set(letters) & set("AW") else None   # 2 d without GQA
    return ModelReport(n_params, n_params - n_embed, state, kv, flops, 3 * flops,
                       fixed_state=fixed, decode_state_per_token=per_token,
                       layer_pattern=letters)
