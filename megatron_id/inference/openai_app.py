"""The HTTP side of `megatron-id serve` (inference/server.py): OpenAI's API over the engine, one
method per endpoint of `OpenAIApp`, which holds what they share (the engine, the tokenizer, the
limits, the requests per client, whether the server drains). Access control is the `guard`
middleware in front of every endpoint. Requests are checked in api.py before any work."""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import sys
import time
import uuid
from urllib.parse import urlsplit

from aiohttp import web

from ..errors import BadOptionError
from .api import (
    BadRequest,
    ChatTemplate,
    StopText,
    check_content_type,
    check_ids,
    check_prompt_bytes,
    check_text,
    decode_body,
    is_token_id,
    longest_token_bytes,
    parse_chat,
    parse_completion,
    to_request,
)

# what a request gets once the engine has stopped (status, message, code)
ENGINE_FAILED = (503, "the engine stopped after a failure and the server is exiting; retry once it is restarted",
                 "engine_failed")
DRAIN = web.AppKey("drain", object)   # the app's drain coroutine (SIGTERM, the engine stopping)
HURRY = web.AppKey("hurry", object)   # ends a drain now, cancelling what runs (a second signal)


class Busy(Exception):
    pass


def error_body(message: str, param=None, kind="invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param=None, kind="invalid_request_error", headers=None,
                   code=None):
    return web.json_response(error_body(message, param, kind, code), status=status, headers=headers)


def engine_failed():
    status, message, code = ENGINE_FAILED
    return error_response(status, message, kind="server_error", code=code)


def json_protocol_errors() -> None:
    """What never reaches the app (a request line aiohttp cannot parse, a header over its 8,190-byte
    limit) aiohttp answers itself, from its protocol handler, with a plain-text 400: clients that
    read every error as JSON (the server's promise) got text they could not parse. Its handler has
    no hook, so `serve` re-makes that answer as OpenAI's error body (same status, the parser's
    reason) for its own process; if aiohttp's answer ever cannot be re-made, it is sent as it is."""
    from aiohttp import web_protocol
    original = web_protocol.RequestHandler.handle_error
    if getattr(original, "megatron_id_json", False):
        return

    def handle_error(self, request, status=500, exc=None, message=None):
        response = original(self, request, status, exc, message)   # (it logs, and refuses a half-sent answer)
        try:
            why = f": {exc}" if status < 500 and exc is not None else ""
            reply = error_response(status, f"{status} {response.reason}: the request could not be read as "
                                            f"HTTP{why}", kind="invalid_request_error" if status < 500 else
                                   "server_error")
            reply.force_close()
            return reply
        except Exception:
            return response
    handle_error.megatron_id_json = True
    web_protocol.RequestHandler.handle_error = handle_error


def release_memory() -> None:
    """Give freed heap back to the system after a large request (glibc keeps it otherwise: a
    refused 4 MiB prompt left ~400 MiB of resident memory)."""
    from ..allocator import release_freed_memory
    release_freed_memory()


