"""train.eval_tasks: `megatron-id eval` on the model in training, at every validation.

    train.eval_tasks='[recall --task passkey mqar --samples 4, length --text val.jsonl --max-tokens 4096]'

Each entry is a `megatron-id eval` command without --checkpoint (recall, length, mqar; parsed by
commands/eval.py's own parser, so its defaults and checks are the command's), or `lm-eval
--include-path DIR --tasks NAME ...` (lm-evaluation-harness on local YAML, the model adapted
in-process as its export would load). At every train.eval_interval and at the last step, the
TP shards of the model are gathered into one TP=1 LanguageModel on rank 0 (the weights a
checkpoint of that step holds), which runs evaluation/run.py's `evaluate_trained` /
`score_mqar`, the functions `megatron-id eval` runs on a checkpoint: the same numbers by
construction (tests/test_eval_tasks.py). The other ranks wait. Training is not disturbed: the
copy is separate (the training module keeps its mode), the RNG states are restored after, and
the data position is untouched.

Logged as eval/<task>/<metric> (scalars: TensorBoard, train.metrics_file, wandb) and a console
line. Pipeline parallelism (PP > 1) is refused at start: the stages would have to be gathered
from several ranks first.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import random
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from ..config import Config, ConfigError, DataSource

TASKS = ("recall", "length", "mqar", "lm-eval")
# options of `megatron-id eval` the run decides: the model, its tokenizer, the device, no files
SET_BY_THE_RUN = ("--checkpoint", "--name", "--tokenizer", "--allow-tokenizer-mismatch", "--device", "--json",
                  "--out", "--overwrite")
EXAMPLE = "e.g. 'recall --task passkey --samples 8' or 'lm-eval --include-path eval/tasks --tasks megatron_id_lastword'"


def _lm_eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lm-eval", allow_abbrev=False)
    p.add_argument("--include-path", required=True, help="a folder of lm_eval task YAMLs (lm_eval --include_path)")
    p.add_argument("--tasks", nargs="+", required=True, help="task names in that folder")
    p.add_argument("--limit", type=int, default=None, help="documents per task (lm_eval --limit; default: all)")
    p.add_argument("--batch-size", type=int, default=8, help="requests scored together (default 8)")
    p.add_argument("--chunk-size", type=int, default=2048, help="the adapter's prefill chunk (default 2048)")
    return p


def _parse(words: list[str]) -> argparse.Namespace:
    """`megatron-id eval WORDS --checkpoint <the run>`, or lm-eval's options, by their parsers."""
    if words[0] == "lm-eval":
        args = _lm_eval_parser().parse_args(words[1:])
        args.evaluation = "lm-eval"
        return args
    from ..commands.eval import add_parser
    parser = argparse.ArgumentParser(prog="megatron-id", allow_abbrev=False)
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["eval", *words, "--checkpoint", "<the model in training>"])


def parse_eval_tasks(cfg: Config) -> list[argparse.Namespace]:
    """train.eval_tasks as parsed commands, or a ConfigError naming the entry, its value and the fix."""
    out, seen = [], set()
    for i, spec in enumerate(cfg.train.eval_tasks):
        key = f"train.eval_tasks[{i}]={spec!r}"
        words = shlex.split(str(spec))
        if not words or words[0] not in TASKS:
            raise ConfigError(f"{key} is not a task: each entry is one of {', '.join(TASKS)} with its options "
                              f"({EXAMPLE}).")
        given = [w.split("=")[0] for w in words if w.split("=")[0] in SET_BY_THE_RUN]
        if given:
            raise ConfigError(f"{key}: {given[0]} is set by the run (the model in training, data.tokenizer, the "
                              f"training device, the metrics): remove it.")
        if words[0] in seen:
            raise ConfigError(f"{key}: a second '{words[0]}' entry; its metrics would share names "
                              f"(eval/<task>/...): give one entry per task.")
        seen.add(words[0])
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                args = _parse(words)
        except SystemExit:
            error = [line for line in said.getvalue().splitlines() if "error:" in line]
            why = error[-1].split("error:", 1)[1].strip() if error else "not understood"
            raise ConfigError(f"{key}: {why} (the options of `megatron-id eval {words[0]} --help`).") from None
        out.append(args)
    return out


