"""Each parameter's role is declared once, beside the module that creates it (model/roles.py),
and tensor parallelism, checkpoints and the optimizer groups all read that declaration.

- a parameter nobody declared is an error when LanguageModel is built, naming it;
- declaring a new parameter SSM_PER_HEAD is the only edit it needs to join the SSM optimizer
  group and to be cut with the heads by parallelize and split_state_dict;
- the declarations reproduce the name tables they replaced (frozen below) for every shipped
  config and mixer variant: the same partition dim per state-dict name, the same parallel
  layer per module, the same optimizer group per parameter.
"""
import math

import pytest
import torch
import torch.distributed as dist
from conftest import CONFIGS
from distributed import run_distributed
from torch import nn

from megatron_id.config import load_config
from megatron_id.model import LanguageModel, mixers
from megatron_id.model.layers import Linear, RMSNorm
from megatron_id.model.mixers import InterdomainMixer
from megatron_id.model.roles import SSM_PER_HEAD, Group, Role, Split, UndeclaredParameterError, parameter_roles
from megatron_id.parallel import (
    ColumnParallelLinear,
    PartialGradRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    merge_state_dicts,
    parallelize,
    partition_dim,
    split_state_dict,
    tensor_parallel,
)
from megatron_id.training.optim import parameter_groups


def tiny(*overrides):
    return load_config([CONFIGS / "model" / "tiny.yaml"], list(overrides))


def build(cfg, seed):
    return LanguageModel(cfg.model, seed=seed)


@pytest.fixture
def fresh_role_cache(monkeypatch):
    """Checkpoint functions cache the roles per config; a test that swaps a class must not
    read (or leave behind) roles of another class for the same config."""
    monkeypatch.setattr(tensor_parallel, "_ROLES_BY_CONFIG", {})


# ---------------------------------------------------------------- undeclared parameters

class MixerWithUndeclaredParameter(InterdomainMixer):
    def __init__(self, cfg, residual_std, form="chunked"):
        super().__init__(cfg, residual_std, form=form)
        self.extra = nn.Parameter(torch.zeros(cfg.n_heads, 3))


class MixerWithUndeclaredLinear(InterdomainMixer):
    def __init__(self, cfg, residual_std, form="chunked"):
        super().__init__(cfg, residual_std, form=form)
        self.x_proj = Linear(cfg.d_model, cfg.d_model, cfg.init_std)   # no split declared


class Gain(nn.Module):
    PARAMETER_ROLES = {"gain": Role(Split.REPLICATED, Group.NO_DECAY)}   # but no initial_value

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(1))


class MixerWithUninitialisedChild(InterdomainMixer):
    def __init__(self, cfg, residual_std, form="chunked"):
        super().__init__(cfg, residual_std, form=form)
        self.scale = Gain()


@pytest.mark.parametrize("device, seed", [("cpu", 0), ("meta", None)], ids=["initialised", "meta"])
def test_an_undeclared_parameter_is_an_error_naming_it(monkeypatch, device, seed):
    monkeypatch.setitem(mixers.MIXERS, "interdomain", MixerWithUndeclaredParameter)
    with torch.device(device), pytest.raises(UndeclaredParameterError) as error:
        build(tiny(), seed)
    message = str(error.value)
    assert "parameter 'layers.0.mixer.extra' (MixerWithUndeclaredParameter 'extra'; 1 more like it) " \
           "has no declared split / group" in message
    assert "add 'extra': Role(split=Split..., group=Group...) to " \
           "MixerWithUndeclaredParameter.PARAMETER_ROLES" in message


def test_a_layer_without_a_split_names_the_owner_that_must_declare_it(monkeypatch):
    monkeypatch.setitem(mixers.MIXERS, "interdomain", MixerWithUndeclaredLinear)
    with pytest.raises(UndeclaredParameterError,
                       match=r"'layers\.0\.mixer\.x_proj\.weight' \(Linear 'weight'; 1 more like it\) has no "
                             r"declared split: "
                             r"add 'x_proj': <Role> to MixerWithUndeclaredLinear\.PARAMETER_ROLES"):
        build(tiny(), None)


