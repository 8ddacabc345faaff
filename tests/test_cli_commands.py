"""megatron-id as a dispatcher over megatron_id/commands/ (issue 42): every subcommand is one
module with add_parser(sub) and run(args), and the parser is built without torch or DeepSpeed,
so `megatron-id --help` and a refused flag stay fast (cli.py's comment has the timings)."""
from __future__ import annotations

import argparse
import subprocess
import sys

from conftest import ROOT


def test_every_subcommand_is_a_module_with_add_parser_and_run():
    from megatron_id import cli
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert len(cli.COMMANDS) == len(sub.choices)
    for module in cli.COMMANDS:
        assert callable(module.add_parser) and callable(module.run), module.__name__
    for name, command in sub.choices.items():
        if name in cli.HANDED_OVER:   # their own parsers get the rest of the line
            continue
        assert command.get_default("func").__module__.startswith("megatron_id.commands."), name


def test_the_parser_and_a_refused_flag_import_no_torch():
    code = ("import sys\n"
            "from megatron_id.cli import main\n"
            "try:\n"
            "    main(['train', '--bogus'])\n"
            "except SystemExit as e:\n"
            "    assert e.code == 2, e.code\n"
            "heavy = sorted(m for m in ('torch', 'deepspeed') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    assert "unrecognized arguments: --bogus" in _python(code).stderr


def _python(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter (what it imports is the point); it must succeed."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_counting_a_model_imports_no_torch_dynamo():
    """`params` (and every command that builds a model on the meta device, or loads one) starts
    without torch._dynamo: its import is ~1.1 s, as long as torch's own (3.3 s -> 1.7 s for
    `megatron-id params` on 2 cores). It came from torch's default draw at construction
    (layers.NormalInit.reset_parameters) and a compiler.disable decorator (ops/attention.py)."""
    code = ("import sys\n"
            "from megatron_id.cli import main\n"
            "assert main(['params', '--config', 'configs/model/125m-hybrid.yaml']) == 0\n"
            "assert 'torch._dynamo' not in sys.modules\n")
    assert "decode state, all layers" in _python(code).stdout
