"""`megatron-id eval`: perplexity, length extrapolation and recall, for one or more checkpoints.

    megatron-id eval perplexity --checkpoint runs/a/checkpoints [runs/b/hf ...] \\
        [--data PREFIX [--split 969,30,1 --split-name valid --seed S --samples N] | --text FILE ...]
    megatron-id eval length --checkpoint A B --text val.jsonl.zst --factors 0.5 1 2 3.5 4 --out eval/length
    megatron-id eval recall --checkpoint A B --task passkey mqar --seed 1234 --out eval/recall

The evaluations themselves: evaluation/run.py (its docstring says what each scores); the tables
and the --out files: evaluation/report.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..evaluation.report import markdown, write_results


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="perplexity, length extrapolation and recall of checkpoints or exports",
                       description=__doc__.split("\n\n")[0], allow_abbrev=False)
    e.set_defaults(func=run)
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
    p.add_argument("--carry-state", action="store_true",
                   help="read each document in windows of the training length with the state carried between "
                        "them, as data.carry_state trains (--batch-size rows); factor F: the perplexity of the "
                        "predictions less than F x the training length into their document")

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


def run(args) -> int:
    # torch (evaluation/run.py scores with it): not at import (cli.py)
    from ..evaluation.run import check_args, check_sources, evaluate, options, prepare_out, tasks_command
    if args.evaluation == "lm-eval-tasks":
        return tasks_command(args)
    check_args(args)
    check_sources(args)
    if args.out is not None:
        prepare_out(args.out, args.overwrite)
    results = evaluate(args)
    summary = {"evaluation": args.evaluation, "options": options(args), "results": results}
    text = markdown(args.evaluation, results)
    print(json.dumps(summary, indent=1) if args.json else text)
    if args.out is not None:
        write_results(args.out, args.evaluation, summary, text)
    return 0
