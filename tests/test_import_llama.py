"""import-hf of pretrained Llama-architecture transformers folders (issue 43): a randomly
initialised tiny LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM saved by transformers
becomes a softmax-mixer checkpoint whose logits are transformers' own (float32, < 1e-4), at
TP=1 and at TP=2 x PP=2, and whose export (export-hf) has them still. What the model cannot
express is refused, by config.json field, before anything is read or written."""
import json
import shutil

import pytest
import torch
from bad_inputs import refused
from distributed import run_distributed
from test_hf import TOKENIZER, engine_logits, probe_batch, train_items

from megatron_id.config import load_config
from megatron_id.hf.export import import_hf
from megatron_id.hf.llama import UnsupportedModelError, our_name

VOCAB = 50257   # the GPT-2 tokenizer of tests/data (the model's vocabulary holds every id of it)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
# one of each architecture, between them: multi-head and grouped-query attention (2 key/value
# heads: one per rank at TP=2), q/k/v biases, tied and untied embeddings, RoPE bases, epsilons,
# one file and shards named by model.safetensors.index.json
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(num_key_value_heads=4, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 50000.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "mistral-gqa": ("MistralConfig", "MistralForCausalLM",
                    dict(num_key_value_heads=2, sliding_window=None, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}
SHARDED = {"qwen2", "mistral-gqa"}
# besides (not in the slow matrix above): Qwen2 with grouped-query attention and its biases together
QWEN2_GQA = ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, rms_norm_eps=1e-6))


# RoPE scalings (model/rope.py), each on a tiny Llama with grouped-query attention, compared at
# 300 tokens past the context the scaling starts from (64): Llama 3.x's shape (llama3, tied,
# 2 key/value heads), and transformers' linear, yarn and dynamic
ORIGINAL = 64
SCALED = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=512,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": ORIGINAL})),
    "linear": ("LlamaConfig", "LlamaForCausalLM",
               dict(num_key_value_heads=2, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                             "factor": 4.0})),
    "yarn": ("Qwen2Config", "Qwen2ForCausalLM",
             dict(num_key_value_heads=2, max_position_embeddings=256,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": ORIGINAL})),
    "dynamic": ("LlamaConfig", "LlamaForCausalLM",
                dict(num_key_value_heads=2, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                              "factor": 2.0})),
}


def long_batch():
    """Token ids 300 past the scalings' original context."""
    return torch.randint(0, VOCAB, (2, ORIGINAL + 300), generator=torch.Generator().manual_seed(7))


def save_pretrained_model(folder, name: str, seed: int = 0):
    """A random tiny transformers model `name` (MODELS) saved with its tokenizer into `folder`;
    returns the model (eval mode). Weights N(0, 0.2), norms 1 + N(0, 0.2) and biases N(0, 0.2),
    so that logits spread far beyond the tolerance and no comparison rests on a zero or a one."""
    import transformers
    config_class, model_class, extra = (QWEN2_GQA if name == "qwen2-gqa" else
                                        SCALED.get(name) or WINDOWED.get(name) or MODELS[name])
    config = getattr(transformers, config_class)(**{**SHAPE, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, parameter in model.named_parameters():
            noise = 0.2 * torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + noise if pname.endswith("norm.weight") else noise)
    model.save_pretrained(folder, max_shard_size="5MB" if name in SHARDED else "1GB")
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>") \
        .save_pretrained(folder)
    return model


def hf_logits(model, batch=None):
    with torch.no_grad():
        return model(probe_batch() if batch is None else batch).logits


def our_logits(checkpoint, batch=None):
    """The training model's logits from a checkpoint at any layout (merged to TP=1)."""
    from megatron_id.checkpoint.read import read_checkpoint
    from megatron_id.model.language_model import LanguageModel
    _, _, cfg, state = read_checkpoint(checkpoint)
    model = LanguageModel(cfg, seed=None)
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(probe_batch() if batch is None else batch)


def export_logits(folder, batch=None):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, local_files_only=True)
    with torch.no_grad():
        return model.eval()(probe_batch() if batch is None else batch, use_cache=False).logits


