"""Issue 5 foundations: optimiser groups, the token schedule, layout checks, DeepSpeed config."""
import math

import pytest
import torch
from conftest import CONFIGS

from megatron_id.config import ConfigError, load_config
from megatron_id.model import LanguageModel
from megatron_id.training.layout import deepspeed_config, training_layout
from megatron_id.training.optim import apply_learning_rate, learning_rate, parameter_groups


def cfg_with(*overrides):
    return load_config([CONFIGS / "model" / "tiny.yaml"], list(overrides))


def names_by_group(model, groups):
    ids = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {ids[id(p)] for p in g["params"]} for g in groups}


def test_parameter_groups_follow_the_recipe():
    cfg = cfg_with()
    model = LanguageModel(cfg.model, seed=0)
    groups = parameter_groups(model, cfg.optimizer)
    named = names_by_group(model, groups)
    ssm_leaves = {n.split("layers.0.mixer.")[1] for n in named["ssm"] if n.startswith("layers.0.")}
    assert ssm_leaves == {"k_norm.weight", "v_norm.weight", "k_bias", "v_bias", "log_dt", "a_log",
                          "a_im", "c_re", "c_im"}
    assert "norm.weight" in named["no_decay"] and "layers.1.ffn_norm.weight" in named["no_decay"]
    assert "layers.0.mixer.q_conv.bias" in named["no_decay"]
    assert {"embed.weight", "lm_head.weight", "layers.0.mixer.q_proj.weight",
            "layers.0.mixer.q_conv.weight"} <= named["decay"]
    assert sum(len(v) for v in named.values()) == len(list(model.parameters()))
    by_name = {g["name"]: g for g in groups}
    assert by_name["decay"]["weight_decay"] == 0.1 and by_name["ssm"]["weight_decay"] == 0.0
    assert by_name["ssm"]["max_lr"] == 1e-3 and by_name["no_decay"]["weight_decay"] == 0.0
    s4d = LanguageModel(cfg_with("model.mixer=s4d").model, seed=0)
    assert any(n.endswith("c_vec") for n in names_by_group(s4d, parameter_groups(s4d, cfg.optimizer))["ssm"])
    soft = LanguageModel(cfg_with("model.mixer=softmax").model, seed=0)
    assert "ssm" not in {g["name"] for g in parameter_groups(soft, cfg.optimizer)}


def test_weight_decay_and_the_ssm_cap_act_on_the_right_parameters():
    cfg = cfg_with()
    model = LanguageModel(cfg.model, seed=0)
    opt = torch.optim.AdamW(parameter_groups(model, cfg.optimizer), lr=1.0)
    apply_learning_rate(opt, 3e-3)
    assert {g["name"]: g["lr"] for g in opt.param_groups} == {"decay": 3e-3, "no_decay": 3e-3, "ssm": 1e-3}
    apply_learning_rate(opt, 5e-4)
    assert all(g["lr"] == 5e-4 for g in opt.param_groups)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()   # zero gradients: only decoupled weight decay moves anything
    after = dict(model.named_parameters())
    assert not torch.equal(after["embed.weight"], before["embed.weight"])
    assert torch.equal(after["norm.weight"], before["norm.weight"])
    assert torch.equal(after["layers.0.mixer.c_re"], before["layers.0.mixer.c_re"])


