"""Context parallelism on CPU (gloo): per-rank memory of one sequence split over C ranks, and a
training run of the tiny-width interdomain model at 64K tokens per sequence.

    python benchmarks/context_parallel.py                 # both parts, ~6 minutes on 2 cores
    python benchmarks/context_parallel.py --part memory --tokens 8192

(a) memory: the tiny-width model (configs/model/tiny.yaml: d 64, 2 layers, 4 heads, M 16;
    vocabulary 512, random tokens) forward + backward on one sequence of --tokens tokens, at
    CP = 1, 2, 4: each rank's peak RSS above its RSS before the first step (the activations
    and gradients of its block; the weights are in the baseline), the largest over the ranks.
(b) training: `Trainer` (the training loop users run) on the bundled Wikipedia validation shard
    (GPT-2 tokens, so the LM head is 50,257 wide), model.seq_length=65536, CP=4 (16K tokens
    per rank), fp32, 3 steps; prints each step's loss and each rank's peak RSS. The LM head uses
    the fused loss (train.fused_lm_head_loss) when this checkout has it: full float32 logits of
    16K tokens x 50,257 are 3.3 GB per rank before their gradient.
Every rank process has 1 thread; the machine has 2 cores, so times are not meaningful here.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from allocator import ALLOCATOR_ENV  # noqa: E402  (benchmarks/allocator.py, beside this file)

WIKI_VAL = ROOT.parent / "shared/data/corpus/enwiki2015_val.jsonl.zst"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory_rank(rank, world, tokens):
    import torch
    import torch.distributed as dist

    from megatron_id.config import load_config
    from megatron_id.model import LanguageModel
    from megatron_id.parallel.context_parallel import ContextParallel, apply_context_parallel, split_sequence
    cfg = load_config([ROOT / "configs/model/tiny.yaml"], ["model.vocab_size=512", "model.core_impl=autograd"]).model
    model = LanguageModel(cfg, seed=1)
    cp = ContextParallel(dist.group.WORLD, rank, world) if world > 1 else None
    apply_context_parallel(model, cp)
    seq = torch.randint(0, 512, (1, tokens + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = seq[:, :-1], seq[:, 1:]
    if cp is not None:
        inputs, labels = split_sequence(inputs, cp), split_sequence(labels, cp)
    base = _rss()
    start = time.perf_counter()
    logits = model(inputs)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 512), labels.reshape(-1)).backward()
    return {"peak": _peak() - base, "time": time.perf_counter() - start}


def _train_rank(rank, world, prefix, fused):
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    items = [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
             "model.seq_length=65536", f"parallel.context_parallel_size={world}", "train.precision=fp32",
             "train.zero_stage=1", "train.micro_batch_size=1", "train.global_batch_size=1",
             f"train.train_tokens={3 * 65536}", "optimizer.lr=3e-3", "optimizer.warmup_tokens=65536"]
    if fused:
        items.append("train.fused_lm_head_loss=true")
    trainer = Trainer(load_config([ROOT / "configs/model/tiny.yaml"], items))
    base = _rss()
    losses, times = [], []
    for _ in range(3):
        start = time.perf_counter()
        losses.append(trainer.train_step())
        times.append(time.perf_counter() - start)
    return {"losses": losses, "peak": _peak() - base, "times": times}


def _worker(fn, rank, world, init, queue, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        queue.put((rank, fn(rank, world, *args)))
    except BaseException as err:   # the parent reports it
        queue.put((rank, f"{type(err).__name__}: {err}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn, world, args, timeout=1200):
    """fn on `world` gloo ranks in spawned processes (a bounded wait); returns their results."""
    import torch.multiprocessing as mp
    os.environ.update(ALLOCATOR_ENV)   # reuse freed memory instead of faulting it in again
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = Path(tempfile.mkdtemp()) / "init"
    procs = [ctx.Process(target=_worker, args=(fn, r, world, init, queue, args)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.time() + timeout
    try:
        while len(results) < world:
            rank, value = queue.get(timeout=max(1, deadline - time.time()))
            if isinstance(value, str):
                raise RuntimeError(f"rank {rank}: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["memory", "train", "both"], default="both")
    parser.add_argument("--tokens", type=int, default=16384, help="sequence length of part (a)")
    args = parser.parse_args(argv)
    if args.part in ("memory", "both"):
        print(f"## (a) per-rank memory of one {args.tokens:,}-token sequence, tiny width, forward + backward\n")
        print("| CP | tokens per rank | peak RSS above baseline (max over ranks) | vs CP=1 | time (max over ranks) |")
        print("|---|---|---|---|---|")
        first = None
        for world in (1, 2, 4):
            res = run(_memory_rank, world, (args.tokens,))
            peak, seconds = max(r["peak"] for r in res), max(r["time"] for r in res)
            first = first or peak
            print(f"| {world} | {args.tokens // world:,} | {peak / 2**20:,.0f} MiB | {first / peak:.2f}x less | "
                  f"{seconds:.1f} s |", flush=True)
    if args.part in ("train", "both"):
        from megatron_id.config import TrainConfig
        fused = hasattr(TrainConfig, "fused_lm_head_loss") or "fused_lm_head_loss" in TrainConfig.__dataclass_fields__
        folder = Path(tempfile.mkdtemp())
        from data_tools.preprocess import main as preprocess
        if preprocess(["--input", str(WIKI_VAL), "--tokenizer", str(ROOT / "tests/data/gpt2-tokenizer.json"),
                       "--output-prefix", str(folder / "wiki"), "--append-eod", "--no-progress"]) != 0:
            raise SystemExit("preprocessing the Wikipedia shard failed")
        res = run(_train_rank, 4, (str(folder / "wiki_text_document"), fused))
        print(f"\n## (b) training at 65,536 tokens per sequence, CP=4, tiny width, Wikipedia "
              f"(fused LM-head loss: {'on' if fused else 'off'})\n")
        print("| step | loss | step time (rank 0) |")
        print("|---|---|---|")
        for i, (loss, t) in enumerate(zip(res[0]["losses"], res[0]["times"])):
            print(f"| {i + 1} | {loss:.4f} | {t:.1f} s |")
        print("\npeak RSS above baseline per rank: " + ", ".join(f"{r['peak'] / 2**20:,.0f} MiB" for r in res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
