"""Flags and parsing shared by several commands."""
from __future__ import annotations

import argparse
import sys

# every command that pairs a trained model with a tokenizer checks it is the model's own
MISMATCH_HELP = "use a tokenizer other than the one the model was trained with, on purpose"


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", default=[], metavar="YAML",
                   help="config file; repeat to merge several (later wins)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="overrides, e.g. model.mixer=softmax model.n_layers=2")


def add_verify_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verify", choices=["sample", "full"], default="sample",
                   help="an export's files against its manifest.json before use: sample (default: every size, small "
                        "files whole, 16 chunks of 4 MiB of each large one) or full (every byte)")


def parse_with_overrides_anywhere(parser: argparse.ArgumentParser, argv):
    """`--config` may come after the key=value overrides, as users type it (argparse alone ends
    the positional list at the first option and rejects the rest as unrecognized). A command that
    takes overrides answers a flag it does not have in one line: a Megatron-LM flag with the
    override to write (`--lr 3e-4` -> optimizer.lr=3e-4), any other with where the keys are, and
    so does an override named as Megatron-LM or GPT-NeoX name it (`train_iters=10`); argparse's
    usage block said neither."""
    args, extra = parser.parse_known_args(argv)
    takes_overrides = hasattr(args, "overrides")
    if extra and takes_overrides and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = list(args.overrides) + extra   # after the first ones: the order is kept
    elif extra and takes_overrides:
        from ..reference import flag_refusal  # (no torch: the parser stays light)
        _refuse(parser, flag_refusal(list(argv), extra, getattr(args, "command", "")))
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if takes_overrides:
        from ..reference import override_refusal
        said = override_refusal(args.overrides)
        if said:
            _refuse(parser, said)
    return args


def _refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """argparse's exit (status 2), with one line instead of its usage block."""
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
