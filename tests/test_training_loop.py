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
import re
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
    with pytest.raises(ConfigError,
                       match=r"optimizer.decay_shape=sqrt is invalid: it must be one of linear, cosine, 1-sqrt"):
        _opt("optimizer.decay_shape=sqrt")
    with pytest.raises(ConfigError, match=r"optimizer.decay_fraction=0.0 is invalid"):
        _opt("optimizer.decay_fraction=0")


# ------------------------------------------------------------------ the pieces, alone

def test_metrics_file_keeps_the_steps_up_to_the_resume(tmp_path):
    from megatron_id.training.metrics import open_metrics_file
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in range(1, 8)))
    at_five = len("".join(line + "\n" for line in path.read_text().splitlines()[:5]).encode())
    record = {"path": str(path.resolve()), "bytes": at_five}   # what the checkpoint of step 5 recorded
    with open_metrics_file(path, 5, record, resumed=True) as f:
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
    lrs = [learning_rate((line["step"] - 1) * 4 * 64, cfg.optimizer, cfg.train.train_tokens, 4 * 64) for line in lines]
    assert [line["train/lr"] for line in lines] == pytest.approx(lrs, rel=1e-12)
    assert lrs[3] == 1e-2 and lrs[4] < 0.9 * 1e-2 and lrs[7] == pytest.approx(1e-3)   # decay: steps 5-8, to min_lr
    # the time breakdown of the logged steps adds up to the step
    for line in lines:
        if line["step"] % 2 == 0:
            phases = sum(v for k, v in line.items() if k.startswith("train/time_") and k != "train/time_step")
            assert phases == pytest.approx(line["train/time_step"], rel=0.1), line
    # two named validation sets, logged apart, each equal to megatron-id eval perplexity on it
    for name in ("a", "b"):
        assert [line["step"] for line in lines if f"valid/{name}/loss" in line] == [4, 8]
    assert lines[-1]["valid/a/loss"] != lines[-1]["valid/b/loss"]
    # step 8's round is the second: samples 4..7 of a dataset of (8 // 4 + 1) x 1 x 4 = 12 samples.
    # Both commands in one process (megatron_id.cli.main with each argv, as `megatron-id` runs it):
    # one interpreter and torch import instead of two.
    commands = [["eval", "perplexity", "--checkpoint", str(save), "--data", held_out[f"held_{name}"], "--split",
                 "0,100,0", "--samples", "12", "--first-sample", "4", "--count", "4", "--json"] for name in "ab"]
    script = ("import json, sys\nfrom megatron_id.cli import main\nfor argv in json.loads(sys.argv[1]):\n"
              "    status = main(argv)\n    sys.stdout.flush()\n    assert status == 0, status\n")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    decoder, text, summaries = json.JSONDecoder(), done.stdout.strip(), []
    while text:
        summary, end = decoder.raw_decode(text)
        summaries.append(summary)
        text = text[end:].strip()
    assert len(summaries) == 2, done.stdout[-3000:]
    for name, summary in zip("ab", summaries):
        evaluated = summary["results"][0]["loss"]
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


# ------------------------------------------------------------------ issue 41 group A: the loop's careless cases

def _lines(*steps) -> str:
    return "".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in steps)


