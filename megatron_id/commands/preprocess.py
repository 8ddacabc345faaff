"""`megatron-id preprocess` = python -m data_tools.preprocess: its own flags (Megatron's names),
so the rest of the line is handed over whole."""
from __future__ import annotations


def add_parser(sub) -> None:
    sub.add_parser("preprocess", help="tokenize a corpus into .bin/.idx (see --help of it)")


def run(args) -> int:
    """args.argv: the words after `preprocess`; args.debug: --debug was given."""
    # imported here: tens of milliseconds that `megatron-id --help` would pay (cli.py)
    from data_tools.preprocess import main as preprocess_main
    return preprocess_main(args.argv, debug=args.debug)
