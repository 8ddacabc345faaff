"""Preprocessing as Megatron-LM and GPT-NeoX users type it (issue 13): their documented command
lines run unchanged, every flag of their preprocess scripts is accepted (with a note when it
changes nothing here) or refused with a reason, the two GPT-2 tokenizer routes give the same
bytes, Megatron's documents (empty, whitespace-only, lists of sentences) come out byte-identical
to Megatron's own tool, and the tiktoken backend gives the bytes of `tokenizers`."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from bad_inputs import refused, run_module
from conftest import ROOT

from data_tools.preprocess import main as preprocess_main
from megatron_id.data.indexed_dataset import IndexedDataset

DATA = ROOT / "tests" / "data"
FINEWEB = DATA / "fineweb-edu-sample-150.jsonl"
GPT2 = DATA / "gpt2-tokenizer.json"
NEOX = DATA / "gpt-neox-20b-tokenizer.json"
MEGATRON = ROOT.parent / "shared" / "bench" / "megatron-lm"   # Megatron-LM's own tool, offline
PRE = "data_tools.preprocess"

# Megatron's kinds of documents beside ordinary ones: empty, whitespace-only, split-sentence
# lists (with an empty sentence and an empty list), a literal end-of-text token inside a text
TRICKY_ROWS = [{"text": ""}, {"text": "   \n "}, {"text": ["First sentence.", "", " Second one <|endoftext|> x"]},
               {"text": []}, {"text": "Tail <|endoftext|>"}]


def gpt2_vocab_and_merges(folder: Path) -> tuple[Path, Path]:
    """GPT-2's vocab.json and merges.txt, written from the tokenizer.json (the files Megatron's
    and NeoX's READMEs download as gpt2-vocab.json / gpt2-merges.txt)."""
    model = json.loads(GPT2.read_text())["model"]
    vocab, merges = folder / "gpt2-vocab.json", folder / "gpt2-merges.txt"
    vocab.write_text(json.dumps(model["vocab"]))
    lines = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    merges.write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    return vocab, merges


