"""The megatron-id commands as a careless user types them (issue 26): zero-valued and unit-less
plan options, an override given twice (a warning), --config after the overrides, an empty `latest`, eval
ranges and empty texts, quickstart's arguments, and a CPU run planned above the host's memory."""
import os
import re
import subprocess

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
    from megatron_id.commands import eval as eval_command
    sub = parser.add_subparsers(dest="command")
    eval_command.add_parser(sub)
    for argv, mention in (
            (["eval", "length", "--checkpoint", "x", "--text", "t.txt", "--factors", "1", "0"],
             r"--factors 0.0 is out of range: it must be more than 0"),
            (["eval", "perplexity", "--checkpoint", "x", "--count", "0"],
             r"--count 0 is out of range: it must be at least 1"),
            (["eval", "recall", "--checkpoint", "x", "--depths", "1.5"],
             r"--depths 1.5 is out of range: it must be from 0 to 1")):
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


# ------------------------------------------------------------------ issue 41 group A: config values of the wrong kind

@pytest.mark.parametrize("override, mention", [
    # a TypeError traceback ("Cannot merge incompatible container types") before
    ("data.valid_sets=[data/wiki_text_document, data/c4_text_document]",
     r"invalid value \['data/wiki_text_document', 'data/c4_text_document'\] for 'data.valid_sets': data.valid_sets "
     r"names its sets, a key each: data.valid_sets.wiki=\[data/wiki_text_document\]"),
    # omegaconf's "str is not a subclass of WandbConfig" and "AnyNode is not a ListConfig" before
    ("train.wandb=myproject", r"invalid value 'myproject' for 'train.wandb': train.wandb is a group of keys \(project, "
                              r"entity, .*\), not a value: set one of them, e.g. train.wandb.project=myproject\.$"),
    ("train.extra_save_steps=5", r"'train.extra_save_steps': train.extra_save_steps takes a list of whole numbers, "
                                 r"e.g. train.extra_save_steps=\[5\]\.$"),
    ("train.wandb.tags=baseline", r"train.wandb.tags takes a list of text values, e.g. train.wandb.tags=\[baseline\]"),
    ("train.deepspeed=5", r"train.deepspeed takes named entries, e.g. train.deepspeed.steps_per_print=100"),
    ("seed=abc", r"could not be converted to Integer\): seed takes a whole number, e.g. seed=42\.$"),
    ("data.split=[1,2,3]", r"data.split takes one text value, e.g. data.split=969,30,1"),
    ("data.valid_sets.wiki=", r"data.valid_sets.wiki takes a data path, a prefix or weight/prefix pairs, e.g. "
                              r"data.valid_sets.wiki=\[/data/wiki_text_document\]"),
])
def test_a_value_of_the_wrong_kind_says_what_the_key_takes(override, mention):
    with pytest.raises(ConfigError, match=mention) as err:
        load_config([TINY], [override])
    assert "AnyNode" not in str(err.value) and "subclass of" not in str(err.value)


def test_config_files_that_are_not_configs_are_named(tmp_path):
    import json
    cases = {
        "list.yaml": ("- model\n- train\n", r"list.yaml: its top level is a list, not a mapping of sections"),
        "valid.yaml": ("data:\n  valid_sets: [a_text_document]\n",
                       r"valid.yaml: invalid value \['a_text_document'\] for 'data.valid_sets': .*data.valid_sets.a="),
        "wandb.yaml": ("train:\n  wandb: myproject\n", r"wandb.yaml: invalid value 'myproject' for 'train.wandb'"),
        "config.json": (json.dumps({"architectures": ["X"], "model_type": "megatron_id", "d_model": 64}),
                        r"--config .*config.json is a Hugging Face model config \(an export's config.json\), not a "
                        r"megatron_id config"),
        "ds.json": (json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 1}}),
                    r"ds.json is a DeepSpeed config \(give its keys as train.deepspeed.<key>=<value>\)"),
        "metrics.jsonl": ('{"step": 1}\n{"step": 2}\n', r"metrics.jsonl is a JSON Lines file"),
    }
    for name, (text, mention) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=mention):
            load_config([tmp_path / name])
    with pytest.raises(ConfigError,
                       match=r"gpt2-tokenizer.json is a tokenizer \(tokenizer.json\), not a megatron_id config"):
        load_config([ROOT / "tests" / "data" / "gpt2-tokenizer.json"])
    with pytest.raises(ConfigError, match=r"config file '.*configs/model' is a folder: give a YAML file in it, e.g. "):
        load_config([CONFIGS / "model"])
    (tmp_path / "ok.json").write_text(json.dumps({"model": {"d_model": 96}}))   # JSON is YAML: a config in JSON works
    assert load_config([TINY, tmp_path / "ok.json"]).model.d_model == 96
    # through the command: one line, no traceback (it was `TypeError: Cannot merge incompatible container types`)
    refused(["megatron_id.cli", "params", "--config", tmp_path / "list.yaml"],
            mention=r"list.yaml: its top level is a list", unchanged=[tmp_path])


