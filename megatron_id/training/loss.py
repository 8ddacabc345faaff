"""The training loss, built once from the config and used by every engine path.

    loss = LanguageModelLoss.from_config(cfg, tp_group, context=cp)    # the Trainer, once
    mask = loss.mask(inputs)                                           # whole samples [B, N]
    value = loss(logits, labels, mask)                                 # the plain DeepSpeed engine
    value = loss(hidden, labels, mask, lm_head=model.lm_head)          # train.fused_lm_head_loss
    pipeline_model(..., loss=loss)                                     # PP > 1: the last stage calls it

What it settles, in one place (torchtitan's components/loss.py plays this part there):
  which tokens count   data.eod_mask_loss (training/documents.py) times, with data.source=mqar,
                       the answers' positions (data/mqar.py); `mask` finds both on whole samples,
                       before context parallelism cuts them into blocks;
  the cross entropy    vocab-parallel over the first model.vocab_size entries (the padding of the
                       TP-padded vocabulary never counts): from the logits, or with
                       train.fused_lm_head_loss from the final hidden states, the LM head applied
                       chunk by chunk (parallel/fused_cross_entropy.py);
  the normalisation    the mean over the counted tokens (masked_mean); with context parallelism
                       the whole sample's count, so that DeepSpeed's average over the C ranks of a
                       sample gives that sample's mean, as without context parallelism.

The engines keep what is theirs: running the model (and its autocast), cutting the sequence into
context-parallel blocks, and handing the loss to the optimizer's non-finite guard.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import Config, DataSource
from ..data.mqar import MQARTask
from ..parallel.context_parallel import ContextParallel
from ..parallel.fused_cross_entropy import lm_head_loss, masked_mean
from ..parallel.layers import vocab_parallel_cross_entropy
from .documents import DocumentOptions


class LanguageModelLoss:
    """The next-token loss of a micro-batch (module docstring). `fused`: the model hands over its
    final hidden states and the loss applies the LM head (given to each call) itself."""

    def __init__(self, vocab_size: int, tp_group=None, *, documents: DocumentOptions | None = None,
                 mqar: MQARTask | None = None, context: ContextParallel | None = None, fused: bool = False):
        self.vocab_size = vocab_size
        self.tp_group = tp_group
        self.documents = documents or DocumentOptions()
        self.mqar = mqar
        self.context = context
        self.fused = fused

    @classmethod
    def from_config(cls, cfg: Config, tp_group, *, context: ContextParallel | None = None,
                    documents: DocumentOptions | None = None, mqar: MQARTask | None = None) -> "LanguageModelLoss":
        """The loss of a run of `cfg`. documents / mqar: those the caller has already built from
        the same config (resolving the EOD id reads the data's sidecars: once is enough)."""
        if documents is None:
            documents = DocumentOptions.from_config(cfg.data)
        if mqar is None and cfg.data.source == DataSource.mqar:
            mqar = MQARTask.of_run(cfg)
        return cls(cfg.model.vocab_size, tp_group, documents=documents, mqar=mqar, context=context,
                   fused=cfg.train.fused_lm_head_loss)

    def mask(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """[B, N] float 0/1 for whole input samples: the tokens whose next-token loss counts
        (None: all of them)."""
        mask = self.documents.loss_mask(inputs)
        if self.mqar is not None:   # only the answers count
            mask = self.mqar.answer_mask(inputs) if mask is None else mask * self.mqar.answer_mask(inputs)
        return mask

    def __call__(self, output: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None, *,
                 lm_head=None) -> torch.Tensor:
        """The scalar loss. output: vocabulary-sharded logits [B, N, V_local], or with `fused` the
        final hidden states, `lm_head` being the model's (TP-parallel) head; labels [B, N]; mask as
        `mask` gives it (this rank's block of it under context parallelism) or None."""
        if self.fused:
            if lm_head is None:
                raise ValueError("the fused LM-head loss needs the model's lm_head")
            return self._fused(output, labels, mask, lm_head)
        per_token = vocab_parallel_cross_entropy(output, labels, self.tp_group, self.vocab_size)
        if self.context is not None:
            return self._context_parallel_mean(per_token, mask)
        return masked_mean(per_token, mask)

    def _context_parallel_mean(self, per_token: torch.Tensor, mask) -> torch.Tensor:
        """Sum of this block's losses / the sample's count of counted tokens, x C: DeepSpeed
        averages gradients (and the Trainer averages losses) over the C ranks of a sample, which
        then gives the whole sample's mean, as without context parallelism (masks included)."""
        weights = torch.ones_like(per_token) if mask is None else mask.to(per_token.dtype)
        count = weights.sum().detach()
        dist.all_reduce(count, group=self.context.group)
        return (per_token * weights).sum() / count.clamp_min(1) * self.context.size

    def _fused(self, hidden: torch.Tensor, labels: torch.Tensor, mask, lm_head) -> torch.Tensor:
        """The LM head and the loss chunked together, never holding the logits: the value of the
        unfused path (with context parallelism, _context_parallel_mean's, as sum / (count / C))."""
        normalizer = None
        if self.context is not None:   # the sample's count of counted tokens / C, as above
            count = (torch.ones_like(labels, dtype=torch.float32) if mask is None else mask.float()).sum()
            dist.all_reduce(count, group=self.context.group)
            normalizer = count.clamp_min(1) / self.context.size
        return lm_head_loss(lm_head, hidden, labels, self.vocab_size, mask, normalizer=normalizer)