def corpus(path: Path, extra_rows=()) -> Path:
    rows = [json.loads(line) for line in open(FINEWEB, encoding="utf-8")]
    rows = rows[:40] + list(extra_rows) + rows[40:]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pair_bytes(prefix) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tokenizer.json route on the corpus with the tricky rows, by the reference encoder
    (tokenizers): (folder, prefix)."""
    folder = tmp_path_factory.mktemp("reference")
    source = corpus(folder / "corpus.jsonl", TRICKY_ROWS)
    done = run_module(PRE, ["--input", source, "--tokenizer", GPT2, "--output-prefix", folder / "ref",
                            "--append-eod", "--no-progress", "--tokenizer-backend", "tokenizers"])
    assert done.returncode == 0, done.stderr
    return folder, folder / "ref_text_document"


# ---------------------------------------------------------------- the documented command lines

def test_documented_megatron_and_neox_command_lines_run_unchanged(tmp_path, reference):
    """Megatron-LM's README (GPT data), its older form (Megatron-DeepSpeed, --vocab and
    --dataset-impl), GPT-NeoX's README (a .jsonl.zst, --vocab abbreviated), NeoX's HFTokenizer
    form and Megatron's HuggingFaceTokenizer form: the arguments as documented, only the paths
    local. Every run writes what the tokenizer.json route writes, byte for byte (literal
    "<|endoftext|>" in a document included: 50256 on both GPT-2 routes)."""
    import zstandard
    _, ref = reference
    gpt2_vocab_and_merges(tmp_path)
    corpus(tmp_path / "my-corpus.json", TRICKY_ROWS)
    (tmp_path / "data").mkdir()
    shutil.copy(tmp_path / "gpt2-vocab.json", tmp_path / "data" / "gpt2-vocab.json")
    (tmp_path / "data" / "mydataset.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress((tmp_path / "my-corpus.json").read_bytes()))
    (tmp_path / "20B_checkpoints").mkdir()
    shutil.copy(GPT2, tmp_path / "20B_checkpoints" / "20B_tokenizer.json")
    (tmp_path / "hf").mkdir()
    shutil.copy(GPT2, tmp_path / "hf" / "tokenizer.json")
    command_lines = {
        "my-gpt2": "--input my-corpus.json --output-prefix my-gpt2 --vocab-file gpt2-vocab.json "
                   "--tokenizer-type GPT2BPETokenizer --merge-file gpt2-merges.txt --append-eod",
        "old/my-gpt2": "--input my-corpus.json --output-prefix old/my-gpt2 --vocab gpt2-vocab.json "
                       "--dataset-impl mmap --tokenizer-type GPT2BPETokenizer --merge-file gpt2-merges.txt "
                       "--append-eod --workers 8",
        "data/mydataset": "--input ./data/mydataset.jsonl.zst --output-prefix ./data/mydataset "
                          "--vocab ./data/gpt2-vocab.json --merge-file gpt2-merges.txt --dataset-impl mmap "
                          "--tokenizer-type GPT2BPETokenizer --append-eod",
        "neox-hf": "--input my-corpus.json --output-prefix neox-hf --tokenizer-type HFTokenizer "
                   "--vocab-file ./20B_checkpoints/20B_tokenizer.json --append-eod --workers 2 --log-interval 100",
        "megatron-hf": "--input my-corpus.json --output-prefix megatron-hf --tokenizer-type HuggingFaceTokenizer "
                       "--tokenizer-model hf --append-eod --workers 2",
    }
    for prefix, line in command_lines.items():
        done = run_module(PRE, line.split(), cwd=tmp_path)
        assert done.returncode == 0, (line, done.stderr)
        assert pair_bytes(tmp_path / f"{prefix}_text_document") == pair_bytes(ref), line
    # the comma-separated --input of NeoX: two files, in order
    half = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    lines = (tmp_path / "my-corpus.json").read_text().splitlines(keepends=True)
    half[0].write_text("".join(lines[:20]))
    half[1].write_text("".join(lines[20:]))
    done = run_module(PRE, ["--input", "a.jsonl,b.jsonl", "--output-prefix", "commas", "--tokenizer-type",
                            "HFTokenizer", "--vocab-file", GPT2, "--append-eod"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert pair_bytes(tmp_path / "commas_text_document") == pair_bytes(ref)


# ---------------------------------------------------------------- every flag of their scripts

# GPT-NeoX tools/datasets/preprocess_data.py (EleutherAI/gpt-neox a76d767), every flag
NEOX_FLAGS = ["--input", "--jsonl-keys", "--num-docs", "--tokenizer-type", "--vocab-file", "--merge-file",
              "--append-eod", "--ftfy", "--output-prefix", "--dataset-impl", "--workers", "--log-interval"]
# flags this tool implements (tested by the other tests here and in test_data_tools.py)
IMPLEMENTED = {"--input", "--json-keys", "--jsonl-keys", "--output-prefix", "--workers", "--partitions",
               "--append-eod", "--log-interval", "--tokenizer-type", "--tokenizer-model", "--vocab-file",
               "--merge-file", "--vocab-size", "--null-tokenizer-eod-id", "--ftfy"}
VALUES = {"--lang": ["english"], "--workers-to-check": ["16", "32"], "--max-documents": ["100"],
          "--padded-vocab-size": ["50304"], "--vocab-extra-ids": ["100"], "--tokenizer-metadata": ["meta.json"],
          "--tokenizer-special-tokens": ["<a>", "<b>"], "--tiktoken-pattern": ["v2"],
          "--tiktoken-num-special-tokens": ["1000"], "--tokenizer-sentencepiece-ignore-extra-whitespaces": ["False"],
          "--null-tokenizer-pad-id": ["-1"], "--chat-template": ["template.jinja"], "--num-docs": ["150"],
          "--dataset-impl": ["lazy"]}
REFUSED = {"--split-sentences", "--find-optimal-num-workers", "--vocab-extra-ids", "--tokenizer-special-tokens",
           "--dataset-impl"}


def megatron_flags() -> list[str]:
    """Every flag Megatron-LM's tools/preprocess_data.py parses (its own and TokenizerConfig's),
    read from the copy of the tool in ../shared/bench/megatron-lm."""
    sources = [MEGATRON / "tools" / "preprocess_data.py", MEGATRON / "megatron" / "training" / "arguments.py"]
    if not all(p.is_file() for p in sources):
        pytest.skip(f"Megatron-LM's preprocess tool is not at {MEGATRON} (the shared folder beside the project)")
    flags = []
    for p in sources:
        flags += re.findall(r"add_argument\(\s*['\"](--[\w-]+)['\"]", p.read_text())
    assert len(flags) > 30, flags
    return sorted(set(flags))


def test_every_megatron_and_neox_flag_is_accepted_or_refused_with_a_reason(tmp_path, capsys):
    flags = sorted(set(megatron_flags()) | set(NEOX_FLAGS))
    base = ["--input", str(FINEWEB), "--tokenizer", str(GPT2), "--append-eod", "--no-progress"]
    reference = tmp_path / "plain"
    assert preprocess_main([*base, "--output-prefix", str(reference)]) == 0
    capsys.readouterr()
    seen = {}
    for i, flag in enumerate(f for f in flags if f not in IMPLEMENTED):
        out = tmp_path / f"run{i}"
        code = preprocess_main([*base, "--output-prefix", str(out), flag, *VALUES.get(flag, [])])
        err = capsys.readouterr().err
        assert "unrecognized arguments" not in err, (flag, err)
        if flag in REFUSED:
            last = err.strip().splitlines()[-1]
            assert code == 2 and flag in last and "not supported here: " in last, (flag, err)
            assert len(last.split("not supported here: ")[1]) > 40, last   # a reason, not a word
            assert not list(tmp_path.glob(f"run{i}*")), flag   # refused before any work
        else:   # accepted: a note naming the flag, said before the work and again in the summary
            assert code == 0, (flag, err)
            assert err.count(f"{flag}") >= 2 and re.search(re.escape(flag) + r".* has no effect here: .{30,}", err), err
            assert pair_bytes(f"{out}_text_document") == pair_bytes(f"{reference}_text_document"), flag
        seen[flag] = code
    assert set(seen) | IMPLEMENTED >= set(flags)
    print(f"{len(flags)} flags: {sum(c == 0 for c in seen.values())} accepted with a note, "
          f"{sum(c == 2 for c in seen.values())} refused with a reason, {len(IMPLEMENTED & set(flags))} implemented")


def test_lang_is_megatrons_splitter_language_not_a_filter(tmp_path, capsys):
    rows = [{"text": t, "language": "en"} for t in ("One document.", "Another one.")]
    source = tmp_path / "lang.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = preprocess_main(["--input", str(source), "--tokenizer", str(GPT2), "--output-prefix",
                            str(tmp_path / "out"), "--lang", "english", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0 and "documents written: 2" in err and "--lang english has no effect here" in err
    assert len(IndexedDataset(tmp_path / "out_text_document")) == 2


def test_partitions_above_the_number_of_files_say_so(tmp_path, capsys):
    code = preprocess_main(["--input", str(FINEWEB), "--tokenizer", str(GPT2), "--output-prefix",
                            str(tmp_path / "p"), "--partitions", "4", "--no-progress", "--append-eod"])
    err = capsys.readouterr().err
    assert code == 0 and "--partitions 4: 1 input file, so 1 partition" in err


@pytest.mark.parametrize("argv, mention", [
    (["--tokenizer-type", "GPT3Tokenizer"], r"invalid choice: 'GPT3Tokenizer'"),
    (["--tokenizer-type", "BertWordPieceCase", "--vocab-file", "bert-vocab.txt"],
     r"BertWordPieceCase: not supported here: a WordPiece tokenizer for BERT-style models"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], r"needs --tokenizer-model: a tokenizer\.json or a folder"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2/base"], r"looks like a hub name"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(GPT2)],
     r"is a HF tokenizer\.json: pass --tokenizer-type HFTokenizer"),
    (["--tokenizer-type", "GPT2BPETokenizer"], r"needs --vocab-file vocab\.json and --merge-file merges\.txt"),
    (["--tokenizer-type", "NullTokenizer"], r"NullTokenizer reads ids written as text .* needs --vocab-size"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "x.json"],
     r"TikTokenizer: not supported here: .*--tokenizer-backend tiktoken"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "{tmp}/sp.model"],
     r"SentencePiece \.model files are not read here\. Convert it"),
    (["--tokenizer", str(GPT2), "--vocab-file", "v.json", "--merge-file", "m.txt"], r"two tokenizers given"),
    (["--split-sentences", "--tokenizer", str(GPT2)], r"--split-sentences: not supported here: sentence splitting"),
    (["--tokenizer", str(GPT2), "--log-interval", "0"], r"--log-interval 0: must be at least 1"),
    (["--tokenizer", str(GPT2), "--tokenizer-cache-mib", "-1"], r"--tokenizer-cache-mib -1: must be 0 or more"),
])
def test_tokenizer_and_flag_mistakes_are_refused_before_any_work(tmp_path, argv, mention):
    (tmp_path / "sp.model").write_bytes(b"\x0a\x0bnot really")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out = tmp_path / "out"
    out.mkdir()
    refused([PRE, "--input", FINEWEB, "--output-prefix", out / "x", *argv], mention=mention, unchanged=[out])


# ---------------------------------------------------------------- Megatron's documents

@pytest.mark.slow
def test_megatrons_documents_byte_identical_to_megatrons_own_tool(tmp_path):
    """Megatron-LM's tools/preprocess_data.py (the copy in ../shared/bench, run offline) and this
    tool with --keep-empty on the same corpus: FineWeb-Edu documents with an empty text, a
    whitespace-only text, sentence lists (with an empty sentence, and an empty list) and a
    literal <|endoftext|> among them; identical .bin and .idx. Megatron's NullTokenizer too."""
    megatron_flags()   # skips with the reason when the copy is absent
    source = corpus(tmp_path / "corpus.jsonl", TRICKY_ROWS)
    (tmp_path / "hf").mkdir()
    shutil.copy(GPT2, tmp_path / "hf" / "tokenizer.json")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    env = {**os.environ, "PYTHONPATH": str(MEGATRON), "HF_HUB_OFFLINE": "1"}

    def megatron(*args):
        done = subprocess.run([sys.executable, str(MEGATRON / "tools" / "preprocess_data.py"), *map(str, args)],
                              env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-3000:]

    megatron("--input", source, "--output-prefix", "megatron", "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", "hf", "--append-eod", "--workers", "2")
    ours = run_module(PRE, ["--input", source, "--output-prefix", "ours", "--tokenizer-type", "HuggingFaceTokenizer",
                            "--tokenizer-model", "hf", "--append-eod", "--workers", "2", "--keep-empty"], cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    assert "empty documents written (--keep-empty, as Megatron's preprocess_data.py writes them): 2" in ours.stderr
    assert pair_bytes(tmp_path / "ours_text_document") == pair_bytes(tmp_path / "megatron_text_document")
    ds = IndexedDataset(tmp_path / "ours_text_document")
    assert len(ds.document_index) == 150 + len(TRICKY_ROWS) + 1 and len(ds) == 150 + 4   # 2 empty, 1 of 2 sequences
    # without --keep-empty: the empty and whitespace-only rows are skipped and counted
    plain = run_module(PRE, ["--input", source, "--output-prefix", "plain", "--tokenizer", GPT2, "--append-eod"],
                       cwd=tmp_path)
    assert plain.returncode == 0 and "documents skipped: 3: 3 empty document" in plain.stderr, plain.stderr
    # Megatron's NullTokenizer: ids as text
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"text": "3 1 4 1 5"}\n{"text": ["9 2", "6"]}\n{"text": "99"}\n')
    megatron("--input", ids, "--output-prefix", "null-megatron", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "100", "--append-eod", "--workers", "1")
    ours = run_module(PRE, ["--input", ids, "--output-prefix", "null-ours", "--tokenizer-type", "NullTokenizer",
                            "--vocab-size", "100", "--append-eod"], cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr
    assert pair_bytes(tmp_path / "null-ours_text_document") == pair_bytes(tmp_path / "null-megatron_text_document")
    assert IndexedDataset(tmp_path / "null-ours_text_document")[0].tolist() == [3, 1, 4, 1, 5, 99]


def test_keep_empty_documents_and_aligned_keys(tmp_path, capsys):
    """Two --json-keys: a row whose second key is empty is skipped in both datasets by default
    (they stay aligned, one row per document), and written as an empty document of that key
    with --keep-empty; a run of only empty documents is an error, not an empty dataset."""
    rows = [{"a": "first a", "b": "first b"}, {"a": "second a", "b": ""}, {"a": "third a", "b": ["x", "y"]}]
    source = tmp_path / "two.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--input", str(source), "--tokenizer", str(GPT2), "--json-keys", "a", "b", "--no-progress"]
    assert preprocess_main([*common, "--output-prefix", str(tmp_path / "skip")]) == 0
    assert "1 empty after tokenization" in capsys.readouterr().err
    a, b = (IndexedDataset(tmp_path / f"skip_{k}_document") for k in "ab")
    assert len(a.document_index) == len(b.document_index) == 3   # two documents each
    assert len(a) == 2 and len(b) == 3                            # b's list: two sequences
    assert preprocess_main([*common, "--output-prefix", str(tmp_path / "keep"), "--keep-empty"]) == 0
    a, b = (IndexedDataset(tmp_path / f"keep_{k}_document") for k in "ab")
    assert a.document_index.tolist() == [0, 1, 2, 3] and b.document_index.tolist() == [0, 1, 1, 3]
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": []}\n')
    out = tmp_path / "none"
    code = preprocess_main(["--input", str(empty), "--tokenizer", str(GPT2), "--output-prefix", str(out),
                            "--keep-empty", "--no-progress"])
    assert code == 2 and "all 2 documents kept by --keep-empty are empty" in capsys.readouterr().err
    assert not list(tmp_path.glob("none*"))


