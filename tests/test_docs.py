"""The generated reference pages (megatron_id/reference.py) agree with the code."""
from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from megatron_id import reference
from megatron_id.config import Config

ROOT = Path(__file__).resolve().parents[1]


def _leaf_keys(node, prefix=""):
    out = []
    for key, value in node.items():
        if OmegaConf.is_dict(value) and key != "deepspeed" and key != "valid_sets":
            out += _leaf_keys(value, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


def test_reference_pages_are_current():
    """A key or flag added without `python -m megatron_id.reference` fails here."""
    for name, text in reference.pages().items():
        path = reference.PAGES[name]
        assert path.is_file(), f"{path} missing: run python -m megatron_id.reference"
        assert path.read_text() == text, f"{path} is out of date: run python -m megatron_id.reference"
        assert str(ROOT) not in text, f"{path} names this checkout's own path: it would differ in every clone"


def test_config_page_lists_every_schema_key_with_a_meaning():
    keys = {k.name: k for k in reference.schema_keys()}
    schema = _leaf_keys(OmegaConf.structured(Config))
    assert sorted(keys) == sorted(schema)
    assert [k for k in keys.values() if not k.meaning] == [], "a config key without a comment saying what it is"
    assert set(reference.PEER_FLAGS) <= set(keys), set(reference.PEER_FLAGS) - set(keys)
    # the rules come from config.py's checks, constants filled in and other keys' values elided
    assert "must be one of linear, cosine, 1-sqrt" in keys["optimizer.decay_shape"].allowed
    assert keys["model.d_model"].allowed == "must be a positive multiple of model.n_heads"
    assert "`wsd`: warmup-stable-decay" in keys["optimizer.schedule"].allowed
    page = reference.config_page()
    assert all(f"| `{k}` |" in page for k in schema)


def test_cli_page_lists_every_flag_of_every_command():
    page = reference.cli_page()

    def walk(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from walk(sub)
            elif not isinstance(action, argparse._HelpAction):
                yield from action.option_strings

    titles = [t for t, _ in reference.parsers()]
    assert "megatron-id preprocess" in titles and "python launch/reproduce.py" in titles
    for _, parser in reference.parsers():
        missing = [flag for flag in walk(parser) if f"`{flag}`" not in page]
        assert missing == [], (parser.prog, missing)
    for command in ("megatron-id eval mqar", "megatron-id train", "megatron-id export-hf"):
        assert f"## {command}\n" in page


def test_check_names_a_stale_page_and_writes_nothing(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    fresh = tmp_path / "cli.md"
    fresh.write_text(reference.cli_page())
    monkeypatch.setattr(reference, "PAGES", {"config": stale, "cli": fresh})
    assert reference.main(["--check"]) == 1
    assert "config.md" in capsys.readouterr().err and stale.read_text() == "old\n"
    assert reference.main([]) == 0 and stale.read_text() == reference.config_page()
    assert reference.main(["--check"]) == 0


def _heading_ids(markdown: str) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    ids, in_code = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            ids.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return ids


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "launch").rglob("*.md")),
            *sorted((ROOT / "benchmarks").rglob("*.md"))]


def test_relative_links_and_anchors_resolve():
    broken = []
    for page in _pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)   # links in code blocks are not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):   # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _heading_ids(file.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


# ---------------------------------------------------------------- examples in the docs
# Every shell block of the pages says how it is tested, in an HTML comment right before it
# (invisible on GitHub; issue 52: a command a user copies runs as written, or says it is an excerpt):
#   <!-- test: run -->          runs as written (bash -euo pipefail), the page's blocks in order, in a
#                               copy of the tracked files where the README's `run` block has run: its
#                               data (data/fineweb_*), its tiny run at runs/tiny, and that run's
#                               checkpoints again at runs/x/checkpoints, the name the pages give "your run"
#   <!-- test: run exit N -->   the same, for a documented refusal: the block ends with status N, one
#                               `error:` line and no traceback
#   <!-- test: run-by PATH -->  PATH (a test, or .ci/run) runs the block as written: it names the page
#   <!-- test: parse -->        not run (a GPU, a cluster, a server left running, files of the user's, or
#                               minutes of work): every command parsed by its own parser, config files and
#                               key=value overrides loaded and validated
#   <!-- test: excerpt -->      not run: a fragment (`...`, <placeholders>), another project's tool, or a
#                               benchmark of minutes (benchmarks/*.py, run by hand; the page gives its figures)
# adding-a-mixer.md's `<!-- guide: ... -->` marks belong to tests/test_adding_a_mixer.py, which runs them.

