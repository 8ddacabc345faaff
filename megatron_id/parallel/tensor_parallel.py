"""Tensor parallelism applied from outside to the single-device model (torchtitan style).

How every parameter is cut is declared beside the module that creates it (PARAMETER_ROLES,
megatron_id/model/roles.py); `parallelize` shards a model in place by those declarations, and
`split_state_dict` / `merge_state_dicts` / `partition_dim` cut checkpoints by the same ones,
read from the model a config builds on the meta device, so the three can never disagree.
Parameter names do not change.

What the declarations say, per mixer (H heads, each rank keeps H / TP contiguous heads):
  interdomain / s4d   q, k, v (or a, b) and the gate: column-parallel (outputs are head-major)
                      short convs: their channels (= the heads' channels)
                      k_bias, v_bias, log_dt (Delta), a_log / a_im (A), c_re / c_im (C), c_vec: dim 0
                      k_norm, v_norm: replicated, shared by all heads, grads summed over TP
                      o_proj: row-parallel (its 2d-wide input for the linear contraction
                      readout is [Re c.U, Re c.Gamma] per head, so heads stay contiguous)
  softmax             q, k, v column-parallel (their biases, model.qkv_bias, with their rows);
                      o_proj row-parallel. With GQA (model.n_kv_heads) a rank's H / TP query
                      heads read exactly its n_kv_heads / TP key/value heads (kv head i // G)
  SwiGLU              w1, w3 column-parallel; w2 row-parallel
  embed / lm_head     vocabulary rows, padded to a multiple of make_vocab_size_divisible_by x TP
Sequence parallelism (optional): norms and residuals work on sequence shards; the input of
each mixer, SwiGLU and the LM head is all-gathered by a forward pre-hook, and row-parallel
outputs are reduce-scattered.
"""
from __future__ import annotations

import itertools
import re

import torch
from torch import nn

from ..config import Mixer, ModelConfig
from ..model.init import initialize
from ..model.language_model import LanguageModel
from ..model.layers import Embedding, Linear, RMSNorm
from ..model.mixers import MIXERS, InterdomainMixer
from ..model.roles import Role, Split, parameter_roles
from . import mappings
from .layers import (
    ColumnParallelLinear,
    PartialGradRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    group_size,
    shard_parameter,
)
from .layout import check_model_split, padded_vocab_size

# ---------------------------------------------------------------- the declared roles by name

# the names cut by vocabulary rows and padded: the weights of what LanguageModel declares so
# (its embedding and LM head), for the callers that ask by name without a config
VOCAB_PARAMETERS = frozenset(f"{child}.weight" for child, role in LanguageModel.PARAMETER_ROLES.items()
                             if role.split is Split.VOCAB)

_ROLES_BY_CONFIG: dict[str, dict[str, Role]] = {}
_ROLES_OF_ANY_CONFIG: dict[str, Role] = {}


def roles_of(cfg: ModelConfig) -> dict[str, Role]:
    """{state-dict name: declared Role} of the model `cfg` builds, read from a build on the meta
    device (no memory); cached per config, as checkpoints ask once per tensor."""
    key = repr(cfg)
    if key not in _ROLES_BY_CONFIG:
        with torch.device("meta"):
            _ROLES_BY_CONFIG[key] = parameter_roles(LanguageModel(cfg, seed=None))
    return _ROLES_BY_CONFIG[key]


def _any_layer(name: str) -> str:
    return re.sub(r"^layers\.\d+\.", "layers.0.", name)


def _roles_of_any_config() -> dict[str, Role]:
    """{name: Role} over every variant of the model (the mixers, and the switches that add or
    remove parameters), layer indices folded to 0: a name means the same parameter in every
    config, so its role does not depend on which config it came from."""
    if not _ROLES_OF_ANY_CONFIG:
        small = dict(vocab_size=8, d_model=8, n_heads=2, n_layers=1, ffn_hidden=8, state_size=2, rope=False)
        variants = [ModelConfig(mixer=Mixer.interdomain, query_readout=query, dual_kv_input=dual,
                                output_gate=True, **small)
                    for query, dual in itertools.product((True, False), repeat=2)]
        # every other mixer module once (softmax, and any added one: docs/adding-a-mixer.md)
        variants += [ModelConfig(mixer=Mixer(kind), **small) for kind, module in MIXERS.items()
                     if module is not InterdomainMixer]
        variants.append(ModelConfig(mixer=Mixer.softmax, qkv_bias=True, n_kv_heads=1, **small))   # + q/k/v biases
        union: dict[str, Role] = {}
        for cfg in variants:
            for name, role in roles_of(cfg).items():
                if union.setdefault(name, role) != role:
                    raise RuntimeError(f"'{name}' is declared {role} in one model variant and "
                                       f"{union[name]} in another: one name must mean one role.")
        _ROLES_OF_ANY_CONFIG.update(union)
    return _ROLES_OF_ANY_CONFIG


