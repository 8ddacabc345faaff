"""`megatron-id serve`: an HTTP server with OpenAI's completions API over continuous batching.

    megatron-id serve --checkpoint runs/x/hf --port 8000 --slots 16
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "The water cycle", "max_tokens": 32, "temperature": 0}'

Endpoints: POST /v1/completions (streaming with "stream": true, as server-sent events),
GET /v1/models, GET /health: inference/openai_app.py, one method each; this module runs the
engine and the process. The HTTP side is aiohttp (asyncio); the model runs on one engine
thread that owns a ContinuousBatcher (inference/batching.py): a fixed pool of --slots sequences
decoded together by the fused step, each request taking a free slot after its prompt is
prefilled (on a prefill thread beside the decode steps: a burst of long prompts does not stall
the running streams) and leaving it at its last token. Interdomain and S4D-only layers keep a constant-size
state per slot, so memory does not grow with the clients; softmax layers (hybrids) get a KV cache
of --max-model-len tokens per slot, allocated once.

Backpressure: at most --max-pending requests are queued or running; the next gets 503 with
Retry-After (--max-pending-per-client: 429 per client address). A bad request gets a 4xx JSON
error (OpenAI's body) saying which field and why, before any work (api.py: strict JSON and
UTF-8, finite values in range, the prompt's length on its bytes before it is tokenized, off the
event loop). A request whose step fails gets a 500 (or an error event in its stream); the
others and the engine go on. If the engine cannot, /health says "failed" (503) and the process
exits 1, for a supervisor to restart it.

Access: --api-key (or $MEGATRON_ID_API_KEY) on every endpoint but /health (401); JSON bodies
only (415: a text/plain POST from a web page of another site); on a loopback --host, a Host or
Origin of another name is refused (403: DNS rebinding); --read-timeout for a body (408),
--request-timeout for a whole request (504); a client that goes away cancels its request.

SIGTERM or SIGINT: the server keeps listening but answers new requests 503, lets the running and
queued requests finish for up to --drain-timeout seconds, cancels what is left (finish_reason
"cancelled"), and exits 0. A second signal stops it at once.
"""
from __future__ import annotations

import asyncio
import collections
import ipaddress
import json
import queue
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from aiohttp import web

from ..data.tokenizer import chat_template_of
from ..errors import BadOptionError
from .api import ChatTemplate
from .batching import ContinuousBatcher, Request
from .fused_decode import check_kv_pool, fused_decode_refusal
from .generate import load_trained, resolve_device
from .openai_app import DRAIN, HURRY, Busy, build_app, json_protocol_errors
from .prefix_cache import PrefixCache

DEFAULT_MAX_PENDING = 1024   # requests queued or running before 503 (at least 4 x --slots); vLLM queues without bound
__all__ = ["DRAIN", "Engine", "ServeLimits", "build_app", "drain_then_stop", "serve"]   # (build_app: openai_app.py)

FAILED_STEPS_FATAL = 3   # the shared decode step failing this many times in a row: the engine cannot go on
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
API_KEY_ENV = "MEGATRON_ID_API_KEY"


@dataclass
class ServeLimits:
    """What `megatron-id serve` lets one request or client do (the defaults of its flags)."""
    drain_timeout: float = 30.0
    api_key: str | None = None            # every endpoint but /health needs "Authorization: Bearer KEY"
    allowed_hosts: set | None = None      # Host / Origin names accepted (None: any)
    max_pending_per_client: int | None = None   # per remote address (None: only --max-pending)
    read_timeout: float = 30.0            # seconds to receive a request's body
    request_timeout: float = 600.0        # seconds a request may take in all (0: no limit)
    max_body_size: int = 4 * 2**20


def loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Engine:
    """The batcher on its own thread. Requests come in through a queue; each sequence's tokens go
    out to its HTTP request's asyncio queue as (choice, token, finish_reason or None), choice the
    request's index among those submitted together (a request's prompts x n); a sequence that
    failed gets (choice, None, "error") and the engine goes on. What the batcher cannot contain (the engine loop itself
    failing, or the shared decode step failing FAILED_STEPS_FATAL times in a row) stops it:
    `failure` is set, every client gets its error, and `on_fatal` (the server's shutdown) is
    called, so that the process exits non-zero and a supervisor restarts it."""

    def __init__(self, batcher: ContinuousBatcher, max_pending: int, eos_id, on_fatal=None):
        self.batcher, self.max_pending, self.eos_id = batcher, max_pending, eos_id
        self.on_fatal = on_fatal
        self.inbox: queue.Queue = queue.Queue()
        self.pending = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="megatron-id-engine", daemon=True)
        self.routes = {}   # sequence id -> (loop, asyncio queue, ticket, sequence, choice)
        self.finished = collections.Counter()   # by finish_reason (GET /health)

    def start(self):
        self.thread.start()

    def submit(self, requests: list[Request], loop) -> tuple[list[dict], asyncio.Queue]:
        """Queue a request's sequences, all or none (Busy: over --max-pending); returns a ticket
        each (the HTTP side sets "cancelled" when the client goes away) and their shared queue."""
        for request in requests:
            request.eos_id = None if request.ignore_eos else self.eos_id
            self.batcher.check(request)           # BadOptionError: 400
        with self.lock:
            if self.failure is not None:
                raise Busy()
            if self.pending + len(requests) > self.max_pending:
                raise Busy()
            self.pending += len(requests)
        out: asyncio.Queue = asyncio.Queue()
        tickets = [{"cancelled": False} for _ in requests]
        for choice, (request, ticket) in enumerate(zip(requests, tickets)):
            self.inbox.put((request, out, loop, ticket, choice))
        return tickets, out

    def cancel_all(self) -> None:
        self.inbox.put(("cancel-all", None, None, None, None))

    def busy(self) -> int:
        with self.lock:
            return self.pending

    def stop(self) -> None:
        self.stopped.set()
        self.inbox.put(None)
        self.thread.join(timeout=60)
        self.batcher.close()

    def _deliver(self, sequence, item) -> None:
        loop, out, _, _, choice = self.routes[sequence.id]
        loop.call_soon_threadsafe(out.put_nowait, (choice, *item))

    def _done(self, sequence) -> None:
        _, _, ticket, _, _ = self.routes.pop(sequence.id)
        # (a stop string ends a sequence on the HTTP side, which cancels it here: counted as the
        # client was told, "stop", not "cancelled")
        self.finished[ticket.get("finish_reason") or sequence.finish_reason] += 1
        with self.lock:
            self.pending -= 1

    def _take(self, item) -> None:
        if item is None:
            return
        request, out, loop, ticket, choice = item
        if request == "cancel-all":
            for sequence in list(self.batcher.waiting) + list(self.batcher.running.values()):
                self.batcher.cancel(sequence)
            return
        sequence = self.batcher.submit(request)
        self.routes[sequence.id] = (loop, out, ticket, sequence, choice)

    def _hand_out(self, events: list) -> None:
        for sequence, token, finished in events:
            if token is None:
                print(f"megatron-id serve: request {sequence.request.name or sequence.id} failed: "
                      f"{type(sequence.error).__name__}: {sequence.error}", file=sys.stderr, flush=True)
            # (with logprobs: the token's scores, appended on this thread before it is handed out)
            scored = sequence.scored[len(sequence.tokens) - 1] if sequence.request.logprobs is not None and \
                token is not None else None
            self._deliver(sequence, (token, sequence.finish_reason if finished else None, scored))
            if finished:
                self._done(sequence)

    def _step(self) -> None:
        if not self.batcher.busy():
            self._take(self.inbox.get())         # idle: wait for work
        while True:                              # and whatever else has arrived
            try:
                self._take(self.inbox.get_nowait())
            except queue.Empty:
                break
        for _, _, ticket, sequence, _ in self.routes.values():   # their clients went away
            if ticket["cancelled"] and not sequence.cancelled:
                self.batcher.cancel(sequence)
        before = list(self.batcher.waiting) + list(self.batcher.running.values())
        self._hand_out(self.batcher.step(deliver=self._hand_out))   # the decode step's tokens go out first
        for sequence in before:   # cancelled ones end without a token
            if sequence.finish_reason == "cancelled" and sequence.id in self.routes:
                self._deliver(sequence, (None, "cancelled"))
                self._done(sequence)
        if self.batcher.failed_decodes >= FAILED_STEPS_FATAL:
            raise RuntimeError(f"the decode step failed {self.batcher.failed_decodes} times in a row")

    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                self._step()
        except BaseException as e:   # the engine cannot go on: every client gets its error, the server exits
            with self.lock:
                self.failure = e
                self.pending = 0
            for loop, out, _, _, choice in list(self.routes.values()):
                loop.call_soon_threadsafe(out.put_nowait, (choice, None, "error"))
            self.routes.clear()
            print(f"megatron-id serve: the engine stopped: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if self.on_fatal is not None:
                self.on_fatal()


def drain_then_stop(app, stop) -> callable:
    """The handler of SIGTERM / SIGINT (and of the engine stopping): drain while still listening,
    so that new requests get 503, not a refused connection; then `stop()` the server, once. A
    second call stops it at once: what runs is cancelled now (app[HURRY]) and the drain ends.
    (Before, the second call stopped the server while the first drain went on: aiohttp's shutdown
    then drained again, up to --drain-timeout, and the first drain's own stop, raised during that
    shutdown, ended the process with exit code 1 and no closing line.)"""
    state = {"stopping": False, "stopped": False}

    def stop_once():
        if not state["stopped"]:
            state["stopped"] = True
            stop()

    async def drain_and_stop():
        await app[DRAIN]()
        stop_once()

    def on_signal():
        if state["stopping"]:
            app[HURRY]()
            stop_once()
            return
        state["stopping"] = True
        asyncio.get_running_loop().create_task(drain_and_stop())
    return on_signal


def raise_graceful_exit() -> None:
    """Out of the event loop, into run_app, which closes the sockets and cleans up."""
    from aiohttp.web_runner import GracefulExit
    loop = asyncio.get_running_loop()

    def stop():
        raise GracefulExit()
    loop.call_soon(stop)


def check_listen_address(host: str, port: int) -> int:
    """--host and --port are tried (a socket bound and closed) before the model is loaded: an
    address that is not one of this machine's, a name that does not resolve or a port in use is
    named with its flag, not found after minutes of loading as an OSError without one. Returns
    the port: for --port 0, the free one the system chose (which the server then listens on, so
    that the line saying where it listens names it; it said :0)."""
    import errno
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise BadOptionError(f"--host {host}: not an address or a host name that resolves ({err}): give an address "
                             f"of this machine, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every "
                             f"interface).") from None
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as aiohttp binds
            probe.bind(address)
            return probe.getsockname()[1]
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise BadOptionError(f"--port {port}: already in use on {host} (another server?): stop it or choose "
                                 f"another --port.") from None
        if err.errno == errno.EADDRNOTAVAIL:
            raise BadOptionError(f"--host {host}: not an address of this machine: give one of its addresses, e.g. "
                                 f"127.0.0.1 (this machine only) or 0.0.0.0 (every interface).") from None
        if err.errno == errno.EACCES:
            raise BadOptionError(f"--port {port}: permission denied (ports below 1024 need privileges): choose a "
                                 f"port from 1024 up, e.g. 8000.") from None
        raise BadOptionError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err}).") from None


