"""The GPT sample index and the blend index at FineWeb-Edu scale, side by side with megatron-core.

    python benchmarks/data_scale.py --help
    python benchmarks/data_scale.py                  # every cell: ~6 minutes on 2 cores, ~18 GB of disk,
                                                     # ~4 GB of memory
    python benchmarks/data_scale.py --cells blend20-26B blend20-100B single-100B --keep --workdir /scratch/ds
    python benchmarks/data_scale.py --quick          # the same cells 1000x smaller: a smoke test, seconds

What it measures (issue 40): the time and peak private memory of building the training data
indices, ours (`megatron_id.data.gpt_dataset.build_gpt_datasets`) against megatron-core 0.16.1's
(`BlendedMegatronDatasetBuilder` with `GPTDataset` / `BlendedDataset`), on the same files with the
same sizes, split and seed, both from scratch (a fresh, empty cache folder per cell and side).

1. Synthetic Megatron-format corpora, written into --workdir (default: a temporary folder, removed
   at the end unless --keep; with --keep a later run reuses corpora whose description matches):
   uint16 token ids, document lengths lognormal with sigma 1.0 and mean 1,000 tokens (median
   ~607; FineWeb-Edu's documents are that heavy-tailed), drawn with a fixed seed per corpus, the
   last document trimmed so that the corpus holds exactly its nominal number of tokens. The .idx is
   written by `indexed_dataset.write_index`, with a `.meta.json` sidecar beside it.
   - `0.5B`, `5B`: real .bin files (a repeated 32 MB block of random ids: neither side reads the
     .bin to build an index, so only its size and presence matter);
   - `100B`: index-only, a real .idx (100M documents, 2 GB) and a sparse .bin of the right size
     (`truncate`: no disk), which is all either side reads;
   - blends, one prefix per FineWeb-Edu shard: 100B tokens cut into equal shards, `blend20` = 20
     prefixes of 5B tokens, `blend200` = 200 prefixes of 0.5B tokens, each shard its own index-only
     corpus (its own .idx with its own document lengths, its own sparse .bin), weight 1 each
     (`--data-path 1 shard_000 1 shard_001 ...`).
2. Cells (--cells; run tokens / 2048 = train samples, seq_length 2048, split 969,30,1, seed 1234):

       single-0.5B        0.5B corpus, 0.5B-token run (the train split is read twice)
       single-5B          5B corpus, 5B-token run
       single-100B-26B    100B corpus, 26B-token run (a quarter of an epoch)
       single-100B        100B corpus, 100B-token run
       blend20-26B        20 x 5B, 26B-token run
       blend20-100B       20 x 5B, 100B-token run
       blend200-26B       200 x 0.5B, 26B-token run
       blend200-100B      200 x 0.5B, 100B-token run

   Validation samples as the trainer asks for them (engine.py) with a global batch of 512,
   eval_interval 1000 and eval_iters 10: (train samples // 512 // 1000 + 1) x 10 x 512; test 0.
   Ours: `build_gpt_datasets(data_path, "969,30,1", (n_train, n_valid, 0), 2048, 1234, cache)`.
   megatron-core: `BlendedMegatronDatasetBuilder(GPTDataset, [n_train, n_valid, 0], lambda: True,
   GPTDatasetConfig(blend=(prefixes, weights or None), split="969,30,1", sequence_length=2048,
   random_seed=1234, path_to_cache=cache, tokenizer=<eod/pad ids only>, reset_position_ids=False,
   reset_attention_mask=False, eod_mask_loss=False)).build()` in a 1-process gloo group (its
   BlendedDataset calls torch.distributed.get_rank(), so a group must exist, as in Megatron-LM;
   the barriers of one process cost nothing), num_dataset_builder_threads=1 (its default).
3. Each side of each cell runs in a fresh process (`--worker`): imports (numpy, torch, and
   megatron.core for its side) and the process group are set up first, then the build is timed
   (wall time of the one call, in the process). Before each side the cell's .idx files are read
   once, so both start from a warm page cache. Before the first cell our side builds a tiny
   2-prefix blend once, untimed: a helper compiled on first use (megatron_id/data/native.py,
   cached per machine) is built there, as megatron-core's come compiled in its wheel.
   Peak private memory: RssAnon of the worker (/proc/<pid>/status: anonymous resident pages, so
   memory-mapped files such as the .idx/.bin and loaded .npy caches do not count) sampled every
   20 ms by a thread of THIS process, minus its value just before the build. Sampling from
   outside matters: megatron-core's C++ helpers and numpy's shuffle hold the GIL for seconds, so a
   thread inside the worker would miss what they allocate and free within one call.
   disk: what the cell's cache folder takes on disk afterwards (allocated blocks); the cache
   folders are removed after each cell, the corpora at the end unless --keep.
   --timeout: seconds per side and cell (default 600); a side that runs longer is killed and
   shown as `>600 s` (our blend index was a pure-Python loop: minutes at 200 prefixes).
   --quick divides every token count by 1000 but keeps at least 2M tokens (~2,000 documents) per
   prefix, so that every split of every prefix has documents (see QUICK_MIN_PREFIX_TOKENS).
4. The table (ratio = ours / megatron-core), then the issue's acceptance: the blend index at 20
   prefixes within 1.0x megatron-core's time (26B- and 100B-token runs), and every single-prefix
   cell's peak memory within 1.2x megatron-core's. Exit status 1 when a check fails (0 with
   --quick, whose sizes are not the issue's; 2 when a side crashed).

megatron-core: `pip install megatron-core==0.16.1` (in the test extra of setup.py). Its wheels
(cp310-cp313, manylinux x86_64 and aarch64) carry the compiled helpers
(megatron/core/datasets/helpers_cpp.*.so: build_sample_idx_int32/64, build_blending_indices), so
nothing is compiled at install or at run time; it needs only torch >= 2.6, numpy and packaging.
Without it the benchmark runs our side only and says so (as does --ours-only).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ_LENGTH, SPLIT, SEED = 2048, "969,30,1", 1234
MEAN_DOCUMENT, SIGMA = 1000.0, 1.0
VOCAB_SIZE, EOD_ID = 50257, 50256
GLOBAL_BATCH, EVAL_INTERVAL, EVAL_ITERS = 512, 1000, 10
QUICK_SCALE = 1000               # --quick divides every token count by this,
QUICK_MIN_PREFIX_TOKENS = 2_000_000   # but leaves each prefix ~2,000 documents: a split with no
# documents (the 0.1% test split of 500 documents) sends megatron-core 0.16.1 into an endless loop
# (GPTDataset._get_num_epochs adds 0 tokens per epoch until it reaches the 1 token a 0-sample split asks)
SAMPLE_EVERY_S = 0.02
BLOCK_TOKENS = 1 << 24           # the random block a real .bin repeats (32 MB)
CORPUS_VERSION = 1

B = 1_000_000_000
# name: (tokens per prefix, prefixes, real .bin)
CORPORA = {"0.5B": (B // 2, 1, True), "5B": (5 * B, 1, True), "100B": (100 * B, 1, False),
           "blend20": (5 * B, 20, False), "blend200": (B // 2, 200, False)}
# name: (corpus, run tokens)
CELLS = {"single-0.5B": ("0.5B", B // 2), "single-5B": ("5B", 5 * B),
         "single-100B-26B": ("100B", 26 * B), "single-100B": ("100B", 100 * B),
         "blend20-26B": ("blend20", 26 * B), "blend20-100B": ("blend20", 100 * B),
         "blend200-26B": ("blend200", 26 * B), "blend200-100B": ("blend200", 100 * B)}


def tokens_text(n: int) -> str:
    for unit, size in (("B", B), ("M", 10 ** 6), ("K", 10 ** 3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return str(n)


def valid_samples(n_train: int) -> int:
    """What the trainer asks for (engine.py) at a global batch of 512, eval every 1000 steps, 10 iters."""
    return (n_train // GLOBAL_BATCH // EVAL_INTERVAL + 1) * EVAL_ITERS * GLOBAL_BATCH


# ---------------------------------------------------------------- synthetic corpora

def document_lengths(tokens: int, seed: int) -> np.ndarray:
    """int32 lognormal lengths (sigma 1.0, mean 1,000) summing to exactly `tokens`."""
    rng = np.random.default_rng(seed)
    mu = math.log(MEAN_DOCUMENT) - SIGMA ** 2 / 2
    parts, total = [], 0
    while total < tokens:
        n = max(1024, min(1 << 23, int((tokens - total) / MEAN_DOCUMENT * 1.02) + 1024))
        part = np.maximum(np.rint(rng.lognormal(mu, SIGMA, n)), 1).astype(np.int32)
        parts.append(part)
        total += int(part.sum(dtype=np.int64))
    lengths = np.concatenate(parts)
    del parts
    ends = np.cumsum(lengths, dtype=np.int64)
    last = int(np.searchsorted(ends, tokens))          # the document that reaches `tokens`
    lengths = lengths[:last + 1].copy()
    lengths[-1] -= int(ends[last] - tokens)
    return lengths


def write_corpus(prefix: Path, tokens: int, seed: int, real: bool) -> None:
    """`prefix`.idx/.bin/.meta.json: real .bin or a sparse one of the right size."""
    from megatron_id.data.indexed_dataset import META_FORMAT, write_index
    lengths = document_lengths(tokens, seed)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    write_index(f"{prefix}.idx", np.uint16, lengths)
    n_docs = len(lengths)
    del lengths
    with open(f"{prefix}.bin", "wb") as f:
        if real:
            block = np.random.default_rng(seed + 1).integers(0, EOD_ID, BLOCK_TOKENS, dtype=np.uint16)
            view = memoryview(block).cast("B")
            left = tokens
            while left:
                n = min(left, BLOCK_TOKENS)
                f.write(view[:2 * n])
                left -= n
        else:
            f.truncate(2 * tokens)
    meta = {"format": META_FORMAT, "dtype": "uint16", "vocab_size": VOCAB_SIZE,
            "max_token_id": EOD_ID - 1 if real else 0, "min_token_id": 0, "num_sequences": n_docs,
            "num_documents": n_docs, "num_tokens": tokens, "tokenizer": None, "tokenizer_id": None,
            "eod_id": EOD_ID}
    Path(f"{prefix}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def corpus_prefixes(workdir: Path, name: str, scale: int) -> list[Path]:
    """The prefixes of corpus `name`, written unless a matching one is there already."""
    per_prefix, count, real = CORPORA[name]
    tokens = per_prefix if scale == 1 else max(per_prefix // scale, QUICK_MIN_PREFIX_TOKENS)
    folder = workdir / "corpora" / f"{name}{'-quick' if scale > 1 else ''}"
    prefixes = [folder / (f"shard_{i:03d}_text_document" if count > 1 else "synthetic_text_document")
                for i in range(count)]
    spec = {"version": CORPUS_VERSION, "tokens_per_prefix": tokens, "prefixes": count, "real": real,
            "mean": MEAN_DOCUMENT, "sigma": SIGMA}
    marker = folder / "corpus.json"
    try:
        if json.loads(marker.read_text()) == spec:
            return prefixes
    except (OSError, ValueError):
        pass
    shutil.rmtree(folder, ignore_errors=True)
    t = time.time()
    for i, prefix in enumerate(prefixes):
        write_corpus(prefix, tokens, seed=1000 * (1 + list(CORPORA).index(name)) + i, real=real)
    marker.write_text(json.dumps(spec))
    print(f"  wrote corpus {name}: {count} x {tokens_text(tokens)} tokens "
          f"({'real' if real else 'index-only'}) in {time.time() - t:.1f} s", file=sys.stderr, flush=True)
    return prefixes


def warm(prefixes) -> None:
    """Read the .idx files once so that neither side pays for cold disk reads."""
    for prefix in prefixes:
        with open(f"{prefix}.idx", "rb") as f:
            while f.read(1 << 24):
                pass


def disk_usage(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_blocks * 512
    return total


# ---------------------------------------------------------------- one side in a fresh process

class _Tokenizer:
    """All that megatron-core's GPTDataset asks of a tokenizer when nothing is tokenized: the
    eod/pad ids, the vocabulary size (it picks the token dtype from it) and the identifiers its
    cache key is hashed from."""
    vocab_size = VOCAB_SIZE
    eod = EOD_ID
    pad = -1
    unique_identifiers = {"class": "synthetic", "vocab_size": VOCAB_SIZE, "eod": EOD_ID}


def worker(spec: dict) -> None:
    """Build one side's indices, between the READY/GO handshake with the parent; print the result."""
    import gc
    import warnings

    import torch  # noqa: F401  (a trainer has it imported already: not part of the build)
    if spec["side"] == "mcore":
        warnings.filterwarnings("ignore")
        import torch.distributed as dist
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        dist.init_process_group("gloo", init_method=f"file://{spec['rendezvous']}", rank=0, world_size=1)
        prefixes, weights = spec["prefixes"], spec["weights"]
        config = GPTDatasetConfig(
            random_seed=spec["seed"], sequence_length=spec["seq_length"], blend=(prefixes, weights),
            split=spec["split"], path_to_cache=spec["cache"], tokenizer=_Tokenizer(),
            reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)

        def build():
            return BlendedMegatronDatasetBuilder(GPTDataset, [*spec["sizes"][:2], 0], lambda: True, config).build()
    else:
        from megatron_id.data.gpt_dataset import build_gpt_datasets
        data_path = spec["prefixes"] if spec["weights"] is None else \
            [x for w, p in zip(spec["weights"], spec["prefixes"]) for x in (str(w), p)]

        def build():
            return build_gpt_datasets(data_path, spec["split"], (*spec["sizes"][:2], 0), spec["seq_length"],
                                      spec["seed"], spec["cache"])
    gc.collect()
    print("READY", flush=True)
    sys.stdin.readline()
    t = time.perf_counter()
    train, valid, _ = build()
    seconds = time.perf_counter() - t
    print(json.dumps({"time": seconds, "train": len(train), "valid": None if valid is None else len(valid),
                      "train_type": type(train).__name__}), flush=True)
    if spec["side"] == "mcore":
        dist.destroy_process_group()


