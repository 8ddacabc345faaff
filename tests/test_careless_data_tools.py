"""Careless inputs to the data tools get clear refusals (issue 26).

Each refusal is one line naming the file or value and the fix, with a non-zero exit, no
traceback, and nothing changed on disk (`refused`, tests/bad_inputs.py); where refusing would
be wrong, the run goes on and a warning or note line says what was dropped, with a count.
  - preprocess records the tokenizer's identity in the sidecar; old sidecars still read;
  - merge refuses datasets of different tokenizers (by identity, else by vocabulary size)
    unless --allow-tokenizer-mismatch, an input given twice, and an output that is an input;
  - inspect --tokenizer refuses a tokenizer other than the one the sidecar records;
  - preprocess reads a file reached twice once, never reads its own outputs or tokenizer and
    config files in an input folder, refuses a repeated --json-keys key, accepts a UTF-8 BOM;
  - train_tokenizer says when the corpus gave fewer tokens than --vocab-size asked.
Issue 52 (round 4):
  - ids at or above the tokenizer's size (data.tokenizer, inspect --tokenizer, the sidecar's) are
    refused whatever model.vocab_size says, the likely causes first; merge refuses an input whose
    ids reach the recorded vocabulary; a vocab.json given as a tokenizer.json is named so;
  - a file in Latin-1/cp1252 is refused with the iconv line (--skip-non-utf8 to skip its lines);
    UTF-16, a .gz that is not gzip, and JSON arrays that cannot be read are refused before any
    work; UTF-8 marks inside a file (joined with cat) are not bad documents;
  - an --output-prefix ending in _text_document, and a data path naming a .jsonl, a folder or the
    sidecar, get the prefix meant.
"""
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from bad_inputs import refused, run_module
from conftest import ROOT

from data_tools import inspect as inspect_tool
from data_tools import train_tokenizer as train_tool
from data_tools.preprocess import main as preprocess_main
from megatron_id.data.indexed_dataset import IndexedDataset, check_token_ids, meta_path, read_meta
from megatron_id.data.tokenizer import dataset_tokenizer, identity_of_file, load_tokenizer, tokenizer_identity

DATA = ROOT / "tests" / "data"
FINEWEB = DATA / "fineweb-edu-sample-150.jsonl"
GPT2 = DATA / "gpt2-tokenizer.json"
SHAKESPEARE = DATA / "tinyshakespeare-200k.txt"
PRE, MERGE, INSPECT = "data_tools.preprocess", "data_tools.merge", "data_tools.inspect"
EXTS = (".bin", ".idx", ".meta.json")
ID = r"vocab:[0-9a-f]{16}"


def rows(n):
    return [json.loads(line) for line in open(FINEWEB, encoding="utf-8")][:n]


def jsonl_bytes(items) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in items)


def preprocess_args(inputs, out, tokenizer=GPT2, *extra):
    return ["--input", *map(str, inputs), "--tokenizer", str(tokenizer), "--output-prefix", str(out),
            "--append-eod", "--no-progress", *extra]


def preprocess(inputs, out, tokenizer=GPT2, *extra) -> Path:
    assert preprocess_main(preprocess_args(inputs, out, tokenizer, *extra)) == 0
    return Path(f"{out}_text_document")


