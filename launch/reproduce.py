"""The paper's claims tested at CPU scale: length extrapolation at a context the Delta range fills,
the head shape and Delta range at a short context, and recall learned on synthetic associative
recall, each over several seeds; writes docs/replication.md.

    python launch/reproduce.py --out runs/replication                  # length, shapes, mqar (~2 h 45 min on 2 cores)
    python launch/reproduce.py --out runs/replication --study cube     # the earlier study: docs/replication-cube.md
    python launch/reproduce.py --smoke --out /tmp/smoke                # every step with tiny budgets

Studies (--study; each cell = one model and seed, trained in its own folder):
  length  context 1,024, two heads of 64 (the paper's head size), the paper's Delta range
          [1e-3, 1e-1]: softmax, interdomain and S4D-only, --seeds seeds each, --long-tokens tokens;
          `megatron-id eval length` to 4x on held-out Wikipedia, window means and by position.
  shapes  context 256, d_h 32 (4 heads) and 64 (2 heads) at d 128: interdomain with the paper's
          Delta range and with the range scaled to the context ([0.0156, 0.5]), softmax at both
          shapes; --short-tokens each; the same evaluation.
  mqar    multi-query associative recall (`data.source=mqar`, Zoology's task, generated): softmax,
          interdomain, S4D-only and a hybrid (a softmax layer over an interdomain one) at --widths,
          each at every learning rate of --mqar-lrs (the orderings take each mixer's best, as
          Zoology does); `megatron-id eval mqar` accuracy against the decode state (Zoology's fig. 2).
  cube    the first study (six models at 256 on 3M tokens: perplexity, cube, recall probes);
          docs/replication-cube.md, its analysis in docs/replication-cube-notes.md.
Every step is skipped when its result is there, so a killed run continues where it stopped (a cell
resumes from its last checkpoint); --jobs cells run at once, each with cores / jobs threads. The
report states for each of the paper's orderings: the paper's figure, ours (mean and range over
seeds), and holds / does not hold / tie, where a tie is any overlap of the seeds' ranges.
The corpus folder must hold enwiki2015_train-00-of-04.jsonl.zst and enwiki2015_val.jsonl.zst
(../shared/data/corpus, CC BY-SA 3.0: Wikipedia contributors); --study mqar alone needs none.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # run from a checkout without installing: the repo root

from megatron_id.atomic import write_atomic  # noqa: E402
from megatron_id.evaluation.report import pyplot, save_png  # noqa: E402

REPLICATION = ROOT / "configs" / "replication"
CONFIGS = [REPLICATION / "model.yaml", REPLICATION / "train.yaml"]
STUDIES = ("length", "shapes", "mqar", "cube")
DEFAULT_STUDIES = ("length", "shapes", "mqar")
PAPER_DT, SCALED_DT = [], ["model.dt_min=0.0156", "model.dt_max=0.5"]   # the schema's default is the paper's
FACTORS = ("0.5", "1", "2", "3.5", "4")
MQAR_CONTEXT = 32     # configs/replication/mqar.yaml's sequences
TASK_LEARNED = 0.9   # MQAR accuracy the best model must reach for an ordering to mean anything
CONTEXT_USE = 0.01   # nats gained from the far half of the context; below it "flat past 1x" tests nothing

# the cube study (docs/replication-cube.md): name -> overrides
CUBE_MODELS = {
    "softmax": ["model.mixer=softmax"],
    "interdomain": [],
    "s4d-only": ["model.mixer=s4d"],
    "no-query-readout": ["model.query_readout=false"],
    "single-input": ["model.dual_kv_input=false"],
    "interdomain-dt-scaled": SCALED_DT,
}
MIXERS = {"softmax": ["model.mixer=softmax"], "interdomain": [], "s4d-only": ["model.mixer=s4d"],
          # a softmax layer over an interdomain one: the smallest hybrid (model.layer_pattern)
          "hybrid": ["model.layer_pattern=IA"]}


def log(message: str) -> None:
    print(f"[reproduce {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Cell:
    study: str
    model: str              # the row it averages into (e.g. interdomain-dh64)
    seed: int
    items: list             # config overrides besides data, budget and folders
    tokens: int
    context: int
    configs: list = field(default_factory=lambda: list(CONFIGS))

    @property
    def name(self) -> str:
        return f"{self.model}-seed{self.seed}"

    @property
    def key(self) -> str:
        return f"{self.study}/{self.name}"


class Run:
    def __init__(self, args):
        self.args, self.out = args, args.out
        self.state_file = self.out / "state.json"
        self.state = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        self.lock, self.children, self.stopped = threading.Lock(), set(), []
        threads = max(1, (os.cpu_count() or 1) // max(args.jobs, 1))
        self.env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads),
                    "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "68719476736"}

    def done(self, step: str) -> bool:
        return step in self.state

    def mark(self, step: str, seconds: float, **extra) -> None:
        with self.lock:
            self.state[step] = {"seconds": round(seconds, 1), **extra}
            text = json.dumps(self.state, indent=1)
            write_atomic(self.state_file, lambda tmp: tmp.write_text(text))

    def forward_signals(self):
        """SIGTERM / SIGINT / SIGUSR1 go to every running step (a training run saves a checkpoint
        and stops), then this run stops, saying how to continue."""
        def forward(signum, frame):   # the trainer treats a repeated signal like one
            self.stopped.append(signum)
            with self.lock:
                for child in self.children:
                    child.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, forward)

    def call(self, argv, log_file: Path | None = None) -> str:
        """Run a step; its output goes to log_file (appended: a resumed step keeps its history)."""
        if self.stopped:
            raise SystemExit(f"reproduce: stopped by signal {self.stopped[0]}; rerun the same command to continue "
                             f"from here.")
        log_file = log_file or self.out / "logs" / "steps.log"
        log_file.parent.mkdir(parents=True, exist_ok=True)
        start = log_file.stat().st_size if log_file.exists() else 0
        with open(log_file, "a") as f:
            child = subprocess.Popen([str(a) for a in argv], env=self.env, cwd=ROOT, stdout=f,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            with self.lock:
                self.children.add(child)
            try:
                code = child.wait()
            finally:
                with self.lock:
                    self.children.discard(child)
        with open(log_file) as f:
            f.seek(start)
            output = f.read()
        if self.stopped:
            raise SystemExit(f"reproduce: stopped by signal {self.stopped[0]} during: {' '.join(map(str, argv[:4]))} "
                             f"...; rerun the same command to continue from here.")
        if code != 0:
            raise SystemExit(f"reproduce: error: step failed (exit {code}): {' '.join(map(str, argv))}\n"
                             f"{output[-3000:]}\nRerun the same command to continue from here (log: {log_file}).")
        return output

    def step(self, name: str, body) -> None:
        if self.done(name):
            return
        log(f"{name} ...")
        start = time.time()
        extra = body()
        extra = extra if isinstance(extra, dict) else {}
        self.mark(name, time.time() - start, **extra)
        log(f"{name} done in {time.time() - start:.0f} s")

    def parallel(self, steps: list) -> None:
        """(name, body) steps, --jobs at a time; the first failure stops new ones and is raised
        after the running ones end."""
        todo = [(n, b) for n, b in steps if not self.done(n)]
        if not todo:
            return
        with ThreadPoolExecutor(max(1, self.args.jobs)) as pool:
            futures = [pool.submit(self.step, n, b) for n, b in todo]
            error = None
            for future in futures:
                try:
                    future.result()
                except BaseException as err:   # SystemExit from a step: let the others finish, then raise
                    if error is None:
                        error = err
                        for other in futures:
                            other.cancel()
            if error is not None:
                raise error


# ---------------------------------------------------------------- the cells

def lr_tag(lr: float) -> str:
    """1e-3, 3e-4: the learning rate as cell names and tables show it."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def mqar_model(mixer: str, width: int, lr: float) -> str:
    return f"{mixer}-d{width}-lr{lr_tag(lr)}"


