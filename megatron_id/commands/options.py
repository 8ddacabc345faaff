"""Flags and parsing shared by several commands."""
from __future__ import annotations

import argparse

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
    the positional list at the first option and rejects the rest as unrecognized)."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = list(args.overrides) + extra   # after the first ones: the order is kept
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args