# ------------------------------------------------------------------ issue 41 group C: tools and launchers

@pytest.mark.parametrize("extra, mention", [
    # an overhead no GPU of that size can hold was "no layout fits: use more GPUs ..."
    (["--gpu-memory", "8GiB", "--overhead", "10GiB"],
     r"--overhead 10GiB is not less than the 7\.2 GiB a layout may use of --gpu-memory 8GiB \(90%, --margin 0\.1\): "
     r"no layout could fit; check --gpu-memory .*lower --overhead \(default 2GiB\) or --margin"),
    (["--gpu-memory", "80GiB", "--margin", "0.99"], r"--overhead 2GiB is not less than the 0\.8 GiB"),
    # a bare 0 was told "Write 0GiB", which is refused in turn
    (["--gpu-memory", "0"], r"--gpu-memory '0' must be more than 0 \(e\.g\. 80GiB\)\.$"),
    (["--gpu-memory", "-5"], r"--gpu-memory '-5' must be more than 0"),
    (["--gpu-memory", "1e400GiB"], r"--gpu-memory '1e400GiB' is not understood"),
])
def test_plan_names_an_overhead_above_the_gpu_and_a_zero_memory(extra, mention, tmp_path):
    done = refused(PLAN + extra, mention=mention, unchanged=[tmp_path])
    assert "Write 0GiB" not in done.stderr and "Write -5GiB" not in done.stderr


def test_plan_takes_a_bare_zero_overhead():
    done = run_module("megatron_id.cli", [*PLAN[1:], "--gpu-memory", "8GiB", "--overhead", "0", "--top", "1"])
    assert done.returncode == 0 and "overhead 0.0 GiB per GPU included" in done.stdout, done.stderr


def test_kernel_resources_refuses_zero_jobs(tmp_path):
    """--jobs 0 compiled in one process without a word; an abbreviation is not a flag."""
    for jobs in ("0", "-2"):
        refused(["megatron_id.cli", "kernel-resources", "--config", TINY, "--jobs", jobs], unchanged=[tmp_path],
                mention=rf"kernel-resources: error: --jobs {jobs}: give at least 1 compiler process")
    refused(["megatron_id.cli", "kernel-resources", "--config", TINY, "--job", "2"],
            mention=r"unrecognized arguments: --job")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA machine runs the GPU steps")
def test_gpu_check_gpu_steps_on_a_cpu_machine_say_so(tmp_path):
    """`launch/gpu_check.py kernel` was AssertionError: Torch not compiled with CUDA enabled."""
    for step in ("kernel", "decode", "attention"):
        refused(["launch.gpu_check", step], unchanged=[tmp_path],
                mention=rf"gpu_check {step}: needs a CUDA GPU and torch .* \(bash launch/gpu_check.sh\), or add "
                        r"--dry-run for the same check on the CPU\.")
    (tmp_path / "losses.json").write_text("not json")
    refused(["launch.gpu_check", "compare", tmp_path / "losses.json", tmp_path / "losses.json"], unchanged=[tmp_path],
            mention=r"gpu_check compare: .*losses.json is not a losses file \(a JSON list of numbers")
    refused(["launch.gpu_check", "losses", "--out", tmp_path], unchanged=[tmp_path],
            mention=r"gpu_check losses: --out .*: give a file in an existing folder \(it is a folder\)")