def budgets(args) -> dict:
    if args.smoke:
        return {"long": 8 * args.batch_tokens, "short": 8 * args.batch_tokens, "mqar_steps": 40, "context": 256,
                "mqar_samples": 64,
                "eval_tokens": 4096 * 2}
    return {"long": args.long_tokens, "short": args.short_tokens, "mqar_steps": args.mqar_steps, "context": 1024,
            "mqar_samples": 1000, "eval_tokens": 32768}


def study_cells(args) -> list[Cell]:
    b, seeds = budgets(args), range(1, args.seeds + 1)
    cells = []
    if "length" in args.study:
        models = ["softmax", "interdomain"] if args.smoke else ["softmax", "interdomain", "s4d-only"]
        cells += [Cell("length", m, s, ["model.n_heads=2", *MIXERS[m]], b["long"], b["context"])
                  for m in models for s in seeds]
    if "shapes" in args.study:
        shapes = {"interdomain-dh32": ["model.n_heads=4"], "interdomain-dh64": ["model.n_heads=2"],
                  "interdomain-dh32-dtscaled": ["model.n_heads=4", *SCALED_DT],
                  "interdomain-dh64-dtscaled": ["model.n_heads=2", *SCALED_DT],
                  "softmax-dh32": ["model.n_heads=4", *MIXERS["softmax"]],
                  "softmax-dh64": ["model.n_heads=2", *MIXERS["softmax"]]}
        if args.smoke:
            shapes = {k: v for k, v in shapes.items() if k in ("interdomain-dh32", "interdomain-dh64")}
        cells += [Cell("shapes", m, s, items, b["short"], 256) for m, items in shapes.items() for s in seeds]
    if "mqar" in args.study:
        mqar = [REPLICATION / "mqar.yaml"]
        mixers = ["softmax", "interdomain"] if args.smoke else list(MIXERS)
        widths = args.widths[:1] if args.smoke else args.widths
        for width in widths:
            for m in mixers:
                for lr in args.mqar_lrs:
                    for s in seeds:
                        tokens = b["mqar_steps"] * 64 * MQAR_CONTEXT   # global batch 64 (configs/replication/mqar.yaml)
                        cells.append(Cell("mqar", mqar_model(m, width, lr), s,
                                          [f"model.d_model={width}", *MIXERS[m], f"optimizer.lr={lr:g}",
                                           f"optimizer.min_lr={lr / 10:g}"], tokens, MQAR_CONTEXT, mqar))
    return cells


