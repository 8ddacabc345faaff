"""The DeepSpeed training loop: equal losses across TP x PP x DP layouts and ZeRO stages, exact
resume, checkpoints that load at another layout, non-finite steps skipped (issue 5)."""
import re

import pytest
from conftest import CONFIGS, ROOT
from distributed import run_distributed

from megatron_id.config import load_config

STEPS = 5


def overrides(prefix, tp, zero, pp=1):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            f"parallel.tensor_model_parallel_size={tp}", f"parallel.pipeline_model_parallel_size={pp}",
            f"train.zero_stage={zero}", "train.precision=fp32", "train.micro_batch_size=2",
            "train.global_batch_size=4", f"train.train_tokens={STEPS * 4 * 64}", "optimizer.lr=1e-2",
            "optimizer.warmup_tokens=512", "optimizer.min_lr=1e-3"]


def _train(rank, world, items):
    from megatron_id.training.engine import Trainer
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], items)
    trainer = Trainer(cfg)
    return [(trainer.train_step(), trainer.grad_norm()) for _ in range(STEPS)]


@pytest.mark.slow
def test_losses_equal_across_layouts_and_zero_stages(fineweb_prefix):
    """(TP, PP, world, ZeRO); gradient accumulation 2 everywhere but DP=2 (1 there). The
    gradient norm (ours at ZeRO-0, DeepSpeed's under ZeRO) is compared too: it decides clipping."""
    reference = run_distributed(_train, 1, args=(overrides(fineweb_prefix, 1, 0),), timeout=300)[0]
    assert reference[0][0] > reference[-1][0]   # it learns: the comparison is not between constants
    assert max(norm for _, norm in reference) > 1.0   # clipping is active on some steps
    recompute = ["train.activation_checkpointing=true"]   # inside pipeline stages too
    # (PP=2 with ZeRO-1 is in (2, 2, 4, 1); DP=2 with ZeRO-1 in (2, 1, 4, 1): their one-axis
    # forms (1, 2, 2, 1) and (1, 1, 2, 1) were dropped for CI time)
    for tp, pp, world, zero, extra in [(2, 1, 2, 0, []), (1, 2, 2, 0, []), (1, 1, 2, 0, []), (2, 2, 4, 1, []),
                                       (1, 1, 2, 2, []), (2, 1, 4, 1, []), (1, 2, 2, 0, recompute)]:
        items = overrides(fineweb_prefix, tp, zero, pp) + extra
        results = run_distributed(_train, world, args=(items,), timeout=300)
        for rank, steps in enumerate(results):
            for step, ((loss, norm), (want, want_norm)) in enumerate(zip(steps, reference)):
                where = (tp, pp, world, zero, extra, rank, step)
                assert abs(loss - want) <= 1e-4 * abs(want), (where, loss, want)
                assert abs(norm - want_norm) <= 1e-4 * want_norm, (where, norm, want_norm)


def _file_backed(tensors) -> list:
    """The tensors whose memory lies in a mapping of a checkpoint file (/proc/self/maps)."""
    regions = []
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6 and parts[5].endswith(".pt"):
            regions.append(tuple(int(x, 16) for x in parts[0].split("-")))
    return [t for t in tensors if any(lo <= t.untyped_storage().data_ptr() < hi for lo, hi in regions)]


