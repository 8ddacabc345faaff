#!/usr/bin/env python3
"""The paper's scaling grid (launch/scaling/grid.yaml): show it, or submit it to SLURM.

    python launch/scaling/grid.py --dry-run                 # a table and the sbatch commands
    python launch/scaling/grid.py --dry-run --json          # the same as JSON
    python launch/scaling/grid.py --only '^125m' --chain 3 --set data.data_path=/data/fw_text_document

Each cell (`125m-interdomain`, `1p3b-softmax`, `125m-cube-no-rope`, `125m-hybrid`, ...) becomes one
`sbatch ... launch/slurm/train.sbatch --config configs/model/<scale>.yaml key=value ...` job.
Every number shown comes from the package itself, not from a second copy of its rules:
parameters from the model built on the meta device (as `megatron-id params`), steps from the
engine's `training_layout`, the parallel layout and its memory per GPU from the planner's
recommendation (as `megatron-id plan`), and every cell's overrides are loaded through
`load_config` before anything is printed or submitted.

`--chain N` submits N jobs per cell, each starting after the previous one ends
(`--dependency=afterany`): the job script resumes from the run's checkpoints, so a run longer
than the time limit continues in the next job, and a job of a finished run exits at once.
Paths in the commands are relative to the repository root; sbatch is run there.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from megatron_id.config import load_config
from megatron_id.errors import UserError, run_guarded

# megatron_id.training.plan, .layout and .model.accounting import torch (seconds): they are
# imported where a cell is described, so that a mistyped flag or --only is answered at once.
GiB = 1024 ** 3

ROOT = Path(__file__).resolve().parents[2]
GRID = Path(__file__).resolve().with_name("grid.yaml")
JOB_SCRIPT = "launch/slurm/train.sbatch"
PROG = "grid.py"
# set per cell, so never by --set or grid.yaml's overrides (the planner's estimate would no
# longer describe the job, or a cell would no longer be the one its name says)
PER_CELL_KEYS = {"model.mixer", "model.query_readout", "model.dual_kv_input", "model.rope",
                 "model.layer_pattern", "model.window",
                 "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                 "train.zero_stage", "train.micro_batch_size", "train.activation_checkpointing"}


class GridError(UserError):
    """A problem with the grid, the flags or the submission, phrased for the user."""


@dataclass
class Cell:
    name: str
    scale: str
    mixer: str
    cube: str | None              # the cube cell's name, None for a scale x mixer cell
    config: str                   # model config, relative to the repository root
    nodes: int
    gpus_per_node: int
    overrides: list[str]          # mixer / cube switches, recipe, extra; the layout is added later
    paper_ppl: float | None
    same_as: list[str] = field(default_factory=list)   # cube names that are this same run


# ---------------------------------------------------------------------------------------------
# Reading grid.yaml

def _number(value, where: str, kind=float):
    """A positive number from grid.yaml; ints may be written 2_500_000_000 or 2.5e9."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GridError(f"{GRID.name}: {where} = {value!r} is not a number.")
    if kind is int:
        if value != int(value):
            raise GridError(f"{GRID.name}: {where} = {value!r} must be a whole number.")
        value = int(value)
    if value <= 0:
        raise GridError(f"{GRID.name}: {where} = {value!r} must be positive.")
    return value


def load_grid(path: Path = GRID) -> dict:
    try:
        # OmegaConf's YAML reader, as for the configs: 3e-3 is a float (plain PyYAML: a string)
        grid = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as err:   # missing file or YAML errors of several types
        raise GridError(f"cannot read {path}: {err}") from None
    for key in ("recipe", "scales", "mixers", "cube", "slurm", "gpus_per_node"):
        if key not in grid:
            raise GridError(f"{path.name}: the key '{key}' is missing.")
    return grid