def test_the_study_scripts_refuse_an_out_that_is_a_file_or_holds_other_things(tmp_path):
    """`reproduce.py --out FILE` was FileExistsError's traceback; a folder of other files would have
    received tokenizer.json, data/, runs/ ... among them (carry_study's results.md would have
    replaced a file of that name). The three study scripts share the rule (reproduce.check_out)."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for base in (["launch.reproduce", "--study", "mqar", "--out"], ["launch.carry_study", "--study", "mqar", "--out"],
                 ["launch.conversion_study", "--smoke", "--out"]):
        tool = base[0].split(".")[1].replace("conversion_study", "conversion-study")
        refused([*base, mine], unchanged=[tmp_path],
                mention=rf"^{tool}: error: --out .*notes.txt is a file: give a folder")
        refused([*base, mine / "sub"], unchanged=[tmp_path], mention=r"--out .*notes.txt/sub: .*notes.txt is a file")
        refused([*base, tmp_path], unchanged=[tmp_path],
                mention=r"--out .* holds other files and no run of this script \(no state.json or logs/\)")
    refused(["launch.reproduce", "--study", "mqar", "--out", tmp_path / "new", "--report", tmp_path],
            unchanged=[tmp_path], mention=r"--report .* is a folder: give a file name")


# ---------------------------------------------------------------- issue 52: a peer's flags and names

@pytest.mark.parametrize("argv, said", [
    (["--train-iters", "10", "--lr", "3e-4"],
     "megatron-id train takes settings as key=value overrides, not Megatron-LM flags: --train-iters 10 -> "
     "train.train_tokens=<10 x train.global_batch_size x model.seq_length>; --lr 3e-4 -> optimizer.lr=3e-4 "
     "(docs/reference/config.md lists every key with its Megatron-LM flag and GPT-NeoX key)."),
    (["model.d_model=128", "--lr=3e-4", "--bf16", "--no-load-optim"],
     "--lr 3e-4 -> optimizer.lr=3e-4; --bf16 -> train.precision=bf16; --no-load-optim -> train.load_optimizer=false"),
    (["--data-path", "0.7", "a_text_document", "0.3", "b_text_document", "--sequence-parallel"],
     "--data-path 0.7,a_text_document,0.3,b_text_document -> data.data_path=[0.7,a_text_document,0.3,b_text_document]; "
     "--sequence-parallel -> parallel.sequence_parallel=true"),
    (["--override-opt_param-scheduler"], "--override-opt_param-scheduler -> train.override_scheduler=true"),
    (["--bogus", "3"], "unrecognized arguments: --bogus: settings are key=value overrides (e.g. "
                       "optimizer.lr=3e-4), not flags; `megatron-id train --help` lists its flags "
                       "(docs/reference/config.md lists every key"),
    (["train_iters=10"], "override 'train_iters=10': train_iters is a Megatron-LM / GPT-NeoX name; here write "
                         "train.train_tokens=<10 x train.global_batch_size x model.seq_length>"),
    (["lr=3e-4"], "override 'lr=3e-4': lr is a Megatron-LM / GPT-NeoX name; here write optimizer.lr=3e-4"),
], ids=["train-iters-and-lr", "after-overrides", "data-path-pairs", "override-scheduler", "unknown-flag",
        "neox-train_iters", "megatron-lr-name"])
def test_a_megatron_flag_or_name_is_answered_with_the_key_to_write(argv, said, capsys):
    """`megatron-id train --train-iters 10 --lr 3e-4` got argparse's usage block and 'unrecognized
    arguments' (its 10 taken for an override), `train_iters=10` 'Did you mean train?'. Now one
    line with the override to write for each, from the reference page's own table."""
    from megatron_id.cli import main
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--config", TINY, *argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "usage:" not in err and err.count("\n") == 1, err
    assert err.startswith("megatron-id: error: ") and said in err, err


def test_megatron_flags_on_the_command_line_are_one_line_before_any_work(tmp_path):
    refused(["megatron_id.cli", "train", "--config", TINY, "--train-iters", "10", f"train.save={tmp_path / 'ck'}"],
            mention=r"--train-iters 10 -> train.train_tokens=<10 x train.global_batch_size x model.seq_length>",
            unchanged=[tmp_path])


# ---------------------------------------------------------------- issue 52: megatron-id train, typed carelessly

