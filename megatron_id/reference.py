"""The reference pages, generated from the code so that they cannot drift from it:

    python -m megatron_id.reference            # writes docs/reference/config.md and cli.md
    python -m megatron_id.reference --check    # exit 1 naming the page that is out of date

config.md comes from the omegaconf schema (megatron_id/config.py): every key with its type,
default, allowed values (the enums, and the rules `resolve` checks, read from its source), its
meaning (the comment beside or above the field; a mixer's: its row's `meaning` in model/spec.py)
and the nearest Megatron-LM flag / GPT-NeoX key.
cli.md comes from the argparse parsers of every command. tests/test_docs.py fails when either
page differs from what this module writes now (NeoX's configs/neox_arguments.md is generated
from its argument classes in the same spirit).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import io
import re
import sys
import tokenize
import typing
from enum import Enum
from pathlib import Path

from . import config as config_module
from .atomic import write_atomic_text
from .model import spec as spec_module

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"config": ROOT / "docs" / "reference" / "config.md", "cli": ROOT / "docs" / "reference" / "cli.md"}

# The nearest flag of Megatron-LM's arguments.py and key of GPT-NeoX's neox_arguments.md ("-" where
# the peer has none). "(inverse)": the peer's switch means the opposite. Checked by tests/test_docs.py
# to name schema keys only.
PEER_FLAGS = {
    "model.layer_pattern": ("--hybrid-layer-pattern", "attention_config"),
    "model.window": ("--window-size", "sliding_window_width"),
    "model.vocab_size": ("--vocab-size", "-"),
    "model.d_model": ("--hidden-size", "hidden_size"),
    "model.n_layers": ("--num-layers", "num_layers"),
    "model.n_heads": ("--num-attention-heads", "num_attention_heads"),
    "model.n_kv_heads": ("--num-query-groups (with --group-query-attention)", "num_kv_heads"),
    "model.qkv_bias": ("--add-qkv-bias", "-"),
    "model.seq_length": ("--seq-length", "seq_length"),
    "model.ffn_hidden": ("--ffn-hidden-size", "intermediate_size"),
    "model.ffn_multiple_of": ("-", "mlp_multiple_of"),
    "model.norm_eps": ("--norm-epsilon", "rms_norm_epsilon"),
    "model.init_std": ("--init-method-std", "init_method_std"),
    "model.rope_theta": ("--rotary-base", "rotary_emb_base"),
    "model.rope_scaling": ("--use-rope-scaling, --rope-scaling-factor (llama3 only)", "-"),
    "model.state_size": ("--mamba-state-dim (Mamba's N)", "-"),
    "model.tie_embeddings": ("--untie-embeddings-and-output-weights (inverse)", "no_weight_tying (inverse)"),
    "model.make_vocab_size_divisible_by": ("--make-vocab-size-divisible-by", "make_vocab_size_divisible_by"),
    "parallel.tensor_model_parallel_size": ("--tensor-model-parallel-size", "model_parallel_size"),
    "parallel.pipeline_model_parallel_size": ("--pipeline-model-parallel-size", "pipe_parallel_size"),
    "parallel.sequence_parallel": ("--sequence-parallel", "sequence_parallel"),
    "parallel.context_parallel_size": ("--context-parallel-size", "-"),
    "data.data_path": ("--data-path", "data_path / train_data_paths"),
    "data.split": ("--split", "split"),
    "data.index_cache_dir": ("--data-cache-path", "-"),
    "data.tokenizer": ("--tokenizer-model", "vocab_file"),
    "data.reset_attention_mask": ("--reset-attention-mask", "-"),
    "data.reset_position_ids": ("--reset-position-ids", "-"),
    "data.eod_mask_loss": ("--eod-mask-loss", "eod_mask_loss"),
    "data.valid_sets": ("--valid-data-path", "valid_data_paths"),
    "optimizer.lr": ("--lr", "optimizer.params.lr"),
    "optimizer.min_lr": ("--min-lr", "min_lr"),
    "optimizer.warmup_tokens": ("--lr-warmup-samples (x seq length)", "warmup (a fraction)"),
    "optimizer.schedule": ("--lr-decay-style", "lr_decay_style"),
    "optimizer.decay_fraction": ("--lr-wsd-decay-samples (as a share)", "-"),
    "optimizer.decay_shape": ("--lr-wsd-decay-style", "-"),
    "optimizer.weight_decay": ("--weight-decay", "weight_decay"),
    "optimizer.adam_beta1": ("--adam-beta1", "optimizer.params.betas[0]"),
    "optimizer.adam_beta2": ("--adam-beta2", "optimizer.params.betas[1]"),
    "optimizer.adam_eps": ("--adam-eps", "optimizer.params.eps"),
    "optimizer.clip_grad": ("--clip-grad", "gradient_clipping"),
    "train.micro_batch_size": ("--micro-batch-size", "train_micro_batch_size_per_gpu"),
    "train.global_batch_size": ("--global-batch-size", "train_batch_size"),
    "train.train_tokens": ("--train-samples (x seq length)", "train_iters (x batch x seq length)"),
    "train.precision": ("--bf16", "precision"),
    "train.zero_stage": ("--use-distributed-optimizer (ZeRO-1)", "zero_optimization.stage"),
    "train.activation_checkpointing": ("--recompute-granularity full", "checkpoint_activations"),
    "train.compile": ("-", "-"),
    "train.log_interval": ("--log-interval", "log_interval"),
    "train.eval_interval": ("--eval-interval", "eval_interval"),
    "train.eval_iters": ("--eval-iters", "eval_iters"),
    "train.save_interval": ("--save-interval", "checkpoint_factor"),
    "train.save": ("--save", "save"),
    "train.load": ("--load", "load"),
    "train.load_optimizer": ("--no-load-optim (inverse)", "no_load_optim (inverse)"),
    "train.override_scheduler": ("--override-opt_param-scheduler", "override_lr_scheduler"),
    "train.save_optimizer": ("--no-save-optim (inverse)", "no_save_optim (inverse)"),
    "train.extra_save_steps": ("-", "extra_save_iters"),
    "train.keep_last": ("-", "keep_last_n_checkpoints"),
    "train.tensorboard_dir": ("--tensorboard-dir", "tensorboard_dir"),
    "train.collective_timeout_minutes": ("--distributed-timeout-minutes", "-"),
    "train.deepspeed": ("-", "deepspeed_extra_args"),
    "train.wandb.project": ("--wandb-project", "wandb_project"),
    "train.wandb.entity": ("--wandb-entity", "wandb_team"),
    "train.wandb.name": ("--wandb-exp-name", "-"),
    "train.wandb.group": ("-", "wandb_group"),
    "train.wandb.dir": ("--wandb-save-dir", "-"),
    "train.profile.dir": ("--profile", "profile"),
    "train.profile.start_step": ("--profile-step-start", "profile_step_start"),
    "train.profile.steps": ("--profile-step-end (as a count)", "profile_step_stop (as a count)"),
    "train.profile.ranks": ("--profile-ranks", "-"),
    "train.timing_breakdown": ("--timing-log-level", "wall_clock_breakdown"),
    "train.async_save": ("--async-save", "-"),
    "seed": ("--seed", "seed"),
}


# ---------------------------------------------------------------- a peer's flags typed on our command line

# Megatron-LM flags whose key here takes another unit or form than PEER_FLAGS' row says, and common
# ones without a row: flag -> (whether it takes a value, the override to write instead; {v}: its value)
MEGATRON_FLAGS = {
    "--train-iters": (True, "train.train_tokens=<{v} x train.global_batch_size x model.seq_length>"),
    "--train-samples": (True, "train.train_tokens=<{v} x model.seq_length>"),
    "--lr-warmup-iters": (True, "optimizer.warmup_tokens=<{v} x train.global_batch_size x model.seq_length>"),
    "--lr-warmup-samples": (True, "optimizer.warmup_tokens=<{v} x model.seq_length>"),
    "--lr-warmup-fraction": (True, "optimizer.warmup_tokens=<{v} x train.train_tokens>"),
    "--lr-decay-iters": (True, "no key: the decay ends at train.train_tokens"),
    "--lr-decay-samples": (True, "no key: the decay ends at train.train_tokens"),
    "--lr-wsd-decay-iters": (True, "optimizer.decay_fraction=<{v} / the run's steps>"),
    "--lr-wsd-decay-samples": (True, "optimizer.decay_fraction=<{v} / the run's samples>"),
    "--bf16": (False, "train.precision=bf16"),
    "--fp16": (False, "no fp16 here: train.precision=bf16 or fp32"),
    "--use-distributed-optimizer": (False, "train.zero_stage=1"),
    "--recompute-granularity": (True, "train.activation_checkpointing=true"),
    "--recompute-activations": (False, "train.activation_checkpointing=true"),
    "--num-query-groups": (True, "model.n_kv_heads={v}"),
    "--group-query-attention": (False, "model.n_kv_heads=<the number of groups> alone"),
    "--mamba-state-dim": (True, "model.state_size={v}"),
    "--valid-data-path": (True, "data.valid_sets.<name>=[{v}]"),
    "--profile": (False, "train.profile.dir=<a folder>"),
    "--profile-step-end": (True, "train.profile.steps=<{v} - train.profile.start_step + 1>"),
    "--timing-log-level": (True, "train.timing_breakdown=true"),
    "--finetune": (False, "train.finetune=true"),
    "--vocab-file": (True, "data.tokenizer=<its tokenizer.json>"),
    "--merge-file": (True, "data.tokenizer=<its tokenizer.json>"),
    "--tokenizer-type": (True, "data.tokenizer=<its tokenizer.json>"),
}
# GPT-NeoX keys (and Megatron's argument names) typed as key=value whose PEER_FLAGS row has a note
NEOX_KEYS = {
    "train_iters": "train.train_tokens=<{v} x train.global_batch_size x model.seq_length>",
    "warmup": "optimizer.warmup_tokens=<{v} x train.train_tokens>",
    "no_weight_tying": "model.tie_embeddings=<the opposite of {v}>",
    "no_load_optim": "train.load_optimizer=<the opposite of {v}>",
    "no_save_optim": "train.save_optimizer=<the opposite of {v}>",
}
CONFIG_PAGE = "docs/reference/config.md"


def _default_of(key: str):
    node = config_module.Config()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def megatron_flags() -> dict[str, tuple[bool, str]]:
    """Every Megatron-LM flag with a key here: flag -> (takes a value, the override to write)."""
    out = {}
    for key, (megatron, _) in PEER_FLAGS.items():
        flag, _, note = megatron.partition(" ")
        default = _default_of(key)
        if not flag.startswith("--"):
            continue
        if note == "(inverse)":
            out[flag] = (False, f"{key}=false")
        elif not note and isinstance(default, bool):
            out[flag] = (False, f"{key}=true")
        elif not note:
            out[flag] = (True, f"{key}=[{{v}}]" if isinstance(default, list) else f"{key}={{v}}")
    return {**out, **MEGATRON_FLAGS}


def _peer_names() -> dict[str, str]:
    """Names a user may type as `name=value` from habit (Megatron's argument names, GPT-NeoX's
    keys) -> the override to write; none of them is a top-level key here."""
    names = {flag[2:].replace("-", "_"): text for flag, (_, text) in megatron_flags().items()}
    for key, (_, neox) in PEER_FLAGS.items():
        for name in neox.split(" / "):
            if name and name != "-" and " " not in name and "." not in name:
                names.setdefault(name, f"{key}={{v}}")
    names.update(NEOX_KEYS)
    return {k: v for k, v in names.items() if k not in {f.name for f in dataclasses.fields(config_module.Config)}}


def flag_refusal(argv: list, unrecognized: list, command: str) -> str:
    """The one line for flags a command that takes key=value overrides does not have: a peer's
    flag is answered with the override to write, any other with where the keys are listed."""
    known, hints, unknown = megatron_flags(), [], []
    for token in unrecognized:
        if not token.startswith("-"):
            continue
        flag, eq, value = token.partition("=")
        takes, text = known.get(flag, (None, None))
        if text is None:
            unknown.append(token)
            continue
        if takes and not eq and token in argv:   # the value is the next word (argparse may have taken it)
            at = argv.index(token)
            following = []
            for word in argv[at + 1:]:
                if word.startswith("-") or "=" in word:
                    break
                following.append(word)
            value = ",".join(following if "[{v}]" in text else following[:1])
        shown = f"{flag} {value}".strip() if takes else flag
        hints.append(f"{shown} -> {text.replace('{v}', value or '<value>')}")
    out = []
    if hints:
        out.append(f"megatron-id {command} takes settings as key=value overrides, not Megatron-LM flags: "
                   + "; ".join(hints))
    if unknown:
        out.append(f"unrecognized arguments: {' '.join(unknown)}: settings are key=value overrides (e.g. "
                   f"optimizer.lr=3e-4), not flags; `megatron-id {command} --help` lists its flags")
    return ". ".join(out) + f" ({CONFIG_PAGE} lists every key with its Megatron-LM flag and GPT-NeoX key)."


def override_refusal(overrides: list) -> str | None:
    """The one line for an override named as Megatron-LM or GPT-NeoX name it (`train_iters=10`,
    `lr=3e-4`), which the schema would refuse as an unknown key without saying which key it is."""
    names = _peer_names()
    for item in overrides:
        name, _, value = str(item).partition("=")
        if name in names:
            return (f"override '{item}': {name} is a Megatron-LM / GPT-NeoX name; here write "
                    f"{names[name].replace('{v}', value or '<value>')} ({CONFIG_PAGE} maps every key).")
    return None


# ---------------------------------------------------------------- the config schema

@dataclasses.dataclass
class Key:
    name: str            # dotted, as in an override
    type: str
    default: str
    allowed: str
    meaning: str
    megatron: str
    neox: str


def _comments_by_field(source: str, tree: ast.AST) -> dict[tuple[str, str], str]:
    """(class, field) -> the comment beside the field, after the comment lines right above it."""
    lines = source.splitlines()
    trailing = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][:tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:   # dataclass fields (name: type = ...) and enum members (name = ...)
            target = item.target if isinstance(item, ast.AnnAssign) else (
                item.targets[0] if isinstance(item, ast.Assign) and len(item.targets) == 1 else None)
            if not isinstance(target, ast.Name):
                continue
            above, n = [], item.lineno - 2
            while n >= 0 and lines[n].strip().startswith("#"):
                above.insert(0, lines[n].strip().lstrip("#").strip())
                n -= 1
            parts = [" ".join(above)] if above else []
            if item.lineno in trailing:
                parts.append(trailing[item.lineno])
            found[(node.name, target.id)] = "; ".join(parts)
    return found


def _render_fstring(node: ast.JoinedStr, namespace: dict) -> str:
    """A rule's f-string as a reader needs it: module constants filled in, `key={value}` -> `key`."""
    text = ""
    for part in node.values:
        if isinstance(part, ast.Constant):
            text += str(part.value)
        else:
            try:
                text += str(eval(compile(ast.Expression(part.value), "<rule>", "eval"), dict(namespace)))
            except Exception:   # a value known only at run time (another key's setting)
                text += "\0"
    return re.sub(r"=\0", "", text).replace("\0", "...")


