#!/usr/bin/env python3
"""Preprocess a corpus on SLURM: a job array tokenizes slices of the input files in parallel, then
one dependent job merges the parts into the same .bin/.idx a single `megatron-id preprocess` run
over all the files (in the same order) would write, byte for byte.

    python launch/slurm/preprocess_submit.py --array-size 8 --output-prefix data/fineweb \\
        [--overwrite] [--partition P] [--time 4:00:00] [--merge-time 1:00:00] \\
        [--cpus-per-task 8] [--max-running K] [--sbatch-arg=--account=A ...] [--keep-parts] \\
        [--dry-run] \\
        -- --tokenizer tokenizer.json --append-eod [other preprocess flags] \\
        -- data/shard-*.jsonl

Between the two `--`: the flags of `megatron-id preprocess` (= python -m data_tools.preprocess),
except --input and --output-prefix, which are given here (inputs after the second `--`: files,
globs or folders, expanded exactly as preprocess expands --input; their order is the order of
the output). --overwrite may be given in either place. Output: <output-prefix>_<key>_document
.{bin,idx,meta.json} for each --json-keys key (Megatron's naming; `_text_document` by default).

What it does, in order:
  1. checks everything a preprocess run would check before working (its flags, the inputs, the
     tokenizer, the output folder) and refuses an existing output without --overwrite, so
     nothing is submitted for a command that would fail;
  2. cuts the input list into N contiguous slices of about equal size in bytes (N = --array-size,
     or the number of inputs when there are fewer; it says so). Contiguous, not round-robin: the
     merge appends part 0, 1, ..., N-1, which is the input order again;
  3. writes the work folder <output-prefix>.preprocess/:
        files.txt           every input, one absolute path per line, in order
        parts/part-<i>.txt  the inputs of array task i, one per line
        parts/part-<i>_<key>_document.{bin,idx,meta.json}   its output (removed after the merge
                            unless --keep-parts)
        logs/preprocess-<array job>_<task>.out, logs/merge-<job>.out
        jobs.txt            the job ids (a second submission is refused while they are queued)
     (parts and lists of an earlier submission are replaced);
  4. submits launch/slurm/preprocess.sbatch as `sbatch --array=0-(N-1)`, then
     launch/slurm/merge.sbatch with --dependency=afterok:<array job> --kill-on-invalid-dep=yes:
     the merge starts once every task has succeeded, and SLURM cancels it (Reason
     DependencyNeverSatisfied) as soon as one fails. It prints both job ids and the log paths.
--dry-run does steps 1 and 2 and prints the sbatch commands; it writes and submits nothing.

The jobs run in the current folder with this environment (sbatch passes it on); the jobs'
interpreter is MEGATRON_ID_PYTHON, set to this Python unless already set. --time sets both jobs'
limit (--merge-time the merge's alone); without them the scripts' defaults apply (4 h per task,
2 h for the merge). --cpus-per-task also sets each task's --workers unless the flags set it.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))   # run from a checkout without installing: the repo root

from data_tools.outputs import check_outputs, check_prefix, make_folder, remove_folders  # noqa: E402
from data_tools.preprocess import PreprocessError, output_prefix  # noqa: E402
from data_tools.preprocess import build_parser as preprocess_parser  # noqa: E402
from data_tools.readers import expand_inputs  # noqa: E402
from megatron_id.data.tokenizer import eod_id, load_tokenizer  # noqa: E402
from megatron_id.errors import UserError, run_guarded  # noqa: E402

PROG = "preprocess_submit"
PREPROCESS_SBATCH = HERE / "preprocess.sbatch"
MERGE_SBATCH = HERE / "merge.sbatch"
PART_FILE = re.compile(r"part-\d+(\.txt|_.+_document(\.bin|\.idx|\.meta\.json))$")


class SubmitError(UserError, ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python launch/slurm/preprocess_submit.py", allow_abbrev=False,
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --array-size N --output-prefix PREFIX [options] -- PREPROCESS FLAGS -- INPUT...")
    p.add_argument("--array-size", type=int, required=True, metavar="N",
                   help="number of array tasks (parts); at most the number of inputs")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="as for preprocess: writes <prefix>_<key>_document.{bin,idx,meta.json}")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output (once the merged one is complete)")
    p.add_argument("--partition", metavar="P", help="sbatch --partition for both jobs")
    p.add_argument("--time", metavar="T", help="sbatch --time for both jobs (default: 4:00:00 per task, 2:00:00 merge)")
    p.add_argument("--merge-time", metavar="T", help="sbatch --time for the merge job alone")
    p.add_argument("--cpus-per-task", type=int, metavar="C",
                   help="sbatch --cpus-per-task of each array task (default 4); also its --workers")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="another sbatch option for both jobs, e.g. --sbatch-arg=--account=A (repeat)")
    p.add_argument("--max-running", type=int, metavar="K",
                   help="at most K array tasks at once (sbatch --array=0-(N-1)%%K)")
    p.add_argument("--keep-parts", action="store_true", help="keep the parts after the merge")
    p.add_argument("--dry-run", action="store_true", help="check and print the sbatch commands only")
    return p


def split_command_line(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """OPTIONS -- PREPROCESS FLAGS -- INPUTS."""
    if "--" not in argv:
        raise SubmitError("no `--` in the command line: give the preprocess flags after a first "
                          "`--` and the input files after a second one (see --help).")
    first = argv.index("--")
    rest = argv[first + 1:]
    if "--" not in rest:
        raise SubmitError("no input files: give them after a second `--`, following the preprocess "
                          "flags (... -- --tokenizer tok.json --append-eod -- data/*.jsonl).")
    second = rest.index("--")
    return argv[:first], rest[:second], rest[second + 1:]


def contiguous_slices(sizes: list[int], n: int) -> list[tuple[int, int]]:
    """n non-empty contiguous [start, end) ranges over len(sizes) >= n items, cut where the
    running total of sizes is nearest to k/n of the whole."""
    m = len(sizes)
    cumulative = [0]
    for s in sizes:
        cumulative.append(cumulative[-1] + s)
    total = cumulative[-1]
    bounds = [0]
    for k in range(1, n):
        low, high = bounds[-1] + 1, m - (n - k)    # each slice keeps at least one item
        target = total * k / n
        bounds.append(min(range(low, high + 1), key=lambda j: (abs(cumulative[j] - target), j)))
    bounds.append(m)
    return list(zip(bounds, bounds[1:]))


def size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return str(n)


def queued_jobs(jobs_file: Path) -> list[str]:
    """The jobs of an earlier submission into the same work folder that are still queued or
    running (their parts would be overwritten under them)."""
    if not jobs_file.is_file():
        return []
    ids = [line.split()[-1] for line in jobs_file.read_text().splitlines() if line.split()]
    if not ids:
        return []
    try:
        done = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []   # no squeue: sbatch will not work either, and says so
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def sbatch(command: list[str], env: dict) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        raise SubmitError(f"{shlex.join(command)} failed (exit {done.returncode}): "
                          f"{done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    options = argv[:argv.index("--")] if "--" in argv else argv
    if "-h" in options or "--help" in options:
        build_parser().print_help()
        return 0

    def body() -> int:
        return submit(argv)
    return run_guarded(PROG, body)


def submit(argv: list[str]) -> int:
    args, flags, inputs = parse_command_line(argv)
    job = check_like_preprocess(args, flags, inputs)   # 1.
    slice_inputs(job)                                  # 2.
    array_cmd = array_command(job)
    print_plan(job)
    if args.dry_run:
        print("dry run: nothing written or submitted; the commands would be:")
        print("  " + shlex.join(array_cmd))
        print("  " + shlex.join(merge_command(job, "<array job id>")))
        return 0
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch not found: run this where SLURM's client commands are installed "
                          "(a login node), or add --dry-run to see the commands.")
    created = write_work_folder(job)                   # 3.
    array_id, merge_id = submit_jobs(job, array_cmd, created)   # 4.
    print_submitted(job, array_id, merge_id)
    return 0


@dataclass
class Job:
    """What one submission works on, filled in step by step (the numbers of the module docstring)."""
    args: argparse.Namespace    # this helper's options
    flags: list[str]            # the preprocess flags, less --overwrite
    pre: argparse.Namespace     # the preprocess run they make, over every input
    prefix: Path                # --output-prefix, absolute
    files: list[Path]           # the inputs, expanded, absolute, in order
    finals: list[str]           # the merged outputs' prefixes, one per --json-keys key
    work: Path                  # <output-prefix>.preprocess
    n: int = 0                  # array tasks
    sizes: list[int] = field(default_factory=list)               # bytes per input
    slices: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of the inputs per task

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    @property
    def parts(self) -> Path:
        return self.work / "parts"

    def common_sbatch(self) -> list[str]:
        """The sbatch options both jobs get."""
        return ([f"--partition={self.args.partition}"] if self.args.partition else []) + self.args.sbatch_arg


def parse_command_line(argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """This helper's options (checked), the preprocess flags and the inputs."""
    options, flags, inputs = split_command_line(argv)
    args = build_parser().parse_args(options)
    for flag in flags:
        name = flag.split("=", 1)[0]
        if name in ("--input", "--output-prefix"):
            raise SubmitError(f"{name} among the preprocess flags: give the output prefix before the "
                              f"first `--` (--output-prefix) and the inputs after the second `--`.")
    if "--overwrite" in flags:
        args.overwrite = True
        flags = [f for f in flags if f != "--overwrite"]
    if not inputs:
        raise SubmitError("no input files after the second `--`.")
    if args.array_size < 1:
        raise SubmitError(f"--array-size {args.array_size}: must be at least 1.")
    for flag, value in (("--cpus-per-task", args.cpus_per_task), ("--max-running", args.max_running)):
        if value is not None and value < 1:
            raise SubmitError(f"{flag} {value}: must be at least 1.")
    return args, flags, inputs