def parameter_role(name: str, cfg: ModelConfig | None = None) -> Role:
    """The declared role of parameter `name` (a LanguageModel state-dict key) in the model of
    `cfg`; without a config, the role that name has in any config."""
    roles = roles_of(cfg) if cfg is not None else _roles_of_any_config()
    role = roles.get(name if cfg is not None else _any_layer(name))
    if role is None:
        where = f"the model of this config (mixer={cfg.mixer.value})" if cfg is not None else "any model"
        raise ValueError(f"'{name}' is not a parameter of {where}; its tensor-parallel split is unknown.")
    return role


def partition_dim(name: str, cfg: ModelConfig | None = None) -> int | None:
    """The dim along which parameter `name` (a model state-dict key) is split; None = replicated.
    Pass the model config where there is one: a name it does not build is then an error."""
    return parameter_role(name, cfg).split.dim


def _gather_sequence_hook(group):
    def hook(module, args, kwargs):
        return (mappings.gather_from_sequence(args[0], group), *args[1:]), kwargs
    return hook


def _check_sequence_length(tp):
    def hook(module, args):
        n = args[0].shape[1]
        if n % tp:
            raise ValueError(f"sequence parallelism splits the sequence over {tp} ranks, but this "
                             f"batch has sequence length {n}; use a length divisible by {tp} "
                             f"(e.g. model.seq_length) or parallel.sequence_parallel=false.")
    return hook


# the parallel layer each layer kind becomes for each split it may be declared (None: it stays)
PARALLEL_LAYERS = {
    (Linear, Split.COLUMN): ColumnParallelLinear, (Linear, Split.VOCAB): ColumnParallelLinear,
    (Linear, Split.ROW): RowParallelLinear, (Linear, Split.REPLICATED): None,
    (Embedding, Split.VOCAB): VocabParallelEmbedding, (Embedding, Split.REPLICATED): None,
    (RMSNorm, Split.SUMMED_GRADS): PartialGradRMSNorm, (RMSNorm, Split.REPLICATED): None,
}
LAYER_KINDS = (Linear, Embedding, RMSNorm)


def _parallel_class(layer: nn.Module, name: str, split: Split | None, sequence_parallel: bool):
    """The parallel layer class `layer` (holding parameter `name`) becomes, or None."""
    kind = next(k for k in LAYER_KINDS if isinstance(layer, k))
    if (kind, split) not in PARALLEL_LAYERS:
        allowed = " or ".join(f"'{s.value}'" for k, s in PARALLEL_LAYERS if k is kind)
        raise ValueError(f"'{name}' belongs to a {kind.__name__} declared "
                         f"'{split.value if split else 'without a split'}'; a {kind.__name__} can only "
                         f"be {allowed}: change its declaration (PARAMETER_ROLES, model/roles.py).")
    if kind is RMSNorm and sequence_parallel:
        return PartialGradRMSNorm   # replicated, but each rank normalises its own sequence shard
    return PARALLEL_LAYERS[kind, split]


def _make_parallel(cls, layer: nn.Module, split: Split, group, vocab: int, sp: bool) -> nn.Module:
    if cls is ColumnParallelLinear:
        return cls(layer, group, sequence_parallel=sp, padded_out=vocab if split is Split.VOCAB else None)
    if cls is VocabParallelEmbedding:
        return cls(layer, group, vocab, sequence_parallel=sp)
    if cls is RowParallelLinear:
        return cls(layer, group, sequence_parallel=sp)
    return cls(layer, group)   # PartialGradRMSNorm