def test_only_a_resume_of_the_same_run_trims_the_metrics_file(tmp_path, capsys):
    """A fresh run pointed at an earlier run's train.metrics_file deleted its lines (the resume
    rule fired with start step 0); now only the run that wrote the file, resumed from one of its
    checkpoints, drops its own lines after that checkpoint; anything else appends and says so."""
    from megatron_id.training.metrics import metrics_position, open_metrics_file
    path = tmp_path / "m.jsonl"
    earlier = _lines(*range(1, 17))
    path.write_text(earlier)
    with open_metrics_file(path, 0) as f:   # a fresh run: appends after the earlier run's 16 lines
        f.write(_lines(1))
    assert path.read_text() == earlier + _lines(1)
    assert ("holds 16 lines (steps 1-16) of an earlier run: this run starts at step 1 and appends"
            in capsys.readouterr().err)
    ten = len(_lines(*range(1, 11)).encode())
    cases = [(None, "records no metrics file"),                                          # a checkpoint without a record
             ({"path": str(tmp_path / "other.jsonl"), "bytes": ten}, "records " + str(tmp_path / "other.jsonl")),
             ({"path": str(path.resolve()), "bytes": ten + 3}, "the file changed")]      # not at a line's end
    for record, why in cases:
        path.write_text(earlier)
        with open_metrics_file(path, 10, record, resumed=True) as f:
            f.write(_lines(11))
        assert path.read_text() == earlier + _lines(11), record
        assert why in capsys.readouterr().err
    # the same run, resumed from its step-10 checkpoint: its lines 11-16 go, nothing else
    path.write_text(earlier)
    with open_metrics_file(path, 10, {"path": str(path.resolve()), "bytes": ten}, resumed=True) as f:
        assert metrics_position(f) == {"path": str(path.resolve()), "bytes": ten}
    assert path.read_text() == _lines(*range(1, 11))
    assert "dropped the 6 lines (steps 11-16) this run wrote after its checkpoint of step 10" in capsys.readouterr().err
    # lines after the checkpoint's bytes that are not that run's continuation (another run appended)
    path.write_text(_lines(*range(1, 11)) + _lines(1, 2, 3))
    with open_metrics_file(path, 10, {"path": str(path.resolve()), "bytes": ten}, resumed=True):
        pass
    assert path.read_text() == _lines(*range(1, 11)) + _lines(1, 2, 3)


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_ends_at_min_lr_on_the_last_step_whatever_the_fraction(shape):
    """decay_fraction=0.01 on a 16-step run never decayed, and 0.25 decayed over 3 steps ending at
    6.6e-4: the decay takes round(fraction x steps) >= 1 whole steps, the last at min_lr."""
    from megatron_id.training.optim import wsd_decay_steps
    step_tokens, steps = 64, 16
    for fraction, decaying in ((0.01, 1), (0.1, 2), (0.25, 4), (0.5, 8), (1.0, 16)):
        for warmup in (0, 64):
            opt = _opt("optimizer.schedule=wsd", f"optimizer.decay_fraction={fraction}",
                       f"optimizer.decay_shape={shape}", f"optimizer.warmup_tokens={warmup}")
            lrs = [learning_rate(k * step_tokens, opt, steps * step_tokens, step_tokens) for k in range(steps)]
            assert lrs[-1] == pytest.approx(1e-4), (fraction, warmup)
            assert wsd_decay_steps(fraction, steps) == decaying
            stable = lrs[1 if warmup else 0:steps - decaying]
            assert all(lr == 1e-3 for lr in stable) and all(lr < 1e-3 for lr in lrs[steps - decaying:]), (fraction, lrs)
            decay = lrs[max(steps - decaying, 1 if warmup else 0):]
            assert decay == sorted(decay, reverse=True)
    # train_tokens not a multiple of the step: the run's 16th step (ceil) is the last, at min_lr
    opt = _opt("optimizer.schedule=wsd", "optimizer.decay_fraction=0.25", "optimizer.warmup_tokens=0")
    assert learning_rate(15 * 64, opt, 15 * 64 + 1, 64) == pytest.approx(1e-4)
    # the other schedules are what they were: the step size changes nothing
    for schedule in ("cosine", "linear", "constant"):
        opt = _opt(f"optimizer.schedule={schedule}")
        for tokens in (0, 50, 100, 333, 640, 960, 1000, 5000):
            assert learning_rate(tokens, opt, 1000, 64) == learning_rate(tokens, opt, 1000)


