"""Hugging Face export / import / generate never lose data or write garbage silently (issue 10).

Every careless command is refused with one line naming the file or value and the fix, and
leaves every file it could have touched byte-identical with nothing added (`refused`, from
tests/bad_inputs.py); an earlier output is replaced only with --overwrite, only when it is ours,
and atomically. And the SSM parameters of an export stay float32 when it is loaded in bf16.
"""
import json
import os
import random
import re
import shutil

import pytest
import torch
from bad_inputs import refused, snapshot
from conftest import CONFIGS
from distributed import run_distributed
from test_hf import TOKENIZER, train_items

from megatron_id.config import load_config

CLI = "megatron_id.cli"
SSM_LEAVES = {"log_dt", "a_log", "a_im", "c_re", "c_im", "c_vec", "k_norm", "v_norm", "k_bias", "v_bias"}


def _train_save(rank, world, items, path):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    trainer.train(max_steps=2)
    trainer.save_checkpoint(path)


@pytest.fixture(scope="module")
def checkpoint(fineweb_prefix, tmp_path_factory):
    """One tiny trained checkpoint (train.save folder) for the whole module: read, never written."""
    path = tmp_path_factory.mktemp("safety") / "checkpoints"
    run_distributed(_train_save, 1, args=(train_items(fineweb_prefix, 1, 1, "interdomain"), path), timeout=300)
    return path


@pytest.fixture(scope="module")
def export(checkpoint, tmp_path_factory):
    """An export of `checkpoint`, made once; tests copy it before changing anything."""
    from megatron_id.hf.export import export_hf
    return export_hf(checkpoint, tmp_path_factory.mktemp("safety-export") / "hf")


def copy_of(folder, where):
    shutil.copytree(folder, where)
    return where


def fake_run(folder, tags=("iter_0000001", "iter_0000002")):
    """A train.save folder with a history (what a user must never lose to an export or import)."""
    for tag in tags:
        (folder / tag).mkdir(parents=True)
        (folder / tag / "mp_rank_00_model_states.pt").write_bytes(os.urandom(64))
    (folder / "latest").write_text(tags[-1])
    return folder


def hidden_leftovers(folder):
    """Staging (.x.partial-*) or set-aside (.x.old-*) folders left beside an output."""
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def export_cmd(checkpoint, output, *more):
    return [CLI, "export-hf", "--checkpoint", checkpoint, "--output", output, *more]


def import_cmd(folder, output, *more):
    return [CLI, "import-hf", "--input", folder, "--output", output, *more]


# ---------------------------------------------------------------- export-hf refuses

@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_export_never_writes_into_a_folder_holding_a_checkpoint(checkpoint, tmp_path, flags):
    other = fake_run(tmp_path / "other-run")
    refused(export_cmd(checkpoint, other, *flags), mention=r"other-run is not empty and is not an earlier export: "
            r"it holds iter_0000001, iter_0000002, latest.*--overwrite replaces only", unchanged=[tmp_path, checkpoint])


@pytest.mark.slow
@pytest.mark.parametrize("where", ["root", "inside", "iter"])
def test_export_never_writes_into_the_checkpoint_it_reads(checkpoint, where):
    source = {"root": checkpoint, "inside": checkpoint, "iter": checkpoint / "iter_0000002"}[where]
    output = {"root": checkpoint, "inside": checkpoint / "hf", "iter": checkpoint / "hf"}[where]
    refused(export_cmd(source, output, "--overwrite"), mention=r"is the checkpoint being exported .* or inside it.*"
            r"Choose a folder outside it", unchanged=[checkpoint])


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_export_to_dot_holding_user_files_is_refused(checkpoint, tmp_path, flags):
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    (work / "notes.txt").write_text("my notes")
    (work / "data" / "corpus.jsonl").write_text('{"text": "x"}\n')
    refused(export_cmd(checkpoint, ".", *flags), cwd=work, mention=r"work is not empty and is not an earlier export: "
            r"it holds data, notes.txt", unchanged=[tmp_path, checkpoint])


@pytest.mark.slow
def test_export_to_a_file_is_refused(checkpoint, tmp_path):
    (tmp_path / "model.bin").write_bytes(b"precious")
    refused(export_cmd(checkpoint, tmp_path / "model.bin"), mention=r"model.bin is a file, not a folder",
            unchanged=[tmp_path])