def parallelize(model: nn.Module, group, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard a LanguageModel over `group` in place (its weights, if materialised, are sliced;
    on the meta device only shapes change: call model.initialize afterwards).

    What each parameter becomes is its declared role (model/roles.py): a Linear declared
    column-parallel, row-parallel or vocabulary rows becomes the parallel layer, an Embedding
    declared vocabulary rows a VocabParallelEmbedding, a norm whose gradients are summed (and,
    with sequence parallelism, every norm) a PartialGradRMSNorm; any other parameter declared
    with the heads is sliced along dim 0 in place.

    The model's own forward is unchanged: it then returns vocabulary-sharded logits, for
    `vocab_parallel_cross_entropy` or `gather_logits`. With sequence parallelism the input
    sequence length must be divisible by the TP size.
    """
    cfg, tp = model.cfg, group_size(group)
    check_model_split(cfg, tp)
    vocab = padded_vocab_size(cfg, tp)
    sp = sequence_parallel
    roles = parameter_roles(model)
    # decide everything first, so that a declaration parallelize cannot follow changes nothing
    replacements, head_slices = {}, []
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{name}" if module_name else name
            split = roles[full_name].split
            if isinstance(module, LAYER_KINDS):
                cls = _parallel_class(module, full_name, split, sp)
                # a layer is replaced once, for all its parameters (a Linear's weight and bias)
                if replacements.setdefault(module_name, (cls, split)) != (cls, split):
                    raise ValueError(f"'{full_name}' is declared {split.value if split else 'without a split'} "
                                     f"but the other parameters of its layer otherwise: a layer is cut one way.")
            elif split is Split.HEADS:
                head_slices.append((module, name))
            elif split is not Split.REPLICATED:
                raise ValueError(f"'{full_name}' is declared {split.value if split else 'without a split'}; "
                                 f"outside a Linear, Embedding or RMSNorm a parameter can only be "
                                 f"{Split.HEADS.value} or {Split.REPLICATED.value}.")
    for module_name, (cls, split) in replacements.items():
        if cls is None:
            continue
        parent_name, _, name = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, name, _make_parallel(cls, getattr(parent, name), split, group, vocab, sp))
    for module, name in head_slices:
        shard_parameter(module, name, 0, group)
    if sp:
        model.embed.register_forward_pre_hook(_check_sequence_length(tp))
        for block in model.layers:
            block.mixer.register_forward_pre_hook(_gather_sequence_hook(group), with_kwargs=True)
            block.ffn.register_forward_pre_hook(_gather_sequence_hook(group), with_kwargs=True)
        model.lm_head.register_forward_pre_hook(_gather_sequence_hook(group), with_kwargs=True)
    if cfg.tie_embeddings:   # both were sharded alike (vocabulary rows, same padding): share again
        model.lm_head.weight = model.embed.weight
    model.tp_group, model.sequence_parallel = group, sp
    return model


# ---------------------------------------------------------------- checkpoints

# the attributes DeepSpeed reads from a tensor-parallel parameter (set by shard_parameter)
TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def materialise(part: nn.Module, prefix: str, seed: int | None, device) -> nn.Module:
    """A meta-device (parallelised) model or piece of it -> real memory, initialised as in the
    whole model (`prefix`: its name there). Each parameter is drawn at full size and sliced
    (init.py), one at a time, so no more than one full tensor exists at once. to_empty makes new
    Parameter objects: the TP attributes DeepSpeed reads are carried over, and parameters
    shared by several modules (tied embeddings) are shared again."""
    owners: dict[int, list] = {}
    for module in part.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    attributes = {name: {k: v for k, v in vars(p).items() if k in TP_ATTRIBUTES}
                  for name, p in part.named_parameters()}
    part.to_empty(device=device)
    for (first, first_name), *others in owners.values():
        for module, name in others:
            setattr(module, name, getattr(first, first_name))
    for name, p in part.named_parameters():
        for key, value in attributes[name].items():
            setattr(p, key, value)
    if seed is not None:
        initialize(part, seed, prefix=prefix)
    return part


def parallel_model(cfg: ModelConfig, group, *, seed: int, sequence_parallel: bool = False,
                   device="cpu") -> LanguageModel:
    """This TP rank's shard of the LanguageModel of `cfg`, built without the whole model ever
    existing: on the meta device, parallelised there, then materialised and initialised with
    the same weights as LanguageModel(cfg, seed) cut by `parallelize`."""
    with torch.device("meta"):
        model = LanguageModel(cfg, seed=None)
    parallelize(model, group, sequence_parallel=sequence_parallel)
    return materialise(model, "", seed, device)


def split_state_dict(full: dict, cfg: ModelConfig, tp: int) -> list[dict]:
    """A TP=1 state dict -> one state dict per TP rank (vocabulary padded for this TP)."""
    check_model_split(cfg, tp)
    vocab = padded_vocab_size(cfg, tp)
    shards = [{} for _ in range(tp)]
    for name, tensor in full.items():
        split = parameter_role(name, cfg).split
        if split.dim is None:
            for shard in shards:
                shard[name] = tensor.clone()
            continue
        if split is Split.VOCAB:
            if tensor.shape[0] != cfg.vocab_size:
                raise ValueError(f"{name} has {tensor.shape[0]} rows but model.vocab_size is "
                                 f"{cfg.vocab_size}: pass an unpadded TP=1 state dict.")
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, vocab - tensor.shape[0]))
        for shard, piece in zip(shards, tensor.chunk(tp, dim=split.dim)):
            shard[name] = piece.clone()
    return shards


def merge_state_dicts(shards: list[dict], cfg: ModelConfig) -> dict:
    """One state dict per TP rank -> the TP=1 state dict (vocabulary padding stripped).
    Replicated tensors must agree across ranks; a mismatch is an error, not a silent pick."""
    names = list(shards[0])
    for i, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(names):
            raise ValueError(f"TP rank {i} has different keys from rank 0: "
                             f"{sorted(set(shard) ^ set(names))[:5]}")
    full = {}
    for name in names:
        split = parameter_role(name, cfg).split
        if split.dim is None:
            for i, shard in enumerate(shards[1:], start=1):
                if not torch.equal(shard[name], shards[0][name]):
                    raise ValueError(f"replicated tensor '{name}' differs between TP rank 0 and "
                                     f"rank {i}; the shards do not come from one consistent model.")
            full[name] = shards[0][name].clone()
        else:
            full[name] = torch.cat([shard[name] for shard in shards], dim=split.dim)
            if split is Split.VOCAB:
                full[name] = full[name][:cfg.vocab_size].clone()
    return full