def check_like_preprocess(args, flags: list[str], inputs: list[str]) -> Job:
    """Step 1: everything preprocess checks before working, with the same messages; and no
    earlier submission for this output still queued."""
    check_prefix(args.output_prefix, "--output-prefix", "fineweb", "{}_text_document.bin/.idx")
    prefix = Path(args.output_prefix).absolute()
    parser = preprocess_parser()
    parser.prog = f"{PROG} (the preprocess flags between the two `--`)"
    pre = parser.parse_args([*flags, "--input", *inputs, "--output-prefix", str(prefix)])
    if pre.workers < 1:
        raise PreprocessError(f"--workers {pre.workers}: must be at least 1.")
    if pre.partitions < 1:
        raise PreprocessError(f"--partitions {pre.partitions}: must be at least 1.")
    tokenizer = load_tokenizer(pre.tokenizer, pre.vocab_file, pre.merge_file)
    if pre.append_eod:
        eod_id(tokenizer, pre.eod_token)
    files = [p.absolute() for p in expand_inputs(pre.input)]
    bad = [str(p) for p in files if "\n" in str(p)]
    if bad:
        raise SubmitError(f"input {bad[0]!r} has a newline in its name: the file lists hold one "
                          f"path per line; rename it.")
    finals = [output_prefix(str(prefix), k) for k in pre.json_keys]
    check_outputs([Path(f"{p}{ext}") for p in finals for ext in (".bin", ".idx")], "--output-prefix",
                  args.output_prefix, args.overwrite)
    work = Path(f"{prefix}.preprocess")
    if work.exists() and not work.is_dir():
        raise SubmitError(f"{work} (the work folder of --output-prefix {args.output_prefix}) is a "
                          f"file: move it away.")
    queued = queued_jobs(work / "jobs.txt")
    if queued:
        raise SubmitError(f"jobs of an earlier submission for this output are still queued or "
                          f"running ({'; '.join(queued)}): wait for them or scancel them first "
                          f"(their parts are in {work}/parts).")
    return Job(args, flags, pre, prefix, files, finals, work)