def score_tokens(model, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each token of `ids` after the first: its log-probability given those before it and the
    `top` likeliest tokens there with theirs, from one forward pass of the model over `ids` (the
    log-softmax of its logits in float32, the LM head applied 256 positions at a time)."""
    import torch
    with torch.inference_mode():
        device = next(model.parameters()).device
        tokens = torch.tensor([ids], device=device)
        hidden = model(tokens[:, :-1], return_hidden=True)[0]
        out = []
        for start in range(0, hidden.shape[0], 256):
            logprobs = torch.log_softmax(model.lm_head(hidden[start:start + 256]).float(), dim=-1)
            chosen = logprobs.gather(-1, tokens[0, start + 1:start + 1 + logprobs.shape[0], None])[:, 0]
            values, indices = logprobs.topk(top, dim=-1) if top else (None, None)
            for i in range(logprobs.shape[0]):
                best = list(zip(indices[i].tolist(), values[i].tolist())) if top else []
                out.append((chosen[i].item(), best))
        return out


def logprobs_body(ids: list[int], places: list, decode, chat: bool, offset: int = 0) -> dict:
    """OpenAI's logprobs object for tokens `ids`, places[i] (log-probability, [(id, log-probability)
    of the likeliest]) or None (a first prompt token): chat's {"content": [...]}, or legacy
    completions' tokens / token_logprobs / top_logprobs / text_offset (from `offset`, where
    the text before them ends)."""
    if chat:
        def entry(token, logprob):
            text = decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {"content": [{**entry(token, place[0]), "top_logprobs": [entry(t, lp) for t, lp in place[1]]}
                            for token, place in zip(ids, places)]}
    tokens = [decode([token]) for token in ids]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [None if place is None else place[0] for place in places],
            "top_logprobs": [None if place is None else
                             {**{decode([t]): lp for t, lp in place[1]}, decode([token]): place[0]}
                             for token, place in zip(ids, places)],
            "text_offset": offsets}


class Choice:
    """One completion of a request (its prompt's j-th of n): the engine's ticket for it, the
    tokens so far, its text cut at a stop string, what a stream has sent of it."""

    def __init__(self, index: int, request, ticket: dict, settings: dict):
        self.index, self.request, self.ticket = index, request, ticket
        self.tokens, self.sent, self.finish = [], "", None
        self.unsent_scores = []   # a stream's (token, its scores) since its last chunk (with logprobs)
        self.text_offset = 0      # the characters a stream's logprobs have covered (text_offset)
        self.generated = 0   # tokens the model gave, the end-of-text token included (as generate counts them)
        self.text = StopText(settings["stop"], keep=settings["include_stop_str_in_output"])

    def take(self, token, finish, tokenizer, decode_now: bool, scored=None) -> str:
        """One item from the engine (scored: the token's scores, when the request asked the
        engine for them); returns the text a stream may send now (the whole text is decoded
        once at the end when nothing needs it sooner: no stream, no stop string)."""
        if token is not None:
            self.generated += 1
            if token != self.request.eos_id:
                self.tokens.append(token)
                if scored is not None:
                    self.unsent_scores.append((token, scored))
        self.finish = finish
        if not decode_now and finish is None:
            return ""
        self.text.update(tokenizer.decode(self.tokens))
        if self.text.stopped and self.finish is None:
            self.ticket["cancelled"] = True   # the engine frees its slot at the next step
            self.ticket["finish_reason"] = self.finish = "stop"
        if self.finish is None and self.text.text.endswith("\ufffd"):
            return ""   # the rest of a multi-byte character is coming
        ready = self.text.ready(final=self.finish is not None)
        delta, self.sent = ready[len(self.sent):], ready
        return delta


class OpenAIApp:
    """The endpoints: POST /v1/completions and /v1/chat/completions (chat_template: the
    tokenizer's, api.ChatTemplate; without one chat answers 400 saying so), GET /v1/models and
    /health; `drain` runs at shutdown. `app()` is the aiohttp application."""

    def __init__(self, engine, tokenizer, model_name: str, max_model_len: int, limits,
                 chat_template: ChatTemplate | None = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_model_len, self.limits, self.chat_template = max_model_len, limits, chat_template
        self.draining = self.hurrying = False
        self.per_client = collections.Counter()   # remote address -> requests pending
        self.bytes_per_token = longest_token_bytes(tokenizer)
        self.vocabulary = tokenizer.get_vocab_size()
        self.created = int(time.time())   # (GET /v1/models: when this server started serving the model)
        self.totals = collections.Counter()   # prompt and generated tokens, requests answered (GET /metrics)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_size, middlewares=[self.guard])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        app.on_shutdown.append(self.drain)
        app[DRAIN] = self.drain
        app[HURRY] = self.hurry
        return app

    # ------------------------------------------------------------ access control, errors

    @web.middleware
    async def guard(self, http, handler):
        """Access control on every endpoint but /health, and JSON errors for everything (aiohttp's
        own 404, 405, 413 included), without internals."""
        limits = self.limits
        if http.path != "/health":
            refusal = self.refusal(http)
            if refusal is not None:
                return refusal
        try:
            return await handler(http)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            if isinstance(e, web.HTTPRequestEntityTooLarge):
                message = (f"the body is over {limits.max_body_size:,} bytes (serve --max-body-size): send a "
                           f"shorter prompt")
            else:
                message = f"{e.reason}: {http.method} {http.path}"
            return error_response(e.status, message, kind="invalid_request_error")
        except asyncio.CancelledError:
            raise
        except ConnectionError:   # the client went away while its body was read: nobody to answer or to log
            return web.Response(status=499)   # (nginx's "client closed request", for the access log)
        except Exception as e:   # a bug of ours: the log has it, the client a reference
            ident = uuid.uuid4().hex[:12]
            print(f"megatron-id serve: error {ident} in {http.method} {http.path}: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            return error_response(500, f"internal error {ident} (the server's log has the cause)",
                                  kind="server_error")

    def refusal(self, http):
        """The 403 or 401 of a request from a name or origin not allowed, or without the API key;
        None when it may go on."""
        names = self.limits.allowed_hosts
        if names is not None:
            host = urlsplit("//" + http.host).hostname if http.host else None
            if host is not None and host not in names:
                return error_response(403, f"Host {http.host!r} is not this server's name (it answers "
                                           f"{', '.join(sorted(names))}; add names with --allowed-host)",
                                      code="host_not_allowed")
            origin = http.headers.get("Origin")
            if origin is not None and urlsplit(origin).hostname not in names:
                return error_response(403, f"Origin {origin!r}: requests from web pages of other sites are "
                                           f"refused (add the name with --allowed-host)",
                                      code="origin_not_allowed")
        if self.limits.api_key is not None:
            # the scheme in any case ("bearer KEY" from curl users: RFC 7235 makes it case-blind)
            scheme, _, token = http.headers.get("Authorization", "").partition(" ")
            token = token.strip() if scheme.lower() == "bearer" else ""
            if not hmac.compare_digest(token.encode(), self.limits.api_key.encode()):
                return error_response(401, "a valid API key is needed: send 'Authorization: Bearer KEY' "
                                           "(the openai client's api_key)", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
        return None

    async def read_body(self, http):
        check_content_type(http.content_type, http.charset)
        # (not asyncio.wait_for: before Python 3.12 it can swallow the handler's cancellation when
        # the read completes at the same moment, and a client gone would keep its request)
        reading = asyncio.ensure_future(http.read())
        try:
            done, _ = await asyncio.wait({reading}, timeout=self.limits.read_timeout)
        except asyncio.CancelledError:
            reading.cancel()
            raise
        if not done:
            reading.cancel()
            raise BadRequest(f"the body did not arrive within {self.limits.read_timeout:g} s (serve --read-timeout)",
                             status=408)
        raw = reading.result()
        return decode_body(raw), len(raw)

    # ------------------------------------------------------------ completions

    async def completions(self, http):
        return await self.complete(http, chat=False)

    async def chat_completions(self, http):
        return await self.complete(http, chat=True)

    async def complete(self, http, chat: bool):
        """A request checked, tokenized and queued (its prompts x n completions, each a sequence
        of the engine), then answered (`answer`)."""
        engine = self.engine
        if self.draining:
            return error_response(503, "the server is shutting down", kind="server_error")
        if engine.failure is not None:
            return engine_failed()
        size = 0
        try:
            body, size = await self.read_body(http)
            asked = body.get("model") if isinstance(body, dict) else None
            if asked is not None and asked != self.model_name:   # as OpenAI-style servers do: never another model
                return error_response(404, f"The model `{asked}` does not exist: this server serves "
                                           f"`{self.model_name}` (GET /v1/models; megatron-id serve "
                                           f"--served-model-name)", "model", code="model_not_found")
            settings, prompts = (parse_chat(body, self.max_model_len, self.chat_template) if chat else
                                 parse_completion(body, self.max_model_len))
            for prompt in prompts:
                check_prompt_bytes(prompt, settings, self.max_model_len, self.bytes_per_token)
            check_ids([token for token, _ in settings["sampling"].logit_bias], self.vocabulary, "logit_bias keys",
                      "logit_bias")
            requests = []
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str):
                    ids = (await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, prompt)).ids
                else:
                    check_ids(prompt, self.vocabulary, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
                    ids = prompt
                requests += [to_request(ids, settings, self.max_model_len, sample=j) for j in range(settings["n"])]
            client = http.remote or "?"
            limit = self.limits.max_pending_per_client
            if limit is not None and self.per_client[client] >= limit:
                return error_response(429, f"{self.per_client[client]} requests of this client are already queued "
                                           f"or running (serve --max-pending-per-client): retry later",
                                      kind="rate_limit_error", headers={"Retry-After": "1"})
            ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            for j, request in enumerate(requests):
                request.name = ident if len(requests) == 1 else f"{ident}/{j}"
            tickets, out = engine.submit(requests, asyncio.get_running_loop())
        except BadRequest as e:
            return error_response(e.status, str(e), e.param)
        except BadOptionError as e:
            return error_response(400, str(e))
        except Busy:
            if engine.failure is not None:
                return engine_failed()
            return error_response(503, f"{engine.max_pending} sequences are already queued or running (serve "
                                       f"--max-pending; this request has {len(requests)}): retry later",
                                  kind="server_error", headers={"Retry-After": "1"})
        finally:
            if size > 2**20:
                release_memory()
        self.per_client[client] += 1
        try:
            choices = [Choice(i, request, ticket, settings) for i, (request, ticket) in
                       enumerate(zip(requests, tickets))]
            return await self.answer(http, ident, choices, settings, out, chat)
        finally:
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]

    async def answer(self, http, ident, choices: list[Choice], settings, out, chat: bool):
        """The choices' tokens as they come from the engine: one JSON answer, or server-sent
        events as OpenAI streams them (each chunk one choice's, by its index)."""
        engine, tokenizer, limits = self.engine, self.tokenizer, self.limits
        stream = settings["stream"]
        kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
        chunk = {"id": ident, "object": kind, "created": int(time.time()), "model": self.model_name}

        def choice_body(c: Choice, text: str, finish, first: bool = False, logprobs=None) -> dict:
            """OpenAI's choice: text for completions; for chat a message, or in a stream a delta
            (the role in the first, the content in each, empty with the finish_reason at the end)."""
            if not chat:
                return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if not stream:
                return {"index": c.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                        "finish_reason": finish}
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        def unsent_logprobs(c: Choice):
            """A stream's logprobs for the tokens since the choice's last chunk (None without)."""
            if settings["logprobs"] is None:
                return None
            ids, places = [t for t, _ in c.unsent_scores], [p for _, p in c.unsent_scores]
            c.unsent_scores = []
            body = logprobs_body(ids, places, self.tokenizer.decode, chat, c.text_offset)
            c.text_offset += sum(len(t) for t in body["tokens"]) if not chat else 0
            return body
        failure = None
        # the deadline arrives as an item of the queue: a plain `await out.get()` is cancelled
        # cleanly when the client goes away (asyncio.wait_for around it could swallow that while
        # tokens arrive every millisecond, and the sequence ran on to max_tokens)
        timer = (asyncio.get_running_loop().call_later(limits.request_timeout, out.put_nowait,
                                                       (None, None, "timeout")) if limits.request_timeout else None)
        response = None

        def cancel_all() -> None:
            for c in choices:
                c.ticket["cancelled"] = True   # the engine cancels its sequence at the next step

        async def send(data: dict) -> None:
            await response.write(f"data: {json.dumps(data)}\n\n".encode())

        try:
            if stream:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(http)
                if chat:   # OpenAI's first chunk of each choice: the role, no content yet
                    for c in choices:
                        await send({**chunk, "choices": [choice_body(c, "", None, first=True)]})
                elif settings["echo"]:   # each choice's prompt first (with logprobs: scored by the model)
                    scored_prompts = {}   # (n choices of a prompt: scored once)
                    for c in choices:
                        scores = None
                        if settings["logprobs"] is not None:
                            key = tuple(c.request.prompt)
                            if key not in scored_prompts:
                                scored_prompts[key] = await self.prompt_logprobs(c.request.prompt, settings["logprobs"])
                            scores = scored_prompts[key]
                            c.text_offset = sum(len(t) for t in scores["tokens"])
                        await send({**chunk, "choices": [choice_body(c, tokenizer.decode(c.request.prompt), None,
                                                                     logprobs=scores)]})
            running = len(choices)
            while running:
                index, token, finish, *scored = await out.get()   # (scored: with logprobs, a token's)
                if finish == "timeout":
                    cancel_all()
                    failure = (504, f"the request ran past {limits.request_timeout:g} s (serve --request-timeout) "
                                    f"after {sum(c.generated for c in choices)} tokens", "timeout")
                    break
                if finish == "error":
                    cancel_all()
                    failure = (ENGINE_FAILED if engine.failure is not None else
                               (500, f"the model failed while generating request {ident} (the server's log has the "
                                     f"cause); other requests are unaffected: retry", "generation_failed"))
                    break
                c = choices[index]
                if c.finish is not None:   # (a stop string ended it; the engine's last items come after)
                    continue
                delta = c.take(token, finish, tokenizer, stream or bool(settings["stop"]), *scored)
                if c.finish is not None:
                    running -= 1
                if stream and (delta or c.finish is not None):
                    await send({**chunk, "choices": [choice_body(c, delta, c.finish, logprobs=unsent_logprobs(c))]})
            if failure is not None:
                status, message, code = failure
                if not stream:
                    return error_response(status, message, kind="server_error", code=code)
                await send(error_body(message, kind="server_error", code=code))   # as vLLM streams an error
                await response.write_eof()
                return response
            prompt_tokens = sum(len(c.request.prompt) for c in choices[::settings["n"]])   # each prompt once
            completion_tokens = sum(c.generated for c in choices)
            self.totals.update(prompt_tokens=prompt_tokens, generation_tokens=completion_tokens, answered=1)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}
            if stream:
                if settings["include_usage"]:   # OpenAI's last chunk: no choices, the usage
                    await send({**chunk, "choices": [], "usage": usage})
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
        except asyncio.CancelledError:   # the client went away (aiohttp's handler cancellation)
            cancel_all()
            raise
        except ConnectionError:
            # The client went away and a write found its connection closing before aiohttp's
            # cancellation reached this handler (a token arrived in the same turn of the event loop
            # as the hang-up). Raised, aiohttp logs it as an unhandled error with a 25-line
            # traceback; the sequences are cancelled and the response handed back as it stands
            # (aiohttp's own write of its end then fails quietly).
            cancel_all()
            return response if response is not None else web.Response(status=499)
        finally:
            if timer is not None:
                timer.cancel()
        bodies = []
        for c in choices:
            text, logprobs = c.text.ready(final=True), None
            if settings["echo"]:
                text = tokenizer.decode(c.request.prompt) + text
            if settings["logprobs"] is not None:
                logprobs = await self.logprobs(c, settings, chat)
            bodies.append(choice_body(c, text, c.finish, logprobs=logprobs))
        return web.json_response({**chunk, "choices": bodies, "usage": usage})

    async def logprobs(self, c: Choice, settings: dict, chat: bool) -> dict:
        """OpenAI's logprobs of a choice: its completion's tokens (with echo, the prompt's first;
        the first prompt token has none), each with its log-probability and the
        settings["logprobs"] likeliest tokens there, scored by the model on the prompt and the
        completion (one forward pass, off the event loop)."""
        prompt, completion = c.request.prompt, c.tokens
        scored = await asyncio.get_running_loop().run_in_executor(
            None, score_tokens, self.engine.batcher.model, prompt + completion, settings["logprobs"])
        first = 0 if settings["echo"] else len(prompt)
        ids = (prompt + completion)[first:]
        places = [None if first + i == 0 else scored[first + i - 1] for i in range(len(ids))]
        return logprobs_body(ids, places, self.tokenizer.decode, chat)

    async def prompt_logprobs(self, prompt: list[int], top: int) -> dict:
        """A streamed echo's logprobs: the prompt's tokens scored (the first has none)."""
        scored = await asyncio.get_running_loop().run_in_executor(
            None, score_tokens, self.engine.batcher.model, prompt, top)
        return logprobs_body(prompt, [None] + scored, self.tokenizer.decode, chat=False)

    # ------------------------------------------------------------ the rest

    async def models(self, http):
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                               "created": self.created,
                                                               "owned_by": "megatron-id"}]})

    async def tokenize(self, http):
        """vLLM's POST /tokenize: {"prompt": text} -> {"count", "max_model_len", "tokens"}, the ids this
        server reads the text as (no special token is added: none is, to a prompt)."""
        try:
            body, _ = await self.read_body(http)
            if not isinstance(body, dict) or set(body) - {"model", "prompt", "add_special_tokens"} or \
                    not isinstance(body.get("prompt"), str):
                raise BadRequest("the body must be {\"prompt\": a string} (and optionally \"model\")", "prompt")
            check_text(body["prompt"], "prompt")
            ids = (await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, body["prompt"])).ids
        except BadRequest as e:
            return error_response(e.status, str(e), e.param)
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                  "token_strs": None})

    async def detokenize(self, http):
        """vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": their text}."""
        try:
            body, _ = await self.read_body(http)
            tokens = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(body, dict) or set(body) - {"model", "tokens"} or not isinstance(tokens, list):
                raise BadRequest("the body must be {\"tokens\": a list of token ids} (and optionally \"model\")",
                                 "tokens")
            if not all(is_token_id(t) for t in tokens):
                raise BadRequest(f"tokens must be integers, not {str(tokens)[:100]}", "tokens")
            check_ids(tokens, self.vocabulary, "tokens", "tokens")
        except BadRequest as e:
            return error_response(e.status, str(e), e.param)
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def metrics(self, http):
        """Prometheus' text format (as vLLM's /metrics): the engine's sequences by finish reason and
        pending, the tokens read and generated, the prefix cache's counters."""
        engine, lines = self.engine, []

        def metric(name: str, kind: str, about: str, values: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP megatron_id_{name} {about}", f"# TYPE megatron_id_{name} {kind}"])
            lines.extend(f"megatron_id_{name}{labels} {value:g}" for labels, value in values)
        metric("requests_pending", "gauge", "Sequences queued or running.", [("", engine.busy())])
        metric("sequences_finished_total", "counter", "Sequences finished, by finish_reason.",
               [(f'{{finish_reason="{reason}"}}', count) for reason, count in sorted(engine.finished.items())])
        metric("requests_answered_total", "counter", "Requests answered whole (all their choices).",
               [("", self.totals["answered"])])
        metric("prompt_tokens_total", "counter", "Prompt tokens of the requests answered (each prompt once).",
               [("", self.totals["prompt_tokens"])])
        metric("generation_tokens_total", "counter", "Tokens generated for the requests answered.",
               [("", self.totals["generation_tokens"])])
        cache = engine.batcher.prefix_cache
        if cache is not None:
            counters = cache.counters()
            for name, kind, about in (("hits", "counter", "Prompts that started from a saved prefix state."),
                                      ("misses", "counter", "Prompts read from their first token."),
                                      ("tokens_saved", "counter", "Prompt tokens not read again."),
                                      ("entries", "gauge", "Prefix states kept."),
                                      ("bytes", "gauge", "Bytes of the prefix states kept.")):
                metric(f"prefix_cache_{name}" + ("_total" if kind == "counter" else ""), kind, about,
                       [("", counters[name])])
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def version(self, http):
        from importlib.metadata import PackageNotFoundError, version
        try:
            return web.json_response({"version": version("megatron_id")})
        except PackageNotFoundError:   # (run from a checkout that was not installed)
            return web.json_response({"version": "unknown"})

    async def health(self, http):
        engine = self.engine
        if engine.failure is not None:
            return web.json_response({"status": "failed", "error": "the engine stopped; the server is exiting"},
                                     status=503)
        cache = engine.batcher.prefix_cache
        return web.json_response({"status": "draining" if self.draining else "ok", "pending": engine.busy(),
                                  "finished": dict(engine.finished),
                                  "prefix_cache": cache.counters() if cache is not None else None})

    def hurry(self) -> None:
        """Stop waiting for the running requests: the drain cancels them now."""
        self.draining = self.hurrying = True

    async def drain(self, app=None):
        """Refuse new work (503, still listening), let the rest finish, cancel what outlasts the timeout."""
        engine = self.engine
        self.draining = True
        deadline = time.monotonic() + self.limits.drain_timeout
        left = engine.busy()
        if left:
            print(f"megatron-id serve: draining {left} request(s) (up to {self.limits.drain_timeout:g} s)",
                  file=sys.stderr, flush=True)
        while engine.busy() and time.monotonic() < deadline and not self.hurrying:
            await asyncio.sleep(0.05)
        if engine.busy():
            print(f"megatron-id serve: cancelling {engine.busy()} request(s) still running", file=sys.stderr,
                  flush=True)
            engine.cancel_all()
            while engine.busy() and engine.failure is None:
                await asyncio.sleep(0.05)


def build_app(engine, tokenizer, model_name: str, max_model_len: int, limits,
              chat_template: ChatTemplate | None = None) -> web.Application:
    """The aiohttp app of OpenAIApp's endpoints."""
    return OpenAIApp(engine, tokenizer, model_name, max_model_len, limits, chat_template).app()
