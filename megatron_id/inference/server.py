"""`megatron-id serve`: an HTTP server with OpenAI's completions API over continuous batching.

    megatron-id serve --checkpoint runs/x/hf --port 8000 --slots 16
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "The water cycle", "max_tokens": 32, "temperature": 0}'

Endpoints: POST /v1/completions (streaming with "stream": true, as server-sent events),
GET /v1/models, GET /health. The HTTP side is aiohttp (asyncio); the model runs on one engine
thread that owns a ContinuousBatcher (inference/batching.py): a fixed pool of --slots sequences
decoded together by the fused step, each request taking a free slot after its prompt is
prefilled and leaving it at its last token. Interdomain and S4D-only layers keep a constant-size
state per slot, so memory does not grow with the clients; softmax layers (hybrids) get a KV cache
of --max-model-len tokens per slot, allocated once.

Backpressure: at most --max-pending requests are queued or running; the next gets 503 with
Retry-After. A bad request gets 400 (invalid_request_error, OpenAI's error body) saying which
field and why. SIGTERM or SIGINT: the server stops accepting (503), lets the running and queued
requests finish for up to --drain-timeout seconds, cancels what is left (finish_reason
"cancelled"), and exits 0.
"""
from __future__ import annotations

import asyncio
import collections
import json
import queue
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

from ..errors import BadOptionError
from .batching import ContinuousBatcher, Request
from .fused_decode import check_kv_pool, fused_decode_refusal
from .generate import load_trained, resolve_device

# OpenAI parameters accepted only at their neutral value: anything else is refused, not ignored
NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None, "top_p": 1,
           "presence_penalty": 0, "frequency_penalty": 0, "stop": None, "logit_bias": None}
KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_k", "seed", "stream", "user", "stream_options",
         *NEUTRAL}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Busy(Exception):
    pass


