"""`megatron-id serve`: an OpenAI-compatible completions server (inference/server.py)."""
from __future__ import annotations

import argparse
import os

from ..errors import BadOptionError
from .options import MISMATCH_HELP, add_verify_arg

API_KEY_ENV = "MEGATRON_ID_API_KEY"   # (inference/server.py reads it; named here to check it before any work)


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
                    help="requests queued or running before new ones get 503 with Retry-After (default 1024, "
                         "or 4 x --slots if more): those past the slots wait their turn")
    sv.add_argument("--drain-timeout", type=float, default=30.0,
                    help="on SIGTERM / SIGINT: seconds the running requests get to finish (default 30)")
    sv.add_argument("--prefill-chunk-size", type=int, default=2048)
    sv.add_argument("--prefill-batch", type=int, default=8,
                    help="prompts waiting to be read that the prefill thread reads in one call, left-padded in "
                         "groups of similar length (default 8; 1: one at a time, as before issue 55; models "
                         "with softmax layers read one at a time)")
    sv.add_argument("--idle-reads", action=argparse.BooleanOptionalAction, default=True,
                    help="on a CPU, while no sequence decodes, the engine thread reads waiting prompts too, beside "
                         "the prefill thread (up to 1,024 tokens at a time: the decode side's cores would idle "
                         "otherwise; a GPU reads on its own stream). Default on; --no-idle-reads: the prefill "
                         "thread alone, as before issue 55")
    sv.add_argument("--prefix-cache-mib", type=float, default=512.0,
                    help="memory for the states after prompt prefixes shared by several requests (a system "
                         "prompt, few-shot examples): a prompt starts from the longest one it begins with; "
                         "least recently used evicted (default 512; 0: off; inference/prefix_cache.py)")
    sv.add_argument("--inline-prefill", action="store_true",
                    help="read prompts on the engine thread between decode steps (each prompt stalls every "
                         "stream for its length) instead of on a thread of their own beside them (default)")
    sv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the folder's)")
    sv.add_argument("--threads", type=int, default=None,
                    help="torch threads (default on a CPU: half the cores, the prefill thread and the decode "
                         "steps each using that many; with --inline-prefill or on a GPU, torch's choice)")
    sv.add_argument("--api-key", default=None,
                    help="clients must send 'Authorization: Bearer KEY' (every endpoint but /health); default: "
                         "$MEGATRON_ID_API_KEY, which keeps the key out of the process list; none: no key")
    sv.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                    help="a host name clients may address the server by (Host and Origin headers; repeatable). "
                         "On a loopback --host, localhost and 127.0.0.1 are allowed and every other name refused "
                         "(403: DNS rebinding); on another --host, only the names given, or any if none")
    sv.add_argument("--max-pending-per-client", type=int, default=None,
                    help="requests one client address may have queued or running; the next gets 429 "
                         "(default: no limit but --max-pending)")
    sv.add_argument("--read-timeout", type=float, default=30.0,
                    help="seconds a client has to send a request's body; then 408 (default 30)")
    sv.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds a request may take in all; then it is cancelled with 504 (default 600; 0: none)")
    sv.add_argument("--max-body-size", type=float, default=4.0,
                    help="largest request body in MiB; larger gets 413 (default 4)")
    sv.add_argument("--access-log", default=None, metavar="FILE",
                    help="one line per request, appended to FILE (- for stderr); default: none")
    sv.add_argument("--tokenizer", help="tokenizer.json (default: the one the checkpoint or export records)")
    sv.add_argument("--allow-tokenizer-mismatch", action="store_true", help=MISMATCH_HELP)
    sv.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    add_verify_arg(sv)
    sv.set_defaults(func=run)


