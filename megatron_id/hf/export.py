"""Training checkpoints <-> Hugging Face folders.

export_hf: any checkpoint (any TP/PP/ZeRO layout, any mixer) -> a folder that
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` and `AutoTokenizer` load
offline: config.json (with auto_map), configuration_megatron_id.py, modeling_megatron_id.py,
megatron_id_model.py (the training model code, bundled), model.safetensors (TP=1, vocabulary
padding removed, keys `model.<training name>`), the tokenizer files and generation_config.json.

import_hf: such a folder -> a training checkpoint at any TP/PP, holding weights only (the
trainer loads it at any layout and starts the optimizer fresh). It also reads a pretrained
transformers folder of a Llama-style architecture (LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM) as the softmax model: hf/llama.py maps its config and reads its weights.
The import is self-contained: it keeps a copy of the source's tokenizer in `output/tokenizer/`
(IMPORT_TOKENIZER) and records that copy's path and identity, so the source may be deleted.

Outputs are never destroyed by mistake. A new or empty `output` is written. A non-empty one is
refused, unless `overwrite` is given and it holds only an earlier output of the same command
(`why_not_an_export` / `why_not_an_import` say what else it holds); a checkpoint with a
training history or a folder of the user's files is never replaced. The new folder is built
beside `output` and swapped in by renames (`write_folder`), so an error at any point leaves the
old output as it was and no partial folder behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path

import torch
from omegaconf.errors import OmegaConfBaseException

from ..checkpoint.files import (
    CLIENT_STATE,
    ClientState,
    model_config_dict,
    model_config_from_dict,
    read_client_state,
    save_safetensors,
    tag_for,
)
from ..checkpoint.integrity import (
    CHUNK_BYTES,
    MANIFEST,
    checkpoint_files,
    manifest_entries,
    read_manifest,
    verify_folder_files,
    warn_unverified,
    write_manifest,
)
from ..checkpoint.read import ModelState, checkpoint_folder, write_weights_only
from ..data.indexed_dataset import _pid_alive
from ..data.tokenizer import chat_template_of, check_tokenizer_for_model, eod_id, find_tokenizer, load_tokenizer
from ..errors import (
    BadOptionError,
    OutputExistsError,
    UserError,
    check_writable,
    disk_full_error,
    free_bytes,
    human_bytes,
    is_disk_full,
    refuse_output_inside,
)
from ..model.language_model import LanguageModel
from ..model.spec import ffn_hidden_size, kv_heads
from ..parallel.layout import LayoutError, check_model_split
from ..parallel.tensor_parallel import split_state_dict
from ..vllm_plugin.limits import vllm_warnings
from .bundle import bundle_source
from .llama import (
    ARCHITECTURES,
    TransformersWeights,
    UnsupportedModelError,
    transformers_config,
    transformers_model_config,
)

HERE = Path(__file__).resolve().parent
CODE_FILES = ("configuration_megatron_id.py", "modeling_megatron_id.py")
# every file export_hf writes: a folder holding nothing else is an earlier export
EXPORT_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                          "tokenizer_config.json", "megatron_id_model.py", MANIFEST, *CODE_FILES})
# how an export's files are checked against its manifest.json when read (--verify): "sample" the
# sizes of every file, small files whole and VERIFY_SAMPLED_CHUNKS chunks of each large one;
# "full" every byte
VERIFY_MODES = ("sample", "full")
VERIFY_SAMPLED_CHUNKS = 16
IMPORT_TAG = tag_for(0)   # import_hf writes step 0 only
# import_hf's copy of the tokenizer the weights go with, recorded in the checkpoint (path and
# identity), so that the import is self-contained: training, export-hf, generate and eval find it
# after the source folder is deleted. It sits in the checkpoint root beside `latest` and
# iter_0000000 [our choice], not inside iter_0000000: a run that trains on in this folder
# (train.load = train.save) prunes old iter_ folders (train.keep_last) and its step-0 save
# (train.extra_save_steps=[0]) replaces iter_0000000, while no run touches other entries of its
# train.save (data.tokenizer may name the copy: the checkpoints of such a run record it).
IMPORT_TOKENIZER = "tokenizer"
# what is copied: tokenizer.json, the file this project reads (data/tokenizer.py), required; and
# those of transformers' tokenizer files that the source has [our choice: copied too]: they hold
# what tokenizer.json does not (the BOS / EOS / pad names, add_bos_token, the chat template), so
# `output/tokenizer` is a folder AutoTokenizer.from_pretrained loads with the source's settings,
# and nothing of the tokenizer is lost with the source. Slow-tokenizer files (vocab.json,
# merges.txt, tokenizer.model) are not: tokenizer.json, which import-hf requires, holds them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class NotAnExportError(UserError, ValueError):
    """A folder that should be an export of ours and is not (or is damaged)."""


# ------------------------------------------------------------------ reading exports

# a folder's kind, for a refusal's advice (folder_kind): what our exports alone hold, and what a
# transformers model folder holds (weights saved by save_pretrained, a hub download's files)
EXPORT_SIGNS = ("megatron_id_model.py", *CODE_FILES)
TRANSFORMERS_SIGNS = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "tokenizer.json",
                      "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "generation_config.json")
HF_FOLDERS = ("a folder written by megatron-id export-hf, or a transformers folder (save_pretrained) of a "
              f"{', '.join(ARCHITECTURES)} model")


def folder_kind(folder: Path) -> tuple[str | None, list[str]]:
    """What `folder` (given as a Hugging Face folder) looks like, by its files, with the files
    that say so: "export" (our bundled code, or a manifest listing it), "checkpoint" (a train.save
    or iter_ folder), "transformers" (weights or tokenizer files of a transformers model), "empty",
    or None (none of these)."""
    from ..checkpoint.files import CLIENT_STATE
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "empty", []
    ours = [n for n in names if n in EXPORT_SIGNS]
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
        ours += [n for n in EXPORT_SIGNS if n in listed and n not in ours]
    except (OSError, ValueError, KeyError, TypeError):
        pass   # no manifest, or not one of ours: the other signs decide
    if ours:
        return "export", ours
    training = [n for n in names if n in ("latest", CLIENT_STATE) or (n.startswith("iter_") and (folder / n).is_dir())]
    if training:
        return "checkpoint", training
    weights = sorted({p.name for pattern in TRANSFORMERS_SIGNS for p in folder.glob(pattern)})
    if weights:
        return "transformers", weights
    return None, names


def _advice(folder: Path) -> str:
    """The fix for a Hugging Face folder whose config.json is missing or damaged, fitted to the
    folder's kind (folder_kind)."""
    kind, files = folder_kind(folder)
    if kind == "export":
        return (f"It is an export of megatron-id (it holds {_some(files)}): export the checkpoint again with "
                f"megatron-id export-hf, or restore config.json from a copy.")
    if kind == "transformers":
        return (f"It is a transformers model's folder (it holds {_some(files)}): config.json describes the model, "
                f"and transformers' save_pretrained writes it beside the weights; copy config.json from the model's "
                f"hub page (Files) into {folder}, or save the model again with save_pretrained.")
    return f"Give {HF_FOLDERS}."


