"""The `megatron-id` command. Subcommands grow with the project; each is small.

    megatron-id params --config configs/model/125m.yaml [key=value ...]
    megatron-id preprocess --input ... --tokenizer ... --output-prefix ...   (= python -m data_tools.preprocess)
    megatron-id train --nproc N --config run.yaml [key=value ...]          (or under torchrun / srun, without --nproc)
    megatron-id export-hf --checkpoint runs/x/checkpoints --output runs/x/hf
    megatron-id import-hf --input runs/x/hf --output runs/y/checkpoints --tensor-parallel 2
    megatron-id convert --checkpoint runs/y/checkpoints --layer-pattern IIIAIIIA --output runs/z/checkpoints
    megatron-id generate --checkpoint runs/x/hf --prompt "The water cycle" --max-new-tokens 50
    megatron-id check-checkpoint runs/x/checkpoints [--all]
    megatron-id kernel-resources --config configs/model/1p3b.yaml [--arch sm_80 sm_90]

This module only dispatches: each subcommand is a module of megatron_id/commands/ with
`add_parser(sub)` and `run(args)`.
"""
from __future__ import annotations

import argparse
import os
import sys

# Every command module is imported here, for `--help` and to refuse a bad flag before any work.
# So they import torch, DeepSpeed and the model only inside their `run` (a startup-time reason,
# not a cycle): `megatron-id --help` and `megatron-id train --bogus` take 0.24 s, where they took
# 1.40 s while eval's parser module pulled torch in (2 CPU cores, 2026-12). Keep a new command's
# heavy imports inside its `run` too; tests/test_cli_commands.py fails when torch comes back.
from .commands import (
    check_checkpoint,
    convert,
    convert_checkpoint,
    export_hf,
    generate,
    import_hf,
    job_prepare,
    kernel_resources,
    params,
    plan,
    preprocess,
    serve,
    serve_vllm,
    train,
)
from .commands import eval as eval_command
from .commands.options import parse_with_overrides_anywhere
from .errors import run_guarded

# in the order `megatron-id --help` lists them
COMMANDS = (params, preprocess, kernel_resources, train, check_checkpoint, export_hf, import_hf, convert, generate,
            serve, serve_vllm, convert_checkpoint, job_prepare, plan, eval_command)

# Their own parsers (Megatron's flag names; ops/interdomain/resources.py): the rest of the line is
# handed over whole, unparsed here.
HANDED_OVER = {"preprocess": preprocess, "kernel-resources": kernel_resources}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-id", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an expected error too (or MEGATRON_ID_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv   # the traceback of an expected error (also MEGATRON_ID_DEBUG=1)
    argv = [a for a in argv if a != "--debug"]
    if argv[:1] and argv[0] in HANDED_OVER:
        return HANDED_OVER[argv[0]].run(argparse.Namespace(argv=argv[1:], debug=debug))
    parser = build_parser()
    args = parse_with_overrides_anywhere(parser, argv)
    return run_guarded("megatron-id", lambda: args.func(args), debug=debug)


def entry() -> None:
    """The `megatron-id` program. Once a training process group exists, the process ends with
    os._exit after stdout/stderr are flushed, whatever the status: C++ objects of DeepSpeed and
    torch.distributed torn down by the interpreter at exit can abort ("terminate called without
    an active exception": exit 1 after a successful run, -6 after a refused one), which breaks
    SLURM `afterok` chains, requeue logic and our one-line errors."""
    status = main()
    if train.TEARDOWN:   # (only `train` registers teardown steps: commands/train.py)
        for fn in train.TEARDOWN:
            fn()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