def test_a_parameter_without_an_init_is_an_error_at_construction(monkeypatch):
    monkeypatch.setitem(mixers.MIXERS, "interdomain", MixerWithUninitialisedChild)
    with torch.device("meta"), pytest.raises(
            UndeclaredParameterError,
            match=r"'layers\.0\.mixer\.scale\.gain' \(Gain 'gain'; 1 more like it\) has no declared init: "
                  r"give Gain an "
                  r"initial_value"):
        build(tiny(), None)


# ---------------------------------------------------------------- a new SSM parameter

class MixerWithSSMParameter(InterdomainMixer):
    """The whole edit a new per-head SSM parameter needs: create it, declare it, initialise it."""
    PARAMETER_ROLES = {**InterdomainMixer.PARAMETER_ROLES, "extra": SSM_PER_HEAD}

    def __init__(self, cfg, residual_std, form="chunked"):
        super().__init__(cfg, residual_std, form=form)
        self.extra = nn.Parameter(torch.zeros(cfg.n_heads, 3))

    def initial_value(self, name, shape, generator):
        if name == "extra":   # distinct values, so that a wrong slice shows
            return torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
        return super().initial_value(name, shape, generator)


def test_a_declared_ssm_parameter_joins_the_ssm_group(monkeypatch):
    monkeypatch.setitem(mixers.MIXERS, "interdomain", MixerWithSSMParameter)
    cfg = tiny()
    model = build(cfg, 0)
    groups = {g["name"]: g for g in parameter_groups(model, cfg.optimizer)}
    extra = model.layers[1].mixer.extra
    assert any(p is extra for p in groups["ssm"]["params"])
    assert not any(p is extra for name in ("decay", "no_decay") for p in groups[name]["params"])
    assert groups["ssm"]["weight_decay"] == 0.0 and groups["ssm"]["max_lr"] == cfg.optimizer.ssm_lr_max


def test_a_declared_ssm_parameter_is_cut_with_the_heads_in_checkpoints(monkeypatch, fresh_role_cache):
    monkeypatch.setitem(mixers.MIXERS, "interdomain", MixerWithSSMParameter)
    cfg = tiny().model
    full = LanguageModel(cfg, seed=0).state_dict()
    assert partition_dim("layers.0.mixer.extra", cfg) == 0
    shards = split_state_dict(full, cfg, 2)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard["layers.0.mixer.extra"], full["layers.0.mixer.extra"].chunk(2)[rank])
    merged = merge_state_dicts(shards, cfg)
    assert torch.equal(merged["layers.0.mixer.extra"], full["layers.0.mixer.extra"])


def _extra_at_tp(rank, world):
    mixers.MIXERS["interdomain"] = MixerWithSSMParameter   # this process only
    cfg = tiny().model
    model = parallelize(LanguageModel(cfg, seed=0), dist.group.WORLD)
    extra = model.layers[0].mixer.extra
    return dict(extra=extra.detach().clone(), dim=extra.partition_dim,
                tp=extra.tensor_model_parallel, full_shape=model.layers[0].mixer.tp_partitions["extra"].full_shape)


def test_a_declared_ssm_parameter_is_sharded_over_heads_by_parallelize(monkeypatch):
    monkeypatch.setitem(mixers.MIXERS, "interdomain", MixerWithSSMParameter)
    full = build(tiny(), 0).layers[0].mixer.extra.detach()
    results = run_distributed(_extra_at_tp, 2, timeout=120)
    for rank, got in enumerate(results):
        assert got["tp"] and got["dim"] == 0 and got["full_shape"] == tuple(full.shape)
        assert torch.equal(got["extra"], full.chunk(2)[rank])


# ---------------------------------------------------------------- the old tables, frozen

