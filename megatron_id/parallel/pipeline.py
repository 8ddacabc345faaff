"""Pipeline parallelism: the LanguageModel cut into DeepSpeed `PipelineModule` stages.

The model is the same single-device LanguageModel, built on the meta device (no memory) and
tensor-parallelised there; its pieces become the pipeline's layer list

    [EmbeddingStage, BlockStage(0), ..., BlockStage(L-1), FinalNormStage, HeadStage] -> loss

(with model.tie_embeddings the first and last are one TiedEmbeddingStage, DeepSpeed's
TiedLayerSpec)

and DeepSpeed builds (materialises and initialises) only the pieces of this rank's stage, so a
stage never holds the whole model. The blocks of each stage are parallel/layout.stage_layers'
(equal counts for a uniform model; a hybrid's | marks or cost balance); the embedding joins the
first stage, the final norm and LM head the last, as in Megatron. Each piece is initialised
with its name inside the whole model, so PP=2 starts from exactly the weights of PP=1.

Names: pipeline checkpoints store one file per piece (`layer_XX-model_YY-model_states.pt`);
`to_model_names` / `from_model_names` translate between those and the LanguageModel's keys.

The loss is the caller's (the Trainer's training/loss.LanguageModelLoss, the same object its
plain engine path calls): the last stage hands it the head's output and the batch's labels.
"""
from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch import nn

from ..config import ModelConfig
from ..model import LanguageModel
from .layout import stage_layers
from .tensor_parallel import materialise, parallelize


class EmbeddingStage(nn.Module):
    """Packed documents (training/documents.py) arrive as (tokens, seq_idx, position_ids); the
    two index tensors then travel with the hidden states to every block stage."""

    def __init__(self, model: LanguageModel, seed: int | None, device):
        super().__init__()
        self.embed = materialise(model.embed, "embed", seed, device)

    def forward(self, tokens):
        if isinstance(tokens, tuple):
            tokens, *documents = tokens
            return (self.embed(tokens), *documents)
        return self.embed(tokens)


class TiedEmbeddingStage(EmbeddingStage):
    """The embedding and the LM head sharing one matrix (model.tie_embeddings). DeepSpeed builds
    one on the first and one on the last stage (TiedLayerSpec), broadcasts the first's weight to
    the last at start and all-reduces the weight's gradient between the two every step."""

    def __init__(self, model: LanguageModel, seed: int | None, device):
        super().__init__(model, seed, device)
        self.lm_head = model.lm_head   # no parameter of its own once re-tied
        self.lm_head.weight = self.embed.weight

    @staticmethod
    def logits(stage: "TiedEmbeddingStage", h):
        return stage.lm_head(h)

    @staticmethod
    def hidden(stage: "TiedEmbeddingStage", h):   # the fused loss applies the head itself
        return h


class BlockStage(nn.Module):
    def __init__(self, model: LanguageModel, index: int, seed: int | None, device, documents=None):
        super().__init__()
        self.block = materialise(model.layers[index], f"layers.{index}", seed, device)
        self.documents = documents   # which of (seq_idx, position_ids) the block uses

    def forward(self, h):
        if isinstance(h, tuple):
            h, seq_idx, position_ids = h
            used = dict(seq_idx=seq_idx if self.documents.reset_attention_mask else None,
                        position_ids=position_ids if self.documents.reset_position_ids else None)
            return self.block(h, **used), seq_idx, position_ids
        return self.block(h)


class FinalNormStage(nn.Module):
    def __init__(self, model: LanguageModel, seed: int | None, device):
        super().__init__()
        self.norm = materialise(model.norm, "norm", seed, device)

    def forward(self, h):
        return self.norm(h[0] if isinstance(h, tuple) else h)


class HeadStage(nn.Module):
    """The LM head; returns vocabulary-sharded logits (the loss runs after it). With the fused
    loss (train.fused_lm_head_loss) it passes h on and the loss applies the head itself."""

    def __init__(self, model: LanguageModel, seed: int | None, device, fused_loss: bool = False):
        super().__init__()
        self.lm_head = materialise(model.lm_head, "lm_head", seed, device)
        self.fused_loss = fused_loss

    def forward(self, h):
        return h if self.fused_loss else self.lm_head(h)


# Pieces: 0 embedding, 1..L blocks, L+1 final norm, L+2 LM head. Checkpoint files and state
# dicts are per piece; with tied embeddings piece L+2 has none (piece 0 holds the matrix).
def saved_pieces(cfg: ModelConfig) -> range:
    """The pieces that own weights in a pipeline checkpoint (tied: the head is piece 0's matrix)."""
    return range(cfg.n_layers + (2 if cfg.tie_embeddings else 3))


def to_model_names(index: int, piece_state: dict, n_layers: int) -> dict:
    """The state dict of pipeline piece `index` -> LanguageModel keys."""
    if 1 <= index <= n_layers:
        return {f"layers.{index - 1}." + k.removeprefix("block."): v for k, v in piece_state.items()}
    return dict(piece_state)   # embed.weight (lm_head.weight if tied), norm.weight, lm_head.weight


def from_model_names(full: dict, index: int, n_layers: int, tied: bool = False) -> dict:
    """The LanguageModel-keyed state dict -> the state dict of pipeline piece `index`."""
    if index == 0:
        keys = ("embed.", "lm_head.") if tied else ("embed.",)
        return {k: v for k, v in full.items() if k.startswith(keys)}
    if index == n_layers + 1:
        return {k: v for k, v in full.items() if k.startswith("norm.")}
    if index == n_layers + 2:
        return {} if tied else {k: v for k, v in full.items() if k.startswith("lm_head.")}
    prefix = f"layers.{index - 1}."
    return {"block." + k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}