def check_eval_tasks(cfg: Config, layout) -> list[argparse.Namespace]:
    """What train.eval_tasks cannot run with, before any work (training_layout calls it)."""
    tasks = parse_eval_tasks(cfg)
    if not tasks:
        return tasks
    if layout.pipe > 1:
        raise ConfigError(f"train.eval_tasks with parallel.pipeline_model_parallel_size={layout.pipe}: the in-loop "
                          f"evaluations run at PP=1 only (any TP/DP); set train.eval_tasks=[] and run `megatron-id "
                          f"eval` on the checkpoints instead.")
    mqar_run = cfg.data.source == DataSource.mqar
    for i, args in enumerate(tasks):
        key = f"train.eval_tasks[{i}]={cfg.train.eval_tasks[i]!r}"
        if args.evaluation == "mqar" and not mqar_run:
            raise ConfigError(f"{key}: `eval mqar` scores the generated task of data.source=mqar, and this run reads "
                              f"data.source={cfg.data.source.value}: use 'recall --task mqar' for a model of text.")
        if args.evaluation != "mqar" and (mqar_run or not cfg.data.tokenizer):
            why = "data.source=mqar has no tokenizer" if mqar_run else "data.tokenizer is not set"
            raise ConfigError(f"{key} reads text through the run's tokenizer, and {why}: set data.tokenizer, or "
                              f"remove the entry.")
        for path in getattr(args, "text", None) or []:
            if not Path(path).is_file():
                raise ConfigError(f"{key}: --text {path} is not a file.")
        if args.evaluation == "lm-eval":
            check_lm_eval(key, args)
    return tasks