def _run(rank, world, items, steps, kill_at_end, kill_inside_save):
    import os
    import signal

    import torch

    from megatron_id.training.engine import Trainer
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], items)
    trainer = Trainer(cfg)
    if trainer.step:   # resumed (its files memory-mapped): Adam's state restored, none of it left in a file
        state = [v for adam in trainer.guard.state.values() for v in adam.values() if isinstance(v, torch.Tensor)]
        assert state and not _file_backed(state), (len(state), len(_file_backed(state)))
    if kill_inside_save:   # die after DeepSpeed wrote the files, before the rename and `latest`
        save = trainer.engine.save_checkpoint

        def save_then_die(*args, **kwargs):
            save(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.engine.save_checkpoint = save_then_die
    losses = trainer.train(max_steps=steps)
    if kill_at_end:
        os.kill(os.getpid(), signal.SIGKILL)
    return trainer.step, losses


@pytest.mark.slow
def test_killed_run_resumes_exactly_and_a_kill_during_save_keeps_latest(fineweb_prefix, tmp_path):
    from distributed import RankError
    base = overrides(fineweb_prefix, 1, 1) + ["train.global_batch_size=4", f"train.train_tokens={8 * 4 * 64}",
                                              "train.save_interval=4"]
    run = lambda items, steps, kill=False, kill_save=False: run_distributed(
        _run, 2, args=(base + items, steps, kill, kill_save), timeout=300)
    uninterrupted = run([], 8)[0][1]
    assert len(uninterrupted) == 8
    ckpt = tmp_path / "ckpt"
    with pytest.raises(RankError, match="exited with code -9"):
        run([f"train.save={ckpt}"], 4, kill=True)          # SIGKILL right after step 4's save
    assert (ckpt / "latest").read_text() == "iter_0000004"
    with pytest.raises(RankError, match="exited with code -9"):   # resumes, trains to 8, dies saving
        run([f"train.save={ckpt}", f"train.load={ckpt}"], 4, kill_save=True)
    assert (ckpt / "latest").read_text() == "iter_0000004"
    assert not (ckpt / "iter_0000008").exists()
    step, resumed = run([f"train.save={ckpt}", f"train.load={ckpt}"], 4)[0]
    assert step == 8 and len(resumed) == 4
    for got, want in zip(resumed, uninterrupted[4:]):
        assert abs(got - want) <= 1e-6 * abs(want), (resumed, uninterrupted[4:])
    assert (ckpt / "latest").read_text() == "iter_0000008"


def _signalled(rank, world, items):
    import os
    import signal

    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    step = trainer.train_step

    def step_and_signal():
        loss = step()
        if trainer.step == 3 and rank == 0:   # only rank 0 is told, as with a SLURM signal
            os.kill(os.getpid(), signal.SIGUSR1)
        return loss
    trainer.train_step = step_and_signal
    return trainer.step, len(trainer.train())


@pytest.mark.slow
def test_sigusr1_saves_and_stops_every_rank(fineweb_prefix, tmp_path):
    items = overrides(fineweb_prefix, 1, 1) + [f"train.save={tmp_path}", "train.save_interval=100"]
    results = run_distributed(_signalled, 2, args=(items,), timeout=300)
    assert [n for _, n in results] == [3, 3]
    assert (tmp_path / "latest").read_text() == "iter_0000003"


@pytest.mark.slow
def test_megatron_id_train_under_torchrun_logs_to_tensorboard(fineweb_prefix, tmp_path):
    import os
    import subprocess
    import sys
    items = overrides(fineweb_prefix, 1, 1) + [f"train.tensorboard_dir={tmp_path / 'tb'}",
                                               f"train.save={tmp_path / 'ckpt'}", "train.log_interval=1",
                                               "data.split=80,20,0", "train.eval_interval=2", "train.eval_iters=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_id.cli", "train", "--config", str(CONFIGS / "model" / "tiny.yaml"), *items]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step {STEPS}/{STEPS} [{'#' * 20}] 100% | loss" in done.stderr and "MFU" in done.stderr
    assert "TP=1 PP=1 DP=2 ZeRO-1 | global batch 4 x 64 tokens" in done.stderr   # the header
    planned = float(re.search(r"\| planned memory ([\d.]+) GiB per rank \(megatron-id plan\)", done.stderr).group(1))
    assert 0.01 < planned < 2, planned   # the tiny model at this layout, no CUDA overhead on CPU
    assert f"checkpoint: {tmp_path / 'ckpt'}" in done.stderr
    assert (tmp_path / "ckpt" / "latest").read_text() == f"iter_{STEPS:07d}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("loss", "perplexity", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "skipped_steps",
                 "memory_gib"):
        assert f"train/{name}" in tags, name
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    lrs = [e.value for e in events.Scalars("train/lr")]
    assert lrs[0] == 0.0 and lrs[1] > 0   # warmup from zero, in tokens
    valid = events.Scalars("valid/loss")
    assert [e.step for e in valid] == [2, 4, STEPS]   # every eval_interval steps and at the end
    assert valid[-1].value < valid[0].value and "validation at step 4 | loss" in done.stderr
    assert "valid/perplexity" in tags


def _train_then_validate(rank, world, items, steps):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    losses = trainer.train(max_steps=steps)
    trainer.evaluations = 0   # every run validates on the same batches
    return trainer.step, losses, trainer.evaluate()