@pytest.mark.slow
def test_an_earlier_export_needs_overwrite(checkpoint, export, tmp_path):
    old = copy_of(export, tmp_path / "hf")
    refused(export_cmd(checkpoint, old), mention=r"hf already holds an earlier export.*Add --overwrite",
            unchanged=[tmp_path])


@pytest.mark.slow
def test_an_export_with_a_user_file_inside_is_not_overwritten(checkpoint, export, tmp_path):
    old = copy_of(export, tmp_path / "hf")
    (old / "README.md").write_text("my model card")
    refused(export_cmd(checkpoint, old, "--overwrite"), mention=r"it holds README.md, which an export does not write",
            unchanged=[tmp_path])


@pytest.mark.slow
def test_export_of_something_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    refused(export_cmd(tmp_path / "notes", tmp_path / "hf"), mention=r"notes is not a training checkpoint: "
            r"it has neither `latest`.*Give the train.save folder", unchanged=[tmp_path])
    refused(export_cmd(tmp_path / "missing", tmp_path / "hf"), mention=r"missing does not exist: give the "
            r"train.save folder", unchanged=[tmp_path])


@pytest.mark.slow
def test_export_of_a_checkpoint_whose_latest_names_a_missing_folder(checkpoint, tmp_path):
    broken = tmp_path / "checkpoints"
    broken.mkdir()
    shutil.copy(checkpoint / "latest", broken / "latest")   # the iter_ folder was not copied
    refused(export_cmd(broken, tmp_path / "hf"), mention=r"latest names 'iter_0000002' but .* does not exist: write "
            r"the name of an existing iter_", unchanged=[tmp_path])


@pytest.mark.slow
def test_export_with_a_missing_tokenizer(checkpoint, tmp_path):
    refused(export_cmd(checkpoint, tmp_path / "hf", "--tokenizer", tmp_path / "gone.json"),
            mention=r"--tokenizer .*gone.json not found: pass --tokenizer path/to/tokenizer.json",
            unchanged=[tmp_path, checkpoint])


def test_a_recorded_tokenizer_that_moved_is_named(tmp_path):
    from megatron_id.data.tokenizer import TokenizerNotFoundError, find_tokenizer
    with pytest.raises(TokenizerNotFoundError, match=r"records no tokenizer .*pass --tokenizer"):
        find_tokenizer(None, None, tmp_path)
    with pytest.raises(TokenizerNotFoundError, match=r"old/tok.json \(recorded in .*\) not found: it was moved"):
        find_tokenizer(None, "/old/tok.json", tmp_path)
    assert find_tokenizer(None, str(TOKENIZER), tmp_path) == TOKENIZER


# ---------------------------------------------------------------- import-hf refuses

@pytest.mark.slow
def test_import_never_touches_a_training_history(export, tmp_path):
    run = fake_run(tmp_path / "checkpoints")
    refused(import_cmd(export, run, "--overwrite"), mention=r"it holds training checkpoints \(iter_0000001, "
            r"iter_0000002\): a training history is never replaced", unchanged=[tmp_path, export])


@pytest.mark.slow
def test_import_into_an_earlier_import_needs_overwrite(export, tmp_path):
    from megatron_id.hf.export import import_hf
    earlier = import_hf(export, tmp_path / "imported")
    refused(import_cmd(export, earlier), mention=r"imported already holds an earlier import.*Add --overwrite",
            unchanged=[tmp_path])
    # an import someone trained on (weights_only gone) is a training checkpoint, not ours to replace
    client = torch.load(earlier / "iter_0000000" / "client_state.pt", weights_only=True)
    from megatron_id.hf.export import why_not_an_import
    assert why_not_an_import(earlier) is None
    client["weights_only"] = False
    torch.save(client, earlier / "iter_0000000" / "client_state.pt")
    assert "is missing or damaged" in why_not_an_import(earlier)   # the manifest no longer matches
    (earlier / "iter_0000000" / "manifest.json").unlink()
    assert "not weights only" in why_not_an_import(earlier)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["no config", "no weights", "model_type", "truncated"])
