"""Calibration of `megatron-id plan` (megatron_id/training/plan.py) against measured memory on CPU.

    python benchmarks/plan_memory.py [--steps 3] [--layouts tp1,tp2,dp2-zero1,pp2] [--mixers interdomain,softmax,hybrid]

For a small model (d 256, 4 layers, 4 heads, vocabulary 50257, seq 512, fp32, micro-batch 1) it
trains a few steps on gloo ranks (spawned processes, tests/distributed.py) at TP=1, TP=2,
DP=2 ZeRO-1 and PP=2 on the bundled FineWeb-Edu sample (GPT-2 tokenizer), and compares each
rank's measured peak with the planner's estimate for that rank's stage.

What is measured: per rank, the peak resident memory (VmHWM of /proc/self/status) minus the
resident memory (VmRSS) just before the Trainer builds the model; the peak is reset to the
current RSS at that moment (writing 5 to /proc/self/clear_refs), so what the imports and the
process group used before does not count. On CPU the peak includes the framework's own memory
(DeepSpeed engine, gloo, the allocator's free lists, the dataset's index): that is the
per-process overhead, measured ONCE as the same quantity for a tiny config (d 16, 1 layer,
vocabulary 50257, seq 16) less the planner's ~35 MB of model terms for it, and added to every
estimate, the same constant for every layout. ZeRO's reduction bucket is counted as the pages
gradients touch (RSS does not
count untouched pages of torch.empty); on a GPU the planner counts it whole.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

LAYOUTS = {   # name: (world, TP, PP, ZeRO)
    "tp1": (1, 1, 1, 0),
    "tp2": (2, 2, 1, 0),
    "dp2-zero1": (2, 1, 1, 1),
    "pp2": (2, 1, 2, 0),
}
SMALL = ["model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.vocab_size=50257",
         "model.seq_length=512", "model.state_size=64"]
# `--mixers hybrid`: a hybrid of the small model (interdomain and softmax layers alternating;
# at PP=2 the planner's cost balance decides the stages, and the estimate is per stage)
MIXER_ITEMS = {"hybrid": ["model.layer_pattern=IAIA"]}
TINY = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.vocab_size=50257",
        "model.seq_length=16", "model.state_size=8", "model.chunk_size=8"]


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _measure(rank, world, items, steps):
    """Runs on every rank: reset the peak, build and train, return the peak increase (bytes)."""
    import gc

    import deepspeed  # noqa: F401  (imported before the baseline: not part of the training's memory)

    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    cfg = load_config([], items)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:   # VmHWM := VmRSS now
        f.write("5")
    before = _status("VmRSS")
    trainer = Trainer(cfg)
    for _ in range(steps):
        trainer.train_step()
    peak = _status("VmHWM")
    stage = trainer.engine.stage_id if trainer.pipelined else 0
    trainer.close()
    return peak - before, stage


def _train_and_save(rank, world, items):
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([], items))
    trainer.train()
    trainer.close()


def distill_runs(prefix, work: Path, steps: int):
    """(stage, world, tp, items) of train.distill runs: a softmax teacher of the small model
    (trained one step and saved) and its student with layers 0 and 2 converted to interdomain
    (megatron-id convert), distilled in stage layers and in stage logits at TP=1 and TP=2."""
    import shlex

    from megatron_id.checkpoint.conversion import convert
    from megatron_id.commands.import_hf import model_overrides
    teacher, student = work / "teacher", work / "student"
    run_distributed_ = __import__("distributed").run_distributed
    run_distributed_(_train_and_save, 1, args=(items_for(prefix, SMALL, "softmax", 1, 1, 1, 0, 1) + [
        f"train.save={teacher}", "optimizer.lr=1e-9", "optimizer.min_lr=0"],), timeout=900, collective_timeout=600)
    convert(teacher, student, layer_pattern="IAIA", log=lambda *a, **k: None)
    model = shlex.split(model_overrides(student))
    out = []
    for stage in ("layers", "logits"):
        for world, tp in ((1, 1), (2, 2)):
            items = items_for(prefix, SMALL, None, world, tp, 1, 0, steps) + model + [
                f"train.load={student}", f"train.distill.teacher={teacher}", f"train.distill.stage={stage}"]
            out.append((stage, world, tp, items))
    return out


def items_for(prefix, model, mixer, world, tp, pp, zero, steps):
    dp = world // (tp * pp)
    global_batch = 2 * dp   # micro-batch 1: gradient accumulation 2 (two micro-batches in flight at PP=2)
    seq = int([i for i in model if i.startswith("model.seq_length=")][0].split("=")[1])
    mixer_items = [] if mixer is None else MIXER_ITEMS.get(mixer, [f"model.mixer={mixer}"])
    return model + mixer_items + [f"data.data_path=[{prefix}]",
                    "data.split=100,0,0",
                    f"parallel.tensor_model_parallel_size={tp}",
                    f"parallel.pipeline_model_parallel_size={pp}", f"train.zero_stage={zero}",
                    "train.precision=fp32", "train.micro_batch_size=1",
                    f"train.global_batch_size={global_batch}",
                    f"train.train_tokens={steps * global_batch * seq}", "optimizer.warmup_tokens=0",
                    "train.eval_iters=0"]


def run(items, world, steps):
    from distributed import run_distributed
    return run_distributed(_measure, world, args=(items, steps), timeout=900, collective_timeout=600)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--mixers", default="interdomain,softmax")
    ap.add_argument("--distill", action="store_true", help="also train.distill's two stages (a softmax teacher of "
                    "the small model, its IAIA student) at TP=1 and TP=2")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from data_tools.preprocess import main as preprocess
    from megatron_id.config import load_config
    from megatron_id.training.layout import training_layout
    from megatron_id.training.plan import stage_memory

    work = Path(tempfile.mkdtemp(prefix="plan_memory_"))
    try:
        assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"),
                           "--tokenizer", str(ROOT / "tests/data/gpt2-tokenizer.json"),
                           "--output-prefix", str(work / "fineweb"), "--append-eod", "--no-progress"]) == 0
        prefix = str(work / "fineweb_text_document")

        # the per-process overhead, once: a tiny model at TP=1, its measured peak less the planner's
        # own terms for it (~35 MB: the GPT-2 vocabulary's embedding, head and logits)
        tiny = items_for(prefix, TINY, "softmax", 1, 1, 1, 0, args.steps)
        tiny_cfg = load_config([], tiny)
        tiny_terms = stage_memory(tiny_cfg, training_layout(tiny_cfg, 1), 0, 0, checkpointing=False,
                                  overhead=0, touched_only=True)["total"]
        overhead = run(tiny, 1, args.steps)[0][0] - tiny_terms
        print(f"per-process overhead (tiny model, measured once, less its {tiny_terms / 2**20:.0f} MiB "
              f"of model terms): {overhead / 2**20:.0f} MiB")
        print(f"{'mixer':<12} {'layout':<10} {'rank':>4} {'stage':>5} {'estimate MiB':>12} "
              f"{'measured MiB':>12} {'ratio':>6}")
        within = {}
        for mixer in args.mixers.split(","):
            for name in args.layouts.split(","):
                world, tp, pp, zero = LAYOUTS[name]
                items = items_for(prefix, SMALL, mixer, world, tp, pp, zero, args.steps)
                cfg = load_config([], items)
                layout = training_layout(cfg, world)
                results = run(items, world, args.steps)
                for rank, (measured, stage) in enumerate(results):
                    est = stage_memory(cfg, layout, zero, stage, checkpointing=False, overhead=overhead,
                                       touched_only=True)["total"]
                    ratio = est / measured
                    ok = abs(ratio - 1) <= 0.25
                    within.setdefault((mixer, name), []).append(ok)
                    print(f"{mixer:<12} {name:<10} {rank:>4} {stage:>5} {est / 2**20:>12.0f} "
                          f"{measured / 2**20:>12.0f} {ratio:>6.2f}{'' if ok else '  (off by > 25%)'}",
                          flush=True)
        if args.distill:   # train.distill (issue 57): the teacher's weights and logits, frozen parameters
            for stage, world, tp, items in distill_runs(prefix, work, args.steps):
                cfg = load_config([], items)
                layout = training_layout(cfg, world)
                for rank, (measured, _) in enumerate(run(items, world, args.steps)):
                    est = stage_memory(cfg, layout, 0, 0, checkpointing=False, overhead=overhead,
                                       touched_only=True)["total"]
                    ratio = est / measured
                    ok = abs(ratio - 1) <= 0.25
                    within.setdefault((f"distill-{stage}", f"tp{tp}"), []).append(ok)
                    print(f"{'distill-' + stage:<12} {'tp' + str(tp):<10} {rank:>4} {0:>5} {est / 2**20:>12.0f} "
                          f"{measured / 2**20:>12.0f} {ratio:>6.2f}{'' if ok else '  (off by > 25%)'}", flush=True)
        good = [key for key, oks in within.items() if all(oks)]
        print(f"within 25% on every rank: {len(good)} of {len(within)} (mixer, layout) pairs")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)   # ours: the data and every layout's checkpoints


if __name__ == "__main__":
    sys.exit(main())