def test_ftfy_and_log_interval(tmp_path, capfd, monkeypatch):
    pytest.importorskip("ftfy", reason="ftfy is in the test extra: pip install -e '.[test]'")
    import data_tools.preprocess as pre
    source = tmp_path / "mojibake.jsonl"
    source.write_text(json.dumps({"text": "sch\u00c3\u00b6n"}) + "\n" + json.dumps({"text": "sch\u00f6n"}) + "\n")
    assert pre.main(["--input", str(source), "--tokenizer", str(GPT2), "--output-prefix", str(tmp_path / "f"),
                     "--ftfy", "--no-progress"]) == 0
    ds = IndexedDataset(tmp_path / "f_text_document")
    assert ds[0].tolist() == ds[1].tolist()   # repaired to the same text
    capfd.readouterr()
    monkeypatch.setattr(pre, "BATCH_CHARS", 20_000)   # several batches: a line each time 50 more are done
    assert pre.main(["--input", str(FINEWEB), "--tokenizer", str(GPT2), "--output-prefix", str(tmp_path / "l"),
                     "--log-interval", "50"]) == 0
    lines = [x for x in capfd.readouterr().err.splitlines() if "docs (" in x]
    done = [int(x.split(" docs")[0].replace(",", "")) for x in lines]
    assert len(done) == 3 and [d // 50 for d in done] == [1, 2, 3], lines


# ---------------------------------------------------------------- the tiktoken backend

def test_tiktoken_backend_writes_the_bytes_of_tokenizers(tmp_path, capsys, monkeypatch, reference):
    """On the corpus with the tricky rows (and with every document cut into pieces), the
    tiktoken backend's output equals the tokenizers backend's byte for byte. A tokenizer
    tiktoken cannot run exactly (a normalizer; a merge left out, which tiktoken would still
    apply) falls back to tokenizers with a note, and the bytes are still the reference's."""
    pytest.importorskip("tiktoken", reason="tiktoken is in the test extra: pip install -e '.[test]'")
    import data_tools.preprocess as pre
    folder, ref = reference
    source = folder / "corpus.jsonl"
    common = ["--input", str(source), "--append-eod", "--no-progress", "--workers", "2"]
    assert pre.main([*common, "--tokenizer", str(GPT2), "--output-prefix", str(tmp_path / "tt"),
                     "--tokenizer-backend", "tiktoken"]) == 0
    assert "encoder: tiktoken (checked against tokenizers" in capsys.readouterr().err
    assert pair_bytes(tmp_path / "tt_text_document") == pair_bytes(ref)
    monkeypatch.setattr(pre, "BATCH_CHARS", 30_000)   # tiktoken from the second batch on ...
    monkeypatch.setattr(pre, "PIECE_CHARS", 500)      # ... and cutting pieces itself
    assert pre.main([*common, "--tokenizer", str(GPT2), "--output-prefix", str(tmp_path / "cut"),
                     "--tokenizer-backend", "tiktoken"]) == 0
    assert "encoder: tiktoken" in capsys.readouterr().err
    assert pair_bytes(tmp_path / "cut_text_document") == pair_bytes(ref)
    monkeypatch.undo()

    spec = json.loads(GPT2.read_text())
    spec["normalizer"] = {"type": "NFC"}   # the same ids on this text, but not tiktoken's algorithm
    (tmp_path / "nfc.json").write_text(json.dumps(spec))
    assert pre.main([*common, "--tokenizer", str(tmp_path / "nfc.json"), "--output-prefix", str(tmp_path / "nfc"),
                     "--tokenizer-backend", "tiktoken"]) == 0
    err = capsys.readouterr().err
    assert "--tokenizer-backend tiktoken not used: it has a normalizer" in err
    assert pair_bytes(tmp_path / "nfc_text_document") == pair_bytes(ref)

    # a merge left out of the tokenizer: tokenizers never forms that token, tiktoken does (it
    # merges by the vocabulary alone); found on the probe text, or (probe emptied) on the first batch
    spec = json.loads(GPT2.read_text())
    merges = spec["model"]["merges"]
    spec["model"]["merges"] = [m for m in merges if (m if isinstance(m, str) else " ".join(m)) != "Ġ t"]
    assert len(spec["model"]["merges"]) == len(merges) - 1
    (tmp_path / "holed.json").write_text(json.dumps(spec))
    for probe, where in ((pre.PROBE_TEXT, "on the probe text"), ("", "on the first batch of the corpus")):
        monkeypatch.setattr(pre, "PROBE_TEXT", probe)
        out = tmp_path / f"holed{len(probe)}"
        assert pre.main([*common, "--tokenizer", str(tmp_path / "holed.json"), "--output-prefix", str(out),
                         "--tokenizer-backend", "tiktoken"]) == 0
        err = capsys.readouterr().err
        assert f"tiktoken not used: it gave other ids than tokenizers {where}" in err, err
        plain = tmp_path / f"plain{len(probe)}"
        assert pre.main([*common, "--tokenizer", str(tmp_path / "holed.json"), "--output-prefix", str(plain)]) == 0
        assert pair_bytes(f"{out}_text_document") == pair_bytes(f"{plain}_text_document")
    assert not np.array_equal(IndexedDataset(f"{plain}_text_document")._bin, IndexedDataset(ref)._bin)


# ---------------------------------------------------------------- the gigatoken backend

WIDE_ROWS = [{"text": "Café naïve façade, e\u0301 Ελληνικά Русский 日本語の文章 한국어 😀👍🏽"},
             {"text": "\t\n  \r\n"}, {"text": "<|endoftext|>"}, {"text": "a<|endoftext|><|endoftext|>b  "}]


@pytest.mark.parametrize("keep_empty", [False, True], ids=["skip-empty", "keep-empty"])
def test_gigatoken_backend_writes_the_bytes_of_tokenizers_and_is_the_default(tmp_path, capsys, monkeypatch,
                                                                               keep_empty):
    """gigatoken (--tokenizer-backend auto, the default when installed; and by name) writes what
    tokenizers writes, byte for byte, on the corpus with the tricky rows plus non-ASCII,
    whitespace-only and <|endoftext|>-only documents, whole and cut into pieces, with
    --keep-empty and without; on the GPT-2 and the NeoX tokenizer."""
    pytest.importorskip("gigatoken", reason="gigatoken is in the test extra: pip install -e '.[test]'")
    import data_tools.preprocess as pre
    source = corpus(tmp_path / "corpus.jsonl", TRICKY_ROWS + WIDE_ROWS)
    for tokenizer in (GPT2, NEOX):
        common = ["--input", str(source), "--tokenizer", str(tokenizer), "--append-eod", "--no-progress",
                  "--workers", "2", *(["--keep-empty"] if keep_empty else [])]
        assert pre.main([*common, "--output-prefix", str(tmp_path / "ref"), "--tokenizer-backend", "tokenizers",
                         "--overwrite"]) == 0
        assert "encoder:" not in capsys.readouterr().err
        ref = pair_bytes(tmp_path / "ref_text_document")
        for backend in ("auto", "gigatoken"):
            assert pre.main([*common, "--output-prefix", str(tmp_path / backend), "--overwrite",
                             *(["--tokenizer-backend", backend] if backend != "auto" else [])]) == 0
            assert "encoder: gigatoken (checked against tokenizers" in capsys.readouterr().err, backend
            assert pair_bytes(tmp_path / f"{backend}_text_document") == ref, (tokenizer.name, backend)
        monkeypatch.setattr(pre, "BATCH_CHARS", 30_000)   # gigatoken from the second batch on ...
        monkeypatch.setattr(pre, "PIECE_CHARS", 500)      # ... and cutting pieces itself
        assert pre.main([*common, "--output-prefix", str(tmp_path / "cut"), "--overwrite"]) == 0
        assert "encoder: gigatoken" in capsys.readouterr().err
        assert pair_bytes(tmp_path / "cut_text_document") == ref, tokenizer.name
        monkeypatch.undo()


def test_a_tokenizer_gigatoken_cannot_encode_exactly_falls_back_in_one_line(tmp_path, capfd, monkeypatch):
    """A tokenizer gigatoken cannot read (a WordPiece model), or one where it gives other ids on
    the probe text or on the corpus' first batch (simulated: one of gigatoken's ids changed), is encoded
    by tokenizers instead, with one line saying why; the bytes are the reference's. Without
    gigatoken installed, auto is tokenizers without a word."""
    pytest.importorskip("gigatoken", reason="gigatoken is in the test extra: pip install -e '.[test]'")
    import data_tools.preprocess as pre
    from data_tools import encoders
    source = corpus(tmp_path / "corpus.jsonl", TRICKY_ROWS)
    common = ["--input", str(source), "--append-eod", "--no-progress"]
    wordpiece = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                           "max_input_chars_per_word": 100,
                           "vocab": {"[UNK]": 0, "the": 1, "a": 2, "##s": 3, "<|endoftext|>": 4}}}
    (tmp_path / "wordpiece.json").write_text(json.dumps(wordpiece))
    for name, args in (("wp", ["--tokenizer", str(tmp_path / "wordpiece.json"), "--eod-token", "<|endoftext|>"]),
                       ("gpt2", ["--tokenizer", str(GPT2)])):
        assert pre.main([*common, *args, "--output-prefix", str(tmp_path / f"{name}-ref"),
                         "--tokenizer-backend", "tokenizers"]) == 0
    capfd.readouterr()
    assert pre.main([*common, "--tokenizer", str(tmp_path / "wordpiece.json"), "--eod-token", "<|endoftext|>",
                     "--output-prefix", str(tmp_path / "wp")]) == 0
    err = capfd.readouterr().err
    why = [line for line in err.splitlines() if line.startswith("preprocess: note: --tokenizer-backend gigatoken")]
    assert len(why) == 1 and "cannot read this tokenizer.json" in why[0] and "WordPiece" in why[0], err
    assert pair_bytes(tmp_path / "wp_text_document") == pair_bytes(tmp_path / "wp-ref_text_document")

    real_many, real_flat = encoders.GigatokenEncoder.encode_many, encoders.GigatokenEncoder.encode_flat
    for where, patch in (("on the probe text", "many"), ("on the first batch of the corpus", "flat")):
        if patch == "many":
            monkeypatch.setattr(encoders.GigatokenEncoder, "encode_many",
                                lambda self, texts: [[i + 1 for i in ids] for ids in real_many(self, texts)])
        else:
            def flat_changed(self, texts):
                flat, counts = real_flat(self, texts)
                flat = flat.copy()
                flat[:1] += 1
                return flat, counts
            monkeypatch.setattr(encoders.GigatokenEncoder, "encode_flat", flat_changed)
        out = tmp_path / patch
        assert pre.main([*common, "--tokenizer", str(GPT2), "--output-prefix", str(out)]) == 0
        err = capfd.readouterr().err
        assert f"gigatoken not used: it gave other ids than tokenizers {where}" in err, err
        assert "encoder: gigatoken" not in err
        assert pair_bytes(f"{out}_text_document") == pair_bytes(tmp_path / "gpt2-ref_text_document")
        monkeypatch.undo()
    # not installed: auto is the reference, silently; asked by name, the note says so
    monkeypatch.setattr(pre, "gigatoken_unavailable", lambda tokenizer: (
        "the gigatoken package is not installed (pip install gigatoken)", None))
    assert pre.main([*common, "--tokenizer", str(GPT2), "--output-prefix", str(tmp_path / "none")]) == 0
    err = capfd.readouterr().err
    assert "encoder:" not in err and "not used" not in err
    assert pair_bytes(tmp_path / "none_text_document") == pair_bytes(tmp_path / "gpt2-ref_text_document")
    assert pre.main([*common, "--tokenizer", str(GPT2), "--output-prefix", str(tmp_path / "named"),
                     "--tokenizer-backend", "gigatoken"]) == 0
    assert "--tokenizer-backend gigatoken not used: the gigatoken package is not installed" in capfd.readouterr().err


