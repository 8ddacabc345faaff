"""`megatron-id convert` (issue 43): softmax layers -> interdomain / S4D-only layers initialised
from the attention they replace (model/convert.py, checkpoint/conversion.py, docs/conversion.md).
Tiny models (d 64, 4 heads): every test together takes a few seconds."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CONFIGS, ROOT

from megatron_id import cli
from megatron_id.checkpoint.conversion import convert
from megatron_id.checkpoint.files import ClientState, model_config_dict
from megatron_id.checkpoint.read import read_checkpoint, write_weights_only
from megatron_id.commands.import_hf import model_overrides
from megatron_id.commands.options import parse_with_overrides_anywhere
from megatron_id.config import load_config
from megatron_id.data.indexed_dataset import IndexedDatasetWriter
from megatron_id.errors import UserError
from megatron_id.hf.export import write_folder
from megatron_id.model.language_model import LanguageModel

# a Llama-like source: grouped-query attention (2 key/value heads for 4 query heads), Qwen2's
# q/k/v biases; three layers
SOURCE = ["model.mixer=softmax", "model.n_layers=3", "model.n_kv_heads=2", "model.qkv_bias=true"]


def _write(folder: Path, cfg, state: dict, tp: int = 1) -> Path:
    client = ClientState(step=7, model=model_config_dict(cfg), weights_only=True, tokenizer="/tok/tokenizer.json",
                         tokenizer_id="vocab:0123456789abcdef",
                         layout={"tensor": tp, "pipe": 1, "data": 1, "zero_stage": 0})
    shard = {k: v.detach().clone() for k, v in state.items()}
    return write_folder(folder, lambda staging: write_weights_only(staging, [shard], cfg, 1, client))


def _source(tmp_path, *items, name="source"):
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], [*SOURCE, *items]).model
    model = LanguageModel(cfg, seed=3)
    with torch.no_grad():   # biases that are not zero, so that dropping them is seen
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return _write(tmp_path / name, cfg, model.state_dict()), cfg, model


def _logits(cfg, state):
    model = LanguageModel(cfg, seed=None)
    model.load_state_dict(state)
    tokens = torch.arange(24).remainder(cfg.vocab_size)[None] * 7 % cfg.vocab_size
    with torch.no_grad():
        return model(tokens)


def test_an_all_softmax_pattern_is_the_identity(tmp_path):
    source, cfg, teacher = _source(tmp_path)
    done = convert(source, tmp_path / "out", "AAA")
    _, client, got_cfg, got = read_checkpoint(done.output)
    assert got_cfg == cfg and client.weights_only and client.step == 0
    want = teacher.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(_logits(got_cfg, got), _logits(cfg, want))
    assert client.tokenizer_id == "vocab:0123456789abcdef" and client.tokenizer == "/tok/tokenizer.json"
    assert client.conversion["layers"] == [] and client.conversion["source_step"] == 7


def test_converted_layers_carry_the_teacher_and_start_the_rest_fresh(tmp_path, capsys):
    """I (query readout) and S layers beside a kept A layer, through the command line: the
    reused projections and everything outside the converted mixers are the teacher's bits, every
    other tensor is LanguageModel(student, seed)'s init; the printed overrides give that model."""
    source, cfg, teacher = _source(tmp_path)
    out = tmp_path / "out"
    assert cli.main(["convert", "--checkpoint", str(source), "--output", str(out), "--layer-pattern", "IAS",
                     "--seed", "5", "model.state_size=8"]) == 0
    printed = capsys.readouterr().out
    _, client, student, got = read_checkpoint(out)
    assert student.layer_pattern == "IAS" and student.mixer.value == "hybrid" and student.state_size == 8
    assert student.n_kv_heads == 2 and student.qkv_bias   # the kept A layer's
    overrides = re.search(r"its model: (.*)", printed)[1].split()
    assert load_config([], overrides).model == student == load_config([], model_overrides(out).split()).model
    assert "k_proj.bias, q_proj.bias, v_proj.bias of layers 0, 2 are dropped" in printed
    fresh_model = LanguageModel(student, seed=5).state_dict()
    t = teacher.state_dict()
    layers = {layer["layer"]: layer for layer in client.conversion["layers"]}
    assert sorted(layers) == [0, 2] and client.conversion["pattern"] == "IAS"
    carried = {0: {"q_proj.weight": "q_proj.weight", "k_proj.weight": "k_proj.weight", "v_proj.weight": "v_proj.weight",
                   "o_proj.weight": "o_proj.weight"},
               2: {"a_proj.weight": "k_proj.weight", "b_proj.weight": "v_proj.weight"}}
    for name, tensor in got.items():
        i = int(name.split(".")[1]) if name.startswith("layers.") else None
        local = name.split(".mixer.")[-1]
        if i not in layers or ".mixer." not in name:
            assert torch.equal(tensor, t[name]), name                   # outside converted mixers: copied
        elif local in carried[i]:
            want = t[f"layers.{i}.mixer.{carried[i][local]}"]
            if local != "q_proj.weight" and local != "o_proj.weight":   # GQA: each kv head for its 2 query heads
                want = want.view(2, 16, 64).repeat_interleave(2, 0).reshape(64, 64)
            assert torch.equal(tensor, want), name
            assert layers[i]["carried"][local].startswith(carried[i][local])
        elif local == "o_proj.weight":   # S: the value half of each head's columns is the teacher's
            assert layers[i]["partial"] == {local: layers[i]["partial"][local]}
            w = tensor.view(64, 4, 2, 16)
            assert torch.equal(w[:, :, 1], t[f"layers.{i}.mixer.o_proj.weight"].view(64, 4, 16))
            assert torch.equal(w[:, :, 0], fresh_model[name].view(64, 4, 2, 16)[:, :, 0])
        else:
            assert local in layers[i]["fresh"] and torch.equal(tensor, fresh_model[name]), name
    assert set(layers[2]["dropped"]) == {"q_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias"}
    assert torch.isfinite(_logits(student, got)).all()