def read_export_config(folder):
    """An exported folder's config.json and ModelConfig, checked before any weight is read.
    (A folder without config.json, or not a folder, reaches here from import-hf only: generate
    and eval read an export by its config.json. The advice fits what the folder holds.)"""
    folder = Path(folder)
    fix = "Give a folder written by megatron-id export-hf (or export the checkpoint again)."
    path = folder / "config.json"
    if not folder.exists():
        raise NotAnExportError(f"{folder} does not exist. Give {HF_FOLDERS}.")
    if not folder.is_dir():
        raise NotAnExportError(f"{folder} is a file, not a folder. Give {HF_FOLDERS}.")
    if not path.is_file():
        kind, files = folder_kind(folder)
        if kind == "checkpoint":
            # train.load takes the train.save folder (the one with `latest`)
            root = folder.parent if not (folder / "latest").is_file() and (folder.parent / "latest").is_file() \
                else folder
            raise NotAnExportError(
                f"{folder} is a training checkpoint (it holds {_some(files)}), not a Hugging Face folder: it needs no "
                f"import. Train from it with train.load={root} (it loads at any layout), or export it with "
                f"megatron-id export-hf.")
        if kind == "empty":
            raise NotAnExportError(f"{folder} is empty. Give {HF_FOLDERS}.")
        if kind is None:
            raise NotAnExportError(f"{folder} has no config.json and holds neither weights nor a checkpoint (it "
                                   f"holds {_some(files)}). Give {HF_FOLDERS}.")
        raise NotAnExportError(f"{folder} has no config.json. {_advice(folder)}")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise NotAnExportError(f"{path} is not text (not UTF-8): it was overwritten. {_advice(folder)}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        what = "empty" if not text.strip() else \
            f"truncated or not valid JSON at line {err.lineno} column {err.colno} ({err.msg})"
        raise NotAnExportError(f"{path} is {what}. {_advice(folder)}") from None
    if not isinstance(config, dict):
        raise NotAnExportError(f"{path} is not a JSON object (it holds a {type(config).__name__}). "
                               f"{_advice(folder)}")
    model_type = config.get("model_type")
    if model_type == "megatron_id" and not isinstance(config.get("model"), dict):
        kind, files = folder_kind(folder)
        if kind == "transformers":   # a transformers folder whose config.json says ours
            raise NotAnExportError(
                f"{path} says model_type 'megatron_id', but {folder} is a transformers model's folder (it holds "
                f"{_some(files)}, no export code and no `model` section): set model_type and architectures in "
                f"config.json to the model's own (e.g. \"llama\", [\"LlamaForCausalLM\"]).")
    if model_type != "megatron_id":
        pretrained = transformers_config(folder)
        if pretrained is not None and set(pretrained.get("architectures") or []) & set(ARCHITECTURES):
            fix = (f"It is a pretrained {'/'.join(pretrained['architectures'])} folder: megatron-id import-hf reads "
                   f"it into a training checkpoint (then export-hf makes an export of it).")
        raise NotAnExportError(f"{path} has model_type {model_type!r}, not 'megatron_id': {folder} is not an "
                               f"export of this project. {fix}")
    if not isinstance(config.get("model"), dict):
        raise NotAnExportError(f"{path} has no `model` section (the training model config). {fix}")
    try:
        cfg = model_config_from_dict(config["model"])
    except (ValueError, TypeError, OmegaConfBaseException) as err:   # ConfigError is a ValueError
        raise NotAnExportError(f"{path}: its `model` section is not a valid model config "
                               f"({' '.join(str(err).split())}). {fix}") from None
    return config, cfg


def verify_export(folder, verify: str = "sample") -> None:
    """An export's files against the manifest.json written with them (size, then sha256: of
    sampled chunks of large files with "sample", of every byte with "full"). An export written
    before exports carried a manifest loads with a warning, as such checkpoints do."""
    folder = Path(folder)
    if verify not in VERIFY_MODES:
        raise BadOptionError(f"--verify {verify}: one of {', '.join(VERIFY_MODES)}.")
    fix = "Export the checkpoint again with megatron-id export-hf, or restore the file"
    try:
        manifest = read_manifest(folder)
    except UserError:
        raise NotAnExportError(f"{folder / MANIFEST} is damaged: the export cannot be verified. {fix}.") from None
    if manifest is None:
        warn_unverified(folder, "exported before exports carried one")
        return
    problems = verify_folder_files(folder, manifest, sampled_chunks=None if verify == "full" else VERIFY_SAMPLED_CHUNKS)
    if problems:
        more = f" ({len(problems) - 1} more damaged: {'; '.join(problems[1:3])})" if len(problems) > 1 else ""
        raise NotAnExportError(f"{problems[0]}: it was truncated or overwritten. {fix}{more}.")


def read_hf_folder(folder, verify: str = "sample"):
    """An exported folder -> (its config.json, ModelConfig, TP=1 weights with training names),
    its files checked against its manifest first (verify_export)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    folder = Path(folder)
    config, cfg = read_export_config(folder)
    path = folder / "model.safetensors"
    fix = "Export the checkpoint again with megatron-id export-hf."
    if not path.is_file():
        raise NotAnExportError(f"{path} is missing: {folder} is not a complete export. {fix}")
    verify_export(folder, verify)
    try:
        weights = {k.removeprefix("model."): v for k, v in load_file(str(path)).items()}
    except SafetensorError as err:
        raise NotAnExportError(f"{path} is damaged ({err}): it was truncated or overwritten. {fix}") from None
    _check_weights(weights, cfg, path, fix)
    return config, cfg, weights


def _check_weights(weights: dict, cfg, path: Path, fix: str) -> None:
    """The tensors must be exactly those of the model config.json describes (names and shapes):
    a mismatch named here instead of a stack trace from load_state_dict or the re-sharding."""
    with torch.device("meta"):   # shapes only, no memory
        expected = {k: tuple(v.shape) for k, v in LanguageModel(cfg, seed=None).state_dict().items()}
    problems = [f"model.{k} is missing" for k in sorted(set(expected) - set(weights))]
    problems += [f"model.{k} is not a parameter of this model" for k in sorted(set(weights) - set(expected))]
    problems += [f"model.{k} has shape {list(weights[k].shape)}, config.json says {list(shape)}"
                 for k, shape in expected.items() if k in weights and tuple(weights[k].shape) != shape]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise NotAnExportError(f"{path} does not match the model in config.json: {'; '.join(problems[:3])}"
                               f"{more}. {fix}")


def _tokenizer_ids(tokenizer_file: Path) -> dict:
    tok = load_tokenizer(str(tokenizer_file))
    eos = eod_id(tok)
    return {"eos_token": tok.id_to_token(eos), "eos_token_id": eos}


# ------------------------------------------------------------------ outputs

def why_not_an_export(folder: Path) -> str | None:
    """None when `folder` holds an earlier export and nothing else; otherwise why not."""
    entries = sorted(folder.iterdir())
    extra = [p.name for p in entries if p.name not in EXPORT_FILES or not p.is_file()]
    if extra:
        return f"it holds {_some(extra)}, which an export does not write"
    config = folder / "config.json"
    if not config.is_file():
        return "it has no config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError):   # not JSON, or not an object
        return "its config.json is not an export's config"
    if model_type != "megatron_id":
        return f"its config.json has model_type {model_type!r}"
    if not (folder / "model.safetensors").is_file():
        return "it has no model.safetensors"
    return None


def why_not_an_import(folder: Path) -> str | None:
    """None when `folder` holds one earlier import (weights-only iter_0000000 + `latest`, and
    the tokenizer folder of IMPORT_TOKENIZER holding only TOKENIZER_FILES) and nothing else;
    otherwise why not. A folder with training checkpoints is never ours."""
    names = sorted(p.name for p in folder.iterdir())
    history = [n for n in names if n.startswith("iter_") and n != IMPORT_TAG]
    if history:
        return f"it holds training checkpoints ({_some(history)}): a training history is never replaced"
    extra = [n for n in names if n not in ("latest", IMPORT_TAG, IMPORT_TOKENIZER)]
    if extra:
        return f"it holds {_some(extra)}, which import-hf does not write"
    copied = folder / IMPORT_TOKENIZER   # (absent from imports written before the copy was kept)
    if copied.exists():
        if not copied.is_dir() or copied.is_symlink():
            return f"its {IMPORT_TOKENIZER} is not the folder import-hf writes"
        others = sorted(p.name for p in copied.iterdir() if p.name not in TOKENIZER_FILES or not p.is_file())
        if others:
            return f"{copied} holds {_some(others)}, which import-hf does not write"
    latest = folder / "latest"
    if not latest.is_file() or latest.read_text().strip() != IMPORT_TAG:
        return f"its `latest` does not name {IMPORT_TAG}"
    try:
        client = read_client_state(folder / IMPORT_TAG)
    except Exception:   # missing or unreadable: whatever it is, it is not an import we wrote
        return f"{folder / IMPORT_TAG / CLIENT_STATE} is missing or damaged"
    if not client.weights_only:
        return f"{IMPORT_TAG} is a training checkpoint (not weights only): a training history is never replaced"
    if client.data is not None:   # a run's step-0 save (train.extra_save_steps) records its data
        return f"{IMPORT_TAG} is a training checkpoint (written by a run): a training history is never replaced"
    return None


def _some(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_output(output: Path, overwrite: bool, what: str, why_not_ours) -> None:
    """Refuse an `output` that writing would destroy: a file, a non-empty folder that is not an
    earlier `what` of ours (even with --overwrite), or an earlier one without --overwrite."""
    if output.exists() and not output.is_dir():
        raise OutputExistsError(f"--output {output} is a file, not a folder: nothing was written. Give the path "
                                f"of a new or empty folder for the {what}.")
    if not output.is_dir() or not any(output.iterdir()):
        return   # new or empty: written
    reason = why_not_ours(output)
    if reason is not None:
        raise OutputExistsError(
            f"--output {output} is not empty and is not an earlier {what}: {reason}. Nothing was written "
            f"(--overwrite replaces only an earlier {what}, never other files). Choose a new or empty folder.")
    if not overwrite:
        raise OutputExistsError(f"--output {output} already holds an earlier {what}: nothing was written. Add "
                                f"--overwrite to replace it, or choose a new or empty folder.")


def _host() -> str:
    import socket
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _sibling(output: Path, role: str) -> Path:
    """An unused hidden name beside `output` (same file system, so renames are atomic); the host
    and pid tell a stale one (its process gone) from a live one on a shared file system."""
    return output.parent / f".{output.name}.{role}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# (names written before the host was part of them have none)
_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<role>partial|old)-(?:(?P<host>[A-Za-z0-9_.]+)-)?(?P<pid>\d+)-"
                      r"[0-9a-f]{8}$")


def remove_stale_partials(output: Path) -> list[Path]:
    """The staging folders (`.NAME.partial-HOST-PID-*`) that killed exports or imports into
    `output` left beside it, whose process is gone (this host's only: another host's process
    cannot be seen from here), are removed, each with a note; a live one (another export running
    now) is left alone. A set-aside old output
    (`.NAME.old-PID-*`, left by a kill between the two renames of an --overwrite) is the user's
    data: it is named, never removed. Returns what was removed."""
    output = Path(output)
    if not output.parent.is_dir():
        return []
    removed = []
    for entry in sorted(output.parent.iterdir()):
        match = _SIBLING.match(entry.name)
        if not match or match["name"] != output.name or not entry.is_dir() or entry.is_symlink():
            continue
        pid = int(match["pid"])
        if (match["host"] or _host()) != _host() or pid == os.getpid() or _pid_alive(pid):
            continue   # another host's (its process cannot be seen from here), or a live one
        if match["role"] == "old":
            print(f"note: {entry} is an earlier {output.name} set aside by an interrupted --overwrite (process "
                  f"{pid} is gone): it is left as it is; delete it, or rename it back if {output} is missing.",
                  file=sys.stderr)
            continue
        size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(entry, ignore_errors=True)
        print(f"note: removed {entry} ({human_bytes(size, exact=False)}), the staging folder of an interrupted write "
              f"into {output} (process {pid} is gone)", file=sys.stderr)
        removed.append(entry)
    return removed


def check_room(output: Path, needed: int, what: str) -> None:
    """Refuse, before anything is written, an output whose file system has less free space than
    the new folder needs (an --overwrite keeps the old one until the new one is in place)."""
    free = free_bytes(output.parent if not output.exists() else output)
    if free is not None and needed > free:
        raise disk_full_error(what, output, needed, "Nothing was written.",
                              "Free space there or choose another --output.")


def write_folder(output: Path, build, needed: int | None = None, what: str = "the new folder") -> Path:
    """`build(staging)` fills a new folder beside `output`; then it takes the place of `output`
    (absent, empty, or an earlier output the caller agreed to replace): the old folder is
    renamed aside, the new one renamed in, and only then the old one deleted. An error at any
    point leaves `output` as it was and removes the staging folder. (A kill between the two
    renames leaves the old output complete under its `.old-` name beside `output`.) Staging
    folders of killed writes into `output` are removed first (remove_stale_partials). `needed`
    (bytes, about): refused before writing when the file system has less free; a write that
    fails for want of space says so with that figure (DiskFullError)."""
    check_writable(output.parent if output.exists() else output, "--output")   # read-only: named as such
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(output)
    if needed is not None:
        check_room(output, needed, what)
    staging = _sibling(output, "partial")
    staging.mkdir()   # mode from the umask, as any folder the user creates
    aside = None
    try:
        try:
            build(staging)
        except Exception as err:
            if not is_disk_full(err):
                raise
            shutil.rmtree(staging, ignore_errors=True)
            raise disk_full_error(what, output, needed, f"The partial folder {staging.name} was removed"
                                  f"{' and ' + str(output) + ' left as it was' if output.exists() else ''}.",
                                  "Free space there or choose another --output.", show_free=False) from err
        if output.exists():
            aside = _sibling(output, "old")
            os.replace(output, aside)
            try:
                os.replace(staging, output)
            except BaseException:
                os.replace(aside, output)   # put the old output back
                aside = None
                raise
        else:
            os.replace(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    if aside is not None:
        try:
            shutil.rmtree(aside)
        except OSError as err:   # the new output is in place: say what is left, do not fail
            print(f"warning: the replaced {output.name} is left at {aside} ({err.strerror}): delete it "
                  f"by hand.", file=sys.stderr)
    return output


def _positive(option: str, value: int, meaning: str) -> None:
    if value < 1:
        raise BadOptionError(f"{option} {value} is invalid: it must be at least 1 ({meaning}).")


# ------------------------------------------------------------------ export and import

# config.json's record of the tokenizer identity (data/tokenizer.py) the exported weights go with
TOKENIZER_ID_KEY = "megatron_id_tokenizer_id"


def export_config(cfg, ids: dict, tokenizer_id, prefill_chunk_size: int, step: int, layout) -> dict:
    """config.json of an export (also the in-process model of train.eval_tasks' lm-eval entries)."""
    return {
        "model_type": "megatron_id", "architectures": ["MegatronIDForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_megatron_id.MegatronIDConfig",
                     "AutoModelForCausalLM": "modeling_megatron_id.MegatronIDForCausalLM"},
        "model": model_config_dict(cfg), "prefill_chunk_size": prefill_chunk_size,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "tie_word_embeddings": cfg.tie_embeddings,
        # grouped-query attention (model.n_kv_heads, softmax layers), under transformers' name:
        # read by tools that size a KV cache from config.json (the model reads `model`)
        "num_key_value_heads": kv_heads(cfg),
        "eos_token_id": ids["eos_token_id"], "pad_token_id": ids["eos_token_id"],
        "bos_token_id": ids["eos_token_id"], "torch_dtype": "float32", "use_cache": True,
        "megatron_id": {"step": step, "saved_layout": layout},
        TOKENIZER_ID_KEY: tokenizer_id,
    }


def tokenizer_config(cfg, ids: dict, tokenizer: Path) -> dict:
    """tokenizer_config.json of an export (also the in-process tokenizer of train.eval_tasks' lm-eval)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": ids["eos_token"],
            "bos_token": ids["eos_token"], "pad_token": ids["eos_token"], "unk_token": ids["eos_token"],
            # the training context: lm-evaluation-harness sizes its windows and its --batch_size
            # auto probe by it (the model itself has no length limit; longer inputs work)
            "model_max_length": cfg.seq_length,
            # left padding runs each row as if alone (the model's forward); right padding
            # scores correctly too but leaves no cache to generate from
            "padding_side": "left",
            # the tokenizer's chat template, if it has one (an imported Llama / Qwen): what
            # `serve`'s /v1/chat/completions and transformers' apply_chat_template render
            **({"chat_template": template} if (template := chat_template_of(tokenizer)) else {})}


def write_model_files(staging: Path, cfg, ids: dict, tokenizer: Path, tokenizer_id, prefill_chunk_size: int,
                      step, layout) -> None:
    """Every file of an export but its weights and manifest: the code, config.json, the tokenizer
    (also the in-process model of train.eval_tasks' lm-eval entries, evaluation/lm_eval_model.py)."""
    for name in CODE_FILES:
        shutil.copy(HERE / name, staging / name)
    (staging / "megatron_id_model.py").write_text(bundle_source())
    config = export_config(cfg, ids, tokenizer_id, prefill_chunk_size, step, layout)
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (staging / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": ids["eos_token_id"], "pad_token_id": ids["eos_token_id"],
         "bos_token_id": ids["eos_token_id"], "do_sample": False}, indent=2) + "\n")
    shutil.copy(tokenizer, staging / "tokenizer.json")
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg, ids, tokenizer), indent=2) + "\n")


