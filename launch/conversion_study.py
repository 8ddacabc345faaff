"""Conversion at CPU scale (issue 43 item 6), in the replication's spirit: a softmax teacher
trained on Wikipedia until it reads its context, converted (`megatron-id convert`) to an
all-interdomain student and to a hybrid, distilled (stage layers, then stage logits) for a budget
of student tokens, against the same architecture trained from scratch on the same budget; each
student over --seeds seeds; validation perplexity and context use by `megatron-id eval length`;
writes docs/conversion-study.md.

    python launch/conversion_study.py --out runs/conversion       # ~40 min on 2 cores
    python launch/conversion_study.py --smoke --out /tmp/cs        # every step with tiny budgets

The cells (each trained in its own folder under --out/runs; every step is skipped when its result
is in --out/state.json, so a killed run continues where it stopped, a training step from its last
checkpoint):
  teacher       softmax, the replication's model (configs/replication/model.yaml: d 128, 4 layers,
                4 heads of 32) at context --context (128: a short context makes the far half of
                it something a small model learns to read, which the guard below asks for), the
                replication's recipe (train.yaml: AdamW 3e-3 -> 3e-4, cosine, warmup a tenth),
                --teacher-tokens tokens, one seed (1234): every student starts from this one
                teacher, so the seeds below measure the students' spread, not the teacher's.
  <student>-distilled-seedN   `megatron-id convert --layer-pattern P --seed N` of the teacher (the
                converted layers reuse its q/k/v/o; the new parameters are those the seed draws),
                then configs/conversion/stage_layers.yaml for --layers-share of the budget (only
                the converted mixers train, regressed on the teacher's attention outputs), then
                configs/conversion/stage_logits.yaml (train.finetune from stage layers' weights;
                KL to the teacher + 0.5 x next-token loss) for the rest: --student-tokens in all,
                both stages counted. The stages' recipes are the project's (lr 1e-3 and 3e-4),
                their warmups a tenth of each stage.
  <student>-scratch-seedN     the same architecture (convert's printed model.* settings) trained
                from scratch for --student-tokens with the teacher's recipe, seed N.
  Students: all-interdomain (IIII) and a hybrid (--hybrid: select:N for convert's --select N, which
  keeps softmax the N layers of lowest attention entropy on the training data, default select:2;
  or a pattern such as IAIA). The same architecture for both arms: the model.* settings convert
  printed for that seed.
  The seed N sets the student's data order in both arms (train's seed), so the scratch run sees
  the first B tokens of order N; the distilled student sees the first B x share of them in stage
  layers and the first B x (1 - share) again in stage logits (finetune restarts the data): never a
  token the scratch run did not see. Equal student tokens, not equal compute: the teacher's
  training is not counted, and the teacher's forward in both stages adds ~1/3 per step.

Evaluation: `megatron-id eval length` on the held-out Wikipedia articles (enwiki2015_val), windows
of 0.5x, 1x and 2x the training length over the same --eval-tokens tokens: the 1x perplexity is
the validation perplexity; context use (launch/reproduce.py's) is how much the mean loss falls
from 0.5x to 1x windows. The verdict rule is the replication's (reproduce.below): an ordering
holds when every seed of one beats every seed of the other, does not hold when the reverse, tie
otherwise; when the teacher's context use is below the replication's guard (CONTEXT_USE, 0.01
nats) every conversion verdict is "not testable": a teacher that does not read its context has
nothing about reading it to hand on, and interdomain against attention is then not what differs.
MQAR is not run: the teacher is a language model, and its students would be scored on a task
none of them was trained on (near chance, whatever conversion did); testing conversion on MQAR
means an MQAR-trained softmax teacher converted and distilled on MQAR data, a study of its own.

The corpus folder must hold enwiki2015_train-00-of-04.jsonl.zst and enwiki2015_val.jsonl.zst
(../shared/data/corpus, CC BY-SA 3.0: Wikipedia contributors).
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reproduce as R  # noqa: E402  (launch/reproduce.py: Run, Cell, verdicts, report helpers)

ROOT = R.ROOT
CONVERSION = ROOT / "configs" / "conversion"
STUDY = "convert"          # the study folder under --out/eval and the Cells' study
FACTORS = ("0.5", "1", "2")
TEACHER_SEED = 1234


def log(message: str) -> None:
    print(f"[conversion-study {time.strftime('%H:%M:%S')}] {message}", flush=True)


def budgets(args) -> dict:
    if args.smoke:
        return {"teacher": 16 * args.batch_tokens, "student": 8 * args.batch_tokens, "eval_tokens": 4096,
                "context": args.context}
    return {"teacher": args.teacher_tokens, "student": args.student_tokens, "eval_tokens": args.eval_tokens,
            "context": args.context}


def students(args) -> dict:
    """name -> (convert's pattern options, label)."""
    hybrid = args.hybrid
    if hybrid.startswith("select:"):
        n = int(hybrid.split(":", 1)[1])
        return {"interdomain": (["--layer-pattern", "IIII"], "IIII"),
                "hybrid": (["--select", str(n)], f"convert --select {n}")}
    return {"interdomain": (["--layer-pattern", "IIII"], "IIII"),
            "hybrid": (["--layer-pattern", hybrid], f"convert --layer-pattern {hybrid}")}


def stage_tokens(args) -> tuple[int, int]:
    """(stage layers, stage logits) tokens: whole steps, adding to the student budget."""
    b, step = budgets(args), args.batch_tokens
    total = max(2, b["student"] // step)
    layers = min(total - 1, max(1, round(total * args.layers_share)))
    return layers * step, (total - layers) * step


def steps_of(tokens: int, args) -> int:
    return -(-tokens // args.batch_tokens)


def folder(args, kind: str, name: str) -> Path:
    return args.out / "runs" / kind / name


def common(args, data: Path, tokenizer: Path, tokens: int, save: Path, seed: int) -> list[str]:
    batch = args.batch_tokens // args.context
    items = [f"train.train_tokens={tokens}", f"train.save={save}", f"seed={seed}",
             f"model.seq_length={args.context}", f"train.micro_batch_size={batch}",
             f"train.global_batch_size={batch}", f"optimizer.warmup_tokens={max(tokens // 10, 1)}",
             f"data.data_path=[{data}_text_document]", f"data.tokenizer={tokenizer}"]
    if args.smoke:
        items += ["train.save_interval=4", "train.log_interval=2"]
    return items


def train(run: R.Run, args, configs: list, items: list, save: Path, tokens: int, log_name: str) -> dict:
    """One `megatron-id train`; the step is done when its last checkpoint is the run's last step."""
    config = [a for c in configs for a in ("--config", str(c))]
    run.call([sys.executable, "-m", "megatron_id.cli", "train", *config, *items],
             args.out / "logs" / f"{log_name}.log")
    steps = steps_of(tokens, args)
    latest = (save / "latest").read_text().strip()
    if latest != f"iter_{steps:07d}":
        raise SystemExit(f"conversion-study: error: {log_name} stopped at {latest} of {steps} steps (signalled?): "
                         f"rerun to continue.")
    return {"steps": steps, "tokens": tokens}


def resumes(save: Path) -> bool:
    return (save / "latest").is_file()


def train_teacher(run, args, data, tokenizer) -> dict:
    save, tokens = folder(args, "teacher", "teacher"), budgets(args)["teacher"]
    items = common(args, data, tokenizer, tokens, save, TEACHER_SEED) + [f"train.load={save}", "model.mixer=softmax"]
    return train(run, args, R.CONFIGS, items, save, tokens, "teacher")


def convert(run, args, name: str, seed: int, data: Path) -> dict:
    """The teacher converted; returns the model.* settings convert printed (every student's
    training, distilled or from scratch, uses them)."""
    out = folder(args, "convert", f"{name}-seed{seed}")
    shutil.rmtree(out, ignore_errors=True)   # ours: an interrupted conversion starts again
    options, _ = students(args)[name]
    if "--select" in options:
        options = [*options, "--data-path", f"{data}_text_document", "--select-seq-length", str(args.context)]
    output = run.call([sys.executable, "-m", "megatron_id.cli", "convert", "--checkpoint",
                       folder(args, "teacher", "teacher"), "--output", out, "--seed", str(seed), *options],
                      args.out / "logs" / f"convert-{name}-seed{seed}.log")
    found = re.search(r"and its model: (.*)$", output, re.M)
    if not found:
        raise SystemExit(f"conversion-study: error: convert printed no model settings:\n{output[-2000:]}")
    overrides = found.group(1).split()
    pattern = next((o.split("=", 1)[1] for o in overrides if o.startswith("model.layer_pattern=")), None)
    return {"overrides": overrides, "pattern": pattern}


def overrides_of(run, name: str, seed: int) -> list[str]:
    return run.state[f"convert:{name}-seed{seed}"]["overrides"]


def distill(run, args, name: str, seed: int, data: Path, tokenizer: Path) -> dict:
    """Stage layers then stage logits, each its own step (a resumed run continues the one it was in)."""
    teacher = folder(args, "teacher", "teacher")
    model = overrides_of(run, name, seed)
    layers_tokens, logits_tokens = stage_tokens(args)
    a, b = folder(args, "distill-layers", f"{name}-seed{seed}"), folder(args, "distill-logits", f"{name}-seed{seed}")
    configs_a = [*R.CONFIGS, CONVERSION / "stage_layers.yaml"]
    configs_b = [*R.CONFIGS, CONVERSION / "stage_logits.yaml"]

    def layers():
        load = a if resumes(a) else folder(args, "convert", f"{name}-seed{seed}")
        items = common(args, data, tokenizer, layers_tokens, a, seed) + [
            f"train.load={load}", f"train.distill.teacher={teacher}", *model]
        return train(run, args, configs_a, items, a, layers_tokens, f"distill-layers-{name}-seed{seed}")

    def logits():
        # stage (b) starts from stage (a)'s weights at step 0 (finetune); its resume is its own history
        load = [f"train.load={b}", "train.finetune=false"] if resumes(b) else [f"train.load={a}", "train.finetune=true"]
        items = common(args, data, tokenizer, logits_tokens, b, seed) + [
            *load, f"train.distill.teacher={teacher}", *model]
        return train(run, args, configs_b, items, b, logits_tokens, f"distill-logits-{name}-seed{seed}")

    run.step(f"train:distill-layers/{name}-seed{seed}", layers)
    run.step(f"train:distill-logits/{name}-seed{seed}", logits)
    return {"tokens": layers_tokens + logits_tokens}


def scratch(run, args, name: str, seed: int, data: Path, tokenizer: Path) -> dict:
    save = folder(args, "scratch", f"{name}-seed{seed}")
    tokens = sum(stage_tokens(args))   # the distilled students' budget, to the token
    items = common(args, data, tokenizer, tokens, save, seed) + [f"train.load={save}", *overrides_of(run, name, seed)]
    return train(run, args, R.CONFIGS, items, save, tokens, f"scratch-{name}-seed{seed}")


# ---------------------------------------------------------------- evaluation

def cells(args) -> list:
    """The evaluated models as reproduce.Cells (study 'convert'): the teacher, then each student's
    distilled and scratch rows, a cell per seed."""
    out = [R.Cell(STUDY, "teacher", TEACHER_SEED, [], budgets(args)["teacher"], args.context)]
    for name in students(args):
        for arm in ("distilled", "scratch"):
            out += [R.Cell(STUDY, f"{name}-{arm}", s, [], budgets(args)["student"], args.context)
                    for s in range(1, args.seeds + 1)]
    return out


def checkpoint_of(args, cell) -> Path:
    if cell.model == "teacher":
        return folder(args, "teacher", "teacher")
    name, arm = cell.model.rsplit("-", 1)
    return folder(args, "distill-logits" if arm == "distilled" else "scratch", f"{name}-seed{cell.seed}")


def evaluate(run, args, cell, val: Path) -> None:
    out = args.out / "eval" / STUDY / cell.name
    shutil.rmtree(out, ignore_errors=True)   # ours: an interrupted eval starts again
    run.call([sys.executable, "-m", "megatron_id.cli", "eval", "length", "--checkpoint", checkpoint_of(args, cell),
              "--name", cell.name, "--device", "cpu", "--out", out, "--text", val, "--max-tokens",
              str(budgets(args)["eval_tokens"]), "--factors", *FACTORS, "--bucket", "0.25"],
             args.out / "logs" / f"eval-{cell.name}.log")


# ---------------------------------------------------------------- the page

def guarded(verdict: str, teacher_use: float) -> str:
    """The replication's guard, on the teacher: a teacher that gains less than CONTEXT_USE from the
    far half of its context has no context use to hand on."""
    if teacher_use >= R.CONTEXT_USE:
        return verdict
    return (f"**not testable** (the teacher gains {teacher_use:.4f} < {R.CONTEXT_USE} nats from the second half of "
            f"its context: it has no reading of its context to hand on; by the seeds alone: "
            f"{verdict.replace('**', '')})")


def claims(results: R.StudyResults, teacher_use: float, names: list) -> list[tuple]:
    """(claim, here, verdict) rows: per student, distilled below scratch in perplexity and above it
    in context use; the hybrid below all-interdomain, distilled."""
    S, rows = STUDY, []
    for name in names:
        d, s = results.ppl(S, f"{name}-distilled"), results.ppl(S, f"{name}-scratch")
        rows.append((f"{name}: converted + distilled below from scratch (1x perplexity, same student tokens)",
                     f"{R.spread(d, 2)} vs {R.spread(s, 2)}", guarded(R.below(d, s), teacher_use)))
    for name in names:
        d, s = results.context_use(S, f"{name}-distilled"), results.context_use(S, f"{name}-scratch")
        rows.append((f"{name}: converted + distilled reads more of its context than from scratch (context use, "
                     "nats)", f"{R.spread(d, 4)} vs {R.spread(s, 4)}", guarded(R.below(s, d), teacher_use)))
    if "hybrid" in names and "interdomain" in names:
        h, i = results.ppl(S, "hybrid-distilled"), results.ppl(S, "interdomain-distilled")
        rows.append(("converted + distilled: the hybrid below all-interdomain (1x perplexity)",
                     f"{R.spread(h, 2)} vs {R.spread(i, 2)}", guarded(R.below(h, i), teacher_use)))
    return rows


def write_page(run, args, report: Path, command: str) -> None:
    cs = cells(args)
    results = R.StudyResults(args, cs)
    names = list(students(args))
    b = budgets(args)
    teacher_use = results.context_use(STUDY, "teacher")[0]
    teacher_ppl = results.ppl(STUDY, "teacher")[0]
    layers_tokens, logits_tokens = stage_tokens(args)
    # convert's pattern per student (--select measures on sampled sequences: seeds could differ; each
    # scratch run has its own seed's pattern)
    patterns = {n: " / ".join(dict.fromkeys(str(run.state.get(f"convert:{n}-seed{s}", {}).get("pattern"))
                                           for s in range(1, args.seeds + 1))) for n in names}
    seconds = R.step_seconds(run)
    total = sum(v for k, v in seconds.items() if not k.startswith("student:"))   # those hold their stages

    def arm_seconds(prefixes, name):
        vals = [sum(v for k, v in seconds.items() if k.startswith(tuple(prefixes)) and k.endswith(f"/{name}-seed{s}"))
                for s in range(1, args.seeds + 1)]
        return R.spread(vals, 0)

    guard = ("passes" if teacher_use >= R.CONTEXT_USE else "**fails**")
    lines = ["# Conversion at CPU scale: softmax teacher -> interdomain and hybrid students", "",
             "Generated by `launch/conversion_study.py`; every number comes from its `megatron-id eval length` "
             f"results (`{args.out}/eval/{STUDY}/<cell>/results.json`). How conversion and distillation work: "
             "[conversion.md](conversion.md); the replication this follows: [replication.md](replication.md).", "",
             f"- command: `{command}`",
             f"- machine: {R.machine()}",
             f"- time: {total / 60:.1f} minutes of steps ({args.jobs} at once, so the wall clock was less; a resumed "
             "run adds its parts)",
             f"- data: Wikipedia (enwiki2015, CC BY-SA 3.0: Wikipedia contributors): trained on the first training "
             f"shard, a 4,096-token BPE trained on it; evaluated on the held-out articles (enwiki2015_val), "
             f"{b['eval_tokens']:,} tokens per window length",
             f"- teacher: softmax, d 128, 4 layers, 4 heads of 32, context {args.context}, {b['teacher']:,} tokens "
             f"({steps_of(b['teacher'], args)} steps of {args.batch_tokens:,}), the replication's recipe, one seed "
             f"({TEACHER_SEED}): every student starts from it",
             f"- students: all-interdomain (pattern {patterns.get('interdomain') or 'IIII'}) and a hybrid "
             f"({students(args)['hybrid'][1]}: pattern {patterns.get('hybrid')}); each {sum(stage_tokens(args)):,} "
             f"student tokens: distilled = stage layers {layers_tokens:,} + stage logits {logits_tokens:,} "
             "(configs/conversion/*.yaml, warmup a tenth of each stage); scratch = the same architecture, the same "
             "tokens, the teacher's recipe",
             f"- seeds: {args.seeds} per student (the seed draws the converted layers' new parameters and the "
             "scratch model's initialisation, and sets the data order in both arms); `mean [min, max]` over them",
             f"- the teacher's context use: {teacher_use:.4f} nats; the replication's guard ({R.CONTEXT_USE} nats) "
             f"{guard}", ""]
    rows = claims(results, teacher_use, names)
    lines += ["## The orderings", "",
              "The replication's rule: an ordering holds when every seed of one model beats every seed of the other, "
              "does not hold when the reverse is true, and is a tie otherwise. When the teacher gains less than "
              f"{R.CONTEXT_USE} nats from the far half of its context the verdicts are not testable (the teacher has "
              "no reading of its context to hand on, so interdomain against attention is not what the students "
              "differ in).", "",
              "| claim | here | verdict |", "|---|---|---|", *(f"| {c} | {h} | {v} |" for c, h, v in rows), ""]
    lines += ["## Validation perplexity and context use", "",
              f"Held-out Wikipedia, windows of the training length ({args.context}); context use: how much the mean "
              "loss falls from windows of 0.5x to 1x the training length on the same tokens (launch/reproduce.py's); "
              "2x / 1x: windows of twice the training length (extrapolation). Seconds: training (both stages for "
              "the distilled students; not counting the teacher's).", "",
              "| model | pattern | student tokens | 1x perplexity | gap to teacher | context use (nats) | 2x / 1x | "
              "training seconds |", "|---|---|---|---|---|---|---|---|",
              f"| teacher (softmax) | AAAA | {b['teacher']:,} (its own) | {teacher_ppl:.2f} | - | {teacher_use:.4f} | "
              f"{results.ratios(STUDY, 'teacher', '2')[0]:.3f} | {seconds.get('train:teacher', 0):.0f} |"]
    for name in names:
        for arm in ("distilled", "scratch"):
            m = f"{name}-{arm}"
            ppl = results.ppl(STUDY, m)
            prefixes = ["train:distill-layers/", "train:distill-logits/"] if arm == "distilled" else ["train:scratch/"]
            lines.append(f"| {name}, {'converted + distilled' if arm == 'distilled' else 'from scratch'} | "
                         f"{patterns.get(name)} | {sum(stage_tokens(args)):,} | {R.spread(ppl, 2)} | "
                         f"{R.spread([p - teacher_ppl for p in ppl], 2)} | "
                         f"{R.spread(results.context_use(STUDY, m), 4)} | "
                         f"{R.spread(results.ratios(STUDY, m, '2'))} | {arm_seconds(prefixes, name)} |")
    lines += ["", "By seed (1x perplexity):", "",
              "| model | " + " | ".join(f"seed {s}" for s in range(1, args.seeds + 1)) + " |",
              "|" + "---|" * (args.seeds + 1)]
    for name in names:
        for arm in ("distilled", "scratch"):
            lines.append(f"| {name}-{arm} | " + " | ".join(f"{p:.2f}" for p in results.ppl(STUDY, f"{name}-{arm}"))
                         + " |")
    lines += ["", "## Why no MQAR", "",
              "The teacher is a language model trained on Wikipedia; MQAR scores a model trained on the MQAR task "
              "(`data.source=mqar`), and these students never were, so their accuracy would be near chance whatever "
              "conversion did. Testing conversion on recall needs an MQAR-trained softmax teacher converted and "
              "distilled on MQAR data (a study of its own; the replication's MQAR cells took 3-15 minutes each).", ""]
    # a distilled student's step (student:...) holds its two stages' rows: shown once, by stage
    lines += [line for line in R.steps_table(run) if not line.startswith("| student:")]
    R.write_with_notes(report, lines)


# ---------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python launch/conversion_study.py", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "data" / "corpus")
    p.add_argument("--out", type=Path, required=True, help="working folder (created; reused to resume)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per student (default 3)")
    p.add_argument("--jobs", type=int, default=2, help="cells trained at once (default 2; threads = cores / jobs)")
    p.add_argument("--context", type=int, default=128, help="training context of every model (default 128)")
    p.add_argument("--batch-tokens", type=int, default=2048, help="tokens per step (default 2048: 16 x 128)")
    p.add_argument("--teacher-tokens", type=int, default=3_000_000, help="the teacher's tokens (default 3M)")
    p.add_argument("--student-tokens", type=int, default=1_000_000,
                   help="each student's budget, both distillation stages counted (default 1M)")
    p.add_argument("--layers-share", type=float, default=0.2, help="stage layers' share of the budget (0.2)")
    p.add_argument("--hybrid", default="select:2",
                   help="the hybrid: select:N (default select:2: convert --select N keeps the N layers of lowest "
                        "attention entropy softmax) or a pattern for convert --layer-pattern (e.g. IAIA)")
    p.add_argument("--eval-tokens", type=int, default=65536, help="tokens scored per window length (65,536)")
    p.add_argument("--report", type=Path, default=None,
                   help="default docs/conversion-study.md (--smoke: <out>/conversion-study.md)")
    p.add_argument("--teacher-only", action="store_true",
                   help="stop after training and evaluating the teacher (the same --out continues later)")
    p.add_argument("--smoke", action="store_true", help="tiny budgets, at most 2 seeds: checks the pipeline")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for option, value, least in (("--seeds", args.seeds, 1), ("--jobs", args.jobs, 1), ("--context", args.context, 8),
                                 ("--teacher-tokens", args.teacher_tokens, 4096),
                                 ("--student-tokens", args.student_tokens, 4096),
                                 ("--eval-tokens", args.eval_tokens, 1024)):
        if value < least:
            raise SystemExit(f"conversion-study: error: {option} {value}: at least {least:,}.")
    if args.batch_tokens % args.context:
        raise SystemExit(f"conversion-study: error: --batch-tokens {args.batch_tokens} is not a multiple of "
                         f"--context {args.context}.")
    if not 0 < args.layers_share < 1:
        raise SystemExit(f"conversion-study: error: --layers-share {args.layers_share}: in (0, 1).")
    if not (re.fullmatch(r"select:[1-9][0-9]*", args.hybrid) or re.fullmatch(r"[IA]{4}", args.hybrid)):
        raise SystemExit(f"conversion-study: error: --hybrid {args.hybrid}: four letters of I and A (e.g. IAIA) or "
                         "select:N.")
    if args.smoke:
        args.seeds = min(args.seeds, 2)
    report = args.report or (args.out if args.smoke else ROOT / "docs") / "conversion-study.md"
    shard, val = args.corpus / "enwiki2015_train-00-of-04.jsonl.zst", args.corpus / "enwiki2015_val.jsonl.zst"
    for f in (shard, val):
        if not f.is_file():
            raise SystemExit(f"conversion-study: error: {f} not found: --corpus must be the folder holding the "
                             "Wikipedia shards (../shared/data/corpus).")
    R.check_out(args.out, args.report, "conversion-study")
    args.out.mkdir(parents=True, exist_ok=True)
    run = R.Run(args)
    # the teacher's settings are checked always, the students' once a student step has run (the
    # teacher may be trained first, --teacher-only, and the student budget chosen after)
    settings = {"smoke": args.smoke, "context": args.context, "batch_tokens": args.batch_tokens,
                "teacher_tokens": budgets(args)["teacher"], "eval_tokens": budgets(args)["eval_tokens"]}
    student_settings = {"student_tokens": budgets(args)["student"], "layers_share": args.layers_share,
                        "hybrid": args.hybrid, "seeds": args.seeds}
    recorded = run.state.get("settings", {})
    started = any(k.startswith(("convert:", "student:", "train:scratch/", "train:distill")) for k in run.state)
    check = {**settings, **student_settings} if started else settings
    for key, value in check.items():
        if key in recorded and recorded[key] != value:
            raise SystemExit(f"conversion-study: error: {args.out} holds a run with {key}={recorded[key]} (now "
                             f"{value}): give the same budgets to continue it, or another --out.")
    if not args.teacher_only:
        settings.update(student_settings)
    run.state["settings"] = {**recorded, **settings}
    run.forward_signals()
    py = sys.executable
    tokenizer, data = args.out / "tokenizer.json", args.out / "data" / "wiki"
    command = " ".join(["python", "launch/conversion_study.py", *(sys.argv[1:] if argv is None else argv)])

    run.step("tokenizer", lambda: run.call([py, "-m", "data_tools.train_tokenizer", "--input", shard,
                                            "--vocab-size", "4096", "--output", tokenizer, "--overwrite"]))
    run.step("preprocess", lambda: run.call([py, "-m", "data_tools.preprocess", "--input", shard, "--tokenizer",
                                             tokenizer, "--output-prefix", data, "--append-eod", "--workers", "2",
                                             "--no-progress", "--overwrite"]))
    run.step("train:teacher", lambda: train_teacher(run, args, data, tokenizer))
    teacher_cell = cells(args)[0]
    run.step(f"eval:{STUDY}/{teacher_cell.name}", lambda: evaluate(run, args, teacher_cell, val))
    if args.teacher_only:
        use = R.StudyResults(args, [teacher_cell]).context_use(STUDY, "teacher")[0]
        log(f"the teacher is trained and evaluated: context use {use:.4f} nats (guard {R.CONTEXT_USE}); stopping "
            "(--teacher-only)")
        return 0
    seeds = range(1, args.seeds + 1)
    for name in students(args):
        for s in seeds:
            run.step(f"convert:{name}-seed{s}", lambda name=name, s=s: convert(run, args, name, s, data))
    # the distilled chains (two stages each, the longer) first, then the scratch runs
    run.parallel([(f"student:{name}-distilled-seed{s}", lambda name=name, s=s: distill(run, args, name, s, data,
                                                                                         tokenizer))
                  for name in students(args) for s in seeds] +
                 [(f"train:scratch/{name}-seed{s}", lambda name=name, s=s: scratch(run, args, name, s, data, tokenizer))
                  for name in students(args) for s in seeds])
    rest = cells(args)[1:]
    run.parallel([(f"eval:{STUDY}/{c.name}", lambda c=c: evaluate(run, args, c, val)) for c in rest])
    write_page(run, args, report, command)
    log(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
