"""Peak private memory of the checkpoint tools at the paper's 350M config (issue 40, item 6).

    python benchmarks/checkpoint_memory.py [--model configs/model/350m.yaml] [--seq-length 128]
                                           [--source-dp 1] [--only convert,export,weights,resume]

The model is configs/model/350m.yaml as it is (377,360,768 parameters, vocabulary 32,000): its
weights are what matters, so only the sequence is shortened (128 tokens; no parameter depends on
it). The data is the bundled FineWeb-Edu sample, tokenized with a byte-level BPE trained on it
(21,127 tokens, under the model's 32,000; GPT-2's 50,257 would not fit its embedding). A run at
ZeRO-1 on one process trains 1 step (fp32, micro-batch 1) and saves through the trainer's own
save path; with --source-dp 2 a second, 2-rank data-parallel run writes the ZeRO-1 checkpoint
that convert-checkpoint reads (two optimizer partitions). Then each operation runs in a fresh
process:

  convert    `megatron-id convert-checkpoint` of the ZeRO-1 checkpoint (reshard.convert)
  export     `megatron-id export-hf` (hf.export.export_hf)
  weights    a weights-only trainer load (train.load_optimizer=false: engine_io.load)
  resume     a same-layout ZeRO-1 resume with the optimizer (DeepSpeed's load_checkpoint)

What is measured: private (anonymous) memory, the RssAnon of /proc/<pid>/status, sampled by the
parent every millisecond while the operation runs, as the peak above the child's RssAnon just
before it (after its imports; for the trainer loads after the Trainer is built, before it
loads). Memory-mapped checkpoint pages are file-backed (RssFile): the kernel can drop them at
any time, so they are not counted; the VmHWM column (peak resident memory after resetting it
with /proc/self/clear_refs, file pages included) shows them for comparison. Ratios are over the
fp32 weights (4 bytes per parameter; one pipeline stage here, PP=1).

The 1-step run is also the check of the planner's host-memory figure (training/plan.py,
`run_estimate_gib`, which train's host-memory check uses): its whole-process peak resident
memory (VmHWM from the start of the process) against the estimate.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

GiB = 1024 ** 3
OPERATIONS = ("convert", "export", "weights", "resume")


def _status(key: str, pid="self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _items(args, prefix, tokenizer, *extra):
    return [f"model.seq_length={args.seq_length}", f"data.data_path=[{prefix}]", "data.split=100,0,0",
            f"data.tokenizer={tokenizer}", "train.zero_stage=1", "train.precision=fp32",
            "train.micro_batch_size=1", f"train.train_tokens={args.seq_length}", "train.eval_iters=0",
            "optimizer.warmup_tokens=0", *extra]


def _init_single_rank(init_file: str) -> None:
    import torch.distributed as dist
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)


def _prepare(op: str, job: dict):
    """Everything an operation needs before it starts (imports, a built Trainer); returns the
    operation as a callable."""
    import torch
    torch.set_num_threads(2)
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    if op == "save":
        _init_single_rank(job["init_file"])

        def run():
            trainer = Trainer(load_config([job["model"]], job["items"]))
            trainer.train_step()
            peak = _status("VmHWM")   # build + 1 step, from the start of the process
            trainer.save_checkpoint(job["save"])
            trainer.close()
            return {"train_vmhwm": peak}
        return run
    if op == "convert":
        from megatron_id.checkpoint.reshard import convert
        return lambda: {"out": str(convert(Path(job["source"]), Path(job["output"])))}
    if op == "export":
        from megatron_id.hf.export import export_hf
        return lambda: {"out": str(export_hf(job["source"], job["output"]))}
    if op in ("weights", "resume"):
        _init_single_rank(job["init_file"])
        trainer = Trainer(load_config([job["model"]], job["items"]))   # no train.load: nothing loaded yet

        def run():
            trainer.load_checkpoint(job["source"])
            return {"step": trainer.step}
        return run
    raise ValueError(op)


def _child(conn, op: str, job: dict) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        run = _prepare(op, job)
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:   # VmHWM := VmRSS now
            f.write("5")
        conn.send(("ready", _status("RssAnon"), _status("VmRSS")))
        conn.recv()   # go: the parent samples from now on
        result = run()
        conn.send(("done", _status("VmHWM"), result))
    except BaseException:
        import traceback
        conn.send(("error", traceback.format_exc(), None))


def measure(op: str, job: dict, timeout: float = 3600) -> dict:
    """Run `op` in a fresh process; {'anon': peak RssAnon rise, 'hwm': VmHWM rise, ...}."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, op, job), daemon=True)
    proc.start()
    try:
        if not parent.poll(timeout):
            raise TimeoutError(f"{op}: not ready within {timeout} s")
        kind, base_anon, base_rss = parent.recv()
        if kind == "error":
            raise RuntimeError(f"{op} failed:\n{base_anon}")
        peak, started = base_anon, time.perf_counter()
        parent.send("go")
        while not parent.poll():
            try:
                peak = max(peak, _status("RssAnon", proc.pid))
            except (FileNotFoundError, ProcessLookupError):
                break
            if time.perf_counter() - started > timeout:
                raise TimeoutError(f"{op}: not done within {timeout} s")
            time.sleep(0.001)
        kind, hwm, result = parent.recv()
        if kind == "error":
            raise RuntimeError(f"{op} failed:\n{hwm}")
        return {"anon": peak - base_anon, "hwm": hwm - base_rss, "seconds": time.perf_counter() - started,
                "base_anon": base_anon, **result}
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def _save_dp(rank, world, model, items, save):
    from megatron_id.config import load_config
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([model], items))
    trainer.train_step()
    trainer.save_checkpoint(save)
    trainer.close()


