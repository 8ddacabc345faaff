"""Tokenizers, data, models and checkpoints never disagree silently (issue 26): one identity
per tokenizer (data/tokenizer.py), checked by the trainer's preflight (training/agreement.py)
and by every command that pairs a model with a tokenizer or data; a blend naming a prefix twice;
how a signalled plain run ends."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from bad_inputs import refused, run_module
from conftest import CONFIGS, ROOT
from distributed import run_distributed

from megatron_id.config import ConfigError, load_config

TINY = str(CONFIGS / "model" / "tiny.yaml")
GPT2 = ROOT / "tests" / "data" / "gpt2-tokenizer.json"
SAMPLE = ROOT / "tests" / "data" / "fineweb-edu-sample-150.jsonl"


def train_items(prefix, *extra):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            "train.zero_stage=0", "train.precision=fp32", "train.micro_batch_size=2",
            "train.global_batch_size=2", "train.train_tokens=256", "optimizer.warmup_tokens=0",
            "train.eval_iters=0", *extra]


def train_command(*items):
    return ["megatron_id.cli", "train", "--config", TINY, *items]


def _preprocess(jsonl: Path, tokenizer: Path, out: Path, *extra) -> str:
    from data_tools.preprocess import main as preprocess
    assert preprocess(["--input", str(jsonl), "--tokenizer", str(tokenizer), "--output-prefix", str(out),
                       "--no-progress", *extra]) == 0
    return f"{out}_text_document"


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A second tokenizer (a 400-token BPE of Tiny Shakespeare) and the FineWeb-Edu sample
    preprocessed with it: the same text, ids that mean other tokens."""
    from data_tools.train_tokenizer import main as train_tokenizer
    root = tmp_path_factory.mktemp("other")
    (root / "text.txt").write_text((ROOT / "tests/data/tinyshakespeare-200k.txt").read_text()[:60_000])
    assert train_tokenizer(["--input", str(root / "text.txt"), "--vocab-size", "400",
                            "--output", str(root / "tokenizer.json")]) == 0
    prefix = _preprocess(SAMPLE, root / "tokenizer.json", root / "fineweb-other", "--append-eod")
    return root / "tokenizer.json", prefix


@pytest.fixture(scope="module")
def trained(fineweb_prefix, tmp_path_factory):
    """A train.save folder of two steps on GPT-2 data with data.tokenizer set."""
    ckpt = tmp_path_factory.mktemp("trained") / "ckpt"
    items = train_items(fineweb_prefix, f"train.save={ckpt}", f"data.tokenizer={GPT2}")
    assert run_distributed(_save_two_steps, 1, args=(items,), timeout=300) == [2]
    return ckpt


def _save_two_steps(rank, world, items):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    trainer.train(max_steps=2)
    trainer.close()
    return trainer.step


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / ".lock").unlink(missing_ok=True)
    return dst


# ------------------------------------------------------------ identities

def test_identity_is_the_vocabulary_not_the_file(tmp_path, other):
    from megatron_id.data.tokenizer import identity_of_file, load_tokenizer, tokenizer_identity
    copy = tmp_path / "elsewhere.json"
    shutil.copy(GPT2, copy)
    assert identity_of_file(copy) == identity_of_file(GPT2) == tokenizer_identity(load_tokenizer(str(GPT2)))
    assert identity_of_file(other[0]) != identity_of_file(GPT2)
    assert identity_of_file(GPT2).startswith("vocab:") and len(identity_of_file(GPT2)) == len("vocab:") + 16


# ------------------------------------------------------------ the trainer's preflight (in process)

def _run_tokenizer(*items):
    from megatron_id.training.agreement import run_tokenizer
    return run_tokenizer(load_config([TINY], list(items)))


def test_a_blend_of_two_tokenizers_is_refused_unless_asked_for(fineweb_prefix, other, capsys):
    from megatron_id.data.tokenizer import TokenizerMismatchError
    blend = f"data.data_path=[0.5,{fineweb_prefix},0.5,{other[1]}]"
    with pytest.raises(TokenizerMismatchError, match=r"their token ids mean different tokens.*"
                                                     r"data.allow_tokenizer_mismatch=true"):
        _run_tokenizer(blend, "model.vocab_size=50257")
    mixed = _run_tokenizer(blend, "model.vocab_size=50257", "data.allow_tokenizer_mismatch=true")
    assert mixed.identity is None   # the checkpoints then record no identity
    assert "mixed on purpose: allowed" in capsys.readouterr().err


