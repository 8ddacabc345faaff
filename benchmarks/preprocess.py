"""Preprocessing throughput and memory, and GPT index build time.

    python benchmarks/preprocess.py            # ~2 minutes on 2 cores; needs ../shared/data or tests/data

1. Inputs, jsonl of real text from the offline data:
   - fineweb: the 150 FineWeb-Edu documents, each repetition with its sentences shuffled (so no
     document repeats byte for byte), to 50 MB and 200 MB: the corpus this stack is for;
   - mixed: Tiny Shakespeare, WikiText-2, Pride and Prejudice and FineWeb-Edu in paragraph groups,
     to 50 MB, for reference (verse and wiki markup tokenize more slowly per token).
   Preprocessed with the GPT-2 tokenizer, --append-eod, --workers 2, each run in a fresh process
   reporting its own peak RSS. The tokenizer alone (encode_batch_fast, 2 threads, the same
   texts, no I/O) is measured on each corpus: the ratio is the pipeline's overhead.
2. A synthetic 100M-token indexed dataset; time to build (and then to reload) the GPT sample
   index of its train split for one epoch at seq_length 4096.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"
DATA = SHARED if SHARED.is_dir() else ROOT / "tests" / "data"
TOKENIZER = DATA / "gpt2-tokenizer.json"


def fineweb_documents(rng) -> list[str]:
    docs = [json.loads(line)["text"] for line in open(DATA / "fineweb-edu-sample-150.jsonl", encoding="utf-8")]
    out = []
    for text in docs:
        sentences = text.replace("\n", "\n ").split(". ")
        rng.shuffle(sentences)
        out.append(". ".join(sentences))
    return out


def mixed_documents(rng) -> list[str]:
    docs = fineweb_documents(rng)
    for name in ("tinyshakespeare.txt", "extra/wikitext-2-raw-test.txt", "extra/pride-and-prejudice.txt",
                 "tinyshakespeare-200k.txt"):
        path = DATA / name
        if path.is_file():
            lines = path.read_text(encoding="utf-8").replace("\r\n", "\n").split("\n")
            docs += ["\n".join(lines[i:i + 40]) for i in range(0, len(lines), 40)]   # 40 lines a document
    return docs


def write_corpus(path: Path, megabytes: int, kind: str) -> int:
    rng = np.random.RandomState(0)
    make = fineweb_documents if kind == "fineweb" else mixed_documents
    size, n = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1_000_000:
            for text in make(rng):
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                size += len(line.encode())
                n += 1
    return n


RUN = """
import resource, sys, time
sys.path.insert(0, {root!r})
from data_tools.preprocess import build_parser, run
args = build_parser().parse_args({argv!r})
t = time.time(); stats = run(args); t = time.time() - t
print(stats.tokens, t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

TOKENIZER_ONLY = """
import json, os, sys, time
os.environ["RAYON_NUM_THREADS"] = "2"
from tokenizers import Tokenizer
tok = Tokenizer.from_file({tok!r})
texts = [json.loads(l)["text"] for l in open({path!r}, encoding="utf-8")]
batches, batch, size = [], [], 0
for text in texts:   # the same ~4M-character batches the pipeline uses
    batch.append(text)
    size += len(text)
    if size >= {batch_chars}:
        batches.append(batch)
        batch, size = [], 0
batches.append(batch)
t = time.time()
n = sum(len(e.ids) for b in batches for e in tok.encode_batch_fast(b, add_special_tokens=False))
print(n, time.time() - t)
"""


def measure_preprocess(corpus: Path, out: Path, workers: int):
    argv = ["--input", str(corpus), "--tokenizer", str(TOKENIZER), "--output-prefix", str(out),
            "--append-eod", "--workers", str(workers), "--no-progress"]
    res = subprocess.run([sys.executable, "-c", RUN.format(root=str(ROOT), argv=argv)],
                         capture_output=True, text=True, check=True)
    tokens, seconds, rss = res.stdout.split()
    return int(tokens), float(seconds), int(rss)


def index_build(tmp: Path):
    from megatron_id.data.gpt_dataset import GPTDataset, split_ranges
    from megatron_id.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
    rng = np.random.RandomState(0)
    lengths = rng.randint(50, 2000, size=100_000_000 // 1025)
    with IndexedDatasetWriter(tmp / "synthetic", np.uint16) as w:   # the index only needs lengths
        w.add_many(np.zeros(int(lengths.sum()), dtype=np.uint16), lengths)
    ds = IndexedDataset(tmp / "synthetic")
    docs = split_ranges(len(ds), "969,30,1")[0]
    tokens = int(ds.lengths[docs[0]:docs[1]].sum())
    n = (tokens - 1) // 4096
    t = time.time()
    GPTDataset(ds, docs, n, 4096, seed=1234, cache_dir=tmp / "cache")
    build = time.time() - t
    t = time.time()
    again = GPTDataset(ds, docs, n, 4096, seed=1234, cache_dir=tmp / "cache")
    again[0], again[n - 1]
    return ds.num_tokens, n, build, time.time() - t


def tokenizer_alone(path: Path) -> float:
    from data_tools.preprocess import BATCH_CHARS
    code = TOKENIZER_ONLY.format(tok=str(TOKENIZER), path=str(path), batch_chars=BATCH_CHARS)
    res = subprocess.run([sys.executable, "-c", code],
                         capture_output=True, text=True, check=True)
    tokens, seconds = res.stdout.split()
    return int(tokens) / float(seconds)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        rows, alone = [], {}
        for kind, mb in (("fineweb", 50), ("fineweb", 200), ("mixed", 50)):
            corpus = tmp / f"{kind}{mb}.jsonl"
            docs = write_corpus(corpus, mb, kind)
            tokens, seconds, rss = measure_preprocess(corpus, tmp / f"out_{kind}{mb}", workers=2)
            rows.append((kind, mb, docs, tokens, seconds, rss))
            print(f"  {kind} {mb} MB: {tokens:,} tokens in {seconds:.1f} s", file=sys.stderr)
            if kind not in alone:
                sample = tmp / f"{kind}_20.jsonl"
                write_corpus(sample, 20, kind)
                alone[kind] = tokenizer_alone(sample)
        total, samples, build, reload = index_build(tmp)

    print(f"# preprocessing benchmark ({os.cpu_count()} CPUs), GPT-2 tokenizer, --workers 2, --append-eod\n")
    print("| corpus | input | documents | tokens | time | tokens/s | tokenizer alone | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, mb, docs, tokens, seconds, rss in rows:
        print(f"| {kind} | {mb} MB | {docs:,} | {tokens:,} | {seconds:.1f} s | "
              f"{tokens / seconds / 1e6:.2f} M | {alone[kind] / 1e6:.2f} M | {rss / 2**20:.0f} MiB |")
    print(f"\nGPT index of a {total / 1e6:.0f}M-token dataset (train split, {samples:,} samples of 4096): "
          f"built in {build:.2f} s, reloaded from cache in {reload:.3f} s")
    rate = rows[0][3] / rows[0][4]
    growth = rows[1][5] / rows[0][5]
    mixed_ratio = (rows[2][3] / rows[2][4]) / alone["mixed"]
    fineweb_ratio = rate / alone["fineweb"]
    print(f"\npipeline speed / tokenizer alone: {100 * fineweb_ratio:.0f}% on fineweb, "
          f"{100 * mixed_ratio:.0f}% on mixed (short documents cost more per token outside the tokenizer)")
    checks = [(f"throughput on 50 MB of FineWeb-Edu text: {rate / 1e6:.2f} M tokens/s >= 0.8 M", rate >= 0.8e6),
              (f"peak RSS 200 MB vs 50 MB input: {growth:.2f}x (flat: < 1.3x)", growth < 1.3),
              (f"100M-token index build: {build:.2f} s (seconds, not minutes: < 30 s)", build < 30)]
    print("\n## acceptance checks (issue 4)\n")
    for text, ok in checks:
        print(f"- {'PASS' if ok else 'FAIL'}: {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
