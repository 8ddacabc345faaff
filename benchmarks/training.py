"""Training throughput (tokens/s) of the tiny and a ~20M-parameter interdomain model across
parallel layouts, on CPU processes with gloo.

    python benchmarks/training.py              # ~6 minutes on 2 cores
    python benchmarks/training.py --steps 4    # quicker, noisier

Each cell is a fresh `torchrun` of this file in worker mode: it builds the Trainer for the
layout, runs 2 warm-up steps, then times --steps steps between barriers (fp32, global batch 16
sequences: micro-batch 4 x accumulation x DP). Data: the bundled FineWeb-Edu sample,
preprocessed with the GPT-2 tokenizer. Processes run with 1 thread each, except the
single-process row, which gets all cores (so every row uses the whole machine).

Models: tiny = configs/model/tiny.yaml with the GPT-2 vocabulary (d 64, 2 layers, seq 64);
small = d 192, 6 layers, 4 heads, seq 128, M 16 (22M parameters, 19M of them the 50K-token
embedding and LM head).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from allocator import ALLOCATOR_ENV  # noqa: E402  (benchmarks/allocator.py, beside this file)

MODELS = {
    "tiny": ["model.vocab_size=50257"],
    "small": ["model.vocab_size=50257", "model.d_model=192", "model.n_layers=6", "model.n_heads=4",
              "model.seq_length=128", "model.state_size=16"],
}
# (TP, PP, DP, ZeRO stage)
LAYOUTS = [(1, 1, 1, 0), (1, 1, 2, 1), (1, 1, 2, 2), (2, 1, 1, 1), (1, 2, 1, 1)]


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from megatron_id.config import load_config
    from megatron_id.training.distributed import init_distributed_from_env
    from megatron_id.training.engine import Trainer
    tp, pp, dp, zero = args.layout
    items = MODELS[args.model] + [
        f"data.data_path=[{args.data}]", "data.split=100,0,0", f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.pipeline_model_parallel_size={pp}", f"train.zero_stage={zero}", "train.precision=fp32",
        "train.micro_batch_size=4", "train.global_batch_size=16", "train.train_tokens=100000000"]
    cfg = load_config([ROOT / "configs/model/tiny.yaml"], items)
    init_distributed_from_env()
    trainer = Trainer(cfg)
    for _ in range(2):
        trainer.train_step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    dist.barrier()
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        from megatron_id.model.accounting import report
        print("RESULT " + json.dumps({
            "tokens_per_s": args.steps * trainer.layout.tokens_per_step / seconds,
            "parameters": report(cfg.model).parameters, "threads": torch.get_num_threads()}), flush=True)
    dist.destroy_process_group()


def run_cell(model: str, layout, data: str, steps: int) -> dict:
    tp, pp, dp, zero = layout
    world = tp * pp * dp
    threads = max(1, (os.cpu_count() or 1) // world)
    env = {**os.environ, **ALLOCATOR_ENV, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           __file__, "--worker", "--model", model, "--layout", *map(str, layout), "--data", data,
           "--steps", str(steps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not line:
        raise RuntimeError(f"{model} {layout} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--model", choices=sorted(MODELS))
    p.add_argument("--layout", type=int, nargs=4)
    p.add_argument("--data")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    from data_tools.preprocess import main as preprocess
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "fineweb"
        assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"), "--tokenizer",
                           str(ROOT / "tests/data/gpt2-tokenizer.json"), "--output-prefix", str(prefix),
                           "--append-eod", "--no-progress"]) == 0
        data = f"{prefix}_text_document"
        print(f"CPU cores: {os.cpu_count()}; {args.steps} timed steps per cell, global batch 16 sequences, fp32\n")
        print("| model | parameters | TP | PP | DP | ZeRO | processes x threads | tokens/s | vs 1 process |")
        print("|---|---|---|---|---|---|---|---|---|")
        for model in MODELS:
            base = None
            for layout in LAYOUTS:
                r = run_cell(model, layout, data, args.steps)
                base = base or r["tokens_per_s"]
                tp, pp, dp, zero = layout
                print(f"| {model} | {r['parameters'] / 1e6:.1f}M | {tp} | {pp} | {dp} | {zero} | "
                      f"{tp * pp * dp} x {r['threads']} | {r['tokens_per_s']:,.0f} | "
                      f"{r['tokens_per_s'] / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