def _rules(tree: ast.AST, keys: set[str]) -> dict[str, list[str]]:
    """The checks of config.py written as tuples (key, ..., "must ..."): key -> its rules."""
    rules: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Tuple) and len(node.elts) >= 3 and isinstance(node.elts[0], ast.Constant)
                and isinstance(node.elts[0].value, str)):
            continue
        name = node.elts[0].value
        key = name if name in keys else f"model.{name}" if f"model.{name}" in keys else None
        last = node.elts[-1]
        rule = (last.value if isinstance(last, ast.Constant) and isinstance(last.value, str)
                else _render_fstring(last, vars(config_module)) if isinstance(last, ast.JoinedStr) else None)
        if key and rule and rule.startswith("must"):
            rules.setdefault(key, []).append(rule)
    return rules


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        return f"{_type_name(next(a for a in args if a is not type(None)))} or null"
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {_type_name(args[0])} to {_type_name(args[1])}" if args else "mapping"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "enum"
    return getattr(tp, "__name__", str(tp))


def _shown(value) -> str:
    if isinstance(value, Enum):
        return value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 100_000 else str(value)
    return str(value)


def schema_keys() -> list[Key]:
    source = Path(config_module.__file__).read_text()
    tree = ast.parse(source)
    comments = _comments_by_field(source, tree)
    # the `model` section and its enums are model/spec.py's (config.py re-exports them)
    spec_source = Path(spec_module.__file__).read_text()
    comments.update(_comments_by_field(spec_source, ast.parse(spec_source)))
    # model.mixer's values are MIXER_SPECS' rows (its Mixer enum is made from them): each row's meaning
    comments.update({("Mixer", name): row.meaning for name, row in spec_module.MIXER_SPECS.items()})
    out: list[Key] = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls, {**vars(sys.modules[cls.__module__]), **vars(config_module)})
        for f in dataclasses.fields(cls):
            tp, name = hints[f.name], prefix + f.name
            if dataclasses.is_dataclass(tp):
                walk(tp, name + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            enum = next((a for a in (tp, *typing.get_args(tp)) if isinstance(a, type) and issubclass(a, Enum)), None)
            megatron, neox = PEER_FLAGS.get(name, ("-", "-"))
            allowed = "<br>".join(f"`{m.value}`" + (f": {comments[(enum.__name__, m.name)]}"
                                                      if comments.get((enum.__name__, m.name)) else "")
                                  for m in enum) if enum else ""
            out.append(Key(name, _type_name(tp), _shown(default), allowed, comments.get((cls.__name__, f.name), ""),
                           megatron, neox))

    walk(config_module.Config, "")
    rules = _rules(tree, {k.name for k in out})
    for k in out:
        if k.name in rules:
            k.allowed = "<br>".join(filter(None, [k.allowed, *rules[k.name]]))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or "-"


def config_page() -> str:
    keys = schema_keys()
    lines = ["# Config reference", "",
             "Generated by `python -m megatron_id.reference` from `megatron_id/config.py`; do not edit "
             "(tests/test_docs.py fails when it is out of date). Every key is set in a YAML file (`--config`, "
             "repeatable, later files win) or as a `key=value` override on the command line (last wins); an unknown "
             "key or a bad value is refused with its name and the fix before any work.", "",
             "Allowed values: the enums, and the rules `megatron_id/config.py` checks when a config is loaded "
             "(`...`: another key's value). The last two columns name the nearest Megatron-LM flag and GPT-NeoX key; "
             "\"(inverse)\" means the peer's switch says the opposite.", ""]
    sections = {}
    for k in keys:
        sections.setdefault(k.name.split(".")[0] if "." in k.name else "top level", []).append(k)
    hints = typing.get_type_hints(config_module.Config, vars(config_module))
    docs = {f.name: hints[f.name] for f in dataclasses.fields(config_module.Config)
            if dataclasses.is_dataclass(hints[f.name])}
    for section, items in sections.items():
        lines += [f"## {section}", ""]
        doc = docs.get(section).__doc__ if section in docs else None
        if doc and not doc.startswith(docs[section].__name__ + "("):   # dataclasses invent one when none is written
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | allowed | meaning | Megatron-LM | GPT-NeoX |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| `{k.name}` | {k.type} | `{_cell(k.default)}` | {_cell(k.allowed)} | {_cell(k.meaning)} | "
                  f"{_cell(k.megatron)} | {_cell(k.neox)} |" for k in items]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- the command lines