def test_gqa_key_and_value_heads_expand_to_their_query_heads(tmp_path):
    """Query head h reads kv head h // G (HF's repeat_kv): the converted layer's k_proj and
    v_proj rows of head h are the teacher's rows of that kv head; the contraction readout
    (model.query_readout=false) keeps no q_proj and the value half of W_O. Every layer converted."""
    source, cfg, teacher = _source(tmp_path)
    done = convert(source, tmp_path / "out", "III", overrides=["model.query_readout=false"])
    _, _, student, got = read_checkpoint(done.output)
    assert student.query_readout is False and "layers.0.mixer.q_proj.weight" not in got
    # no softmax layer left: no key/value heads or q/k/v biases in its config, and the printed
    # overrides make a valid training config of it
    assert student.layer_pattern == "III" and student.n_kv_heads is None and not student.qkv_bias
    assert load_config([], model_overrides(done.output).split()).model == student
    t = teacher.state_dict()
    for proj in ("k_proj", "v_proj"):
        kv = t[f"layers.2.mixer.{proj}.weight"].view(2, 16, 64)      # 2 key/value heads
        rows = got[f"layers.2.mixer.{proj}.weight"].view(4, 16, 64)  # 4 query heads
        for head in range(4):
            assert torch.equal(rows[head], kv[head // 2]), (proj, head)
    o = got["layers.0.mixer.o_proj.weight"].view(64, 4, 2, 16)[:, :, 1]
    assert torch.equal(o, t["layers.0.mixer.o_proj.weight"].view(64, 4, 16))


def test_a_tp2_pp2_conversion_reads_back_as_the_tp1_one(tmp_path):
    source, *_ = _source(tmp_path)
    one = convert(source, tmp_path / "tp1", "ISA", seed=9)
    two = convert(source, tmp_path / "tp2", "ISA", tensor_parallel=2, pipeline_parallel=3, seed=9)
    _, client, cfg2, got2 = read_checkpoint(two.output)
    _, _, cfg1, got1 = read_checkpoint(one.output)
    assert client.layout["tensor"] == 2 and client.layout["pipe"] == 3 and cfg1 == cfg2
    assert list(got1) == list(got2) and all(torch.equal(got1[k], got2[k]) for k in got1)


def _dataset(tmp_path, vocab=512, tokens=4096):
    prefix = tmp_path / "data" / "text_document"
    generator = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16, vocab_size=vocab) as w:
        for length in (700, 1, 1500, 1895):   # documents of several lengths: windows cross them
            w.add(generator.integers(0, vocab, length))
    return str(prefix)


def test_select_keeps_the_layer_of_sharpest_attention(tmp_path, capsys):
    """Layer 1's queries scaled by 1000: its attention is near one-hot (normalised entropy ~0,
    the others ~1), so --select 1 keeps it as A and converts the rest; the scores are
    deterministic and recorded."""
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], SOURCE).model
    teacher = LanguageModel(cfg, seed=3)
    with torch.no_grad():
        teacher.layers[1].mixer.q_proj.weight.mul_(1000)
    source = _write(tmp_path / "source", cfg, teacher.state_dict())
    data = _dataset(tmp_path)
    assert cli.main(["convert", "--checkpoint", str(source), "--output", str(tmp_path / "a"), "--select", "1",
                     "--data-path", data, "--select-samples", "3", "--select-seq-length", "64"]) == 0
    printed = capsys.readouterr().out
    again = convert(source, tmp_path / "b", select=1, data_path=data, select_samples=3, select_seq_length=64,
                    log=lambda text: None)
    _, client, student, _ = read_checkpoint(tmp_path / "a")
    record = client.conversion["select"]
    assert student.layer_pattern == "IAI" and record["kept"] == [1] and record["pattern"] == "IAI"
    assert record == again.record["select"]
    entropy = [s["entropy"] for s in record["scores"]]
    assert entropy[1] < 0.2 < 0.8 < min(entropy[0], entropy[2]), entropy
    assert re.search(r"^\s+1\s+0\.\d+\s+\S+\s+A\s+\(kept", printed, re.M) and "pattern IAI" in printed


