"""What a batch job (launch/slurm/train.sbatch) settles before it starts any rank.

`megatron-id job-prepare --run-dir D --world-size N --job-id J --attempt A -- <train arguments>`
resolves the config the ranks will train with, fills in the job defaults, records the resolved
config, checks the layout against the job's task count, and prints what the job script needs
as `key=value` lines:

    override=train.save=D/checkpoints      (only when train.save is unset)
    override=train.load=D/checkpoints      (only when train.load is unset: resume from `latest`)
    override=train.metrics_file=D/metrics.jsonl   (only when unset)
    save=...  config_record=...  tensor=2 pipe=1 data=2  step=40  train_iters=96

Defaults for jobs [our choice, Megatron's habit]: checkpoints go to `<run dir>/checkpoints`,
every step's scalars to `<run dir>/metrics.jsonl`, and `train.load` is `train.save`, so a
requeued or chained job resumes from `latest` with the
same command; a first run finds no checkpoint there and starts from scratch. A config or
layout error is reported here, once, before srun starts a process per GPU.
"""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from ..atomic import write_atomic_text
from ..checkpoint.files import latest_folder
from ..config import load_config, to_yaml
from ..errors import UserError
from .engine import check_run as train_checks
from .engine import run_warnings
from .layout import training_layout
from .plan import run_estimate_gib


class JobLayoutError(UserError):
    """The job's tasks do not match its GPUs (one task per GPU)."""


def check_one_task_per_gpu(env: dict) -> None:
    """On GPU nodes a rank drives the GPU its local rank names: fewer tasks than GPUs per node
    leaves GPUs idle for the whole allocation, more puts two ranks on one GPU (NCCL refuses).
    SLURM_GPUS_ON_NODE is set when the job asked for GPUs (--gpus-per-node, --gres=gpu:N)."""
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    tasks = env.get("SLURM_TASKS_PER_NODE", "").split("(")[0].split(",")[0]
    if not gpus.isdigit() or not tasks.isdigit() or int(gpus) == 0:
        return
    gpus, tasks = int(gpus), int(tasks)
    if tasks != gpus:
        what = (f"{gpus - tasks} of the {gpus} GPUs per node would stay idle" if tasks < gpus
                else f"{tasks - gpus} GPU(s) per node would hold two ranks")
        raise JobLayoutError(
            f"the job has {tasks} task(s) and {gpus} GPU(s) per node: {what}. One task per GPU: "
            f"sbatch --ntasks-per-node={gpus} --gpus-per-node={gpus} (or MEGATRON_ID_DEVICE=cpu "
            f"for a CPU run).")


def prepare(run_dir: Path, config_files: list[str], overrides: list[str], *, world_size: int,
            job_id: str, attempt: int, env: dict | None = None, check_run: bool = False) -> dict:
    """check_run: also run train's own checks before any work (the data, tokenizers, folders,
    the checkpoint resumed: training/engine.py check_run) and print its warnings to stderr, so
    that a config train would refuse is refused here, before srun starts a process per GPU
    (`megatron-id job-prepare` sets it)."""
    run_dir = Path(run_dir)
    env = dict(os.environ) if env is None else env
    if world_size < 1:
        raise JobLayoutError(f"--world-size {world_size}: a job has at least 1 task (its training processes; "
                             f"the job scripts pass SLURM_NTASKS or --nproc).")
    if attempt < 0:
        raise JobLayoutError(f"--attempt {attempt}: at least 0 (the job's restart count, SLURM_RESTART_COUNT).")
    if not job_id or "/" in job_id or job_id in (".", ".."):
        raise JobLayoutError(f"--job-id {job_id!r}: give a job id without '/' (it names the config record "
                             f"<run dir>/logs/<job id>.<attempt>.config.yaml), e.g. SLURM_JOB_ID.")
    on_gpu = env.get("MEGATRON_ID_DEVICE", "gpu") == "gpu"
    if on_gpu:
        check_one_task_per_gpu(env)
    cfg = load_config(config_files, overrides)
    extra = []
    save = cfg.train.save
    if not save:
        save = str(run_dir / "checkpoints")
        extra.append(f"train.save={save}")
    if not cfg.train.load:
        extra.append(f"train.load={save}")
    if not cfg.train.metrics_file:   # every step's scalars in the run folder, without any service
        extra.append(f"train.metrics_file={run_dir / 'metrics.jsonl'}")
    cfg = load_config(config_files, [*overrides, *extra])
    layout = training_layout(cfg, world_size)
    if check_run:
        train_checks(cfg, layout, on_gpu)
        for line in run_warnings(cfg, layout, world_size):
            print(f"warning: {line}", file=sys.stderr, flush=True)
    memory_gib = run_estimate_gib(cfg, layout, on_gpu)
    latest = latest_folder(save)
    step = int(latest.name.removeprefix("iter_")) if latest is not None else 0
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    record = logs / f"{job_id}.{attempt}.config.yaml"
    arguments = [a for f in config_files for a in ("--config", f)] + [*overrides, *extra]
    write_atomic_text(record, f"# SLURM job {job_id}, attempt {attempt}: the resolved config of\n"
                              f"# megatron-id train {shlex.join(arguments)}\n" + to_yaml(cfg))
    return {"override": extra, "save": save, "load": cfg.train.load, "config_record": str(record),
            "tensor": layout.tensor, "pipe": layout.pipe, "data": layout.data,
            "micro_batch": layout.micro_batch_size, "accumulation": layout.gradient_accumulation,
            "memory_gib": f"{memory_gib:.1f}",
            "step": step, "train_iters": layout.train_iters, "max_restarts": cfg.train.max_restarts,
            "mixer": cfg.model.mixer.value,
            "model": f"d_model={cfg.model.d_model} n_layers={cfg.model.n_layers}"}


def shell_lines(values: dict) -> str:
    """One `key=value` line per value (a list gives one line per item); values hold no newline."""
    lines = []
    for key, value in values.items():
        for item in value if isinstance(value, list) else [value]:
            text = str(item)
            if "\n" in text:
                raise ValueError(f"{key}={text!r} holds a newline, which the job script cannot read")
            lines.append(f"{key}={text}")
    return "\n".join(lines) + "\n"
