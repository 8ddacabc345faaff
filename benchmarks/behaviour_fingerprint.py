"""A refactor's proof that behaviour did not change: the losses of a sweep over layouts and
features, and the bytes of a Hugging Face export, recorded as JSON and compared between commits.

    python benchmarks/behaviour_fingerprint.py --out before.json           # on the old commit
    python benchmarks/behaviour_fingerprint.py --out after.json --compare before.json

Each cell trains the tiny model for a few steps through `megatron-id train --nproc N` (the real
command, its spawned gloo ranks and DeepSpeed) on the bundled FineWeb-Edu sample, and records
every logged loss and gradient norm as exact float reprs. The last cell is exported with
`export-hf`, and the safetensors and config bytes are hashed. --compare prints a table and exits 1
on any difference: losses are compared bit for bit (same machine, same threads: a refactor that
only moves code leaves every float where it was). Takes ~6 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (ranks, overrides): every parallel axis, both loss paths, the document masks, MQAR,
# every mixer and a hybrid
CELLS = {
    "interdomain-dp1": (1, []),
    "interdomain-tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "interdomain-tp2-sp": (2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    "interdomain-pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
    "interdomain-cp2": (2, ["parallel.context_parallel_size=2"]),
    "interdomain-zero2-dp2": (2, ["train.zero_stage=2"]),
    "interdomain-fused-loss-tp2": (2, ["parallel.tensor_model_parallel_size=2", "train.fused_lm_head_loss=true"]),
    "interdomain-documents": (1, ["data.reset_attention_mask=true", "data.reset_position_ids=true"]),
    "softmax-tp2": (2, ["model.mixer=softmax", "parallel.tensor_model_parallel_size=2"]),
    "s4d-dp1": (1, ["model.mixer=s4d"]),
    "hybrid-pp2": (2, ["model.layer_pattern=IA|WS", "model.n_layers=4", "model.window=16",
                       "parallel.pipeline_model_parallel_size=2"]),
    "mqar-dp1": (1, ["data.source=mqar"]),
}
EXPORTED = "interdomain-dp1"


def run(cmd, env):
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(cmd)}\n{result.stderr[-3000:]}")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fingerprint(work: Path, cells: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    prefix = work / "fineweb"
    run([sys.executable, "-m", "data_tools.preprocess", "--input", "tests/data/fineweb-edu-sample-150.jsonl",
         "--tokenizer", "tests/data/gpt2-tokenizer.json", "--output-prefix", str(prefix), "--append-eod"], env)
    out = {}
    for name in cells:
        ranks, overrides = CELLS[name]
        metrics = work / f"{name}.jsonl"
        save = work / name / "checkpoints"
        # MQAR generates its own samples: no corpus, no tokenizer, the tiny vocabulary
        data = ([] if "data.source=mqar" in overrides else
                ["--config", "configs/train/quickstart.yaml", f"data.data_path=[{prefix}_text_document]",
                 "model.vocab_size=50304"])
        run([sys.executable, "-m", "megatron_id.cli", "train", "--nproc", str(ranks),
             "--config", "configs/model/tiny.yaml", *data, "train.train_tokens=8192", "train.zero_stage=1",
             "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_interval=1",
             "train.eval_interval=4", "train.eval_iters=1", f"train.save={save}",
             f"train.metrics_file={metrics}", *overrides], env)
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        # the numbers the run computed (not its timings or memory)
        kept = ("step", "train/loss", "train/grad_norm", "train/lr", "train/skipped_steps")
        out[name] = [{k: repr(v) for k, v in row.items() if k in kept or k.startswith("valid")} for row in rows]
        if name == EXPORTED:
            hf = work / "hf"
            run([sys.executable, "-m", "megatron_id.cli", "export-hf", "--checkpoint", str(save),
                 "--output", str(hf)], env)
            out["export"] = {p.name: sha256(p) for p in sorted(hf.iterdir())
                             # manifest.json hashes the bundled model code too, which a refactor moves
                             if p.suffix in (".safetensors", ".json") and p.name != "manifest.json"}
    return out


def compare(old: dict, new: dict) -> bool:
    same = True
    print(f"{'cell':32} {'rows':>5}  result")
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        verdict = "identical" if a == b else "DIFFERENT"
        same &= a == b
        print(f"{name:32} {len(b or []):>5}  {verdict}")
        if a != b and isinstance(a, list) and isinstance(b, list):
            for x, y in zip(a, b):
                if x != y:
                    print(f"    first difference: {x} -> {y}")
                    break
        elif a != b and isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    print(f"    {key}: {a.get(key, 'absent')[:12]} -> {(b.get(key) or 'absent')[:12]}")
    return same


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where the fingerprint JSON goes")
    parser.add_argument("--compare", help="an earlier fingerprint: print the table, exit 1 on any difference")
    parser.add_argument("--cells", nargs="*", default=list(CELLS), choices=list(CELLS), metavar="CELL")
    args = parser.parse_args(argv)
    if args.compare and not Path(args.compare).is_file():
        sys.exit(f"--compare {args.compare}: no such file (make it with --out on the earlier commit)")
    # before the minutes of training, not after: an output that cannot be written, or one that
    # would replace an earlier fingerprint
    out = Path(args.out)
    if out.exists():
        sys.exit(f"--out {out} exists: give a new file name (an earlier fingerprint is never replaced)")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        sys.exit(f"--out {out}: its folder {out.parent} does not exist or cannot be written: give a writable folder")
    with tempfile.TemporaryDirectory(prefix="fingerprint-") as tmp:
        result = fingerprint(Path(tmp), args.cells)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}: {len(args.cells)} cells")
    if args.compare:
        sys.exit(0 if compare(json.loads(Path(args.compare).read_text()), result) else 1)


if __name__ == "__main__":
    main()