def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"_reference_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the script is executed
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """(how it is run, its parser) for every command; megatron-id's subcommands that hand over to
    another parser (preprocess, kernel-resources) are listed under that parser."""
    from data_tools import inspect as data_inspect
    from data_tools import merge, preprocess, train_tokenizer

    from .cli import build_parser
    from .ops.interdomain.resources import build_parser as resources_parser
    out = [("megatron-id", build_parser()), ("megatron-id preprocess", preprocess.build_parser()),
           ("megatron-id kernel-resources", resources_parser()),
           ("python -m data_tools.train_tokenizer", train_tokenizer.build_parser()),
           ("python -m data_tools.inspect", data_inspect.build_parser()),
           ("python -m data_tools.merge", merge.build_parser())]
    for script in ("launch/slurm/preprocess_submit.py", "launch/scaling/grid.py", "launch/reproduce.py",
                   "launch/gpu_check.py"):
        out.append((f"python {script}", _load_script(ROOT / script).build_parser()))
    return out


def _subcommands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            return [(name, sub, helps.get(name)) for name, sub in action.choices.items()]
    return []


def _portable(default) -> str:
    """A default path inside (or beside) the checkout, written relative to it: the page must not
    depend on where the repository was cloned."""
    text = str(default)
    for base, shown in ((ROOT, "."), (ROOT.parent, "..")):
        if text.startswith(str(base) + "/"):
            return shown + text[len(str(base)):]
    return text


