"""How long a checkpoint save holds up the training loop: train.async_save=false (the files
written in the save call) against true (a host copy in the call, the files written by a thread).

    python benchmarks/async_save.py                      # 125M shape, ~3 min on 2 cores
    python benchmarks/async_save.py --config configs/model/tiny.yaml

One process (gloo, ZeRO-1, fp32), the model of --config at 128 tokens per sample: a few steps,
then a save, then steps again. For each mode: the seconds the save call blocked the loop, the
seconds until the checkpoint was committed, and the mean time of the 3 steps after the save
against the 3 before (the background writer shares the machine with them). The checkpoint
holds the fp32 weights and Adam's two moments: 16 bytes per parameter, plus DeepSpeed's fp32
partition copy.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def _measure(rank, world, items, save):
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([], items))

    def steps(n):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - t)
        return times
    steps(2)   # warm-up
    before = steps(3)
    t = time.perf_counter()
    trainer.save_checkpoint(save)
    blocked = time.perf_counter() - t
    after = steps(3)
    trainer.wait_for_saves()
    committed = time.perf_counter() - t
    size = sum(f.stat().st_size for f in Path(save).rglob("*") if f.is_file())
    trainer.close()
    return {"blocked": blocked, "committed": committed, "before": sum(before) / 3, "after": sum(after) / 3,
            "bytes": size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/model/125m.yaml"))
    args = ap.parse_args(argv)
    if not Path(args.config).is_file():
        ap.error(f"--config {args.config}: no such file")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from distributed import run_distributed

    from data_tools.preprocess import main as preprocess
    work = Path(tempfile.mkdtemp(prefix="async_save_"))
    try:
        assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"),
                           "--tokenizer", str(ROOT / "tests/data/gpt2-tokenizer.json"),
                           "--output-prefix", str(work / "fineweb"), "--append-eod", "--no-progress"]) == 0
        rows = {}
        for mode in ("false", "true"):
            items = [f"data.data_path=[{work / 'fineweb_text_document'}]", "data.split=100,0,0",
                     "model.vocab_size=50257", "model.seq_length=128", "train.precision=fp32", "train.zero_stage=1",
                     "train.micro_batch_size=1", "train.global_batch_size=1", "train.train_tokens=100000",
                     f"train.async_save={mode}", f"train.save={work / ('ckpt-' + mode)}", "train.eval_iters=0"]
            import yaml
            model = yaml.safe_load(Path(args.config).read_text()).get("model", {})
            items = [f"model.{k}={v}" for k, v in model.items() if k not in ("vocab_size", "seq_length")] + items
            rows[mode] = run_distributed(_measure, 1, args=(items, str(work / ("ckpt-" + mode))), timeout=1800,
                                         collective_timeout=1800)[0]
            print(f"  measured async_save={mode}", file=sys.stderr, flush=True)
        print(f"# a save of {rows['false']['bytes'] / 2**30:.2f} GiB ({Path(args.config).name}, ZeRO-1, fp32), "
              "one CPU process\n")
        print("| train.async_save | save call blocks the loop | committed after | step before | step after (3 steps) |")
        print("|---|---|---|---|---|")
        for mode, r in rows.items():
            print(f"| {mode} | {r['blocked']:.2f} s | {r['committed']:.2f} s | {r['before']:.2f} s | "
                  f"{r['after']:.2f} s |")
        ratio = rows["true"]["blocked"] / rows["false"]["blocked"]
        print(f"\nasync blocks the loop {ratio:.2f}x as long as a synchronous save")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)   # ours: two checkpoints of the model (GBs at 125m)


if __name__ == "__main__":
    sys.exit(main())