def test_gigatoken_is_renewed_when_the_process_grows_and_its_ids_do_not_change(monkeypatch):
    """gigatoken caches every distinct word in its tokenizer object, without bound; the encoder
    loads the tokenizer anew when the process has grown past its bound (--tokenizer-cache-mib; here:
    at every batch), and the ids stay tokenizers' across the renewals."""
    pytest.importorskip("gigatoken", reason="gigatoken is in the test extra: pip install -e '.[test]'")
    from tokenizers import Tokenizer

    from data_tools import encoders
    monkeypatch.setattr(encoders, "RENEW_MIN_CHARS", 1)
    reference = Tokenizer.from_file(str(GPT2))
    why, loaded = encoders.gigatoken_unavailable(reference)
    assert why is None
    encoder = encoders.GigatokenEncoder(loaded, reference.to_str(), renew_after_bytes=-2**40)
    texts = [json.loads(line)["text"] for line in open(FINEWEB, encoding="utf-8")]
    for start in range(0, 60, 20):
        batch = texts[start:start + 20]
        flat, counts = encoder.encode_flat(batch)
        want = [e.ids for e in reference.encode_batch_fast(batch, add_special_tokens=False)]
        assert counts.tolist() == [len(ids) for ids in want] and flat.tolist() == [i for ids in want for i in ids]
    assert encoder.renewals == 2 and encoder.tokenizer is not loaded   # after the 2nd and 3rd batch