def max_error(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """{name: (folder, the transformers model, its logits on the probe batch)}"""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for name in MODELS:
        model = save_pretrained_model(root / name, name)
        out[name] = root / name, model, hf_logits(model)
    return out


# ---------------------------------------------------------------- the logits are transformers'

@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_imported_logits_equal_transformers_and_survive_export(pretrained, tmp_path, name):
    from megatron_id.checkpoint.files import module_file, read_client_state
    from megatron_id.data.tokenizer import load_tokenizer, tokenizer_identity
    from megatron_id.hf.export import export_hf
    folder, model, want = pretrained[name]
    if name in SHARDED:
        assert (folder / "model.safetensors.index.json").is_file()
    ckpt = import_hf(folder, tmp_path / "ckpt")
    got = our_logits(ckpt)
    assert max_error(got, want) < 1e-4, (name, max_error(got, want))
    assert want.abs().max() > 1.0   # a comparison of something
    client = read_client_state(ckpt / "iter_0000000")
    cfg = client.model_config()
    config = model.config
    assert (cfg.mixer.value, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.ffn_hidden, cfg.vocab_size) == \
        ("softmax", 64, 2, 4, 96, VOCAB)
    assert cfg.n_kv_heads == (None if config.num_key_value_heads == 4 else config.num_key_value_heads)
    assert cfg.qkv_bias == (name == "qwen2") and cfg.tie_embeddings == config.tie_word_embeddings
    assert cfg.rope_theta == config.rope_parameters["rope_theta"] and cfg.norm_eps == config.rms_norm_eps
    assert cfg.seq_length == 64 and client.weights_only and client.step == 0
    # the checkpoint's own copy of the tokenizer shipped with the weights, and its identity,
    # recorded as for our own exports
    assert client.tokenizer == str(ckpt / "tokenizer" / "tokenizer.json")
    assert client.tokenizer_id == tokenizer_identity(load_tokenizer(str(TOKENIZER)))
    # vocabulary padding rows (50257 -> 50304 at TP=1) are zero, and every tensor is float32
    saved = torch.load(ckpt / "iter_0000000" / module_file(0), weights_only=True)["module"]
    assert saved["embed.weight"].shape[0] == 50304 and not saved["embed.weight"][VOCAB:].any()
    assert all(t.dtype == torch.float32 for t in saved.values())
    # exported back: the export's logits (transformers, the bundled code) are still transformers',
    # and its config.json names the key/value heads as transformers does
    exported = export_hf(ckpt, tmp_path / "hf")
    assert max_error(export_logits(exported), want) < 1e-4
    assert json.loads((exported / "config.json").read_text())["num_key_value_heads"] == config.num_key_value_heads


def test_a_gqa_qwen2_with_biases_round_trips(tmp_path):
    """Qwen2 with grouped-query attention and its q/k/v biases, imported at TP=2 (one key/value
    head per rank) and exported back: the export loads in transformers with the source's logits,
    and its config.json says num_key_value_heads for transformers' users (tools that size a KV
    cache from it), as the model section says model.n_kv_heads and model.qkv_bias."""
    from transformers import AutoConfig

    from megatron_id.checkpoint.files import read_client_state
    from megatron_id.hf.export import export_hf
    model = save_pretrained_model(tmp_path / "qwen2", "qwen2-gqa")
    want = hf_logits(model)
    ckpt = import_hf(tmp_path / "qwen2", tmp_path / "ckpt", tensor_parallel=2)
    cfg = read_client_state(ckpt / "iter_0000000").model_config()
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.qkv_bias) == (4, 2, True)
    assert max_error(our_logits(ckpt), want) < 1e-4
    exported = export_hf(ckpt, tmp_path / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["model"]["n_kv_heads"], config["model"]["qkv_bias"]) == (2, True)
    assert AutoConfig.from_pretrained(exported, trust_remote_code=True, local_files_only=True).num_key_value_heads == 2
    assert max_error(export_logits(exported), want) < 1e-4
    assert want.abs().max() > 1.0


