"""`megatron-id job-prepare` (for job scripts): resolve, record and check a training config
before srun (training/job.py)."""
from __future__ import annotations

import argparse
import sys

from .options import add_config_args, parse_with_overrides_anywhere


def add_parser(sub) -> None:
    j = sub.add_parser("job-prepare", allow_abbrev=False,
                       help="(for job scripts) resolve, record and check a training config before srun")
    j.add_argument("--run-dir", required=True)
    j.add_argument("--world-size", type=int, required=True)
    j.add_argument("--job-id", required=True)
    j.add_argument("--attempt", type=int, default=0)
    j.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then megatron-id train's arguments")
    j.set_defaults(func=run)


def run(args) -> int:
    """For launch/slurm/train.sbatch: resolve and record the config, check the layout against
    the job's tasks, print key=value lines for the script (training/job.py)."""
    from ..training.job import prepare, shell_lines  # torch: not at import (cli.py)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    parsed = argparse.ArgumentParser(prog="megatron-id train", allow_abbrev=False)
    add_config_args(parsed)
    parsed = parse_with_overrides_anywhere(parsed, train_args)
    values = prepare(args.run_dir, parsed.config, parsed.overrides, world_size=args.world_size,
                     job_id=args.job_id, attempt=args.attempt, check_run=True)   # train's own checks too
    sys.stdout.write(shell_lines(values))
    return 0
