"""Pipeline parallelism: the LanguageModel cut into DeepSpeed `PipelineModule` stages.

The model is the same single-device LanguageModel, built on the meta device (no memory) and
tensor-parallelised there; its pieces become the pipeline's layer list

    [EmbeddingStage, BlockStage(0), ..., BlockStage(L-1), HeadStage]      -> loss_fn(logits, labels)

and DeepSpeed builds (materialises and initialises) only the pieces of this rank's stage, so a
stage never holds the whole model. Blocks are balanced across stages (the embedding joins the
first stage, the final norm and LM head the last, as in Megatron). Each piece is initialised
with its name inside the whole model, so PP=2 starts from exactly the weights of PP=1.

Names: pipeline checkpoints store one file per piece (`layer_XX-model_YY-model_states.pt`);
`to_model_names` / `from_model_names` translate between those and the LanguageModel's keys.
"""
from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch import nn

from ..config import ModelConfig
from ..model import LanguageModel
from ..model.init import initialize
from .layers import vocab_parallel_cross_entropy
from .tensor_parallel import parallelize

TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _materialise(part: nn.Module, prefix: str, seed: int | None, device) -> nn.Module:
    """A meta-device piece of the model -> real memory, initialised as in the whole model.
    to_empty makes new Parameter objects, so the TP attributes DeepSpeed reads are carried over."""
    attributes = {name: {k: v for k, v in vars(p).items() if k in TP_ATTRIBUTES}
                  for name, p in part.named_parameters()}
    part.to_empty(device=device)
    for name, p in part.named_parameters():
        for key, value in attributes[name].items():
            setattr(p, key, value)
    if seed is not None:
        initialize(part, seed, prefix=prefix)
    return part


class EmbeddingStage(nn.Module):
    def __init__(self, model: LanguageModel, seed: int | None, device):
        super().__init__()
        self.embed = _materialise(model.embed, "embed", seed, device)

    def forward(self, tokens):
        return self.embed(tokens)


class BlockStage(nn.Module):
    def __init__(self, model: LanguageModel, index: int, seed: int | None, device):
        super().__init__()
        self.block = _materialise(model.layers[index], f"layers.{index}", seed, device)

    def forward(self, h):
        return self.block(h)


class HeadStage(nn.Module):
    """Final norm and LM head; returns vocabulary-sharded logits (the loss runs after it)."""

    def __init__(self, model: LanguageModel, seed: int | None, device):
        super().__init__()
        self.norm = _materialise(model.norm, "norm", seed, device)
        self.lm_head = _materialise(model.lm_head, "lm_head", seed, device)

    def forward(self, h):
        return self.lm_head(self.norm(h))


def to_model_names(index: int, piece_state: dict, n_layers: int) -> dict:
    """The state dict of pipeline layer `index` -> LanguageModel keys."""
    if 1 <= index <= n_layers:
        return {f"layers.{index - 1}." + k.removeprefix("block."): v for k, v in piece_state.items()}
    return dict(piece_state)   # embed.weight / norm.weight, lm_head.weight are already model keys


def from_model_names(full: dict, index: int, n_layers: int) -> dict:
    """The LanguageModel-keyed state dict -> the state dict of pipeline layer `index`."""
    if index == 0:
        return {k: v for k, v in full.items() if k.startswith("embed.")}
    if index == n_layers + 1:
        return {k: v for k, v in full.items() if k.startswith(("norm.", "lm_head."))}
    prefix = f"layers.{index - 1}."
    return {"block." + k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}


def pipeline_model(cfg: ModelConfig, topology, tp_group, *, seed: int | None, loss_vocab: int,
                   sequence_parallel: bool = False, activation_checkpointing: bool = False,
                   device="cpu"):
    """The PipelineModule for `cfg` on `topology` (DeepSpeed's PipeModelDataParallelTopology;
    its model axis is `tp_group`). The loss is the vocab-parallel cross entropy over the first
    `loss_vocab` entries (the padding is masked)."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    with torch.device("meta"):
        meta = LanguageModel(cfg, seed=None)
    parallelize(meta, tp_group, sequence_parallel=sequence_parallel)
    specs = [LayerSpec(EmbeddingStage, meta, seed, device)]
    specs += [LayerSpec(BlockStage, meta, i, seed, device) for i in range(cfg.n_layers)]
    specs += [LayerSpec(HeadStage, meta, seed, device)]

    def loss_fn(logits, labels):
        return vocab_parallel_cross_entropy(logits, labels, tp_group, loss_vocab).mean()

    module = PipelineModule(
        specs, topology=topology, loss_fn=loss_fn, partition_method="type:BlockStage",
        activation_checkpoint_interval=1 if activation_checkpointing else 0,
        activation_checkpoint_func=functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
        checkpointable_layers=["BlockStage"])
    # DeepSpeed's gradient norm (clipping, ZeRO) sums over its "model parallel" group, which
    # under pipelining is every stage x TP rank, but counts a parameter not marked as model
    # parallel only on that group's rank 0, i.e. only on the first stage. Mark each parameter
    # that this rank must count: TP shards always, TP-replicated ones on TP rank 0 only.
    tp_rank = torch.distributed.get_rank(tp_group)
    for param in module.parameters():
        if not getattr(param, "tensor_model_parallel", False) and tp_rank == 0:
            param.model_parallel = True
    return module