def export_hf(checkpoint, output, tokenizer=None, prefill_chunk_size: int = 2048, overwrite: bool = False,
              allow_tokenizer_mismatch: bool = False) -> Path:
    """Write the Hugging Face folder `output` (see the module doc for when an existing one is
    replaced). Every check runs before anything is written."""
    _positive("--prefill-chunk-size", prefill_chunk_size, "tokens per prefill chunk; default 2048")
    folder = checkpoint_folder(checkpoint)
    output = Path(output).resolve()
    sources = {Path(checkpoint).resolve(), folder.resolve()}
    if (folder.parent / "latest").is_file():   # an iter_ folder: its train.save root is the checkpoint too
        sources.add(folder.parent.resolve())
    for source in sorted(sources, key=lambda p: len(p.parts)):
        refuse_output_inside(output, source, "the checkpoint being exported", "hf")
    check_output(output, overwrite, "export", why_not_an_export)
    client = read_client_state(folder)   # checked against the checkpoint's manifest, like the weights
    tokenizer = find_tokenizer(tokenizer, client.tokenizer, folder)
    ids = _tokenizer_ids(tokenizer)
    cfg = client.model_config()
    for line in vllm_warnings(cfg):   # (the export still serves transformers and megatron-id serve)
        print(f"export-hf: note: {line}", file=sys.stderr)
    # the tokenizer shipped with the weights is theirs, and none of its ids is beyond the
    # embedding table (else every transformers user fails on the first such id)
    tokenizer_id = check_tokenizer_for_model(load_tokenizer(str(tokenizer)), tokenizer, cfg.vocab_size,
                                             client.tokenizer_id, folder, allow=allow_tokenizer_mismatch,
                                             recorded_path=client.tokenizer)
    # memory-mapped, merged over TP one tensor at a time as the file is written: the export
    # never holds the model (benchmarks/checkpoint_memory.py)
    weights = ModelState(folder, cfg, client.layout)

    def build(staging: Path) -> None:
        save_safetensors(staging / "model.safetensors",
                         {f"model.{k}": weights.spec(k) for k in weights.names},
                         lambda key: weights.tensor(key.removeprefix("model."))[0], metadata={"format": "pt"})
        # safetensors creates its file owner-only (0600); give it the mode of the other files
        # (the umask's, as the staging folder has), or a shared export is unreadable to the group
        os.chmod(staging / "model.safetensors", staging.stat().st_mode & 0o666)
        write_model_files(staging, cfg, ids, tokenizer, tokenizer_id, prefill_chunk_size, client.step,
                          client.layout)
        # last: the size and sha256 of every file (and of each 4 MiB chunk, for sampled checks),
        # verified by generate, serve, eval and import-hf before they use the weights
        write_manifest(staging, manifest_entries(staging, checkpoint_files(staging), chunk_bytes=CHUNK_BYTES))

    # the weights plus the tokenizer, the bundled code and the small files (under 1 MiB)
    needed = sum(_nbytes(*weights.spec(k)) for k in weights.names) + tokenizer.stat().st_size + (1 << 20)
    return write_folder(output, build, needed, f"the export of {folder}")


