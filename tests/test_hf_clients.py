"""The exported model under the clients users bring (issue 13): transformers' generation
features (beam search, padded batches, hidden states, gradient checkpointing, inputs_embeds,
resize_token_embeddings, device_map), lm-evaluation-harness, and the oldest transformers 5.x.

Models are random tiny ones (tests/hf_tiny.py: no training), compared in float64 where the
claim is exactness: a padded row must compute what the row computes alone."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch
from hf_tiny import tiny_export

MIXERS = ["interdomain", "softmax", "s4d", "hybrid"]
PROMPTS = [[464, 1660, 6954, 8477, 703, 262, 1917], [31319, 3283], [40, 588, 257, 1492]]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    return {mixer: tiny_export(root / mixer, mixer) for mixer in MIXERS}


def load(folder, **kwargs):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, local_files_only=True,
                                                **kwargs).eval()


def cache_of(output):
    """The cache field: `cache` from transformers 5.24, `past_key_values` before."""
    return getattr(output, "cache", None) if "cache" in type(output).__dataclass_fields__ else output.past_key_values


def pad(prompts, side, pad_id=50256):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, cols], mask[i, cols] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("mixer", MIXERS)
def test_padded_batches_compute_what_each_row_computes_alone(exports, mixer):
    """float64: the logits of every real token, left or right padded, equal the row's own
    (< 1e-10), also through a chunked prefill; the left-padded cache continues each row as its
    own cache does; a right-padded batch gives no cache, and asking for one is refused."""
    model = load(exports[mixer]).double()
    with torch.no_grad():
        alone = [model(torch.tensor([p])).logits[0] for p in PROMPTS]
        for side in ("left", "right"):
            ids, mask = pad(PROMPTS, side)
            for chunk in (None, 3):
                out = model(ids, attention_mask=mask, prefill_chunk_size=chunk)
                for i, p in enumerate(PROMPTS):
                    got = out.logits[i][mask[i].bool()]
                    assert (got - alone[i]).abs().max().item() < 1e-10, (side, chunk, i)
        ids, mask = pad(PROMPTS, "right")
        assert cache_of(model(ids, attention_mask=mask)) is None
        with pytest.raises(ValueError, match="padding_side = 'left'"):
            model(ids, attention_mask=mask, use_cache=True)
        # one decode step after a left-padded prefill equals each row's own next step
        ids, mask = pad(PROMPTS, "left")
        batched = model(ids, attention_mask=mask, use_cache=True)
        nxt = torch.tensor([[11], [13], [198]])
        step = model(nxt, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                     use_cache=True, cache=cache_of(batched))
        for i, p in enumerate(PROMPTS):
            own = model(torch.tensor([p + nxt[i].tolist()])).logits[0, -1]
            assert (step.logits[i, -1] - own).abs().max().item() < 1e-10, i
        with pytest.raises(ValueError, match="between real tokens"):
            model(ids, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1, 1]] * 3))


@pytest.mark.parametrize("mixer", MIXERS)
def test_padded_batch_loss_is_the_token_weighted_mean_of_each_rows_own_loss(exports, mixer):
    """labels=input_ids with an attention mask (pads neither targets nor predictors), left and
    right padded: the batch's loss equals sum over rows of (own loss x own targets) / targets."""
    model = load(exports[mixer]).double()
    with torch.no_grad():
        own = [(model(torch.tensor([p]), labels=torch.tensor([p])).loss.item(), len(p) - 1) for p in PROMPTS]
        want = sum(loss * n for loss, n in own) / sum(n for _, n in own)
        for side in ("left", "right"):
            ids, mask = pad(PROMPTS, side)
            got = model(ids, attention_mask=mask, labels=ids).loss.item()
            assert abs(got - want) < 1e-6 * abs(want), (side, got, want)   # the loss runs in float32


