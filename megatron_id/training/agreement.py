"""Before a run starts: the tokenizer, the data, the model and the checkpoint it resumes from
must describe one model. Rank 0 runs these in the trainer's preflight, before DeepSpeed.

- Tokenizers (identities of data/tokenizer.py): every prefix of the blend, `data.tokenizer`
  and the checkpoint resumed from record the same one; a blend of GPT-2 and NeoX data trains
  one embedding table on ids that mean different tokens, and a resume on another tokenizer's
  data turns the trained embeddings into noise without an error. Mixing on purpose (a
  vocabulary transplant, a study) takes `data.allow_tokenizer_mismatch=true`: a warning, and
  the checkpoint then records no tokenizer identity.
- Vocabulary: `model.vocab_size` holds the tokenizer's whole vocabulary, not only the ids
  that happen to be in the data (those are checked by check_token_ids); a smaller table trains
  and exports, then fails on the first prompt that uses a larger id.
- Resume: the checkpoint's model config equals the run's on every key that changes the
  weights' shapes or their meaning, and all differing keys are named at once (not a
  77-line size-mismatch traceback from load_state_dict).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.files import model_config_dict, read_client_state
from ..config import Config, ConfigError, defaulted_keys
from ..data.gpt_dataset import parse_data_path
from ..data.indexed_dataset import IndexedDataset, matching_meta
from ..data.tokenizer import MISMATCH_KEY, check_same_tokenizer, identity_of_file, size_of_file
from ..model.accounting import report
from ..model.pattern import spelled_out
from ..model.spec import ModelConfig, ffn_hidden_size


@dataclass
class RunTokenizer:
    """What this run's data is made of: the identity recorded in its checkpoints (None when
    unknown or mixed on purpose), the tokenizer file when data.tokenizer names one, and the
    vocabulary size the tokenizer or the sidecars give (None: unknown)."""
    identity: str | None
    path: str | None
    vocab_size: int | None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run_tokenizer(cfg: Config) -> RunTokenizer:
    """Check the blend's sidecars and data.tokenizer against each other and the model's
    vocabulary; return what the checkpoints will record. Raises a UserError naming both sides."""
    d, m = cfg.data, cfg.model
    allow = d.allow_tokenizer_mismatch
    fix = (f"Preprocess all data with one tokenizer (data_tools.preprocess --tokenizer ...), or set "
           f"{MISMATCH_KEY} to mix on purpose.")
    sides = []   # (what, identity, tokenizer path, vocab size) per prefix, validation sets included
    named = [("data", d.data_path)] + [(f"data.valid_sets.{name}", path) for name, path in d.valid_sets.items()]
    for what, path in named:
        for _, prefix in parse_data_path(path):
            meta = matching_meta(IndexedDataset(prefix)) or {}
            label = f"data {prefix}" if what == "data" else f"{what} {prefix}"
            sides.append((label, meta.get("tokenizer_id"), meta.get("tokenizer"), meta.get("vocab_size")))
    mixed = False
    for other in sides[1:]:
        if not _same_data_tokenizer(sides[0], other, fix, allow):
            mixed = True
    known = [s for s in sides if s[1] is not None]
    identity = known[0][1] if known and not mixed else None
    path, vocab_size = None, max((s[3] for s in sides if s[3] is not None), default=None)
    if d.tokenizer:
        file = Path(d.tokenizer)
        own = identity_of_file(file)   # (loaded once with the data checks); a missing or broken file: one line
        for side in known:
            if not check_same_tokenizer(
                    side[:3], (f"data.tokenizer={d.tokenizer}", own, None),
                    f"Set data.tokenizer to the tokenizer the data was preprocessed with"
                    f"{f' ({side[2]})' if side[2] else ''}, or set {MISMATCH_KEY}.", allow=allow, warn=_warn):
                mixed = True
        identity = None if mixed else own
        path = str(file.resolve())
        vocab_size = size_of_file(file)
        source = f"the tokenizer data.tokenizer={d.tokenizer}"
    else:
        source = next((f"the tokenizer recorded in {s[0].split(' ', 1)[-1]}.meta.json"
                       for s in sides if s[3] == vocab_size), "the tokenizer")
    if vocab_size is not None and m.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={m.vocab_size} is smaller than the {vocab_size:,} tokens of {source}: "
            f"ids {m.vocab_size}..{vocab_size - 1} could not be embedded (the model would train on "
            f"this data and then fail on the first text that uses them). Set model.vocab_size="
            f"{vocab_size} or more.")
    return RunTokenizer(identity, path, vocab_size)


def _same_data_tokenizer(a: tuple, b: tuple, fix: str, allow: bool) -> bool:
    """Two prefixes' sidecars: their identities when both record one; else their vocabulary
    sizes (data written before identities were recorded), which tell tokenizers apart when
    they differ. False when they are known to differ (and allowed)."""
    if a[1] is not None and b[1] is not None:
        return check_same_tokenizer(a[:3], b[:3], fix, allow=allow, warn=_warn)
    if a[3] is None or b[3] is None or a[3] == b[3]:
        return True
    sized = [(what, f"of {vocab:,} tokens", path) for what, _, path, vocab in (a, b)]
    return check_same_tokenizer(sized[0], sized[1], fix, allow=allow, warn=_warn)


def check_resume_tokenizer(folder: Path, run: RunTokenizer, allow: bool) -> None:
    """The checkpoint resumed from was trained on the same tokenizer's ids as this run's data."""
    client = read_client_state(folder)
    recorded = client.tokenizer_id
    if recorded is None and client.tokenizer and Path(client.tokenizer).is_file():
        recorded = identity_of_file(client.tokenizer)   # written before identities were recorded
    check_same_tokenizer(
        (f"checkpoint {folder}", recorded, client.tokenizer), ("this run's data", run.identity, run.path),
        f"Resume on data made with the checkpoint's tokenizer, start a new run (another train.save) "
        f"for the new tokenizer, or set {MISMATCH_KEY} to continue on purpose.", allow=allow, warn=_warn)


# Keys of the model config that change how the core is computed, not the weights or what they
# compute: a resume may change them (a GPU run resuming a CPU run's checkpoint with core_impl=triton).
RESUME_FREE_KEYS = frozenset({"core_impl", "chunk_size"})


def _layers_spelled_out(model: dict) -> dict:
    """The model config with layer_pattern as one letter per layer: an unset pattern and its
    uniform spelling are one model, and the | marks (pipeline stages) may change on a resume."""
    if "mixer" not in model or "n_layers" not in model:
        return model
    return {**model, "layer_pattern": spelled_out(model.get("layer_pattern"), model["mixer"], model["n_layers"])}


def _as_the_weights_mean_it(saved: dict, current: dict) -> tuple[dict, dict]:
    """The two model configs with the layer pattern spelled out and the keys whose None stands
    for a value compared by that value, so that two spellings of one model compare equal
    (import-hf writes model.n_kv_heads only under GQA and model.ffn_hidden always; a run may write
    either way): n_kv_heads None is n_heads (as in a checkpoint written before the key), and
    ffn_hidden None the width model.ffn_multiple_of gives, compared as that width (ffn_multiple_of
    then decides nothing). A key both sides spell alike is left as it is, so that a resume that
    changes model.d_model is told about d_model, not also about the widths it derives."""
    saved, current = dict(_layers_spelled_out(saved)), dict(_layers_spelled_out(current))
    for side, other in ((saved, current), (current, saved)):
        if side.get("n_kv_heads") is None and other.get("n_kv_heads") is not None and "n_heads" in side:
            side["n_kv_heads"] = side["n_heads"]
    multiples = [side.get("ffn_multiple_of", ModelConfig.ffn_multiple_of) for side in (saved, current)]
    if saved.get("ffn_hidden") is not None or current.get("ffn_hidden") is not None or multiples[0] != multiples[1]:
        for side, multiple in zip((saved, current), multiples):
            if side.get("ffn_hidden") is None and "d_model" in side:
                side["ffn_hidden"] = ffn_hidden_size(ModelConfig(d_model=side["d_model"], ffn_multiple_of=multiple))
            side.pop("ffn_multiple_of", None)
    return saved, current


def check_resume_model(folder: Path, cfg: Config) -> None:
    """Refuse a resume whose model config differs from the checkpoint's, naming every key."""
    client = read_client_state(folder)
    saved, current = _as_the_weights_mean_it(client.model, model_config_dict(cfg.model))
    differing = sorted(k for k in set(saved) | set(current)
                       if k not in RESUME_FREE_KEYS and k in saved and saved.get(k) != current.get(k))
    if not differing:
        return
    shown = ", ".join(f"model.{k}={saved[k]} in the checkpoint but {current.get(k)} here" for k in differing)
    restore = " ".join(f"model.{k}={saved[k]}" for k in differing)
    raise ConfigError(
        f"train.load resumes {folder}, whose model differs from this run's: {shown}. A resume "
        f"continues the same model (and model.seq_length the same data order): set {restore}, or "
        f"start a new run with another train.save.")