def _nbytes(dtype, shape) -> int:
    import math
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def _check_tensor_parallel(cfg, tp: int, folder: Path) -> None:
    """The TP size must split the model evenly; the error lists the sizes that do (the
    divisibility check's own hints are about training config keys, not this option)."""
    def fits(t: int) -> bool:
        try:
            check_model_split(cfg, t)
            return True
        except LayoutError:
            return False
    if not fits(tp):
        valid = ", ".join(str(t) for t in range(1, cfg.n_heads + 1) if fits(t))
        # what does not divide, first: the key/value heads of grouped-query attention (a Llama
        # with one KV head splits its 4 query heads and its SwiGLU at TP=2, not its one KV head)
        sizes = [("model.n_heads", cfg.n_heads)]
        if cfg.n_kv_heads is not None:
            sizes.append(("model.n_kv_heads", cfg.n_kv_heads))
        sizes.append(("SwiGLU hidden size", ffn_hidden_size(cfg)))
        failing = [f"{name}={n}" for name, n in sizes if n % tp]
        held = [f"{name}={n}" for name, n in sizes if not n % tp]
        verb = "does" if len(failing) == 1 else "do"
        also = f" ({', '.join(held)} {'does' if len(held) == 1 else 'do'})" if held and failing else ""
        raise BadOptionError(
            f"--tensor-parallel {tp} cannot split the model of {folder}: {', '.join(failing) or 'its vocabulary'} "
            f"{verb if failing else 'does'} not divide by {tp}{also}; every tensor-parallel rank "
            f"keeps whole heads, whole key/value heads and an equal share of the SwiGLU. Valid --tensor-parallel "
            f"values for this model: {valid}.")