def test_import_of_a_folder_that_is_not_an_export(export, tmp_path, damage):
    bad = copy_of(export, tmp_path / "hf")
    if damage == "no config":
        (bad / "config.json").unlink()
        mention = r"hf has no config.json. It is an export of megatron-id \(it holds configuration_megatron_id.py, " \
                  r"megatron_id_model.py, modeling_megatron_id.py\): export the checkpoint again with megatron-id " \
                  r"export-hf, or restore config.json from a copy"
    elif damage == "no weights":
        (bad / "model.safetensors").unlink()
        mention = r"model.safetensors is missing: .* is not a complete export. Export the checkpoint again"
    elif damage == "model_type":
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
        mention = r"config.json has model_type 'llama', not 'megatron_id'"
    else:
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[:len(data) // 2])
        mention = r"model.safetensors is damaged \(.*\): it was truncated or overwritten. Export the checkpoint again"
    refused(import_cmd(bad, tmp_path / "imported"), mention=mention, unchanged=[tmp_path])


@pytest.mark.slow
@pytest.mark.parametrize("tp, mention", [
    ("3", r"--tensor-parallel 3 cannot split the model .*n_heads=4.*Valid --tensor-parallel values for this "
          r"model: 1, 2, 4"),
    ("0", r"--tensor-parallel 0 is invalid: it must be at least 1")])
def test_import_with_a_tensor_parallel_size_that_cannot_work(export, tmp_path, tp, mention):
    refused(import_cmd(export, tmp_path / "imported", "--tensor-parallel", tp), mention=mention,
            unchanged=[tmp_path, export])


@pytest.mark.slow
def test_weights_that_do_not_match_the_config_are_named(export, tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_id.hf.export import NotAnExportError, read_hf_folder
    bad = copy_of(export, tmp_path / "hf")
    (bad / "manifest.json").unlink()   # an export written before manifests (with one, the manifest refuses first)
    weights = load_file(str(bad / "model.safetensors"))
    weights.pop("model.norm.weight")
    weights["model.layers.0.mixer.a_im"] = torch.zeros(3)
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(NotAnExportError, match=r"does not match the model in config.json: model.norm.weight "
                                               r"is missing; model.layers.0.mixer.a_im has shape \[3\]"):
        read_hf_folder(bad)


# ---------------------------------------------------------------- generate refuses

@pytest.mark.slow
def test_generate_refuses_bad_inputs(export, tmp_path):
    refused([CLI, "generate", "--checkpoint", tmp_path / "nope", "--prompt", "Hi"],
            mention=r"checkpoint .*nope does not exist: give the train.save folder .*or a folder written by "
                    r"megatron-id export-hf", unchanged=[tmp_path])
    refused([CLI, "generate", "--checkpoint", export, "--prompt", "Hi", "--max-new-tokens", "-1"],
            mention=r"--max-new-tokens -1 is invalid: it must be at least 0", unchanged=[export])
    refused([CLI, "generate", "--checkpoint", export, "--prompt", ""],
            mention=r"--prompt '' gives no tokens: give a prompt with some text", unchanged=[export])


@pytest.mark.slow
def test_generate_a_file_of_prompts_in_batches_as_one_at_a_time(export, tmp_path, capsys):
    """--input-file: the prompts decoded 2 at a time with continuous batching (the fused step)
    give, line by line, what --prompt gives for each alone; blank lines are counted, not lost."""
    from megatron_id.cli import main
    prompts = ["Rivers carry", "The water cycle is the", "", "A", "Clouds form when warm air rises and"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.jsonl"
    common = ["--checkpoint", str(export), "--max-new-tokens", "6", "--ignore-eos", "--prefill-chunk-size", "3"]
    assert main(["generate", *common, "--input-file", str(tmp_path / "prompts.txt"), "--output-file", str(out),
                 "--batch-size", "2"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 blank line(s)" in err and "wrote 4 completions" in err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [p for p in prompts if p]
    assert all(r["tokens"] == 6 and r["finish_reason"] == "length" for r in rows)
    for row in rows:
        for decode in ("eager", "fused"):
            assert main(["generate", *common, "--prompt", row["prompt"], "--decode", decode]) == 0
            assert capsys.readouterr().out == row["prompt"] + row["completion"] + "\n", decode
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    for args, mention in [
            (["--input-file", str(tmp_path / "prompts.txt"), "--output-file", str(out)],
             r"--output-file .*out.jsonl exists: give a new file \(it is never replaced\)"),
            (["--input-file", str(tmp_path / "nope.txt")], r"--input-file .*nope.txt: no such file"),
            (["--input-file", str(tmp_path / "bad.jsonl")], r"bad.jsonl, line 2: no \"prompt\" string in it"),
            (["--prompt", "Hi", "--output-file", str(tmp_path / "x.jsonl")], r"--output-file goes with --input-file"),
            (["--input-file", str(tmp_path / "prompts.txt"), "--batch-size", "0"], r"--batch-size 0: at least 1")]:
        before = snapshot(tmp_path)
        assert main(["generate", "--checkpoint", str(export), *args]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert re.search(mention, err[-1]) and "Traceback" not in "".join(err), (args, err)
        assert snapshot(tmp_path) == before


def test_generation_options_are_checked():
    from megatron_id.errors import BadOptionError
    from megatron_id.inference.generate import check_options, generate_ids
    check_options(0, 0.0, 0, 1)
    for args, option in [((5, -1.0, 0, 8), "--temperature"), ((5, float("nan"), 0, 8), "--temperature"),
                         ((5, 0.0, -2, 8), "--top-k"), ((5, 0.0, 0, 0), "--prefill-chunk-size")]:
        with pytest.raises(BadOptionError, match=option):
            check_options(*args)
    with pytest.raises(BadOptionError, match="the prompt is empty"):
        next(generate_ids(None, [], 5))


# ---------------------------------------------------------------- what is written, and how

@pytest.mark.slow
def test_export_into_an_empty_folder_equals_a_fresh_export(checkpoint, export, tmp_path):
    from megatron_id.hf.export import export_hf
    (tmp_path / "empty").mkdir()
    assert export_hf(checkpoint, tmp_path / "empty") == tmp_path / "empty"
    assert snapshot(tmp_path / "empty") == snapshot(export)
    assert hidden_leftovers(tmp_path) == []
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in (tmp_path / "empty").iterdir())   # umask 022: readable


@pytest.mark.slow
def test_overwrite_replaces_an_earlier_export_with_a_fresh_one(checkpoint, export, tmp_path):
    from megatron_id.cli import main
    from megatron_id.hf.export import export_hf
    older = export_hf(checkpoint, tmp_path / "hf", prefill_chunk_size=7)   # differs in config.json
    assert snapshot(older) != snapshot(export)
    assert main(["export-hf", "--checkpoint", str(checkpoint), "--output", str(older), "--overwrite"]) == 0
    assert snapshot(older) == snapshot(export)
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.slow
def test_overwrite_replaces_an_earlier_import(export, tmp_path):
    from megatron_id.checkpoint.files import read_client_state
    from megatron_id.checkpoint.integrity import verify_checkpoint
    from megatron_id.hf.export import import_hf
    out = import_hf(export, tmp_path / "imported", tensor_parallel=1)
    import_hf(export, out, tensor_parallel=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000000", "latest", "tokenizer"]
    assert read_client_state(out / "iter_0000000").layout["tensor"] == 2
    assert verify_checkpoint(out / "iter_0000000") == []   # its manifest covers every file
    assert hidden_leftovers(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("fail_at", ["build", "rename in"])
def test_a_failed_overwrite_leaves_the_old_export_intact(checkpoint, export, tmp_path, monkeypatch, fail_at):
    import megatron_id.hf.export as hf_export
    old = copy_of(export, tmp_path / "hf")
    (old / "config.json").write_text((old / "config.json").read_text().replace('"prefill_chunk_size": 2048',
                                                                            '"prefill_chunk_size": 7'))
    before = snapshot(tmp_path)
    if fail_at == "build":
        def bundle_source():
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(hf_export, "bundle_source", bundle_source)
    else:
        real = os.replace

        def replace(src, dst):   # the new folder cannot be renamed in (after the old one was moved aside)
            if ".partial-" in str(src):
                raise OSError(28, "No space left on device")
            return real(src, dst)
        monkeypatch.setattr(hf_export.os, "replace", replace)
    with pytest.raises(OSError, match="(?i)no space left"):
        hf_export.export_hf(checkpoint, old, overwrite=True)
    assert snapshot(tmp_path) == before   # old export byte-identical, no staging or set-aside folder


@pytest.mark.slow
def test_a_failed_import_leaves_the_old_import_intact(export, tmp_path, monkeypatch):
    import megatron_id.checkpoint.read as checkpoint_read
    import megatron_id.hf.export as hf_export
    out = hf_export.import_hf(export, tmp_path / "imported")
    before = snapshot(tmp_path)

    def write_client_state(folder, client):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint_read, "write_client_state", write_client_state)
    with pytest.raises(OSError, match="(?i)no space left"):
        hf_export.import_hf(export, out, tensor_parallel=2, overwrite=True)
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- SSM parameters stay float32

@pytest.mark.slow
def test_ssm_parameters_stay_float32_when_loaded_in_bf16(export, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    folder = copy_of(export, tmp_path / "hf")
    saved = load_file(str(folder / "model.safetensors"))
    big = torch.tensor(1283.3)   # float32; bf16 steps by 8 there: it would become 1280 or 1288
    saved["model.layers.0.mixer.a_im"][0, 0] = big
    save_file(saved, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, local_files_only=True,
                                                 dtype=torch.bfloat16).eval()
    params = dict(model.named_parameters())
    ssm = {n for n in params if SSM_LEAVES & set(n.split("."))}
    assert ssm and {n for n, p in params.items() if p.dtype == torch.float32} == ssm
    assert all(p.dtype == torch.bfloat16 for n, p in params.items() if n not in ssm)
    for name in ssm:
        assert torch.equal(params[name], saved[name]), name   # bit-equal to the saved float32
    assert params["model.layers.0.mixer.a_im"][0, 0].item() == big.item()
    # the forward runs on the mixed bf16 / float32 weights, with and without the cache
    ids = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
        generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert generated.shape == (1, 15)


# ---------------------------------------------------------------- issue 41 group B: generation, serving,
# export and checkpoint I/O (exports carry a manifest; full disks; read-only outputs; careless inputs)

def _damage_in_place(path, at: int, count: int = 4096) -> None:
    """Overwrite `count` bytes of `path` at `at` (same size: what a bad copy or a disk error does)."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * count)


def _dead_pid() -> int:
    import subprocess
    import sys
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


@pytest.mark.slow
def test_an_export_carries_a_manifest_and_a_damaged_export_is_refused(export, tmp_path):
    """Before: an export whose model.safetensors was overwritten in place generated garbage with
    exit 0. Now generate, serve and import-hf check it against its manifest.json first."""
    from megatron_id.checkpoint.integrity import read_manifest
    manifest = read_manifest(export)
    assert set(manifest) == {p.name for p in export.iterdir()} - {"manifest.json"}
    assert all(entry["chunk_sha256"] for entry in manifest.values())
    bad = copy_of(export, tmp_path / "hf")
    _damage_in_place(bad / "model.safetensors", (bad / "model.safetensors").stat().st_size // 2)
    mention = (r"hf/model.safetensors is damaged \(its sha256 differs from manifest.json's\): it was truncated or "
               r"overwritten. Export the checkpoint again with megatron-id export-hf, or restore the file")
    generate = [CLI, "generate", "--checkpoint", bad, "--prompt", "The water cycle", "--max-new-tokens", "3"]
    for command in (generate, generate + ["--verify", "full"], import_cmd(bad, tmp_path / "imported"),
                    [CLI, "serve", "--checkpoint", bad, "--port", "0"]):
        done = refused(command, mention=mention, unchanged=[tmp_path])
        assert "The water cycle" not in done.stdout
    done = refused([CLI, "check-checkpoint", bad], mention=r"the export .*hf is damaged \(listed above\): export the "
                   r"checkpoint again", unchanged=[tmp_path])
    assert "model.safetensors does not match its sha256" in done.stderr


def test_a_sampled_check_reads_a_few_chunks_and_a_full_one_every_byte(tmp_path, monkeypatch):
    from megatron_id.checkpoint import integrity
    (tmp_path / "w.bin").write_bytes(os.urandom(10 * 4096))
    entries = integrity.manifest_entries(tmp_path, ["w.bin"], chunk_bytes=4096)
    assert len(entries["w.bin"]["chunk_sha256"]) == 10
    monkeypatch.setattr(integrity, "WHOLE_BELOW", 0)   # a "large" file: sampled
    assert integrity.verify_folder_files(tmp_path, entries, sampled_chunks=3) == []
    _damage_in_place(tmp_path / "w.bin", 4 * 4096 + 7, 10)
    # a sample of 3 (first, last, one other) may miss chunk 4; every chunk, or every byte, does not
    for seed in range(20):   # a sample of all 10 reads all 10, whatever the draw
        problems = integrity.verify_folder_files(tmp_path, entries, sampled_chunks=10, rng=random.Random(seed))
        assert problems == [f"{tmp_path / 'w.bin'} is damaged (bytes 16,384-20,479 differ from manifest.json's sha256 "
                            f"of them)"]
    assert "sha256 differs" in integrity.verify_folder_files(tmp_path, entries, sampled_chunks=None)[0]
    _damage_in_place(tmp_path / "w.bin", 9 * 4096, 1)   # the last chunk is always in the sample
    assert "bytes 36,864-40,959" in integrity.verify_folder_files(tmp_path, entries, sampled_chunks=2)[0]
    with open(tmp_path / "w.bin", "ab") as f:
        f.write(b"x")
    assert "it has 40,961 bytes, manifest.json says 40,960" in integrity.verify_folder_files(tmp_path, entries, 2)[0]


@pytest.mark.slow
def test_an_export_written_before_manifests_loads_with_a_warning(export, tmp_path, capsys):
    from megatron_id.cli import main
    old = copy_of(export, tmp_path / "hf")
    (old / "manifest.json").unlink()
    assert main(["generate", "--checkpoint", str(old), "--prompt", "The water cycle", "--max-new-tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("The water cycle")
    assert f"warning: {old} has no manifest.json (exported before exports carried one): its files are not " \
           f"verified" in captured.err


@pytest.mark.slow
def test_stale_partials_of_killed_exports_are_removed_with_a_note(checkpoint, export, tmp_path, capsys):
    """Before: a killed `export-hf --overwrite` left its .hf.partial-* folder (112 MB at 350M)
    forever. Now the next export into the same output removes those of dead processes, with a
    note; one of a live process and a set-aside old export (the user's data) are kept."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    import megatron_id.hf.export as hf_export
    from megatron_id.hf.export import export_hf
    old = copy_of(export, tmp_path / "hf")
    # a real kill -9 of `export-hf --overwrite` while it writes the new folder
    for _ in range(3):
        process = subprocess.Popen([sys.executable, "-m", CLI, "export-hf", "--checkpoint", str(checkpoint),
                                    "--output", str(old), "--overwrite"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        deadline = time.time() + 120
        while process.poll() is None and time.time() < deadline and not list(tmp_path.glob(".hf.partial-*/*")):
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)
        process.wait()
        killed = list(tmp_path.glob(".hf.partial-*"))
        if killed:
            break
    assert len(killed) == 1 and snapshot(old) == snapshot(export)   # the old export untouched
    dead, alive = _dead_pid(), os.getpid()
    stale = tmp_path / f".hf.partial-{dead}-0123abcd"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(os.urandom(4096))
    running = tmp_path / f".hf.partial-{os.getppid()}-4567abcd"   # a live process's: not ours to remove
    running.mkdir()
    aside = tmp_path / f".hf.old-{dead}-89abcdef"
    copy_of(export, aside)
    other = tmp_path / f".other.partial-{dead}-0123abcd"   # another output's: not this export's business
    other.mkdir()
    remote = tmp_path / f".hf.partial-elsewhere-{dead}-0123abcd"   # another host's: its process is not seen here
    remote.mkdir()
    mine = tmp_path / f".hf.partial-{hf_export._host()}-{dead}-fedcba98"   # this host's, dead: removed too
    mine.mkdir()
    assert alive != dead
    export_hf(checkpoint, old, overwrite=True)
    err = capsys.readouterr().err
    assert f"note: removed {stale} (4.0 KiB), the staging folder of an interrupted write into {old} " \
           f"(process {dead} is gone)" in err
    assert f"note: {aside} is an earlier hf set aside by an interrupted --overwrite" in err
    assert f"note: removed {mine} " in err and f"note: removed {killed[0]} " in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", running.name, aside.name, other.name,
                                                                 remote.name])
    assert snapshot(old) == snapshot(export)


@pytest.mark.slow
def test_an_export_or_import_onto_a_full_disk_says_so_and_leaves_nothing(checkpoint, export, tmp_path,
                                                                         monkeypatch):
    """Before: `RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos` or a
    bare 'No space left on device.' with no folder. Now: refused before writing when the file
    system has less room than the export needs, and a write that fails all the same names the
    folder and the bytes and removes its partial folder. A real 4 MiB tmpfs where this test may
    mount one (root), else writes made to fail with ENOSPC in-process."""
    import errno

    from file_systems import small_file_system

    import megatron_id.hf.export as hf_export
    from megatron_id.errors import DiskFullError
    disk = tmp_path / "disk"
    with small_file_system(disk, "4m") as real:
        if real:
            done = refused(export_cmd(checkpoint, disk / "hf"), unchanged=[disk],
                           mention=r"no space left on device writing the export of .*checkpoints/iter_0000002 into "
                                   r".*disk/hf: it needs about [\d,]+ bytes \(2\d.\d MiB\), [\d,]+ bytes \(4.0 MiB\) "
                                   r"free there. Nothing was written. Free space there or choose another --output")
            assert done.returncode == 1
            with pytest.raises(DiskFullError, match=r"no space left on device writing the import of .* Nothing was "
                                                    r"written"):
                hf_export.import_hf(export, disk / "imported")
        else:
            monkeypatch.setattr(hf_export, "save_safetensors",
                                lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
        monkeypatch.setattr(hf_export, "check_room", lambda *a: None)   # the disk filled after the check
        with pytest.raises(DiskFullError, match=r"no space left on device writing the export of .*checkpoints/"
                                                r"iter_0000002 into .*disk/hf: it needs about [\d,]+ bytes .* The "
                                                r"partial folder \.hf\.partial-[\w.-]+ was removed\. Free space"):
            hf_export.export_hf(checkpoint, disk / "hf")
        assert list(disk.iterdir()) == []


def test_torch_and_safetensors_full_disk_errors_are_known():
    from megatron_id.errors import is_disk_full
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 13454080 vs 13453968"))
    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing "
                                     "file data/3: file write failed"))
    assert is_disk_full(Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })'))
    assert is_disk_full(OSError(28, "No space left on device"))
    assert not is_disk_full(RuntimeError("CUDA out of memory")) and not is_disk_full(OSError(13, "Permission denied"))


@pytest.mark.slow
def test_generate_refuses_an_unreadable_input_file_and_an_unwritable_output_before_any_work(export, tmp_path):
    """Before: a non-UTF-8 --input-file ended in a UnicodeDecodeError traceback, and a read-only
    --output-file folder was refused after every prompt was generated (completions lost)."""
    from file_systems import read_only_folder
    (tmp_path / "latin1.txt").write_bytes("Rivers\nCaf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "utf16.txt").write_bytes("Rivers\n".encode("utf-16"))
    (tmp_path / "prompts.txt").write_text("Rivers\nClouds\n")
    base = [CLI, "generate", "--checkpoint", export, "--max-new-tokens", "2"]
    refused(base + ["--input-file", tmp_path / "latin1.txt"], unchanged=[tmp_path],
            mention=r"--input-file .*latin1.txt, line 2 \(byte 10\): not UTF-8 text \(byte 0xe9\): save the file as "
                    r"UTF-8, e.g. iconv -f latin1 -t utf-8")
    refused(base + ["--input-file", tmp_path / "utf16.txt"], unchanged=[tmp_path],
            mention=r"utf16.txt is UTF-16 text \(it starts with a byte-order mark\), not UTF-8.*iconv -f utf-16")
    with read_only_folder(tmp_path / "ro") as real:
        if not real:
            pytest.skip("no read-only folder can be made here (root without the right to mount)")
        done = refused(base + ["--input-file", tmp_path / "prompts.txt",
                               "--output-file", tmp_path / "ro" / "out.jsonl"],
                       unchanged=[tmp_path], mention=r"--output-file .*ro/out.jsonl: its folder .*ro: cannot write "
                                                     r"there: (the file system is read-only|permission denied)\. "
                                                     r"Nothing was done")
        assert "[1/2]" not in done.stderr   # refused before the model generated anything


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    from megatron_id.commands.generate import read_prompts
    (tmp_path / "bom.txt").write_bytes("\ufeffThe water cycle\nRivers\n".encode("utf-8"))
    assert read_prompts(str(tmp_path / "bom.txt")) == ["The water cycle", "Rivers"]


@pytest.mark.slow
def test_eval_refuses_an_export_for_mqar_and_an_unwritable_out_before_scoring(export, tmp_path):
    from file_systems import read_only_folder
    refused([CLI, "eval", "mqar", "--checkpoint", export], unchanged=[export],
            mention=r"--checkpoint .*hf is a Hugging Face export: `eval mqar` needs the training checkpoint \(the "
                    r"train.save folder of a run with data.source=mqar")
    (tmp_path / "text.txt").write_text("The water cycle moves water between the oceans and the sky. " * 20)
    with read_only_folder(tmp_path / "ro") as real:
        if not real:
            pytest.skip("no read-only folder can be made here (root without the right to mount)")
        done = refused([CLI, "eval", "perplexity", "--checkpoint", export, "--text", tmp_path / "text.txt",
                        "--device", "cpu", "--out", tmp_path / "ro" / "results"], unchanged=[tmp_path],
                       mention=r"--out .*ro/results: cannot write there \(its folder .*ro\): (the file system is "
                               r"read-only|permission denied)")
        assert "eval perplexity: hf done" not in done.stderr   # before: refused after scoring every checkpoint


def test_a_checkpoint_path_that_holds_no_checkpoint_says_what_it_holds(tmp_path):
    from megatron_id.checkpoint.read import CheckpointNotFoundError, checkpoint_folder
    (tmp_path / "empty").mkdir()
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / ".lock").write_text("host 1")
    run = fake_run(tmp_path / "run" / "checkpoints")
    for tag in ("iter_0000001", "iter_0000002"):
        (run / tag / "client_state.pt").write_bytes(b"x")
    (tmp_path / "noLatest").mkdir()
    shutil.copytree(run / "iter_0000002", tmp_path / "noLatest" / "iter_0000002")
    for path, mention in [
            (tmp_path / "missing", r"checkpoint .*missing does not exist"),
            (tmp_path / "empty", r"empty is not a training checkpoint: it is empty: no checkpoint was saved there"),
            (tmp_path / "started", r"it holds no checkpoint yet \(only .lock: a run saves there, train.save, but none "
                                   r"was committed\)"),
            (tmp_path / "noLatest", r"it has iter_ folders but no `latest`: give one of them, e.g. .*noLatest/"
                                    r"iter_0000002"),
            (tmp_path / "run", r"run is not a training checkpoint: it has neither `latest` nor client_state.pt, but "
                               r"its subfolder .*run/checkpoints is one: give that")]:
        with pytest.raises(CheckpointNotFoundError, match=mention):
            checkpoint_folder(path)
    refused([CLI, "check-checkpoint", tmp_path / "missing"], mention=r"missing does not exist: give a train.save "
            r"folder", unchanged=[tmp_path])


@pytest.mark.slow
def test_a_tokenizer_file_replaced_at_the_same_path_is_named(tmp_path):
    """Before: 'the model of X was made with tokenizer A but the tokenizer X with B', which reads
    as two files. Now the message says the recorded file changed since the checkpoint."""
    from megatron_id.checkpoint.files import ClientState, model_config_dict
    from megatron_id.checkpoint.read import write_weights_only
    from megatron_id.data.tokenizer import identity_of_file
    from megatron_id.hf.export import write_folder
    from megatron_id.model.language_model import LanguageModel
    tokenizer = tmp_path / "tokenizer.json"
    shutil.copy(TOKENIZER, tokenizer)
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], ["model.vocab_size=50257"]).model
    client = ClientState(step=0, model=model_config_dict(cfg), weights_only=True, tokenizer=str(tokenizer),
                         tokenizer_id=identity_of_file(tokenizer), layout={"tensor": 1, "pipe": 1, "data": 1,
                                                                           "zero_stage": 0})
    shard = {k: v.detach().clone() for k, v in LanguageModel(cfg, seed=1).state_dict().items()}
    write_folder(tmp_path / "hf-ckpt", lambda staging: write_weights_only(staging, [shard], cfg, 1, client))
    table = json.loads(tokenizer.read_text())
    vocab = table["model"]["vocab"]
    vocab["water"], vocab["cycle"] = vocab["cycle"], vocab["water"]   # same size, other ids: another tokenizer
    tokenizer.write_text(json.dumps(table))
    refused([CLI, "generate", "--checkpoint", tmp_path / "hf-ckpt", "--prompt", "The water cycle"],
            unchanged=[tmp_path],
            mention=r"the tokenizer file .*tokenizer.json changed since the model of .*hf-ckpt recorded it \(replaced "
                    r"or edited at the same path\): the model of .* was made with tokenizer vocab:\w+ but the "
                    r"tokenizer file now holds tokenizer vocab:\w+.*Restore the original file")


@pytest.mark.slow
def test_completions_that_cannot_be_written_are_not_lost(export, tmp_path, capsys, monkeypatch):
    """A disk that fills while the prompts are generated: the completions go to stdout, and the
    error says so (before: one line about the OSError, every completion lost)."""
    import errno

    from megatron_id.cli import main
    (tmp_path / "prompts.txt").write_text("Rivers\nClouds\n")
    real = os.replace

    def replace(src, dst):
        if str(dst).endswith("out.jsonl"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    assert main(["generate", "--checkpoint", str(export), "--input-file", str(tmp_path / "prompts.txt"),
                 "--output-file", str(tmp_path / "out.jsonl"), "--max-new-tokens", "2"]) == 1
    captured = capsys.readouterr()
    assert [json.loads(line)["prompt"] for line in captured.out.splitlines()] == ["Rivers", "Clouds"]
    assert captured.err.strip().splitlines()[-1].endswith(
        "out.jsonl could not be written (No space left on device): the 2 completions were written to stdout "
        "instead. Free space there or write elsewhere.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.txt"]
