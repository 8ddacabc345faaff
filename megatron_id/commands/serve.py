"""`megatron-id serve`: an OpenAI-compatible completions server (inference/server.py)."""
from __future__ import annotations

from ..errors import BadOptionError
from .options import MISMATCH_HELP, add_verify_arg


def add_parser(sub) -> None:
    sv = sub.add_parser("serve", allow_abbrev=False,
                        help="an OpenAI-compatible completions server (continuous batching over state slots)")
    sv.add_argument("--checkpoint", required=True, help="train.save folder, iter_ folder or exported folder")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--slots", type=int, default=8, help="sequences decoded together (default 8)")
    sv.add_argument("--max-model-len", type=int, default=None,
                    help="prompt + max_tokens of one request (default: the model's seq_length); softmax layers "
                         "keep a KV cache this long per slot")
    sv.add_argument("--max-pending", type=int, default=None,
                    help="requests queued or running before new ones get 503 (default 4 x --slots)")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM / SIGINT: seconds the running requests get to finish (default 30)")
    sv.add_argument("--prefill-chunk-size", type=int, default=2048)
    sv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the folder's)")
    sv.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    sv.add_argument("--tokenizer", help="tokenizer.json (default: the one the checkpoint or export records)")
    sv.add_argument("--allow-tokenizer-mismatch", action="store_true", help=MISMATCH_HELP)
    sv.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    add_verify_arg(sv)
    sv.set_defaults(func=run)


def run(args) -> int:
    """An OpenAI-compatible completions server over continuous batching (inference/server.py)."""
    from ..inference.generate import check_options  # torch: not at import (cli.py)
    for option, value, least in (("--slots", args.slots, 1), ("--port", args.port, 0),
                                 ("--max-pending", args.max_pending, 1), ("--max-model-len", args.max_model_len, 2),
                                 ("--threads", args.threads, 1)):
        if value is not None and value < least:
            raise BadOptionError(f"{option} {value}: at least {least}.")
    if args.port > 65535 or args.drain_timeout < 0:
        raise BadOptionError(f"--port {args.port} / --drain-timeout {args.drain_timeout}: a port up to 65535, "
                             f"a timeout of at least 0 seconds.")
    check_options(0, prefill_chunk_size=args.prefill_chunk_size)
    from ..inference.server import serve
    return serve(args)
