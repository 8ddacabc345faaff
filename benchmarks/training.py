"""Training throughput (tokens/s) of the tiny and a ~20M-parameter interdomain model across
parallel layouts, on CPU processes with gloo.

    python benchmarks/training.py              # ~6 minutes on 2 cores
    python benchmarks/training.py --steps 4    # quicker, noisier
    python benchmarks/training.py --compile --models tiny   # eager vs train.compile=true
    python benchmarks/training.py --overhead   # issue 53's run-watching off vs on, ~14 minutes

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

--overhead measures issue 53's per-step features (docs/training-loop.md): "off"
(train.straggler_interval=0 train.spike_factor=0) against "on" (slow ranks gathered every 10
steps, loss-spike detection at 4x the median of a window of 10, train.local_save configured but
never due while timed; the fault-injection hooks run in both, no-ops without
MEGATRON_ID_INJECT_FAULTS). Both trainers in one process group of 2 processes x 1 thread (DP=2,
ZeRO-1, gloo: the gather and the all-reduce are real collectives), timed in alternating rounds
of 10 steps of Trainer.train() itself (metrics, hooks, the per-step collectives; each round holds
one slow-rank gather), the order flipped every round; the overhead is on time / off time - 1, by
wall clock and by CPU seconds (both ranks'). Then each hook alone, outside the steps, and the local
saves (Trainer.save_locally, --local-saves of them), reported apart: seconds per save and what one
every 10 steps adds per step. Models: tiny as below; 125m = configs/model/125m.yaml with the GPT-2
vocabulary, sequences of 256 and a global batch of 2 (micro-batch 1), so a step takes seconds.

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


# --overhead: the model file and its overrides, micro-batch, global batch. 125m: the paper's 125M
# (configs/model/125m.yaml) with the GPT-2 vocabulary, but sequences of 256 (not 4,096) and a global
# batch of 2 sequences, so that a step takes seconds on 2 CPU cores.
OVERHEAD_MODELS = {
    "tiny": ("tiny.yaml", MODELS["tiny"], 4, 16),
    "125m": ("125m.yaml", ["model.vocab_size=50257", "model.seq_length=256"], 1, 2),
}
OVERHEAD_LAYOUT = (1, 1, 2, 1)   # DP=2, ZeRO-1: the slow-rank gather and the loss all-reduce are real collectives
OVERHEAD_ROUND = 10              # steps per timed round = the "on" trainer's train.straggler_interval
OVERHEAD_STEPS = {"tiny": 300, "125m": 20}   # timed steps per variant unless --steps
# what "on" turns on (issue 53's per-step features); "off" sets the first two to 0
OVERHEAD_ON = ["train.straggler_interval=10", "train.spike_factor=4", "train.spike_window=10"]
OVERHEAD_OFF = ["train.straggler_interval=0", "train.spike_factor=0"]


def build_trainer(args, compiled: bool = False, extra: tuple = ()):
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    tp, pp, dp, zero = args.layout
    model_file, overrides, micro, global_batch = (
        OVERHEAD_MODELS[args.model] if getattr(args, "compare_overhead", False) else
        ("tiny.yaml", MODELS[args.model], 4, 16))
    items = overrides + [
        f"data.data_path=[{args.data}]", "data.split=100,0,0", f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.pipeline_model_parallel_size={pp}", f"train.zero_stage={zero}", "train.precision=fp32",
        f"train.micro_batch_size={micro}", f"train.global_batch_size={global_batch}", "train.train_tokens=100000000",
        f"model.mixer={args.mixer}", f"train.compile={str(compiled).lower()}", *extra]
    cfg = load_config([ROOT / "configs/model" / model_file], items)
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


def overhead_worker(args) -> None:
    """Issue 53's per-step run-watching off and on: two trainers side by side in one process
    group (DP=2), timed in alternating rounds of OVERHEAD_ROUND steps of Trainer.train() (the real
    loop: metrics, the hooks, the per-step collectives; the "on" trainer's slow-rank gather falls
    in every round). Then the local saves: Trainer.save_locally, timed on its own."""
    import gc

    import torch
    import torch.distributed as dist

    from megatron_id.model.accounting import report
    from megatron_id.training.distributed import init_distributed_from_env
    init_distributed_from_env()
    # no validation; console: only each train() call's first step (the same in both)
    quiet = ["train.eval_iters=0", "train.log_interval=1000000000"]
    local = Path(args.local_save) / f"rank{dist.get_rank()}"
    trainers = {}
    for mode, items in (("off", OVERHEAD_OFF), ("on", OVERHEAD_ON)):
        # "on": train.local_save configured too (its per-step check included), never due while timed
        extra = items + quiet + ([f"train.local_save={local}", "train.local_save_interval=1000000000"]
                                 if mode == "on" else [])
        trainers[mode], cfg = build_trainer(args, extra=tuple(extra))
    warm_up = OVERHEAD_ROUND if args.model == "tiny" else 2
    for trainer in trainers.values():
        trainer.train(max_steps=warm_up)
    seconds, cpu_seconds = dict.fromkeys(trainers, 0.0), dict.fromkeys(trainers, 0.0)
    rounds = max(1, args.steps // OVERHEAD_ROUND)
    for i in range(rounds):   # the order flips every round: neither always goes first
        for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
            gc.collect()
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            trainers[mode].train(max_steps=OVERHEAD_ROUND)
            dist.barrier()
            seconds[mode] += time.perf_counter() - start
            cpu_seconds[mode] += time.process_time() - cpu_start
    cpu = torch.tensor([cpu_seconds["off"], cpu_seconds["on"]], dtype=torch.float64)
    dist.all_reduce(cpu)   # every rank's CPU seconds
    cpu_seconds = {"off": cpu[0].item(), "on": cpu[1].item()}
    on = trainers["on"]
    assert on.spikes.limit() is not None, "spike detection never became active"
    # each hook alone, outside a step (where the overhead comes from, free of the rounds' noise):
    # the fault-injection hooks (no-ops without MEGATRON_ID_INJECT_FAULTS; run by both trainers)
    calls, began = 100000, time.perf_counter()
    for s in range(calls):
        on.faults.before_step(s)
        on.faults.slow_down(s)
        on.faults.loss_factor(s, ())
    hooks_us = (time.perf_counter() - began) / calls * 1e6
    # the slow-rank wrapper of a step (clock reads, the window), its gather (a collective), and the
    # loss-spike hooks (the limit: a median of the window; the record)
    from megatron_id.training import spikes as spike_hooks
    from megatron_id.training.stragglers import Stragglers
    watch = Stragglers(on, on.metrics)
    began = time.perf_counter()
    for s in range(calls // 10):
        with watch.step(s * 10 + 1):   # never a multiple of the interval: no gather
            pass
    straggler_us = (time.perf_counter() - began) / (calls // 10) * 1e6
    window, gathers, gather_s = watch.window[:OVERHEAD_ROUND], 50, 0.0
    for s in range(gathers):
        watch.window, watch.first = list(window), 1   # a full window, as at every interval's end
        dist.barrier()
        began = time.perf_counter()
        watch._report(OVERHEAD_ROUND * (s + 1))
        gather_s += time.perf_counter() - began
    gather_ms = gather_s / gathers * 1e3
    loss, began = float(on.spikes.recent[-1]), time.perf_counter()
    for _ in range(calls // 10):
        spike_hooks.arm(on)
        on.guard.spiked = False
        spike_hooks.observe(on, loss, on.metrics)
    spike_us = (time.perf_counter() - began) / (calls // 10) * 1e6
    # local saves: this rank's shard (Trainer.save_locally: LocalSaves.save), each between barriers
    save_s = []
    for _ in range(args.local_saves):
        dist.barrier()
        on.save_locally()
        took = torch.tensor([on.last_local_save], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)   # the slowest rank's: the others wait for it
        save_s.append(took.item())
    size = sum(f.stat().st_size for f in local.iterdir())
    on.local_saves.remove_all()
    if dist.get_rank() == 0:
        tokens = rounds * OVERHEAD_ROUND * on.layout.tokens_per_step
        print("RESULT " + json.dumps({
            **{f"{mode}_tokens_per_s": tokens / seconds[mode] for mode in trainers},
            **{f"{mode}_tokens_per_cpu_s": tokens / cpu_seconds[mode] for mode in trainers},
            **{f"{mode}_step_s": seconds[mode] / (rounds * OVERHEAD_ROUND) for mode in trainers},
            "steps": rounds * OVERHEAD_ROUND, "hooks_us": hooks_us, "straggler_us": straggler_us,
            "gather_ms": gather_ms, "spike_us": spike_us, "local_save_s": sorted(save_s),
            "local_save_bytes": size, "parameters": report(cfg.model).parameters,
            "seq_length": cfg.model.seq_length, "global_batch": on.layout.global_batch_size,
            "micro_batch": on.layout.micro_batch_size, "threads": torch.get_num_threads()}), flush=True)
    for trainer in trainers.values():
        trainer.close()
    dist.destroy_process_group()


def overhead_table(models, data: str, steps: int | None, local_saves: int, tmp: str) -> None:
    """Off vs on per model at DP=2 (2 processes x 1 thread, gloo), then the local saves."""
    rows = []
    print("| model | parameters | seq x global batch | timed steps per variant | off tokens/s | on tokens/s | "
          "overhead, wall | overhead, CPU seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for model in models:
        r = run_cell(model, OVERHEAD_LAYOUT, data, steps or OVERHEAD_STEPS[model], overhead=True,
                     local_saves=local_saves, local_save=tempfile.mkdtemp(prefix="local-save-", dir=tmp))
        rows.append((model, r))
        wall = (r["off_tokens_per_s"] / r["on_tokens_per_s"] - 1) * 100    # = on time / off time - 1
        cpu = (r["off_tokens_per_cpu_s"] / r["on_tokens_per_cpu_s"] - 1) * 100
        print(f"| {model} | {r['parameters'] / 1e6:.1f}M | {r['seq_length']} x {r['global_batch']} | {r['steps']} | "
              f"{r['off_tokens_per_s']:,.0f} | {r['on_tokens_per_s']:,.0f} | {wall:+.1f}% | {cpu:+.1f}% |", flush=True)
    print("\nEach hook alone, outside the steps (rank 0; per step unless said), and its share of the off step:")
    print("| model | off step, s | slow-rank wrapper, us | slow-rank gather, ms per train.straggler_interval | "
          "loss-spike arm + observe, us | fault hooks, us | all of them per step, at interval 10 |")
    print("|---|---|---|---|---|---|---|")
    for model, r in rows:
        per_step_s = (r["straggler_us"] + r["spike_us"] + r["hooks_us"]) / 1e6 + r["gather_ms"] / 1e3 / OVERHEAD_ROUND
        print(f"| {model} | {r['off_step_s']:.3f} | {r['straggler_us']:.1f} | {r['gather_ms']:.2f} | "
              f"{r['spike_us']:.1f} | {r['hooks_us']:.1f} | {per_step_s * 1e3:.3f} ms "
              f"({100 * per_step_s / r['off_step_s']:.3f}%) |", flush=True)
    print("\nLocal saves (Trainer.save_locally, each between barriers; the slowest rank's time):")
    print("| model | s per local save (median of n, range) | shard per rank | off step, s | "
          "per step at train.local_save_interval=10 (save / 10 steps) |")
    print("|---|---|---|---|---|")
    for model, r in rows:
        saves = r["local_save_s"]
        median = saves[len(saves) // 2]
        print(f"| {model} | {median:.3f} (n={len(saves)}, {saves[0]:.3f}-{saves[-1]:.3f}) | "
              f"{r['local_save_bytes'] / 2**20:,.1f} MiB | {r['off_step_s']:.3f} | "
              f"{100 * median / (10 * r['off_step_s']):.1f}% |", flush=True)


def run_cell(model: str, layout, data: str, steps: int, mixer: str = "interdomain",
             compare_compile: bool = False, compile_cache: str | None = None, overhead: bool = False,
             local_saves: int = 0, local_save: str | None = None) -> dict:
    tp, pp, dp, zero = layout
    world = tp * pp * dp
    threads = max(1, (os.cpu_count() or 1) // world)
    env = {**os.environ, **ALLOCATOR_ENV, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(ROOT)}
    if compile_cache:   # a cold inductor cache: the warm-up is what a first run pays
        env["TORCHINDUCTOR_CACHE_DIR"] = compile_cache
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           __file__, "--worker", "--model", model, "--layout", *map(str, layout), "--data", data,
           "--steps", str(steps), "--mixer", mixer] + (["--compare-compile"] if compare_compile else []) + (
               ["--compare-overhead", "--local-saves", str(local_saves), "--local-save", local_save]
               if overhead else [])
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
    names = sorted({*MODELS, *OVERHEAD_MODELS})
    p.add_argument("--model", choices=names)
    p.add_argument("--layout", type=int, nargs=4)
    p.add_argument("--data")
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed steps per cell (default 8); with --overhead per variant (default "
                        f"{', '.join(f'{m} {n}' for m, n in OVERHEAD_STEPS.items())}), in rounds of {OVERHEAD_ROUND}")
    p.add_argument("--mixer", default="interdomain", help=argparse.SUPPRESS)            # worker mode
    p.add_argument("--compare-compile", action="store_true", help=argparse.SUPPRESS)   # worker mode
    p.add_argument("--compare-overhead", action="store_true", help=argparse.SUPPRESS)  # worker mode
    p.add_argument("--local-save", help=argparse.SUPPRESS)                              # worker mode
    p.add_argument("--compile", action="store_true",
                   help="measure eager vs train.compile=true (one process) instead of the layouts")
    p.add_argument("--overhead", action="store_true",
                   help="measure issue 53's run-watching (slow ranks, loss spikes) off vs on at DP=2, and "
                        "the local saves, instead of the layouts")
    p.add_argument("--local-saves", type=int, default=5, help="with --overhead: local saves timed per model")
    p.add_argument("--models", nargs="+", choices=names, default=None,
                   help=f"default: {' '.join(MODELS)}; with --overhead {' '.join(OVERHEAD_MODELS)}")
    p.add_argument("--mixers", nargs="+", choices=["interdomain", "s4d", "softmax"], default=["interdomain"],
                   help="with --compile: the mixers to measure")
    args = p.parse_args()
    if args.worker:
        if args.compare_overhead:
            return overhead_worker(args)
        args.steps = args.steps or 8
        return compile_worker(args) if args.compare_compile else worker(args)
    args.models = args.models or list(OVERHEAD_MODELS if args.overhead else MODELS)
    allowed = OVERHEAD_MODELS if args.overhead else MODELS
    if set(args.models) - set(allowed):
        p.error(f"--models: {' '.join(sorted(set(args.models) - set(allowed)))} only with"
                f"{'out' if args.overhead else ''} --overhead (choose from {' '.join(allowed)})")
    from data_tools.preprocess import main as preprocess
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "fineweb"
        assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"), "--tokenizer",
                           str(ROOT / "tests/data/gpt2-tokenizer.json"), "--output-prefix", str(prefix),
                           "--append-eod", "--no-progress"]) == 0
        data = f"{prefix}_text_document"
        if args.overhead:
            print(f"CPU cores: {os.cpu_count()}; DP=2 ZeRO-1, 2 processes x 1 thread (gloo), fp32; rounds of "
                  f"{OVERHEAD_ROUND} steps of Trainer.train(), off and on alternating; off: "
                  f"{' '.join(OVERHEAD_OFF)}; on: {' '.join(OVERHEAD_ON)}\n")
            return overhead_table(args.models, data, args.steps, args.local_saves, tmp)
        args.steps = args.steps or 8
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