def slice_inputs(job: Job) -> None:
    """Step 2: contiguous slices of about equal bytes, no more than there are inputs."""
    n = job.args.array_size
    if n > len(job.files):
        print(f"{PROG}: --array-size {n} is more than the {len(job.files)} input"
              f"{'s' if len(job.files) > 1 else ''}: using {len(job.files)} array task"
              f"{'s' if len(job.files) > 1 else ''} (one input each)", file=sys.stderr)
        n = len(job.files)
    job.n = n
    job.sizes = [size_of(p) for p in job.files]
    job.slices = contiguous_slices(job.sizes, n)


def array_command(job: Job) -> list[str]:
    """The sbatch command of the array job (launch/slurm/preprocess.sbatch)."""
    args = job.args
    throttle = f"%{args.max_running}" if args.max_running else ""
    cmd = ["sbatch", "--parsable", f"--array=0-{job.n - 1}{throttle}",
           f"--output={job.logs}/preprocess-%A_%a.out", *job.common_sbatch()]
    if args.time:
        cmd.append(f"--time={args.time}")
    if args.cpus_per_task:
        cmd.append(f"--cpus-per-task={args.cpus_per_task}")
    return cmd + [str(PREPROCESS_SBATCH), str(job.work), *job.flags]


def merge_command(job: Job, array_id: str) -> list[str]:
    """The sbatch command of the merge job (launch/slurm/merge.sbatch), after array job `array_id`."""
    args = job.args
    cmd = ["sbatch", "--parsable", f"--dependency=afterok:{array_id}", "--kill-on-invalid-dep=yes",
           f"--output={job.logs}/merge-%j.out", *job.common_sbatch()]
    merge_time = args.merge_time or args.time
    if merge_time:
        cmd.append(f"--time={merge_time}")
    cmd.append(str(MERGE_SBATCH))
    cmd += ["--overwrite"] if args.overwrite else []
    cmd += ["--keep-parts"] if args.keep_parts else []
    return cmd + [str(job.work), str(job.prefix), *job.pre.json_keys]