def train_cell(run: Run, args, cell: Cell, data: Path, tokenizer: Path) -> dict:
    py, save = sys.executable, args.out / "runs" / cell.study / cell.name
    batch = 64 if cell.study == "mqar" else max(1, args.batch_tokens // cell.context)
    items = [f"train.train_tokens={cell.tokens}", f"train.save={save}", f"train.load={save}", f"seed={cell.seed}",
             f"model.seq_length={cell.context}", f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}",
             f"optimizer.warmup_tokens={max(cell.tokens // 10, 1)}", *cell.items]
    if cell.study != "mqar":
        items += [f"data.data_path=[{data}_text_document]", f"data.tokenizer={tokenizer}"]
    if args.smoke:
        items += ["train.save_interval=4", "train.log_interval=2"]
    config = [a for c in cell.configs for a in ("--config", str(c))]
    run.call([py, "-m", "megatron_id.cli", "train", *config, *items],
             args.out / "logs" / cell.study / f"{cell.name}.log")
    steps = -(-cell.tokens // (batch * cell.context))   # the trainer's train_iters: whole steps, rounded up
    latest = (save / "latest").read_text().strip()
    if latest != f"iter_{steps:07d}":
        raise SystemExit(f"reproduce: error: {cell.key} stopped at {latest} of {steps} steps (signalled?): "
                         f"rerun to continue.")
    return {"steps": steps}


def eval_cell(run: Run, args, cell: Cell, val: Path) -> None:
    py, save = sys.executable, args.out / "runs" / cell.study / cell.name
    folder = args.out / "eval" / cell.study / cell.name
    shutil.rmtree(folder, ignore_errors=True)   # ours: an interrupted eval starts again
    b = budgets(args)
    if cell.study == "mqar":
        options = ["mqar", "--samples", str(b["mqar_samples"]), "--batch-size", "64"]
    else:
        options = ["length", "--text", str(val), "--max-tokens", str(b["eval_tokens"]), "--factors", *FACTORS,
                   "--bucket", "0.25"]
    run.call([py, "-m", "megatron_id.cli", "eval", options[0], "--checkpoint", save, "--name", cell.name,
              "--device", "cpu", "--out", folder, *options[1:]], args.out / "logs" / cell.study / f"{cell.name}.log")


def cell_result(out: Path, cell: Cell) -> dict:
    return json.loads((out / "eval" / cell.study / cell.name / "results.json").read_text())["results"][0]


# ---------------------------------------------------------------- main

def report_paths(args) -> tuple[Path, Path]:
    """Where the studies' and the cube's reports go: --report, else docs/; a smoke run or a
    subset of the cells (--cells) writes into --out, never over the full report under docs/."""
    docs = args.out if args.smoke or args.cells else ROOT / "docs"
    return args.report or docs / "replication.md", args.report or docs / "replication-cube.md"


def check_out(out: Path, report: Path | None = None, tool: str = "reproduce") -> None:
    """--out is a working folder a study script created (state.json or logs/ in it: a run to
    continue), an empty one or a new one; a file, or a folder of other things, is refused
    before any work (it would write tokenizer.json, data/, runs/, results.md ... among them).
    --report is a file whose folder exists (it is written hours later). `tool` names the script
    in the errors (reproduce, conversion-study and carry_study share this rule)."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"{tool}: error: --out {out} is a file: give a folder (new, empty, or an earlier "
                         f"run's to continue it).")
    if out.is_dir() and any(out.iterdir()) and not ((out / "state.json").is_file() or (out / "logs").is_dir()):
        raise SystemExit(f"{tool}: error: --out {out} holds other files and no run of this script (no state.json "
                         f"or logs/): give a new or empty folder, or an earlier run's to continue it.")
    for parent in out.parents:   # the first existing folder above a new --out must be a folder
        if parent.exists():
            if not parent.is_dir():
                raise SystemExit(f"{tool}: error: --out {out}: {parent} is a file, not a folder.")
            break
    if report is not None:
        if report.is_dir():
            raise SystemExit(f"{tool}: error: --report {report} is a folder: give a file name "
                             f"(e.g. {report / 'replication.md'}).")
        if not report.parent.is_dir():
            raise SystemExit(f"{tool}: error: --report {report}: the folder {report.parent} does not exist.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python launch/reproduce.py", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("--corpus", type=Path, default=ROOT.parent / "shared" / "data" / "corpus")
    p.add_argument("--extra", nargs="*", type=Path, default=None, help="cube: other sources (.txt files)")
    p.add_argument("--out", type=Path, required=True, help="working folder (created; reused to resume)")
    p.add_argument("--study", nargs="+", choices=STUDIES, default=list(DEFAULT_STUDIES))
    p.add_argument("--seeds", type=int, default=3, help="seeds per cell (default 3)")
    p.add_argument("--jobs", type=int, default=2, help="cells trained at once (default 2; threads = cores / jobs)")
    p.add_argument("--long-tokens", type=int, default=2_000_000, help="length study: tokens per model (2M)")
    p.add_argument("--short-tokens", type=int, default=1_000_000, help="shapes study: tokens per model (1M)")
    p.add_argument("--batch-tokens", type=int, default=2048,
                   help="length and shapes: tokens per step (default 2048: 2 x 1,024 or 8 x 256); steps, not "
                        "tokens, are what these small models are short of")
    p.add_argument("--mqar-steps", type=int, default=2500, help="mqar study: steps of 64 sequences (2,500)")
    p.add_argument("--widths", nargs="+", type=int, default=[64, 128], help="mqar study: d_model values (64 128)")
    p.add_argument("--mqar-lrs", nargs="+", type=float, default=[1e-3, 3e-4],
                   help="mqar study: learning rates, each mixer at each (default 1e-3 3e-4); the orderings take "
                        "each mixer's best, as Zoology does")
    p.add_argument("--cells", nargs="+", default=None, metavar="GLOB",
                   help="only the cells matching one of these (e.g. 'length/softmax-*'); the report shows those "
                        "and goes into --out unless --report says where")
    p.add_argument("--tokens", type=int, default=3_000_000, help="cube: training tokens per model (default 3M)")
    p.add_argument("--models", nargs="+", choices=list(CUBE_MODELS), default=None, help="cube: models")
    p.add_argument("--report", type=Path, default=None,
                   help="default: docs/replication.md (cube: docs/replication-cube.md; smoke or --cells: in --out)")
    p.add_argument("--smoke", action="store_true", help="tiny budgets, two models per study: checks the pipeline")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for option, value, least in (("--seeds", args.seeds, 1), ("--jobs", args.jobs, 1),
                                 ("--long-tokens", args.long_tokens, 4096), ("--short-tokens", args.short_tokens, 4096),
                                 ("--mqar-steps", args.mqar_steps, 1), ("--tokens", args.tokens, 4096),
                                 ("--batch-tokens", args.batch_tokens, 1024),
                                 *(("--widths", w, 8) for w in args.widths)):
        if value < least:
            raise SystemExit(f"reproduce: error: {option} {value}: at least {least:,}.")
    for lr in args.mqar_lrs:
        if not 0 < lr < 1:
            raise SystemExit(f"reproduce: error: --mqar-lrs {lr:g}: a learning rate in (0, 1), e.g. 1e-3.")
    if len(set(map(lr_tag, args.mqar_lrs))) < len(args.mqar_lrs):
        raise SystemExit(f"reproduce: error: --mqar-lrs {' '.join(map(lr_tag, args.mqar_lrs))}: a rate given twice.")
    if args.smoke:
        args.seeds = min(args.seeds, 2)
        args.mqar_lrs = args.mqar_lrs[:1]
        args.tokens = min(args.tokens, 24 * 16 * 256)
        args.models = args.models or ["softmax", "interdomain"]
    args.models = args.models or list(CUBE_MODELS)
    studies_report, cube_report = report_paths(args)
    shard, val = args.corpus / "enwiki2015_train-00-of-04.jsonl.zst", args.corpus / "enwiki2015_val.jsonl.zst"
    for f in (shard, val) if set(args.study) - {"mqar"} else ():   # MQAR generates its data
        if not f.is_file():
            raise SystemExit(f"reproduce: error: {f} not found: --corpus must be the folder holding the Wikipedia "
                             f"shards (../shared/data/corpus).")
    if args.extra is None:
        here = args.corpus.parent
        args.extra = sorted((here / "extra").glob("*.txt")) + [t for t in [here / "tinyshakespeare.txt"] if t.is_file()]
    for f in args.extra:
        if not f.is_file():
            raise SystemExit(f"reproduce: error: --extra {f} not found.")
    cells = study_cells(args)   # a --cells that matches nothing is refused before any work
    if args.cells:
        import fnmatch
        cells = [c for c in cells if any(fnmatch.fnmatch(c.key, pattern) for pattern in args.cells)]
        if not cells:
            raise SystemExit(f"reproduce: error: --cells {' '.join(args.cells)} matches no cell of --study "
                             f"{' '.join(args.study)} (cells are named like length/softmax-seed1).")
    check_out(args.out, args.report)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"reproduce: error: --out {args.out}: cannot create the folder ({e.strerror}): "
                         f"give a folder you can write to.") from None
    run = Run(args)
    settings = {"tokens": args.tokens, "smoke": args.smoke, "long_tokens": args.long_tokens,
                "batch_tokens": args.batch_tokens,
                "short_tokens": args.short_tokens, "mqar_steps": args.mqar_steps}
    if "mqar" in args.study:
        settings["mqar_lrs"] = sorted(args.mqar_lrs)
    recorded = run.state.get("settings", {})
    for key, value in settings.items():
        if key in recorded and recorded[key] != value:
            raise SystemExit(f"reproduce: error: {args.out} holds a run with {key}={recorded[key]} (now {value}): "
                             f"give the same budgets to continue it, or another --out.")
    run.state["settings"] = {**recorded, **settings}
    run.forward_signals()
    py = sys.executable
    tokenizer, data = args.out / "tokenizer.json", args.out / "data" / "wiki"
    command = " ".join(["python", "launch/reproduce.py", *(sys.argv[1:] if argv is None else argv)])

    if set(args.study) - {"mqar"}:   # the Wikipedia studies' tokenizer and data (MQAR generates its own)
        run.step("tokenizer", lambda: run.call([py, "-m", "data_tools.train_tokenizer", "--input", shard,
                                                "--vocab-size", "4096", "--output", tokenizer, "--overwrite"]))
        run.step("preprocess", lambda: run.call([py, "-m", "data_tools.preprocess", "--input", shard, "--tokenizer",
                                                 tokenizer, "--output-prefix", data, "--append-eod", "--workers", "2",
                                                 "--no-progress", "--overwrite"]))
    run.parallel([(f"train:{c.key}", lambda c=c: train_cell(run, args, c, data, tokenizer)) for c in cells])
    run.parallel([(f"eval:{c.key}", lambda c=c: eval_cell(run, args, c, val)) for c in cells])
    if cells:
        write_studies_report(run, args, cells, studies_report, command)
        log(f"report: {studies_report}")
    if "cube" in args.study:
        cube_study(run, args, py, tokenizer, data, val, cube_report, command)
        log(f"report: {cube_report}")
    return 0


# ---------------------------------------------------------------- the studies' report

PAPER_LENGTH = {"softmax": (12.79, 20.54, 55.92), "interdomain": (14.36, 14.14, 14.26),
                "s4d-only": (27.24, 26.89, 26.75)}   # ../shared/docs/paper-results.md: 1.3B at 4K, 8K, 14K


def spread(values: list[float], digits: int = 3) -> str:
    """mean [min, max] over seeds."""
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def below(a: list[float], b: list[float]) -> str:
    """`a < b` by every seed (holds), `a > b` by every seed (does not hold), else a tie."""
    if not a or not b:
        return "n/a (not run)"
    if max(a) < min(b):
        return "**holds**"
    if min(a) > max(b):
        return "**does not hold**"
    return "**tie** (the seeds' ranges overlap)"


def within(values: list[float], low: float, high: float) -> str:
    """Every seed inside [low, high] (holds), every seed outside (does not hold), else mixed."""
    if not values:
        return "n/a (not run)"
    inside = [low <= v <= high for v in values]
    return "**holds**" if all(inside) else ("**does not hold**" if not any(inside) else "**mixed** (seeds disagree)")


class StudyResults:
    """The studies' eval results, by (study, model): one per seed, in the cells' order; and the
    figures the report reads off them."""

    def __init__(self, args, cells: list[Cell]):
        self.args = args
        self.by_model: dict = {}
        for c in cells:
            self.by_model.setdefault((c.study, c.model), []).append(cell_result(args.out, c))

    def seeds(self, study: str, model: str) -> list[dict]:
        return self.by_model.get((study, model), [])

    def ratios(self, study, model, factor="3.5"):
        return [next(x["vs_1x"] for x in r["contexts"] if x["factor"] == float(factor))
                for r in self.seeds(study, model)]

    def ppl(self, study, model, factor="1"):
        return [next(x["perplexity"] for x in r["contexts"] if x["factor"] == float(factor))
                for r in self.seeds(study, model)]

    def context_use(self, study, model):
        """Nats the mean loss falls from windows of half the training length to windows of the
        whole (the same tokens, cut two ways): what the second half of the context is worth."""
        out = []
        for r in self.seeds(study, model):
            loss = {x["factor"]: x["loss"] for x in r["contexts"]}
            out.append(loss[0.5] - loss[1.0])
        return out

    def judged(self, verdict, study, *models):
        """A model that gains (almost) nothing from the far half of its context stays flat past it
        whatever its state does: a claim that it stays flat is then not a test."""
        if all(v >= CONTEXT_USE for m in models for v in self.context_use(study, m)):
            return verdict
        return (f"**not testable** (a model gains < {CONTEXT_USE} nats from the second half of its context: "
                "flat past 1x says nothing)")

    def accuracy(self, model):
        return [r["accuracy"] for r in self.seeds("mqar", model)]

    def best_lr(self, mixer, width):
        """The learning rate of the sweep at which `mixer` did best at `width`: the highest mean
        accuracy over seeds, then the lowest mean answer loss (Zoology reports each model at its
        best learning rate); None when no cell ran."""
        runs = {lr: self.seeds("mqar", mqar_model(mixer, width, lr)) for lr in self.args.mqar_lrs}
        runs = {lr: rs for lr, rs in runs.items() if rs}
        if not runs:
            return None
        return max(runs, key=lambda lr: (sum(r["accuracy"] for r in runs[lr]) / len(runs[lr]),
                                         -sum(r["answer_loss"] for r in runs[lr]) / len(runs[lr])))


def write_studies_report(run: Run, args, cells: list[Cell], report: Path, command: str) -> None:
    """The report of the studies' cells (docs/replication.md): the run's facts, the orderings
    judged over seeds, a section per study with its plot, the steps' seconds."""
    plots = report.parent / (report.stem + "-plots")
    plots.mkdir(parents=True, exist_ok=True)
    results = StudyResults(args, cells)
    b = budgets(args)
    studies = {c.study for c in cells}
    rows = []   # (claim, paper, ours, verdict)
    if "length" in studies:
        rows += length_claims(results, b)
    if "shapes" in studies:
        rows += shapes_claims(results)
    if "mqar" in studies:
        rows += mqar_claims(results, args)
    lines = report_header(run, args, b, command) + orderings_table(rows)
    for study, title in (("length", f"## Length extrapolation at context {b['context']:,} (two heads of 64, the "
                          "paper's Delta range)"), ("shapes", "## Head shape and Delta range at context 256")):
        models = list(dict.fromkeys(c.model for c in cells if c.study == study))
        if models:
            lines += extrapolation_section(results, study, title, models, plots)
    mq = [c for c in cells if c.study == "mqar"]
    if mq:
        lines += mqar_section(results, args, mq, b, plots)
    lines += steps_table(run)
    write_with_notes(report, lines)


def step_seconds(run: Run) -> dict:
    return {k: v["seconds"] for k, v in run.state.items() if isinstance(v, dict) and "seconds" in v}


def report_header(run: Run, args, b: dict, command: str) -> list[str]:
    """The title, where the numbers come from, and the run's command, machine, time, seeds and budgets."""
    total = sum(step_seconds(run).values())
    return ["# Replication at CPU scale: the paper's claims over seeds", "",
            "Generated by `launch/reproduce.py`; every number comes from its `megatron-id eval` results "
            f"(`{args.out}/eval/<study>/<cell>/results.json`). The first study (six models at context 256, the cube "
            "and the perplexity tables) is in [replication-cube.md](replication-cube.md).", "",
            f"- command: `{command}`",
            f"- machine: {machine()}",
            f"- time: {total / 60:.1f} minutes of steps ({args.jobs} at once, so the wall clock was less; "
            "a resumed run adds its parts)",
            f"- seeds: {args.seeds} per cell (the seed sets the initialisation and the data order); "
            "`mean [min, max]` over them everywhere below",
            f"- budgets: length {b['long']:,} tokens per model at context {b['context']:,}; shapes {b['short']:,} "
            f"tokens at 256 ({args.batch_tokens:,} tokens per step); mqar {b['mqar_steps']} steps of 64 sequences "
            f"of {MQAR_CONTEXT} tokens at each learning rate of {', '.join(lr_tag(x) for x in args.mqar_lrs)}", ""]


def length_claims(results: StudyResults, b: dict) -> list[tuple]:
    """The paper's length-extrapolation claims at the length study's context."""
    L = "length"
    ri, rs, rd = (results.ratios(L, m) for m in ("interdomain", "softmax", "s4d-only"))
    ppl_i, ppl_d = results.ppl(L, "interdomain"), results.ppl(L, "s4d-only")
    return [
        (f"interdomain flat to 3.5x (context {b['context']:,})", "14K/4K: 0.99x", spread(ri) + "x",
         results.judged(within(ri, 0, 1.05), L, "interdomain")),
        (f"softmax (RoPE) rises > 30% at 3.5x (context {b['context']:,})", "14K/4K: 4.37x", spread(rs) + "x",
         within(rs, 1.30, float("inf"))),
        ("interdomain's 3.5x / 1x below softmax's", "0.99x < 4.37x", f"{spread(ri)}x vs {spread(rs)}x",
         below(ri, rs)),
        (f"S4D-only flat to 3.5x (context {b['context']:,})", "14K/4K: 0.98x", spread(rd) + "x",
         results.judged(within(rd, 0, 1.05), L, "s4d-only")),
        ("interdomain perplexity at 1x below S4D-only's", "14.36 vs 27.24",
         f"{spread(ppl_i, 2)} vs {spread(ppl_d, 2)}", below(ppl_i, ppl_d))]


def shapes_claims(results: StudyResults) -> list[tuple]:
    """At context 256: interdomain against softmax at both head sizes, the scaled Delta range, and
    d_h 64 against d_h 32."""
    S, rows = "shapes", []
    for shape in ("dh32", "dh64"):
        ri, rs = results.ratios(S, f"interdomain-{shape}"), results.ratios(S, f"softmax-{shape}")
        rows.append((f"at 256, {shape.replace('dh', 'd_h ')}: interdomain's 3.5x / 1x below softmax's",
                     "0.99x < 4.37x (at 4K)", f"{spread(ri)}x vs {spread(rs)}x", below(ri, rs)))
    for shape in ("dh32", "dh64"):
        scaled = results.ratios(S, f"interdomain-{shape}-dtscaled")
        rows.append((f"at 256, {shape.replace('dh', 'd_h ')}, Delta scaled to the context: interdomain flat "
                     "to 3.5x", "-", spread(scaled) + "x",
                     results.judged(within(scaled, 0, 1.05), S, f"interdomain-{shape}-dtscaled")))
    a, c64 = results.ratios(S, "interdomain-dh32"), results.ratios(S, "interdomain-dh64")
    rows.append(("at 256 (the paper's Delta range): d_h 64 extrapolates better than d_h 32 (not a paper claim; "
                 "the question this study asks)", "-", f"{spread(c64)}x vs {spread(a)}x", below(c64, a)))
    return rows


def mqar_claims(results: StudyResults, args) -> list[tuple]:
    """The recall orderings at each width, each mixer at its best learning rate; not testable
    where no model learned the task."""
    rows = []
    for width in args.widths:
        chosen = {m: results.best_lr(m, width) for m in MIXERS}
        acc = {m: results.accuracy(mqar_model(m, width, lr)) if lr is not None else [] for m, lr in chosen.items()}
        if not acc["softmax"]:
            continue
        if len(args.mqar_lrs) > 1:   # each mixer at its best learning rate: say which
            acc_label = {m: f" (lr {lr_tag(lr)})" if lr is not None else "" for m, lr in chosen.items()}
        else:
            acc_label = {m: "" for m in MIXERS}
        best = max(sum(a) / len(a) for a in acc.values() if a)

        def learned(verdict, best=best):   # an ordering among models that did not learn the task says nothing
            return verdict if best >= TASK_LEARNED else (
                f"**not testable** (no model's mean over seeds reached {TASK_LEARNED:.0%}: not learned reliably at "
                "this budget)")

        def pair(a, b, acc=acc, acc_label=acc_label):
            return f"{spread(acc[a])}{acc_label[a]} vs {spread(acc[b])}{acc_label[b]}"
        rows.append((f"MQAR at d {width}: softmax above interdomain", "needle 1K: 99.5 > 65.5",
                     pair("softmax", "interdomain"), learned(below(acc["interdomain"], acc["softmax"]))))
        rows.append((f"MQAR at d {width}: interdomain above S4D-only", "needle 1K: 65.5 > 0",
                     pair("interdomain", "s4d-only"), learned(below(acc["s4d-only"], acc["interdomain"]))))
        if acc["hybrid"]:
            rows.append((f"MQAR at d {width}: the hybrid (a softmax layer) above interdomain", "- (hybrids: "
                         "not in the paper)", pair("hybrid", "interdomain"),
                         learned(below(acc["interdomain"], acc["hybrid"]))))
    return rows


def orderings_table(rows: list[tuple]) -> list[str]:
    return ["## The orderings", "",
            "A claim about one model holds when every seed meets it; an ordering holds when every seed of one "
            "model beats every seed of the other, does not hold when the reverse is true, and is a tie otherwise.", "",
            "| claim | paper | here | verdict |", "|---|---|---|---|",
            *(f"| {c} | {p} | {o} | {v} |" for c, p, o, v in rows), ""]


def extrapolation_section(results: StudyResults, study: str, title: str, models: list, plots: Path) -> list[str]:
    """A length or shapes study: perplexity at 1x and each context's ratio to it, the context
    use, the loss by position in the longest windows, and their plot."""
    lines = [title, "", "Held-out Wikipedia articles (joined, cut into windows); perplexity at 1x and each "
             "context's perplexity / 1x's, mean [min, max] over seeds.", "",
             "| model | 1x perplexity | context use (nats) | " + " | ".join(f"{f}x / 1x" for f in FACTORS) + " |",
             "|" + "---|" * (len(FACTORS) + 3)]
    for m in models:
        lines.append(f"| {m} | {spread(results.ppl(study, m), 2)} | {spread(results.context_use(study, m))} | " +
                     " | ".join(spread(results.ratios(study, m, f)) for f in FACTORS) + " |")
    lines += ["", f"Context use: how much the mean loss falls from windows of 0.5x to windows of 1x the training "
              f"length on the same tokens. Below {CONTEXT_USE} nats a model gains almost nothing from the far half "
              "of its context, and its staying flat past 1x is then no test of its state (those claims are marked "
              "not testable); softmax's rise is positional and stays a test."]
    lines += ["", "By position in the longest (4x) windows: loss (nats) per quarter of the training length, "
              "mean over seeds; a flat row past 1x is extrapolation.", ""]
    first = results.seeds(study, models[0])[0]
    edges = [(x["start"], x["end"]) for x in first["positions"]["buckets"]]
    train_length = first["train_length"]
    lines += ["| model | " + " | ".join(f"{s / train_length:g}-{e / train_length:g}x" for s, e in edges) + " |",
              "|" + "---|" * (len(edges) + 1)]
    curves = {}
    for m in models:
        per_seed = [[x["loss"] for x in r["positions"]["buckets"]] for r in results.seeds(study, m)]
        curves[m] = [sum(col) / len(col) for col in zip(*per_seed)]
        lines.append(f"| {m} | " + " | ".join(f"{v:.3f}" for v in curves[m]) + " |")
    png = plots / f"{study}.png"
    if draw_length(png, curves, edges, train_length, results.by_model, study, models):
        lines += ["", f"![{study}]({plots.name}/{png.name})"]
    lines.append("")
    return lines


def mqar_section(results: StudyResults, args, mq: list[Cell], b: dict, plots: Path) -> list[str]:
    """The MQAR study: the task, every model at every learning rate (its best in bold), and the
    plot of accuracy against the decode state."""
    first = cell_result(args.out, mq[0])["task"]
    lines = ["## Recall: multi-query associative recall (MQAR)", "",
             f"`data.source=mqar`: {first['num_pairs']} key-value pairs then {first['num_queries']} queries in "
             f"{first['seq_length'] + 1} tokens, {first['num_keys']} keys and {first['num_values']} values "
             f"(chance {1 / first['num_values']:.3f}); 2 layers; accuracy on the task's test split "
             f"({b['mqar_samples']:,} sequences); state: the decode state at the task's length (fp32 bytes).", "",
             f"Each mixer trained at each learning rate of {', '.join(lr_tag(x) for x in args.mqar_lrs)}; "
             "**bold**: its best at that width (highest mean accuracy), the one the orderings and the plot use.",
             "", "| model | mixer | layers | state bytes | parameters | lr | accuracy | answer loss |",
             "|---|---|---|---|---|---|---|---|"]
    points = {}
    for m in dict.fromkeys(c.model for c in mq):
        rs = results.seeds("mqar", m)
        kind, rest = m.rsplit("-d", 1)
        width = int(rest.split("-lr")[0])
        lr = next(x for x in args.mqar_lrs if m == mqar_model(kind, width, x))
        best = lr == results.best_lr(kind, width)
        bold = "**" if best and len(args.mqar_lrs) > 1 else ""
        lines.append(f"| {m.rsplit('-lr', 1)[0]} | {rs[0]['mixer']} | {rs[0]['layer_pattern']} | "
                     f"{rs[0]['state_bytes_fp32']:,} | {rs[0]['parameters']:,} | {lr_tag(lr)} | "
                     f"{bold}{spread([r['accuracy'] for r in rs])}{bold} | {spread([r['answer_loss'] for r in rs])} |")
        if best:
            points.setdefault(kind, []).append((rs[0]["state_bytes_fp32"], [r["accuracy"] for r in rs]))
    png = plots / "mqar.png"
    if draw_mqar(png, points):
        lines += ["", f"![mqar]({plots.name}/{png.name})"]
    lines.append("")
    return lines


def steps_table(run: Run) -> list[str]:
    return (["## Steps and their seconds", "", "| step | seconds |", "|---|---|"] +
            [f"| {k} | {v:.0f} |" for k, v in step_seconds(run).items()] + [""])


def machine() -> str:
    """The report's machine line: what the figures were measured on."""
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
            f"torch {__import__('torch').__version__}, {platform.platform()}")