def test_settings_that_would_be_ignored_are_said_before_any_work():
    """decay_fraction under cosine, a profile window past the run or on a rank the run does not
    have, a split without validation while eval_iters > 0: each ignored without a word before."""
    from megatron_id.training.engine import run_warnings
    from megatron_id.training.layout import training_layout

    def warnings(*items, world=1):
        cfg = load_config([TINY], [f"train.train_tokens={1024 * world}", f"train.global_batch_size={world}",
                                   "optimizer.warmup_tokens=0", *items])
        return run_warnings(cfg, training_layout(cfg, world), world)   # 16 steps of 64 tokens per rank

    assert warnings() == [] and warnings("optimizer.schedule=wsd", "optimizer.decay_fraction=0.25") == []
    (line,) = warnings("optimizer.decay_fraction=0.1")
    assert line.startswith("optimizer.decay_fraction=0.1 applies to optimizer.schedule=wsd only; this run's schedule "
                           "is cosine")
    (line,) = warnings("optimizer.schedule=linear", "optimizer.decay_shape=cosine")
    assert "optimizer.decay_shape=cosine applies to optimizer.schedule=wsd only" in line
    (line,) = warnings("optimizer.schedule=wsd", "optimizer.decay_fraction=0.01")
    assert "0.16 of a step: the wsd decay takes the last 1 step" in line
    (line,) = warnings("train.profile.dir=p", "train.profile.start_step=20")
    assert "train.profile.start_step=20 is after this run's last step (16): nothing will be profiled" in line
    (line,) = warnings("train.profile.dir=p", "train.profile.start_step=15", "train.profile.steps=4")
    assert "only steps 15-16 will be traced" in line
    (line,) = warnings("train.profile.dir=p", "train.profile.ranks=[2,3]", world=2)
    assert "this run has ranks 0-1, so 2, 3 will not trace and nothing will be profiled" in line
    assert warnings("train.profile.ranks=[5]") == []   # no train.profile.dir: no profiling asked for
    (line,) = warnings("data.split=100,0,0", "train.eval_iters=2")
    assert ("data.split=100,0,0 leaves no validation documents, so no validation will run although "
            "train.eval_iters=2") in line
    (line,) = warnings("data.split=100,0,0", "data.valid_sets.wiki=[w]")
    assert "so only data.valid_sets (wiki) will be validated" in line
    assert warnings("data.split=100,0,0", "train.eval_iters=0") == []
    (line,) = warnings("optimizer.schedule=constant", "optimizer.min_lr=1e-5")
    assert "optimizer.min_lr=1e-05 is where a decay ends, and optimizer.schedule=constant has none" in line
    (line,) = warnings("optimizer.warmup_tokens=4096")
    assert "optimizer.warmup_tokens=4,096 is not below train.train_tokens=1,024: the warmup never ends" in line


def test_interrupted_before_the_first_save_names_save_interval(tmp_path):
    """Ctrl-C before the first checkpoint advised 'set train.save and train.save_interval' with
    train.save set; now it names the interval (and train.save only when it is unset)."""
    from types import SimpleNamespace

    from megatron_id.training.engine import Trainer
    cfg = load_config([TINY], [f"train.save={tmp_path / 'ck'}", "train.save_interval=500"])
    said = Trainer._last_checkpoint(SimpleNamespace(cfg=cfg))
    assert said == (f"none yet in {tmp_path / 'ck'} (the first save comes at step 500, train.save_interval; "
                    "lower it to save sooner)")
    said = Trainer._last_checkpoint(SimpleNamespace(cfg=load_config([TINY], [])))
    assert said == "none (train.save is unset: set train.save=<folder> to keep checkpoints)"


def test_export_at_end_into_a_folder_that_cannot_be_written_is_refused_at_start(tmp_path, monkeypatch):
    import os

    from megatron_id.training.engine import check_export_at_end
    cfg = load_config([TINY], [f"train.save={tmp_path / 'ck'}", f"data.tokenizer={GPT2}",
                               f"train.export_hf_at_end={tmp_path / 'out' / 'hf'}"])
    check_export_at_end(cfg)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p) == str(tmp_path) else real(p, mode, **k))
    with pytest.raises(ConfigError, match=rf"train.export_hf_at_end={tmp_path}/out/hf: {tmp_path} is not writable, so "
                                          r"the export at the end would fail after the whole run"):
        check_export_at_end(cfg)


def test_wandb_online_without_an_api_key_is_refused_before_any_work(tmp_path, monkeypatch):
    from megatron_id.training.metrics import check_wandb
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    online = load_config([], ["train.wandb.project=p"])
    with pytest.raises(ConfigError, match=r"train.wandb.mode=online \(the default\) uploads to W&B, and no API key was "
                                          r"found .*run `wandb login` or set WANDB_API_KEY, "
                                          r"or set train.wandb.mode=offline"):
        check_wandb(online)
    check_wandb(load_config([], ["train.wandb.project=p", "train.wandb.mode=offline"]))   # no key needed
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    check_wandb(online)   # `wandb login` writes ~/.netrc
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_wandb(online)