def serve(args) -> int:
    """The body of `megatron-id serve` (options checked by the CLI before this loads the model).
    Exits 0 after a drain, 1 when the engine stopped on a failure (so a supervisor restarts it)."""
    import os

    from ..allocator import keep_freed_memory
    # freed blocks kept, not unmapped and faulted in again at the next read: with the prefill and
    # engine threads reading side by side, 64 clients' first tokens p50 0.52 -> 0.43 s and steady
    # (benchmarks/serve_load.py, 5 rounds: 0.43-0.58 -> 0.43-0.44); a large request's
    # release_memory (malloc_trim) still gives memory back
    keep_freed_memory()
    device = resolve_device(args.device)
    port = check_listen_address(args.host, args.port)   # before the model is loaded
    limits = serve_limits(args, os.environ.get(API_KEY_ENV))
    access_log = open_access_log(args.access_log)
    trained = load_trained(args.checkpoint, args.tokenizer, args.allow_tokenizer_mismatch, args.verify)
    model = trained.model
    why = fused_decode_refusal(model)
    if why:
        raise BadOptionError(f"megatron-id serve decodes with the fused step: {why}.")
    model.to(device)
    torch.set_num_threads(args.threads or default_threads(device, args.inline_prefill))
    name = args.served_model_name or Path(args.checkpoint).resolve().name
    max_model_len = args.max_model_len or trained.cfg.seq_length
    defaulted = '' if args.max_model_len else ' (the seq_length of the model)'
    check_kv_pool(model, args.slots, max_model_len, device,
                  f"--max-model-len {max_model_len:,}{defaulted} x --slots {args.slots:,}",
                  "Lower --max-model-len or --slots")
    # (the cache's blocks are the chunked form's chunks: a read split there computes what one read does)
    cache = (PrefixCache(block=trained.cfg.chunk_size, max_bytes=int(args.prefix_cache_mib * 2**20))
             if args.prefix_cache_mib > 0 else None)
    batcher = ContinuousBatcher(model, slots=args.slots, capacity=max_model_len,
                                prefill_chunk_size=args.prefill_chunk_size, prefill_thread=not args.inline_prefill,
                                prefix_cache=cache, prefill_batch=args.prefill_batch,
                                idle_reads=args.idle_reads)
    engine = Engine(batcher, args.max_pending or max(DEFAULT_MAX_PENDING, 4 * args.slots), trained.eod)
    template = chat_template_of(trained.tokenizer_path)
    try:
        chat = ChatTemplate(template, special_tokens(trained.tokenizer_path)) if template else None
    except Exception as e:   # jinja2's TemplateSyntaxError: a broken template, named before serving
        raise BadOptionError(f"the chat template beside {trained.tokenizer_path} does not parse ({e}): fix it, or "
                             f"remove it to serve /v1/completions only.") from None
    app = build_app(engine, trained.tokenizer, name, max_model_len, limits, chat)
    json_protocol_errors()   # (aiohttp's own 400s, for what never reaches the app, as JSON too)

    async def on_startup(app):
        import signal
        loop = asyncio.get_running_loop()
        on_signal = drain_then_stop(app, raise_graceful_exit)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        engine.on_fatal = lambda: loop.call_soon_threadsafe(on_signal)
    app.on_startup.append(on_startup)
    engine.start()
    if not loopback(args.host) and limits.api_key is None:
        print(f"megatron-id serve: warning: listening on {args.host} (not this machine only) without an API key: "
              f"anyone who can reach the port can use the model; set --api-key or {API_KEY_ENV}", file=sys.stderr,
              flush=True)
    where = f"[{args.host}]" if ":" in args.host else args.host   # (an IPv6 address in a URL: http://[::1]:8000)
    listening = (f"megatron-id serve: {name} on http://{where}:{port} ({args.slots} slots, max-model-len "
                 f"{max_model_len}, device {device}{', API key required' if limits.api_key else ''}"
                 f"{', chat template: /v1/chat/completions' if chat else ''})")
    try:
        # (run_app prints once its socket listens: the line clients and tests wait for)
        web.run_app(app, host=args.host, port=port, shutdown_timeout=args.drain_timeout + 5,
                    handle_signals=False, handler_cancellation=True, access_log=access_log,
                    print=lambda _: print(listening, file=sys.stderr, flush=True))
    except OSError as err:
        import errno
        if err.errno != errno.EADDRINUSE:
            raise
        # (free when tried before loading: two servers started at once on one port)
        raise BadOptionError(f"--port {args.port}: port {port} on {args.host} was taken while the model loaded "
                             f"(another server started at the same time?): stop it or choose another "
                             f"--port.") from None
    finally:
        engine.stop()
    if engine.failure is not None:
        print(f"megatron-id serve: stopped after an engine failure ({type(engine.failure).__name__}): exit 1",
              file=sys.stderr, flush=True)
        return 1
    print("megatron-id serve: stopped", file=sys.stderr, flush=True)
    return 0