def parse_completion(body, tokenizer, max_model_len: int) -> tuple[Request, bool, str]:
    """(request, stream, prompt text) from a completions body, or BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] != neutral and body[name] is not None:
            raise BadRequest(f"{name}={body[name]!r} is not supported (only {neutral!r})", name)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string (one prompt per request)", "prompt")
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise BadRequest("prompt gives no tokens: send some text", "prompt")

    def number(name, default, kind, low, high=None):
        value = body.get(name, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
            raise BadRequest(f"{name} must be {'a number' if kind is float else 'an integer'}, not {value!r}", name)
        if value < low or (high is not None and value > high):
            raise BadRequest(f"{name}={value} is out of range [{low}, {high if high is not None else 'inf'}]", name)
        return kind(value)

    max_tokens = number("max_tokens", 16, int, 1)
    if len(ids) + max_tokens > max_model_len:
        raise BadRequest(f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} exceed this server's "
                         f"--max-model-len of {max_model_len} tokens: ask for fewer", "max_tokens")
    temperature = number("temperature", 1.0, float, 0.0, 2.0)   # OpenAI's default and range
    top_k = number("top_k", 0, int, 0)
    seed = number("seed", 0, int, 0)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, not {stream!r}", "stream")
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict) or set(options) - {"include_usage"} or not stream:
        raise BadRequest("stream_options takes only {\"include_usage\": true|false}, with stream", "stream_options")
    request = Request(ids, max_tokens, temperature, top_k, seed)
    request.include_usage = bool(options.get("include_usage"))
    return request, stream, prompt


class Engine:
    """The batcher on its own thread. Requests come in through a queue; each sequence's tokens go
    out to its asyncio queue as (token, finish_reason or None) pairs."""

    def __init__(self, batcher: ContinuousBatcher, max_pending: int, eos_id):
        self.batcher, self.max_pending, self.eos_id = batcher, max_pending, eos_id
        self.inbox: queue.Queue = queue.Queue()
        self.pending = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="megatron-id-engine", daemon=True)
        self.routes = {}   # sequence id -> (loop, asyncio queue, ticket, sequence)
        self.finished = collections.Counter()   # by finish_reason (GET /health)

    def start(self):
        self.thread.start()

    def submit(self, request: Request, loop) -> tuple[dict, asyncio.Queue]:
        request.eos_id = self.eos_id
        self.batcher.check(request)           # BadOptionError: 400
        with self.lock:
            if self.pending >= self.max_pending:
                raise Busy()
            self.pending += 1
        out: asyncio.Queue = asyncio.Queue()
        ticket = {"cancelled": False}   # set by the HTTP side when the client goes away
        self.inbox.put((request, out, loop, ticket))
        return ticket, out

    def cancel(self, ticket: dict) -> None:
        ticket["cancelled"] = True

    def cancel_all(self) -> None:
        self.inbox.put(("cancel-all", None, None, None))

    def busy(self) -> int:
        with self.lock:
            return self.pending

    def stop(self) -> None:
        self.stopped.set()
        self.inbox.put(None)
        self.thread.join(timeout=60)

    def _deliver(self, sequence, item) -> None:
        loop, out, _, _ = self.routes[sequence.id]
        loop.call_soon_threadsafe(out.put_nowait, item)

    def _done(self, sequence) -> None:
        del self.routes[sequence.id]
        self.finished[sequence.finish_reason] += 1
        with self.lock:
            self.pending -= 1

    def _take(self, item) -> None:
        if item is None:
            return
        request, out, loop, ticket = item
        if request == "cancel-all":
            for sequence in list(self.batcher.waiting) + list(self.batcher.running.values()):
                self.batcher.cancel(sequence)
            return
        sequence = self.batcher.submit(request)
        self.routes[sequence.id] = (loop, out, ticket, sequence)

    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                if not self.batcher.busy():
                    self._take(self.inbox.get())         # idle: wait for work
                while True:                              # and whatever else has arrived
                    try:
                        self._take(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                for _, _, ticket, sequence in self.routes.values():   # their clients went away
                    if ticket["cancelled"] and not sequence.cancelled:
                        self.batcher.cancel(sequence)
                before = list(self.batcher.waiting) + list(self.batcher.running.values())
                events = self.batcher.step()
                for sequence, token, finished in events:
                    self._deliver(sequence, (token, sequence.finish_reason if finished else None))
                    if finished:
                        self._done(sequence)
                for sequence in before:   # cancelled ones end without a token
                    if sequence.finish_reason == "cancelled" and sequence.id in self.routes:
                        self._deliver(sequence, (None, "cancelled"))
                        self._done(sequence)
        except BaseException as e:   # the model failed: every waiting client gets a 500
            self.failure = e
            for loop, out, _, _ in list(self.routes.values()):
                loop.call_soon_threadsafe(out.put_nowait, (None, "error"))
            print(f"megatron-id serve: the engine stopped: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def error_response(web, status: int, message: str, param=None, kind="invalid_request_error", headers=None,
                   code=None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def build_app(engine: Engine, tokenizer, model_name: str, max_model_len: int, drain_timeout: float):
    from aiohttp import web
    state = {"draining": False}

    async def completions(http):
        if state["draining"]:
            return error_response(web, 503, "the server is shutting down", kind="server_error")
        if engine.failure is not None:
            return error_response(web, 500, f"the engine failed: {engine.failure}", kind="server_error")
        try:
            body = await http.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_response(web, 400, f"the body is not JSON: {e}")
        asked = body.get("model") if isinstance(body, dict) else None
        if asked is not None and asked != model_name:   # as OpenAI-style servers do: never another model silently
            return error_response(web, 404, f"The model `{asked}` does not exist: this server serves `{model_name}` "
                                            f"(GET /v1/models; megatron-id serve --served-model-name)", "model",
                                  code="model_not_found")
        try:
            request, stream, prompt = parse_completion(body, tokenizer, max_model_len)
            ticket, out = engine.submit(request, asyncio.get_running_loop())
        except BadRequest as e:
            return error_response(web, 400, str(e), e.param)
        except BadOptionError as e:
            return error_response(web, 400, str(e))
        except Busy:
            return error_response(web, 503, f"{engine.max_pending} requests are already queued or running: "
                                            f"retry later", kind="server_error", headers={"Retry-After": "1"})
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        chunk = {"id": ident, "object": "text_completion", "created": created, "model": model_name}
        tokens, printed, finish = [], "", None
        response = None
        try:
            if stream:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(http)
            while finish is None:
                token, finish = await out.get()
                if token is not None and token != request.eos_id:
                    tokens.append(token)
                if finish == "error":
                    return error_response(web, 500, f"the engine failed: {engine.failure}", kind="server_error")
                if stream:
                    text = tokenizer.decode(tokens)
                    if finish is None and text.endswith("\ufffd"):
                        continue   # the rest of a multi-byte character is coming
                    delta, printed = text[len(printed):], text
                    choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
                    await response.write(f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode())
        except (asyncio.CancelledError, ConnectionResetError):
            ticket["cancelled"] = True   # the engine cancels its sequence at the next step
            raise
        usage = {"prompt_tokens": len(request.prompt), "completion_tokens": len(tokens),
                 "total_tokens": len(request.prompt) + len(tokens)}
        if stream:
            if request.include_usage:   # OpenAI's last chunk: no choices, the usage
                await response.write(f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        choice = {"index": 0, "text": tokenizer.decode(tokens), "logprobs": None, "finish_reason": finish}
        return web.json_response({**chunk, "choices": [choice], "usage": usage})

    async def models(http):
        return web.json_response({"object": "list", "data": [{"id": model_name, "object": "model",
                                                              "owned_by": "megatron-id"}]})

    async def health(http):
        if engine.failure is not None:
            return error_response(web, 500, f"the engine failed: {engine.failure}", kind="server_error")
        return web.json_response({"status": "draining" if state["draining"] else "ok", "pending": engine.busy(),
                                  "finished": dict(engine.finished)})

    async def drain(app):
        """On SIGTERM / SIGINT: refuse new work, let the rest finish, cancel what outlasts the timeout."""
        state["draining"] = True
        deadline = time.monotonic() + drain_timeout
        left = engine.busy()
        print(f"megatron-id serve: draining {left} request(s) (up to {drain_timeout:g} s)", file=sys.stderr,
              flush=True)
        while engine.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if engine.busy():
            print(f"megatron-id serve: cancelling {engine.busy()} request(s) still running", file=sys.stderr,
                  flush=True)
            engine.cancel_all()
            while engine.busy() and engine.failure is None:
                await asyncio.sleep(0.05)

    app = web.Application(client_max_size=4 * 2**20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.on_shutdown.append(drain)
    return app


def check_listen_address(host: str, port: int) -> None:
    """--host and --port are tried (a socket bound and closed) before the model is loaded: an
    address that is not one of this machine's, a name that does not resolve or a port in use is
    named with its flag, not found after minutes of loading as an OSError without one."""
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
    """The body of `megatron-id serve` (options checked by the CLI before this loads the model)."""
    try:
        from aiohttp import web
    except ImportError:
        raise BadOptionError("megatron-id serve needs aiohttp: pip install 'megatron_id[serve]'.") from None
    device = resolve_device(args.device)
    check_listen_address(args.host, args.port)   # before the model is loaded
    trained = load_trained(args.checkpoint, args.tokenizer, args.allow_tokenizer_mismatch, args.verify)
    model = trained.model
    why = fused_decode_refusal(model)
    if why:
        raise BadOptionError(f"megatron-id serve decodes with the fused step: {why}.")
    model.to(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.served_model_name or Path(args.checkpoint).resolve().name
    max_model_len = args.max_model_len or trained.cfg.seq_length
    defaulted = '' if args.max_model_len else ' (the seq_length of the model)'
    check_kv_pool(model, args.slots, max_model_len, device,
                  f"--max-model-len {max_model_len:,}{defaulted} x --slots {args.slots:,}",
                  "Lower --max-model-len or --slots")
    batcher = ContinuousBatcher(model, slots=args.slots, capacity=max_model_len,
                                prefill_chunk_size=args.prefill_chunk_size)
    engine = Engine(batcher, args.max_pending or 4 * args.slots, trained.eod)
    engine.start()
    app = build_app(engine, trained.tokenizer, name, max_model_len, args.drain_timeout)
    listening = (f"megatron-id serve: {name} on http://{args.host}:{{port}} ({args.slots} slots, max-model-len "
                 f"{max_model_len}, device {device})")

    try:
        # (run_app prints once its socket listens: the line clients and tests wait for)
        web.run_app(app, host=args.host, port=args.port, shutdown_timeout=args.drain_timeout + 5,
                    handle_signals=True, print=lambda _: print(listening.format(port=args.port), file=sys.stderr,
                                                               flush=True))
    finally:
        engine.stop()
    print("megatron-id serve: stopped", file=sys.stderr, flush=True)
    return 0
