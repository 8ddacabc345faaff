"""launch/reproduce.py in its smoke form (issue 14): on a 300-article slice of the Wikipedia
corpus, the whole pipeline (tokenizer, preprocessing, two models, every evaluation, the report);
killed while a model trains, the same command continues where it stopped (finished steps are not
redone, the model resumes from its checkpoint) and ends with the complete report."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT

CORPUS = ROOT.parent / "shared" / "data" / "corpus"


def slice_corpus(folder, train_docs=300, val_docs=20):
    import zstandard
    folder.mkdir()
    for name, count in (("enwiki2015_train-00-of-04.jsonl.zst", train_docs), ("enwiki2015_val.jsonl.zst", val_docs)):
        with open(CORPUS / name, "rb") as f:
            reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(f), encoding="utf-8")
            lines = [next(reader) for _ in range(count)]
        (folder / name).write_bytes(zstandard.ZstdCompressor().compress("".join(lines).encode()))
    return folder


@pytest.mark.slow
def test_reproduce_smoke_runs_resumes_and_reports(tmp_path):
    if not (CORPUS / "enwiki2015_val.jsonl.zst").is_file():
        pytest.skip(f"the Wikipedia corpus is not at {CORPUS} (the shared folder beside the project)")
    corpus = slice_corpus(tmp_path / "corpus")
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "launch" / "reproduce.py"), "--smoke", "--corpus", str(corpus),
               "--study", "length", "mqar", "cube", "--models", "interdomain", "--tokens", "8192",   # cube: 2 steps
               "--extra", str(ROOT / "tests" / "data" / "tinyshakespeare-200k.txt"), "--out", str(out)]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    deadline = time.time() + 600
    latest = out / "runs" / "length" / "interdomain-seed1" / "latest"
    while not latest.exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert latest.exists(), first.communicate()[0][-3000:]
    os.killpg(first.pid, signal.SIGTERM)   # as a scheduler stops a job: the trainers save and stop
    output = first.communicate(timeout=300)[0]
    assert first.returncode != 0 and "to continue from here" in output, output[-3000:]
    stopped = latest.read_text().strip()
    assert stopped != "iter_0000008", "the kill came too late to test a resume"
    state = json.loads((out / "state.json").read_text())
    assert "train:length/interdomain-seed1" not in state and "eval:length/softmax-seed1" not in state

    second = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert "tokenizer ..." not in second.stdout   # not redone
    assert latest.read_text().strip() == "iter_0000008"
    log = (out / "logs" / "length" / "interdomain-seed1.log").read_text()
    # the first attempt stopped early (saving), the second loaded that checkpoint and finished
    assert f"stopped at step {int(stopped[5:])} of 8 (SIGTERM)" in log and log.count("finished at step 8;") == 1
    assert f"steps {int(stopped[5:]) + 1}-8 |" in log, log[-3000:]   # the second attempt's header
    state = json.loads((out / "state.json").read_text())
    cells = [f"{m}-seed{s}" for m in ("softmax", "interdomain") for s in (1, 2)]
    mqar = {f"eval:mqar/{m}-d64-lr1e-3-seed{s}" for m in ("softmax", "interdomain") for s in (1, 2)}
    assert {f"eval:length/{c}" for c in cells} | mqar <= set(state)
    report = (out / "replication.md").read_text()
    for part in ("## The orderings", "| interdomain flat to 3.5x (context 256) |", "## Length extrapolation",
                 "| interdomain |", "## Recall: multi-query associative recall", "| softmax-d64 | softmax | AA |",
                 "| 1e-3 |",
                 "python launch/reproduce.py --smoke"):
        assert part in report, part
    # a row's spread is its seeds' own results
    results = [json.loads((out / "eval" / "length" / c / "results.json").read_text())
               for c in ("interdomain-seed1", "interdomain-seed2")]
    ratios = [r["results"][0]["contexts"][3]["vs_1x"] for r in results]
    row = next(line for line in report.splitlines() if line.startswith("| interdomain flat to 3.5x"))
    assert f"{sum(ratios) / 2:.3f} [{min(ratios):.3f}, {max(ratios):.3f}]x" in row, row
    assert (out / "replication-plots" / "length.png").stat().st_size > 10_000
    assert (out / "replication-plots" / "mqar.png").stat().st_size > 10_000
    cube = (out / "replication-cube.md").read_text()
    assert "## Length extrapolation (held-out Wikipedia, trained at 256)" in cube and "| interdomain |" in cube
    assert {"eval:cube/length", "eval:cube/recall", "eval:cube/perplexity:tinyshakespeare-200k"} <= set(state)


def _reproduce_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "launch" / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reproduce"] = module   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_verdicts_claim_nothing_the_seeds_do_not_support():
    r = _reproduce_module()
    assert r.spread([1.0, 2.0, 4.0]) == "2.333 [1.000, 4.000]" and r.spread([0.5]) == "0.500" and r.spread([]) == "-"
    assert r.below([1.0, 1.1], [1.2, 1.5]).startswith("**holds**")
    assert r.below([1.3, 1.6], [1.0, 1.2]).startswith("**does not hold**")
    assert r.below([1.0, 1.3], [1.2, 1.5]).startswith("**tie**")          # ranges overlap: no ordering
    assert r.below([], [1.0]).startswith("n/a")
    assert r.within([1.01, 1.04], 0, 1.05).startswith("**holds**")
    assert r.within([1.2, 1.3], 0, 1.05).startswith("**does not hold**")
    assert r.within([1.01, 1.3], 0, 1.05).startswith("**mixed**")


def test_a_subset_of_cells_never_replaces_the_full_report(tmp_path):
    """--cells (or --smoke) writes its report into --out; only a full run writes docs/ (a
    four-cell timing run once replaced docs/replication.md with its four rows)."""
    reproduce = _reproduce_module()
    parse = reproduce.build_parser().parse_args
    full = reproduce.report_paths(parse(["--out", str(tmp_path)]))
    assert full == (ROOT / "docs" / "replication.md", ROOT / "docs" / "replication-cube.md")
    subset = reproduce.report_paths(parse(["--out", str(tmp_path), "--cells", "length/softmax-*"]))
    assert subset == (tmp_path / "replication.md", tmp_path / "replication-cube.md")
    assert reproduce.report_paths(parse(["--out", str(tmp_path), "--smoke"]))[0] == tmp_path / "replication.md"
    chosen = reproduce.report_paths(parse(["--out", str(tmp_path), "--cells", "x", "--report", str(tmp_path / "r.md")]))
    assert chosen == (tmp_path / "r.md", tmp_path / "r.md")


def test_the_learning_rate_sweep_makes_one_cell_per_rate_and_names_it():
    reproduce = _reproduce_module()
    args = reproduce.build_parser().parse_args(["--out", "x", "--study", "mqar", "--seeds", "2", "--widths", "64"])
    cells = reproduce.study_cells(args)
    assert len(cells) == 4 * 2 * 2   # mixers x rates x seeds
    softmax = [c for c in cells if c.model.startswith("softmax")]
    assert [c.key for c in softmax] == ["mqar/softmax-d64-lr1e-3-seed1", "mqar/softmax-d64-lr1e-3-seed2",
                                        "mqar/softmax-d64-lr3e-4-seed1", "mqar/softmax-d64-lr3e-4-seed2"]
    assert {"optimizer.lr=0.0003", "optimizer.min_lr=3e-05"} <= set(softmax[2].items)
    assert [reproduce.lr_tag(x) for x in (1e-3, 2.5e-3, 0.01)] == ["1e-3", "2.5e-3", "1e-2"]
    with pytest.raises(SystemExit, match="--mqar-lrs 2: a learning rate in"):
        reproduce.main(["--out", "x", "--study", "mqar", "--mqar-lrs", "2"])
    with pytest.raises(SystemExit, match="--mqar-lrs 1e-3 1e-3: a rate given twice"):
        reproduce.main(["--out", "x", "--study", "mqar", "--mqar-lrs", "1e-3", "0.001"])


def test_the_mqar_study_alone_needs_no_corpus(tmp_path):
    """MQAR generates its data: --study mqar goes on without the Wikipedia shards (here to the
    --cells check, which stops it before any work), the Wikipedia studies refuse to start."""
    reproduce = _reproduce_module()
    missing = tmp_path / "no-corpus"
    with pytest.raises(SystemExit, match="matches no cell of --study mqar"):
        reproduce.main(["--out", str(tmp_path / "out"), "--study", "mqar", "--corpus", str(missing), "--cells", "x"])
    with pytest.raises(SystemExit, match=f"{missing}/enwiki2015_train-00-of-04.jsonl.zst not found"):
        reproduce.main(["--out", str(tmp_path / "out"), "--study", "length", "mqar", "--corpus", str(missing)])
    assert not (tmp_path / "out").exists()
