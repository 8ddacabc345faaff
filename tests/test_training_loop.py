"""The training loop users bring from Megatron-LM, torchtitan and flame (issue 28): schedules,
the JSONL metrics file, wandb, the profiler window and the step's time breakdown, named
validation sets, asynchronous saves and the export at the end.

The end-to-end test trains the tiny model on 2 gloo ranks with every option on, then resumes it
twice from its step-3 checkpoint: once stopped by SIGUSR1 at step 5 and continued (the wandb run
id and the loss trajectory carry on), once killed with SIGKILL while the background save of step
6 is being written (`latest` stays on step 3, and a rerun continues exactly)."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bad_inputs import refused
from conftest import CONFIGS, ROOT
from distributed import RankError, run_distributed
from megatron_id.config import ConfigError, load_config
from megatron_id.training.optim import learning_rate

GPT2 = ROOT / "tests" / "data" / "gpt2-tokenizer.json"
FINEWEB = ROOT / "tests" / "data" / "fineweb-edu-sample-150.jsonl"
TINY = CONFIGS / "model" / "tiny.yaml"


# ------------------------------------------------------------------ schedules

def _opt(*items):
    return load_config([], ["optimizer.lr=1e-3", "optimizer.min_lr=1e-4", "optimizer.warmup_tokens=100",
                            *items]).optimizer


@pytest.mark.parametrize("shape, q_half", [("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_wsd_is_warmup_then_stable_then_the_decay_shape(shape, q_half):
    opt, total = _opt("optimizer.schedule=wsd", "optimizer.decay_fraction=0.25", f"optimizer.decay_shape={shape}"), 1000
    assert learning_rate(50, opt, total) == pytest.approx(5e-4)       # warmup: linear from 0
    for tokens in (100, 400, 749, 750):                                  # stable until 75% of the run
        assert learning_rate(tokens, opt, total) == 1e-3
    assert learning_rate(875, opt, total) == pytest.approx(1e-4 + 9e-4 * q_half)   # halfway through the decay
    assert learning_rate(1000, opt, total) == pytest.approx(1e-4) == learning_rate(5000, opt, total)


def test_linear_constant_and_the_papers_cosine():
    linear, constant, cosine = (_opt(f"optimizer.schedule={s}") for s in ("linear", "constant", "cosine"))
    assert learning_rate(550, linear, 1000) == pytest.approx(1e-3 - 9e-4 * 0.5)
    assert learning_rate(1000, linear, 1000) == pytest.approx(1e-4)
    assert learning_rate(50, constant, 1000) == pytest.approx(5e-4) and learning_rate(999_999, constant, 1000) == 1e-3
    assert learning_rate(550, cosine, 1000) == pytest.approx(1e-4 + 9e-4 * 0.5)
    assert load_config([]).optimizer.schedule.value == "cosine"   # the default is the paper's
    with pytest.raises(ConfigError, match=r"optimizer.decay_shape=sqrt is invalid: it must be one of linear, cosine, 1-sqrt"):
        _opt("optimizer.decay_shape=sqrt")
    with pytest.raises(ConfigError, match=r"optimizer.decay_fraction=0.0 is invalid"):
        _opt("optimizer.decay_fraction=0")


# ------------------------------------------------------------------ the pieces, alone

def test_metrics_file_keeps_the_steps_up_to_the_resume(tmp_path):
    from megatron_id.training.metrics import open_metrics_file
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in range(1, 8)))
    with open_metrics_file(path, 5) as f:
        f.write(json.dumps({"step": 6, "train/loss": 0.5}) + "\n")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    (tmp_path / "notes.txt").write_text("my notes\n")
    before = (tmp_path / "notes.txt").read_bytes()
    with pytest.raises(ConfigError, match=r"holds a line that is not a JSON object .* give another path"):
        open_metrics_file(tmp_path / "notes.txt", 0)
    assert (tmp_path / "notes.txt").read_bytes() == before


def test_the_step_timer_adds_up_and_the_profiler_writes_a_trace(tmp_path):
    import time

    import torch
    from megatron_id.training.profiling import ProfileWindow, StepTimer
    timer = StepTimer("cpu")
    timer.start(True)
    for phase, seconds in (("data", 0.02), ("forward", 0.05), ("backward", 0.03)):
        with timer.phase(phase):
            time.sleep(seconds)
    result = timer.result()
    assert set(result) == {"data", "forward", "backward", "step"}
    assert sum(v for k, v in result.items() if k != "step") == pytest.approx(result["step"], rel=0.1)
    timer.start(False)
    with timer.phase("forward"):
        pass
    assert timer.result() is None
    cfg = load_config([], [f"train.profile.dir={tmp_path / 'prof'}", "train.profile.start_step=2",
                           "train.profile.steps=2"])
    window = ProfileWindow(cfg, rank=0, device="cpu")
    for step in range(1, 5):
        window.before_step(step)
        torch.ones(64, 64) @ torch.ones(64, 64)
        window.after_step(step)
    (trace,) = (tmp_path / "prof").glob("*.json")
    assert trace.name == "rank0.steps2-3.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("mm" in str(e.get("name", "")) for e in events)
    assert ProfileWindow(cfg, rank=1, device="cpu").active is False   # ranks: [0]


def _items(prefix, save, *extra):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", f"data.tokenizer={GPT2}", "model.vocab_size=50257",
            f"train.save={save}", *extra]


def test_options_that_cannot_work_are_refused_before_any_work(fineweb_prefix, tmp_path):
    base = ["megatron_id.cli", "train", "--config", TINY]
    save = tmp_path / "ckpt"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine\n")
    cases = [
        (["train.export_hf_at_end=" + str(tmp_path / "mine")],
         r"train.export_hf_at_end=.*mine is not empty and is not an earlier export \(it holds notes.txt"),
        (["train.export_hf_at_end=" + str(save / "hf")], r"is inside train.save=.*: choose a folder outside it"),
        ([f"data.valid_sets.held=[{tmp_path / 'missing'}]"], r"data.valid_sets.held: .*missing"),
    ]
    for extra, mention in cases:
        refused(base + _items(fineweb_prefix, save, *extra), mention=mention, unchanged=[tmp_path])
    refused(base + [f"data.data_path=[{fineweb_prefix}]", "model.vocab_size=50257",
                    f"train.export_hf_at_end={tmp_path / 'hf'}"],
            mention=r"train.export_hf_at_end=.* train.save is unset", unchanged=[tmp_path])
    refused(base + [f"data.data_path=[{fineweb_prefix}]", "model.vocab_size=50257", f"train.save={save}",
                    f"train.export_hf_at_end={tmp_path / 'hf'}"],
            mention=r"data.tokenizer is unset", unchanged=[tmp_path])


def test_wandb_asked_for_and_missing_is_one_line(monkeypatch):
    import importlib.util
    from megatron_id.training.metrics import check_wandb
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"train.wandb.project=p asks for Weights & Biases, which is not installed: "
                                          r"pip install 'megatron_id\[wandb\]'"):
        check_wandb(load_config([], ["train.wandb.project=p"]))
    check_wandb(load_config([], ["train.wandb.project=p", "train.wandb.mode=disabled"]))   # off: no check


# ------------------------------------------------------------------ end to end

STEPS, EVAL_INTERVAL, SAVE_INTERVAL = 8, 4, 3


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    """Two held-out sets of 25 FineWeb-Edu documents each (GPT-2 tokenizer)."""
    from data_tools.preprocess import main as preprocess
    folder = tmp_path_factory.mktemp("held")
    rows = FINEWEB.read_text().splitlines()
    prefixes = {}
    for name, part in (("held_a", rows[100:125]), ("held_b", rows[125:150])):
        (folder / f"{name}.jsonl").write_text("\n".join(part) + "\n")
        assert preprocess(["--input", str(folder / f"{name}.jsonl"), "--tokenizer", str(GPT2), "--output-prefix",
                           str(folder / name), "--append-eod", "--no-progress"]) == 0
        prefixes[name] = str(folder / f"{name}_text_document")
    return prefixes


def loop_items(prefix, held, run: Path, save: Path):
    return _items(prefix, save) + [
        f"data.valid_sets.a=[{held['held_a']}]", f"data.valid_sets.b=[{held['held_b']}]",
        "train.zero_stage=1", "train.precision=fp32", "train.micro_batch_size=1", "train.global_batch_size=4",
        f"train.train_tokens={STEPS * 4 * 64}", f"train.eval_interval={EVAL_INTERVAL}", "train.eval_iters=1",
        "train.log_interval=2", f"train.save_interval={SAVE_INTERVAL}", "train.async_save=true",
        f"train.metrics_file={run / 'metrics.jsonl'}", f"train.tensorboard_dir={run / 'tb'}",
        "train.wandb.project=loop", "train.wandb.mode=offline", f"train.wandb.dir={run}",
        f"train.profile.dir={run / 'profile'}", "train.profile.start_step=2", "train.profile.steps=2",
        f"train.export_hf_at_end={run / 'hf'}",
        "optimizer.lr=1e-2", "optimizer.min_lr=1e-3", "optimizer.warmup_tokens=256",
        "optimizer.schedule=wsd", "optimizer.decay_fraction=0.5", "optimizer.decay_shape=1-sqrt"]


def _train(rank, world, items, signal_at=None, kill_writing=None):
    """Trainer.train() as the CLI runs it; signal_at: rank 0 gets SIGUSR1 after that step;
    kill_writing: SIGKILL in the background write of that checkpoint (any rank)."""
    import os
    import signal
    from megatron_id.checkpoint import background
    from megatron_id.training.engine import Trainer
    if kill_writing:
        write = background.write_file

        def write_then_die(state, path):
            write(state, path)
            if kill_writing in path:
                os.kill(os.getpid(), signal.SIGKILL)
        background.write_file = write_then_die
    trainer = Trainer(load_config([TINY], items))
    if signal_at:
        step = trainer.train_step

        def step_and_signal():
            loss = step()
            if trainer.step == signal_at and rank == 0:
                os.kill(os.getpid(), signal.SIGUSR1)
            return loss
        trainer.train_step = step_and_signal
    try:
        start = trainer.step
        losses = trainer.train()
        return start, trainer.step, losses, trainer.wandb_run_id
    finally:
        trainer.close()


def _from_step(ckpt: Path, tag: str, to: Path) -> Path:
    """A train.save folder holding only `ckpt`'s checkpoint `tag`."""
    to.mkdir(parents=True)
    shutil.copytree(ckpt / tag, to / tag)
    (to / "latest").write_text(tag)
    return to


