"""Per-token losses of a model on token streams, computed in chunks that carry the model's state.

Everything the evaluations report is built from `sequence_losses`: the loss (nats) of predicting
each token from all the tokens before it in its window. Long windows are fed through the model
`chunk` tokens at a time with the per-layer state carried over (the prefill path of generation),
so memory is bounded by the chunk for the recurrent mixers at any length; softmax keeps a KV cache
that grows with the window, as it must.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


@torch.no_grad()
def sequence_losses(model, tokens: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """tokens [B, N] (long) -> losses [B, N-1] (float32, nats): position i is the loss of
    tokens[:, i + 1] given tokens[:, :i + 1]."""
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"need [batch, >= 2 tokens], got {tuple(tokens.shape)}")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    states, out = None, []
    for start in range(0, inputs.shape[1], chunk):
        logits, states = model(inputs[:, start:start + chunk], states=states, return_states=True)
        piece = targets[:, start:start + chunk]
        out.append(F.cross_entropy(logits.float().flatten(0, 1), piece.flatten(), reduction="none")
                   .view(piece.shape))
    return torch.cat(out, dim=1)


def windows(stream: np.ndarray, context: int, max_windows: int | None = None) -> np.ndarray:
    """Consecutive windows of context + 1 tokens of a token stream (each window's last token is
    the next one's first, as the trainer's samples): [W, context + 1]. The tail shorter than a
    window is not scored (counted by the caller)."""
    count = (len(stream) - 1) // context
    if max_windows is not None:
        count = min(count, max_windows)
    if count < 1:
        return np.zeros((0, context + 1), dtype=np.int64)
    index = np.arange(count)[:, None] * context + np.arange(context + 1)[None, :]
    return np.asarray(stream)[index].astype(np.int64)


class Totals:
    """Summed loss, scored tokens and the bytes they stand for: perplexity and bits per byte."""

    def __init__(self):
        self.loss, self.tokens, self.bytes = 0.0, 0, 0

    def add(self, losses: torch.Tensor, targets: torch.Tensor, token_bytes: np.ndarray | None) -> None:
        self.loss += float(losses.double().sum())
        self.tokens += losses.numel()
        if token_bytes is not None:
            self.bytes += int(token_bytes[targets.cpu().numpy()].sum())

    def result(self) -> dict:
        mean = self.loss / self.tokens if self.tokens else float("nan")
        return {"loss": mean, "perplexity": math.exp(mean) if self.tokens else float("nan"),
                "bits_per_byte": self.loss / math.log(2) / self.bytes if self.bytes else None,
                "tokens": self.tokens, "bytes": self.bytes}


def score_windows(model, rows: np.ndarray, batch_size: int, chunk: int, token_bytes: np.ndarray | None,
                  device, positions: np.ndarray | None = None) -> Totals:
    """Sum the losses of every window (rows [W, L+1]); `positions` (float64 [L], optional)
    accumulates the loss at each position over the windows."""
    totals = Totals()
    for start in range(0, len(rows), batch_size):
        batch = torch.from_numpy(rows[start:start + batch_size]).to(device)
        losses = sequence_losses(model, batch, chunk)
        totals.add(losses, batch[:, 1:], token_bytes)
        if positions is not None:
            positions += losses.double().sum(dim=0).cpu().numpy()
    return totals


@torch.no_grad()
def carried_position_losses(model, rows: np.ndarray, window: int, eod: int, horizon: int,
                            token_bytes: np.ndarray | None, device) -> tuple[tuple[np.ndarray, ...], int]:
    """rows [B, W x window + 1], each read window by window with its state carried and reset at
    document starts (training/carry.py, as data.carry_state trains). Returns ((loss, predictions,
    bytes) summed per position in the document, float64 [horizon] each), and the count of
    predictions at positions >= horizon (scored, not in the sums)."""
    from ..training.carry import RowStates, window_model_inputs
    loss_at, count_at, bytes_at = (np.zeros(horizon, dtype=np.float64) for _ in range(3))
    beyond = 0
    tokens = torch.from_numpy(rows).to(device)
    carried = RowStates.fresh(len(rows), device=tokens.device)
    for start in range(0, tokens.shape[1] - 1, window):
        inputs, targets = tokens[:, start:start + window], tokens[:, start + 1:start + window + 1]
        kwargs, after = window_model_inputs(inputs, eod, carried)
        logits, after.layers = model(inputs, return_states=True, **kwargs)
        carried = after
        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        positions = kwargs["position_ids"].flatten().cpu().numpy()
        losses = losses.double().cpu().numpy()
        inside = positions < horizon
        beyond += int((~inside).sum())
        np.add.at(loss_at, positions[inside], losses[inside])
        np.add.at(count_at, positions[inside], 1)
        if token_bytes is not None:
            np.add.at(bytes_at, positions[inside], token_bytes[targets.flatten().cpu().numpy()[inside]])
    return (loss_at, count_at, bytes_at), beyond
