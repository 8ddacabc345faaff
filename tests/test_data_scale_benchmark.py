"""benchmarks/data_scale.py --quick: every cell asked for is in the table with numbers that parse,
our side serves exactly the train samples asked for, megatron-core (when installed) was asked for
the same number and built at least that many, and without megatron-core our side still runs."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "data_scale.py"
HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def run(tmp_path, *args):
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--workdir", str(tmp_path / "work"),
                          "--json", str(out), *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (tmp_path / "work").exists()   # created by the run, removed at its end (no --keep)
    return res.stdout, json.loads(out.read_text())


def table_rows(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith("| cell")]
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 11, line
        rows[cells[0]] = cells
    return rows


def number(text: str) -> float:
    return float(text.replace(",", "").rstrip("x"))


def test_quick_run_side_by_side(tmp_path):
    cells = ["single-5B", "blend20-26B"]
    stdout, data = run(tmp_path, "--cells", *cells)
    rows = table_rows(stdout)
    assert list(rows) == cells
    for raw in data["rows"]:
        cells_ = rows[raw["cell"]]
        assert int(cells_[1]) == raw["prefixes"] == (1 if raw["cell"].startswith("single") else 20)
        ours = raw["ours"]
        assert ours["train"] == raw["n_train"] > 0           # exactly the samples asked for
        assert ours["valid"] == raw["n_valid"] > 0
        assert number(cells_[3].split("/")[0]) == raw["n_train"]
        assert number(cells_[4]) >= 0 and number(cells_[7]) >= 0      # ours s, ours MiB
        if HAVE_MCORE:
            mc = raw["mcore"]
            for column in (5, 6, 8, 9):                    # mcore s, ratio, mcore MiB, ratio
                assert number(cells_[column]) >= 0
            if raw["prefixes"] == 1:   # megatron-core keeps the whole epochs it shuffled
                assert mc["train"] >= raw["n_train"]
            else:                      # sum over prefixes of ceil(n x weight)
                assert raw["n_train"] <= mc["train"] <= raw["n_train"] + raw["prefixes"]
            assert mc["train_type"] == ("GPTDataset" if raw["prefixes"] == 1 else "BlendedDataset")
    checks = re.findall(r"^- (PASS|FAIL|SKIP): (\S+):", stdout, re.M)
    assert {cell for _, cell in checks} == set(cells)
    assert all(v != "SKIP" for v, _ in checks) == HAVE_MCORE


def test_ours_only(tmp_path):
    stdout, data = run(tmp_path, "--cells", "single-0.5B", "--ours-only")
    assert "megatron-core not run" in stdout
    row = table_rows(stdout)["single-0.5B"]
    assert row[5] == "-" and row[6] == "-"
    assert data["rows"][0]["ours"]["train"] == data["rows"][0]["n_train"]
    assert "SKIP: single-0.5B" in stdout


@pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed")
def test_megatron_core_helpers_come_compiled():
    """The wheel carries megatron-core's C++ helpers: nothing is compiled at run time."""
    spec = importlib.util.find_spec("megatron.core")
    folder = Path(spec.origin).parent / "datasets"
    assert list(folder.glob("helpers_cpp*.so"))