def expand(grid: dict, nodes_override: dict, gpus_per_node: int | None,
           extra: list[str]) -> tuple[list[Cell], dict[str, str]]:
    """Every cell of the grid, in the file's order, and {cube alias: cell name} for the cube
    cells that are the same run as a scale x mixer cell."""
    recipe = grid["recipe"]
    gpn = gpus_per_node or _number(grid["gpus_per_node"], "gpus_per_node", int)
    shared = [f"model.seq_length={_number(recipe['seq_length'], 'recipe.seq_length', int)}",
              f"train.global_batch_size={_number(recipe['global_batch_size'], 'recipe.global_batch_size', int)}",
              f"optimizer.warmup_tokens={_number(recipe['warmup_tokens'], 'recipe.warmup_tokens', int)}",
              f"optimizer.min_lr={_number(recipe['min_lr'], 'recipe.min_lr')!r}",
              f"train.precision={recipe['precision']}"]
    unknown = set(nodes_override) - set(grid["scales"])
    if unknown:
        raise GridError(f"--nodes names unknown scale(s) {', '.join(sorted(unknown))}; "
                        f"scales: {', '.join(grid['scales'])}.")

    def scale_cell(scale: str, name: str, mixer: str, cube, switches: list[str], ppl) -> Cell:
        s = grid["scales"][scale]
        where = f"scales.{scale}"
        own = [f"optimizer.lr={_number(s['lr'], where + '.lr')!r}",
               f"train.train_tokens={_number(s['train_tokens'], where + '.train_tokens', int)}"]
        nodes = nodes_override.get(scale) or _number(s["nodes"], where + ".nodes", int)
        return Cell(name, scale, mixer, cube, s["config"], nodes, gpn,
                    switches + own + shared + list(grid.get("overrides") or []) + list(extra), ppl)

    cells = []
    for scale, s in grid["scales"].items():
        for mixer in grid["mixers"]:
            cells.append(scale_cell(scale, f"{scale}-{mixer}", mixer, None, [f"model.mixer={mixer}"],
                                    (s.get("paper_ppl") or {}).get(mixer)))
    by_name = {c.name: c for c in cells}
    aliases = {}
    cube = grid["cube"]
    if cube["scale"] not in grid["scales"]:
        raise GridError(f"{GRID.name}: cube.scale '{cube['scale']}' is not one of the scales.")
    for entry in cube["cells"]:
        alias = f"{cube['scale']}-cube-{entry['name']}"
        if entry.get("same_as"):
            if entry["same_as"] not in by_name:
                raise GridError(f"{GRID.name}: cube cell '{entry['name']}' is same_as "
                                f"'{entry['same_as']}', which is not a cell.")
            aliases[alias] = entry["same_as"]
            by_name[entry["same_as"]].same_as.append(alias)
            continue
        switches = list(entry["overrides"])
        mixer = next((o.split("=", 1)[1] for o in switches if o.startswith("model.mixer=")), None)
        if mixer is None:
            raise GridError(f"{GRID.name}: cube cell '{entry['name']}' must set model.mixer.")
        cells.append(scale_cell(cube["scale"], alias, mixer, entry["name"], switches, entry.get("paper_ppl")))
    for entry in grid.get("hybrids") or []:   # not the paper's: hybrids of its shapes (model/pattern.py)
        scale = entry.get("scale")
        if scale not in grid["scales"]:
            raise GridError(f"{GRID.name}: hybrid cell '{entry.get('name')}' has scale {scale!r}, which is "
                            f"not one of the scales ({', '.join(grid['scales'])}).")
        switches = list(entry.get("overrides") or [])
        if not any(o.startswith("model.layer_pattern=") for o in switches) and not entry.get("config"):
            raise GridError(f"{GRID.name}: hybrid cell '{entry.get('name')}' must set model.layer_pattern "
                            f"(in its overrides) or a config that has one.")
        cell = scale_cell(scale, f"{scale}-{entry['name']}", "hybrid", None, switches, None)
        cell.config = entry.get("config") or cell.config
        cells.append(cell)
    return cells, aliases


# ---------------------------------------------------------------------------------------------
# One cell: the package's own numbers and the command

