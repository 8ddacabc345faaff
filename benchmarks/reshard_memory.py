"""Peak memory of loading a checkpoint at another layout (megatron_id/checkpoint): a rank that
loads its TP=4 slice vs a rank that loads the whole model (TP=1).

    python benchmarks/reshard_memory.py

A model with 8 layers (d 256, 4 heads, vocabulary 50257) trains 1 step at TP=1 with
train.reshardable_optimizer=true and saves; then, at TP=1 (1 rank) and at TP=4 (4 ranks), each
rank builds its Trainer without loading, resets its peak (writing 5 to /proc/self/clear_refs:
VmHWM := VmRSS), loads, and reports the rise of VmHWM over the RSS just before. Two loads:
  optimizer   weights and Adam state from optim/ (reshard.load: what a resume at another
              layout does)
  weights     the weights alone from DeepSpeed's TP=1 model file (engine_io.load_weights:
              train.load_optimizer=false, or a checkpoint without optim/)
Issue 12's target: a TP=4 rank below 0.5x the whole load.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODEL = ["model.d_model=256", "model.n_layers=8", "model.n_heads=4", "model.vocab_size=50257",
         "model.seq_length=64", "model.state_size=16"]
MiB = 1024 ** 2


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _items(prefix, tp, *extra):
    return MODEL + [f"data.data_path=[{prefix}]", "data.split=100,0,0", f"parallel.tensor_model_parallel_size={tp}",
                    "train.zero_stage=1", "train.precision=fp32", "train.micro_batch_size=1",
                    "train.global_batch_size=1", "train.train_tokens=640", "train.eval_iters=0", *extra]


def _save(rank, world, items, ckpt):
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([], items))
    trainer.train_step()
    trainer.save_checkpoint(ckpt)
    trainer.close()


def _load(rank, world, items, folder, what):
    import gc

    from megatron_id.checkpoint import engine_io, reshard
    from megatron_id.checkpoint.files import read_client_state
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([], items))
    saved = read_client_state(Path(folder)).layout
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    if what == "optimizer":
        reshard.load(trainer, Path(folder))
    else:
        engine_io.load_weights(trainer, Path(folder), saved)
    peak = _status("VmHWM") - before
    params = sum(p.numel() for p in trainer.engine.module.parameters())
    trainer.close()
    return peak, params


def main() -> int:
    from distributed import run_distributed

    from data_tools.preprocess import main as preprocess
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prefix = tmp / "data" / "fineweb"
        preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"), "--tokenizer",
                    str(ROOT / "tests/data/gpt2-tokenizer.json"), "--output-prefix", str(prefix),
                    "--append-eod", "--no-progress"])
        prefix = f"{prefix}_text_document"
        ckpt = tmp / "ckpt"
        run_distributed(_save, 1, args=(_items(prefix, 1, f"train.save={ckpt}", "train.reshardable_optimizer=true"),
                                        ckpt), timeout=600)
        folder = next(ckpt.glob("iter_*"))
        size = sum(p.stat().st_size for p in (folder / "optim").glob("*.safetensors"))
        print(f"optim/ of the 8-layer model: {size / MiB:.0f} MiB (fp32 weight + 2 Adam moments per parameter)")
        print(f"{'load':10} {'layout':8} {'rank':>4} {'parameters':>11} {'peak rise MiB':>14} {'vs whole':>9}")
        for what in ("optimizer", "weights"):
            whole = None
            for tp in (1, 4):
                results = run_distributed(_load, tp, args=(_items(prefix, tp), folder, what), timeout=600)
                for rank, (peak, params) in enumerate(results):
                    whole = whole if whole is not None else peak
                    print(f"{what:10} {'TP=' + str(tp):8} {rank:>4} {params:>11,} {peak / MiB:>14.0f} "
                          f"{peak / whole:>9.2f}")
                if tp == 4:
                    worst = max(peak for peak, _ in results) / whole
                    print(f"{what}: largest TP=4 rank / whole-model load: {worst:.2f} (target below 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
