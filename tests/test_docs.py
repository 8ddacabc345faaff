"""The generated reference pages (megatron_id/reference.py) agree with the code."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

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