SHELL_BLOCK = re.compile(r"(?:<!-- (test|guide): ([^>]*?) -->\n[ \t]*)?```(?:bash|sh|shell|console)\n(.*?)```", re.S)
MARKS = re.compile(r"run|run exit [1-9][0-9]*|run-by \S+|parse|excerpt")
README = Path("README.md")


def _blocks():
    """(page, mark, block) of every shell block of the pages, in page order; mark None when unmarked."""
    found = []
    for page in _pages():
        for kind, mark, block in SHELL_BLOCK.findall(page.read_text()):
            mark = ("run-by tests/test_adding_a_mixer.py" if kind == "guide" else mark) if kind else None
            found.append((page.relative_to(ROOT), mark, block))
    return found


def _examples(kind):
    return [(page, block) for page, mark, block in _blocks() if mark == kind]


def test_every_shell_block_says_how_it_is_tested():
    problems = []
    for page, mark, block in _blocks():
        first = block.strip().splitlines()[0] if block.strip() else "(empty)"
        if mark is None or not MARKS.fullmatch(mark):
            problems.append(f"{page}: `{first}`: mark {mark!r} (want run, run exit N, run-by PATH, parse or excerpt)")
        elif mark.startswith("run-by "):
            runner = ROOT / mark.split()[1]
            if not runner.is_file() or page.name not in runner.read_text():
                problems.append(f"{page}: `{first}`: {mark}, but {runner.relative_to(ROOT)} does not name {page.name}")
    assert not problems, "\n".join(problems)
    # the marks are read: an unmarked block, a mark of its own kind and a runner that never reads the page fail
    assert [m for _, m, _ in _blocks() if m and m.startswith("run")], "no block runs"


