"""docs/adding-a-mixer.md, followed literally: each file it shows is written and each line it
shows is inserted where it says, in a copy of the repository; then its commands run there and
what it promises is checked: the toy mixer trains alike at TP=2 and CP=2, exports to
Hugging Face and generates with its cache exactly as without one.

Markers on the page (HTML comments, invisible on GitHub), each before a fenced block:
    <!-- guide: new PATH -->                  the block is a new file
    <!-- guide: after 'ANCHOR' in PATH -->    the block goes right after the one line containing ANCHOR
    <!-- guide: run -->                       the block runs in bash (cwd: the copy)
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_quickstart import tracked_copy

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "adding-a-mixer.md"
STEP = re.compile(r"<!-- guide: (new (\S+)|after '([^']*)' in (\S+)|run) -->\n```(?:python|bash)\n(.*?)```", re.S)


def guide_steps(text: str) -> list[dict]:
    steps = []
    for whole, new_path, anchor, after_path, body in STEP.findall(text):
        kind = "run" if whole == "run" else "new" if new_path else "after"
        steps.append(dict(kind=kind, path=new_path or after_path, anchor=anchor, body=body))
    return steps


def apply_step(root: Path, step: dict) -> None:
    """Write or insert one step's block; an anchor that is not on exactly one line is the page
    going stale, and says where."""
    target = root / step["path"]
    if step["kind"] == "new":
        assert not target.exists(), (f"{GUIDE.name}: '{step['path']}' exists already: the page adds files, "
                                     f"never replaces them")
        target.write_text(step["body"])
        return
    lines = target.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if step["anchor"] in line]
    assert len(hits) == 1, (f"{GUIDE.name}: the anchor {step['anchor']!r} is on {len(hits)} lines of "
                            f"{step['path']}, not one: update the page to the code")
    lines[hits[0] + 1:hits[0] + 1] = [step["body"]]
    target.write_text("".join(lines))


def follow_the_edits(root: Path) -> list[dict]:
    """Apply every file and line of the page under `root`; return its run blocks."""
    steps = guide_steps(GUIDE.read_text())
    for step in steps:
        if step["kind"] != "run":
            apply_step(root, step)
    return [s for s in steps if s["kind"] == "run"]


def _env(clone: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(clone)   # the copy's package, also for the `megatron-id` console script
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


def _python(clone: Path, code: str, timeout: int = 300) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=clone, env=_env(clone),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def test_the_page_has_the_steps_of_a_whole_mixer():
    steps = guide_steps(GUIDE.read_text())
    kinds = [(s["kind"], s["path"]) for s in steps]
    # the module (which registers itself, @mixer_module) and one row of MIXER_SPECS in model/spec.py:
    # nothing else is edited (the Mixer enum, config.py and model/pattern.py derive from the row,
    # model/mixers/__init__.py imports every module of its folder)
    assert [(kind, path) for kind, path in kinds if kind != "run"] == [
        ("new", "megatron_id/model/mixers/ema.py"), ("after", "megatron_id/model/spec.py")]
    row = next(s["body"] for s in steps if s["kind"] == "after")
    assert row.startswith('    "ema": MixerSpec(') and row.rstrip().endswith(")),")   # one row of the table
    assert [s for s in steps if s["kind"] == "run"]


def test_a_stale_anchor_is_named(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\nx = 1\n")
    with pytest.raises(AssertionError, match="on 2 lines of a.py"):
        apply_step(tmp_path, dict(kind="after", path="a.py", anchor="x = 1", body="y = 2\n"))
    with pytest.raises(AssertionError, match="exists already"):
        apply_step(tmp_path, dict(kind="new", path="a.py", anchor="", body=""))


def test_the_toy_builds_decodes_and_is_accounted_after_the_edits(tmp_path):
    """The edits alone (no training): the config accepts the mixer and its letter, the model
    continues a prefix exactly, the accounting reads the toy's declarations, and a mixer
    without a letter's worth of config (model.rope=true) is refused."""
    for part in ("megatron_id", "configs"):
        subprocess.run(["cp", "-r", str(ROOT / part), str(tmp_path / part)], check=True)
    follow_the_edits(tmp_path)
    out = _python(tmp_path, """
        import json, torch
        from megatron_id.config import ConfigError, load_config
        from megatron_id.model import LanguageModel
        from megatron_id.model.accounting import report
        cfg = load_config(["configs/model/tiny.yaml"], ["model.mixer=ema"]).model
        model = LanguageModel(cfg, seed=1).eval()
        x = torch.randint(0, cfg.vocab_size, (2, 24))
        full = model(x)
        logits, states = model(x[:, :10], return_states=True)
        parts = [logits]
        for i in range(10, 24):
            logits, states = model(x[:, i:i + 1], states=states, return_states=True)
            parts.append(logits)
        r = report(cfg)
        hybrid = load_config(["configs/model/tiny.yaml"], ["model.layer_pattern=EA"]).model
        try:
            load_config(["configs/model/tiny.yaml"], ["model.mixer=ema", "model.rope=true"])
            refused = ""
        except ConfigError as err:
            refused = str(err)
        print(json.dumps(dict(diff=(torch.cat(parts, 1) - full).abs().max().item(),
                              state=[list(s["h"].shape) for s in states], fixed=r.fixed_state,
                              per_token=r.decode_state_per_token, hybrid=hybrid.mixer.value,
                              hybrid_per_token=report(hybrid).decode_state_per_token, refused=refused)))
    """)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["diff"] < 1e-5
    assert got["state"] == [[2, 4, 16], [2, 4, 16]]            # tiny: 4 heads of 16 channels
    assert got["fixed"] == 2 * 64 and got["per_token"] == 0     # d_model numbers per layer
    assert got["hybrid"] == "hybrid" and got["hybrid_per_token"] == 2 * 64   # its A layer's KV cache
    assert "model.rope=True contradicts model.mixer=ema" in got["refused"]