def _logits_after_load(rank, world, items):
    """The engine's logits after train.load, the model given by `items` alone (no model file:
    the overrides import-hf prints are the differences from the schema's defaults)."""
    from megatron_id.training.engine import Trainer
    return engine_logits(Trainer(load_config([], items)))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_import_at_tp2_pp2_runs_in_the_trainer_with_transformers_logits(pretrained, fineweb_prefix, tmp_path,
                                                                         capsys, name):
    """The CLI writes TP=2 x PP=2; the trainer at that layout loads it (train.load) and its
    engine computes transformers' logits; the export of the 2 x 2 checkpoint too."""
    from megatron_id.cli import main
    from megatron_id.hf.export import export_hf
    folder, _, want = pretrained[name]
    ckpt = tmp_path / "ckpt"
    assert main(["import-hf", "--checkpoint", str(folder), "--output", str(ckpt), "--tensor-parallel", "2",
                 "--pipeline-parallel", "2"]) == 0
    said = capsys.readouterr().out
    names = {p.name for p in (ckpt / "iter_0000000").iterdir()}
    assert "layer_01-model_01-model_states.pt" in names, names   # the files of a PP run, TP rank 1
    # the model.* overrides the command prints give the trainer the imported model
    overrides = said.rsplit("and its model: ", 1)[1].strip().rstrip(")").split()
    assert "model.mixer=softmax" in overrides and "model.d_model=64" in overrides, said
    items = train_items(fineweb_prefix, 2, 2, "softmax") + overrides + [f"train.load={ckpt}"]
    results = run_distributed(_logits_after_load, 4, args=(items,), timeout=300)
    got = next(r for r in results if r is not None)
    assert max_error(got, want) < 1e-4, (name, max_error(got, want))
    assert max_error(our_logits(ckpt), want) < 1e-4
    assert max_error(export_logits(export_hf(ckpt, tmp_path / "hf")), want) < 1e-4


# ---------------------------------------------------------------- RoPE scaling (Llama 3.x)

@pytest.mark.parametrize("name", list(SCALED))
def test_scaled_rope_imports_with_transformers_logits_past_the_original_context(tmp_path, name):
    """A folder whose RoPE is scaled (Llama 3.x's llama3, and linear, yarn, dynamic) imports with
    model.rope_scaling, and its logits 300 tokens past the original context are transformers'.
    llama3 (tied, grouped-query attention) is exported back too: the export's logits are still
    transformers'."""
    from megatron_id.checkpoint.files import read_client_state
    from megatron_id.hf.export import export_hf
    model = save_pretrained_model(tmp_path / name, name)
    batch = long_batch()
    want = hf_logits(model, batch)
    ckpt = import_hf(tmp_path / name, tmp_path / "ckpt")
    cfg = read_client_state(ckpt / "iter_0000000").model_config()
    assert cfg.rope_scaling["rope_type"] == name and cfg.rope_scaling["factor"] == \
        model.config.rope_parameters["factor"]
    got = our_logits(ckpt, batch)
    assert max_error(got, want) < 1e-4, (name, max_error(got, want))
    # not plain RoPE: without the scaling the same weights give other logits past the original context
    plain = our_logits_with(ckpt, batch, rope_scaling=None)
    assert max_error(plain[:, ORIGINAL:], want[:, ORIGINAL:]) > 1e-2
    if name == "dynamic":   # a call within the original context is plain RoPE
        short = batch[:, :ORIGINAL]
        assert max_error(our_logits(ckpt, short), our_logits_with(ckpt, short, rope_scaling=None)) == 0
    if name == "llama3":
        assert cfg.tie_embeddings and cfg.n_kv_heads == 2
        assert max_error(export_logits(export_hf(ckpt, tmp_path / "hf"), batch), want) < 1e-4


def our_logits_with(checkpoint, batch, **model_changes):
    """our_logits with fields of the checkpoint's model config changed."""
    import dataclasses

    from megatron_id.checkpoint.read import read_checkpoint
    from megatron_id.model.language_model import LanguageModel
    _, _, cfg, state = read_checkpoint(checkpoint)
    model = LanguageModel(dataclasses.replace(cfg, **model_changes), seed=None)
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(batch)


def _logits_of_long_batch(rank, world, items):
    from megatron_id.training.engine import Trainer
    return engine_logits(Trainer(load_config([], items)), long_batch())