def test_a_tilde_path_and_an_unwritable_output_folder_are_refused_before_any_work(tmp_path, monkeypatch):
    """`train.save=~/runs/x` reaches Python as it is (the shell expands ~ only at a word's start):
    the run wrote its checkpoints into ./~/runs/x. A read-only train.tensorboard_dir failed after
    the model was built, as 'No such file or directory' without the key."""
    from file_systems import read_only_folder

    from megatron_id.errors import UserError
    from megatron_id.training.engine import check_paths
    monkeypatch.chdir(tmp_path)
    for item, key in (("train.save=~/runs/x", "train.save"), ("data.data_path=[~/data/corpus]", "data.data_path")):
        with pytest.raises(ConfigError, match=rf"{re.escape(key)}(\[0\])?=~/.*: ~ is not expanded here \(the shell "
                                              rf"expands it only at the start of a word, not after key=\), so this "
                                              rf"would be a folder named '~' in {tmp_path}: write {key}=\$HOME/"):
            check_paths(load_config([TINY], [item]))
    assert not list(tmp_path.iterdir())
    with read_only_folder(tmp_path / "ro") as real:
        if not real:
            pytest.skip("no read-only folder can be made here")
        with pytest.raises(UserError, match=r"train.tensorboard_dir .*ro/tb: cannot write there \(its folder "
                                              r".*ro\): (the file system is read-only|permission denied)"):
            check_paths(load_config([TINY], [f"train.tensorboard_dir={tmp_path / 'ro' / 'tb'}"]))


def test_an_empty_train_load_from_an_unset_variable_is_refused(capsys):
    """`train.load=$CKPT` with CKPT unset arrives as `train.load=`, which the schema reads as
    unset: a job meant to resume started again from step 1 (and `train.save=` trained without
    saving anything). Refused before any import of torch."""
    from megatron_id.cli import main
    assert main(["train", "--config", TINY, "train.load="]) == 2
    assert capsys.readouterr().err == ("megatron-id: error: override 'train.load=' has an empty value (an unset shell "
                                       "variable?), so train.load would be unset: the run would start from step 1 "
                                       "instead of resuming. Give its value, or leave the override out (or write "
                                       "train.load=null) to leave it unset on purpose.\n")
    assert main(["train", "--config", TINY, "train.save="]) == 2
    assert "no checkpoint would be saved" in capsys.readouterr().err


def test_a_hugging_face_folder_as_train_load_names_import_hf(tmp_path):
    from megatron_id.checkpoint.rules import check_save_and_load
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"train.load={hf} is a Hugging Face folder \(it holds config.json\), not a "
                                          rf"train.save folder: import it first \(megatron-id import-hf --input {hf} "
                                          rf"--output {tmp_path}/hf-imported\), then train from "
                                          rf"train.load={tmp_path}/hf-imported"):
        check_save_and_load(str(tmp_path / "ckpt"), str(hf))


def test_a_resume_with_another_seed_or_data_says_the_order_changes(tmp_path):
    """Resumed with another seed (or data path, or split), the run read another shuffle from step
    x batch on without a word: samples seen again, others never. Said, not refused (a new shuffle
    past a loss spike, an annealing mix are done on purpose)."""
    from megatron_id.checkpoint.files import ClientState, write_client_state
    from megatron_id.training.engine import resume_data_changes
    folder = tmp_path / "ckpt" / "iter_0000004"
    folder.mkdir(parents=True)
    write_client_state(folder, ClientState(step=4, model={}, consumed_samples=32, data={
        "data_path": ["data/fineweb_text_document"], "split": "95,5,0", "seed": 42}))
    same = ["data.data_path=[/elsewhere/data/fineweb_text_document]", "data.split=95,5,0"]   # another folder: the same
    assert resume_data_changes(folder, load_config([TINY], same)) == []
    (line,) = resume_data_changes(folder, load_config([TINY], [*same, "seed=7", "data.split=90,10,0"]))
    assert line == ("warning: iter_0000004 was trained with other data settings (seed=42 -> 7, data.split=95,5,0 -> "
                    "90,10,0): the run goes on 32 samples into the new data order, so samples already trained on may "
                    "come again and others never; resume with the checkpoint's settings to continue its order.")