def test_data_tokenizer_must_be_the_datas(fineweb_prefix, other):
    from megatron_id.data.tokenizer import TokenizerMismatchError, identity_of_file
    with pytest.raises(TokenizerMismatchError, match=rf"data.tokenizer={other[0]}"):
        _run_tokenizer(f"data.data_path=[{fineweb_prefix}]", f"data.tokenizer={other[0]}", "model.vocab_size=50257")
    same = _run_tokenizer(f"data.data_path=[{fineweb_prefix}]", f"data.tokenizer={GPT2}", "model.vocab_size=50257")
    assert same.identity == identity_of_file(GPT2) and same.vocab_size == 50257


def test_model_vocab_below_the_tokenizers_is_refused(fineweb_prefix):
    with pytest.raises(ConfigError, match=r"model.vocab_size=50000 is smaller than the 50,257 tokens.*"
                                          r"Set model.vocab_size=50257"):
        _run_tokenizer(f"data.data_path=[{fineweb_prefix}]", "model.vocab_size=50000")


def test_a_small_vocab_on_small_ids_is_refused_before_training(tmp_path):
    """The data hold only ids < 512 (no end-of-document token), so the ids-fit check passes;
    the tokenizer's 50,257 tokens do not fit model.vocab_size=512."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "small.jsonl").write_text("".join('{"text": "a b a b a b a b"}\n' for _ in range(200)))
    prefix = _preprocess(tmp_path / "in" / "small.jsonl", GPT2, tmp_path / "data" / "small")
    items = [i for i in train_items(prefix) if not i.startswith("model.vocab_size")]
    refused(train_command(*items, "model.vocab_size=512", f"train.save={tmp_path / 'ckpt'}"),
            mention=r"model.vocab_size=512 is smaller than the 50,257 tokens", unchanged=[tmp_path])


# ------------------------------------------------------------ resume

@pytest.mark.slow
def test_a_resume_with_another_model_names_every_differing_key(fineweb_prefix, trained, tmp_path):
    ckpt = _copy(trained, tmp_path / "ckpt")
    items = [i for i in train_items(fineweb_prefix, f"train.save={ckpt}", f"train.load={ckpt}",
                                    f"data.tokenizer={GPT2}")]
    done = refused(train_command(*items, "model.d_model=128", "model.seq_length=32"),
                   mention=r"model.d_model=64 in the checkpoint but 128 here, model.seq_length=64 in the "
                           r"checkpoint but 32 here.*set model.d_model=64 model.seq_length=64",
                   unchanged=[tmp_path])
    assert "size mismatch" not in done.stderr


@pytest.mark.slow
def test_a_resume_on_another_tokenizers_data_is_refused(other, trained, tmp_path):
    ckpt = _copy(trained, tmp_path / "ckpt")
    refused(train_command(*train_items(other[1], f"train.save={ckpt}", f"train.load={ckpt}")),
            mention=rf"checkpoint {ckpt}/iter_0000002 was made with tokenizer vocab:\w+ .*but this run's data "
                    r"with tokenizer vocab:\w+.*data.allow_tokenizer_mismatch=true",
            unchanged=[tmp_path])


# ------------------------------------------------------------ generate, export, import, eval

@pytest.mark.slow
def test_commands_refuse_another_tokenizer_for_the_model(trained, other, tmp_path):
    ckpt = _copy(trained, tmp_path / "ckpt")
    wrong = str(other[0])
    mention = r"the model of .* was made with tokenizer vocab:\w+ but the tokenizer .* with tokenizer vocab:\w+"
    refused(["megatron_id.cli", "generate", "--checkpoint", ckpt, "--prompt", "Hello", "--tokenizer", wrong,
             "--max-new-tokens", "2"], mention=mention, unchanged=[tmp_path])
    refused(["megatron_id.cli", "export-hf", "--checkpoint", ckpt, "--output", tmp_path / "hf",
             "--tokenizer", wrong], mention=mention, unchanged=[tmp_path])
    refused(["megatron_id.cli", "eval", "perplexity", "--checkpoint", ckpt, "--tokenizer", wrong,
             "--data", other[1], "--count", "1", "--device", "cpu"], mention=mention, unchanged=[tmp_path])
    # the model's own tokenizer on another tokenizer's data: the data side is named
    refused(["megatron_id.cli", "eval", "perplexity", "--checkpoint", ckpt, "--data", other[1],
             "--count", "1", "--device", "cpu"],
            mention=rf"--data {other[1]} was made with tokenizer vocab:\w+.*--allow-tokenizer-mismatch",
            unchanged=[tmp_path])
    # on purpose: generation runs (a warning, then text)
    done = run_module("megatron_id.cli", ["generate", "--checkpoint", ckpt, "--prompt", "Hello", "--tokenizer",
                                          wrong, "--max-new-tokens", "2", "--allow-tokenizer-mismatch",
                                          "--device", "cpu"])
    assert done.returncode == 0 and "mixed on purpose: allowed" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_the_export_and_import_carry_the_identity(trained, other, tmp_path):
    import json

    from megatron_id.checkpoint.files import read_client_state
    from megatron_id.checkpoint.read import checkpoint_folder
    from megatron_id.data.tokenizer import identity_of_file
    from megatron_id.hf.export import TOKENIZER_ID_KEY, export_hf, import_hf
    own = identity_of_file(GPT2)
    assert read_client_state(checkpoint_folder(trained)).tokenizer_id == own
    hf = export_hf(trained, tmp_path / "hf")
    assert json.loads((hf / "config.json").read_text())[TOKENIZER_ID_KEY] == own
    back = import_hf(hf, tmp_path / "imported")
    assert read_client_state(checkpoint_folder(back)).tokenizer_id == own
    # a tokenizer.json swapped into the export by hand is not the one its weights go with
    shutil.copy(other[0], hf / "tokenizer.json")
    refused(["megatron_id.cli", "import-hf", "--input", hf, "--output", tmp_path / "again"],
            mention=r"the model of .* was made with tokenizer vocab:\w+ but the tokenizer", unchanged=[tmp_path])


# ------------------------------------------------------------ blends

def test_a_prefix_named_twice_is_one_dataset(fineweb_prefix, tmp_path, capsys):
    """Two copies of one GPT dataset share their seed, hence their order: the blend served
    each sample twice in a row. Merged, it is the single prefix's dataset."""
    from megatron_id.data.gpt_dataset import build_gpt_datasets, check_data, parse_data_path
    spelled = fineweb_prefix.removesuffix("_text_document")   # the same dataset, spelled otherwise
    twice = ["0.5", fineweb_prefix, "0.5", spelled]
    assert parse_data_path(twice) == [(1.0, fineweb_prefix)]
    blended = build_gpt_datasets(twice, "100,0,0", (40, 0, 0), 64, 1234, str(tmp_path / "a"))[0]
    single = build_gpt_datasets([fineweb_prefix], "100,0,0", (40, 0, 0), 64, 1234, str(tmp_path / "b"))[0]
    rows = [np.asarray(blended[i]) for i in range(len(blended))]
    assert len(rows) == len(single)
    assert all(np.array_equal(r, np.asarray(single[i])) for i, r in enumerate(rows))
    assert not any(np.array_equal(rows[i], rows[i + 1]) for i in range(len(rows) - 1))
    # with a third dataset the weights add up: 3 of 4 draws from the repeated prefix
    assert parse_data_path(["1", fineweb_prefix, "2", fineweb_prefix, "1", "other"]) == \
        [(0.75, fineweb_prefix), (0.25, "other")]
    check_data(twice, "100,0,0", 64, 50257)
    assert "names " in capsys.readouterr().err