OLD_COLUMN_PARALLEL = {"q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "w1", "w3", "lm_head"}
OLD_ROW_PARALLEL = {"o_proj", "w2"}
OLD_HEAD_PARAMETERS = {"k_bias", "v_bias", "log_dt", "a_log", "a_im", "c_re", "c_im", "c_vec"}
OLD_CHANNEL_SHARDED = {"q_conv", "k_conv", "a_conv", "b_conv"}
OLD_VOCAB_PARAMETERS = {"embed.weight", "lm_head.weight"}
OLD_HEAD_SHARED_NORMS = {"k_norm", "v_norm"}
OLD_SSM_PARAMETERS = {"k_norm.weight", "v_norm.weight", "k_bias", "v_bias", "log_dt", "a_log", "a_im",
                      "c_re", "c_im", "c_vec"}


def old_partition_dim(name):
    parts = name.split(".")
    leaf, owner = parts[-1], (parts[-2] if len(parts) > 1 else "")
    if owner in OLD_COLUMN_PARALLEL or owner in OLD_CHANNEL_SHARDED or owner == "embed":
        return 0
    if owner in OLD_ROW_PARALLEL:
        return 1
    if leaf in OLD_HEAD_PARAMETERS:
        return 0
    return None


def old_group(name, param):
    tail2 = ".".join(name.split(".")[-2:])
    if name.split(".")[-1] in OLD_SSM_PARAMETERS or tail2 in OLD_SSM_PARAMETERS:
        return "ssm"
    return "no_decay" if param.dim() < 2 else "decay"


def old_parallel_class(name, child, sequence_parallel):
    """The class the old parallelize gave the child module called `name` (its own class if none)."""
    if name == "embed":
        return VocabParallelEmbedding
    if isinstance(child, Linear) and name in OLD_COLUMN_PARALLEL:
        return ColumnParallelLinear
    if isinstance(child, Linear) and name in OLD_ROW_PARALLEL:
        return RowParallelLinear
    if isinstance(child, RMSNorm) and (name in OLD_HEAD_SHARED_NORMS or sequence_parallel):
        return PartialGradRMSNorm
    return type(child)


MODEL_CONFIGS = sorted(p.name for p in (CONFIGS / "model").glob("*.yaml"))
VARIANTS = {"interdomain": [], "s4d": ["model.mixer=s4d"], "softmax": ["model.mixer=softmax"],
            "single_input": ["model.dual_kv_input=false"], "no_query_readout": ["model.query_readout=false"],
            "output_gate": ["model.output_gate=true"], "tied": ["model.tie_embeddings=true"],
            "s4d_gate_tied": ["model.mixer=s4d", "model.output_gate=true", "model.tie_embeddings=true"]}


# a hybrid config's pattern decides its mixers: the variants that set model.mixer are not its
CASES = [(config, variant) for config in MODEL_CONFIGS for variant in VARIANTS
         if not ("hybrid" in config and any(item.startswith("model.mixer=") for item in VARIANTS[variant]))]


@pytest.mark.parametrize("config, variant", CASES)
def test_the_declarations_reproduce_the_old_tables(config, variant):
    cfg = load_config([CONFIGS / "model" / config], VARIANTS[variant])
    with torch.device("meta"):
        model = LanguageModel(cfg.model, seed=None)
    names = list(model.state_dict())
    assert set(parameter_roles(model)) == set(names)
    # checkpoints: the partition dim of every state-dict name, with and without the config
    for name in names:
        old = old_partition_dim(name)
        assert partition_dim(name, cfg.model) == old, name
        assert partition_dim(name) == old, name
        assert (name in tensor_parallel.VOCAB_PARAMETERS) == (name in OLD_VOCAB_PARAMETERS), name
    # the optimizer group of every parameter
    group_by_id = {id(p): g["name"] for g in parameter_groups(model, cfg.optimizer) for p in g["params"]}
    for name, param in model.named_parameters():
        assert group_by_id[id(param)] == old_group(name, param), name
    # parallelize (at TP=1, where every shard is the whole tensor but the cut is recorded): the
    # same parallel layer per module and the same dim per parameter
    for sequence_parallel in (False, True):
        with torch.device("meta"):
            model = LanguageModel(cfg.model, seed=None)
        expected = {f"{parent}.{name}".lstrip("."): old_parallel_class(name, child, sequence_parallel)
                    for parent, module in model.named_modules() for name, child in module.named_children()}
        parallelize(model, None, sequence_parallel=sequence_parallel)
        got = {f"{parent}.{name}".lstrip("."): type(child)
               for parent, module in model.named_modules() for name, child in module.named_children()}
        assert got == expected
        for name, param in model.named_parameters(remove_duplicate=False):
            assert getattr(param, "partition_dim", None) == old_partition_dim(name), name
