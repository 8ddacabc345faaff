"""ZeRO-3 at pipeline parallel size 1 (issue 12): DeepSpeed partitions every parameter of the
head-sharded tensor-parallel model over the DP group; the losses and gradient norms equal
ZeRO-1's at the same layout, non-finite steps are skipped, a checkpoint resumes exactly, and
the layouts ZeRO-3 cannot serve are refused before any work."""
import math

import pytest
from conftest import CONFIGS
from distributed import run_distributed

from megatron_id.config import ConfigError, load_config

TINY = CONFIGS / "model" / "tiny.yaml"
TOKENIZER = CONFIGS.parent / "tests" / "data" / "gpt2-tokenizer.json"
# every parameter partitioned (none kept whole as "persistent") and released after each use,
# so that forward and backward gather each one again: the paths a large model takes
MINIMAL_LIVE = [f"train.deepspeed.zero_optimization.{key}=0" for key in (
    "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size")]


def overrides(prefix, tp, zero, steps, global_batch=4):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            f"parallel.tensor_model_parallel_size={tp}", "parallel.pipeline_model_parallel_size=1",
            f"train.zero_stage={zero}", "train.precision=fp32", "train.micro_batch_size=2",
            f"train.global_batch_size={global_batch}", f"train.train_tokens={steps * global_batch * 64}",
            "optimizer.lr=1e-2", "optimizer.warmup_tokens=512", "optimizer.min_lr=1e-3"]


def _train(rank, world, items, steps):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    params = list(trainer.engine.module.parameters())
    held = sum(p.numel() for p in params)                                  # this rank's p.data
    full = sum(getattr(p, "ds_numel", p.numel()) for p in params)          # the TP shard
    partition = sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor"))
    steps_run = [(trainer.train_step(), trainer.grad_norm()) for _ in range(steps)]
    return steps_run, (held, full, partition)


@pytest.mark.slow
def test_zero3_losses_and_grad_norms_equal_zero1_at_the_same_layout(fineweb_prefix):
    """(TP, DP) = (2, 2) with tied embeddings, sequence parallelism and activation checkpointing,
    and (1, 2) with gradient accumulation 2: 5 steps of ZeRO-3 (every parameter partitioned and
    re-gathered in backward) against ZeRO-1. Clipping is active on some steps, so the gradient
    norm DeepSpeed computes over the partitions (TP shards counted once, replicated parameters
    on TP rank 0 only) must be right for the losses to agree."""
    steps = 5
    for tp, world, batch, extra in [
            (2, 4, 4, ["model.tie_embeddings=true", "parallel.sequence_parallel=true",
                       "train.activation_checkpointing=true"]),
            (1, 2, 8, [])]:
        runs = {}
        for zero in (1, 3):
            items = overrides(fineweb_prefix, tp, zero, steps, batch) + extra + (MINIMAL_LIVE if zero == 3 else [])
            runs[zero] = run_distributed(_train, world, args=(items, steps), timeout=400)
        reference = runs[1][0][0]
        assert reference[-1][0] < reference[0][0]                 # it learns
        assert max(norm for _, norm in reference) > 1.0           # clipping is active on some steps
        for rank, (got, (held, full, partition)) in enumerate(runs[3]):
            for step, ((loss, norm), (want, want_norm)) in enumerate(zip(got, reference)):
                assert abs(loss - want) <= 1e-5 * abs(want), (tp, rank, step, loss, want)
                assert abs(norm - want_norm) <= 1e-5 * want_norm, (tp, rank, step, norm, want_norm)
            # after the step no parameter is held whole; each rank keeps about 1/DP of its TP shard
            dp = world // tp
            assert held == 0, held
            assert full // dp <= partition <= full // dp + 64, (partition, full)
            assert full == runs[1][rank][1][1]                  # the same TP shard as ZeRO-1's


