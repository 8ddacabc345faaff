"""`megatron-id eval`: perplexity, length extrapolation and recall, for one or more checkpoints.

    megatron-id eval perplexity --checkpoint runs/a/checkpoints [runs/b/hf ...] \\
        [--data PREFIX [--split 969,30,1 --split-name valid --seed S --samples N] | --text FILE ...]
    megatron-id eval length --checkpoint A B --text val.jsonl.zst --factors 0.5 1 2 3.5 4 --out eval/length
    megatron-id eval recall --checkpoint A B --task passkey mqar --seed 1234 --out eval/recall

Every checkpoint is a training checkpoint (any TP/PP/ZeRO layout: its weights are read at TP=1)
or an exported Hugging Face folder. Each evaluation prints a markdown table; `--json` prints the
JSON summary instead; `--out DIR` also writes results.json, results.md, a CSV and a PNG there.
Results depend only on the checkpoints, the inputs, the options and the seed: the JSON holds no
time or path of the machine beyond what was given, so two runs give identical files.

Perplexity on an indexed dataset rebuilds the trainer's own samples: the GPT dataset of
`--split-name` (valid by default) of the `--data` prefix (default: the checkpoint's data.data_path),
with the checkpoint's split, seed and seq_length (recorded at save; options override them), and
`--samples` samples (default: those of the trainer's last validation, when the checkpoint records
its validation settings; else one pass over the split). `--first-sample` and `--count` select a
range of them, so `eval` reproduces any validation round of the trainer exactly. On text files
(.txt: one document per file; .jsonl, .jsonl.gz, .jsonl.zst, .json: the `text` field of each row),
documents are tokenized with the checkpoint's tokenizer, joined with the end-of-document token
after each (as preprocessing with --append-eod) and cut into consecutive windows of
seq_length + 1 tokens. Bits per byte divide the summed loss (in bits) by the UTF-8 bytes the
scored tokens stand for (the EOD stands for none).
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
import random
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..errors import UserError
from .recall import mqar, mqar_correct, passkey, passkey_correct
from .scoring import score_windows, windows

RESULT_FILES = ("results.json", "results.md", "results.csv", "results.png")


class EvalError(UserError, ValueError):
    pass


# ---------------------------------------------------------------- inputs

def read_documents(paths) -> list[str]:
    """Texts of .txt/.md files (one document each) and of jsonl/json rows (their `text`)."""
    docs = []
    for path in map(Path, paths):
        if not path.is_file():
            raise EvalError(f"--text {path}: not found (give .txt files or .jsonl/.jsonl.zst/.jsonl.gz files "
                            f"with a 'text' field).")
        name = path.name.lower()
        if name.endswith((".txt", ".md", ".raw")):
            text = path.read_text(encoding="utf-8")
            if not text.strip():
                raise EvalError(f"--text {path}: the file is empty (no text to score): give a file with text.")
            docs.append(text)
            continue
        if not name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".ndjson")):
            raise EvalError(f"--text {path}: unsupported type; use .txt, .jsonl, .jsonl.gz or .jsonl.zst.")
        raw = open(path, "rb")
        if name.endswith(".gz"):
            raw = gzip.GzipFile(fileobj=raw)
        elif name.endswith(".zst"):
            import zstandard
            raw = zstandard.ZstdDecompressor().stream_reader(raw)
        before = len(docs)
        with io.TextIOWrapper(raw, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line).get("text")
                except (json.JSONDecodeError, AttributeError):
                    raise EvalError(f"{path}:{number}: not a JSON object (one object with a 'text' field per "
                                    f"line).") from None
                if isinstance(text, list):
                    text = " ".join(text)
                if not isinstance(text, str):
                    raise EvalError(f"{path}:{number}: no 'text' string in this row.")
                docs.append(text)
        if len(docs) == before:
            raise EvalError(f"--text {path}: holds no documents.")
    return docs


def token_stream(trained, docs: list[str]) -> np.ndarray:
    """The documents' ids, each followed by the end-of-document id (int64)."""
    encoded = trained.tokenizer.encode_batch_fast(docs, add_special_tokens=False)
    parts = []
    for e in encoded:
        parts.append(np.asarray(e.ids, dtype=np.int64))
        parts.append(np.asarray([trained.eod], dtype=np.int64))
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if stream.size and int(stream.max()) >= trained.cfg.vocab_size:
        raise EvalError(f"the tokenizer {trained.tokenizer_path} gives id {int(stream.max())}, outside the model's "
                        f"vocabulary ({trained.cfg.vocab_size}): pass the tokenizer the model was trained with "
                        f"(--tokenizer).")
    return stream