def _group_a_items(prefix, run: Path, *extra):
    return ["--config", TINY, f"data.data_path=[{prefix}]", "data.split=90,10,0", f"data.tokenizer={GPT2}",
            "model.vocab_size=50257", "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=2",
            "train.train_tokens=2048", "train.eval_iters=1", "optimizer.warmup_tokens=0", "train.log_interval=8",
            f"train.save={run / 'ckpt'}", f"train.metrics_file={run / 'metrics.jsonl'}", *extra]


def test_refusals_of_the_loop_come_before_any_work(fineweb_prefix, tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    home = tmp_path / "home"
    home.mkdir()
    train = ["megatron_id.cli", "train"]
    done = refused(train + _group_a_items(fineweb_prefix, tmp_path / "run", "train.wandb.project=p"),
                   mention=r"train.wandb.mode=online \(the default\) uploads to W&B, and no API key was found",
                   unchanged=[tmp_path], env={"HOME": str(home), "WANDB_API_KEY": "", "NETRC": "",
                                              "WANDB_CONFIG_DIR": str(home)})
    assert "training " not in done.stderr   # before the model is built (it was 40 lines after)
    refused(train + _group_a_items(fineweb_prefix, tmp_path / "run",
                                   f"train.export_hf_at_end={tmp_path / 'notes.txt' / 'hf'}"),
            mention=rf"train.export_hf_at_end=.*notes.txt/hf: {tmp_path}/notes.txt is a file, not a folder",
            unchanged=[tmp_path])
    # job-prepare: a config that train refuses is refused by the same check, before anything is recorded
    prepare = ["megatron_id.cli", "job-prepare", "--run-dir", tmp_path / "job", "--job-id", "7"]
    refused(prepare + ["--world-size", "1", "--"] + _group_a_items(fineweb_prefix, tmp_path / "run",
                                                                  f"train.export_hf_at_end={tmp_path / 'notes.txt'}"),
            mention=r"train.export_hf_at_end=.*notes.txt is a file: give the path of a new or empty folder",
            unchanged=[tmp_path])


def test_job_prepare_refuses_a_job_of_no_tasks(tmp_path):
    """--world-size 0 ended in a ZeroDivisionError traceback; now one line (the CLI prints a
    UserError as `megatron-id: error: ...`, exit 2)."""
    from megatron_id.errors import UserError
    from megatron_id.training.job import prepare
    for world, attempt, job, mention in ((0, 0, "7", r"--world-size 0: a job has at least 1 task"),
                                         (-2, 0, "7", r"--world-size -2: a job has at least 1 task"),
                                         (1, -1, "7", r"--attempt -1: at least 0"),
                                         (1, 0, "a/b", r"--job-id 'a/b': give a job id without '/'")):
        with pytest.raises(UserError, match=mention):
            prepare(tmp_path / "job", [TINY], [], world_size=world, job_id=job, attempt=attempt, env={})
    assert not (tmp_path / "job").exists()


@pytest.mark.slow
def test_a_fresh_run_keeps_earlier_lines_decays_to_min_lr_and_a_rerun_says_it_is_finished(fineweb_prefix, tmp_path):
    """One 16-step run with wsd decay_fraction=0.01 into a metrics file that holds another run's
    lines (kept), exported at the end; then the same command resuming it: 'already finished at
    step 16', exit 0, nothing trained, rewritten or exported again."""
    from bad_inputs import run_module, snapshot
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(_lines(1, 2, 3))   # an unrelated earlier run's
    items = _group_a_items(fineweb_prefix, run, "optimizer.schedule=wsd", "optimizer.decay_fraction=0.01",
                           f"train.export_hf_at_end={run / 'hf'}")
    done = run_module("megatron_id.cli", ["train", *items])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the wsd decay takes the last 1 step" in done.stderr
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, *range(1, 17)] and "train/lr" not in lines[0]
    # tiny.yaml's lr, the default min_lr
    assert [line["train/lr"] for line in lines[3:]] == [3e-3] * 15 + [pytest.approx(1e-5)]
    assert (run / "hf" / "model.safetensors").is_file()
    before = snapshot(run)
    again = run_module("megatron_id.cli", ["train", *items, f"train.load={run / 'ckpt'}"])
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stderr.strip().splitlines()
    assert said[-2].startswith(f"already finished at step 16: train.load={run / 'ckpt'} holds the run's end; "
                               "nothing to train")
    assert said[-1].startswith(f"train.export_hf_at_end={run / 'hf'}: kept the export there, not exported again")
    assert "training " not in again.stderr and snapshot(run) == before