def write_with_notes(report: Path, lines: list) -> None:
    """The report, atomically, followed by its analysis written by hand after a run
    (<report>-notes.md beside it), which a regenerated report keeps."""
    notes = report.parent / (report.stem + "-notes.md")
    if notes.is_file():   # the analysis written by hand after a run: kept beside the generated part
        lines += [notes.read_text()]
    report.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(report, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))


def draw_length(path: Path, curves: dict, edges, train_length: int, by_model: dict, study: str, models) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in models:
        factors = [float(f) for f in FACTORS]
        per_seed = [[next(x["vs_1x"] for x in r["contexts"] if x["factor"] == f) for f in factors]
                    for r in by_model[(study, m)]]
        mean = [sum(col) / len(col) for col in zip(*per_seed)]
        line, = a.plot(factors, mean, "o-", label=m)
        a.fill_between(factors, [min(col) for col in zip(*per_seed)], [max(col) for col in zip(*per_seed)],
                       color=line.get_color(), alpha=0.2)
        b.plot([(s + e) / 2 / train_length for s, e in edges], curves[m], ".-", label=m)
    a.set(xlabel="context (x training length)", ylabel="perplexity / perplexity at 1x (seeds: band)")
    b.set(xlabel="position (x training length)", ylabel="loss at that position (nats, mean of seeds)")
    for ax in (a, b):
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=7)
    save_png(plt, fig, path)
    return True