@pytest.mark.slow
def test_pipeline_checkpoint_resumes_exactly_and_loads_at_tp1_pp1(fineweb_prefix, tmp_path):
    """TP=2 x PP=2 with ZeRO-1: 2 steps, save, resume for 2 more = 4 uninterrupted steps; the
    saved weights at TP=1, PP=1 give the same validation loss; loading them there with the
    optimizer state is refused with the fix named."""
    from distributed import RankError
    ckpt = tmp_path / "ckpt"
    items = lambda tp, pp, zero: overrides(fineweb_prefix, tp, zero, pp) + [
        "data.split=90,10,0", "train.eval_interval=100", "train.eval_iters=2", "train.save_interval=100"]
    run = lambda world, extra, steps: run_distributed(_train_then_validate, world,
                                                      args=(items(*extra[:3]) + extra[3:], steps), timeout=300)
    _, uninterrupted, _ = run(4, [2, 2, 1], 4)[0]
    step, first, saved_valid = run(4, [2, 2, 1, f"train.save={ckpt}"], 2)[0]
    assert step == 2 and (ckpt / "latest").read_text() == "iter_0000002"
    assert sorted(p.name for p in (ckpt / "iter_0000002").glob("layer_*"))[:2] == [
        "layer_00-model_00-model_states.pt", "layer_00-model_01-model_states.pt"]
    step, resumed, _ = run(4, [2, 2, 1, f"train.save={ckpt}", f"train.load={ckpt}"], 2)[0]
    assert step == 4
    for got, want in zip(first + resumed, uninterrupted):
        assert abs(got - want) <= 1e-6 * abs(want), (first + resumed, uninterrupted)

    load_old = [f"train.load={ckpt}"]
    (ckpt / "latest").write_text("iter_0000002")   # back to the step-2 checkpoint
    step, _, valid = run(1, [1, 1, 0, *load_old, "train.load_optimizer=false"], 0)[0]
    assert step == 2 and abs(valid - saved_valid) <= 1e-5 * saved_valid, (valid, saved_valid)
    step, _, valid_tp2 = run(2, [2, 1, 0, *load_old, "train.load_optimizer=false"], 0)[0]
    assert abs(valid_tp2 - saved_valid) <= 1e-5 * saved_valid
    with pytest.raises(RankError, match="saved at TP=2, PP=2, DP=1, ZeRO-1; this run is TP=1, PP=1.*"
                                        "train.load_optimizer=false"):
        run(1, [1, 1, 0, *load_old], 0)


