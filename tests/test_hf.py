"""Hugging Face export / import and generation with a constant-size state (issue 6)."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import CONFIGS, ROOT
from distributed import run_distributed

from megatron_id.config import load_config

TOKENIZER = ROOT / "tests/data/gpt2-tokenizer.json"
MIXERS = {"interdomain": [], "softmax": ["model.mixer=softmax"], "s4d": ["model.mixer=s4d"],
          # a hybrid whose pipeline stage boundary (at PP=2) falls inside the pattern
          "hybrid": ["model.layer_pattern=IW|AI", "model.n_layers=4", "model.window=5"]}


def train_items(prefix, tp, pp, mixer):
    return MIXERS[mixer] + [
        f"data.data_path=[{prefix}]", "data.split=100,0,0", f"data.tokenizer={TOKENIZER}",
        "model.vocab_size=50257", "model.chunk_size=8", f"parallel.tensor_model_parallel_size={tp}",
        f"parallel.pipeline_model_parallel_size={pp}", "train.zero_stage=1", "train.precision=fp32",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.train_tokens=512",
        "optimizer.lr=1e-2", "optimizer.warmup_tokens=1"]


def probe_batch():
    return torch.randint(0, 50257, (2, 21), generator=torch.Generator().manual_seed(5))


def _train_save_logits(rank, world, items, path):
    """Train 2 steps, save, and return the engine's logits on the probe batch at this layout
    (gathered over TP; from the last pipeline stage)."""
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items))
    trainer.train(max_steps=2)
    trainer.save_checkpoint(path)
    return engine_logits(trainer)


def engine_logits(trainer, batch=None):
    """The engine's logits on the probe batch (or `batch`) at its layout, gathered over TP; None
    on ranks that do not hold them (all but the last pipeline stage)."""
    from megatron_id.parallel import gather_logits, state
    batch = probe_batch() if batch is None else batch
    with torch.no_grad():
        if trainer.pipelined:
            trainer.engine.reset_activation_shape()   # the probe is shorter than the training sequences
            out = trainer.engine.eval_batch(iter([(batch, batch)]), return_logits=True, num_micro_batches=1)
            local = out[1] if trainer.engine.is_last_stage() else None
        else:
            trainer.engine.eval()
            local = trainer.engine(batch)
    if local is None:
        return None
    return gather_logits(local, state.get_tensor_model_parallel_group(), 50257)


@pytest.fixture(scope="module")
def checkpoints(fineweb_prefix, tmp_path_factory):
    """{(mixer, layout): (checkpoint root, engine logits on the probe batch)}"""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for mixer in MIXERS:
        for tp, pp, world in [(1, 1, 1), (2, 2, 4)]:
            path = root / f"{mixer}-{tp}x{pp}"
            results = run_distributed(_train_save_logits, world,
                                      args=(train_items(fineweb_prefix, tp, pp, mixer), path), timeout=300)
            logits = next(r for r in results if r is not None)
            out[mixer, (tp, pp)] = path, logits
    return out


def load_exported(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, local_files_only=True)
    return model.eval(), AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("mixer", list(MIXERS))
def test_exported_logits_equal_the_training_engine(checkpoints, tmp_path, mixer):
    from megatron_id.hf.export import export_hf
    for layout in [(1, 1), (2, 2)]:
        path, engine_logits = checkpoints[mixer, layout]
        folder = export_hf(path, tmp_path / f"hf-{layout[0]}x{layout[1]}")
        names = {p.name for p in folder.iterdir()}
        assert {"config.json", "model.safetensors", "modeling_megatron_id.py", "configuration_megatron_id.py",
                "megatron_id_model.py", "tokenizer.json", "generation_config.json"} <= names
        model, _ = load_exported(folder)
        batch = probe_batch()
        with torch.no_grad():
            out = model(batch, labels=batch, use_cache=False)
        assert out.logits.shape == (2, 21, 50257)               # vocabulary padding removed
        err = ((out.logits - engine_logits).norm() / engine_logits.norm()).item()
        assert err <= 1e-5, (mixer, layout, err)
        want = torch.nn.functional.cross_entropy(engine_logits[:, :-1].reshape(-1, 50257), batch[:, 1:].reshape(-1))
        assert abs(out.loss.item() - want.item()) <= 1e-5 * want.item()


@pytest.mark.slow
def test_export_import_export_is_identical_at_every_layout(checkpoints, tmp_path):
    from safetensors.torch import load_file

    from megatron_id.hf.export import export_hf, import_hf
    path, _ = checkpoints["interdomain", (2, 2)]
    first = export_hf(path, tmp_path / "first")
    for tp, pp in [(1, 1), (2, 2), (2, 1)]:
        ckpt = import_hf(first, tmp_path / f"imported-{tp}x{pp}", tensor_parallel=tp, pipeline_parallel=pp)
        again = export_hf(ckpt, tmp_path / f"again-{tp}x{pp}")
        a, b = load_file(str(first / "model.safetensors")), load_file(str(again / "model.safetensors"))
        assert set(a) == set(b)
        for name in a:
            assert torch.equal(a[name], b[name]), (tp, pp, name)


@pytest.mark.slow
def test_the_trainer_continues_from_an_imported_folder(checkpoints, fineweb_prefix, tmp_path):
    from megatron_id.hf.export import export_hf, import_hf
    path, engine_logits = checkpoints["interdomain", (1, 1)]
    ckpt = import_hf(export_hf(path, tmp_path / "hf"), tmp_path / "imported", tensor_parallel=2, pipeline_parallel=2)
    items = train_items(fineweb_prefix, 2, 2, "interdomain") + [f"train.load={ckpt}"]
    results = run_distributed(_logits_after_load, 4, args=(items,), timeout=300)
    logits = next(r for r in results if r is not None)
    assert ((logits - engine_logits).norm() / engine_logits.norm()).item() <= 1e-5


def _logits_after_load(rank, world, items):
    from megatron_id.training.engine import Trainer
    return engine_logits(Trainer(load_config([CONFIGS / "model" / "tiny.yaml"], items)))


@pytest.mark.slow
@pytest.mark.parametrize("mixer", list(MIXERS))
def test_generation_with_the_cache_equals_recomputing(checkpoints, tmp_path, mixer):
    from megatron_id.hf.export import export_hf
    model, tokenizer = load_exported(export_hf(checkpoints[mixer, (1, 1)][0], tmp_path / "hf"))
    prompt = tokenizer("The water cycle describes how", return_tensors="pt").input_ids
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=12, do_sample=False)
        recomputed = prompt
        for _ in range(12):   # no cache: the whole sequence through the model every step
            logits = model(recomputed, use_cache=False).logits
            recomputed = torch.cat([recomputed, logits[:, -1:].argmax(-1)], dim=1)
        assert torch.equal(cached, recomputed), (cached, recomputed)
        # chunked prefill equals full prefill (logits and the state it leaves)
        long = torch.randint(0, 50257, (1, 50), generator=torch.Generator().manual_seed(1))
        full = model(long, use_cache=True, prefill_chunk_size=10**6)
        chunked = model(long, use_cache=True, prefill_chunk_size=7)
        assert ((chunked.logits - full.logits).norm() / full.logits.norm()).item() <= 1e-5
        last = model(long, use_cache=True, prefill_chunk_size=7, logits_to_keep=3).logits
        assert last.shape[1] == 3 and torch.allclose(last, full.logits[:, -3:], rtol=1e-4, atol=1e-5)
        # (50 = 7 x 7 + 1: the last chunk takes the decode path, which also caches parameter-only
        # step tables; the state proper must be the same)
        a, b = [{p: t for p, t in c.cache.tensors().items() if ".tables." not in p} for c in (chunked, full)]
        assert a.keys() == b.keys() and a
        for path in a:
            assert a[path].shape == b[path].shape, path
            assert torch.allclose(a[path], b[path], rtol=1e-4, atol=1e-5), path


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["interdomain", "s4d"])
def test_the_cache_does_not_grow(checkpoints, tmp_path, mixer):
    from megatron_id.hf.export import export_hf
    model, _ = load_exported(export_hf(checkpoints[mixer, (1, 1)][0], tmp_path / "hf"))
    sizes = {}
    with torch.no_grad():
        out = model(torch.tensor([[464]]), use_cache=True)
        for step in range(1, 1001):
            token = out.logits[:, -1:].argmax(-1)
            out = model(token, cache=out.cache, use_cache=True)
            if step in (10, 1000):
                sizes[step] = {path: (tuple(t.shape), t.dtype) for path, t in out.cache.tensors().items()}
    assert sizes[10] == sizes[1000] and sizes[10]
    assert out.cache.get_seq_length() == 1001


@pytest.mark.slow
def test_tokenizer_round_trips_and_ids_match_the_config(checkpoints, tmp_path):
    from megatron_id.hf.export import export_hf
    folder = export_hf(checkpoints["interdomain", (1, 1)][0], tmp_path / "hf")
    _, tokenizer = load_exported(folder)
    text = "Photosynthesis converts light energy into chemical energy.\nÉtudes: 42% — ok?"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert config["pad_token_id"] == tokenizer.pad_token_id == generation["pad_token_id"]
    assert generation["eos_token_id"] == tokenizer.eos_token_id


@pytest.mark.slow
def test_the_export_loads_without_megatron_id(checkpoints, tmp_path):
    from megatron_id.hf.export import export_hf
    folder = export_hf(checkpoints["interdomain", (1, 1)][0], tmp_path / "hf")
    code = ("import sys; sys.modules['megatron_id'] = None; sys.modules['data_tools'] = None\n"
            "import torch; from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)\n"
            "print(m(torch.tensor([[1, 2, 3]])).logits.shape)\n"
            # generate decodes on the bundled fused step, its torch ops (no megatron_id to build the C++ core)
            "with torch.no_grad():\n"
            "    out = m(torch.tensor([[1, 2, 3]]), use_cache=True)\n"
            "    out = m(torch.tensor([[4]]), cache=out.cache, use_cache=True)\n"
            "print('fused kernel', out.cache.fused.kernel)\n"
            "print(m.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).shape)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                             "HF_HOME": str(tmp_path / "hf-home")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch.Size([1, 3, 50257])" in done.stdout
    assert "fused kernel torch" in done.stdout and "torch.Size([1, 7])" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["interdomain", "hybrid"])
def test_megatron_id_generate_streams_what_hf_generate_produces(checkpoints, tmp_path, mixer):
    from megatron_id.cli import main
    from megatron_id.hf.export import export_hf
    checkpoint = checkpoints[mixer, (2, 2)][0]
    folder = export_hf(checkpoint, tmp_path / "hf")
    model, tokenizer = load_exported(folder)
    prompt = "Rivers carry"
    with torch.no_grad():
        ids = model.generate(tokenizer(prompt, return_tensors="pt").input_ids, max_new_tokens=10, do_sample=False)
    want = tokenizer.decode(ids[0])
    for source in (checkpoint, folder):   # a TP=2 x PP=2 training checkpoint, and the export
        done = subprocess.run([sys.executable, "-m", "megatron_id.cli", "generate", "--checkpoint", str(source),
                               "--prompt", prompt, "--max-new-tokens", "10", "--ignore-eos",
                               "--prefill-chunk-size", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout == want + "\n", (done.stdout, want)
    assert main(["export-hf", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "model.safetensors").is_file()


@pytest.mark.slow
def test_export_of_the_cube_switches_and_tied_embeddings(fineweb_prefix, tmp_path):
    """The other corners of the config: linear-contraction readout, single SSM input, output
    gate, plain readout, tied embeddings (one matrix in the checkpoint, two keys in the export)."""
    from megatron_id.hf.export import export_hf
    items = train_items(fineweb_prefix, 1, 1, "interdomain") + [
        "model.query_readout=false", "model.dual_kv_input=false", "model.output_gate=true",
        "model.readout=plain", "model.tie_embeddings=true"]
    engine_logits = run_distributed(_train_save_logits, 1, args=(items, tmp_path / "ckpt"), timeout=300)[0]
    model, _ = load_exported(export_hf(tmp_path / "ckpt", tmp_path / "hf"))
    assert model.model.lm_head.weight is model.model.embed.weight
    with torch.no_grad():
        logits = model(probe_batch(), use_cache=False).logits
    assert ((logits - engine_logits).norm() / engine_logits.norm()).item() <= 1e-5