def copy_pair(source: Path, folder: Path, name="copy_text_document", drop_identity=False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for ext in EXTS:
        shutil.copyfile(f"{source}{ext}", folder / f"{name}{ext}")
    if drop_identity:   # a sidecar written before identities were recorded
        meta = json.loads(meta_path(folder / name).read_text())
        del meta["tokenizer_id"]
        meta_path(folder / name).write_text(json.dumps(meta, indent=1) + "\n")
    return folder / name


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Five documents preprocessed with GPT-2 and with a tiny byte-level BPE trained here (same
    uint16 dtype, other ids), and that tiny tokenizer."""
    folder = tmp_path_factory.mktemp("careless")
    docs = folder / "docs.jsonl"
    docs.write_bytes(jsonl_bytes(rows(5)))
    tiny = folder / "tiny" / "tokenizer.json"
    tiny.parent.mkdir()
    train_tool.train([SHAKESPEARE], 300).save(str(tiny))
    return {"folder": folder, "docs": docs, "tiny": tiny,
            "gpt2": preprocess([docs], folder / "pairs" / "gpt2"),
            "small": preprocess([docs], folder / "pairs" / "small", tiny)}


# ------------------------------------------------------------------ 1. the identity in the sidecar

def test_preprocess_records_the_tokenizer_identity_and_old_sidecars_still_read(data, tmp_path):
    gpt2, small = read_meta(data["gpt2"]), read_meta(data["small"])
    own = tokenizer_identity(load_tokenizer(str(GPT2)))
    assert re.fullmatch(ID, own) and gpt2["tokenizer_id"] == own == identity_of_file(GPT2)
    assert (gpt2["tokenizer"], gpt2["eod_id"], gpt2["vocab_size"]) == (str(GPT2.resolve()), 50256, 50257)
    assert small["tokenizer_id"] == identity_of_file(data["tiny"]) != own
    assert small["vocab_size"] == 300 and small["dtype"] == gpt2["dtype"] == "uint16"
    assert dataset_tokenizer(data["gpt2"]) == (own, str(GPT2.resolve()))
    # a sidecar without the key (written before identities were recorded) takes the identity of
    # the tokenizer file it names; when that file is gone too, the identity is unknown
    old = copy_pair(data["gpt2"], tmp_path, drop_identity=True)
    assert dataset_tokenizer(old) == (own, str(GPT2.resolve()))
    meta = json.loads(meta_path(old).read_text())
    moved = copy_pair(data["gpt2"], tmp_path / "moved", drop_identity=True)
    meta["tokenizer"] = str(tmp_path / "no-such" / "tokenizer.json")
    meta_path(moved).write_text(json.dumps(meta, indent=1) + "\n")
    assert dataset_tokenizer(moved) == (None, meta["tokenizer"])
    assert check_token_ids(old, 50257)["source"] == "sidecar"
    assert inspect_tool.main([str(old), "--check", "--tokenizer", str(GPT2), "--doc", "0"]) == 0


# ------------------------------------------------------------------ 2. merge: one tokenizer

def test_merge_refuses_datasets_of_different_tokenizers_unless_allowed(data, tmp_path):
    out = tmp_path / "out" / "merged"
    refused([MERGE, out, data["gpt2"], data["small"]], unchanged=[tmp_path, data["folder"]],
            mention=rf"merge: error: input .*gpt2_text_document was made with tokenizer {ID} \(.*gpt2-tokenizer"
                    rf"\.json\) but input .*small_text_document with tokenizer {ID} \(.*tiny/tokenizer\.json\): "
                    rf"their token ids mean different tokens\. Merge only .* --allow-tokenizer-mismatch")
    assert not (tmp_path / "out").exists()
    # sidecars without identities: told apart by their vocabulary sizes
    old_gpt2 = copy_pair(data["gpt2"], tmp_path / "old", "gpt2", drop_identity=True)
    old_small = copy_pair(data["small"], tmp_path / "old", "small", drop_identity=True)
    refused([MERGE, out, old_gpt2, old_small], unchanged=[tmp_path],
            mention=r"input .*old/gpt2 was made with tokenizer of 50,257 tokens .* but input .*old/small with "
                    r"tokenizer of 300 tokens .*--allow-tokenizer-mismatch")
    # on purpose: a warning, and the merged sidecar records no tokenizer
    done = run_module(MERGE, [out, data["gpt2"], data["small"], "--allow-tokenizer-mismatch"])
    assert done.returncode == 0, done.stderr
    assert re.search(r"merge: warning: input .* was made with tokenizer .* \(mixed on purpose: allowed\)", done.stderr)
    meta = read_meta(out)
    assert (meta["tokenizer"], meta["tokenizer_id"], meta["num_documents"]) == (None, None, 10)
    # the same tokenizer (a copy of the GPT-2 pair, an old sidecar of it): kept in the merged sidecar
    same = copy_pair(data["gpt2"], tmp_path / "same")
    done = run_module(MERGE, [tmp_path / "agreed", data["gpt2"], same, old_gpt2])
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
    meta, gpt2 = read_meta(tmp_path / "agreed"), read_meta(data["gpt2"])
    assert (meta["tokenizer"], meta["eod_id"], meta["vocab_size"]) == (gpt2["tokenizer"], 50256, 50257)
    assert meta["tokenizer_id"] is None   # one input does not record it
    done = run_module(MERGE, [tmp_path / "agreed2", data["gpt2"], same])
    assert done.returncode == 0, done.stderr
    assert read_meta(tmp_path / "agreed2")["tokenizer_id"] == gpt2["tokenizer_id"]


# ------------------------------------------------------------------ 3. merge: inputs and output

def test_merge_refuses_an_input_given_twice_and_an_output_that_is_an_input(data, tmp_path):
    pair = copy_pair(data["gpt2"], tmp_path / "data", "corpus_text_document")
    other = copy_pair(data["gpt2"], tmp_path / "data", "other_text_document")
    refused([MERGE, tmp_path / "merged", pair, other, pair], unchanged=[tmp_path],
            mention=r"input .*corpus_text_document is given twice: its 5 documents would be written twice\. "
                    r"Name each dataset once")
    # the same dataset spelled two ways (without _text_document, through a symlinked folder)
    os.symlink(tmp_path / "data", tmp_path / "link")
    refused([MERGE, tmp_path / "merged", tmp_path / "data" / "corpus", tmp_path / "link" / "corpus_text_document.bin"],
            unchanged=[tmp_path],
            mention=r"is given twice \(as .*data/corpus and as .*link/corpus_text_document\.bin\)")
    # the output is one of the inputs: refused even with --overwrite (it would replace what it reads)
    for output in (pair, tmp_path / "link" / "corpus_text_document"):
        refused([MERGE, output, other, pair, "--overwrite"], unchanged=[tmp_path],
                mention=r"output prefix .*corpus_text_document is the input .*corpus_text_document: .*--overwrite "
                        r"or not; nothing was written\. Choose another output prefix")


# ------------------------------------------------------------------ 4. inspect --tokenizer

def test_inspect_refuses_a_tokenizer_other_than_the_recorded_one(data, capsys):
    refused([INSPECT, data["gpt2"], "--tokenizer", data["tiny"], "--doc", "0"], unchanged=[data["folder"]],
            mention=rf"inspect: error: dataset .*gpt2_text_document was made with tokenizer {ID} \(.*gpt2-tokenizer"
                    rf"\.json\) but --tokenizer .*tiny/tokenizer\.json with tokenizer {ID}: .*Pass the tokenizer the "
                    rf"data was preprocessed with \(--tokenizer .*gpt2-tokenizer\.json\), "
                    rf"or --allow-tokenizer-mismatch")
    text = rows(1)[0]["text"]
    assert inspect_tool.main([str(data["gpt2"]), "--tokenizer", str(GPT2), "--doc", "0"]) == 0
    out, err = capsys.readouterr()
    assert text in out and "warning" not in err
    assert inspect_tool.main([str(data["gpt2"]), "--tokenizer", str(data["tiny"]), "--doc", "0",
                              "--allow-tokenizer-mismatch"]) == 0
    out, err = capsys.readouterr()
    assert "inspect: warning: dataset" in err and "(mixed on purpose: allowed)" in err and text not in out


# ------------------------------------------------------------------ 5. preprocess inputs

def test_a_file_reached_twice_is_read_once_with_a_counted_note(data, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(jsonl_bytes(rows(3)))
    (folder / "b.jsonl").write_bytes(jsonl_bytes(rows(5)[3:]))
    os.symlink(folder / "a.jsonl", tmp_path / "alias.jsonl")
    once = preprocess([folder / "a.jsonl", folder / "b.jsonl"], tmp_path / "once")
    capsys.readouterr()
    twice = preprocess([folder / "a.jsonl", folder / "a.jsonl", f"{folder}/*.jsonl", tmp_path / "alias.jsonl",
                        folder], tmp_path / "twice")
    err = capsys.readouterr().err
    assert "documents read: 5" in err and "documents written: 5" in err, err
    assert re.search(r"preprocess: note: 5 duplicate inputs dropped, each file is read once: .*a\.jsonl "
                     r"\(given 5 times\), .*b\.jsonl \(given 2 times\)", err), err
    assert "note: 5 duplicate inputs dropped" in err.strip().splitlines()[-1]   # repeated at the end
    for ext in (".bin", ".idx"):
        assert Path(f"{once}{ext}").read_bytes() == Path(f"{twice}{ext}").read_bytes()


def test_outputs_and_tokenizer_files_in_the_input_folder_are_not_read(data, tmp_path, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "docs.jsonl").write_bytes(jsonl_bytes(rows(4)))
    shutil.copyfile(data["tiny"], folder / "tokenizer.json")
    (folder / "settings.json").write_text(json.dumps({"text": "not a document", "lr": 3e-4}, indent=2))
    first = preprocess([folder], folder / "out")
    err = capsys.readouterr().err
    assert "documents read: 4" in err and "documents skipped: 0" in err, err
    assert re.search(r"note: 2 files in the input folders or globs skipped, not documents: .*settings\.json "
                     r"\(one pretty-printed JSON object, not JSON lines\), .*tokenizer\.json \(a tokenizer or "
                     r"model config file\)", err), err
    # the next run into the same folder does not ingest the first run's outputs (nor by a glob)
    second = preprocess([folder], folder / "again")
    err = capsys.readouterr().err
    assert "documents read: 4" in err and "note: 3 files" in err and "out_text_document.meta.json (a dataset " \
        "sidecar)" in err, err
    third = preprocess([f"{folder}/*.json*"], tmp_path / "glob")
    err = capsys.readouterr().err
    assert "documents read: 4" in err and "note: 4 files" in err, err
    for ext in (".bin", ".idx"):
        assert Path(f"{first}{ext}").read_bytes() == Path(f"{second}{ext}").read_bytes() == \
            Path(f"{third}{ext}").read_bytes()
    # a glob that reaches only such files is refused, naming them
    refused([PRE, *preprocess_args([f"{folder}/*.json"], tmp_path / "new" / "out")], unchanged=[tmp_path],
            mention=r"input '.*corpus/\*\.json' holds no document file: only .*again_text_document\.meta\.json "
                    r"\(a dataset sidecar\), .*Name the data files")


def test_a_repeated_json_key_is_refused_before_any_work(data, tmp_path):
    refused([PRE, *preprocess_args([data["docs"]], tmp_path / "new" / "out", GPT2, "--json-keys", "text", "id",
                                   "text")], unchanged=[tmp_path, data["folder"]],
            mention=r"preprocess: error: --json-keys text id text: the key 'text' is given 2 times, but each key "
                    r"makes its own dataset \(.*new/out_text_document\): name each key once\.")
    assert not (tmp_path / "new").exists()


def test_a_utf8_byte_order_mark_is_not_a_malformed_document(data, tmp_path, capsys):
    bom = b"\xef\xbb\xbf"
    items = rows(3)
    (tmp_path / "bom.jsonl").write_bytes(bom + jsonl_bytes(items))
    (tmp_path / "bom_array.json").write_bytes(bom + json.dumps(items).encode())
    prefix = preprocess([tmp_path / "bom.jsonl", tmp_path / "bom_array.json"], tmp_path / "out")
    err = capsys.readouterr().err
    assert "documents written: 6" in err and "documents skipped: 0" in err, err
    plain = preprocess([data["docs"]], tmp_path / "plain")
    ds, ref = IndexedDataset(prefix), IndexedDataset(plain)
    for i in range(3):   # the same ids as without the mark: it is not text
        assert np.array_equal(ds[i], ref[i]) and np.array_equal(ds[3 + i], ref[i])


# ------------------------------------------------------------------ 6. train_tokenizer

def test_train_tokenizer_says_when_it_got_fewer_tokens_than_asked(tmp_path, capsys):
    corpus = tmp_path / "small.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat on the log\n" * 20)
    assert train_tool.main(["--input", str(corpus), "--vocab-size", "70000", "--output",
                            str(tmp_path / "tok.json")]) == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    found = re.fullmatch(r"train_tokenizer: warning: --vocab-size 70,000 asked, (\d+) obtained: the corpus is too "
                         r"small \(920 characters in 1 file\).*Train on more text, or lower --vocab-size.*", last)
    assert found, last
    assert int(found[1]) == load_tokenizer(str(tmp_path / "tok.json")).get_vocab_size() < 300
    # a vocabulary the corpus can fill: no warning
    assert train_tool.main(["--input", str(corpus), "--vocab-size", "260", "--output", str(tmp_path / "ok.json")]) == 0
    assert "warning" not in capsys.readouterr().err


# ----------------------------------------------------------------- issue 41 group C: output prefixes that name a folder
# `--output-prefix dir/` wrote dir/_text_document.bin/.idx and `merge dir/ ...` a hidden dir/.bin: a prefix is
# a path plus the start of file names (Megatron's), so a folder, ".", "" or a name ending in .bin/.idx is refused
# before any work with the prefix that was most likely meant.

@pytest.mark.parametrize("given, mention", [
    ("{out}/", r"--output-prefix '.*/out/' names a folder, not a prefix: .* e\.g\. --output-prefix .*/out/fineweb "
               r"writes .*/out/fineweb_text_document\.bin/\.idx\."),
    ("{out}/.", r"--output-prefix '.*/out/\.' names a folder, not a prefix"),
    ("", r"--output-prefix '' is empty: .* e\.g\. --output-prefix fineweb writes fineweb_text_document\.bin/\.idx\."),
    ("{out}/corpus.bin", r"--output-prefix '.*/out/corpus\.bin' ends in \.bin: the prefix has no extension; "
                         r"e\.g\. --output-prefix .*/out/corpus writes"),
])
def test_preprocess_refuses_an_output_prefix_that_names_a_folder(data, tmp_path, given, mention):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    refused([PRE, *preprocess_args([data["docs"]], given.format(out=tmp_path / "out"))], mention=mention,
            unchanged=[tmp_path], cwd=tmp_path)
    assert not list(tmp_path.glob("**/*_text_document*")) and not list(tmp_path.glob("**/.bin"))
    refused(["megatron_id.cli", "preprocess", *preprocess_args([data["docs"]], f"{tmp_path / 'out'}/")],
            mention=r"--output-prefix '.*/out/' names a folder", unchanged=[tmp_path])


def test_merge_refuses_an_output_prefix_that_names_a_folder(data, tmp_path):
    pair = copy_pair(data["gpt2"], tmp_path / "data", "corpus_text_document")
    for given, mention in ((f"{tmp_path / 'data'}/", r"output prefix '.*/data/' names a folder, not a prefix: .* "
                                                      r"e\.g\. output prefix .*/data/merged writes "
                                                      r".*/data/merged\.bin/\.idx\."),
                           (f"{tmp_path / 'data'}/.", r"output prefix '.*/data/\.' names a folder"),
                           (str(tmp_path / "merged.idx"), r"output prefix '.*/merged\.idx' ends in \.idx: "
                                                          r"the prefix has "
                                                          r"no extension; e\.g\. output prefix .*/merged writes")):
        refused([MERGE, given, pair], mention=mention, unchanged=[tmp_path])
    assert not (tmp_path / "data" / ".bin").exists()
    done = run_module(MERGE, [tmp_path / "data" / "merged", pair])   # the prefix it suggested works
    assert done.returncode == 0 and (tmp_path / "data" / "merged.bin").is_file(), done.stderr


# ----------------------------------------------------------------- issue 52: ids the tokenizer cannot make
# A Megatron-made .bin (no sidecar) with every 50th id overwritten by 60000 was refused with "set
# model.vocab_size to at least 60001" first; doing so trained and saved with exit 0, although
# data.tokenizer (GPT-2, 50,257 tokens) cannot produce id 60000. Ids at or above the tokenizer's
# size are now refused whatever model.vocab_size is, with the likely causes first.

def _damaged_megatron_made(data, folder: Path) -> Path:
    prefix = copy_pair(data["gpt2"], folder, "mega_text_document")
    meta_path(prefix).unlink()   # Megatron's tools write no sidecar
    ids = np.memmap(f"{prefix}.bin", dtype=np.uint16, mode="r+")
    ids[::50] = 60000
    ids.flush()
    del ids
    return prefix


def _check_run(prefix, tmp_path, *overrides):
    from megatron_id.config import load_config
    from megatron_id.training.engine import check_run
    from megatron_id.training.layout import training_layout
    cfg = load_config([ROOT / "configs" / "model" / "tiny.yaml"], [
        f"data.data_path=[{prefix}]", f"data.index_cache_dir={tmp_path / 'cache'}", "train.check_host_memory=false",
        *overrides])
    return check_run(cfg, training_layout(cfg, 1), on_gpu=False)


def test_ids_the_tokenizer_cannot_make_are_refused_whatever_model_vocab_size(data, tmp_path, capsys):
    from megatron_id.data.gpt_dataset import DataConfigError
    prefix = _damaged_megatron_made(data, tmp_path)
    impossible = (r"mega_text_document\.bin holds token ids that data\.tokenizer=.*gpt2-tokenizer\.json cannot "
                  r"produce: it has 50,257 tokens \(ids 0\.\.50,256\), and [\d,]+ of its [\d,]+ ids \(1 in 50; values "
                  r"60,000 only\) are 50,257 or more, the first in document 0, token 0\. Either the data was made "
                  r"with another tokenizer: set data\.tokenizer to the tokenizer that made it, or preprocess the text "
                  r"again .*; or the \.bin is damaged: .*A larger model\.vocab_size would not help")
    # GPT-2's padded table (50304) and the advice the old message gave first (60001): both refused
    for vocab in (50304, 60001):
        with pytest.raises(DataConfigError, match=impossible) as err:
            _check_run(prefix, tmp_path, f"data.tokenizer={GPT2}", f"model.vocab_size={vocab}")
        assert "set model.vocab_size to at least" not in str(err.value)
    # no tokenizer known (no data.tokenizer, no sidecar): raising model.vocab_size is offered, last,
    # with the caveat
    with pytest.raises(DataConfigError, match=r"holds token id 60000 but model\.vocab_size=50304: [\d,]+ of its .* No "
                                              r"tokenizer is known .*data\.tokenizer is not given.*either the data "
                                              r"was made with a tokenizer of more than 50,304 tokens, then set "
                                              r"data\.tokenizer to it.*or the \.bin is damaged.*Set model\.vocab_size "
                                              r"to at least 60001 .* only when the tokenizer that made the data has "
                                              r"that many tokens"):
        _check_run(prefix, tmp_path, "model.vocab_size=50304")
    # inspect --check --tokenizer applies the same rule (it passed before: no --vocab-size given)
    capsys.readouterr()
    assert inspect_tool.main([str(prefix), "--check", "--tokenizer", str(GPT2)]) == 1
    assert re.search(r"inspect: error: .*mega_text_document\.bin holds token ids that --tokenizer "
                     r".*gpt2-tokenizer\.json cannot produce: .*set --tokenizer to the tokenizer that made it",
                     capsys.readouterr().err)
    # --doc decodes what it can and says which ids the tokenizer left out (it said nothing)
    assert inspect_tool.main([str(prefix), "--doc", "0", "--tokenizer", str(GPT2)]) == 0
    assert re.search(r"inspect: warning: document 0 holds \d+ ids that --tokenizer .* \(50,257 tokens\) cannot decode "
                     r"\(60000\): left out of the text above", capsys.readouterr().err)
    # the data as preprocessed (no damage) passes with the padded table
    clean = copy_pair(data["gpt2"], tmp_path / "clean", "clean_text_document")
    meta_path(clean).unlink()
    assert _check_run(clean, tmp_path, f"data.tokenizer={GPT2}", "model.vocab_size=50304")[2].vocab_size == 50257


def test_merge_refuses_an_input_whose_ids_reach_the_recorded_vocabulary(data, tmp_path, capsys):
    """It merged with exit 0 and a sidecar recording vocab_size 50257 beside max_token_id 60000."""
    from data_tools.merge import main as merge_main
    damaged = _damaged_megatron_made(data, tmp_path)
    out = tmp_path / "out" / "merged"
    assert merge_main([str(out), str(data["gpt2"]), str(damaged)]) == 2
    assert re.search(r"merge: error: input .*mega_text_document holds token id 60,000, but the sidecar of "
                     r".*gpt2_text_document records a tokenizer of 50,257 tokens \(it has no sidecar\): its ids are "
                     r"another tokenizer's, or it is damaged\. Nothing was written\.", capsys.readouterr().err)
    assert not (tmp_path / "out").exists()
    assert merge_main([str(out), str(data["gpt2"]), str(damaged), "--allow-tokenizer-mismatch"]) == 0
    assert "(mixed on purpose: allowed; the merged sidecar records no vocabulary" in capsys.readouterr().err
    assert (read_meta(out)["vocab_size"], read_meta(out)["max_token_id"]) == (None, 60000)


def test_a_vocab_json_given_as_data_tokenizer_is_named_with_the_way_to_a_tokenizer_json(data, tmp_path):
    from megatron_id.data.tokenizer import TokenizerError
    spec = json.loads(GPT2.read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = ["#version: 0.2"] + [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("\n".join(merges) + "\n")
    for name, kind in (("vocab.json", r"a GPT-2 style vocab\.json \(token -> id, 50,257 tokens\)"),
                       ("merges.txt", r"a GPT-2 style merges\.txt")):
        with pytest.raises(TokenizerError, match=rf"data\.tokenizer=.*{name}: .* is not a valid HF tokenizer\.json: "
                                                 rf"it is {kind}.*load_tokenizer\(vocab_file="):
            _check_run(data["gpt2"], tmp_path, f"data.tokenizer={tmp_path / name}", "model.vocab_size=50304")


# ----------------------------------------------------------------- issue 52: inputs in another encoding
# A Latin-1 .jsonl lost its accented lines as "3 not UTF-8" with exit 0 and no hint.

ACCENTED = ["Le café est très bon à Zürich.", "A plain line about the water cycle.", "Señor Muñoz visitó la ciudad.",
            "Another plain line.", "naïve façade, déjà vu"]


def accented_jsonl(texts=ACCENTED) -> str:
    return "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)


def test_a_latin1_jsonl_is_refused_with_the_iconv_line_and_nothing_written(data, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    latin1 = tmp_path / "in" / "docs.jsonl"
    latin1.write_bytes(accented_jsonl().encode("latin-1"))   # what iconv -f utf-8 -t latin1 writes
    out = tmp_path / "out" / "docs"
    assert preprocess_main(preprocess_args([latin1, data["docs"]], out)) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"preprocess: error: input .*in/docs\.jsonl: 3 of its 5 lines are not UTF-8 but documents in "
                        r"another encoding \(the first at line 1\), and skipping them would drop every document with "
                        r"an accented letter: nothing was written\. It reads as Latin-1 \(ISO-8859-1\) text \('Le "
                        r"café est très bon à Zürich\.' read that way\)\. Convert it: iconv -f latin1 -t utf-8 "
                        r".*in/docs\.jsonl > .*in/docs\.utf8\.jsonl, and give .*docs\.utf8\.jsonl to --input .*; or "
                        r"give --skip-non-utf8 to skip such lines \(counted\)\.", last), last
    assert not (tmp_path / "out").exists()
    # cp1252 (Windows quotes): named so, with -f cp1252; --strict says the same at the first line
    windows = tmp_path / "in" / "quotes.jsonl"
    windows.write_bytes(accented_jsonl(["He said \u201cmerci\u201d \u2013 très bien."]).encode("cp1252"))
    assert preprocess_main(preprocess_args([windows], out, GPT2, "--strict")) == 2
    assert re.search(r"quotes\.jsonl:1: not UTF-8: it reads as Windows-1252 \(cp1252.*\) text \('He said “merci” – "
                     r"très bien\.' .*iconv -f cp1252 -t utf-8 .*\(run without --strict", capsys.readouterr().err)
    # on purpose: skipped and counted, with the conversion in a note
    assert preprocess_main(preprocess_args([latin1], out, GPT2, "--skip-non-utf8")) == 0
    err = capsys.readouterr().err
    assert "documents skipped: 3: 3 not UTF-8" in err and re.search(
        r"note: input .*docs\.jsonl: 3 of its 5 lines .* skipped and counted as not UTF-8\. To keep them: it reads as "
        r"Latin-1 .*iconv -f latin1", err), err
    # a stray line in a large file (1 in 2,000) is damage: skipped with the note, not refused
    big = tmp_path / "in" / "big.jsonl"
    big.write_bytes(accented_jsonl(["plain line %d" % i for i in range(1999)]).encode() +
                    accented_jsonl(["un café"]).encode("latin-1"))
    assert preprocess_main(preprocess_args([big], tmp_path / "big")) == 0
    err = capsys.readouterr().err
    assert "documents written: 1,999" in err and "big.jsonl: 1 of its 2,000 lines is not UTF-8" in err, err
    # the line it gives restores the UTF-8 original
    if shutil.which("iconv"):
        assert os.system(f"iconv -f latin1 -t utf-8 {latin1} > {tmp_path / 'in' / 'docs.utf8.jsonl'}") == 0
        assert (tmp_path / "in" / "docs.utf8.jsonl").read_text(encoding="utf-8") == accented_jsonl()


@pytest.mark.parametrize("name, content, mention", [
    ("utf16.jsonl", accented_jsonl().encode("utf-16"),
     r"utf16\.jsonl is UTF-16 text \(it starts with a byte-order mark\), not UTF-8: .*iconv -f utf-16 -t utf-8"),
    ("utf16le.jsonl", accented_jsonl().encode("utf-16-le"),
     r"utf16le\.jsonl holds zero bytes \(UTF-16 text without a byte-order mark\?\).*iconv -f utf-16le -t utf-8"),
    ("plain.jsonl.gz", accented_jsonl().encode(),
     r"plain\.jsonl\.gz is named \.gz but is not gzip-compressed \(it starts with b'\{\"': plain JSON text\)\. "
     r"Rename it to what it is \(e\.g\. plain\.jsonl\)"),
    ("array.json", json.dumps([{"text": t} for t in ACCENTED], ensure_ascii=False).encode("latin-1"),
     r"array\.json is a JSON array that is not UTF-8 .*none of its documents can be read: it reads as Latin-1"),
    ("cut.json", json.dumps([{"text": t} for t in ACCENTED]).encode()[:-30],
     r"cut\.json starts a JSON array but is not valid JSON .*none of its documents can be read"),
])
def test_inputs_that_would_lose_a_whole_file_are_refused_before_any_work(data, tmp_path, capsys, name, content,
                                                                         mention):
    """Each lost all its documents while the run, with another good input, ended with exit 0."""
    (tmp_path / name).write_bytes(content)
    assert preprocess_main(preprocess_args([tmp_path / name, data["docs"]], tmp_path / "out" / "x")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(mention, last), last
    assert not (tmp_path / "out").exists()


def test_utf8_marks_inside_a_file_joined_with_cat_are_not_malformed_documents(data, tmp_path, capsys):
    bom = b"\xef\xbb\xbf"
    items = rows(4)
    (tmp_path / "joined.jsonl").write_bytes(bom + jsonl_bytes(items[:2]) + bom + jsonl_bytes(items[2:]))
    prefix = preprocess([tmp_path / "joined.jsonl"], tmp_path / "out")
    err = capsys.readouterr().err
    assert "documents written: 4" in err and "documents skipped: 0" in err, err
    assert np.array_equal(IndexedDataset(prefix)[2], IndexedDataset(data["gpt2"])[2])


def test_a_data_path_naming_a_document_file_a_folder_or_the_sidecar(data, tmp_path):
    """data.data_path given the .jsonl itself (not preprocessed), the folder of the datasets, or
    the sidecar's path: the first two said only "looked for X.jsonl.bin", the third was refused."""
    from megatron_id.data.gpt_dataset import DataConfigError, check_data
    with pytest.raises(DataConfigError, match=r"It is a document file, not a preprocessed dataset: tokenize it first, "
                                              r"e\.g\. python -m data_tools\.preprocess --input .*docs\.jsonl "
                                              r"--tokenizer tokenizer\.json --output-prefix .*/docs --append-eod, then "
                                              r"pass .*/docs_text_document\."):
        check_data(str(data["docs"]), "100,0,0", 64, 50257)
    with pytest.raises(DataConfigError, match=r"It is a folder: name one of its datasets \(.*gpt2_text_document, "
                                              r".*small_text_document\), or blend them"):
        check_data(str(data["gpt2"].parent), "100,0,0", 64, 50257)
    check_data(f"{data['gpt2']}.meta.json", "100,0,0", 64, 50257)



def test_an_output_prefix_ending_in_text_document_is_refused_and_training_names_the_doubled_files(data, tmp_path):
    """`--output-prefix data/x_text_document` wrote data/x_text_document_text_document.bin, and
    data.data_path=data/x_text_document then said only that it looked for x_text_document.bin."""
    from megatron_id.data.gpt_dataset import DataConfigError, check_data
    refused([PRE, *preprocess_args([data["docs"]], tmp_path / "out" / "x_text_document")], unchanged=[tmp_path],
            mention=r"--output-prefix '.*out/x_text_document' ends in _text_document, which preprocessing appends "
                    r".*it would write .*x_text_document_text_document\.bin/\.idx\. Give --output-prefix .*out/x: it "
                    r"writes .*out/x_text_document\.bin/\.idx")
    copy_pair(data["gpt2"], tmp_path / "made", "x_text_document_text_document")   # as it was written before
    with pytest.raises(DataConfigError, match=r"x_text_document_text_document\.bin exists: the data was preprocessed "
                                              r"with an --output-prefix that already ended in _text_document\. Pass "
                                              r".*x_text_document_text_document, or rename"):
        check_data(str(tmp_path / "made" / "x_text_document"), "100,0,0", 64, 50257)


def test_train_tokenizer_counts_the_json_lines_it_skips(tmp_path, capsys):
    """Lines that gave no text (here Latin-1) were dropped without a word."""
    corpus = tmp_path / "mixed.jsonl"
    corpus.write_bytes(accented_jsonl(["the cat sat on the mat"] * 30).encode() + accented_jsonl().encode("latin-1"))
    assert train_tool.main(["--input", str(corpus), "--vocab-size", "260", "--output", str(tmp_path / "t.json")]) == 0
    assert "train_tokenizer: note: 3 JSON lines skipped: 3 not UTF-8" in capsys.readouterr().err
