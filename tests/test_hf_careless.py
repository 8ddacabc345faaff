"""The careless battery, round 4 (issue 52): import-hf, export-hf, check-checkpoint and convert
given the folders a new user has at hand.

- Every tensor of a transformers folder is either imported or named in a refusal (hf/llama.py
  TransformersWeights.sources): Qwen2 weights under a config.json that says Llama or Mistral
  (whose q/k/v biases were dropped without a word, the logits 1.13 off), o_proj biases, layers
  beyond num_hidden_layers, a head that a tied config.json would leave unread; the same reader
  for train.distill.teacher. Sharded folders as transformers reads them: model.safetensors
  first, shards without their index, a shard holding a tensor its index does not name.
- The advice fits the folder's kind: a transformers folder without (or with a truncated)
  config.json, an export without one, a training checkpoint given to import-hf, a Hugging Face
  folder given to export-hf / convert; check-checkpoint of an export, of a transformers folder,
  of a step-0 checkpoint and of a run with older checkpoints."""
import json
import re
import shutil

import pytest
import torch
from conftest import CONFIGS
from safetensors.torch import load_file, save_file
from test_import_llama import hf_logits, max_error, our_logits, save_pretrained_model

from megatron_id.cli import main
from megatron_id.hf.export import NotAnExportError, import_hf
from megatron_id.hf.llama import UnsupportedModelError


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A tiny untied Qwen2 with grouped-query attention and q/k/v biases, saved by transformers
    with the GPT-2 tokenizer (one file), and the same model saved in shards with
    model.safetensors.index.json: (folder, sharded folder, the model)."""
    root = tmp_path_factory.mktemp("careless")
    model = save_pretrained_model(root / "qwen2", "qwen2-gqa")
    model.save_pretrained(root / "sharded", max_shard_size="5MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "qwen2" / name, root / "sharded" / name)
    return root / "qwen2", root / "sharded", model


def copy(source, folder, **fields):
    """`source` copied to `folder`, config.json's `fields` set (None: removed)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return folder


def edit_weights(folder, change, name="model.safetensors"):
    """`change(tensors)` applied to folder/`name` (a dict of tensors, changed in place)."""
    tensors = load_file(folder / name)
    change(tensors)
    save_file(tensors, folder / name, metadata={"format": "pt"})