def test_learning_rate_schedule_in_tokens():
    opt = cfg_with("optimizer.lr=3e-3", "optimizer.min_lr=1e-5", "optimizer.warmup_tokens=1000").optimizer
    total = 11_000
    assert learning_rate(0, opt, total) == 0
    assert learning_rate(500, opt, total) == pytest.approx(1.5e-3)
    assert learning_rate(1000, opt, total) == pytest.approx(3e-3)
    assert learning_rate(6000, opt, total) == pytest.approx((3e-3 + 1e-5) / 2)
    assert learning_rate(total, opt, total) == pytest.approx(1e-5)
    assert learning_rate(10 * total, opt, total) == pytest.approx(1e-5)
    lrs = [learning_rate(t, opt, total) for t in range(1000, total, 250)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("overrides,world,needles", [
    (["parallel.tensor_model_parallel_size=2"], 3, ["world size 3", "TP=2"]),
    (["parallel.pipeline_model_parallel_size=2", "train.zero_stage=2"], 2,
     ["train.zero_stage=2", "pipeline", "train.zero_stage=1"]),
    (["parallel.pipeline_model_parallel_size=3"], 3, ["model.n_layers=2", "3 equal stages"]),
    (["train.global_batch_size=6", "train.micro_batch_size=4"], 1, ["global_batch_size=6", "micro_batch_size=4"]),
    (["train.global_batch_size=6", "train.micro_batch_size=2"], 4, ["data-parallel size 4"]),
    (["parallel.tensor_model_parallel_size=3"], 3, ["n_heads=4", "tensor parallel size 3"]),
    (["train.zero_stage=7"], 1, ["train.zero_stage=7"]),
    (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", "model.seq_length=63"], 2,
     ["seq_length=63", "divisible by 2"]),
])
def test_invalid_layouts_are_refused_before_training(overrides, world, needles):
    with pytest.raises(ConfigError) as err:
        training_layout(cfg_with(*overrides), world)
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_layout_and_generated_deepspeed_config():
    cfg = cfg_with("parallel.tensor_model_parallel_size=2", "train.global_batch_size=16",
                   "train.micro_batch_size=2", "train.train_tokens=100000", "train.zero_stage=2",
                   "train.deepspeed.wall_clock_breakdown=true", "train.deepspeed.zero_optimization.overlap_comm=true")
    layout = training_layout(cfg, world_size=8)
    assert (layout.tensor, layout.pipe, layout.data, layout.gradient_accumulation) == (2, 1, 4, 2)
    assert layout.train_iters == math.ceil(100000 / (16 * 64))
    ds = deepspeed_config(cfg, layout)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 1.0
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert ds["wall_clock_breakdown"] is True and ds["bf16"] == {"enabled": False}
    bad = cfg_with("train.global_batch_size=16", "train.micro_batch_size=2", "train.deepspeed.train_batch_size=32")
    with pytest.raises(ConfigError, match="train_batch_size differ"):
        deepspeed_config(bad, training_layout(bad, 1))


def test_srun_per_process_launch_maps_to_torch_distributed(tmp_path, monkeypatch):
    from megatron_id.training.distributed import environment_from_slurm
    torchrun = {"RANK": "0", "SLURM_PROCID": "5"}
    assert environment_from_slurm(torchrun) == {}   # torchrun inside srun: its variables win
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
             "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "1234"}
    monkeypatch.setenv("PATH", str(tmp_path))       # no scontrol: a loud error, no localhost guess
    with pytest.raises(RuntimeError, match="scontrol.*MASTER_ADDR"):
        environment_from_slurm(slurm)
    fake = tmp_path / "scontrol"                    # answers as SLURM does for an emulated node
    fake.write_text('#!/bin/sh\nif [ "$2" = hostnames ]; then printf "node1\\nnode2\\n"; '
                    'else echo "NodeName=$3 Arch=x86_64"; echo "   NodeAddr=10.0.0.7 NodeHostName=$3"; fi\n')
    fake.chmod(0o755)
    assert environment_from_slurm(slurm) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                             "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "21234"}
    assert environment_from_slurm({**slurm, "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}


def test_guarded_adamw_clips_and_vetoes_nonfinite_losses_and_gradients():
    from megatron_id.training.optim import GuardedAdamW
    p = torch.nn.Parameter(torch.zeros(4))
    opt = GuardedAdamW([p], clip_grad=1.0, lr=0.1)
    p.grad = torch.tensor([6.0, 8.0, 0.0, 0.0])          # norm 10 -> clipped to 1
    opt.step()
    assert opt.updates == 1 and opt.last_grad_norm == pytest.approx(10.0)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8, 0.0, 0.0]), atol=1e-6)
    before = p.detach().clone()
    opt.observe_loss(torch.tensor(float("nan")))        # finite gradients, non-finite loss
    p.grad = torch.ones(4)
    opt.step()
    assert opt.updates == 1 and torch.equal(p.detach(), before)
    opt.step()                                            # the veto holds for the whole batch (ZeRO
    assert opt.updates == 1 and torch.equal(p.detach(), before)   # calls step() once per group)...
    opt.end_of_step()                                     # ...and ends with it
    p.grad = torch.tensor([1.0, float("inf"), 0.0, 0.0])  # finite loss, non-finite gradient
    opt.observe_loss(torch.tensor(2.0))
    opt.step()
    assert opt.updates == 1 and opt.last_grad_norm == math.inf and torch.equal(p.detach(), before)
    opt.end_of_step()
    with torch.no_grad():                                 # evaluation losses are not observed
        opt.observe_loss(torch.tensor(float("nan")))
    p.grad = torch.ones(4)
    opt.step()
    assert opt.updates == 2 and not torch.equal(p.detach(), before)
    partition = GuardedAdamW([p], clip_grad=None, lr=0.1)   # under ZeRO: checks only
    p.grad = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    partition.step()
    assert partition.updates == 0