# ------------------------------------------------------------------ issue 52: a resume that changes the schedule

def _saved_at_step_4(tmp_path, base) -> Path:
    """A checkpoint folder whose client state records the settings of `base` at step 4 (all a
    resume's schedule check reads)."""
    from megatron_id.checkpoint.files import ClientState, write_client_state
    from megatron_id.training.engine import optimizer_record
    folder = tmp_path / "ckpt" / "iter_0000004"
    folder.mkdir(parents=True)
    write_client_state(folder, ClientState(step=4, model={}, optimizer=optimizer_record(load_config([TINY], base))))
    return folder


def test_a_resume_that_changes_the_schedule_is_refused_naming_each_key(tmp_path):
    """optimizer.lr changed on resume bent the schedule mid-run without a word, and a changed
    optimizer.weight_decay or beta was ignored without a word (the optimizer state restores the
    checkpoint's). Megatron asserts its scheduler's values match unless
    --override-opt_param-scheduler; here train.override_scheduler=true."""
    from megatron_id.training.engine import check_resume_optimizer
    from megatron_id.training.layout import training_layout
    base = ["train.train_tokens=2048", "train.global_batch_size=2", "optimizer.warmup_tokens=0"]   # 16 steps
    folder = _saved_at_step_4(tmp_path, base)

    def check(*items):
        cfg = load_config([TINY], [*base, f"train.load={folder.parent}", *items])
        return check_resume_optimizer(folder, cfg, training_layout(cfg, 1))
    assert check() is None and check("optimizer.clip_grad=0.5") is None   # exact resume; clipping may change
    with pytest.raises(ConfigError, match=r"iter_0000004 \(step 4\) was trained with optimizer.lr=0.003, and this run "
                                          r"sets optimizer.lr=0.001 \(the learning rate of step 5 would go from "
                                          r"0.002\d+ to 0.000\d+\); a resume continues its checkpoint's schedule and "
                                          r"AdamW settings. Set optimizer.lr=0.003 to resume as it was, or "
                                          r"train.override_scheduler=true to apply this run's values from step 5 on"):
        check("optimizer.lr=1e-3")
    with pytest.raises(ConfigError, match=r"trained with train.train_tokens=2048, optimizer.weight_decay=0.1, and this "
                                          r"run sets train.train_tokens=4096, optimizer.weight_decay=0.0 \(the "
                                          r"learning rate of step 5"):
        check("optimizer.weight_decay=0", "train.train_tokens=4096")
    with pytest.raises(ConfigError, match=r"optimizer.adam_beta2=0.95.*sets optimizer.adam_beta2=0.99; a resume"):
        check("optimizer.adam_beta2=0.99")   # no rate to compare: the schedule is the same
    lines = check("optimizer.lr=1e-3", "train.override_scheduler=true").splitlines()
    assert lines[0] == "train.override_scheduler=true: optimizer.lr=0.001 from step 5 on (iter_0000004 was trained " \
                       "with optimizer.lr=0.003)"
    assert re.match(r"train.override_scheduler=true: the learning rate of step 5 is 0.000\d+ \(0.002\d+ as "
                    r"iter_0000004 was trained\)$", lines[1]), lines
    assert check("optimizer.lr=1e-3", "train.load_optimizer=false") is None   # Adam restarts: as Megatron, no check
    assert check("optimizer.decay_fraction=0.5") is None   # a wsd key under cosine changes nothing
    constant = [*base, "optimizer.schedule=constant"]
    folder = _saved_at_step_4(tmp_path / "constant", constant)
    cfg = load_config([TINY], [*constant, "train.train_tokens=4096"])   # a longer constant run: the same rates
    assert check_resume_optimizer(folder, cfg, training_layout(cfg, 1)) is None