def rss_anon(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_side(spec: dict, timeout: float, log: Path) -> dict:
    """Run `worker(spec)` in a fresh process; {"time", "peak", "train", ...} or {"error"/"timeout"}."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
        try:
            ready = proc.stdout.readline()
            if ready.strip() != "READY":
                proc.wait()
                return {"error": f"worker failed before the build (exit {proc.returncode}): "
                                 f"{log.read_text()[-2000:]}"}
            base = rss_anon(proc.pid) or 0
            peak, stop = [base], threading.Event()

            def sample():
                while not stop.is_set():
                    value = rss_anon(proc.pid)
                    if value is not None:
                        peak[0] = max(peak[0], value)
                    stop.wait(SAMPLE_EVERY_S)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            proc.stdin.write("GO\n")
            proc.stdin.flush()
            lines = []
            reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
            reader.start()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return {"timeout": timeout, "peak": peak[0] - base}
            finally:
                stop.set()
                sampler.join()
            reader.join()
            if proc.returncode != 0 or not lines:
                return {"error": f"worker exited {proc.returncode}: {log.read_text()[-2000:]}"}
            return {**json.loads(lines[-1]), "peak": peak[0] - base}
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def warm_up(workdir: Path, timeout: float) -> None:
    """Our side once on a tiny 2-prefix blend, untimed: a helper that is compiled on first use
    (and cached per machine) is then built before the first measured cell, as megatron-core's
    come compiled in its wheel."""
    folder = workdir / "caches" / "warm-up"
    prefixes = [folder / f"part{i}_text_document" for i in range(2)]
    for i, prefix in enumerate(prefixes):
        write_corpus(prefix, 400_000, seed=i, real=False)
    spec = {"side": "ours", "prefixes": [str(p) for p in prefixes], "weights": [1.0, 1.0],
            "sizes": [100, 10, 0], "seq_length": SEQ_LENGTH, "seed": SEED, "split": SPLIT,
            "cache": str(folder / "cache"), "rendezvous": ""}
    result = run_side(spec, timeout, folder / "log")
    if "error" in result:
        print(f"  warm-up failed: {result['error'][-1500:]}", file=sys.stderr)
    shutil.rmtree(folder, ignore_errors=True)


def run_cell(name: str, workdir: Path, scale: int, sides: list[str], timeout: float) -> dict:
    corpus, run_tokens = CELLS[name]
    prefixes = corpus_prefixes(workdir, corpus, scale)
    run_tokens //= scale
    n_train = run_tokens // SEQ_LENGTH
    n_valid = valid_samples(n_train)
    per_prefix = json.loads((prefixes[0].parent / "corpus.json").read_text())["tokens_per_prefix"]
    row = {"cell": name, "prefixes": len(prefixes), "corpus_tokens": per_prefix * len(prefixes),
           "run_tokens": run_tokens, "n_train": n_train, "n_valid": n_valid}
    for side in sides:
        cache = workdir / "caches" / f"{name}-{side}"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        spec = {"side": side, "prefixes": [str(p) for p in prefixes],
                "weights": None if len(prefixes) == 1 else [1.0] * len(prefixes),
                "sizes": [n_train, n_valid, 0], "seq_length": SEQ_LENGTH, "seed": SEED, "split": SPLIT,
                "cache": str(cache), "rendezvous": str(workdir / "caches" / f".{name}-{side}-rendezvous")}
        warm(prefixes)
        print(f"  {name} ({len(prefixes)} prefix{'es' if len(prefixes) > 1 else ''}, {tokens_text(run_tokens)}-token "
              f"run, {n_train:,} samples): {side} ...", file=sys.stderr, flush=True)
        result = run_side(spec, timeout, workdir / "caches" / f"{name}-{side}.log")
        result["disk"] = disk_usage(cache)
        shutil.rmtree(cache, ignore_errors=True)
        Path(spec["rendezvous"]).unlink(missing_ok=True)
        row[side] = result
        shown = f"{result['time']:.1f} s, {result['peak'] / 2 ** 20:,.0f} MiB" if "time" in result else \
            f"timed out after {timeout:.0f} s" if "timeout" in result else "FAILED"
        print(f"    {side}: {shown}", file=sys.stderr, flush=True)
        if "error" in result:
            print(result["error"][-1500:], file=sys.stderr)
    return row


# ---------------------------------------------------------------- table and checks

def mib(n) -> str:
    return f"{n / 2 ** 20:,.0f}"


def table(rows: list[dict], sides: list[str]) -> list[str]:
    def seconds(r):
        return f"{r['time']:.2f}" if "time" in r else f">{r['timeout']:.0f}" if "timeout" in r else "failed"

    def ratio(a, b, key):
        if a is None or b is None or key not in a or key not in b or not b[key]:
            return "-"
        return f"{a[key] / b[key]:.2f}x"

    def samples(r):
        return f"{r['train']:,}" if "train" in r else "-"
    lines = ["| cell | prefixes | run tokens | train samples ours / mcore | ours s | mcore s | ratio | "
             "ours MiB | mcore MiB | ratio | disk ours / mcore MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ours, mc = row.get("ours"), row.get("mcore")
        lines.append(
            f"| {row['cell']} | {row['prefixes']} | {tokens_text(row['run_tokens'])} | "
            f"{samples(ours) if ours else '-'} / {samples(mc) if mc else '-'} | "
            f"{seconds(ours) if ours else '-'} | {seconds(mc) if mc else '-'} | {ratio(ours, mc, 'time')} | "
            f"{mib(ours['peak']) if ours and 'peak' in ours else '-'} | "
            f"{mib(mc['peak']) if mc and 'peak' in mc else '-'} | "
            f"{ratio(ours, mc, 'peak')} | {mib(ours['disk']) if ours else '-'} / {mib(mc['disk']) if mc else '-'} |")
    return lines


def checks(rows: list[dict]) -> list[tuple[str, bool | None]]:
    """(text, passed; None: not measured) for the issue's acceptance."""
    out = []
    by_cell = {r["cell"]: r for r in rows}
    for cell in ("blend20-26B", "blend20-100B"):
        row = by_cell.get(cell)
        if row is None:
            continue
        ours, mc = row.get("ours", {}), row.get("mcore")
        if mc is None or "time" not in mc:
            out.append((f"{cell}: blend index time vs megatron-core (megatron-core not measured)", None))
        elif "time" not in ours:
            out.append((f"{cell}: ours {'timed out' if 'timeout' in ours else 'failed'}, megatron-core "
                        f"{mc['time']:.1f} s (<= 1.0x, issue 40)", False))
        else:
            r = ours["time"] / mc["time"]
            out.append((f"{cell}: blend index (20 prefixes) {ours['time']:.1f} s vs megatron-core's "
                        f"{mc['time']:.1f} s = {r:.2f}x (<= 1.0x, issue 40)", r <= 1.0))
    for row in rows:
        if row["prefixes"] != 1:
            continue
        ours, mc = row.get("ours", {}), row.get("mcore")
        if mc is None or "time" not in mc:
            out.append((f"{row['cell']}: single-prefix index memory vs megatron-core (megatron-core not "
                        f"measured)", None))
        elif "time" not in ours:
            out.append((f"{row['cell']}: ours {'timed out' if 'timeout' in ours else 'failed'}", False))
        else:
            r = ours["peak"] / max(mc["peak"], 1)
            out.append((f"{row['cell']}: single-prefix index peak memory {mib(ours['peak'])} MiB vs "
                        f"megatron-core's {mib(mc['peak'])} MiB = {r:.2f}x (<= 1.2x, issue 40)", r <= 1.2))
    return out


def mcore_available() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Our sample/blend index build vs megatron-core's, at FineWeb-Edu "
                                "scale (see the module docstring for what each column measures).",
                                allow_abbrev=False)
    p.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS), metavar="CELL",
                   help=f"cells to run (default: all of {' '.join(CELLS)})")
    p.add_argument("--quick", action="store_true",
                   help=f"every token count divided by {QUICK_SCALE} (seconds: a smoke test)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where corpora and caches go (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the corpora (a later run with the same "
                   "--workdir reuses them)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per side and cell (default 600; 60 with --quick)")
    p.add_argument("--ours-only", action="store_true", help="do not run megatron-core even when installed")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.timeout is None:
        args.timeout = 60.0 if args.quick else 600.0
    if args.timeout <= 0:
        p.error(f"--timeout {args.timeout}: give a positive number of seconds")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    have_mcore = mcore_available()
    sides = ["ours"] + (["mcore"] if have_mcore and not args.ours_only else [])
    scale = QUICK_SCALE if args.quick else 1
    created = args.workdir is None or not args.workdir.exists()
    workdir = Path(tempfile.mkdtemp(prefix="data_scale-")) if args.workdir is None else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    cells = [c for c in CELLS if c in args.cells]
    rows = []
    try:
        warm_up(workdir, args.timeout)
        for cell in cells:
            rows.append(run_cell(cell, workdir, scale, sides, args.timeout))
    finally:
        shutil.rmtree(workdir / "caches", ignore_errors=True)
        if not args.keep:
            if created:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                shutil.rmtree(workdir / "corpora", ignore_errors=True)

    load = os.getloadavg()[0]
    print(f"# data index build: ours vs megatron-core ({os.cpu_count()} CPUs, load {load:.1f}"
          f"{', QUICK: every size / ' + str(QUICK_SCALE) if args.quick else ''})\n")
    if not have_mcore:
        print("megatron-core is not installed (pip install megatron-core==0.16.1, or pip install -e '.[test]'): "
              "our side only\n")
    elif args.ours_only:
        print("--ours-only: megatron-core not run\n")
    print(f"seq_length {SEQ_LENGTH}, split {SPLIT}, seed {SEED}; documents lognormal (mean {MEAN_DOCUMENT:,.0f}, "
          f"sigma {SIGMA}); train samples = run tokens / {SEQ_LENGTH}, valid = (train // {GLOBAL_BATCH} // "
          f"{EVAL_INTERVAL} + 1) x {EVAL_ITERS} x {GLOBAL_BATCH}. Time: the build call, warm page cache. MiB: "
          f"peak RssAnon above the value before the build (sampled every {SAMPLE_EVERY_S * 1000:.0f} ms). "
          f"disk: the cache folder. ratio: ours / megatron-core. megatron-core's train sample count is its "
          f"dataset's length: whole epochs for one prefix, sum(ceil(n x weight)) for a blend.\n")
    for line in table(rows, sides):
        print(line)
    results = checks(rows)
    print("\n## acceptance checks\n")
    for text, ok in results:
        print(f"- {'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}: {text}")
    if args.json:
        args.json.write_text(json.dumps({"quick": args.quick, "sides": sides, "rows": rows}, indent=1))
    if any("error" in row.get(side, {}) for row in rows for side in sides):
        return 2
    if args.quick:
        return 0
    return 0 if all(ok is not False for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