def check_lm_eval(key: str, args) -> None:
    if importlib.util.find_spec("lm_eval") is None:   # (not imported here: it imports torch)
        raise ConfigError(f"{key} needs lm-evaluation-harness, which is not installed: pip install -e '.[eval]' "
                          f"(or remove the entry).")
    folder = Path(args.include_path)
    if not folder.is_dir():
        raise ConfigError(f"{key}: --include-path {folder} is not a folder of task YAMLs (`megatron-id eval "
                          f"lm-eval-tasks --out {folder}` writes one).")
    for option, value in (("--limit", args.limit), ("--batch-size", args.batch_size),
                          ("--chunk-size", args.chunk_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}: {option} {value} must be at least 1.")


# ---------------------------------------------------------------- metric names

def _g(x: float) -> str:
    return f"{x:g}"


def task_scalars(args, result: dict) -> dict[str, float]:
    """One evaluation's result (as `megatron-id eval --json` gives it) -> eval/<task>/<metric>."""
    out = {}
    if args.evaluation == "recall":
        for task, cells in result.items():
            name = "passkey" if task == "passkey" else "recall_mqar"
            per = "factor" if task == "passkey" else "pairs"
            out[f"eval/{name}/accuracy"] = sum(c["accuracy"] for c in cells) / len(cells)
            out[f"eval/{name}/answer_loss"] = sum(c["answer_loss"] for c in cells) / len(cells)
            for value in dict.fromkeys(c[per] for c in cells):
                mine = [c["accuracy"] for c in cells if c[per] == value]
                suffix = f"{_g(value)}x" if per == "factor" else f"{value}pairs"
                out[f"eval/{name}/accuracy_{suffix}"] = sum(mine) / len(mine)
    elif args.evaluation == "length":
        for c in result["contexts"]:
            out[f"eval/length/loss_{_g(c['factor'])}x"] = c["loss"]
            out[f"eval/length/perplexity_{_g(c['factor'])}x"] = c["perplexity"]
        for b in result["positions"]["buckets"]:
            out[f"eval/length/loss_at_{b['start']}-{b['end']}"] = b["loss"]
    elif args.evaluation == "mqar":
        out["eval/mqar/accuracy"] = result["accuracy"]
        out["eval/mqar/answer_loss"] = result["answer_loss"]
    else:
        for task, metrics in result.items():
            for metric, value in metrics.items():
                out[f"eval/{task}/{metric}"] = value
    return {k: float(v) for k, v in out.items()}


def console_line(step: int, scalars: dict, seconds: dict) -> str:
    """`eval tasks at step 4 | passkey accuracy 0.250 | ... | 1.2 s (recall 0.8, length 0.4)`:
    each task's first metric (all of them: the JSONL file and TensorBoard)."""
    shown = {}
    for name, value in scalars.items():
        task = name.split("/")[1]
        shown.setdefault(task, f"{task} {name.split('/', 2)[2]} {value:.4g}")
    times = ", ".join(f"{k} {v:.1f}" for k, v in seconds.items())
    return f"eval tasks at step {step} | {' | '.join(shown.values())} | {sum(seconds.values()):.1f} s ({times})"


# ---------------------------------------------------------------- the evaluations in the loop

class DownstreamEvals:
    """train.eval_tasks of one Trainer; `run(trainer, metrics)` at each validation."""

    def __init__(self, cfg: Config, layout):
        self.tasks = check_eval_tasks(cfg, layout)
        # every rank: {entry: the result as `megatron-id eval --json` gives it} of the last evaluation
        self.last_results = None
        self._model = None

    def run(self, trainer, metrics) -> None:
        if not self.tasks:
            return
        import torch.distributed as dist
        model = self._gathered_model(trainer)   # every rank takes part; rank 0 gets the model
        payload = None
        if dist.get_rank() == 0:
            payload = self._evaluate(trainer, model)
        box = [payload]
        dist.broadcast_object_list(box, src=0)   # the others wait here for rank 0
        scalars, seconds, self.last_results = box[0]
        metrics.scalars(scalars, trainer.step)
        if dist.get_rank() == 0:
            print(console_line(trainer.step, scalars, seconds), file=sys.stderr, flush=True)

    def _gathered_model(self, trainer):
        """The TP=1 LanguageModel of the engine's current weights on rank 0 (None elsewhere):
        each TP shard (gathered over data parallelism first at ZeRO-3) sent to rank 0 and merged
        as the checkpoint reader merges them (parallel/tensor_parallel.merge_state_dicts)."""
        import torch
        import torch.distributed as dist

        from ..model import LanguageModel
        from ..parallel import state
        from ..parallel.tensor_parallel import merge_state_dicts
        module = trainer.engine.module
        gathered = contextlib.nullcontext()
        if trainer.cfg.train.zero_stage == 3:
            import deepspeed
            gathered = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        with gathered:
            local = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        group = state.get_tensor_model_parallel_group()
        if 0 not in dist.get_process_group_ranks(group):
            return None
        shards = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
        dist.gather_object(local, shards, dst=0, group=group)
        if dist.get_rank() != 0:
            return None
        with torch.random.fork_rng(devices=[]):   # building a module draws nothing, but never risk it
            if self._model is None:
                self._model = LanguageModel(trainer.cfg.model, seed=None).eval()
            self._model.load_state_dict(merge_state_dicts(shards, trainer.cfg.model), strict=True)
        return self._model.to(trainer.device)

    def _evaluate(self, trainer, model) -> tuple[dict, dict, dict]:
        import numpy as np
        import torch

        from ..data.tokenizer import eod_id, load_tokenizer
        from ..evaluation.run import evaluate_trained, score_mqar
        from ..inference.generate import Trained
        device = torch.device(trainer.device)
        cfg = trainer.cfg
        tokenizer = load_tokenizer(str(cfg.data.tokenizer)) if cfg.data.source != DataSource.mqar else None
        trained = Trained(model, tokenizer, eod_id(tokenizer) if tokenizer else None, cfg.model,
                          SimpleNamespace(data=trainer.data_record()), Path(str(cfg.data.tokenizer)), None)
        scalars, seconds, results = {}, {}, {}
        devices = [device] if device.type == "cuda" else []
        python_rng, numpy_rng = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for spec, args in zip(cfg.train.eval_tasks, self.tasks):
                started = time.perf_counter()
                args.device = device
                if args.evaluation == "mqar":
                    result = score_mqar(model, cfg.model, trained.client.data, args)
                elif args.evaluation == "lm-eval":
                    from ..evaluation.lm_eval_model import lm_eval_scores
                    result = lm_eval_scores(model, cfg.model, Path(str(cfg.data.tokenizer)), args)
                else:
                    result = evaluate_trained(trained, args)
                results[spec] = result
                scalars.update(task_scalars(args, result))
                seconds[args.evaluation] = time.perf_counter() - started
        random.setstate(python_rng)
        np.random.set_state(numpy_rng)
        return scalars, seconds, results