@pytest.mark.slow
def test_llama3_shaped_import_at_tp2_pp2_has_transformers_logits_past_the_original_context(
        fineweb_prefix, tmp_path, capsys):
    """Llama 3.x's shape (llama3 RoPE scaling, tied, grouped-query attention) written at TP=2 x PP=2
    by the CLI: the trainer at that layout, given the model by the overrides the command prints
    (model.rope_scaling among them, quoted for a shell), computes transformers' logits 300 tokens
    past the original context."""
    import shlex

    from megatron_id.cli import main
    model = save_pretrained_model(tmp_path / "llama3", "llama3")
    want = hf_logits(model, long_batch())
    ckpt = tmp_path / "ckpt"
    assert main(["import-hf", "--checkpoint", str(tmp_path / "llama3"), "--output", str(ckpt),
                 "--tensor-parallel", "2", "--pipeline-parallel", "2"]) == 0
    said = capsys.readouterr().out
    overrides = shlex.split(said.rsplit("and its model: ", 1)[1].strip().rstrip(")"))
    assert any(o.startswith("model.rope_scaling={") for o in overrides), said
    items = train_items(fineweb_prefix, 2, 2, "softmax") + overrides + [f"train.load={ckpt}"]
    results = run_distributed(_logits_of_long_batch, 4, args=(items,), timeout=300)
    got = next(r for r in results if r is not None)
    assert max_error(got, want) < 1e-4, max_error(got, want)


# ---------------------------------------------------------------- sliding windows

WINDOWED = {   # name: (config class, model class, fields); WINDOW_PATTERNS: the layer pattern it imports as
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=8)),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, use_sliding_window=True,
                                                             sliding_window=8, max_window_layers=1)),
}
WINDOW_PATTERNS = {"mistral-window": "WW", "qwen2-window": "AW"}


@pytest.mark.parametrize("name", list(WINDOWED))
def test_sliding_windows_import_as_w_layers_with_transformers_logits(tmp_path, name):
    """Mistral's sliding_window (every layer) and Qwen2's (use_sliding_window, from
    max_window_layers on) import as W layers of model.window tokens: transformers' logits over
    40 tokens, 5 windows of 8, and not those of full attention."""
    from megatron_id.checkpoint.files import read_client_state
    model = save_pretrained_model(tmp_path / name, name)
    assert model.config.sliding_window == 8
    batch = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    want = hf_logits(model, batch)
    ckpt = import_hf(tmp_path / name, tmp_path / "ckpt")
    cfg = read_client_state(ckpt / "iter_0000000").model_config()
    assert (cfg.layer_pattern, cfg.window) == (WINDOW_PATTERNS[name], 8)
    assert max_error(our_logits(ckpt, batch), want) < 1e-4
    full = our_logits_with(ckpt, batch, layer_pattern=None, window=None)
    assert max_error(full[:, :8], want[:, :8]) < 1e-4 and max_error(full, want) > 1e-2   # past the window


# ---------------------------------------------------------------- refused before any work

