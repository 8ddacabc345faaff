"""Clean exits: N consecutive short training runs (tiny model, 2 ranks under torchrun, a few
steps, a checkpoint) must all exit 0. A run that trains and then aborts at exit breaks SLURM
`afterok` chains and requeue logic (issue 10).

    python benchmarks/exit_codes.py [--runs 50] [--out runs/exit-codes]

Prints a table: exit status -> runs, and the wall time per run.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--out", default=None, help="folder for data, checkpoints and logs (default: a temp folder)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="exit-codes-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    prefix = out / "data" / "fineweb"
    if not Path(f"{prefix}_text_document.bin").exists():
        subprocess.run([sys.executable, "-m", "data_tools.preprocess", "--input",
                        str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"), "--tokenizer",
                        str(ROOT / "tests/data/gpt2-tokenizer.json"), "--output-prefix", str(prefix),
                        "--append-eod", "--no-progress"], check=True, env=env, cwd=ROOT)
    statuses, times, failures = collections.Counter(), [], []
    for i in range(args.runs):
        ckpt = out / f"ckpt-{i}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megatron_id.cli", "train", "--config", "configs/model/tiny.yaml",
               f"data.data_path=[{prefix}_text_document]", "data.split=90,10,0", "model.vocab_size=50257",
               "train.precision=fp32", "train.micro_batch_size=2", "train.global_batch_size=4",
               "train.train_tokens=768", "train.eval_interval=2", "train.eval_iters=1",
               f"train.save={ckpt}", f"train.tensorboard_dir={out / f'tb-{i}'}"]
        start = time.time()
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        times.append(time.time() - start)
        statuses[done.returncode] += 1
        finished = "finished at step 3" in done.stderr
        if done.returncode != 0 or not finished:
            log = out / f"run-{i}.log"
            log.write_text(done.stdout + done.stderr)
            failures.append(f"run {i}: exit {done.returncode}, finished={finished}, log {log}")
        print(f"run {i + 1}/{args.runs}: exit {done.returncode} ({times[-1]:.1f} s)", file=sys.stderr, flush=True)
    print("\n| exit status | runs |\n|---|---|")
    for status, n in sorted(statuses.items()):
        print(f"| {status} | {n} |")
    print(f"\n{args.runs} runs, {statuses[0]} exited 0; wall time per run: "
          f"min {min(times):.1f} s, mean {sum(times) / len(times):.1f} s, max {max(times):.1f} s")
    for line in failures:
        print(line)
    return 0 if statuses[0] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
