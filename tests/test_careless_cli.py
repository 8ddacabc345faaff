"""The megatron-id commands as a careless user types them (issue 26): zero-valued and unit-less
plan options, an override given twice (a warning), --config after the overrides, an empty `latest`, eval
ranges and empty texts, quickstart's arguments, and a CPU run planned above the host's memory."""
import os
import subprocess
from pathlib import Path

import pytest

from bad_inputs import refused, run_module, snapshot
from conftest import CONFIGS, ROOT
from megatron_id.config import ConfigError, load_config

TINY = str(CONFIGS / "model" / "tiny.yaml")
PLAN = ["megatron_id.cli", "plan", "--config", TINY, "--nodes", "1", "--gpus-per-node", "2"]


@pytest.mark.parametrize("extra, mention", [
    (["--gpu-memory", "80GiB", "--global-batch", "0"], r"--global-batch 0: must be at least 1"),
    (["--gpu-memory", "80GiB", "--seq-length", "0"], r"--seq-length 0: must be at least 1"),
    (["--gpu-memory", "80GiB", "--max-micro-batch", "0"], r"--max-micro-batch 0: must be at least 1"),
    (["--gpu-memory", "80GiB", "--top", "-1"], r"--top -1: must be at least 0"),
    (["--gpu-memory", "80"], r"--gpu-memory '80' has no unit: 80 what\? Write 80GiB"),
    (["--gpu-memory", "0GiB"], r"--gpu-memory '0GiB' must be more than 0"),
    (["--gpu-memory", "eighty"], r"--gpu-memory 'eighty' is not understood"),
])
def test_plan_refuses_zero_and_unitless_values(extra, mention, tmp_path):
    refused(PLAN + extra, mention=mention, unchanged=[tmp_path])


def test_an_override_given_twice_says_which_value_is_used(capsys):
    """The last wins (scripts put their overrides before the user's), with a warning line."""
    assert load_config([TINY], ["model.d_model=64", "model.d_model=128"]).model.d_model == 128
    assert capsys.readouterr().err.strip() == ("warning: override model.d_model given twice, as model.d_model=64 "
                                               "and then model.d_model=128: the last one, 128, is used.")
    assert load_config([TINY], ["model.d_model=128", "model.d_model=128"]).model.d_model == 128
    assert capsys.readouterr().err == ""   # the same value twice: nothing to say
    done = run_module("megatron_id.cli", ["params", "--config", TINY, "model.n_layers=2", "model.n_layers=4"])
    assert done.returncode == 0 and "n_layers=4" in done.stdout, done.stderr
    assert "warning: override model.n_layers given twice" in done.stderr


def test_config_may_follow_the_overrides():
    done = run_module("megatron_id.cli", ["params", "model.d_model=128", "--config", TINY, "model.n_layers=3"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "d_model=128 n_layers=3 n_heads=4" in done.stdout   # n_heads from tiny.yaml: the file was read
    refused(["megatron_id.cli", "params", "model.d_model=128", "--config", TINY, "--bogus"],
            mention=r"unrecognized arguments: --bogus")


def test_the_header_names_the_defaults_that_decided():
    from megatron_id.training.metrics import defaults_that_decided
    note = defaults_that_decided(load_config([str(CONFIGS / "train" / "quickstart.yaml")], []))
    assert note.startswith("the schema's defaults decided the model: model.d_model=768, model.n_layers=12, "
                           "model.n_heads=12, model.seq_length=4096"), note
    assert "budget" not in note   # quickstart.yaml sets train_tokens and the global batch
    assert defaults_that_decided(load_config([TINY, str(CONFIGS / "train" / "quickstart.yaml")], [])) == ""


def _available_gib() -> float:
    from megatron_id.training.agreement import available_host_memory
    return (available_host_memory() or 0) / 2 ** 30


@pytest.mark.skipif(_available_gib() > 45, reason="the default model's plan fits this host's memory")
def test_a_cpu_run_planned_above_the_hosts_memory_is_refused(fineweb_prefix, tmp_path):
    """--config configs/train/quickstart.yaml alone: the schema's 125M model at 4K context,
    which the OOM killer ended without a word."""
    refused(["megatron_id.cli", "train", "--config", str(CONFIGS / "train" / "quickstart.yaml"),
             f"data.data_path=[{fineweb_prefix}]", f"train.save={tmp_path / 'ckpt'}"],
            mention=r"planned memory [\d.]+ GiB per rank x 1 rank\(s\) on this host is more than the [\d.]+ GiB "
                    r"it has available.*model.d_model, model.n_layers, model.n_heads from the schema's defaults.*"
                    r"train.check_host_memory=false", unchanged=[tmp_path])


def test_an_empty_latest_is_named(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000002").mkdir(parents=True)
    (ckpt / "latest").write_text("")
    refused(["megatron_id.cli", "export-hf", "--checkpoint", ckpt, "--output", tmp_path / "hf"],
            mention=rf"{ckpt}/latest is empty: it names no checkpoint.*\(here: iter_0000002\)", unchanged=[tmp_path])


def test_eval_names_the_empty_file_and_the_ranges(tmp_path):
    import argparse
    from megatron_id.evaluation.run import EvalError, check_args, read_documents
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(EvalError, match=rf"--text {tmp_path / 'empty.txt'}: the file is empty"):
        read_documents([tmp_path / "empty.txt"])
    parser = argparse.ArgumentParser()
    from megatron_id.evaluation import run
    sub = parser.add_subparsers(dest="command")
    run.add_parser(sub)
    for argv, mention in (
            (["eval", "length", "--checkpoint", "x", "--text", "t.txt", "--factors", "1", "0"],
             r"--factors 0.0 is out of range: it must be more than 0"),
            (["eval", "perplexity", "--checkpoint", "x", "--count", "0"], r"--count 0 is out of range: it must be at least 1"),
            (["eval", "recall", "--checkpoint", "x", "--depths", "1.5"], r"--depths 1.5 is out of range: it must be from 0 to 1")):
        with pytest.raises(EvalError, match=mention):
            check_args(parser.parse_args(argv))


def _quickstart(*args, cwd):
    env = {**os.environ, "PYTHON": "/nonexistent/python"}   # nothing may get as far as Python
    return subprocess.run(["bash", str(ROOT / "launch" / "quickstart.sh"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_quickstart_takes_an_override_in_the_folders_place(tmp_path):
    """`quickstart.sh model.mixer=softmax x` read model.mixer=softmax as the output folder; now it
    is an override, and the stray word after it is refused before anything is installed."""
    done = _quickstart("model.mixer=softmax", "stray", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "'stray' is not a key=value override" in done.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())   # no ./model.mixer=softmax/ folder


def test_quickstart_refuses_a_folder_that_holds_a_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "train.log").write_text("an earlier run\n")
    before = snapshot(tmp_path)
    done = _quickstart(str(run), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"{run} already holds a run: give a new OUTPUT_DIR" in last and "--overwrite" not in last
    assert snapshot(tmp_path) == before