def describe(cell: Cell, gpu_memory: float, max_micro_batch: int, slurm: dict, runs_dir: Path) -> dict:
    """Everything the dry run shows for one cell; raises GridError when nothing fits."""
    from megatron_id.model.accounting import report
    from megatron_id.training.layout import training_layout
    from megatron_id.training.plan import plan, recommend
    world = cell.nodes * cell.gpus_per_node
    try:
        cfg = load_config([ROOT / cell.config], cell.overrides)
    except UserError as err:
        raise GridError(f"cell {cell.name}: {err}") from None
    # the planner's pick among the layouts the engine accepts (same defaults as `megatron-id plan`)
    best, why = recommend(plan(cfg, world, gpu_memory, max_micro_batch=max_micro_batch))
    if best is None:
        raise GridError(f"cell {cell.name}: no layout fits {cell.nodes} x {cell.gpus_per_node} GPUs "
                        f"of {gpu_memory / GiB:.0f} GiB ({why}); give it more nodes with "
                        f"--nodes {cell.scale}=N or more memory with --gpu-memory.")
    overrides = cell.overrides + [
        f"parallel.tensor_model_parallel_size={best.tensor}",
        f"parallel.pipeline_model_parallel_size={best.pipe}",
        f"train.zero_stage={best.zero_stage}",
        f"train.micro_batch_size={best.micro_batch_size}",
        f"train.activation_checkpointing={str(best.activation_checkpointing).lower()}"]
    # the exact config the job will run, through the same loader and the engine's layout checks
    try:
        cfg = load_config([ROOT / cell.config], overrides)
        layout = training_layout(cfg, world)
    except UserError as err:
        raise GridError(f"cell {cell.name}: {err}") from None
    # The engine sets the LR of step s (0-based) from the s x tokens_per_step tokens consumed
    # before it (Trainer.train_step); the steps still in the linear ramp are those with
    # s x tokens_per_step < warmup_tokens: ceil(warmup_tokens / tokens_per_step) of them.
    warmup_steps = math.ceil(cfg.optimizer.warmup_tokens / layout.tokens_per_step)
    run_dir = runs_dir / cell.name
    argv = ["sbatch", f"--job-name={cell.name}", f"--nodes={cell.nodes}",
            f"--ntasks-per-node={cell.gpus_per_node}", f"--gpus-per-node={cell.gpus_per_node}",
            f"--time={slurm['time']}"]
    argv += [f"--partition={slurm['partition']}"] if slurm.get("partition") else []
    argv += [f"--account={slurm['account']}"] if slurm.get("account") else []
    argv += [f"--export=ALL,MEGATRON_ID_RUN_DIR={run_dir}", JOB_SCRIPT, "--config", cell.config, *overrides]
    m = cfg.model
    return {
        "name": cell.name, "scale": cell.scale, "mixer": cell.mixer, "cube": cell.cube,
        "same_as": cell.same_as,
        "switches": {"query_readout": m.query_readout, "dual_kv_input": m.dual_kv_input, "rope": m.rope},
        "config": cell.config, "overrides": overrides,
        "parameters": report(m).parameters,
        "train_tokens": cfg.train.train_tokens, "tokens_per_step": layout.tokens_per_step,
        "steps": layout.train_iters, "warmup_tokens": cfg.optimizer.warmup_tokens,
        "warmup_steps": warmup_steps, "lr": cfg.optimizer.lr, "min_lr": cfg.optimizer.min_lr,
        "nodes": cell.nodes, "gpus_per_node": cell.gpus_per_node, "gpus": world,
        "layout": {"tensor": layout.tensor, "pipe": layout.pipe, "data": layout.data,
                   "zero_stage": cfg.train.zero_stage, "micro_batch_size": layout.micro_batch_size,
                   "gradient_accumulation": layout.gradient_accumulation,
                   "activation_checkpointing": cfg.train.activation_checkpointing},
        "memory_per_gpu": best.total, "gpu_memory": gpu_memory, "plan_reason": why,
        "paper_ppl": cell.paper_ppl, "run_dir": str(run_dir),
        "sbatch": argv, "command": shlex.join(argv),
    }


# ---------------------------------------------------------------------------------------------
# Output

