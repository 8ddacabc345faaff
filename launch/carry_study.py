"""Recall across training windows: data.carry_state against reset windows (issue 44).

    python launch/carry_study.py --out runs/carry            # 3 seeds x 2 controls (~see docs/training.md)
    python launch/carry_study.py --out /tmp/c --smoke        # minutes: the pipeline end to end

MQAR across windows (data.mqar.query_window=2, data/mqar.py): every episode spans 3 windows of 32
tokens, the 4 key-value pairs open the first, 2 of the keys are asked in the third. Two controls
of the same task at the same tokens per step (configs/replication/mqar.yaml's model, interdomain,
--width):

    carried  data.carry_state=true, model.seq_length=96, train.carry_grad_windows=3: each row's
             3 windows run in order, the state (and its gradient) carried between them
    reset    model.seq_length=32: every window read alone

`megatron-id eval mqar` scores each checkpoint on the task's test split as it was trained
(episodes whole for carried, window by window for reset). The claim: carried > 0.9 on every seed
while reset stays at chance (below 2 x 1/64). Each step is a resumable command: a rerun skips what
is done (train.load = train.save; an eval writes its JSON last).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "replication" / "mqar.yaml"
WINDOW, EPISODE_WINDOWS = 32, 3
CONTROLS = {
    "carried": [f"model.seq_length={WINDOW * EPISODE_WINDOWS}", f"train.carry_grad_windows={EPISODE_WINDOWS}",
                "data.carry_state=true"],
    "reset": [f"model.seq_length={WINDOW}"],
}


def run(command: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise SystemExit(f"carry_study: error: {' '.join(command[:5])} ... failed (exit {done.returncode}); see {log}")


def train(args, control: str, seed: int) -> Path:
    save = args.out / "runs" / f"{control}-seed{seed}"
    episodes_per_step = 64
    tokens = args.steps * episodes_per_step * WINDOW * EPISODE_WINDOWS   # the same for both controls
    rows = episodes_per_step if control == "carried" else episodes_per_step * EPISODE_WINDOWS
    micro = 16 if control == "carried" else 48   # the same tokens per forward
    items = [f"--config={CONFIG}", "data.mqar.query_window=2", "model.vocab_size=136", f"model.d_model={args.width}",
             f"seed={seed}", f"train.train_tokens={tokens}", f"train.global_batch_size={rows}",
             f"train.micro_batch_size={micro}", f"optimizer.warmup_tokens={tokens // 10}", f"train.save={save}",
             f"train.load={save}", *CONTROLS[control]]
    if args.smoke:
        items += ["train.save_interval=2", "train.eval_interval=2", "train.log_interval=1"]
    run([sys.executable, "-m", "megatron_id.cli", "train", *items], args.out / "logs" / f"{control}-seed{seed}.log")
    return save


def evaluate(args, save: Path) -> dict:
    result = args.out / "eval" / f"{save.name}.json"
    if not result.is_file():
        result.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "megatron_id.cli", "eval", "mqar", "--checkpoint", str(save),
                               "--samples", str(args.samples), "--json"], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"carry_study: error: eval mqar {save} failed: {done.stderr[-2000:]}")
        partial = result.with_suffix(".json.partial")
        partial.write_text(done.stdout)
        partial.replace(result)
    return json.loads(result.read_text())["results"][0]


def table(scores: dict, seeds: list[int]) -> str:
    lines = ["| control | " + " | ".join(f"seed {s}" for s in seeds) + " | min | chance |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for control, by_seed in scores.items():
        accuracy = [by_seed[s]["accuracy"] for s in seeds]
        lines.append(f"| {control} | " + " | ".join(f"{a:.3f}" for a in accuracy)
                     + f" | {min(accuracy):.3f} | {by_seed[seeds[0]]['chance']:.3f} |")
    carried = min(scores["carried"][s]["accuracy"] for s in seeds)
    reset = max(scores["reset"][s]["accuracy"] for s in seeds)
    chance = scores["reset"][seeds[0]]["chance"]
    holds = carried > 0.9 and reset < 2 * chance
    lines += ["", f"carried > 0.9 on every seed and reset below 2 x chance: **{'holds' if holds else 'fails'}** "
              f"(carried min {carried:.3f}, reset max {reset:.3f})"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", type=Path, required=True, help="runs, logs, eval JSON and results.md (resumable)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=1500, help="steps of 64 episodes (1,500)")
    p.add_argument("--width", type=int, default=128, help="model.d_model (128)")
    p.add_argument("--samples", type=int, default=1000, help="test episodes scored (1,000)")
    p.add_argument("--smoke", action="store_true", help="4 steps, 64 test episodes: the pipeline, not the claim")
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.samples, args.width = 4, 64, 64
    if args.steps < 1 or args.samples < 1 or not args.seeds:
        raise SystemExit("carry_study: error: --steps and --samples must be at least 1, --seeds not empty.")
    args.out.mkdir(parents=True, exist_ok=True)
    scores = {control: {} for control in CONTROLS}
    for seed in args.seeds:
        for control in CONTROLS:
            scores[control][seed] = evaluate(args, train(args, control, seed))
            print(f"carry_study: {control} seed {seed}: accuracy {scores[control][seed]['accuracy']:.3f}",
                  file=sys.stderr, flush=True)
    text = table(scores, args.seeds)
    (args.out / "results.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
