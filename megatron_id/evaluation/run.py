"""The evaluations of `megatron-id eval` (its flags: commands/eval.py; its tables and files:
report.py): perplexity, length extrapolation and recall, for one or more checkpoints.

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

import dataclasses
import gzip
import io
import json
import math
import random
import sys
from pathlib import Path

import numpy as np

from ..checkpoint.read import checkpoint_folder, read_checkpoint
from ..data.gpt_dataset import build_gpt_datasets, default_cache_dir, parse_data_path, split_ranges
from ..data.indexed_dataset import IndexedDataset
from ..data.mqar import MQARTask, score
from ..data.tokenizer import MISMATCH_FLAG, check_same_tokenizer, dataset_tokenizer, token_bytes
from ..errors import BadOptionError, UserError, check_writable
from ..hf.export import read_export_config
from ..inference.generate import load_trained, resolve_device
from ..model.accounting import report
from ..model.language_model import LanguageModel
from ..model.pattern import layer_mixer
from .lm_eval_tasks import write_tasks
from .recall import mqar, mqar_correct, passkey, passkey_correct
from .report import RESULT_FILES
from .scoring import carried_position_losses, score_windows, windows


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
    for _, prefix in parse_data_path(data_path):
        identity, path = dataset_tokenizer(prefix)
        check_same_tokenizer((f"--data {prefix}", identity, path),
                             (f"the tokenizer {trained.tokenizer_path}", trained.tokenizer_id, None),
                             f"Score data preprocessed with the model's tokenizer, or pass {MISMATCH_FLAG} "
                             f"to score it anyway.", allow=allow)


def gpt_rows(trained, args) -> tuple[np.ndarray, dict]:
    """The trainer's samples of the validation (or another) split, as [count, seq_length + 1]."""
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
    if args.carry_state:
        return run_length_carried(trained, args, token_bytes, stream)
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