def _nonfinite(rank, world, items, bad_steps, steps):
    """Step 3 gets a NaN loss (odd) and step 4 a NaN in one gradient (even). Returns per step:
    skipped?, this rank's partitions unchanged by the step?"""
    import torch

    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    params = list(trainer.engine.module.parameters())
    first, handles = params[0], []
    loss_fn = trainer._loss

    def poisoned(batch):
        loss, step = loss_fn(batch), trainer.step + 1
        if step in bad_steps and step % 2:
            return loss * float("nan")
        if step in bad_steps:
            def nan_gradient(grad):
                handles.pop().remove()
                return grad * float("nan")
            handles.append(first.register_hook(nan_gradient))
        return loss
    trainer._loss = poisoned
    record = []
    for _ in range(steps):
        before = [p.ds_tensor.clone() for p in params]
        trainer.train_step()
        record.append((trainer.last_skipped, all(torch.equal(b, p.ds_tensor) for b, p in zip(before, params)),
                       math.isinf(trainer.grad_norm())))
    return record


@pytest.mark.slow
def test_zero3_skips_nonfinite_steps(fineweb_prefix):
    items = overrides(fineweb_prefix, 1, 3, 6) + MINIMAL_LIVE
    record = run_distributed(_nonfinite, 2, args=(items, {3, 4}, 6), timeout=300)[0]
    assert [skipped for skipped, _, _ in record] == [False, False, True, True, False, False], record
    for skipped, unchanged, inf_norm in record[1:]:   # (step 1 has LR 0: warmup starts at zero)
        assert unchanged == skipped and inf_norm == skipped, record


def _load_weights_then_step(rank, world, items):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    loaded = {k: v.detach().clone() for k, v in trainer.engine.module.state_dict().items()}
    return trainer.step, loaded, trainer.train_step()


def _run(rank, world, items, steps):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    return trainer.step, trainer.train(max_steps=steps)


