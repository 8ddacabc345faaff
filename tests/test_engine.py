"""The DeepSpeed training step: equal losses across TP x DP layouts and ZeRO stages (issue 5,
plain engine; pipeline layouts are not built yet)."""
import pytest

from conftest import CONFIGS, ROOT
from distributed import run_distributed
from megatron_id.config import load_config

STEPS = 5


@pytest.fixture(scope="module")
def fineweb_prefix(tmp_path_factory):
    from data_tools.preprocess import main as preprocess
    out = tmp_path_factory.mktemp("data") / "fineweb"
    assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"),
                       "--tokenizer", str(ROOT / "tests/data/gpt2-tokenizer.json"),
                       "--output-prefix", str(out), "--append-eod", "--no-progress"]) == 0
    return f"{out}_text_document"


def overrides(prefix, tp, zero):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            f"parallel.tensor_model_parallel_size={tp}", f"train.zero_stage={zero}",
            "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=4",
            f"train.train_tokens={STEPS * 4 * 64}", "optimizer.lr=1e-2", "optimizer.warmup_tokens=512",
            "optimizer.min_lr=1e-3"]


def _train(rank, world, items):
    from megatron_id.training.engine import Trainer
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], items)
    trainer = Trainer(cfg)
    return [trainer.train_step() for _ in range(STEPS)]


@pytest.mark.slow
def test_losses_equal_across_layouts_and_zero_stages(fineweb_prefix):
    reference = run_distributed(_train, 1, args=(overrides(fineweb_prefix, 1, 0),), timeout=300)[0]
    assert reference[0] > reference[-1]   # it learns: the comparison is not between constants
    for tp, world, zero in [(2, 2, 0), (1, 2, 0), (1, 2, 1), (1, 2, 2), (2, 4, 1)]:
        results = run_distributed(_train, world, args=(overrides(fineweb_prefix, tp, zero),), timeout=300)
        for rank, losses in enumerate(results):
            for step, (got, want) in enumerate(zip(losses, reference)):
                assert abs(got - want) <= 1e-4 * abs(want), (tp, world, zero, rank, step, got, want)


def _run(rank, world, items, steps, kill_at_end, kill_inside_save):
    import os
    import signal
    from megatron_id.training.engine import Trainer
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], items)
    trainer = Trainer(cfg)
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
    assert f"step {STEPS}/{STEPS} | loss" in done.stderr and "MFU" in done.stderr
    assert f"checkpoint: {tmp_path / 'ckpt'}" in done.stderr
    assert (tmp_path / "ckpt" / "latest").read_text() == f"iter_{STEPS:07d}"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("loss", "perplexity", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu",
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