@pytest.mark.slow
def test_following_the_page_trains_at_tp2_and_cp2_exports_and_generates(tmp_path):
    clone = tmp_path / "clone"
    tracked_copy(clone)
    runs = follow_the_edits(clone)
    for step in runs:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", step["body"]], cwd=clone, env=_env(clone),
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{GUIDE.name}:\n{step['body']}\n{(done.stdout + done.stderr)[-4000:]}"
    assert "The water cycle" in done.stdout
    # the reference was regenerated with the new value
    assert "`ema`" in (clone / "docs" / "reference" / "config.md").read_text()

    def losses(layout):
        rows = [json.loads(line) for line in (clone / "runs" / "ema" / f"{layout}.jsonl").read_text().splitlines()]
        return [r["train/loss"] for r in rows if "train/loss" in r]

    tp2, cp2 = losses("tp2"), losses("cp2")
    assert len(tp2) == len(cp2) == 16
    assert tp2[-1] < tp2[0] - 0.5                               # it learns
    # same batches and initial weights, cut by heads or by the sequence: equal only if both are right
    assert cp2 == pytest.approx(tp2, rel=1e-4, abs=1e-4)

    # the export loads without megatron_id (the bundle carries the toy) and its cache changes nothing
    out = _python(clone, """
        import sys; sys.modules['megatron_id'] = None
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained("runs/ema/hf", trust_remote_code=True).eval()
        prompt = torch.tensor([[464, 1660, 6772, 318, 262]])
        cached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=False)
        sizes = []
        for n in (5, 40):
            out = model(torch.randint(0, 50257, (1, n)), use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            sizes.append(sum(t.numel() for t in cache.tensors().values()))
        print(json.dumps(dict(cached=cached.tolist(), uncached=uncached.tolist(), sizes=sizes)))
    """)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["cached"] == got["uncached"] and len(got["cached"][0]) == 17
    assert got["sizes"][0] == got["sizes"][1] > 0               # a fixed-size state


def test_context_parallelism_is_refused_for_a_mixer_without_it(tiny_config):
    """A mixer without the context_parallel attribute would see only its own block: an error."""
    from megatron_id.errors import UserError
    from megatron_id.model import LanguageModel
    from megatron_id.parallel.context_parallel import ContextParallel, apply_context_parallel
    model = LanguageModel(tiny_config(), seed=0)
    del model.layers[1].mixer.context_parallel
    with pytest.raises(UserError, match="the mixer InterdomainMixer does not run context parallel"):
        apply_context_parallel(model, ContextParallel(group=None, rank=0, size=2))
    assert model.layers[0].mixer.context_parallel is None   # nothing was set