def _flag_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = ", ".join(f"`{s}`" for s in a.option_strings) if a.option_strings else f"`{a.metavar or a.dest}`"
        if a.nargs == 0:
            value = "(switch)"
        else:
            value = a.metavar or (a.type.__name__ if isinstance(a.type, type) else "text")
            if a.choices:
                value = "{" + ", ".join(map(str, a.choices)) + "}"
            if a.nargs in ("+", "*"):
                value += " ..." if a.nargs == "+" else " ... (any number)"
            elif a.nargs == argparse.REMAINDER:
                value = "the rest of the line"
        required = a.required and a.nargs not in ("*", "?", argparse.REMAINDER)   # argparse marks those too
        default = ("required" if required else "-" if a.default in (None, False, argparse.SUPPRESS)
                   or a.nargs == 0 else f"`{_portable(a.default)}`")
        help_text = (a.help or "").replace("%(default)s", str(a.default)).replace("%%", "%")
        rows.append(f"| {name} | {_cell(str(value))} | {_cell(default)} | {_cell(' '.join(help_text.split()))} |")
    return rows


def cli_page() -> str:
    lines = ["# Command-line reference", "",
             "Generated by `python -m megatron_id.reference` from the commands' argparse parsers; do not edit "
             "(tests/test_docs.py fails when it is out of date). `megatron-id train`, `params`, `plan` and "
             "`kernel-resources` also take config `key=value` overrides anywhere on the line: "
             "[config.md](config.md) lists every key.", ""]
    toc, body = [], []

    commands = parsers()
    own_page = {title for title, _ in commands}

    def emit(title, parser, summary=None):
        anchor = re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")   # GitHub's heading ids
        toc.append(f"- [`{title}`](#{anchor})" + (f": {summary}" if summary else ""))
        body.extend([f"## {title}", ""])
        description = summary or parser.description
        if description:
            body.extend([" ".join(description.split()), ""])
        rows = _flag_rows(parser)
        if rows:
            body.extend(["| flag | value | default | meaning |", "|---|---|---|---|", *rows, ""])
        for name, sub, help_text in _subcommands(parser):
            if f"{title} {name}" not in own_page:   # preprocess, kernel-resources: their own parsers follow
                emit(f"{title} {name}", sub, help_text)

    for title, parser in commands:
        emit(title, parser)
    return "\n".join(lines + toc + [""] + body)


def pages() -> dict[str, str]:
    return {"config": config_page(), "cli": cli_page()}


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_id.reference", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is out of date")
    args = p.parse_args(argv)
    stale = []
    for name, text in pages().items():
        path = PAGES[name]
        if path.is_file() and path.read_text() == text:
            continue
        if args.check:
            stale.append(_relative(path))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic_text(path, text)
        print(f"wrote {_relative(path)}")
    if stale:
        print(f"out of date: {', '.join(stale)}: run python -m megatron_id.reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