def check_api_key(key: str, where: str, for_none: str) -> None:
    """Refuse a key that no client can send, so that every request would get 401 (the key itself
    is never printed): empty or blank (also a variable set from an unset one, KEY=$UNSET, which
    must not serve without a key), whitespace at either end (HTTP drops it from the header; a
    newline read from a key file) or a control character (no header can hold one)."""
    if not key.strip():
        raise BadOptionError(f"{where} is {'empty' if not key else 'blank (only whitespace)'}: every request would "
                             f"get 401. Give a key, or {for_none} to serve without one.")
    if key != key.strip():
        end = "start" if key[0].isspace() else "end"
        raise BadOptionError(f"{where} has whitespace at its {end} (a newline read from a key file?): clients cannot "
                             f"send it (HTTP drops it from the Authorization header), so every request would get "
                             f"401. Remove it (from a file: \"$(tr -d '[:space:]' < keyfile)\").")
    bad = next((i for i, c in enumerate(key) if not c.isprintable()), None)
    if bad is not None:
        raise BadOptionError(f"{where} holds a control character ({key[bad]!r} at character {bad + 1} of {len(key)}): "
                             f"no HTTP header can carry it, so every request would get 401. Give a key of "
                             f"printable characters.")


def run(args) -> int:
    """An OpenAI-compatible completions server over continuous batching (inference/server.py)."""
    from ..inference.generate import check_options  # torch: not at import (cli.py)
    for option, value, least in (("--slots", args.slots, 1), ("--port", args.port, 0),
                                 ("--max-pending", args.max_pending, 1), ("--max-model-len", args.max_model_len, 2),
                                 ("--threads", args.threads, 1), ("--prefill-batch", args.prefill_batch, 1)):
        if value is not None and value < least:
            raise BadOptionError(f"{option} {value}: at least {least}.")
    for option, value in (("--read-timeout", args.read_timeout), ("--max-body-size", args.max_body_size)):
        if not value > 0:
            raise BadOptionError(f"{option} {value}: more than 0.")
    if not args.request_timeout >= 0:
        raise BadOptionError(f"--request-timeout {args.request_timeout}: at least 0 (0: no limit).")
    if not 1 / 1024 <= args.max_body_size < float("inf"):   # (inf failed later, an OverflowError traceback)
        raise BadOptionError(f"--max-body-size {args.max_body_size}: the largest body in MiB, from 0.001 (1 KiB) "
                             f"to any finite size; default 4.")
    if args.api_key is not None:
        check_api_key(args.api_key, "--api-key", "leave the flag out")
    elif API_KEY_ENV in os.environ:   # (the flag, when given, is the key: the variable is not read)
        check_api_key(os.environ[API_KEY_ENV], f"${API_KEY_ENV}", "unset it")
    for name in args.allowed_host or ():   # (matched against the Host header's name: never a scheme or a port)
        bracketed = name.startswith("[")   # an IPv6 address, [::1], ends with its bracket: no port after it
        if not name.strip() or "/" in name or (not name.endswith("]") if bracketed else name.count(":") == 1):
            raise BadOptionError(f"--allowed-host {name!r}: give a host name or address only, without a scheme or "
                                 f"a port (clients' Host headers are matched on the name), e.g. --allowed-host "
                                 f"{(name.split('//')[-1].split('/')[0].rsplit(':', 1)[0] or 'example.com')}.")
    if args.max_pending_per_client is not None and args.max_pending_per_client < 1:
        raise BadOptionError(f"--max-pending-per-client {args.max_pending_per_client}: at least 1.")
    if args.port > 65535 or not args.drain_timeout >= 0:   # (not >=: nan too)
        raise BadOptionError(f"--port {args.port} / --drain-timeout {args.drain_timeout}: a port up to 65535, "
                             f"a timeout of at least 0 seconds.")
    if not 0 <= args.prefix_cache_mib < float("inf"):   # (not <=: nan too)
        raise BadOptionError(f"--prefix-cache-mib {args.prefix_cache_mib}: the prefix cache's memory in MiB, at "
                             f"least 0 (0: off) and finite; default 512.")
    check_options(0, prefill_chunk_size=args.prefill_chunk_size)
    try:
        import aiohttp  # noqa: F401  (the server's HTTP side)
    except ImportError:
        raise BadOptionError("megatron-id serve needs aiohttp: pip install 'megatron_id[serve]'.") from None
    from ..inference.server import serve
    return serve(args)