@pytest.fixture
def refusal_source(tmp_path):
    return _source(tmp_path)[0]


@pytest.mark.parametrize("kwargs,match", [
    (dict(layer_pattern="IIAI"), "has 4 layers but .* model.n_layers=3"),
    (dict(layer_pattern="IXA"), "has 'X': the letters are"),
    (dict(layer_pattern="IWA"), "layer 1 is A in the source but W here"),
    (dict(layer_pattern="I||A"), "every pipeline stage needs at least one layer"),
    (dict(), "give --layer-pattern"),
    (dict(layer_pattern="IIA", tensor_parallel=3), "not divisible by tensor parallel size 3"),
    (dict(layer_pattern="IIA", overrides=["model.d_model=32"]), "model.d_model is the source model's"),
    (dict(layer_pattern="III", overrides=["model.query_readout=maybe"]), "is invalid"),
    (dict(layer_pattern="SSS", overrides=["model.query_readout=true"]), "contradicts model.mixer=s4d"),
    (dict(select=1), "give --data-path"),
    (dict(layer_pattern="IIA", data_path="x"), "--data-path is read by --select only"),
    (dict(select=1, layer_pattern="IAI", data_path="x"), "picks the softmax layers itself"),
    (dict(select=4, data_path="x"), "between 0 and 3"),
    (dict(select=1, data_path="/nonexistent/prefix"), "nonexistent"),
])
def test_refusals_name_the_value_and_write_nothing(tmp_path, refusal_source, kwargs, match):
    with pytest.raises(UserError, match=match):
        convert(refusal_source, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_refusals_of_the_source_and_the_output(tmp_path, refusal_source):
    hybrid = load_config([CONFIGS / "model" / "tiny.yaml"], ["model.layer_pattern=IA"]).model
    other = _write(tmp_path / "hybrid", hybrid, LanguageModel(hybrid, seed=1).state_dict())
    with pytest.raises(UserError, match=r"not a softmax model .*layer 0 \(interdomain\)"):
        convert(other, tmp_path / "out", "IA")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty and is not an earlier conversion"):
        convert(refusal_source, theirs, "IIA")
    assert (theirs / "notes.txt").read_text() == "mine"
    with pytest.raises(UserError, match="inside it"):
        convert(refusal_source, refusal_source / "converted", "IIA")
    done = convert(refusal_source, tmp_path / "ours", "IIA")   # an earlier conversion: --overwrite replaces it
    with pytest.raises(UserError, match="Add --overwrite"):
        convert(refusal_source, done.output, "IIA")
    assert convert(refusal_source, done.output, "AIA", overwrite=True).record["pattern"] == "AIA"


def test_the_documented_convert_commands_parse():
    text = (ROOT / "docs" / "conversion.md").read_text()
    lines = [shlex.split(line) for line in re.sub(r"\\\n", " ", text).splitlines()
             if line.startswith("megatron-id convert ")]
    assert len(lines) >= 2
    for argv in lines:
        args = parse_with_overrides_anywhere(cli.build_parser(), argv[1:])
        assert args.func.__module__ == "megatron_id.commands.convert"