# ------------------------------------------------------------------ the host's memory (CPU runs)

def available_host_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def ranks_on_this_host() -> int:
    """The training processes that share this host's memory: torchrun's LOCAL_WORLD_SIZE, or
    SLURM's tasks per node, else 1."""
    import os
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def check_host_memory(cfg: Config, layout, planned_gib: float) -> None:
    """A CPU run whose planned memory is above what the host has free is refused before any
    work: the kernel's OOM killer would end it mid-setup with no message (SIGKILL). The
    message says where the model came from when the schema's defaults decided it."""
    available = available_host_memory()
    ranks = ranks_on_this_host()
    if not cfg.train.check_host_memory or available is None or planned_gib * ranks * 2**30 <= available:
        return
    m = cfg.model
    origin = model_origin(cfg)
    raise ConfigError(
        f"planned memory {planned_gib:.1f} GiB per rank x {ranks} rank(s) on this host is more than the "
        f"{available / 2**30:.1f} GiB it has available: the model (d_model={m.d_model}, n_layers={m.n_layers}, "
        f"{report(m).parameters:,} parameters{origin}) would be killed by the out-of-memory killer. Choose a "
        f"smaller model (e.g. --config configs/model/tiny.yaml, or model.d_model=... model.n_layers=...), a "
        f"smaller train.micro_batch_size, or set train.check_host_memory=false to try anyway.")


def model_origin(cfg: Config) -> str:
    """'' when a config file or override set the model; else where its shape came from."""
    shape = ("model.d_model", "model.n_layers", "model.n_heads", "model.vocab_size")
    missing = defaulted_keys(cfg, shape)
    if not missing:
        return ""
    if len(missing) == len(shape):
        return ": the schema's defaults, no config file or override sets model.*"
    return f": {', '.join(missing)} from the schema's defaults"