def test_keep_empty_eod_writes_each_row_as_megatrons_fast_tool_does(tmp_path, capsys):
    """Megatron-LM's preprocess_data_fast.py tokenizes every row's text whole and appends the
    end-of-document id to each, so an empty text is the EOD alone; --keep-empty eod writes
    exactly that (compared with tokenizers' ids + EOD, row by row), plain --keep-empty writes the
    empty text as an empty document (preprocess_data.py), and the default skips it. eod without
    --append-eod is refused before any work."""
    from tokenizers import Tokenizer
    rows = [{"text": ""}, {"text": "A plain line."}, {"text": "   \n "}, {"text": "Tail <|endoftext|>"},
            {"text": "Ünïcödé 日本語 😀"}, {"text": ""}]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = Tokenizer.from_file(str(GPT2))
    want = [tokenizer.encode(r["text"], add_special_tokens=False).ids + [50256] for r in rows]
    common = ["--input", str(source), "--tokenizer", str(GPT2), "--append-eod", "--no-progress"]
    for rule, expected in (("eod", want), ("empty", [w if len(w) > 1 else [] for w in want]),
                           (None, [w for w, r in zip(want, rows) if r["text"].strip()])):   # blanks skipped
        out = tmp_path / f"rule-{rule}"
        assert preprocess_main([*common, "--output-prefix", str(out),
                                *(["--keep-empty", rule] if rule == "eod" else ["--keep-empty"] if rule else [])]) == 0
        err = capsys.readouterr().err
        ds = IndexedDataset(f"{out}_text_document")
        bounds = ds.document_index   # document d: sequences bounds[d] .. bounds[d + 1]
        got = [[t for q in range(bounds[d], bounds[d + 1]) for t in ds[q].tolist()] for d in range(len(bounds) - 1)]
        assert got == expected, (rule, got)
        if rule == "eod":
            assert "empty documents written (--keep-empty eod, as Megatron's preprocess_data_fast.py writes " \
                   "them): 2" in err, err
        elif rule == "empty":
            assert "(--keep-empty, as Megatron's preprocess_data.py writes them): 2" in err, err
    refused([PRE, "--input", source, "--tokenizer", GPT2, "--output-prefix", tmp_path / "noeod", "--keep-empty",
             "eod"], mention=r"--keep-empty eod .* give --append-eod", unchanged=[tmp_path])


