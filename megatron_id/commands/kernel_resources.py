"""`megatron-id kernel-resources`: its own parser (ops/interdomain/resources.py), so the rest of
the line is handed over whole."""
from __future__ import annotations

from ..errors import run_guarded


def add_parser(sub) -> None:
    sub.add_parser("kernel-resources", help="compile the Triton core for sm_80 / sm_90 here and report shared "
                                            "memory, registers, spills, tensor cores (see --help of it)")


def run(args) -> int:
    """args.argv: the words after `kernel-resources`; args.debug: --debug was given."""
    from ..ops.interdomain.resources import main as resources_main  # torch: not at import (cli.py)
    return run_guarded("megatron-id kernel-resources", lambda: resources_main(args.argv), debug=args.debug)