def _nonfinite(rank, world, items, bad_steps, steps):
    """Steps in bad_steps get a NaN: odd ones in the loss, even ones only in a gradient (the
    loss stays finite). Returns per step: loss, skipped?, weights unchanged by the step?"""
    import torch

    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    module = trainer.engine.module
    first_param, handles = next(module.parameters()), []
    if trainer.pipelined:
        loss_fn = module.loss_fn
        module.loss_fn = lambda logits, labels: poison(loss_fn(logits, labels))
    else:
        loss_fn = trainer._loss
        trainer._loss = lambda batch: poison(loss_fn(batch))

    def poison(loss):
        step = trainer.step + 1
        if step in bad_steps and torch.is_grad_enabled():
            if step % 2:
                return loss * float("nan")
            def nan_gradient(grad):   # for this micro-batch only
                handles.pop().remove()
                return grad * float("nan")
            handles.append(first_param.register_hook(nan_gradient))
        return loss
    record = []
    step_fn = trainer.train_step

    def observed_step():
        before = [p.detach().clone() for p in module.parameters()]
        loss = step_fn()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, module.parameters()))
        record.append((loss, trainer.last_skipped, unchanged))
        return loss
    trainer.train_step = observed_step
    try:
        trainer.train(max_steps=steps)
    except Exception as err:
        return record, trainer.skipped_steps, f"{type(err).__name__}: {err}"
    return record, trainer.skipped_steps, all(bool(torch.isfinite(p).all()) for p in module.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,world,zero", [(1, 1, 1, 0), (1, 1, 2, 1), (1, 1, 1, 2), (1, 2, 2, 0)])
def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(fineweb_prefix, tmp_path, tp, pp, world, zero):
    items = overrides(fineweb_prefix, tp, zero, pp) + [f"train.save={tmp_path}", "train.save_interval=2",
                                                       "train.max_nonfinite_in_a_row=3",
                                                       f"train.train_tokens={8 * 256}"]
    record, skipped, finite = run_distributed(_nonfinite, world, args=(items, {3, 6}, 7), timeout=300)[0]
    assert [r[1] for r in record] == [False, False, True, False, False, True, False], record
    for loss, was_skipped, unchanged in record[1:]:   # (step 1 has LR 0: warmup starts at zero)
        assert unchanged == was_skipped   # a skipped step leaves every weight as it was
    assert record[1][0] == record[1][0] and record[3][0] == record[3][0]   # finite losses around
    assert skipped == 2 and finite is True
    if zero != 0:   # the stop after N in a row is the loop's, not the layout's: checked at ZeRO-0 (PP 1 and 2)
        return

    second = tmp_path / "second"   # a new run never writes into another run's history
    items = [i for i in items if not i.startswith("train.save=")] + [f"train.save={second}"]
    record, skipped, error = run_distributed(_nonfinite, world, args=(items, {3, 4, 5}, 7), timeout=300)[0]
    assert len(record) == 5 and skipped == 3
    assert error.startswith("NonFiniteTrainingError: stopping at step 5: 3 steps in a row (3-5)"), error
    assert f"Last good checkpoint: {second / 'iter_0000004'} (step 4)" in error


def _train_and_save(rank, world, items, path):
    from megatron_id.checkpoint.engine_io import current_layout
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    losses = [trainer.train_step() for _ in range(STEPS)]
    trainer.save_checkpoint(path)
    return losses, current_layout(trainer)


@pytest.mark.slow
def test_tied_embeddings_across_pipeline_stages(fineweb_prefix, tmp_path):
    """model.tie_embeddings: the matrix lives on the first and the last stage (DeepSpeed's
    TiedLayerSpec) and its two gradients are summed. Losses and the trained weights (read back
    from each layout's checkpoint as one TP=1 state dict) equal the single-process run's."""
    import torch

    from megatron_id.checkpoint.read import read_model_state
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"],
                      overrides(fineweb_prefix, 1, 0) + ["model.tie_embeddings=true"])
    runs = {}
    for tp, pp, world, zero in [(1, 1, 1, 0), (1, 2, 2, 1), (2, 2, 4, 0)]:
        items = overrides(fineweb_prefix, tp, zero, pp) + ["model.tie_embeddings=true"]
        path = tmp_path / f"{tp}{pp}{world}{zero}"
        losses, record = run_distributed(_train_and_save, world, args=(items, path), timeout=300)[0]
        runs[tp, pp] = losses, read_model_state(path / f"iter_{STEPS:07d}", cfg.model, record)
    ref_losses, ref_weights = runs[1, 1]
    assert ref_losses[-1] < ref_losses[0]
    assert torch.equal(ref_weights["embed.weight"], ref_weights["lm_head.weight"])   # one matrix
    for layout, (losses, weights) in runs.items():
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 1e-4 * abs(want), (layout, losses, ref_losses)
        assert set(weights) == set(ref_weights), layout
        for name, want in ref_weights.items():
            err = ((weights[name] - want).norm() / want.norm()).item()
            assert err <= 1e-4, (layout, name, err)


def _train_all(rank, world, items):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    start = trainer.step
    try:
        return start, trainer.train()
    finally:
        trainer.close()


