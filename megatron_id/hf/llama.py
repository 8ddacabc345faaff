"""Pretrained Llama-architecture transformers folders -> the softmax mixer's model (import-hf).

A folder saved by transformers (`save_pretrained`) whose config.json names LlamaForCausalLM,
Qwen2ForCausalLM or MistralForCausalLM is the decoder of model/language_model.py with
model.mixer=softmax: RoPE in the half-split layout (model/layers.py apply_rope, HF's
rotate_half), SwiGLU, RMSNorm in float32, grouped-query attention (model.n_kv_heads) and
Qwen2's q/k/v biases (model.qkv_bias). `transformers_model_config` maps config.json to a
ModelConfig (RoPE scaled as Llama 3.x's llama3, linear, dynamic or yarn: model.rope_scaling) and
reads sliding windows as W layers (model.layer_pattern, model.window), and refuses, naming the
config.json field, what this model cannot express (another RoPE scaling, MLP or
output-projection biases, another activation or head width),
before any weight is read. `TransformersWeights` reads the safetensors files (model.safetensors,
else the shards model.safetensors.index.json names: transformers' order) memory-mapped, and
gives each TP rank of the checkpoint to write only its own rows or columns, one rank at a time,
in float32. Every tensor of those files is read or named in a refusal with the config.json
field that disagrees (`sources`): a tensor left out would make a model whose logits are not the
source's.

Name mapping (HF -> ours):
    model.embed_tokens.weight                       embed.weight
    model.layers.{i}.input_layernorm.weight         layers.{i}.mixer_norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.*     layers.{i}.mixer.{q,k,v,o}_proj.*
    model.layers.{i}.post_attention_layernorm.weight  layers.{i}.ffn_norm.weight
    model.layers.{i}.mlp.gate_proj / up_proj / down_proj .weight   layers.{i}.ffn.w1 / w3 / w2 .weight
    model.norm.weight                               norm.weight
    lm_head.weight                                  lm_head.weight (the embedding when tied)
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from omegaconf.errors import OmegaConfBaseException
from safetensors import SafetensorError, safe_open

from ..checkpoint.files import model_config_from_dict
from ..checkpoint.read import local_slice
from ..config import Config, ConfigError, resolve
from ..errors import UserError
from ..model.language_model import LanguageModel
from ..model.rope import SCALINGS, RopeScalingError, check_scaling
from ..model.spec import ModelConfig
from ..parallel.tensor_parallel import Split, padded_vocab_size, parameter_role

# config.json `architectures` -> its model_type; what import-hf reads besides our own exports
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
OURS = "MegatronIDForCausalLM"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IN_LAYER = {"input_layernorm.weight": "mixer_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate_proj.weight": "ffn.w1.weight", "mlp.up_proj.weight": "ffn.w3.weight",
             "mlp.down_proj.weight": "ffn.w2.weight"}
_TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight"}
# buffers older transformers versions saved beside the weights: not parameters, recomputed here
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


class UnsupportedModelError(UserError, ValueError):
    """A transformers folder whose model this project cannot express, or a damaged one."""


def transformers_config(folder: Path) -> dict | None:
    """folder/config.json when it is a transformers model's config (not one of our exports),
    else None (missing, unreadable or ours: the export reader says what is wrong with it)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(config, dict) or config.get("model_type") == "megatron_id" or \
            OURS in (config.get("architectures") or []) or isinstance(config.get("model"), dict):
        return None   # ours (perhaps damaged: read_export_config names how)
    return config


def _accepted() -> str:
    return ", ".join(ARCHITECTURES)