def _check_data_tokenizer(trained, data_path, allow: bool) -> None:
    """Every prefix scored was made with the tokenizer the model is evaluated with (its ids are
    decoded by it for bits per byte, and embedded by the model as its own)."""
    from ..data.gpt_dataset import parse_data_path
    from ..data.tokenizer import MISMATCH_FLAG, check_same_tokenizer, dataset_tokenizer
    for _, prefix in parse_data_path(data_path):
        identity, path = dataset_tokenizer(prefix)
        check_same_tokenizer((f"--data {prefix}", identity, path),
                             (f"the tokenizer {trained.tokenizer_path}", trained.tokenizer_id, None),
                             f"Score data preprocessed with the model's tokenizer, or pass {MISMATCH_FLAG} "
                             f"to score it anyway.", allow=allow)


def gpt_rows(trained, args) -> tuple[np.ndarray, dict]:
    """The trainer's samples of the validation (or another) split, as [count, seq_length + 1]."""
    from ..data.gpt_dataset import build_gpt_datasets, default_cache_dir, parse_data_path
    from ..data.indexed_dataset import IndexedDataset
    record = (trained.client.data if trained.client is not None else None) or {}
    data_path = args.data or record.get("data_path")
    if not data_path:
        raise EvalError("no --data given and the checkpoint records no data.data_path (an export or an older "
                        "checkpoint): pass --data PREFIX, or --text FILE.")
    _check_data_tokenizer(trained, data_path, getattr(args, "allow_tokenizer_mismatch", False))
    split = args.split or record.get("split") or "969,30,1"
    seed = args.seed if args.seed is not None else record.get("seed", 1234)
    seq = args.seq_length or record.get("seq_length") or trained.cfg.seq_length
    which = {"train": 0, "valid": 1, "test": 2}[args.split_name]
    samples = args.samples
    if samples is None and which == 1 and record.get("eval_iters"):
        # as many as the trainer's validation dataset holds: its rounds then match exactly
        evals = record["train_iters"] // max(record["eval_interval"], 1) + 1
        samples = evals * record["eval_iters"] * record["global_batch_size"]
    if samples is None:   # one pass over the split
        from ..data.gpt_dataset import split_ranges
        tokens = 0
        for _, prefix in parse_data_path(data_path):
            ds = IndexedDataset(prefix)
            start, end = split_ranges(len(ds), split)[which]
            tokens += int(ds.lengths[start:end].sum(dtype=np.int64))
        samples = max((tokens - 1) // seq, 1)
    nums = [0, 0, 0]
    nums[which] = samples
    cache = args.index_cache_dir or record.get("index_cache_dir") or default_cache_dir(data_path)
    dataset = build_gpt_datasets(data_path, split, tuple(nums), seq, seed, cache)[which]
    if dataset is None:
        raise EvalError(f"data.split={split} leaves no {args.split_name} documents in {' '.join(map(str, data_path))}.")
    first = args.first_sample
    count = len(dataset) - first if args.count is None else args.count
    if not 0 <= first < len(dataset) or count < 1 or first + count > len(dataset):
        raise EvalError(f"--first-sample {first} --count {args.count}: the {args.split_name} dataset has "
                        f"{len(dataset):,} samples (0..{len(dataset) - 1}).")
    rows = np.stack([np.asarray(dataset[i], dtype=np.int64) for i in range(first, first + count)])
    where = {"data_path": [str(x) for x in data_path], "split": split, "split_name": args.split_name,
             "seed": seed, "seq_length": seq, "samples": samples, "first_sample": first, "count": count}
    return rows, where


# ---------------------------------------------------------------- evaluations

def run_perplexity(trained, args, token_bytes) -> dict:
    if args.text:
        seq = args.seq_length or trained.cfg.seq_length
        stream = token_stream(trained, read_documents(args.text))
        rows = windows(stream, seq, None if args.max_tokens is None else max(1, args.max_tokens // seq))
        if not len(rows):
            raise EvalError(f"--text holds {len(stream):,} tokens, fewer than one window of {seq + 1}.")
        where = {"text": [str(t) for t in args.text], "seq_length": seq, "windows": len(rows),
                 "tokens_unscored": int(len(stream) - (len(rows) * seq + 1))}
    else:
        rows, where = gpt_rows(trained, args)
    totals = score_windows(trained.model, rows, args.batch_size, args.chunk_size, token_bytes, args.device)
    return {**where, **totals.result()}


def run_length(trained, args, token_bytes) -> dict:
    train_length = trained.cfg.seq_length
    stream = token_stream(trained, read_documents(args.text))
    contexts, largest = [], max(args.factors)
    for factor in args.factors:
        context = max(1, round(factor * train_length))
        rows = windows(stream, context, max(1, args.max_tokens // context))
        if not len(rows):
            raise EvalError(f"--text holds {len(stream):,} tokens: too few for one window at {factor}x the "
                            f"training length ({context + 1} tokens). Give more text or smaller --factors.")
        positions = np.zeros(context, dtype=np.float64) if factor == largest else None
        totals = score_windows(trained.model, rows, args.batch_size, args.chunk_size, token_bytes, args.device,
                               positions)
        contexts.append({"factor": factor, "context": context, **totals.result()})
        if positions is not None:
            width = max(1, round(args.bucket * train_length))
            buckets = []
            for start in range(0, context, width):
                part = positions[start:start + width]
                mean = float(part.sum() / (len(part) * len(rows)))
                buckets.append({"start": start, "end": start + len(part), "loss": mean, "perplexity": math.exp(mean)})
    one = next((c for c in contexts if c["factor"] == 1), None)
    for c in contexts:
        c["vs_1x"] = c["perplexity"] / one["perplexity"] if one else None
    return {"train_length": train_length, "max_tokens": args.max_tokens, "contexts": contexts,
            "positions": {"context": round(largest * train_length), "bucket": width, "buckets": buckets}}


def run_recall(trained, args) -> dict:
    out = {}
    train_length = trained.cfg.seq_length
    if "passkey" in args.task:
        cells = []
        for factor in args.factors:
            length = max(1, round(factor * train_length))
            for depth in args.depths:
                rng = random.Random(f"{args.seed}-passkey-{length}-{depth}")   # the same prompts for every model
                try:
                    probes = [passkey(trained.tokenizer, length, depth, rng) for _ in range(args.samples)]
                except ValueError as err:
                    raise EvalError(f"--factors {factor}: {err}; use larger factors.") from None
                scored = [passkey_correct(trained.model, p, args.device, args.chunk_size) for p in probes]
                cells.append({"factor": factor, "length": length, "depth": depth,
                              "accuracy": sum(ok for ok, _ in scored) / len(probes),
                              "answer_loss": sum(loss for _, loss in scored) / len(probes), "samples": len(probes)})
        out["passkey"] = cells
    if "mqar" in args.task:
        cells = []
        for pairs in args.pairs:
            rng = random.Random(f"{args.seed}-mqar-{pairs}")
            probes = [mqar(trained.tokenizer, pairs, rng) for _ in range(args.samples)]
            scored = [mqar_correct(trained.model, p, args.device, args.chunk_size) for p in probes]
            hits = [h for ok, _ in scored for h in ok]
            losses = [x for _, loss in scored for x in loss]
            cells.append({"pairs": pairs, "length": int(np.mean([p.length for p in probes])),
                          "accuracy": sum(hits) / len(hits), "answer_loss": sum(losses) / len(losses),
                          "queries": len(hits)})
        out["mqar"] = cells
    return out


def run_mqar(source, args) -> dict:
    """Accuracy and the answers' loss on sequences of the MQAR task's test split (never seen in
    training: the trainer reads the train and valid splits), with the checkpoint's task settings
    unless options change them; and the model's decode state for the task's length."""
    import dataclasses
    from ..checkpoint.read import read_checkpoint
    from ..data.mqar import MQARTask, score
    from ..model.accounting import report
    from ..model.language_model import LanguageModel
    folder, client, cfg, weights = read_checkpoint(source)
    data = client.data or {}
    if data.get("source") != "mqar":
        raise EvalError(f"{folder} was not trained with data.source=mqar (its data: "
                        f"{data.get('data_path') or 'not recorded'}): `eval mqar` scores the generated task; "
                        f"for a model of text use `eval recall --task mqar`.")
    settings = {**data["mqar"], **{k: getattr(args, k) for k in ("num_pairs", "num_queries", "num_keys", "num_values")
                                   if getattr(args, k) is not None}}
    task = MQARTask(args.seq_length or cfg.seq_length, **settings)
    task.check(cfg.vocab_size)
    model = LanguageModel(cfg, seed=None)
    model.load_state_dict(weights, strict=True)
    model.eval().to(args.device)
    seed = data["seed"] if args.seed is None else args.seed
    result = score(model, task, seed, args.samples, args.batch_size, args.device)
    counts = report(cfg)
    state = counts.decode_state(task.seq_length)
    return {**result, "seed": seed, "task": dataclasses.asdict(task), "mixer": str(getattr(cfg.mixer, "value", cfg.mixer)),
            "layer_pattern": counts.layer_pattern, "state_numbers": state, "state_bytes_fp32": 4 * state,
            "parameters": counts.parameters}


# ---------------------------------------------------------------- reports

def _md_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _f(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(evaluation: str, results: list[dict]) -> str:
    if evaluation == "perplexity":
        rows = [(r["name"], r["tokens"], _f(r["loss"], 4), _f(r["perplexity"], 2), _f(r["bits_per_byte"], 4))
                for r in results]
        return _md_table(["model", "tokens", "loss", "perplexity", "bits/byte"], rows)
    if evaluation == "length":
        factors = [c["factor"] for c in results[0]["contexts"]]
        head = ["model", "train length"] + [f"{f}x" for f in factors]
        rows = [(r["name"], r["train_length"], *[_f(c["perplexity"], 2) for c in r["contexts"]]) for r in results]
        text = "perplexity by context (x the training length)\n\n" + _md_table(head, rows)
        rel = [(r["name"], r["train_length"], *[_f(c["vs_1x"], 3) for c in r["contexts"]]) for r in results]
        return text + "\n\nrelative to 1x\n\n" + _md_table(head, rel)
    if evaluation == "mqar":
        rows = [(r["name"], r["mixer"], r["layer_pattern"], f"{r['state_bytes_fp32']:,}", r["task"]["num_pairs"],
                 r["answers"], _f(r["accuracy"], 3), _f(r["chance"], 3), _f(r["answer_loss"], 3)) for r in results]
        return "MQAR accuracy (the task's test split; state: the decode state at the task's length, fp32)\n\n" + \
            _md_table(["model", "mixer", "layers", "state bytes", "pairs", "answers", "accuracy", "chance",
                       "answer loss"], rows)
    parts = []
    if "passkey" in results[0]:
        cells = results[0]["passkey"]
        keys = sorted({(c["factor"], c["length"]) for c in cells})
        head = ["model", "depth"] + [f"{f}x ({n})" for f, n in keys]
        rows = []
        for r in results:
            for depth in sorted({c["depth"] for c in r["passkey"]}):
                got = {(c["factor"], c["length"]): c["accuracy"] for c in r["passkey"] if c["depth"] == depth}
                rows.append((r["name"], depth, *[_f(got[k], 2) for k in keys]))
        parts.append("passkey accuracy (prompt length in tokens)\n\n" + _md_table(head, rows))
        loss_rows = [(r["name"], *[_f(sum(c["answer_loss"] for c in r["passkey"] if (c["factor"], c["length"]) == k) /
                                      sum(1 for c in r["passkey"] if (c["factor"], c["length"]) == k), 3) for k in keys])
                     for r in results]
        parts.append("passkey: the key's loss under teacher forcing (nats per token, mean over depths; lower is "
                     "better)\n\n" + _md_table(["model"] + head[2:], loss_rows))
    if "mqar" in results[0]:
        pairs = [c["pairs"] for c in results[0]["mqar"]]
        rows = [(r["name"], *[_f(c["accuracy"], 3) for c in r["mqar"]]) for r in results]
        parts.append("multi-query associative recall: accuracy per query\n\n" +
                     _md_table(["model"] + [f"{p} pairs" for p in pairs], rows))
        rows = [(r["name"], *[_f(c["answer_loss"], 3) for c in r["mqar"]]) for r in results]
        parts.append("multi-query associative recall: the value's loss (nats per token; lower is better)\n\n" +
                     _md_table(["model"] + [f"{p} pairs" for p in pairs], rows))
    return "\n\n".join(parts)


def write_csv(path: Path, evaluation: str, results: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        if evaluation == "perplexity":
            w.writerow(["model", "tokens", "loss", "perplexity", "bits_per_byte"])
            for r in results:
                w.writerow([r["name"], r["tokens"], r["loss"], r["perplexity"], r["bits_per_byte"]])
        elif evaluation == "length":
            w.writerow(["model", "kind", "factor_or_start", "context_or_end", "tokens", "loss", "perplexity"])
            for r in results:
                for c in r["contexts"]:
                    w.writerow([r["name"], "context", c["factor"], c["context"], c["tokens"], c["loss"], c["perplexity"]])
                for b in r["positions"]["buckets"]:
                    w.writerow([r["name"], "position", b["start"], b["end"], "", b["loss"], b["perplexity"]])
        elif evaluation == "mqar":
            w.writerow(["model", "mixer", "layers", "state_bytes_fp32", "pairs", "answers", "accuracy", "chance",
                        "answer_loss"])
            for r in results:
                w.writerow([r["name"], r["mixer"], r["layer_pattern"], r["state_bytes_fp32"], r["task"]["num_pairs"],
                            r["answers"], r["accuracy"], r["chance"], r["answer_loss"]])
        else:
            w.writerow(["model", "task", "length", "depth_or_pairs", "accuracy", "answer_loss"])
            for r in results:
                for c in r.get("passkey", []):
                    w.writerow([r["name"], "passkey", c["length"], c["depth"], c["accuracy"], c["answer_loss"]])
                for c in r.get("mqar", []):
                    w.writerow([r["name"], "mqar", c["length"], c["pairs"], c["accuracy"], c["answer_loss"]])


def write_png(path: Path, evaluation: str, results: list[dict]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if evaluation == "mqar":   # Zoology's figure 2: accuracy against the state's size
        fig, ax = plt.subplots(figsize=(6, 3.8))
        for mixer in sorted({r["mixer"] for r in results}):
            mine = sorted((r for r in results if r["mixer"] == mixer), key=lambda r: r["state_bytes_fp32"])
            ax.plot([r["state_bytes_fp32"] for r in mine], [r["accuracy"] for r in mine], "o-", label=mixer)
        ax.set(xlabel="decode state (bytes, fp32)", ylabel="accuracy", xscale="log", ylim=(-0.02, 1.02))
        ax.legend(fontsize=8)
    elif evaluation == "perplexity":
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([r["name"] for r in results], [r["perplexity"] for r in results])
        ax.set_ylabel("perplexity")
    elif evaluation == "length":
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for r in results:
            a.plot([c["factor"] for c in r["contexts"]], [c["perplexity"] for c in r["contexts"]], "o-", label=r["name"])
            buckets = r["positions"]["buckets"]
            b.plot([(x["start"] + x["end"]) / 2 / r["train_length"] for x in buckets],
                   [x["perplexity"] for x in buckets], ".-", label=r["name"])
        a.set(xlabel="context (x training length)", ylabel="perplexity", yscale="log")
        b.set(xlabel="position (x training length)", ylabel="perplexity at that position", yscale="log")
        for ax in (a, b):
            ax.axvline(1.0, color="grey", lw=0.5)
            ax.legend(fontsize=8)
    else:
        with_passkey = [r for r in results if "passkey" in r]
        panels = len(with_passkey) + (1 if any("mqar" in r for r in results) else 0)
        fig, axes = plt.subplots(1, panels, figsize=(3.6 * panels, 3.4), squeeze=False)
        for ax, r in zip(axes[0], with_passkey):
            lengths = sorted({c["length"] for c in r["passkey"]})
            depths = sorted({c["depth"] for c in r["passkey"]})
            grid = np.array([[next(c["accuracy"] for c in r["passkey"] if c["length"] == n and c["depth"] == d)
                              for n in lengths] for d in depths])
            ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
            ax.set(xticks=range(len(lengths)), xticklabels=lengths, yticks=range(len(depths)), yticklabels=depths,
                   xlabel="prompt tokens", ylabel="needle depth", title=f"passkey: {r['name']}")
        if panels > len(with_passkey):
            ax = axes[0][-1]
            for r in results:
                if "mqar" in r:
                    ax.plot([c["pairs"] for c in r["mqar"]], [c["accuracy"] for c in r["mqar"]], "o-", label=r["name"])
            ax.set(xlabel="key-value pairs", ylabel="accuracy", ylim=(-0.02, 1.02), title="MQAR", xscale="log")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return True


def prepare_out(folder: Path, overwrite: bool) -> None:
    """--out: a new or empty folder, or (with --overwrite) one holding only an earlier eval's files."""
    if folder.exists() and not folder.is_dir():
        raise EvalError(f"--out {folder} is a file: give a folder.")
    if folder.is_dir():
        present = {p.name for p in folder.iterdir()}
        if present and not overwrite:
            raise EvalError(f"--out {folder} is not empty ({', '.join(sorted(present)[:4])}"
                            f"{', ...' if len(present) > 4 else ''}): give a new folder, or --overwrite to replace "
                            f"an earlier eval's results there.")
        foreign = present - set(RESULT_FILES)
        if present and (foreign or "results.json" not in present):
            raise EvalError(f"--out {folder} holds files that are not an earlier eval's results "
                            f"({', '.join(sorted(foreign or present)[:4])}): --overwrite replaces only those; "
                            f"give another folder.")
    from ..errors import check_writable   # before any checkpoint is scored, not after
    check_writable(folder, "--out")


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------- command line

def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="perplexity, length extrapolation and recall of checkpoints or exports",
                       description=__doc__.split("\n\n")[0], allow_abbrev=False)
    kinds = e.add_subparsers(dest="evaluation", required=True)

    def common(p):
        p.add_argument("--checkpoint", nargs="+", required=True,
                       help="training checkpoints (root or iter folder) or exported folders")
        p.add_argument("--name", nargs="+", default=None, help="a name per checkpoint for the tables (default: "
                       "the folder names)")
        p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one the checkpoint records)")
        p.add_argument("--allow-tokenizer-mismatch", action="store_true",
                       help="use a tokenizer (or data) other than the one the model was trained with, on purpose")
        p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
        p.add_argument("--chunk-size", type=int, default=2048, help="tokens per forward call; the state is carried "
                       "between chunks, so memory is bounded by it for the recurrent mixers (default 2048)")
        p.add_argument("--batch-size", type=int, default=8, help="windows scored together (default 8)")
        p.add_argument("--json", action="store_true", help="print the JSON summary instead of the table")
        p.add_argument("--out", type=Path, default=None, help="also write results.json/.md/.csv/.png here")
        p.add_argument("--overwrite", action="store_true", help="replace an earlier eval's results in --out")

    p = kinds.add_parser("perplexity", help="perplexity and bits per byte", allow_abbrev=False)
    common(p)
    src = p.add_argument_group("what to score (default: the checkpoint's own validation split)")
    src.add_argument("--data", nargs="+", default=None, help="indexed dataset prefix (or Megatron blend)")
    src.add_argument("--text", nargs="+", default=None, help=".txt or .jsonl(.gz/.zst) files instead")
    src.add_argument("--split", default=None, help="train,valid,test weights (default: the checkpoint's)")
    src.add_argument("--split-name", choices=["train", "valid", "test"], default="valid")
    src.add_argument("--seed", type=int, default=None, help="the dataset seed (default: the checkpoint's)")
    src.add_argument("--seq-length", type=int, default=None, help="window (default: the model's seq_length)")
    src.add_argument("--samples", type=int, default=None, help="samples the split's dataset is built with")
    src.add_argument("--first-sample", type=int, default=0)
    src.add_argument("--count", type=int, default=None, help="samples to score (default: all from --first-sample)")
    src.add_argument("--max-tokens", type=int, default=None, help="--text: score at most this many tokens")
    src.add_argument("--index-cache-dir", default=None)

    p = kinds.add_parser("length", help="perplexity at multiples of the training context, and by position",
                         allow_abbrev=False)
    common(p)
    p.add_argument("--text", nargs="+", required=True, help=".txt or .jsonl(.gz/.zst) files")
    p.add_argument("--factors", nargs="+", type=float, default=[0.5, 1, 2, 3.5, 4],
                   help="contexts as multiples of the training length (default 0.5 1 2 3.5 4)")
    p.add_argument("--max-tokens", type=int, default=65536, help="tokens scored per context (default 65536)")
    p.add_argument("--bucket", type=float, default=0.5, help="position buckets, x the training length (0.5)")

    p = kinds.add_parser("recall", help="passkey retrieval and multi-query associative recall", allow_abbrev=False)
    common(p)
    p.add_argument("--task", nargs="+", choices=["passkey", "mqar"], default=["passkey", "mqar"])
    p.add_argument("--factors", nargs="+", type=float, default=[0.5, 1, 2],
                   help="passkey prompt lengths, x the training length (default 0.5 1 2)")
    p.add_argument("--depths", nargs="+", type=float, default=[0, 0.25, 0.5, 0.75, 1])
    p.add_argument("--pairs", nargs="+", type=int, default=[4, 8, 16, 32], help="MQAR key-value pairs")
    p.add_argument("--samples", type=int, default=8, help="prompts per cell (default 8)")
    p.add_argument("--seed", type=int, default=1234)


    p = kinds.add_parser("mqar", allow_abbrev=False,
                         help="accuracy on the generated MQAR task of models trained with data.source=mqar")
    common(p)
    p.add_argument("--samples", type=int, default=1000, help="sequences scored (default 1000)")
    p.add_argument("--seed", type=int, default=None,
                   help="the task's seed (default: the checkpoint's; sequences come from its test split)")
    for key in ("pairs", "queries", "keys", "values"):
        p.add_argument(f"--num-{key}", type=int, default=None, help=f"data.mqar.num_{key} (default: the checkpoint's)")
    p.add_argument("--seq-length", type=int, default=None, help="the sequence length (default: the model's)")

    p = kinds.add_parser("lm-eval-tasks", allow_abbrev=False,
                         help="write local lm-evaluation-harness tasks (last word, rolling perplexity) from text")
    p.add_argument("--text", nargs="+", required=True, help=".txt or .jsonl(.gz/.zst) files")
    p.add_argument("--out", type=Path, required=True, help="a new or empty folder (lm_eval --include_path)")
    p.add_argument("--passages", type=int, default=200, help="last-word passages (default 200)")
    p.add_argument("--documents", type=int, default=50, help="documents for rolling perplexity (default 50)")
    p.add_argument("--seed", type=int, default=1234)


TASK_FILES = ("lastword.jsonl", "rolling.jsonl", "megatron_id_lastword.yaml", "megatron_id_rolling.yaml",
              "megatron_id_rolling_utils.py", "__pycache__")


def tasks_command(args) -> int:
    from .lm_eval_tasks import write_tasks
    if args.passages < 1 or args.documents < 1:
        raise EvalError("--passages and --documents must be at least 1.")
    if args.out.exists() and (not args.out.is_dir() or set(p.name for p in args.out.iterdir()) - set(TASK_FILES)):
        raise EvalError(f"--out {args.out} exists and holds other files than an earlier lm-eval-tasks output: "
                        f"give a new or empty folder.")
    try:
        made = write_tasks(read_documents(args.text), args.out, args.passages, args.seed, args.documents)
    except ValueError as err:
        raise EvalError(f"--text: {err}.") from None
    print(f"wrote {made['lastword']} last-word passages and {made['rolling']} documents to {args.out}; run:\n"
          f"  lm_eval --model hf --model_args pretrained=EXPORT,trust_remote_code=True --include_path {args.out} "
          f"--tasks megatron_id_lastword,megatron_id_rolling --batch_size auto")
    return 0


def check_args(args) -> None:
    # (option, value, within range, the range in words)
    rules = [("--chunk-size", args.chunk_size, args.chunk_size >= 1, "at least 1"),
             ("--batch-size", args.batch_size, args.batch_size >= 1, "at least 1")]
    if args.name is not None and len(args.name) != len(args.checkpoint):
        raise EvalError(f"--name gives {len(args.name)} names for {len(args.checkpoint)} checkpoints.")
    if args.evaluation == "perplexity":
        if args.data and args.text:
            raise EvalError("give --data or --text, not both.")
        rules += [(o, v, v is None or v >= 1, "at least 1") for o, v in (
            ("--seq-length", args.seq_length), ("--samples", args.samples), ("--count", args.count),
            ("--max-tokens", args.max_tokens))]
        rules.append(("--first-sample", args.first_sample, args.first_sample >= 0, "at least 0"))
    elif args.evaluation == "length":
        rules += [("--max-tokens", args.max_tokens, args.max_tokens >= 1, "at least 1"),
                  ("--bucket", args.bucket, args.bucket > 0, "more than 0")]
        rules += [("--factors", f, f > 0, "more than 0 (multiples of the training context, e.g. 1 2 4)")
                  for f in args.factors]
    elif args.evaluation == "mqar":
        rules += [("--samples", args.samples, args.samples >= 1, "at least 1")]
        rules += [(f"--{k.replace('_', '-')}", v, v is None or v >= 1, "at least 1") for k, v in (
            ("num_pairs", args.num_pairs), ("num_queries", args.num_queries), ("num_keys", args.num_keys),
            ("num_values", args.num_values), ("seq_length", args.seq_length))]
    else:
        rules += [("--samples", args.samples, args.samples >= 1, "at least 1")]
        rules += [("--depths", d, 0 <= d <= 1, "from 0 to 1 (a fraction of the context)") for d in args.depths]
        rules += [("--factors", f, f > 0, "more than 0 (multiples of the training context, e.g. 1 2 4)")
                  for f in args.factors]
        rules += [("--pairs", n, n >= 1, "at least 1") for n in args.pairs]
    for option, value, ok, valid in rules:
        if not ok:
            raise EvalError(f"{option} {value} is out of range: it must be {valid}.")
    from ..errors import BadOptionError
    from ..generation import resolve_device
    try:
        args.device = resolve_device(args.device)
    except BadOptionError as error:
        raise EvalError(str(error)) from None


def check_sources(args) -> None:
    """Every --checkpoint is found (and, for mqar, is a training checkpoint) before any is scored."""
    from ..checkpoint.read import checkpoint_folder
    from ..hf.export import read_export_config
    for source in args.checkpoint:
        export = (Path(source) / "config.json").is_file()
        if export and args.evaluation == "mqar":   # an export records no data settings
            raise EvalError(f"--checkpoint {source} is a Hugging Face export: `eval mqar` needs the training "
                            f"checkpoint (the train.save folder of a run with data.source=mqar, or one of its iter_ "
                            f"folders), whose record holds the task's settings and seed; an export does not keep them.")
        if export:
            read_export_config(source)
        else:
            checkpoint_folder(source, also_export=args.evaluation != "mqar")


def command(args) -> int:
    if args.evaluation == "lm-eval-tasks":
        return tasks_command(args)
    check_args(args)
    check_sources(args)
    if args.out is not None:
        prepare_out(args.out, args.overwrite)
    from ..data.tokenizer import token_bytes
    from ..generation import load_trained
    names = args.name or [Path(c).name if Path(c).name not in ("checkpoints", "hf") else
                          f"{Path(c).parent.name}/{Path(c).name}" for c in args.checkpoint]
    results = []
    for name, source in zip(names, args.checkpoint):
        if args.evaluation == "mqar":   # generated data: no tokenizer
            results.append({"name": name, "checkpoint": str(source), **run_mqar(source, args)})
            print(f"eval {args.evaluation}: {name} done", file=sys.stderr)
            continue
        trained = load_trained(source, args.tokenizer, args.allow_tokenizer_mismatch)
        trained.model.to(args.device)
        bytes_of = np.asarray(token_bytes(trained.tokenizer), dtype=np.int64)
        if args.evaluation == "perplexity":
            result = run_perplexity(trained, args, bytes_of)
        elif args.evaluation == "length":
            result = run_length(trained, args, bytes_of)
        else:
            result = run_recall(trained, args)
        mixer = getattr(trained.cfg.mixer, "value", trained.cfg.mixer)
        results.append({"name": name, "checkpoint": str(source), "mixer": str(mixer), **result})
        print(f"eval {args.evaluation}: {name} done", file=sys.stderr)
    summary = {"evaluation": args.evaluation, "options": _options(args), "results": results}
    text = markdown(args.evaluation, results)
    print(json.dumps(summary, indent=1) if args.json else text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        _atomic(args.out / "results.json", lambda p: p.write_text(json.dumps(summary, indent=1) + "\n"))
        _atomic(args.out / "results.md", lambda p: p.write_text(text + "\n"))
        _atomic(args.out / "results.csv", lambda p: write_csv(p, args.evaluation, results))
        drawn = [False]

        def png(p):
            drawn[0] = write_png(p, args.evaluation, results)
        _atomic(args.out / "results.png", png)
        if not drawn[0]:
            (args.out / "results.png").unlink(missing_ok=True)
            print("eval: note: results.png not drawn: matplotlib is not installed (pip install matplotlib).",
                  file=sys.stderr)
    return 0


def _options(args) -> dict:
    skip = {"json", "out", "overwrite", "device", "func", "command"}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items()) if k not in skip}