def _tokenizer(out: Path) -> Path:
    """A byte-level BPE trained on the bundled sample (fits the 350M config's 32,000 ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32000, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [json.loads(line)["text"] for line in open(ROOT / "tests/data/fineweb-edu-sample-150.jsonl")]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "configs/model/350m.yaml"))
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--source-dp", type=int, default=1, choices=(1, 2),
                    help="data-parallel ranks of the ZeRO-1 checkpoint convert-checkpoint reads")
    ap.add_argument("--only", default=",".join(OPERATIONS))
    ap.add_argument("--work", help="a folder to work in (kept); default: a temporary one, removed")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--reuse", action="store_true",
                    help="with --work: reuse its data and checkpoint of an earlier run "
                         "(no 1-step run, no planner line)")
    args = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from data_tools.preprocess import main as preprocess
    from megatron_id.config import load_config
    from megatron_id.training.layout import training_layout
    from megatron_id.training.plan import run_estimate_gib

    work = Path(args.work or tempfile.mkdtemp(prefix="checkpoint_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        reuse = args.reuse and args.work and (work / "ckpt" / "latest").is_file()
        tokenizer = work / "tokenizer.json"
        if not reuse:
            _tokenizer(tokenizer)
            assert preprocess(["--input", str(ROOT / "tests/data/fineweb-edu-sample-150.jsonl"),
                               "--tokenizer", str(tokenizer), "--output-prefix", str(work / "fineweb"),
                               "--append-eod", "--no-progress"]) == 0
        prefix = str(work / "fineweb_text_document")
        items = _items(args, prefix, tokenizer, "train.global_batch_size=1")
        cfg = load_config([args.model], items)
        from megatron_id.model.accounting import build_on_meta
        params = sum(p.numel() for p in build_on_meta(cfg.model).parameters())
        weights = 4 * params
        print(f"model {args.model}: {params:,} parameters, fp32 weights {weights / GiB:.2f} GiB; "
              f"sequence {args.seq_length}, ZeRO-1, fp32", flush=True)

        ckpt = work / "ckpt"
        estimate = run_estimate_gib(cfg, training_layout(cfg, 1), on_gpu=False)
        saved = {"train_vmhwm": None}
        if not reuse:
            saved = measure("save", {"init_file": str(work / "pg-save"), "model": args.model,
                                     "items": items + [f"train.save={ckpt}"], "save": str(ckpt)})
            measured = saved["train_vmhwm"] / GiB
            print(f"1-step ZeRO-1 run, 1 process: peak resident memory {measured:.2f} GiB "
                  f"({saved['train_vmhwm'] / params:.1f} bytes/parameter); planner (run_estimate_gib) "
                  f"{estimate:.2f} GiB: {estimate / measured:.2f}x the measured peak", flush=True)
        source = ckpt
        if args.source_dp == 2:
            source = work / "ckpt-dp2"
        if args.source_dp == 2 and "convert" in args.only and not (reuse and (source / "latest").is_file()):
            from distributed import run_distributed
            run_distributed(_save_dp, 2, args=(args.model, _items(args, prefix, tokenizer, "train.global_batch_size=2",
                                                                  f"train.save={source}"), source),
                            timeout=3600, collective_timeout=1800)
        rows = {}
        for op in args.only.split(","):
            job = {"convert": {"source": str(source), "output": str(work / "converted")},
                   "export": {"source": str(ckpt), "output": str(work / "hf")},
                   "weights": {"source": str(ckpt), "init_file": str(work / "pg-weights"), "model": args.model,
                               "items": items + ["train.load_optimizer=false"]},
                   "resume": {"source": str(ckpt), "init_file": str(work / "pg-resume"), "model": args.model,
                              "items": items}}[op]
            rows[op] = measure(op, job)
            shutil.rmtree(work / "converted", ignore_errors=True)
            shutil.rmtree(work / "hf", ignore_errors=True)
            print(f"  {op}: {rows[op]['anon'] / GiB:.2f} GiB private, {rows[op]['seconds']:.1f} s", flush=True)
        labels = {"convert": f"convert-checkpoint (ZeRO-1, DP={args.source_dp})", "export": "export-hf",
                  "weights": "weights-only load (ZeRO-1)", "resume": "same-layout resume (ZeRO-1)"}
        print()
        print("| operation | fp32 weights | peak private (RssAnon) | / fp32 weights | VmHWM rise | time |")
        print("|---|---|---|---|---|---|")
        for op, r in rows.items():
            print(f"| {labels[op]} | {weights / GiB:.2f} GiB | {r['anon'] / GiB:.2f} GiB | "
                  f"{r['anon'] / weights:.2f}x | {r['hwm'] / GiB:.2f} GiB | {r['seconds']:.1f} s |")
        if args.json:
            Path(args.json).write_text(json.dumps({"parameters": params, "weights": weights, "rows": rows,
                                                   "train_vmhwm": saved["train_vmhwm"],
                                                   "estimate_gib": estimate}, indent=2))
        return 0
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