def test_a_lone_surrogate_is_a_bad_document_not_a_crash(tmp_path, capsys):
    """JSON may escape half a surrogate pair ("\\ud800"): valid JSON, not Unicode text, and the
    tokenizers library raises a TypeError on it. It is skipped and counted (both backends), and
    --strict names the file and line."""
    source = tmp_path / "surrogate.jsonl"
    source.write_text('{"text": "a fine document"}\n{"text": "broken \\ud800 half"}\n{"text": ["ok", "x\\udfff"]}\n')
    backends = ["tokenizers"] + [b for b in ("tiktoken", "gigatoken") if __import__("importlib").util.find_spec(b)]
    for backend in backends:
        out = tmp_path / backend
        assert preprocess_main(["--input", str(source), "--tokenizer", str(GPT2), "--output-prefix", str(out),
                                "--no-progress", "--tokenizer-backend", backend]) == 0
        assert "2 key 'text' holds a lone surrogate" in capsys.readouterr().err
        assert len(IndexedDataset(f"{out}_text_document")) == 1
    refused([PRE, "--input", source, "--tokenizer", GPT2, "--output-prefix", tmp_path / "strict", "--strict"],
            mention=r"surrogate\.jsonl:2: key 'text' holds a lone surrogate", unchanged=[tmp_path])