@pytest.mark.parametrize("mixer", MIXERS)
def test_batched_generation_with_left_padding_equals_one_at_a_time(exports, mixer):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(exports[mixer], trust_remote_code=True)
    assert tokenizer.padding_side == "left"
    model = load(exports[mixer])
    texts = ["The water cycle describes how", "Rivers", "Photosynthesis in plants turns light"]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    assert not bool(batch.attention_mask.all())   # the batch is really padded
    with torch.no_grad():
        together = model.generate(**batch, max_new_tokens=8, do_sample=False)
        for i, text in enumerate(texts):
            ids = tokenizer(text, return_tensors="pt").input_ids
            alone = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
            assert together[i, batch.input_ids.shape[1]:].tolist() == alone.tolist(), i


@pytest.mark.parametrize("mixer", MIXERS)
def test_beam_search_with_the_cache_equals_beam_search_without(exports, mixer):
    model = load(exports[mixer])
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=True)
        recomputed = model.generate(prompt, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False)
        greedy = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert cached.tolist() == recomputed.tolist()
    assert cached.shape == greedy.shape


def test_hidden_states_inputs_embeds_and_gradient_checkpointing(exports):
    model = load(exports["interdomain"]).double()
    ids = torch.tensor([PROMPTS[0]])
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        assert len(out.hidden_states) == n_layers + 1
        assert torch.equal(out.hidden_states[0], model.get_input_embeddings()(ids))
        assert torch.allclose(model.get_output_embeddings()(out.hidden_states[-1]), out.logits, atol=1e-12)
        chunked = model(ids, output_hidden_states=True, use_cache=True, prefill_chunk_size=3)
        for a, b in zip(out.hidden_states, chunked.hidden_states):
            assert (a - b).abs().max().item() < 1e-10
        embeds = model.get_input_embeddings()(ids)
        assert (model(inputs_embeds=embeds).logits - out.logits).abs().max().item() < 1e-12
        from_ids = model.generate(ids, max_new_tokens=5, do_sample=False)
        from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False)
        assert from_embeds.tolist() == from_ids[:, ids.shape[1]:].tolist()
    # gradient checkpointing recomputes each block: same loss and gradients, and it can be undone
    grads = {}
    model.train()
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        assert model.model.activation_checkpointing is checkpointing
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads[checkpointing] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    model.gradient_checkpointing_disable()
    assert model.model.activation_checkpointing is False
    assert grads[True][0] == pytest.approx(grads[False][0], abs=1e-12)
    for name, g in grads[False][1].items():
        assert (grads[True][1][name] - g).abs().max().item() < 1e-10, name


def test_resize_token_embeddings_keeps_the_old_rows_and_saves(exports, tmp_path):
    model = load(exports["interdomain"])
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = model(ids).logits
    model.resize_token_embeddings(50304)
    assert model.config.model["vocab_size"] == model.config.vocab_size == 50304
    with torch.no_grad():
        after = model(ids).logits
        assert after.shape[-1] == 50304
        assert torch.allclose(after[..., :50257], before, atol=1e-6)
        assert torch.isfinite(model(torch.tensor([[50300]])).logits).all()   # a new row is usable
    model.save_pretrained(tmp_path / "resized")
    again = load(tmp_path / "resized")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, after)


def test_device_map_and_the_tokenizer_files(exports, tmp_path):
    folder = exports["softmax"]
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[2]])
        assert torch.equal(load(folder, device_map="cpu")(ids).logits, load(folder)(ids).logits)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 64   # tiny.yaml's seq_length, not 10**9
    mask = os.umask(0)
    os.umask(mask)
    assert (folder.stat().st_mode & 0o777) == 0o777 & ~mask   # the umask's mode, not mkdtemp's 0700
    # the README's tokenizer call answers at once, with no stdin (no "run custom code? [y/N]")
    code = (f"from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained({str(folder)!r}, "
            f"trust_remote_code=True); print(t.model_max_length, t('Rivers carry').input_ids)")
    done = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[y/N]" not in done.stdout + done.stderr
    from tokenizers import Tokenizer
    want = Tokenizer.from_file(str(folder / "tokenizer.json")).encode("Rivers carry").ids
    assert done.stdout.split("\n")[0] == f"64 {want}"