@pytest.mark.slow
def test_zero3_checkpoint_resumes_exactly_at_the_same_layout(fineweb_prefix, tmp_path):
    """TP=2 x DP=2: 2 steps, save, resume for 2 more = 4 uninterrupted steps. DeepSpeed writes
    one model file per (DP, TP) rank at ZeRO-3, whose `module` holds empty placeholders: the
    weights are only in the fp32 partitions of the optimizer files (what a reader of another
    layout must consolidate)."""
    import torch
    ckpt = tmp_path / "ckpt"
    items = overrides(fineweb_prefix, 2, 3, 4) + ["train.save_interval=100"]
    run = lambda extra, steps: run_distributed(_run, 4, args=(items + extra, steps), timeout=400)[0]  # noqa: E731
    _, uninterrupted = run([], 4)
    start, first = run([f"train.save={ckpt}"], 2)
    assert start == 0 and (ckpt / "latest").read_text() == "iter_0000002"
    import shutil
    at_step_2 = tmp_path / "at-step-2"   # the resume below moves ckpt's `latest` to step 4
    shutil.copytree(ckpt, at_step_2)
    start, resumed = run([f"train.save={ckpt}", f"train.load={ckpt}"], 2)
    assert start == 2
    for got, want in zip(first + resumed, uninterrupted, strict=True):
        assert abs(got - want) <= 1e-6 * abs(want), (first + resumed, uninterrupted)

    folder = ckpt / "iter_0000002"
    names = sorted(p.name for p in folder.glob("*_model_states.pt"))
    assert names == [f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt" for d in range(2) for t in range(2)]
    states = torch.load(folder / names[0], map_location="cpu", weights_only=False)
    assert states["module"] and all(t.numel() == 0 for t in states["module"].values())
    optim = torch.load(folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu",
                       weights_only=False)["optimizer_state_dict"]
    shapes = [shape for group in states["param_shapes"] for shape in group.values()]
    held = sum(t.numel() for t in optim["fp32_flat_groups"])
    assert held == sum(math.ceil(s.numel() / 2) for s in shapes)   # each parameter cut in DP pieces

    # another layout consolidates the DP pieces: the weights alone at TP=1 x DP=1 x ZeRO-0 give
    # step 3 the loss of the uninterrupted run (a step's loss is computed before its update)
    single = overrides(fineweb_prefix, 1, 0, 4) + [f"train.load={at_step_2}", "train.load_optimizer=false"]
    start, loaded, loss = run_distributed(_load_weights_then_step, 1, args=(single,), timeout=300)[0]
    assert start == 2 and abs(loss - uninterrupted[2]) <= 1e-5 * abs(uninterrupted[2]), (loss, uninterrupted)
    # and the Hugging Face export of the ZeRO-3 checkpoint holds those same weights
    from safetensors.torch import load_file

    from megatron_id.hf.export import export_hf
    export_hf(at_step_2, tmp_path / "hf", tokenizer=TOKENIZER)
    exported = {k.removeprefix("model."): v for k, v in load_file(str(tmp_path / "hf" / "model.safetensors")).items()}
    assert sorted(exported) == sorted(loaded)
    for name, want in loaded.items():   # the loaded module has the vocabulary padded for TP
        assert torch.equal(exported[name], want[:exported[name].shape[0]]), name
    # its optimizer state cannot move: convert-checkpoint says so and writes nothing
    import subprocess
    import sys

    from conftest import ROOT
    out = tmp_path / "converted"
    done = subprocess.run([sys.executable, "-m", "megatron_id.cli", "convert-checkpoint", "--input", str(ckpt),
                           "--output", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "was saved at ZeRO-3" in done.stderr and not out.exists(), done.stderr


def test_zero3_layout_rules():
    """Accepted with PP=1; refused with pipelines and with the re-shardable optimizer state,
    each with the values and the fix."""
    from megatron_id.training.layout import deepspeed_config, training_layout
    base = ["train.zero_stage=3", "train.micro_batch_size=1", "train.global_batch_size=8",
            "train.train_tokens=100000"]
    cfg = load_config([TINY], base + ["parallel.tensor_model_parallel_size=2"])
    layout = training_layout(cfg, 8)
    assert (layout.tensor, layout.pipe, layout.data) == (2, 1, 4)
    assert deepspeed_config(cfg, layout)["zero_optimization"] == {"stage": 3}
    with pytest.raises(ConfigError, match=r"train.zero_stage=3 cannot be combined with pipeline parallelism "
                                          r"\(parallel.pipeline_model_parallel_size=2\).*train.zero_stage=1"):
        training_layout(load_config([TINY], base + ["parallel.pipeline_model_parallel_size=2"]), 8)
    with pytest.raises(ConfigError, match=r"train.reshardable_optimizer=true cannot be combined with "
                                          r"train.zero_stage=3.*train.reshardable_optimizer=false"):
        training_layout(load_config([TINY], base + ["train.reshardable_optimizer=true"]), 8)


@pytest.mark.slow
def test_recomputing_core_under_zero3_equals_zero1(fineweb_prefix):
    """model.core_impl=recompute with chunks of 8 (8 chunks, 2 segments per 64-token row):
    under ZeRO-1 the mixer runs features and core in segments; under ZeRO-3, whose parameters
    are gathered in submodule hooks that functional calls would bypass, only the core
    recomputes. Both train to the same losses."""
    steps, extra = 3, ["model.chunk_size=8", "model.core_impl=recompute"]
    runs = {zero: run_distributed(_train, 2, args=(overrides(fineweb_prefix, 1, zero, steps, 8) + extra
                                                    + (MINIMAL_LIVE if zero == 3 else []), steps), timeout=300)
            for zero in (1, 3)}
    reference = [loss for loss, _ in runs[1][0][0]]
    assert reference[-1] < reference[0]
    for (loss, _), want in zip(runs[3][0][0], reference):
        assert abs(loss - want) <= 1e-5 * abs(want), (loss, want)