def pipeline_state_dict(full: dict, module, n_layers: int, tied: bool) -> dict:
    """This rank's TP shard of the model (LanguageModel keys) -> keys of its PipelineModule
    (`<piece>.<name>`, tied pieces under `tied_modules.embed.`)."""
    out = {}
    for piece in range(module._local_start, module._local_stop):
        if tied and piece in (0, n_layers + 2):
            out.update({f"tied_modules.embed.{k}": v for k, v in from_model_names(full, 0, n_layers, True).items()})
        else:
            out.update({f"{piece}.{k}": v for k, v in from_model_names(full, piece, n_layers).items()})
    return out


def _staged_pipeline_class():
    from deepspeed.pipe import PipelineModule

    class StagedPipelineModule(PipelineModule):
        """DeepSpeed's PipelineModule with the stage bounds given (parallel/layout.stage_layers:
        the pattern's | marks, a hybrid's cost balance) instead of one of its own methods."""

        def __init__(self, bounds, *args, **kwargs):
            self._given_bounds = list(bounds)   # read by _partition_layers during __init__
            super().__init__(*args, partition_method="given", **kwargs)

        def _partition_layers(self, method="given"):
            if len(self._given_bounds) != self.num_stages + 1:
                raise ValueError(f"{len(self._given_bounds) - 1} stage bounds for {self.num_stages} stages")
            self.parts = self._given_bounds
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])
    return StagedPipelineModule


def staged_pipeline_module(bounds, *args, **kwargs):
    """A PipelineModule whose stage s holds pieces bounds[s] .. bounds[s+1] - 1."""
    return _staged_pipeline_class()(bounds, *args, **kwargs)


def pipeline_model(cfg: ModelConfig, topology, tp_group, *, seed: int | None, loss,
                   sequence_parallel: bool = False, activation_checkpointing: bool = False,
                   device="cpu", documents=None):
    """The PipelineModule for `cfg` on `topology` (DeepSpeed's PipeModelDataParallelTopology;
    its model axis is `tp_group`). loss: called on the last stage as loss(output, labels, mask,
    lm_head=...) (training/loss.LanguageModelLoss); with `loss.fused` true the last stage ends
    with the final hidden states and the loss applies the LM head itself
    (train.fused_lm_head_loss). documents: training/documents.DocumentOptions when
    packed-document switches are on (the batches then carry the document tensors)."""
    # deepspeed.pipe here, not at the top: importing it starts DeepSpeed's accelerator detection,
    # which the modules importing this one for its name mapping alone (checkpoint/) do not need
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    fused_loss = loss.fused

    with torch.device("meta"):
        meta = LanguageModel(cfg, seed=None)
    parallelize(meta, tp_group, sequence_parallel=sequence_parallel)
    if cfg.tie_embeddings:
        first = TiedLayerSpec("embed", TiedEmbeddingStage, meta, seed, device, tied_weight_attr=["embed.weight"])
        last = TiedLayerSpec("embed", TiedEmbeddingStage, meta, seed, device, tied_weight_attr=["embed.weight"],
                             forward_fn=TiedEmbeddingStage.hidden if fused_loss else TiedEmbeddingStage.logits)
    else:
        first = LayerSpec(EmbeddingStage, meta, seed, device)
        last = LayerSpec(HeadStage, meta, seed, device, fused_loss)
    specs = [first] + [LayerSpec(BlockStage, meta, i, seed, device, documents) for i in range(cfg.n_layers)]
    specs += [LayerSpec(FinalNormStage, meta, seed, device), last]

    def loss_fn(output, labels):
        """DeepSpeed's loss_fn(outputs, labels) on the last stage: `labels` is the batch's second
        element, with packed documents (labels, loss mask) (training/engine.py _pipeline_batches)."""
        labels, mask = labels if isinstance(labels, tuple) else (labels, None)
        return loss(output, labels, mask, lm_head=last_head() if fused_loss else None)

    # pieces per stage: the embedding joins the first stage, the final norm and head the last
    blocks = stage_layers(cfg, topology.get_dim("pipe"))
    bounds = [0] + [1 + r.stop for r in blocks[:-1]] + [len(specs)]
    module = staged_pipeline_module(
        bounds, specs, topology=topology, loss_fn=loss_fn,
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        activation_checkpoint_func=functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
        checkpointable_layers=["BlockStage"])

    def last_head():   # the last stage's LM head (it exists on the last stage, where loss_fn runs)
        if cfg.tie_embeddings:
            return module.tied_modules["embed"].lm_head
        return next(m for m in module.modules() if isinstance(m, HeadStage)).lm_head
    # DeepSpeed's gradient norm (clipping, ZeRO) sums over its "model parallel" group, which
    # under pipelining is every stage x TP rank, but counts a parameter not marked as model
    # parallel only on that group's rank 0, i.e. only on the first stage. Mark each parameter
    # that this rank must count: TP shards always, TP-replicated ones on TP rank 0 only.
    tp_rank = torch.distributed.get_rank(tp_group)
    for param in module.parameters():
        if not getattr(param, "tensor_model_parallel", False) and tp_rank == 0:
            param.model_parallel = True
    return module
