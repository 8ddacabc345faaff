"""The package's layering (issue 42): lower layers never import higher ones, no two modules import
each other, and ruff (pyflakes, isort, line length: .ruff.toml) passes on the whole repository.

Every import counts, at the top of a module or inside a function: a lazy import hides a loop, it
does not remove it. Imports under `if TYPE_CHECKING:` are for annotations only and are skipped.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron_id"

# the floors, lowest first: a module may import its own floor and the ones below it
LOWER = {"errors", "atomic", "allocator", "config", "model", "ops", "data"}
HIGHER = {"parallel", "training", "checkpoint", "inference", "evaluation", "hf", "vllm_plugin", "commands", "cli",
          "reference", "generation"}


def module_files() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking_only(node)
               for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import name`: the submodule pkg.name when it is one, else pkg itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            # `import megatron_id.model.spec` also runs the packages above it; the edge that
            # matters is to the module named
            if target in modules and target != name:
                found.add(target)
    return found


def floor(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_the_walker_sees_relative_lazy_and_package_imports(tmp_path):
    # the walker itself can fail: a relative import inside a function, and `from . import x`
    modules = module_files()
    assert "megatron_id.training.engine" in modules and "megatron_id.model" in modules
    source = tmp_path / "probe.py"
    source.write_text("from ..model import spec\ndef f():\n    from ..parallel.layout import x\n"
                      "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cli import main\n")
    found = imported_modules("megatron_id.training.probe", source, {**modules, "megatron_id.training.probe": source})
    assert "megatron_id.parallel.layout" in found
    assert "megatron_id.cli" not in found
    assert ("megatron_id.model.spec" in found) == ("megatron_id.model.spec" in modules)


def test_lower_floors_never_import_higher_ones(graph):
    upward = sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                    if floor(name) in LOWER and floor(target) in HIGHER)
    upward += sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                     if floor(name) == "parallel" and floor(target) == "training")
    assert not upward, "imports from a lower floor to a higher one:\n  " + "\n  ".join(upward)


def test_every_module_has_a_floor(graph):
    # a new top-level module must be placed in LOWER or HIGHER, so the rule above covers it
    unplaced = sorted({floor(name) for name in graph} - LOWER - HIGHER - {""})
    assert not unplaced, f"modules on no floor (add them to LOWER or HIGHER in this test): {unplaced}"


def test_no_two_modules_import_each_other(graph):
    mutual = sorted(f"{a} <-> {b}" for a, targets in graph.items() for b in targets
                    if a < b and a in graph.get(b, ()))
    assert not mutual, "modules that import each other:\n  " + "\n  ".join(mutual)


def test_ruff_passes():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]' brings it (setup.py's test extra)")
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, ("ruff check . (config: .ruff.toml) found:\n"
                                    f"{result.stdout[-4000:]}{result.stderr[-2000:]}")