def refuse(folder, tmp_path, pattern, error=UnsupportedModelError):
    """import_hf of `folder` is refused with `pattern`, on one line, and writes nothing."""
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(error, match=pattern) as err:
        import_hf(folder, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    return str(err.value)


def refuse_weights(folder, pattern):
    """The weights of `folder` refused, on one line, by the reader import-hf and
    train.distill.teacher share (import_hf calls it before writing anything: the CLI test below
    shows that; here without its tokenizer checks, which cost more than the reading)."""
    from megatron_id.hf.llama import TransformersWeights, transformers_config, transformers_model_config
    cfg = transformers_model_config(folder, transformers_config(folder))
    with pytest.raises(UnsupportedModelError, match=pattern) as err:
        TransformersWeights(folder).sources(cfg)
    assert "\n" not in str(err.value) and str(err.value).endswith("nothing was written.")


# ---------------------------------------------------------------- every tensor read or refused

@pytest.mark.parametrize("architecture, model_type, said", [
    ("LlamaForCausalLM", "llama", "LlamaForCausalLM without attention_bias"),
    ("MistralForCausalLM", "mistral", r"MistralForCausalLM \(its attention has no biases\)")])
def test_qwen2_weights_under_another_architecture_are_refused_naming_the_biases(qwen2, tmp_path, capsys,
                                                                                 architecture, model_type, said):
    """Before: imported with exit 0, the 6 bias tensors dropped (the export's logits 1.13 off)."""
    folder = copy(qwen2[0], tmp_path / "mislabelled", architectures=[architecture], model_type=model_type,
                  sliding_window=None)
    assert main(["import-hf", "--input", str(folder), "--output", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"megatron-id: error: {folder}/config.json says {said}, but model.safetensors holds "
                        r"model.layers.0.self_attn.q_proj.bias \(\+5 more\): the weights are of another architecture "
                        r"\(Qwen2\?\); if so, set architectures to \[\"Qwen2ForCausalLM\"\] and model_type to "
                        r"\"qwen2\" in config.json; nothing was written.", line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mislabelled"]


def test_a_mislabelled_teacher_is_refused_before_any_work(qwen2, tmp_path):
    """train.distill.teacher reads transformers folders with the same reader: refused by
    check_teacher (rank 0, before the run starts), not silently distilled from a teacher
    without its biases."""
    from megatron_id.config import load_config
    from megatron_id.training.distill import check_teacher
    folder = copy(qwen2[0], tmp_path / "mislabelled", architectures=["LlamaForCausalLM"], model_type="llama")
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], [f"train.distill.teacher={folder}", "model.vocab_size=50257",
                                                          "model.layer_pattern=IA"])
    with pytest.raises(UnsupportedModelError, match=r"says LlamaForCausalLM without attention_bias, but "
                       r"model.safetensors holds model.layers.0.self_attn.q_proj.bias \(\+5 more\)"):
        check_teacher(cfg, 1)


def _biases(projections: str, kv_width: int):
    """A change for edit_weights: biases on the `projections` (of "qkvo") of both layers."""
    def change(tensors):
        for i in range(2):
            for p in projections:
                tensors[f"model.layers.{i}.self_attn.{p}_proj.bias"] = 0.1 * torch.ones(kv_width if p in "kv" else 64)
    return change


def test_tensors_the_configured_model_has_no_place_for_are_refused(qwen2, tmp_path):
    """o_proj biases (a Llama with attention_bias=true), with or without q/k/v ones; layers
    beyond num_hidden_layers; and fewer layers than config.json says, by name."""
    folder = copy(qwen2[0], tmp_path / "llama-biased", architectures=["LlamaForCausalLM"], model_type="llama")
    edit_weights(folder, _biases("o", 32))
    refuse_weights(folder, r"says LlamaForCausalLM, but model.safetensors holds "
           r"model.layers.0.self_attn.o_proj.bias \(\+7 more\): biases on o_proj are those of a Llama with "
           r"attention_bias=true, which this import does not read")
    folder = copy(qwen2[0], tmp_path / "qwen2-o-bias")
    edit_weights(folder, _biases("o", 32))
    refuse_weights(folder, r"says Qwen2ForCausalLM, but model.safetensors holds model.layers.0.self_attn.o_proj.bias "
           r"\(\+1 more\): biases on o_proj")
    refuse_weights(copy(qwen2[0], tmp_path / "fewer", num_hidden_layers=1, layer_types=None),
           r"fewer/config.json says num_hidden_layers=1, but model.safetensors holds "
           r"model.layers.1.self_attn.q_proj.bias \(\+11 more\) \(layer 1\): the folder holds 2 layers; fix "
           r"num_hidden_layers in config.json")
    refuse_weights(copy(qwen2[0], tmp_path / "more", num_hidden_layers=3, layer_types=None),
           r"more/config.json says num_hidden_layers=3, but the weights of .*more hold 2 layers \(no "
           r"model.layers.2.\*\): fix num_hidden_layers in config.json")


def test_a_tied_config_with_a_head_of_its_own(qwen2, tmp_path):
    """tie_word_embeddings=true beside a separate lm_head.weight: a head unlike the embedding
    (which transformers keeps untied) is refused with the field to fix; an exact copy of the
    embedding is the tied head, and imported."""
    refuse_weights(copy(qwen2[0], tmp_path / "tied", tie_word_embeddings=True),
           r"tied/config.json says tie_word_embeddings=true, but model.safetensors holds lm_head.weight, which differs "
           r"from model.embed_tokens.weight \(transformers then leaves the head untied\): set tie_word_embeddings to "
           r"false in config.json")
    folder = copy(qwen2[0], tmp_path / "tied-copy", tie_word_embeddings=True)
    edit_weights(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    import_hf(folder, tmp_path / "ckpt")


def test_sharded_folders_are_read_as_transformers_reads_them(qwen2, tmp_path, capsys):
    """Shards without their index are named with the file to copy; a shard holding a tensor its
    index does not name is refused (it was dropped); with model.safetensors beside the shards,
    model.safetensors is read, as from_pretrained reads it (it read the shards), with a note."""
    from transformers import AutoModelForCausalLM
    _, sharded, model = qwen2
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.norm.weight"]
    folder = copy(sharded, tmp_path / "no-index")
    (folder / "model.safetensors.index.json").unlink()
    refuse_weights(folder, r"no-index has model-00001-of-0000\d.safetensors, .* but no model.safetensors.index.json, "
           r"which names the tensors each shard holds: copy model.safetensors.index.json from the model's hub page")
    folder = copy(sharded, tmp_path / "stray")
    edit_weights(folder, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.ones(64)}), shard)
    refuse_weights(folder, rf"{shard} holds model.layers.0.self_attn.o_proj.bias, but model.safetensors.index.json "
           r"does not name it: the index and the shards are of different saves")
    folder = copy(sharded, tmp_path / "both")
    merged = {}
    for name in sorted(set(index.values())):
        merged.update(load_file(folder / name))
    merged["model.norm.weight"] = merged["model.norm.weight"] * 2   # another save than the shards
    save_file(merged, folder / "model.safetensors", metadata={"format": "pt"})
    want = hf_logits(AutoModelForCausalLM.from_pretrained(folder).eval())
    assert max_error(want, hf_logits(model)) > 1e-2   # transformers read model.safetensors, not the shards
    capsys.readouterr()
    assert max_error(our_logits(import_hf(folder, tmp_path / "ckpt")), want) < 1e-4
    assert "holds both model.safetensors and model.safetensors.index.json (two saves): model.safetensors is read" \
        in capsys.readouterr().err