def draw_mqar(path: Path, points: dict) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (kind, cells) in enumerate(points.items()):
        cells = sorted(cells)
        # mixers with equal states would hide each other: each drawn a little to the right of the last
        dodge = 1.04 ** (i - (len(points) - 1) / 2)
        xs = [x * dodge for x, _ in cells]
        line, = ax.plot(xs, [sum(a) / len(a) for _, a in cells], "o-", label=kind)
        for x, (_, acc) in zip(xs, cells):
            ax.plot([x, x], [min(acc), max(acc)], color=line.get_color(), lw=1)
    ax.set(xlabel="decode state at the task's length (bytes, fp32; equal states drawn side by side)",
           ylabel="MQAR accuracy (seeds: bars)",
           xscale="log", ylim=(-0.02, 1.02))
    states = [x for cells in points.values() for x, _ in cells]
    ax.set_xlim(min(states) / 2, max(states) * 2)   # one width alone would zoom onto the side-by-side offsets
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.legend(fontsize=8)
    save_png(plt, fig, path)
    return True


# ---------------------------------------------------------------- the cube study (replication-cube.md)

def cube_study(run: Run, args, py: str, tokenizer: Path, data: Path, val: Path, report: Path, command: str) -> None:
    steps = max(1, args.tokens // (16 * 256))
    for name in args.models:
        save = args.out / "runs" / "cube" / name

        def train(name=name, save=save):
            items = [f"data.data_path=[{data}_text_document]", f"data.tokenizer={tokenizer}",
                     f"train.train_tokens={steps * 16 * 256}", f"train.save={save}", f"train.load={save}",
                     "seed=1234", *(["train.save_interval=10", "train.log_interval=5"] if args.smoke else []),
                     *CUBE_MODELS[name]]
            config = [a for c in CONFIGS for a in ("--config", str(c))]
            run.call([py, "-m", "megatron_id.cli", "train", *config, *items],
                     args.out / "logs" / "cube" / f"{name}.log")
            latest = (save / "latest").read_text().strip()
            if latest != f"iter_{steps:07d}":
                raise SystemExit(f"reproduce: error: {name} stopped at {latest} of {steps} steps (signalled?): "
                                 f"rerun to continue.")
            return {"steps": steps}
        run.step(f"train:cube/{name}", train)
    checkpoints = [str(args.out / "runs" / "cube" / n) for n in args.models]
    budget = (4096, 4096 * 4, 2) if args.smoke else (65536, 32768, 8)   # ppl tokens, sweep tokens, samples

    def evaluate(folder, evaluation, *options):
        folder = args.out / "eval" / "cube" / folder
        shutil.rmtree(folder, ignore_errors=True)   # ours: an interrupted eval starts again
        run.call([py, "-m", "megatron_id.cli", "eval", evaluation, "--checkpoint", *checkpoints,
                  "--name", *args.models, "--device", "cpu", "--out", folder, *options])

    sources = {"wikipedia-val": val, **{f.stem: f for f in args.extra}}
    for source, path in sources.items():
        run.step(f"eval:cube/perplexity:{source}", lambda path=path, source=source: evaluate(
            f"perplexity-{source}", "perplexity", "--text", path, "--max-tokens", str(budget[0])))
    run.step("eval:cube/length", lambda: evaluate("length", "length", "--text", val, "--max-tokens", str(budget[1])))
    run.step("eval:cube/recall", lambda: evaluate("recall", "recall", "--samples", str(budget[2]), "--seed", "1234"))
    write_cube_report(run, args, sources, report, steps, command)


PAPER = {   # ../shared/docs/paper-results.md
    "cube_125m": {"interdomain": 16.48, "softmax": 16.65, "single-input": 16.94, "s4d-only": 19.22,
                  "no-query-readout": 20.18},
    "needle_1p3b": {"softmax": "99.5 / 100 / 89 / 0", "interdomain": "65.5 / 28 / 9.5 / 3.5", "s4d-only": "0"},
}


def _load(out: Path, folder: str) -> dict:
    return {r["name"]: r for r in json.loads((out / "eval" / "cube" / folder / "results.json").read_text())["results"]}


def verdict(ok: bool | None) -> str:
    return "n/a (model not run)" if ok is None else ("**holds**" if ok else "**does not hold**")


def write_cube_report(run: Run, args, sources: dict, report: Path, steps: int, command: str) -> None:
    out, names = args.out, args.models
    ppl = {source: _load(out, f"perplexity-{source}") for source in sources}
    length, recall = _load(out, "length"), _load(out, "recall")
    val = ppl["wikipedia-val"]
    plots = report.parent / (report.stem + "-plots")
    plots.mkdir(parents=True, exist_ok=True)
    for folder, name in (("length", "length.png"), ("recall", "recall.png"), ("perplexity-wikipedia-val", "val.png")):
        if (out / "eval" / "cube" / folder / "results.png").is_file():
            shutil.copy(out / "eval" / "cube" / folder / "results.png", plots / name)

    def get(table, name, key="perplexity"):
        return table[name][key] if name in table else None

    def ratio(name, factor):
        if name not in length:
            return None
        by = {c["factor"]: c["perplexity"] for c in length[name]["contexts"]}
        return by[factor] / by[1.0]

    def recall_score(name, key="accuracy"):
        if name not in recall:
            return None
        cells = recall[name].get("passkey", []) + recall[name].get("mqar", [])
        return sum(c[key] for c in cells) / len(cells)

    lines = []
    seconds = sum(v["seconds"] for k, v in run.state.items() if k.split(":", 1)[-1].startswith(("cube/", "tokenizer",
                                                                                                 "preprocess")))
    lines += ["# Replication at CPU scale: the first study (the cube, one seed)", "",
              "Generated by `launch/reproduce.py --study cube`; every number below comes from its `megatron-id eval` "
              f"results (`{out}/eval/cube/*/results.json`). The claims over seeds: "
              "[replication.md](replication.md).", "",
              f"- command: `{command}`",
              f"- machine: {machine()}",
              f"- time: {seconds / 60:.1f} minutes in all (steps below; a resumed run adds its parts)",
              f"- per model: {args.tokens:,} training tokens ({steps} steps of 16 x 256)", ""]
    lines += ["| step | seconds |", "|---|---|"] + [f"| {k} | {v['seconds']:.0f} |" for k, v in run.state.items()
                                                     if isinstance(v, dict) and "seconds" in v and
                                                     (k.startswith(("tokenizer", "preprocess")) or "cube/" in k)]
    i, s4, nq, si = (get(val, n) for n in ("interdomain", "s4d-only", "no-query-readout", "single-input"))
    o1 = None if None in (i, s4) else i < s4
    o2 = None if None in (i, nq, si) else (nq - i) > (si - i)
    ri, rs = ratio("interdomain", 3.5), ratio("softmax", 3.5)
    o3 = None if None in (ri, rs) else (abs(ri - 1) <= 0.05 and rs > 1.30)
    cs, ci, cd = (recall_score(n) for n in ("softmax", "interdomain", "s4d-only"))
    o4 = None if None in (cs, ci, cd) else cs > ci > cd
    ls, li, ld = (recall_score(n, "answer_loss") for n in ("softmax", "interdomain", "s4d-only"))
    o5 = None if None in (ls, li, ld) else ls < li < ld
    fmt = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"   # noqa: E731
    lines += ["", "## The orderings", "",
              "| ordering (paper) | here | verdict |", "|---|---|---|",
              f"| interdomain perplexity below S4D-only (16.48 vs 19.22 at 125M) | {fmt(i)} vs {fmt(s4)} | "
              f"{verdict(o1)} |",
              f"| removing the query readout hurts more than removing the dual input (+3.70 vs +0.46) | "
              f"+{fmt(None if None in (nq, i) else nq - i)} vs +{fmt(None if None in (si, i) else si - i)} | "
              f"{verdict(o2)} |",
              f"| interdomain at 3.5x within 5% of 1x, softmax rising > 30% (1.3B at 4K: 0.99x vs 4.37x) | "
              f"{fmt(ri, 3)}x vs {fmt(rs, 3)}x | {verdict(o3)} |",
              f"| recall: softmax > interdomain > S4D-only (needle 1K: 99.5 > 65.5 > 0) | "
              f"{fmt(cs, 3)} > {fmt(ci, 3)} > {fmt(cd, 3)} | {verdict(o4)} |",
              f"| the same, graded: the answers' loss (nats/token, mean over every recall cell) softmax < "
              f"interdomain < S4D-only | {fmt(ls, 3)} < {fmt(li, 3)} < {fmt(ld, 3)} | {verdict(o5)} |", ""]
    head = ["model"] + list(sources)
    lines += ["## Perplexity", "", "Held-out Wikipedia articles (the training distribution) and other sources; "
              f"at most {ppl['wikipedia-val'][names[0]]['tokens']:,} tokens each, windows of 256.", "",
              "| " + " | ".join(head + ["paper 125M"]) + " |", "|" + "---|" * (len(head) + 1)]
    for n in names:
        lines.append("| " + " | ".join([n] + [fmt(get(ppl[src], n)) for src in sources] +
                                       [str(PAPER["cube_125m"].get(n, "-"))]) + " |")
    lines += ["", "Bits per byte:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        lines.append("| " + " | ".join([n] + [fmt(get(ppl[src], n, "bits_per_byte"), 3) for src in sources]) + " |")
    factors = [c["factor"] for c in length[names[0]]["contexts"]]
    lines += ["", "## Length extrapolation (held-out Wikipedia, trained at 256)", "",
              "| model | " + " | ".join(f"{f}x" for f in factors) + " | 3.5x / 1x |",
              "|" + "---|" * (len(factors) + 2)]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(fmt(c["perplexity"]) for c in length[n]["contexts"]) +
                     f" | {fmt(ratio(n, 3.5), 3)} |")
    lines += ["", "Paper (1.3B, trained at 4K; 4K / 8K / 14K): " + "; ".join(
        f"{k} {' / '.join(map(str, v))}" for k, v in PAPER_LENGTH.items()), "",
        f"![length]({plots.name}/length.png)", "", "## Recall", ""]
    lines += [(out / "eval" / "cube" / "recall" / "results.md").read_text(), "",
              "Paper (1.3B, RULER single needle at 1K/2K/4K/8K): " + "; ".join(
                  f"{k} {v}" for k, v in PAPER["needle_1p3b"].items()), "", f"![recall]({plots.name}/recall.png)", ""]
    write_with_notes(report, lines)


if __name__ == "__main__":
    sys.exit(main())