def import_hf(folder, output, tensor_parallel: int = 1, pipeline_parallel: int = 1,
              overwrite: bool = False, allow_tokenizer_mismatch: bool = False, verify: str = "sample") -> Path:
    """An exported folder, or a pretrained transformers folder of a Llama-style architecture
    (hf/llama.py: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, as a softmax model)
    -> `output`/iter_0000000 (+ `latest`), weights only, at TP x PP, and `output`/tokenizer, the
    checkpoint's own copy of the tokenizer (IMPORT_TOKENIZER; see the module doc for when an
    existing `output` is replaced). Every check runs before anything is written."""
    _positive("--tensor-parallel", tensor_parallel, "the tensor parallel size of the checkpoint to write")
    _positive("--pipeline-parallel", pipeline_parallel, "the pipeline parallel size of the checkpoint to write")
    folder, output = Path(folder), Path(output).resolve()
    pretrained = transformers_config(folder)
    if pretrained is not None:
        cfg = transformers_model_config(folder, pretrained)   # what the model cannot express: refused here
    else:
        _, cfg = read_export_config(folder)
    _check_tensor_parallel(cfg, tensor_parallel, folder)
    refuse_output_inside(output, folder.resolve(), "the export being imported" if pretrained is None
                         else "the folder being imported", "checkpoints")
    check_output(output, overwrite, "import", why_not_an_import)
    # the checkpoint records the identity of the tokenizer shipped with the weights, after
    # checking it is the one the export recorded (a tokenizer.json swapped in by hand is not);
    # a transformers folder records none: its tokenizer.json is taken as the weights' own
    tokenizer = (folder / "tokenizer.json").resolve()
    if pretrained is not None and not tokenizer.is_file():
        raise UnsupportedModelError(
            f"{folder} has no tokenizer.json (the fast tokenizer file transformers writes): the checkpoint records "
            f"the tokenizer its ids mean. Save it there with AutoTokenizer.from_pretrained(...).save_pretrained("
            f"'{folder}'), then import again; nothing was written.")
    recorded = None if pretrained is not None else \
        json.loads((folder / "config.json").read_text()).get(TOKENIZER_ID_KEY)
    tokenizer_id = check_tokenizer_for_model(load_tokenizer(str(find_tokenizer(None, str(tokenizer), folder))),
                                             tokenizer, cfg.vocab_size, recorded, folder,
                                             allow=allow_tokenizer_mismatch, recorded_path=tokenizer)
    # the checkpoint records its own copy of the tokenizer (IMPORT_TOKENIZER), by the path it has
    # once the new folder is renamed into place
    tokenizer_files = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    layout = {"tensor": tensor_parallel, "pipe": pipeline_parallel, "data": 1, "zero_stage": 0}
    client = ClientState(step=0, layout=layout, model=model_config_dict(cfg), weights_only=True,
                         tokenizer=str(output / IMPORT_TOKENIZER / "tokenizer.json"), tokenizer_id=tokenizer_id)
    if pretrained is not None:
        # memory-mapped: each TP rank's slices are read, written and dropped before the next
        # rank's (the import holds one rank's share of the model, in float32)
        weights = TransformersWeights(folder)
        sources = weights.sources(cfg)   # names and shapes from the headers, before any weight is read
        shards = (weights.local_shard(sources, cfg, tensor_parallel, rank) for rank in range(tensor_parallel))
        needed = weights.nbytes(sources, cfg, tensor_parallel) + (1 << 20)
    else:
        _, cfg, full = read_hf_folder(folder, verify)
        shards = split_state_dict(full, cfg, tensor_parallel)
        needed = sum(t.numel() * t.element_size() for shard in shards for t in shard.values()) + (1 << 20)

    needed += sum(path.stat().st_size for path in tokenizer_files)

    def build(staging: Path) -> None:
        write_weights_only(staging, shards, cfg, pipeline_parallel, client)
        (staging / IMPORT_TOKENIZER).mkdir()
        for path in tokenizer_files:   # (the umask's mode, as the checkpoint's files: not a read-only cache's)
            shutil.copyfile(path, staging / IMPORT_TOKENIZER / path.name)

    return write_folder(output, build, needed, f"the import of {folder}")