def run_length_carried(trained, args, token_bytes, stream: np.ndarray) -> dict:
    """`eval length --carry-state`: the documents read as data.carry_state trains on them, in
    windows of the training length, each row's state carried from window to window and reset at
    every document start (training/carry.py); the loss by position in the document, so the
    factor F is the perplexity of every prediction made less than F x the training length into
    its document (one number per factor, as the windowed table)."""
    length = trained.cfg.seq_length
    growing = sorted({layer_mixer(trained.cfg, i) for i in range(trained.cfg.n_layers)} & {"softmax", "sliding"})
    if growing:
        raise EvalError(f"--carry-state reads whole documents through a fixed state, and this model has "
                        f"{'/'.join(growing)} layers, whose KV cache would grow with every window: evaluate it "
                        f"without --carry-state (its windows at each factor).")
    horizon = max(1, round(max(args.factors) * length))
    rows = document_rows(stream, trained.eod, args.batch_size)
    usable = min(len(r) for r in rows) - 1
    n_windows = min(usable // length, max(1, args.max_tokens // (length * len(rows))))
    if n_windows < 1:
        raise EvalError(f"--text holds {len(stream):,} tokens: too few for {len(rows)} rows of one window of "
                        f"{length + 1} tokens (--batch-size {args.batch_size}). Give more text or a smaller "
                        f"--batch-size.")
    rows = np.stack([r[:n_windows * length + 1] for r in rows])
    at, beyond = carried_position_losses(trained.model, rows, length, trained.eod, horizon, token_bytes, args.device)
    contexts = []
    for factor in args.factors:
        upto = max(1, round(factor * length))
        loss, count, nbytes = (float(a[:upto].sum()) for a in at)
        mean = loss / count if count else float("nan")
        contexts.append({"factor": factor, "context": upto, "loss": mean, "perplexity": math.exp(mean),
                         "bits_per_byte": loss / math.log(2) / nbytes if nbytes else None,
                         "tokens": int(count), "bytes": int(nbytes)})
    one = next((c for c in contexts if c["factor"] == 1), None)
    for c in contexts:
        c["vs_1x"] = c["perplexity"] / one["perplexity"] if one else None
    width = max(1, round(args.bucket * length))
    buckets = []
    for start in range(0, horizon, width):
        loss, count = float(at[0][start:start + width].sum()), float(at[1][start:start + width].sum())
        mean = loss / count if count else float("nan")
        buckets.append({"start": start, "end": min(start + width, horizon), "loss": mean,
                        "perplexity": math.exp(mean) if count else float("nan"), "tokens": int(count)})
    return {"train_length": length, "max_tokens": args.max_tokens, "carry_state": True, "rows": len(rows),
            "windows_per_row": n_windows, "tokens_beyond": beyond, "contexts": contexts,
            "positions": {"context": horizon, "bucket": width, "buckets": buckets}}


def document_rows(stream: np.ndarray, eod: int, count: int) -> list[np.ndarray]:
    """`count` pieces of the stream of about equal length, each cut right after an EOD (every
    row starts at a document's first token, so positions in documents are exact)."""
    ends = np.flatnonzero(stream == eod) + 1
    cuts = [0]
    for i in range(1, count):
        after = ends[ends >= i * len(stream) // count]
        if len(after) and after[0] > cuts[-1] and after[0] < len(stream):
            cuts.append(int(after[0]))
    cuts.append(len(stream))
    return [stream[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if b - a > 1]


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
    folder, client, cfg, weights = read_checkpoint(source)
    data = client.data or {}
    if data.get("source") != "mqar":
        raise EvalError(f"{folder} was not trained with data.source=mqar (its data: "
                        f"{data.get('data_path') or 'not recorded'}): `eval mqar` scores the generated task; "
                        f"for a model of text use `eval recall --task mqar`.")
    model = LanguageModel(cfg, seed=None)
    model.load_state_dict(weights, strict=True)
    return score_mqar(model.eval().to(args.device), cfg, data, args)


def score_mqar(model, cfg, data: dict, args) -> dict:
    """run_mqar's scores of a loaded model (eval mode, on args.device), given the data settings
    its checkpoint records (Trainer.data_record): also train.eval_tasks' `mqar` in the loop."""
    settings = {**data["mqar"], **{k: getattr(args, k) for k in ("num_pairs", "num_queries", "num_keys", "num_values")
                                   if getattr(args, k) is not None}}
    seq_length = args.seq_length or cfg.seq_length
    window = seq_length // data.get("carry_grad_windows", 1) if settings.get("query_window") else 0
    task = MQARTask(seq_length, **settings, window=window)
    task.check(cfg.vocab_size)
    seed = data["seed"] if args.seed is None else args.seed
    result = score(model, task, seed, args.samples, args.batch_size, args.device,
                   carry=bool(data.get("carry_state")))   # episodes read as the model was trained
    counts = report(cfg)
    state = counts.decode_state(task.seq_length)
    return {**result, "seed": seed, "task": dataclasses.asdict(task),
            "mixer": str(getattr(cfg.mixer, "value", cfg.mixer)),
            "layer_pattern": counts.layer_pattern, "state_numbers": state, "state_bytes_fp32": 4 * state,
            "parameters": counts.parameters}


# ---------------------------------------------------------------- the command's checks and steps

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
    check_writable(folder, "--out")   # before any checkpoint is scored, not after


TASK_FILES = ("lastword.jsonl", "rolling.jsonl", "megatron_id_lastword.yaml", "megatron_id_rolling.yaml",
              "megatron_id_rolling_utils.py", "__pycache__")


def tasks_command(args) -> int:
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
    try:
        args.device = resolve_device(args.device)
    except BadOptionError as error:
        raise EvalError(str(error)) from None


def check_sources(args) -> None:
    """Every --checkpoint is found (and, for mqar, is a training checkpoint) before any is scored."""
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


def evaluate(args) -> list[dict]:
    """Every --checkpoint scored by `args.evaluation` (checked by check_args and check_sources
    first): a result per checkpoint, with its name, in the order given."""
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
        mixer = getattr(trained.cfg.mixer, "value", trained.cfg.mixer)
        results.append({"name": name, "checkpoint": str(source), "mixer": str(mixer),
                        **evaluate_trained(trained, args)})
        print(f"eval {args.evaluation}: {name} done", file=sys.stderr)
    return results


def evaluate_trained(trained, args) -> dict:
    """One evaluation (perplexity, length or recall) of a loaded model (trained.model on
    args.device, eval mode): what `evaluate` reports per checkpoint, and what train.eval_tasks
    reports of the model in training (training/downstream.py), by the same code."""
    bytes_of = np.asarray(token_bytes(trained.tokenizer), dtype=np.int64)
    if args.evaluation == "perplexity":
        return run_perplexity(trained, args, bytes_of)
    if args.evaluation == "length":
        return run_length(trained, args, bytes_of)
    return run_recall(trained, args)


def options(args) -> dict:
    """The JSON summary's record of the options (none that depend on the machine or the output)."""
    skip = {"json", "out", "overwrite", "device", "func", "command"}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items()) if k not in skip}