# ------------------------------------------------------------ signals to a plain run

def _start_plain_run(items, log: Path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MEGATRON_ID_STOPPED_EXIT_STATUS", None)
    # SIGINT back to its default in the child: a shell without job control (a CI script started
    # with `&`) starts its background commands with SIGINT ignored, the child would inherit that,
    # and Python never turns an ignored SIGINT into KeyboardInterrupt
    return subprocess.Popen([sys.executable, "-m", "megatron_id.cli", "train", "--config", TINY, *items],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"), cwd=ROOT,
                            stdin=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_step(proc, log: Path, step: int, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if f"step {step}/" in log.read_text():
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no step {step} in the log:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_sigterm_to_a_plain_run_says_stopped_and_exits_3(fineweb_prefix, tmp_path):
    from megatron_id.training.launcher import STOPPED_EXIT_STATUS
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    items = train_items(fineweb_prefix, "train.train_tokens=1000000", "train.log_interval=1",
                        f"train.save={ckpt}", "train.save_interval=100000")
    proc = _start_plain_run(items, log)
    _wait_for_step(proc, log, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == STOPPED_EXIT_STATUS == 3, log.read_text()[-3000:]
    last = log.read_text().strip().splitlines()[-1]
    step = int((ckpt / "latest").read_text().removeprefix("iter_"))
    assert last == (f"stopped at step {step:,} of 7,813 (SIGTERM): checkpoint {ckpt}/iter_{step:07d} (step {step}); "
                    f"resume with the same command and train.load={ckpt} (exit 3)"), last


@pytest.mark.slow
def test_sigint_says_what_was_saved(fineweb_prefix, tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log"
    items = train_items(fineweb_prefix, "train.train_tokens=1000000", "train.log_interval=1",
                        f"train.save={ckpt}", "train.save_interval=2")
    proc = _start_plain_run(items, log)
    _wait_for_step(proc, log, 3)
    proc.send_signal(signal.SIGINT)
    try:
        status = proc.wait(timeout=120)
    finally:
        proc.kill()   # never left running past the test (it would slow every test after it)
    assert status == 130, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("megatron-id: interrupted (SIGINT) at step ") and \
        f"of 7,813; last checkpoint: {ckpt}/iter_" in last, last