def test_the_mark_check_reads_the_marks(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("<!-- test: excerpt -->\n```bash\nmegatron-id train ...\n```\n\n```bash\nls\n```\n"
                    "<!-- test: run-by README.md -->\n```bash\nls\n```\n<!-- test: runs -->\n```sh\nls\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "_pages", lambda: [page])
    assert [m for _, m, _ in _blocks()] == ["excerpt", None, "run-by README.md", "runs"]
    with pytest.raises(AssertionError) as err:
        test_every_shell_block_says_how_it_is_tested()
    assert "mark None" in str(err.value) and "mark 'runs'" in str(err.value)
    assert "README.md does not name page.md" in str(err.value)


def _command_lines(block: str) -> list[list[str]]:
    joined = re.sub(r"\\\n", " ", block)
    return [argv for argv in (shlex.split(line, comments=True) for line in joined.splitlines()) if argv]


@functools.cache
def _commands() -> dict[str, argparse.ArgumentParser]:
    """How each command is typed -> its parser: the list the CLI reference is generated from."""
    return dict(reference.parsers())


def _parse_command(argv: list[str]) -> None:
    """Parse one documented command line as its program would; raise AssertionError naming it."""
    from megatron_id.commands.options import parse_with_overrides_anywhere as _parse_with_overrides_anywhere
    from megatron_id.config import load_config
    line = " ".join(argv)
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):   # VAR=value prefixes
        argv = argv[1:]
    if argv[0] in ("torchrun", "deepspeed"):   # the launcher's own options, up to the module
        argv = ["python", *argv[argv.index("-m"):]]
    if argv[:3] == ["python", "-m", "megatron_id.cli"]:
        argv = ["megatron-id", *argv[3:]]
    if argv[:3] == ["python", "-m", "data_tools.preprocess"]:   # = megatron-id preprocess
        argv = ["megatron-id", "preprocess", *argv[3:]]
    commands = _commands()
    # the longest command that starts the line: `megatron-id preprocess` before `megatron-id`
    title = max((t for t in commands if argv[:len(t.split())] == t.split()), key=len, default=None)
    if title is None:
        raise AssertionError(f"no parser known for `{line}`: mark the block `run` or not at all")
    rest = argv[len(title.split()):]
    try:
        if title == "megatron-id":
            args = _parse_with_overrides_anywhere(commands[title], rest)
            if hasattr(args, "overrides"):
                # (convert takes model.KEY=VALUE overrides and no --config)
                load_config([ROOT / c for c in getattr(args, "config", [])], args.overrides)
        elif title == "python launch/slurm/preprocess_submit.py":   # its options -- preprocess's -- inputs
            options, flags, inputs = reference._load_script(ROOT / argv[1]).split_command_line(rest)
            commands[title].parse_args(options)
            commands["megatron-id preprocess"].parse_args([*flags, "--input", *inputs, "--output-prefix", "x"])
        else:
            commands[title].parse_args(rest)
    except SystemExit as stop:   # argparse's exit on a bad flag
        raise AssertionError(f"`{line}` does not parse (exit {stop.code})") from None


def test_documented_commands_parse():
    examples = _examples("parse")
    assert len(examples) >= 10
    for page, block in examples:
        for argv in _command_lines(block):
            try:
                _parse_command(argv)
            except Exception as err:
                raise AssertionError(f"{page}: {err}") from None


def test_parse_check_catches_a_wrong_flag_and_a_wrong_key():
    with pytest.raises(AssertionError, match="does not parse"):
        _parse_command(["megatron-id", "export-hf", "--checkpoint", "a", "--outptu", "b"])
    with pytest.raises(Exception, match="n_layer"):
        _parse_command(["megatron-id", "params", "--config", "configs/model/tiny.yaml", "model.n_layer=3"])


def _run_block(block: str, cwd: Path) -> subprocess.CompletedProcess:
    """One block as a user pastes it, in the installed environment (megatron-id, torchrun on PATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """The README's `run` block (its commands by hand: preprocess, train on 2 processes, export,
    generate) in a copy of the tracked files, as a user would paste it; then the same checkpoints
    at runs/x/checkpoints, the run the pages call runs/x."""
    from test_quickstart import tracked_copy
    clone = tmp_path_factory.mktemp("docs") / "clone"
    tracked_copy(clone)
    (block,) = [block for page, mark, block in _blocks() if page == README and mark == "run"]
    done = _run_block(block, clone)
    assert done.returncode == 0, f"README.md:\n{block}\n{(done.stdout + done.stderr)[-4000:]}"
    shutil.copytree(clone / "runs" / "tiny" / "checkpoints", clone / "runs" / "x" / "checkpoints")
    return clone, done


@pytest.mark.slow
def test_the_readme_commands_run(readme_run):
    clone, done = readme_run
    assert (clone / "runs" / "tiny" / "hf" / "model.safetensors").is_file()
    assert "The water cycle" in done.stdout
    # issue 41 group C: the README trains with `megatron-id train --nproc 2`, not torchrun (whose report
    # followed every refusal); its training reaches the end in the ranks' own words
    assert "torch/distributed/run.py" not in done.stderr and "finished at step 32;" in done.stderr, done.stderr[-3000:]


RUN_PAGES = sorted({page for page, mark, _ in _blocks() if page != README and mark and MARKS.fullmatch(mark)
                    and (mark == "run" or mark.startswith("run exit"))}, key=str)


@pytest.mark.slow
@pytest.mark.parametrize("page", RUN_PAGES, ids=str)
def test_the_pages_commands_run_as_written(page, readme_run, tmp_path):
    """Each page's `run` blocks, in order, in its own copy of the README's results (so no page
    sees another's outputs)."""
    work = tmp_path / "clone"
    shutil.copytree(readme_run[0], work, symlinks=True)
    for _, mark, block in [b for b in _blocks() if b[0] == page and b[1] and b[1].startswith("run") and
                           not b[1].startswith("run-by")]:
        status = int(mark.split()[-1]) if mark.startswith("run exit") else 0
        done = _run_block(block, work)
        said = f"{page} (want exit {status}, got {done.returncode}):\n{block}\n{(done.stdout + done.stderr)[-4000:]}"
        assert done.returncode == status, said
        assert "Traceback" not in done.stdout + done.stderr, said
        if status:
            assert "error:" in done.stderr, said

