"""The generated reference pages (megatron_id/reference.py) agree with the code."""
from __future__ import annotations

import argparse
import functools
import os
import re
import shlex
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
# A shell block preceded by `<!-- test: parse -->` has every command parsed by its own parser (and
# every config file and key=value override loaded and validated), without running it: for
# commands that need a GPU, a cluster or data a test does not have. `<!-- test: run -->` blocks
# run, in that order, in a copy of the repository's tracked files.

EXAMPLE = re.compile(r"<!-- test: (run|parse) -->\n```bash\n(.*?)```", re.S)


def _examples(kind):
    found = []
    for page in _pages():
        for mark, block in EXAMPLE.findall(page.read_text()):
            if mark == kind:
                found.append((page.relative_to(ROOT), block))
    return found


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
                load_config([ROOT / c for c in args.config], args.overrides)
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


@pytest.mark.slow
def test_documented_examples_run(tmp_path):
    """The `run` blocks (the README's commands by hand: preprocess, train on 2 processes, export,
    generate), in a copy of the tracked files, as a user would paste them."""
    from test_quickstart import tracked_copy
    examples = _examples("run")
    assert examples, "no `<!-- test: run -->` block in the docs"
    clone = tmp_path / "clone"
    tracked_copy(clone)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"   # megatron-id, torchrun
    for page, block in examples:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=clone, env=env, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, f"{page}:\n{block}\n{(done.stdout + done.stderr)[-4000:]}"
    assert (clone / "runs" / "tiny" / "hf" / "model.safetensors").is_file()
    assert "The water cycle" in done.stdout
    # issue 41 group C: the README trains with `megatron-id train --nproc 2`, not torchrun (whose report
    # followed every refusal); its training reaches the end in the ranks' own words
    assert "torch/distributed/run.py" not in done.stderr and "finished at step 32;" in done.stderr, done.stderr[-3000:]