def _wandb_runs(run: Path) -> list:
    from wandb_offline import read_offline_run
    return [read_offline_run(f) for f in sorted((run / "wandb").glob("offline-run-*"))]


@pytest.mark.slow
def test_every_option_on_two_ranks_then_a_requeue_and_a_kill_during_the_background_save(
        fineweb_prefix, held_out, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run, save = tmp_path / "run", tmp_path / "run" / "ckpt"
    items = loop_items(fineweb_prefix, held_out, run, save)
    results = run_distributed(_train, 2, args=(items,), timeout=300)
    start, end, losses, run_id = results[0]
    assert (start, end, len(losses)) == (0, STEPS, STEPS) and losses[0] > losses[-1]
    assert (save / "latest").read_text() == f"iter_{STEPS:07d}" and not (save / ".incomplete").exists()
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000003", "iter_0000006", "iter_0000008"]

    # the JSONL file: one line per step, every TensorBoard scalar with its value
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert [line["train/loss"] for line in lines] == pytest.approx(losses, rel=1e-7)
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert set(tags) == {k for line in lines for k in line if k != "step"}
    for tag in tags:
        board = {e.step: e.value for e in events.Scalars(tag)}
        mine = {line["step"]: line[tag] for line in lines if tag in line}
        assert board.keys() == mine.keys(), tag
        assert all(board[s] == pytest.approx(mine[s], rel=1e-6, abs=1e-12) for s in mine), tag   # TB keeps float32
    # the schedule: each step's LR is the formula's at the tokens consumed before it (wsd decays in the 2nd half)
    cfg = load_config([TINY], items)
    lrs = [learning_rate((line["step"] - 1) * 4 * 64, cfg.optimizer, cfg.train.train_tokens) for line in lines]
    assert [line["train/lr"] for line in lines] == pytest.approx(lrs, rel=1e-12)
    assert lrs[3] == 1e-2 and lrs[4] == pytest.approx(1e-2) and lrs[5] < 0.9 * 1e-2   # the decay starts at step 5
    # the time breakdown of the logged steps adds up to the step
    for line in lines:
        if line["step"] % 2 == 0:
            phases = sum(v for k, v in line.items() if k.startswith("train/time_") and k != "train/time_step")
            assert phases == pytest.approx(line["train/time_step"], rel=0.1), line
    # two named validation sets, logged apart, each equal to megatron-id eval perplexity on it
    for name in ("a", "b"):
        assert [line["step"] for line in lines if f"valid/{name}/loss" in line] == [4, 8]
    assert lines[-1]["valid/a/loss"] != lines[-1]["valid/b/loss"]
    for name, prefix in (("a", held_out["held_a"]), ("b", held_out["held_b"])):
        # step 8's round is the second: samples 4..7 of a dataset of (8 // 4 + 1) x 1 x 4 = 12 samples
        done = subprocess.run([sys.executable, "-m", "megatron_id.cli", "eval", "perplexity", "--checkpoint", str(save),
                               "--data", prefix, "--split", "0,100,0", "--samples", "12", "--first-sample", "4",
                               "--count", "4", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-3000:]
        evaluated = json.loads(done.stdout)["results"][0]["loss"]
        assert abs(evaluated - lines[-1][f"valid/{name}/loss"]) <= 1e-5 * evaluated, name
    # wandb offline: the run and every step's scalars
    (wandb_id, project, rows), = _wandb_runs(run)
    assert (wandb_id, project) == (run_id, "loop")
    assert [row["_step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["train/loss"] for row in rows] == pytest.approx(losses, rel=1e-7)
    assert rows[3]["valid/a/loss"] == pytest.approx(lines[3]["valid/a/loss"], rel=1e-7)
    # the profile window (rank 0) and the export at the end
    (trace,) = (run / "profile").glob("*.json")
    assert trace.name == "rank0.steps2-3.pt.trace.json" and json.loads(trace.read_text())["traceEvents"]
    assert (run / "hf" / "model.safetensors").is_file() and (run / "hf" / "tokenizer.json").is_file()

    # a requeue: SIGUSR1 at step 5 saves and stops; the next job continues both the losses and the wandb run
    again = tmp_path / "again"
    resumed_save = _from_step(save, "iter_0000003", again / "ckpt")
    resumed = loop_items(fineweb_prefix, held_out, again, resumed_save) + [f"train.load={resumed_save}"]
    first = run_distributed(_train, 2, args=(resumed, 5), timeout=300)[0]
    assert (resumed_save / "latest").read_text() == "iter_0000005"
    second = run_distributed(_train, 2, args=(resumed,), timeout=300)[0]
    assert (first[0], first[1], second[0], second[1]) == (3, 5, 5, STEPS)
    assert first[2] + second[2] == losses[3:]   # bit for bit across the decay's start (step 5)
    assert {r[0] for r in _wandb_runs(again)} == {run_id} and first[3] == second[3] == run_id
    steps = [json.loads(line)["step"] for line in (again / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 5, 6, 7, 8]

    # SIGKILL while step 6's checkpoint is written in the background: `latest` stays on step 3
    killed = tmp_path / "killed"
    killed_save = _from_step(save, "iter_0000003", killed / "ckpt")
    items = loop_items(fineweb_prefix, held_out, killed, killed_save) + [f"train.load={killed_save}"]
    with pytest.raises(RankError, match="exited with code -9"):
        run_distributed(_train, 2, args=(items, None, "iter_0000006"), timeout=300)
    assert (killed_save / "latest").read_text() == "iter_0000003" and not (killed_save / "iter_0000006").exists()
    assert (killed_save / ".incomplete" / "iter_0000006").is_dir()
    rerun = run_distributed(_train, 2, args=(items,), timeout=300)[0]
    assert (rerun[0], rerun[1]) == (3, STEPS) and rerun[2] == losses[3:]
    assert not (killed_save / ".incomplete").exists()