def print_table(rows: list[dict], aliases: dict, gpu_memory: float, chain: int) -> None:
    header = ["cell", "params", "tokens", "steps", "warmup", "lr", "GPUs", "TP", "PP", "DP", "ZeRO",
              "mb", "GA", "ckpt", "GiB/GPU"]
    lines = [[r["name"], f"{r['parameters'] / 1e6:,.1f}M", f"{r['train_tokens'] / 1e9:g}B",
              f"{r['steps']:,}", f"{r['warmup_steps']:,}", f"{r['lr']:g}",
              f"{r['nodes']}x{r['gpus_per_node']}", *(str(r["layout"][k]) for k in
              ("tensor", "pipe", "data", "zero_stage", "micro_batch_size", "gradient_accumulation")),
              "yes" if r["layout"]["activation_checkpointing"] else "no",
              f"{r['memory_per_gpu'] / GiB:.1f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    for line in [header] + lines:   # names left-aligned, numbers right-aligned
        print("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths))))
    first = rows[0]
    print(f"\nsteps of {first['tokens_per_step']:,} tokens; warmup = steps in the linear LR ramp "
          f"({first['warmup_tokens']:,} tokens), then cosine to {first['min_lr']:g}; GiB/GPU = the "
          f"planner's estimate for its recommended layout, fits = <= 90% of {gpu_memory / GiB:g} GiB.")
    shown = {r["name"] for r in rows}
    same = [f"{a} = {c}" for a, c in aliases.items() if c in shown]
    if same:
        print("cube cells that are the same run: " + ", ".join(same) + ".")
    if chain > 1:
        print(f"--chain {chain}: each command is submitted {chain} times, each job with "
              f"--dependency=afterany:<the previous job of the cell>.")
    print()
    for r in rows:
        print(r["command"])


# ---------------------------------------------------------------------------------------------
# Submission

def submit(rows: list[dict], chain: int) -> None:
    """N jobs per cell, job k+1 waiting for job k to end (`afterany`: also after a time-out or a
    failure, since the next job resumes from the last checkpoint; a finished run exits at once)."""
    submitted = []
    for r in rows:
        ids = []
        for _ in range(chain):
            argv = ["sbatch", "--parsable"] + ([f"--dependency=afterany:{ids[-1]}"] if ids else []) + r["sbatch"][1:]
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
            # --parsable prints "<job id>" or "<job id>;<cluster>"
            job = done.stdout.strip().split(";")[0]
            if done.returncode != 0 or not job.isdigit():
                so_far = "; ".join(submitted + ([f"{r['name']} {' '.join(ids)}"] if ids else [])) or "nothing"
                raise GridError(f"sbatch failed for {r['name']} (exit {done.returncode}): "
                                f"{(done.stderr or done.stdout).strip() or 'no output'}. Submitted before "
                                f"it: {so_far}.")
            ids.append(job)
        submitted.append(f"{r['name']} {' '.join(ids)}")
        print(f"{r['name']}: {' -> '.join(ids)}", flush=True)


# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--dry-run", action="store_true", help="print the cells and commands; submit nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the cells as JSON")
    p.add_argument("--only", metavar="REGEX", help="cells whose name matches (re.search), e.g. '^125m' or 'softmax'")
    p.add_argument("--gpu-memory", default="80GiB", help="memory per GPU for the planner (default 80GiB)")
    p.add_argument("--max-micro-batch", type=int, default=64,
                   help="largest micro-batch the planner tries (powers of two; default 64)")
    p.add_argument("--nodes", action="append", default=[], metavar="SCALE=N",
                   help="nodes for one scale instead of grid.yaml's (repeat for several), e.g. 1p3b=8")
    p.add_argument("--gpus-per-node", type=int, help="instead of grid.yaml's gpus_per_node")
    p.add_argument("--chain", type=int, default=1, metavar="N",
                   help="jobs per cell, each after the previous one ends (afterany); default 1")
    p.add_argument("--time", help="per job, SLURM's format (e.g. 24:00:00, 2-00:00:00); default from grid.yaml")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--runs-dir", default="runs/scaling",
                   help="each cell runs in <runs-dir>/<cell> (checkpoints under it); default runs/scaling")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="extra",
                   help="an override for every cell, e.g. data.data_path=/data/fw_text_document (repeat)")
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_guarded(PROG, lambda: run(args))


def run(args) -> int:
    grid = load_grid()
    if args.json and not args.dry_run:
        raise GridError("--json describes a dry run: add --dry-run.")
    if args.chain < 1:
        raise GridError(f"--chain {args.chain}: must be at least 1.")
    if args.max_micro_batch < 1:
        raise GridError(f"--max-micro-batch {args.max_micro_batch}: must be at least 1.")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise GridError(f"--gpus-per-node {args.gpus_per_node}: must be at least 1.")
    nodes = {}
    for item in args.nodes:
        scale, _, n = item.partition("=")
        if not n.isdigit() or int(n) < 1:
            raise GridError(f"--nodes {item}: write SCALE=N with N >= 1, e.g. --nodes 1p3b=8.")
        nodes[scale] = int(n)
    slurm = dict(grid["slurm"])
    for key in ("time", "partition", "account"):
        if getattr(args, key):
            slurm[key] = getattr(args, key)
    # SLURM's forms: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
    if not re.fullmatch(r"(\d+-\d+(:\d{1,2}){0,2}|\d+(:\d{1,2}){0,2})", str(slurm["time"])):
        raise GridError(f"--time {slurm['time']}: not a SLURM time; write HH:MM:SS or D-HH:MM:SS.")
    runs_dir = Path(args.runs_dir).expanduser().absolute()   # the job may start anywhere
    if "," in str(runs_dir):   # --export=ALL,VAR=value is comma-separated
        raise GridError(f"--runs-dir {runs_dir}: a comma cannot be passed through sbatch --export.")
    for item in args.extra + list(grid.get("overrides") or []):
        key = item.split("=", 1)[0].strip()
        if "=" not in item:
            raise GridError(f"--set {item}: write KEY=VALUE, e.g. --set data.data_path=/data/fw_text_document.")
        if key in PER_CELL_KEYS:
            raise GridError(f"{item}: {key} is chosen per cell (the mixer and cube switches by the "
                            f"grid, the layout by the planner); use --only to pick cells, or "
                            f"--nodes / --gpu-memory to change what the planner picks.")

    cells, aliases = expand(grid, nodes, args.gpus_per_node, args.extra)
    names = [c.name for c in cells]
    if args.only:
        try:
            pattern = re.compile(args.only)
        except re.error as err:
            raise GridError(f"--only {args.only!r} is not a regular expression ({err}).") from None
        # a cube alias selects the run it names
        chosen = {c.name for c in cells if pattern.search(c.name)}
        chosen |= {target for alias, target in aliases.items() if pattern.search(alias)}
        cells = [c for c in cells if c.name in chosen]
        if not cells:
            raise GridError(f"--only {args.only!r} matches no cell; cells: "
                            f"{', '.join(names)}.")
    if not args.dry_run:   # before the planner's seconds: what would stop the submission anyway
        if shutil.which("sbatch") is None:
            raise GridError("sbatch not found on PATH: submit from a SLURM login node, or use "
                            "--dry-run to print the commands without submitting.")
        if not any(o.startswith("data.data_path=") for o in cells[0].overrides):
            raise GridError("no data.data_path for the jobs: every one would fail at startup. Pass "
                            "--set data.data_path=<prefix> (or add it to overrides in grid.yaml).")
    from megatron_id.config import parse_size
    gpu_memory = parse_size(args.gpu_memory, "--gpu-memory")
    if gpu_memory <= 0:
        raise GridError(f"--gpu-memory {args.gpu_memory}: must be positive.")
    rows = [describe(c, gpu_memory, args.max_micro_batch, slurm, runs_dir) for c in cells]

    if args.dry_run:
        if args.json:
            print(json.dumps({"gpu_memory": gpu_memory, "chain": args.chain, "cells": rows,
                              "same_as": {a: t for a, t in aliases.items() if t in {r["name"] for r in rows}}},
                             indent=1))
        else:
            print_table(rows, aliases, gpu_memory, args.chain)
            _warn_without_data(rows)
        return 0
    submit(rows, args.chain)
    return 0


def _warn_without_data(rows: list[dict]) -> None:
    if not any(o.startswith("data.data_path=") for o in rows[0]["overrides"]):
        print("\nnote: no data.data_path yet; submitting needs --set data.data_path=<prefix> "
              "(or overrides in grid.yaml).", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