def _resume_reporting_groups(rank, world, items):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    groups = [(g["name"], g["weight_decay"], tuple(g["betas"])) for g in trainer.guard.param_groups]
    try:
        return trainer.train(), groups
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_resume_with_another_lr_is_refused_and_with_the_override_takes_the_new_schedule(fineweb_prefix, tmp_path,
                                                                                         capfd):
    """Refused before any work; then with train.override_scheduler=true the run says
    what changed, steps 3-4 take the new schedule and the new weight decay reaches Adam's groups
    (the optimizer state's load restored 0.1 before); its checkpoints record the new values, so
    the same command resumes again without a word."""
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    items = _items(fineweb_prefix, save, "train.train_tokens=512", "train.micro_batch_size=2",
                   "train.global_batch_size=2", "train.eval_iters=0", "optimizer.warmup_tokens=0",
                   "train.save_interval=2", f"train.metrics_file={metrics}")   # 4 steps of 128 tokens
    run_distributed(_save_two_steps, 1, args=(items,), timeout=300)
    changed = [*items, f"train.load={save}", "optimizer.lr=1e-3", "optimizer.weight_decay=0.01"]
    with pytest.raises(RankError, match=r"iter_0000002 \(step 2\) was trained with optimizer.lr=0.003, "
                                        r"optimizer.weight_decay=0.1, and this run sets optimizer.lr=0.001, "
                                        r"optimizer.weight_decay=0.01 \(the learning rate of step 3 would go from "
                                        r".*train.override_scheduler=true"):
        run_distributed(_resume_reporting_groups, 1, args=(changed,), timeout=300)
    assert (save / "latest").read_text() == "iter_0000002" and len(metrics.read_text().splitlines()) == 2
    losses, groups = run_distributed(_resume_reporting_groups, 1, args=([*changed, "train.override_scheduler=true"],),
                                     timeout=300)[0]
    assert len(losses) == 2 and ("decay", 0.01, (0.9, 0.95)) in groups
    said = capfd.readouterr().err
    assert "train.override_scheduler=true: optimizer.lr=0.001 from step 3 on (iter_0000002 was trained with " \
           "optimizer.lr=0.003)" in said
    assert "train.override_scheduler=true: optimizer.weight_decay=0.01 from step 3 on" in said
    cfg = load_config([TINY], changed)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert [line["train/lr"] for line in lines[2:]] == [pytest.approx(learning_rate(s * 128, cfg.optimizer, 512, 128))
                                                       for s in (2, 3)]
    from megatron_id.training.engine import check_resume_optimizer
    from megatron_id.training.layout import training_layout
    assert check_resume_optimizer(save / "iter_0000004", cfg, training_layout(cfg, 1)) is None


def _save_two_steps(rank, world, items):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    trainer.train(max_steps=2)   # (train.save_interval=2: saved at step 2)
    trainer.close()


def test_the_console_shows_step_1_and_a_resumes_first_step(capsys):
    """The quickstart's console started at step 20 (train.log_interval), so the README's "the
    loss starts at 10.8" showed only in TensorBoard. Now the first step of a run prints its line
    too, as torchtitan does; the scalars of every step are recorded as before."""
    from megatron_id.training.layout import training_layout
    from megatron_id.training.metrics import Metrics
    cfg = load_config([TINY, CONFIGS / "train" / "quickstart.yaml"], [])
    layout = training_layout(cfg, 2)
    fresh, resumed = Metrics(cfg, layout, is_logger=True), Metrics(cfg, layout, is_logger=True, start_step=40)
    assert [s for s in range(1, 151) if fresh.logs(s)] == [1, 20, 40, 60, 80, 100, 120, 140, 150]
    assert [s for s in range(41, 151) if resumed.logs(s)] == [41, 60, 80, 100, 120, 140, 150]
    fresh.step(1, 10.83, 3e-3, 1.5, 0)
    fresh.step(2, 10.5, 3e-3, 1.5, 0)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("step 1/150 [") and "| loss 10.8300 |" in lines[0], lines
    assert fresh.pending["train/loss"] == 10.5   # step 2's scalars go to the files all the same