def write_config(folder, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "head_dim": 16, "tie_word_embeddings": False,
                "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
QWEN2 = {**{k: v for k, v in LLAMA_CONFIG.items() if k not in ("attention_bias", "mlp_bias", "head_dim")},
         "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False,
         "sliding_window": None, "max_window_layers": 28, "layer_types": ["full_attention"] * 2}
MISTRAL = {**QWEN2, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "head_dim": 16}
for _key in ("use_sliding_window", "max_window_layers", "layer_types"):
    MISTRAL.pop(_key)

REFUSED = {   # name: (config.json, the line's pattern)
    "rope_scaling": ({**LLAMA_CONFIG, "rope_parameters": None, "rope_theta": 10000.0,
                      "rope_scaling": {"type": "longrope", "factor": 2.0}},
                     r'rope_scaling.type="longrope" is not supported: RoPE here is plain or scaled by linear, '
                     r'dynamic, yarn, llama3'),
    "rope_parameters llama3": ({**LLAMA_CONFIG, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                                                     "factor": 8.0}},
                               r"rope_parameters makes an invalid RoPE scaling \(model.rope_scaling \(rope_type "
                               r"llama3\) lacks low_freq_factor, high_freq_factor"),
    "rope_parameters llama3 extra": ({**LLAMA_CONFIG, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "beta_fast": 32}}, r"rope_parameters.beta_fast=32 is not supported: llama3 scaling here reads factor, "),
    "layer_types": ({**QWEN2, "layer_types": ["full_attention", "chunked_attention"]},
                    r'layer_types=\["chunked_attention"\] is not supported: layers here are full_attention or '
                    r'sliding_attention'),
    "llama sliding": ({**LLAMA_CONFIG, "layer_types": ["full_attention", "sliding_attention"],
                       "sliding_window": 8}, r'layer_types=\["sliding_attention"\] is not supported: '
                                             r'LlamaForCausalLM has no sliding window'),
    "sliding_window": ({**MISTRAL, "sliding_window": 0}, r"sliding_window=0 is not supported: expected a positive"),
    "mlp_bias": ({**LLAMA_CONFIG, "mlp_bias": True}, r"mlp_bias=true is not supported: the SwiGLU here has no "
                 r"biases"),
    "hidden_act": ({**LLAMA_CONFIG, "hidden_act": "gelu"}, r'hidden_act="gelu" is not supported'),
    "head_dim": ({**LLAMA_CONFIG, "head_dim": 32}, r"head_dim=32 is not supported: heads here are hidden_size / "
                 r"num_attention_heads = 16 wide"),
    "attention_bias": ({**LLAMA_CONFIG, "attention_bias": True}, r"attention_bias=true is not supported: "
                       r"LlamaForCausalLM then has a bias on o_proj too"),
    "architecture": ({**LLAMA_CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
                     r"names architectures \['GPT2LMHeadModel'\]: import-hf reads exports of megatron-id and the "
                     r"transformers architectures LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"),
    "kv heads": ({**LLAMA_CONFIG, "num_key_value_heads": 3}, r"num_key_value_heads=3 is not supported: it must "
                 r"divide num_attention_heads=4"),
    # what AutoModel saves (issue 52): named as the decoder without its head
    "base model": ({**LLAMA_CONFIG, "architectures": ["LlamaModel"]}, r"names architectures \['LlamaModel'\]: .* "
                   r"\(LlamaModel is the decoder without its LM head, as AutoModel saves it: save the model with "
                   r"AutoModelForCausalLM instead\)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_model_cannot_express_is_refused_by_field(tmp_path, case):
    config, pattern = REFUSED[case]
    # no weights, no tokenizer: the refusal comes before either is looked at
    folder = write_config(tmp_path / "pretrained", config)
    with pytest.raises(UnsupportedModelError, match=pattern) as err:
        import_hf(folder, tmp_path / "out", tensor_parallel=2)
    assert "\n" not in str(err.value) and "nothing was written" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrained"]


def test_one_key_value_head_at_tp2_is_refused_naming_n_kv_heads(tmp_path):
    """A Llama with one key/value head (its 4 query heads and its SwiGLU do split by 2): the
    refusal names n_kv_heads=1, not the sizes that divide, before any weight is read."""
    from megatron_id.errors import UserError
    folder = write_config(tmp_path / "pretrained", {**LLAMA_CONFIG, "num_key_value_heads": 1})
    with pytest.raises(UserError) as err:
        import_hf(folder, tmp_path / "out", tensor_parallel=2)
    assert str(err.value).startswith(f"--tensor-parallel 2 cannot split the model of {folder}: model.n_kv_heads=1 "
                                     f"does not divide by 2 (model.n_heads=4, SwiGLU hidden size=96 do)")
    assert "Valid --tensor-parallel values for this model: 1." in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrained"]


@pytest.mark.parametrize("config", [LLAMA_CONFIG, QWEN2, MISTRAL], ids=["llama", "qwen2", "mistral"])
def test_accepted_configs_map_to_the_softmax_model(tmp_path, config):
    from megatron_id.hf.llama import transformers_model_config
    cfg = transformers_model_config(tmp_path, config)
    assert (cfg.mixer.value, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.ffn_hidden, cfg.seq_length) == \
        ("softmax", 64, 2, 4, 96, 64)
    assert cfg.qkv_bias == (config is QWEN2) and cfg.rope and cfg.n_kv_heads is None
    gqa = transformers_model_config(tmp_path, {**config, "num_key_value_heads": 2,
                                               "rope_parameters": None, "rope_theta": 5e5})
    assert gqa.n_kv_heads == 2 and gqa.rope_theta == 5e5


def test_tensor_names_map_to_the_training_model():
    assert our_name("model.embed_tokens.weight") == "embed.weight"
    assert our_name("model.layers.7.self_attn.k_proj.bias") == "layers.7.mixer.k_proj.bias"
    assert our_name("model.layers.0.mlp.gate_proj.weight") == "layers.0.ffn.w1.weight"
    assert our_name("model.layers.0.mlp.up_proj.weight") == "layers.0.ffn.w3.weight"
    assert our_name("model.layers.0.mlp.down_proj.weight") == "layers.0.ffn.w2.weight"
    assert our_name("model.layers.1.post_attention_layernorm.weight") == "layers.1.ffn_norm.weight"
    assert our_name("model.layers.1.input_layernorm.weight") == "layers.1.mixer_norm.weight"
    assert our_name("model.norm.weight") == "norm.weight" and our_name("lm_head.weight") == "lm_head.weight"
    assert our_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


@pytest.mark.slow
def test_weights_that_do_not_match_are_named_before_writing(pretrained, tmp_path):
    """A shard named by the index but missing, a tensor of another shape, a folder of pickled
    weights only, no tokenizer.json: one line each, exit 2, nothing written (the CLI, as a
    user runs it)."""
    source = pretrained["mistral-gqa"][0]
    missing = shutil.copytree(source, tmp_path / "missing")
    shard = json.loads((missing / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    (missing / shard).unlink()
    refused(["megatron_id.cli", "import-hf", "--checkpoint", missing, "--output", tmp_path / "a"],
            mention=rf"{shard} is missing \(model.safetensors.index.json names it\)", unchanged=[tmp_path])
    wrong = shutil.copytree(source, tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    done = refused(["megatron_id.cli", "import-hf", "--checkpoint", wrong, "--output", tmp_path / "b"],
                   mention=r"model.layers.0.mlp.gate_proj.weight has shape \[96, 64\], config.json says \[128, 64\]",
                   unchanged=[tmp_path])
    assert done.returncode == 2
    pickled = write_config(tmp_path / "pickled", LLAMA_CONFIG)
    (pickled / "pytorch_model.bin").write_bytes(b"x")
    shutil.copy(source / "tokenizer.json", pickled / "tokenizer.json")
    refused(["megatron_id.cli", "import-hf", "--checkpoint", pickled, "--output", tmp_path / "c"],
            mention=r"has neither model.safetensors nor model.safetensors.index.json \(it has pytorch_model.bin: "
                    r"pickled weights are not read\)", unchanged=[tmp_path])
    untokenized = shutil.copytree(source, tmp_path / "untokenized")
    (untokenized / "tokenizer.json").unlink()
    refused(["megatron_id.cli", "import-hf", "--checkpoint", untokenized, "--output", tmp_path / "e"],
            mention=r"untokenized has no tokenizer.json \(the fast tokenizer file transformers writes\)",
            unchanged=[tmp_path])
    # and a refusal by config field, through the CLI: exit 2, one line
    bad = write_config(tmp_path / "scaled", REFUSED["rope_scaling"][0])
    done = refused(["megatron_id.cli", "import-hf", "--checkpoint", bad, "--output", tmp_path / "d"],
                   mention=REFUSED["rope_scaling"][1], unchanged=[tmp_path])
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_a_pretrained_folder_given_where_an_export_is_wanted_names_import_hf(tmp_path):
    from megatron_id.hf.export import NotAnExportError, read_export_config
    folder = write_config(tmp_path / "pretrained", QWEN2)
    with pytest.raises(NotAnExportError, match=r"has model_type 'qwen2', not 'megatron_id'.*It is a pretrained "
                       r"Qwen2ForCausalLM folder: megatron-id import-hf reads it into a training checkpoint"):
        read_export_config(folder)


# ---------------------------------------------------------------- self-contained: the tokenizer copied

def _train_into(rank, world, items):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([], items))
    try:
        return trainer.train()
    finally:
        trainer.close()


def test_the_import_keeps_its_tokenizer_and_outlives_its_source(fineweb_prefix, tmp_path, capsys):
    """import-hf copies the tokenizer into the checkpoint (output/tokenizer/) and records the copy:
    with the source folder deleted, export-hf ships the same tokenizer, the trainer continues the
    import in its own folder (train.load = train.save, pruning iter_0000000 away) on data.tokenizer
    = the copy, and the run's checkpoint exports too. --overwrite replaces an earlier import (its
    tokenizer folder included); a tokenizer folder holding anything else is not an import's."""
    import transformers

    from megatron_id.checkpoint.files import read_client_state
    from megatron_id.cli import main
    from megatron_id.commands.import_hf import model_overrides
    from megatron_id.data.tokenizer import identity_of_file
    from megatron_id.errors import OutputExistsError
    from megatron_id.hf.export import TOKENIZER_FILES, export_hf, why_not_an_import
    source = tmp_path / "pretrained"
    save_pretrained_model(source, "llama")
    shipped = sorted(name for name in TOKENIZER_FILES if (source / name).is_file())
    assert "tokenizer.json" in shipped and "tokenizer_config.json" in shipped, shipped
    identity = identity_of_file(TOKENIZER)
    ckpt = import_hf(source, tmp_path / "ckpt")
    copied = ckpt / "tokenizer"
    assert sorted(p.name for p in copied.iterdir()) == shipped
    assert all((copied / name).read_bytes() == (source / name).read_bytes() for name in shipped)
    client = read_client_state(ckpt / "iter_0000000")
    assert (client.tokenizer, client.tokenizer_id) == (str(copied / "tokenizer.json"), identity)
    # an earlier import with its tokenizer folder: replaced with --overwrite only
    with pytest.raises(OutputExistsError, match=r"already holds an earlier import"):
        import_hf(source, ckpt)
    assert main(["import-hf", "--checkpoint", str(source), "--output", str(ckpt), "--overwrite"]) == 0
    assert f"train with train.load={ckpt} data.tokenizer={copied / 'tokenizer.json'} " in capsys.readouterr().out
    assert why_not_an_import(ckpt) is None
    (copied / "notes.txt").write_text("mine")
    assert why_not_an_import(ckpt) == f"{copied} holds notes.txt, which import-hf does not write"
    (copied / "notes.txt").unlink()
    overrides = model_overrides(ckpt).split()
    shutil.rmtree(source)
    # export-hf finds the tokenizer by the checkpoint's record: the same one ships
    exported = export_hf(ckpt, tmp_path / "hf")
    assert (exported / "tokenizer.json").read_bytes() == (copied / "tokenizer.json").read_bytes()
    assert json.loads((exported / "config.json").read_text())["megatron_id_tokenizer_id"] == identity
    # the copy is a tokenizer folder transformers loads, with the source's settings
    text = "The water cycle"
    assert transformers.AutoTokenizer.from_pretrained(copied)(text)["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(exported)(text)["input_ids"]
    # the trainer continues the import in its own folder, on data tokenized with the copy
    items = train_items(fineweb_prefix, 1, 1, "softmax") + overrides + [
        f"train.load={ckpt}", f"train.save={ckpt}", f"data.tokenizer={copied / 'tokenizer.json'}",
        "train.save_interval=1", "train.keep_last=1"]
    losses = run_distributed(_train_into, 1, args=(items,), timeout=300)[0]
    assert len(losses) == 2
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == \
        ["iter_0000002", "latest", "tokenizer"]   # iter_0000000 pruned, the tokenizer kept
    assert read_client_state(ckpt / "iter_0000002").tokenizer == str(copied / "tokenizer.json")
    again = export_hf(ckpt, tmp_path / "hf2")
    assert (again / "tokenizer.json").read_bytes() == (copied / "tokenizer.json").read_bytes()
