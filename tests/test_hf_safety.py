"""Hugging Face export / import / generate never lose data or write garbage silently (issue 10).

Every careless command is refused with one line naming the file or value and the fix, and
leaves every file it could have touched byte-identical with nothing added (`refused`, from
tests/bad_inputs.py); an earlier output is replaced only with --overwrite, only when it is ours,
and atomically. And the SSM parameters of an export stay float32 when it is loaded in bf16.
"""
import json
import os
import re
import shutil

import pytest
import torch

from bad_inputs import refused, snapshot
from conftest import CONFIGS
from distributed import run_distributed
from megatron_id.config import load_config
from test_hf import TOKENIZER, train_items

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
        mention = r"hf is not a megatron_id export: it has no config.json. Give a folder written by " \
                  r"megatron-id export-hf"
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
    from megatron_id.generation import check_options, generate_ids
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
    from megatron_id.hf.export import import_hf
    from megatron_id.checkpoint.files import read_client_state
    from megatron_id.checkpoint.integrity import verify_checkpoint
    out = import_hf(export, tmp_path / "imported", tensor_parallel=1)
    import_hf(export, out, tensor_parallel=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000000", "latest"]
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
    with pytest.raises(OSError, match="No space left"):
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
    with pytest.raises(OSError, match="No space left"):
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