# ---------------------------------------------------------------- advice that fits the folder

@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny softmax export (tests/hf_tiny.py) and, beside it, the step-0 checkpoint it was
    exported from (`export`-ckpt)."""
    from hf_tiny import tiny_export
    return tiny_export(tmp_path_factory.mktemp("export") / "hf", "softmax")


def test_import_hf_advice_fits_the_folder(qwen2, export, tmp_path):
    """Before, each said 'Give a folder written by megatron-id export-hf'."""
    llama = qwen2[0]
    hub = r"copy config.json from the model's hub page \(Files\) into .*, or save the model again with save_pretrained"
    folder = copy(llama, tmp_path / "no-config")
    (folder / "config.json").unlink()
    message = refuse(folder, tmp_path, r"no-config has no config.json. It is a transformers model's folder \(it holds "
                     r".*model.safetensors, tokenizer.json.*\): config.json describes the model, and transformers' "
                     r"save_pretrained writes it beside the weights; " + hub, NotAnExportError)
    assert "export-hf" not in message
    folder = copy(llama, tmp_path / "truncated")
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[:len(text) // 2])
    refuse(folder, tmp_path, r"truncated/config.json is truncated or not valid JSON at line \d+ column \d+ \(.*\)\. It "
           r"is a transformers model's folder .*" + hub, NotAnExportError)
    folder = shutil.copytree(export, tmp_path / "export-without-config")
    (folder / "config.json").unlink()
    refuse(folder, tmp_path, r"has no config.json. It is an export of megatron-id \(it holds "
           r"configuration_megatron_id.py.*\): export the checkpoint again with megatron-id export-hf",
           NotAnExportError)
    ckpt = export.with_name("hf-ckpt")
    for given in (ckpt, ckpt / "iter_0000000"):
        refuse(given, tmp_path, rf"{given} is a training checkpoint \(it holds .*\), not a Hugging Face folder: it "
               rf"needs no import. Train from it with train.load={ckpt} \(it loads at any layout\)", NotAnExportError)


def test_a_hugging_face_folder_given_for_a_training_checkpoint_names_import_hf(qwen2, export, tmp_path, capsys):
    for command in (["export-hf", "--checkpoint", str(qwen2[0]), "--output", str(tmp_path / "hf")],
                    ["convert", "--checkpoint", str(export), "--layer-pattern", "IA", "--output", str(tmp_path / "c")]):
        assert main(command) == 2
        assert "it is a Hugging Face folder (it has config.json: an export, or a transformers model): megatron-id " \
               "import-hf reads it into a training checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def check(path, capsys) -> tuple[int, str]:
    status = main(["check-checkpoint", str(path)])
    return status, capsys.readouterr().err


def test_check_checkpoint_advice_fits_the_folder(qwen2, export, tmp_path, capsys):
    """An export: export again or restore the file (before: 'edit <parent>/latest', advice for
    training checkpoints); a transformers folder: what it is (before: 'an export without
    manifest.json'); a damaged step-0 checkpoint: write it again (before: 'resume from a whole
    one', of which there is none); a run with an older checkpoint: go back to that one."""
    folder = shutil.copytree(export, tmp_path / "hf")
    assert check(folder, capsys)[0] == 0
    (folder / "generation_config.json").write_text('{"do_sample": true}\n')
    status, err = check(folder, capsys)
    assert status == 2 and "generation_config.json has" in err and "latest" not in err and "older" not in err, err
    assert err.strip().splitlines()[-1] == (f"megatron-id: error: the export {folder} is damaged (listed above): "
                                            f"export the checkpoint again with megatron-id export-hf, or restore the "
                                            f"damaged files from a copy.")
    folder = shutil.copytree(export, tmp_path / "hf-notes")
    (folder / "notes.txt").write_text("mine")
    status, err = check(folder, capsys)
    assert status == 2 and err.strip().endswith("holds files export-hf did not write (listed above): move them out "
                                                "of it; its own files are whole."), err
    folder = shutil.copytree(export, tmp_path / "hf-manifest")
    (folder / "manifest.json").write_text("{")
    status, err = check(folder, capsys)
    assert status == 2 and "manifest.json is damaged: the export" in err and "latest" not in err, err
    status, err = check(qwen2[0], capsys)
    assert status == 2 and "is a transformers model's folder (Qwen2ForCausalLM), not written by megatron-id" in err, err
    # a step-0 checkpoint (import-hf and convert write only this one)
    ckpt = shutil.copytree(export.with_name("hf-ckpt"), tmp_path / "ckpt")
    shard = next((ckpt / "iter_0000000").glob("*model_states.pt"))
    shard.write_bytes(shard.read_bytes() + b"x")
    status, err = check(ckpt, capsys)
    assert status == 2 and "Use an older checkpoint" not in err and "writing its name" not in err, err
    assert "holds no other checkpoint to go back to; a step-0 checkpoint is written by import-hf, convert or a run's " \
           "step-0 save: write it again with that command" in err
    # a run whose latest is damaged and an older checkpoint beside it: go back to that one
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(export.with_name("hf-ckpt") / "iter_0000000", run / "iter_0000000")
    shutil.copytree(ckpt / "iter_0000000", run / "iter_0000001")
    (run / "latest").write_text("iter_0000001")
    status, err = check(run, capsys)
    assert status == 2 and "Use an older checkpoint" not in err, err
    assert err.strip().endswith(f"resume from an older one by writing its name into {run}/latest (check it first: "
                                f"megatron-id check-checkpoint {run / 'iter_0000000'}), or restore the damaged files "
                                f"from a copy."), err