def test_lm_evaluation_harness_batches(exports):
    """lm_eval 0.4.13's HFLM on an export: --batch_size auto picks a batch above 1 (it probes at
    model_max_length), loglikelihood at that batch equals batch 1, and generate_until at batch 2
    (left-padded by lm_eval) equals batch 1."""
    pytest.importorskip("lm_eval", reason="lm_eval is in the test extra: pip install -e '.[test]'")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    folder = str(exports["interdomain"])
    auto = HFLM(pretrained=folder, trust_remote_code=True, batch_size="auto", device="cpu")
    one = HFLM(pretrained=folder, trust_remote_code=True, batch_size=1, device="cpu")
    two = HFLM(pretrained=folder, trust_remote_code=True, batch_size=2, device="cpu")
    assert auto.max_length == 64
    pairs = [("The water cycle", " describes how"), ("Rivers", " carry sediment to the sea"), ("A", " B")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    scored = auto.loglikelihood(requests)
    assert auto.batch_sizes and min(auto.batch_sizes.values()) > 1, auto.batch_sizes
    for (a, _), (b, _) in zip(scored, one.loglikelihood(requests)):
        assert a == pytest.approx(b, rel=1e-5)
    until = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    generations = [Instance("generate_until", {}, (text, dict(until)), i)
                   for i, text in enumerate(["The water cycle describes", "Rivers", "Photosynthesis is"])]
    assert two.generate_until(generations) == one.generate_until(generations)


OLDEST = "5.0.0"


@pytest.mark.slow
def test_the_oldest_transformers_5(exports, tmp_path_factory):
    """transformers 5.0.0 in a virtual environment of its own (this one's packages behind it):
    load, forward with labels, cached greedy generation equal to recomputation, beam search."""
    home = Path(os.environ.get("MEGATRON_ID_TEST_CACHE", Path.home() / ".cache" / "megatron_id-tests"))
    env_dir = home / f"transformers-{OLDEST}"
    python = env_dir / "bin" / "python"
    if not (env_dir / "ready").exists():
        shutil.rmtree(env_dir, ignore_errors=True)
        venv.create(env_dir, with_pip=True)
    # this environment's packages (torch, tokenizers, ...) come after the new venv's own
    # site-packages (a .pth line), so only transformers and what it needs differently change;
    # written at every run: the cached venv outlives the environment that made it (CI's venv is
    # a temporary folder), and a line naming a removed folder left it without torch
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "zz_megatron_id_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if not (env_dir / "ready").exists():
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", f"transformers=={OLDEST}"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        (env_dir / "ready").touch()
    code = f"""
import torch, transformers
from transformers import AutoModelForCausalLM
assert transformers.__version__ == {OLDEST!r}, transformers.__version__
for folder in {[str(f) for f in exports.values()]!r}:
    m = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids = torch.tensor([{PROMPTS[0]!r}])
    with torch.no_grad():
        loss = m(ids, labels=ids).loss
        assert torch.isfinite(loss)
        cached = m.generate(ids, max_new_tokens=8, do_sample=False)
        seq = ids
        for _ in range(8):
            seq = torch.cat([seq, m(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
        assert cached.tolist() == seq.tolist(), (cached, seq)
        beams = [m.generate(ids, max_new_tokens=4, num_beams=3, use_cache=c).tolist() for c in (True, False)]
        assert beams[0] == beams[1]
    print(folder.rsplit('/', 1)[-1], round(loss.item(), 6))
"""
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path_factory.mktemp("old"),
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    # the same losses as the newest transformers computes here
    for mixer, folder in exports.items():
        ids = torch.tensor([PROMPTS[0]])
        with torch.no_grad():
            loss = load(folder)(ids, labels=ids).loss.item()
        assert f"{mixer} {round(loss, 6)}" in done.stdout, (mixer, loss, done.stdout)