@pytest.mark.slow
def test_weights_only_saves_and_the_step_0_save(fineweb_prefix, tmp_path, capfd):
    """train.save_optimizer=false (Megatron's --no-save-optim) and train.extra_save_steps=[0]
    (GPT-NeoX's extra_save_iters) for a run that starts from imported weights: no optimizer file
    in any checkpoint; the step-0 save resumes exactly (Adam has no state before the first step);
    a later one is refused with train.load_optimizer=true and continues with fresh Adam with
    false (at ZeRO-0 too), saying so; convert-checkpoint refuses it; the bad combinations are
    refused before any work."""
    import shutil

    import torch
    from distributed import RankError

    from megatron_id.checkpoint.files import ClientState, model_config_dict, read_client_state
    from megatron_id.checkpoint.integrity import CheckpointError
    from megatron_id.checkpoint.read import read_model_state, write_weights_only
    from megatron_id.checkpoint.reshard import convert
    from megatron_id.config import ConfigError
    from megatron_id.hf.export import why_not_an_import
    from megatron_id.model import LanguageModel
    from megatron_id.training.layout import training_layout
    steps = 3
    items = overrides(fineweb_prefix, 1, 1) + [f"train.train_tokens={steps * 4 * 64}", "train.eval_iters=0"]
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], items)
    for bad, message in [(["train.zero_stage=3"], "ZeRO-3 keeps the weights themselves in its optimizer files"),
                         (["train.reshardable_optimizer=true"], "saves the optimizer state a second time")]:
        with pytest.raises(ConfigError, match=message):
            training_layout(load_config([CONFIGS / "model" / "tiny.yaml"],
                                        items + ["train.save_optimizer=false", *bad]), 1)
    with pytest.raises(ConfigError, match=r"train.extra_save_steps=\[-1\] is invalid"):
        load_config([CONFIGS / "model" / "tiny.yaml"], items + ["train.extra_save_steps=[-1]"])
    # imported weights (another init than the run's own seed would give), at step 0
    imported = tmp_path / "imported"
    imported.mkdir()
    weights = LanguageModel(cfg.model, seed=7).state_dict()
    write_weights_only(imported, [weights], cfg.model, 1, ClientState(
        step=0, model=model_config_dict(cfg.model), weights_only=True,
        layout={"tensor": 1, "pipe": 1, "data": 1, "zero_stage": 0}))
    root = tmp_path / "ckpt"
    start, losses = run_distributed(_train_all, 1, timeout=300, args=(items + [
        f"train.load={imported}", f"train.save={root}", "train.save_interval=2", "train.extra_save_steps=[0]",
        "train.save_optimizer=false"],))[0]
    assert start == 0 and len(losses) == steps
    tags = sorted(p.name for p in root.glob("iter_*"))
    assert tags == ["iter_0000000", "iter_0000002", f"iter_{steps:07d}"]
    for tag in tags:
        assert read_client_state(root / tag).weights_only, tag
        assert not list((root / tag).glob("*optim_states.pt")), tag   # DeepSpeed's optimizer files left out
    saved0 = read_model_state(root / "iter_0000000", cfg.model, read_client_state(root / "iter_0000000").layout)
    assert sorted(saved0) == sorted(weights) and all(torch.equal(saved0[k], v) for k, v in weights.items())
    assert "loaded the weights of" in capfd.readouterr().err   # the import, said
    # the step-0 save alone in a folder: a run's checkpoint, never replaced by import-hf
    start_root = tmp_path / "start"
    start_root.mkdir()
    shutil.copytree(root / "iter_0000000", start_root / "iter_0000000")
    (start_root / "latest").write_text("iter_0000000")
    assert "written by a run" in why_not_an_import(start_root)
    start, resumed = run_distributed(_train_all, 1, timeout=300, args=(items + [f"train.load={start_root}"],))[0]
    assert start == 0 and resumed == losses, (resumed, losses)   # exact: nothing of Adam was lost
    assert "weights-only checkpoint (no optimizer state), so Adam starts fresh at step 0" in capfd.readouterr().err
    # past step 0: refused with train.load_optimizer=true, fresh Adam with false
    with pytest.raises(RankError, match=r"saved with train.save_optimizer=false.*Set train.load_optimizer=false"):
        run_distributed(_train_all, 1, timeout=300, args=(items + [f"train.load={root}"],))
    zero0 = tmp_path / "zero0"
    more = items[:-2] + [f"train.train_tokens={(steps + 1) * 4 * 64}", "train.eval_iters=0"]
    start, later = run_distributed(_train_all, 1, timeout=300, args=(more + [
        f"train.load={root}", "train.load_optimizer=false", "train.zero_stage=0", f"train.save={zero0}",
        "train.save_optimizer=false"],))[0]
    assert start == steps and len(later) == 1
    assert "Adam starts fresh at step 3" in capfd.readouterr().err
    saved = torch.load(zero0 / f"iter_{steps + 1:07d}" / "mp_rank_00_model_states.pt", weights_only=True)
    assert saved["optimizer"] is None and saved["module"]   # ZeRO-0 keeps Adam in its model file: left out
    with pytest.raises(CheckpointError, match="holds weights only"):
        convert(root, tmp_path / "converted")
