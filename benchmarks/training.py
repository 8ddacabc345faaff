"""Training throughput (tokens/s) of the tiny and a ~20M-parameter interdomain model across
parallel layouts, on CPU processes with gloo.

    python benchmarks/training.py              # ~6 minutes on 2 cores
    python benchmarks/training.py --steps 4    # quicker, noisier
    python benchmarks/training.py --compile --models tiny   # eager vs train.compile=true

Each cell is a fresh `torchrun` of this file in worker mode: it builds the Trainer for the
layout, runs 2 warm-up steps, then times --steps steps between barriers (fp32, global batch 16
sequences: micro-batch 4 x accumulation x DP). Data: the bundled FineWeb-Edu sample,
preprocessed with the GPT-2 tokenizer. Processes run with 1 thread each, except the
single-process row, which gets all cores (so every row uses the whole machine).

--compile measures, instead of the layouts, each model and mixer (--mixers) eager and with
train.compile=true: both trainers in one process with all cores, timed in alternating rounds of
2 steps (so a busy machine slows both alike), --steps steps each. Besides wall-clock tokens/s
it gives the ratio per CPU second of the process, which other processes on a shared machine
disturb far less. And the 2 warm-up steps: the compiled trainer's include the compilation
(inductor, from an empty cache folder, as a first run on a fresh machine).

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


def build_trainer(args, compiled: bool = False):
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    tp, pp, dp, zero = args.layout
    items = MODELS[args.model] + [
        f"data.data_path=[{args.data}]", "data.split=100,0,0", f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.pipeline_model_parallel_size={pp}", f"train.zero_stage={zero}", "train.precision=fp32",
        "train.micro_batch_size=4", "train.global_batch_size=16", "train.train_tokens=100000000",
        f"model.mixer={args.mixer}", f"train.compile={str(compiled).lower()}"]
    cfg = load_config([ROOT / "configs/model/tiny.yaml"], items)
    return Trainer(cfg), cfg


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from megatron_id.training.distributed import init_distributed_from_env
    init_distributed_from_env()
    trainer, cfg = build_trainer(args)
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


ROUND_STEPS = 2


def compile_worker(args) -> None:
    """An eager and a train.compile=true trainer side by side in one process, timed in
    alternating rounds of ROUND_STEPS steps, so that whatever else loads the machine slows both
    alike (timing them one after the other measured the neighbours as much as the modes)."""
    import torch
    import torch.distributed as dist

    from megatron_id.model.accounting import report
    from megatron_id.training.distributed import init_distributed_from_env
    init_distributed_from_env()
    trainers, warm_up_s = {}, {}
    for mode in ("eager", "compiled"):
        trainers[mode], cfg = build_trainer(args, compiled=mode == "compiled")
        start = time.perf_counter()
        for _ in range(2):   # compiled: the first step compiles
            trainers[mode].train_step()
        warm_up_s[mode] = time.perf_counter() - start
    seconds, cpu_seconds = dict.fromkeys(trainers, 0.0), dict.fromkeys(trainers, 0.0)
    rounds = max(1, args.steps // ROUND_STEPS)
    for _ in range(rounds):
        for mode, trainer in trainers.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(ROUND_STEPS):
                trainer.train_step()
            seconds[mode] += time.perf_counter() - start
            cpu_seconds[mode] += time.process_time() - cpu_start
    tokens = rounds * ROUND_STEPS * trainers["eager"].layout.tokens_per_step
    print("RESULT " + json.dumps({
        **{f"{mode}_tokens_per_s": tokens / seconds[mode] for mode in trainers},
        **{f"{mode}_tokens_per_cpu_s": tokens / cpu_seconds[mode] for mode in trainers},
        **{f"{mode}_warm_up_s": warm_up_s[mode] for mode in trainers},
        "parameters": report(cfg.model).parameters, "threads": torch.get_num_threads()}), flush=True)
    dist.destroy_process_group()


def run_cell(model: str, layout, data: str, steps: int, mixer: str = "interdomain",
             compare_compile: bool = False, compile_cache: str | None = None) -> dict:
    tp, pp, dp, zero = layout
    world = tp * pp * dp
    threads = max(1, (os.cpu_count() or 1) // world)
    env = {**os.environ, **ALLOCATOR_ENV, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(ROOT)}
    if compile_cache:   # a cold inductor cache: the warm-up is what a first run pays
        env["TORCHINDUCTOR_CACHE_DIR"] = compile_cache
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           __file__, "--worker", "--model", model, "--layout", *map(str, layout), "--data", data,
           "--steps", str(steps), "--mixer", mixer] + (["--compare-compile"] if compare_compile else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not line:
        raise RuntimeError(f"{model} {mixer} {layout} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[0][len("RESULT "):])


def compile_table(models, mixers, data: str, steps: int, tmp: str) -> None:
    """Eager vs train.compile=true, one process with every core, per model and mixer."""
    print("| model | mixer | parameters | eager tokens/s | compiled tokens/s | compiled / eager | "
          "compiled / eager, per CPU second | warm-up s, eager | warm-up s, compiled (cold cache) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for mixer in mixers:
            r = run_cell(model, (1, 1, 1, 0), data, steps, mixer, compare_compile=True,
                         compile_cache=tempfile.mkdtemp(prefix="inductor-", dir=tmp))
            print(f"| {model} | {mixer} | {r['parameters'] / 1e6:.1f}M | {r['eager_tokens_per_s']:,.0f} | "
                  f"{r['compiled_tokens_per_s']:,.0f} | {r['compiled_tokens_per_s'] / r['eager_tokens_per_s']:.2f} | "
                  f"{r['compiled_tokens_per_cpu_s'] / r['eager_tokens_per_cpu_s']:.2f} | "
                  f"{r['eager_warm_up_s']:.1f} | {r['compiled_warm_up_s']:.1f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--model", choices=sorted(MODELS))
    p.add_argument("--layout", type=int, nargs=4)
    p.add_argument("--data")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--mixer", default="interdomain", help=argparse.SUPPRESS)            # worker mode
    p.add_argument("--compare-compile", action="store_true", help=argparse.SUPPRESS)   # worker mode
    p.add_argument("--compile", action="store_true",
                   help="measure eager vs train.compile=true (one process) instead of the layouts")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--mixers", nargs="+", choices=["interdomain", "s4d", "softmax"], default=["interdomain"],
                   help="with --compile: the mixers to measure")
    args = p.parse_args()
    if args.worker:
        return compile_worker(args) if args.compare_compile else worker(args)
    from data_tools.preprocess import main as preprocess
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "fineweb"
        assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"), "--tokenizer",
                           str(ROOT / "tests/data/gpt2-tokenizer.json"), "--output-prefix", str(prefix),
                           "--append-eod", "--no-progress"]) == 0
        data = f"{prefix}_text_document"
        print(f"CPU cores: {os.cpu_count()}; {args.steps} timed steps per cell, global batch 16 sequences, fp32\n")
        if args.compile:
            return compile_table(args.models, args.mixers, data, args.steps, tmp)
        print("| model | parameters | TP | PP | DP | ZeRO | processes x threads | tokens/s | vs 1 process |")
        print("|---|---|---|---|---|---|---|---|---|")
        for model in args.models:
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
