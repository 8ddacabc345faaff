"""The Llama-style decoder shared by every mixer (plain single-device code). Each block's mixer
is the one model.layer_pattern gives its layer (model/pattern.py: hybrids), model.mixer's by default.

    h = embed(tokens)
    for each block:  h = h + mixer(RMSNorm(h));  h = h + SwiGLU(RMSNorm(h))
    logits = lm_head(RMSNorm(h))                 (untied embeddings unless model.tie_embeddings; no dropout)

Init: N(0, init_std) everywhere, residual output projections (mixer o_proj, SwiGLU w2) with
init_std / sqrt(2 L) (GPT-2). See init.py for how each parameter gets its own generator.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .init import initialize
from .layers import Embedding, Linear, RMSNorm
from .mixers import build_mixer
from .pattern import layer_config, layer_mixer
from .roles import COLUMN_PARALLEL, REPLICATED, ROW_PARALLEL, VOCAB_ROWS, check_declarations
from .spec import ModelConfig, ffn_hidden_size


class SwiGLU(nn.Module):
    PARAMETER_ROLES = {"w1": COLUMN_PARALLEL, "w3": COLUMN_PARALLEL, "w2": ROW_PARALLEL}   # model/roles.py

    def __init__(self, d: int, hidden: int, init_std: float, residual_std: float):
        super().__init__()
        self.w1, self.w3 = Linear(d, hidden, init_std), Linear(d, hidden, init_std)
        self.w2 = Linear(hidden, d, residual_std)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    # the mixer and the SwiGLU declare their own parameters
    PARAMETER_ROLES = {"mixer_norm": REPLICATED, "ffn_norm": REPLICATED}

    def __init__(self, cfg: ModelConfig, residual_std: float, form: str, index: int = 0):
        """index: the layer's place in the model, which picks its mixer (model/pattern.py)."""
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = build_mixer(layer_config(cfg, index), residual_std, form=form, kind=layer_mixer(cfg, index))
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, ffn_hidden_size(cfg), cfg.init_std, residual_std)

    def forward(self, h, state=None, return_state=False, start=None, seq_idx=None, position_ids=None):
        # start: left padding; seq_idx, position_ids: packed documents (see the mixers)
        kwargs = {name: value for name, value in
                  (("start", start), ("seq_idx", seq_idx), ("position_ids", position_ids)) if value is not None}
        out = self.mixer(self.mixer_norm(h), state=state, return_state=return_state, **kwargs)
        mixed, state = out if return_state else (out, None)
        h = h + mixed
        h = h + self.ffn(self.ffn_norm(h))
        return (h, state) if return_state else h


class LanguageModel(nn.Module):
    # the embedding and the LM head are cut by vocabulary rows, padded to the TP multiple (the
    # head becomes a column-parallel layer); with tied embeddings they are one matrix, cut alike
    PARAMETER_ROLES = {"embed": VOCAB_ROWS, "norm": REPLICATED, "lm_head": VOCAB_ROWS}

    def __init__(self, cfg: ModelConfig, form: str = "chunked", seed: int | None = 42):
        """form: how interdomain/s4d mixers run full sequences (chunked | recurrent | naive).
        seed None skips initialisation (meta-device builds, or weights loaded right after)."""
        super().__init__()
        self.cfg = cfg
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, cfg.init_std)
        self.layers = nn.ModuleList(Block(cfg, residual_std, form, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, cfg.init_std)
        if cfg.tie_embeddings:   # one [vocab, d] matrix, initialised as the embedding
            self.lm_head.weight = self.embed.weight
        # recompute each block in backward instead of storing its activations (train.activation_checkpointing)
        self.activation_checkpointing = False
        check_declarations(self)   # every parameter's split, optimizer group and init (roles.py)
        if seed is not None:
            initialize(self, seed)

    def forward(self, tokens, states=None, return_states=False, *, embeddings=None, start=None,
                hidden_states: list | None = None, seq_idx=None, position_ids=None, return_hidden=False):
        """tokens [B, N] -> logits [B, N, V] (return_hidden=True: the final hidden states
        [B, N, d] after the final norm instead, for a loss that applies lm_head itself:
        parallel/fused_cross_entropy.py). `states` (one per layer, from an earlier call with
        return_states=True) continue a prefix: prefill and decode use the same call.
        For clients such as the Hugging Face model: `embeddings` [B, N, d] replace embed(tokens);
        `start` [B] marks left padding (each row's first real position, counted from the start
        of the sequence the states hold); `hidden_states`, a list, receives the embeddings and
        each layer's output (the last one after the final norm, as Hugging Face models do).
        Packed documents (data.reset_attention_mask / reset_position_ids, training/documents.py):
        `seq_idx` [B, N] a document index per token, `position_ids` [B, N] RoPE's positions."""
        h = self.embed(tokens) if embeddings is None else embeddings
        if hidden_states is not None:
            hidden_states.append(h)
        new_states = []
        for i, layer in enumerate(self.layers):
            if self.activation_checkpointing and self.training and torch.is_grad_enabled() and not return_states:
                h = torch.utils.checkpoint.checkpoint(layer, h, None, False, start, seq_idx, position_ids,
                                                      use_reentrant=False)
            else:
                out = layer(h, state=states[i] if states else None, return_state=return_states, start=start,
                            seq_idx=seq_idx, position_ids=position_ids)
                h = out[0] if return_states else out
                if return_states:
                    new_states.append(out[1])
            if hidden_states is not None:
                hidden_states.append(h)
        h = self.norm(h)
        if hidden_states is not None:
            hidden_states[-1] = h
        out = h if return_hidden else self.lm_head(h)
        return (out, new_states) if return_states else out


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in float32; labels are the tokens shifted by one."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