def architecture(config: dict, path: Path) -> str:
    """The one accepted architecture config.json names (by `architectures`, else `model_type`)."""
    named = config.get("architectures") or []
    if not isinstance(named, list):
        named = [named]
    found = [a for a in named if a in ARCHITECTURES]
    if not named:
        by_type = {t: a for a, t in ARCHITECTURES.items()}
        if config.get("model_type") in by_type:
            return by_type[config["model_type"]]
    if len(found) == 1:
        return found[0]
    what = f"architectures {named}" if named else f"model_type {config.get('model_type')!r} and no architectures"
    # LlamaModel & co: what AutoModel saves, the decoder without its LM head
    headless = [a for a in named if isinstance(a, str) and a.removesuffix("Model") + "ForCausalLM" in ARCHITECTURES]
    hint = (f" ({headless[0]} is the decoder without its LM head, as AutoModel saves it: save the model with "
            f"AutoModelForCausalLM instead)") if headless else ""
    raise UnsupportedModelError(f"{path} names {what}: import-hf reads exports of megatron-id and the "
                                f"transformers architectures {_accepted()} (Llama-style decoders){hint}; nothing "
                                f"was written.")


def transformers_model_config(folder: Path, config: dict) -> ModelConfig:
    """config.json of a LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM folder -> the
    softmax model's ModelConfig. Anything the model cannot express is refused with the field
    named (UnsupportedModelError), before any weight is read.

    max_position_embeddings becomes model.seq_length [our choice]: the context the model was
    trained at is where continued training and lm-evaluation-harness windows start."""
    path = Path(folder) / "config.json"
    arch = architecture(config, path)
    kind = ARCHITECTURES[arch]
    nothing = "nothing was written"

    def refuse(field: str, value, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{path}: {field}={json.dumps(value)} is not supported: {why}; {nothing}.")

    def need(field: str, kind_=int):
        value = config.get(field)
        if not isinstance(value, kind_) or isinstance(value, bool) or value <= 0:
            raise UnsupportedModelError(f"{path}: {field} is {json.dumps(value)}, expected a positive number "
                                        f"({arch}'s config.json has one); {nothing}.")
        return value

    d, heads, layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    vocab, ffn = need("vocab_size"), need("intermediate_size")
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):   # one function (transformers' ACT2FN)
        raise refuse("hidden_act", act, "the MLP here is SwiGLU, silu(gate_proj x) * up_proj x")
    if config.get("mlp_bias"):
        raise refuse("mlp_bias", config["mlp_bias"], "the SwiGLU here has no biases")
    if d % heads:
        raise refuse("hidden_size", d, f"it is not a multiple of num_attention_heads={heads}")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != d // heads:
        raise refuse("head_dim", head_dim, f"heads here are hidden_size / num_attention_heads = {d // heads} wide")
    # RoPE: rope_theta (transformers 4) or rope_parameters (5), with a scaling (model/rope.py)
    # as transformers computes it: llama3 (Llama 3.1-3.3), linear, dynamic, yarn
    theta, scaling = config.get("rope_theta", 10000.0), None
    for field in ("rope_scaling", "rope_parameters"):
        rope = config.get(field)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise refuse(field, rope, "expected an object")
        key = "rope_type" if "rope_type" in rope or "type" not in rope else "type"   # (4.x wrote `type`)
        rope_type = rope.get(key, "default")
        if rope_type != "default" and rope_type not in SCALINGS:
            raise refuse(f"{field}.{key}", rope_type, f"RoPE here is plain or scaled by {', '.join(SCALINGS)} "
                         "(as transformers computes them)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise refuse(f"{field}.partial_rotary_factor", rope["partial_rotary_factor"],
                         "RoPE here turns every dimension of a head")
        theta = rope.get("rope_theta", theta)
        if rope_type == "default":
            continue
        required, optional = SCALINGS[rope_type]
        extra = sorted(set(rope) - set(required) - set(optional) - {"rope_type", "type", "rope_theta",
                                                                   "partial_rotary_factor"})
        if extra:
            raise refuse(f"{field}.{extra[0]}", rope[extra[0]], f"{rope_type} scaling here reads "
                         f"{', '.join(required + tuple(optional))}")
        scaling = {"rope_type": rope_type, **{k: rope[k] for k in (*required, *optional) if k in rope}}
        # the context the scaling starts from, where transformers takes it: dynamic from
        # max_position_embeddings; llama3 and yarn from a top-level original_max_position_embeddings
        # (Phi-3's place), else their own, else max_position_embeddings
        top = config.get("max_position_embeddings")
        if rope_type == "dynamic":
            scaling["original_max_position_embeddings"] = top
        elif rope_type in ("llama3", "yarn"):
            scaling["original_max_position_embeddings"] = config.get(
                "original_max_position_embeddings", scaling.get("original_max_position_embeddings", top))
        original = scaling.get("original_max_position_embeddings")
        if rope_type == "yarn" and scaling.get("factor") is None and top and original:
            scaling["factor"] = top / original
        try:
            check_scaling(scaling)
        except RopeScalingError as err:
            raise UnsupportedModelError(f"{path}: {field} makes an invalid RoPE scaling ({err}); {nothing}.") from None
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("partial_rotary_factor", config["partial_rotary_factor"], "RoPE here turns every dimension")
    # sliding windows, as transformers reads them: Mistral's sliding_window on every layer; Qwen2's
    # sliding_window where use_sliding_window is set, on the layers layer_types names
    # sliding_attention (by default those from max_window_layers on). Those layers become W
    # layers (model.layer_pattern) whose query sees model.window tokens, itself included, as
    # transformers' mask (kv > q - sliding_window)
    window = config.get("sliding_window")
    if kind == "qwen2" and not config.get("use_sliding_window"):
        window = None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise refuse("sliding_window", window, "expected a positive number of tokens")
    types = config.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != layers):
        raise refuse("layer_types", types, f"expected one entry per layer (num_hidden_layers={layers})")
    if kind == "mistral":
        types = ["full_attention" if window is None else "sliding_attention"] * layers
    elif types is None:
        start = config.get("max_window_layers", layers) if kind == "qwen2" else layers
        types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                 for i in range(layers)]
    other = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if other:
        raise refuse("layer_types", other, "layers here are full_attention or sliding_attention")
    if kind == "llama" and "sliding_attention" in types:
        raise refuse("layer_types", ["sliding_attention"], f"{arch} has no sliding window (transformers' Llama "
                     "attends to every earlier token)")
    # a sliding_attention layer without a window (use_sliding_window false) attends to everything
    pattern = "".join("W" if t == "sliding_attention" and window is not None else "A" for t in types)
    # biases: Qwen2's q, k and v always; Llama's attention_bias puts one on o_proj too
    # (Mistral's attention has no biases whatever the field says)
    qkv_bias = kind == "qwen2"
    if kind == "llama" and config.get("attention_bias"):
        raise refuse("attention_bias", True, f"{arch} then has a bias on o_proj too, and the output projection "
                     "here has none")
    kv = config.get("num_key_value_heads") or heads
    if not isinstance(kv, int) or kv < 1 or heads % kv:
        raise refuse("num_key_value_heads", kv, f"it must divide num_attention_heads={heads}")
    values = dict(mixer="softmax", vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn,
                  seq_length=config.get("max_position_embeddings") or ModelConfig.seq_length,
                  norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(theta), rope=True,
                  rope_scaling=scaling,
                  tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    std = config.get("initializer_range")
    if isinstance(std, (int, float)) and not isinstance(std, bool) and std > 0:
        values["init_std"] = float(std)   # how new parameters would start; the imported ones are read
    if kv != heads:
        values["n_kv_heads"] = kv   # grouped-query attention
    if "W" in pattern:
        values.update(layer_pattern=pattern, window=window)
    if qkv_bias:
        values["qkv_bias"] = True
    try:
        cfg = model_config_from_dict(values)
        resolve(Config(model=cfg))
    except (ConfigError, ValueError, TypeError, OmegaConfBaseException) as err:
        raise UnsupportedModelError(f"{path} makes an invalid model config ({' '.join(str(err).split())}); "
                                    f"{nothing}.") from None
    return cfg


def our_name(hf_name: str) -> str | None:
    """The LanguageModel state-dict name of a transformers tensor (None: not one of ours)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    match = _LAYER.match(hf_name)
    if match is None:
        return None
    index, rest = match.groups()
    if rest in _IN_LAYER:
        return f"layers.{index}.{_IN_LAYER[rest]}"
    attention = re.fullmatch(r"self_attn\.([qkvo])_proj\.(weight|bias)", rest)
    if attention:
        return f"layers.{index}.mixer.{attention[1]}_proj.{attention[2]}"
    return None


class TransformersWeights:
    """The safetensors files of a transformers folder, memory-mapped: their headers are read at
    construction (shapes, which file holds which tensor), a tensor's bytes only when a rank's
    slice of it is taken."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        fix = "save the model again with transformers' save_pretrained (safetensors)"
        again = "download it again (or copy it from the model's hub page)"
        index = self.folder / INDEX
        if (self.folder / SINGLE).is_file():
            # what transformers' from_pretrained reads when it is there, whatever else is: an
            # index beside it is of another save, and its shards are not the model
            files = None
            if index.is_file():
                print(f"note: {self.folder} holds both {SINGLE} and {INDEX} (two saves): {SINGLE} is read, as "
                      f"transformers' from_pretrained reads it; remove the files of the other save to silence "
                      f"this.", file=sys.stderr, flush=True)
        elif index.is_file():
            try:
                files = json.loads(index.read_text())["weight_map"]
                files = {str(k): str(v) for k, v in files.items()}
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
                raise UnsupportedModelError(f"{index} is not a safetensors index (no weight_map): {again}; nothing "
                                            f"was written.") from None
        else:
            shards = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if shards:   # shards without the index that says which tensor each holds
                raise UnsupportedModelError(f"{self.folder} has {', '.join(shards[:3])} but no {INDEX}, which names "
                                            f"the tensors each shard holds: copy {INDEX} from the model's hub page "
                                            f"into {self.folder}; nothing was written.")
            others = sorted(p.name for p in self.folder.glob("*.bin")) + sorted(p.name for p in
                                                                               self.folder.glob("*.pth"))
            also = f" (it has {', '.join(others[:3])}: pickled weights are not read)" if others else ""
            raise UnsupportedModelError(f"{self.folder} has neither {SINGLE} nor {INDEX}{also}: {fix}; nothing "
                                        f"was written.")
        self.handles, self.where, stray = {}, {}, []
        names = sorted(set(files.values())) if files is not None else [SINGLE]
        for name in names:
            path = self.folder / name
            if not path.is_file():
                raise UnsupportedModelError(f"{path} is missing ({INDEX} names it): the folder is incomplete; "
                                            f"{again}; nothing was written.")
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise UnsupportedModelError(f"{path} is damaged ({err}): it was truncated or overwritten; {again}; "
                                            f"nothing was written.") from None
            self.handles[name] = handle
            for key in handle.keys():
                if files is None or files.get(key) == name:
                    self.where[key] = name
                else:   # a tensor the index does not read from here: never silently left out
                    stray.append((name, key))
        if files is not None:
            lost = sorted(set(files) - set(self.where))
            if lost:
                raise UnsupportedModelError(f"{INDEX} names {lost[0]} in {files[lost[0]]}, which does not hold it: "
                                            f"the folder is damaged; {again}; nothing was written.")
            if stray:
                name, key = stray[0]
                more = f" (+{len(stray) - 1} more)" if len(stray) > 1 else ""
                elsewhere = f"names it in {files[key]}" if key in files else "does not name it"
                raise UnsupportedModelError(f"{name} holds {key}{more}, but {INDEX} {elsewhere}: the index and the "
                                            f"shards are of different saves; download them again (or copy them from "
                                            f"the model's hub page); nothing was written.")

    def shape(self, key: str) -> tuple:
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())

    def sources(self, cfg: ModelConfig) -> dict:
        """{our name: the transformers tensor it is read from}, every name and shape checked
        against the model `cfg` builds (read from the headers: no weight is read, but for a
        tied model whose folder holds a head of its own, compared with the embedding).

        Every tensor of the folder is either read or named in a refusal: a tensor this model
        has a place for in general but the configured one lacks (q/k/v biases under a config
        without them, o_proj biases, layers beyond num_hidden_layers, a head config.json ties
        away) means config.json describes another model than the weights; dropping it would
        import a model whose logits are not the source's."""
        with torch.device("meta"):   # shapes only, no memory
            expected = {k: tuple(v.shape) for k, v in LanguageModel(cfg, seed=None).state_dict().items()}
        sources, unknown, unheld, head = {}, [], [], None
        for key in self.where:
            name = our_name(key)
            if name is None:
                if not _IGNORED.match(key):
                    unknown.append(key)
            elif name == "lm_head.weight" and cfg.tie_embeddings:
                head = key   # tied: read only when it is a copy of the embedding (below)
            elif name not in expected:
                unheld.append(key)
            else:
                sources[name] = key
        if unheld:
            raise self._unheld_error(unheld, cfg)
        if cfg.tie_embeddings and "embed.weight" in sources:
            if head is not None and not self._same(head, sources["embed.weight"]):
                raise UnsupportedModelError(
                    f"{self._config_path()} says tie_word_embeddings=true, but {self.where[head]} holds {head}, which "
                    f"differs from {sources['embed.weight']} (transformers then leaves the head untied): set "
                    f"tie_word_embeddings to false in config.json; nothing was written.")
            sources["lm_head.weight"] = sources["embed.weight"]
        held = {int(_LAYER.match(k)[1]) for k in self.where if _LAYER.match(k)}
        absent = {int(name.split(".")[1]) for name in set(expected) - set(sources) if name.startswith("layers.")}
        if held and absent and min(absent) == max(held) + 1 == len(held):   # whole layers at the end
            raise UnsupportedModelError(
                f"{self._config_path()} says num_hidden_layers={cfg.n_layers}, but the weights of {self.folder} hold "
                f"{len(held)} layers (no model.layers.{min(absent)}.*): fix num_hidden_layers in config.json, or "
                f"the folder lacks a file; nothing was written.")
        where = f"the weights of {self.folder}"
        fix = "it is not the model its config.json describes; nothing was written"
        problems = [f"{k} has no counterpart here" for k in unknown]
        problems += [f"{self._hf_name(k)} is missing" for k in sorted(set(expected) - set(sources))]
        problems += [f"{sources[k]} has shape {list(self.shape(sources[k]))}, config.json says {list(shape)}"
                     for k, shape in expected.items() if k in sources and self.shape(sources[k]) != shape]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise UnsupportedModelError(f"{where} do not match this model: {'; '.join(problems[:3])}{more}: {fix}.")
        return {k: sources[k] for k in expected}   # the model's order

    def _config_path(self) -> Path:
        return self.folder / "config.json"

    def _same(self, a: str, b: str, rows: int = 4096) -> bool:
        """Whether tensors `a` and `b` hold the same values (read `rows` rows at a time)."""
        if self.shape(a) != self.shape(b):
            return False
        first, second = self.handles[self.where[a]].get_slice(a), self.handles[self.where[b]].get_slice(b)
        return all(torch.equal(first[i:i + rows], second[i:i + rows]) for i in range(0, self.shape(a)[0], rows))

    def _unheld_error(self, keys: list[str], cfg: ModelConfig) -> UnsupportedModelError:
        """The refusal of tensors the configured model has no place for: which ones, the
        config.json field that disagrees with them, and what the weights then are."""
        def order(key):   # layer 2 before layer 10; q, k, v, o as a model lists them
            match = _LAYER.match(key)
            if match is None:
                return -1, 0, key
            projection = re.search(r"([qkvo])_proj", match[2])
            return int(match[1]), "qkvo".index(projection[1]) if projection else 4, match[2]
        keys = sorted(keys, key=order)
        config = transformers_config(self.folder) or {}
        try:
            arch = architecture(config, self._config_path())
        except UnsupportedModelError:
            arch = "its architecture"

        def named(group: list[str]) -> str:
            more = f" (+{len(group) - 1} more)" if len(group) > 1 else ""
            return f"{self.where[group[0]]} holds {group[0]}{more}"
        said = f"{self._config_path()} says"
        nothing = "nothing was written"
        layers = [k for k in keys if _LAYER.match(k) and int(_LAYER.match(k)[1]) >= cfg.n_layers]
        if layers:
            top = max(int(_LAYER.match(k)[1]) for k in layers)
            span = f"layer {top}" if top == cfg.n_layers else f"layers {cfg.n_layers} to {top}"
            return UnsupportedModelError(
                f"{said} num_hidden_layers={cfg.n_layers}, but {named(layers)} ({span}): the folder holds {top + 1} "
                f"layers; fix num_hidden_layers in config.json; {nothing}.")
        out = [k for k in keys if k.endswith("self_attn.o_proj.bias")]
        qkv = [k for k in keys if re.search(r"self_attn\.[qkv]_proj\.bias$", k)]
        if out:   # named first: the bias that no configuration here can hold
            return UnsupportedModelError(
                f"{said} {arch}, but {named(out + qkv)}: biases on o_proj are those of a Llama with "
                f"attention_bias=true, which this import does not read (the output projection here has no bias); "
                f"{nothing}.")
        if qkv:
            field = {"LlamaForCausalLM": " without attention_bias",
                     "MistralForCausalLM": " (its attention has no biases)"}.get(arch, "")
            return UnsupportedModelError(
                f"{said} {arch}{field}, but {named(qkv)}: the weights are of another architecture (Qwen2?); if so, "
                f"set architectures to [\"Qwen2ForCausalLM\"] and model_type to \"qwen2\" in config.json; "
                f"{nothing}.")
        return UnsupportedModelError(f"{said} a model without {keys[0]}, but {named(keys)}: config.json does not "
                                     f"describe these weights; fix it; {nothing}.")

    @staticmethod
    def _hf_name(name: str) -> str:
        """Our state-dict name -> the transformers name it is read from (for messages)."""
        top = {ours: hf for hf, ours in _TOP.items()}
        if name in top:
            return top[name]
        index, rest = name.split(".", 2)[1:]
        in_layer = {ours: hf for hf, ours in _IN_LAYER.items()}
        return f"model.layers.{index}." + (in_layer.get(rest) or "self_attn." + rest.removeprefix("mixer."))

    def local_shard(self, sources: dict, cfg: ModelConfig, tp: int, rank: int) -> dict:
        """TP rank `rank`'s state dict at TP=`tp` (vocabulary padded with zero rows), float32:
        only the rows or columns it keeps are read from the files. A tied head is the
        embedding's tensor (saved once)."""
        shard = {}
        for name, key in sources.items():
            if name == "lm_head.weight" and cfg.tie_embeddings:
                shard[name] = shard["embed.weight"]
                continue
            piece = self.handles[self.where[key]].get_slice(key)
            tensor = local_slice(name, cfg, tp, rank, [(self.shape(key), piece.__getitem__)])
            shard[name] = tensor.to(torch.float32)
        return shard

    def nbytes(self, sources: dict, cfg: ModelConfig, tp: int) -> int:
        """About the bytes of the float32 checkpoint at TP=`tp` (vocabulary padding included)."""
        total = 0
        for name, key in sources.items():
            if name == "lm_head.weight" and cfg.tie_embeddings:
                continue
            shape = list(self.shape(key))
            if parameter_role(name, cfg).split is Split.VOCAB:
                shape[0] = padded_vocab_size(cfg, tp)
            count = 1
            for n in shape:
                count *= n
            total += 4 * count
        return total