def print_plan(job: Job) -> None:
    """The inputs and the part each array task gets."""
    files, sizes, n = job.files, job.sizes, job.n
    print(f"{PROG}: {len(files)} input{'s' if len(files) > 1 else ''}, {human(sum(sizes))}, in {n} "
          f"contiguous part{'s' if n > 1 else ''} (merged in input order):")
    for i, (a, b) in enumerate(job.slices):
        span = files[a].name if b - a == 1 else f"{files[a].name} .. {files[b - 1].name}"
        print(f"  part {i}: {b - a} input{'s' if b - a > 1 else ''}, {human(sum(sizes[a:b]))} ({span})")


def write_work_folder(job: Job) -> list[Path]:
    """Step 3: the work folder with the input lists (an earlier submission's parts and lists
    replaced); returns the folders created (make_folder's list), for removal if nothing is submitted."""
    created = make_folder(job.work)
    for folder in (job.logs, job.parts):
        folder.mkdir(parents=True, exist_ok=True)
    for old in job.parts.iterdir():
        if PART_FILE.fullmatch(old.name) and old.is_file():
            old.unlink()
    (job.work / "jobs.txt").unlink(missing_ok=True)
    (job.work / "files.txt").write_text("".join(f"{p}\n" for p in job.files))
    for i, (a, b) in enumerate(job.slices):
        (job.parts / f"part-{i}.txt").write_text("".join(f"{p}\n" for p in job.files[a:b]))
    return created


def submit_jobs(job: Job, array_cmd: list[str], created: list[Path]) -> tuple[str, str]:
    """Step 4: the array job, then the merge depending on it, their ids in jobs.txt. Nothing is
    left behind when the array job is refused; the array job is cancelled when the merge is."""
    env = dict(os.environ)
    env.setdefault("MEGATRON_ID_PYTHON", sys.executable)
    try:
        array_id = sbatch(array_cmd, env)
    except SubmitError:
        if created:   # nothing was submitted: leave nothing behind
            shutil.rmtree(job.work, ignore_errors=True)
            remove_folders(created[1:])
        raise
    (job.work / "jobs.txt").write_text(f"preprocess {array_id}\n")
    try:
        merge_id = sbatch(merge_command(job, array_id), env)
    except SubmitError:
        subprocess.run(["scancel", array_id], capture_output=True, timeout=60)
        print(f"{PROG}: the merge job could not be submitted: array job {array_id} was cancelled",
              file=sys.stderr)
        raise
    (job.work / "jobs.txt").write_text(f"preprocess {array_id}\nmerge {merge_id}\n")
    return array_id, merge_id


def print_submitted(job: Job, array_id: str, merge_id: str) -> None:
    outputs = ", ".join(f"{p}.{{bin,idx,meta.json}}" for p in job.finals)
    print(f"submitted preprocess array job {array_id} (tasks 0-{job.n - 1})")
    print(f"submitted merge job {merge_id} (starts when every task has succeeded; cancelled, "
          f"Reason=DependencyNeverSatisfied, if one fails)")
    print(f"  logs:   {job.logs}/preprocess-{array_id}_<task>.out, {job.logs}/merge-{merge_id}.out")
    print(f"  output: {outputs}")
    print(f"  check:  squeue -j {array_id},{merge_id}; scontrol show job {merge_id} (JobState, Reason)")


if __name__ == "__main__":
    sys.exit(main())