def special_tokens(tokenizer_path) -> dict:
    """bos_token / eos_token as tokenizer_config.json names them, for chat templates that use them."""
    config = Path(tokenizer_path).parent / "tokenizer_config.json"
    try:
        values = json.loads(config.read_text()) if config.is_file() else {}
    except json.JSONDecodeError:
        values = {}
    out = {}
    for name in ("bos_token", "eos_token"):
        token = values.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        out[name] = token if isinstance(token, str) else ""
    return out


def default_threads(device, inline_prefill: bool) -> int:
    """Torch threads when --threads is not given: on a CPU, half the cores this process may use
    when prompts are read beside the decode steps (each side gets its half: at 2 threads each
    on 2 cores the decode step went from 5.8 to 14.7 ms while a prompt was read, at 1 each from
    12.5 to 13.9), all of them when read inline."""
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if device.type != "cpu" or inline_prefill:
        return torch.get_num_threads()
    return max(1, cores // 2)


def serve_limits(args, key_from_env: str | None) -> ServeLimits:
    """The flags as ServeLimits (checked by the CLI already). Host names are checked when the
    server listens on this machine only (DNS rebinding: a web page's name resolved to 127.0.0.1)
    or when --allowed-host names them."""
    # as the Host and Origin headers' names are read: lower case, an IPv6 address without brackets
    names = {name.lower().strip("[]") for name in args.allowed_host or ()}
    if loopback(args.host):
        names |= {*LOOPBACK_NAMES, args.host}
    return ServeLimits(drain_timeout=args.drain_timeout, api_key=args.api_key or key_from_env or None,
                       allowed_hosts=names or None, max_pending_per_client=args.max_pending_per_client,
                       read_timeout=args.read_timeout, request_timeout=args.request_timeout,
                       max_body_size=int(args.max_body_size * 2**20))


def open_access_log(path: str | None):
    """--access-log FILE (appended) or - (stderr): one line per request, aiohttp's format."""
    import logging
    if path is None:
        return None
    log = logging.getLogger("megatron_id.serve.access")
    log.setLevel(logging.INFO)
    log.propagate = False
    if path == "-":
        log.addHandler(logging.StreamHandler(sys.stderr))
    else:
        folder = Path(path).resolve().parent
        try:
            if Path(path).is_dir() or not folder.is_dir():
                raise FileNotFoundError(2, "a folder" if Path(path).is_dir() else f"no folder {folder}")
            # delay: the file is opened at the first request, so a start that fails leaves none
            log.addHandler(logging.FileHandler(path, mode="a", delay=True))
        except OSError as e:
            raise BadOptionError(f"--access-log {path}: cannot write there ({e.strerror or e}): give a file in an "
                                 f"existing folder, or - for stderr.") from None
    return log
