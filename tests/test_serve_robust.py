"""`megatron-id serve` that one request cannot take down (issue 45), in-process (aiohttp's test
client over the real app and engine, a tiny export): hostile values get a 4xx JSON error while a
streaming canary beside them goes on unharmed; a failure inside a step fails only the requests it
touched; access control (API key, Content-Type, Host and Origin, per-client limit, timeouts);
stop strings."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from hf_tiny import tiny_export

from megatron_id.inference.batching import ContinuousBatcher
from megatron_id.inference.generate import generate_ids, load_trained
from megatron_id.inference.server import DRAIN, Engine, ServeLimits, build_app, drain_then_stop

MAX_MODEL_LEN = 256
CANARY = "The water cycle"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return load_trained(tiny_export(tmp_path_factory.mktemp("robust") / "hf"))


def greedy(trained, prompt: str, max_tokens: int) -> str:
    ids = trained.tokenizer.encode(prompt).ids
    return trained.tokenizer.decode(list(generate_ids(trained.model, ids, max_tokens, decode="eager",
                                                      eos_id=trained.eod)))


def serve(trained, body, limits: ServeLimits | None = None, slots: int = 2, step_seconds: float = 0.0,
          max_pending: int = 8, chat=None, handler_cancellation: bool = True, prefix_cache=None):
    """Run `body(client, engine)` against the app with a live engine; `step_seconds` slows every
    decode step (a model of realistic speed, so that requests overlap). handler_cancellation: on,
    as `megatron-id serve` runs aiohttp (a client's hang-up cancels its handler); off, aiohttp's
    own default (the handler finds out when it next writes)."""
    from aiohttp.test_utils import TestClient, TestServer

    class Server(TestServer):   # (TestServer turns handler cancellation on whatever it is given)
        async def _make_runner(self, **kwargs):
            return await super()._make_runner(**{**kwargs, "handler_cancellation": handler_cancellation})
    batcher = ContinuousBatcher(trained.model, slots=slots, capacity=MAX_MODEL_LEN, prefill_thread=True,
                                prefix_cache=prefix_cache)
    if step_seconds:
        step = batcher.decoder.step

        def slow(tokens):
            time.sleep(step_seconds)
            return step(tokens)
        batcher.decoder.step = slow
    engine = Engine(batcher, max_pending, trained.eod)
    app = build_app(engine, trained.tokenizer, "hf", MAX_MODEL_LEN, limits or ServeLimits(), chat)

    async def run():
        engine.start()
        try:
            async with TestClient(Server(app)) as client:
                return await body(client, engine)
        finally:
            engine.stop()
    return asyncio.run(run())


async def stream_text(client, prompt: str, max_tokens: int, **more) -> tuple[str, list, float]:
    """(text, events, time of the last event) of a streaming greedy request."""
    reply = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                       "stream": True, **more})
    assert reply.status == 200, await reply.text()
    events = []
    async for line in reply.content:
        line = line.decode().strip()
        if line.startswith("data: {"):
            events.append(json.loads(line[6:]))
    text = "".join(e["choices"][0]["text"] for e in events if "choices" in e and e["choices"])
    return text, events, time.monotonic()


async def settled(client) -> tuple[int, dict]:
    """/health once the engine has closed its books (a client reads its last event a moment before
    the engine counts the sequence done)."""
    for _ in range(250):
        reply = await client.get("/health")
        health = await reply.json()
        if reply.status != 200 or not health["pending"]:
            break
        await asyncio.sleep(0.02)
    return reply.status, health


async def post_raw(client, data: bytes, content_type="application/json", headers=None):
    reply = await client.post("/v1/completions", data=data, headers={"Content-Type": content_type, **(headers or {})})
    try:
        body = await reply.json(content_type=None)
    except json.JSONDecodeError:
        body = {"not json": await reply.text()}
    return reply.status, body


HOSTILE = [   # (body, Content-Type, status, what the message says)
    (b'{"prompt": "Hi", "temperature": NaN}', "application/json", 400, "NaN is not a JSON value"),
    (b'{"prompt": "Hi", "temperature": Infinity}', "application/json", 400, "Infinity is not a JSON value"),
    (b'{"prompt": "Hi", "temperature": 1e-300}', "application/json", 400, "temperature=1e-300 is below 1e-05"),
    (b'{"prompt": "Hi", "temperature": 1e-40}', "application/json", 400, "send 0 for greedy"),
    (b'{"prompt": "Hi", "temperature": 1, "seed": 1180591620717411303424}', "application/json", 400,
     "seed=1180591620717411303424 is out of range [0, 18446744073709551615]"),
    (b'{"prompt": "Hi"}', "application/json; charset=bogus", 415, "charset 'bogus': this server reads UTF-8 only"),
    (b'{"prompt": "a\\ud800b"}', "application/json", 400, "prompt holds a lone surrogate"),
    (b'{"prompt": "Hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json", 400,
     "the body is nested too deep"),
    (json.dumps({"prompt": "a" * (4 * 2**20)}).encode(), "application/json", 413,
     "the body is over 4,194,304 bytes (serve --max-body-size)"),
    (json.dumps({"prompt": "word " * 600_000}).encode(), "application/json", 400,
     "leaves no room for a completion under this server's --max-model-len of 256 tokens (prompt + max_tokens): "
     "send a shorter prompt"),
    (b'{"prompt": "Hi"}', "text/plain", 415, "Content-Type 'text/plain': send the body as JSON"),
    (b'\xff\xfe{"prompt": "Hi"}', "application/json", 400, "the body is not UTF-8 (byte 0)"),
    (b'{"prompt": "Hi", "stop": ["a", ""]}', "application/json", 400, "stop holds an empty string"),
    (json.dumps({"prompt": "Hi", "stop": "x" * 100_000}).encode(), "application/json", 400,
     "stop holds a string of 100,000 characters: at most 1,000"),
]


def test_each_hostile_request_gets_a_4xx_json_error_and_a_canary_stream_beside_them_goes_on(trained):
    """Before: NaN, 1e-300 or a seed past 2^64 crashed the engine thread for good (every later
    request and /health answered 500); a bogus charset, a lone surrogate and deep JSON got a
    plain-text 500."""
    want = greedy(trained, CANARY, 120)

    async def body(client, engine):
        canary = asyncio.create_task(stream_text(client, CANARY, 120))
        while not engine.busy():
            await asyncio.sleep(0.01)
        answered = []
        for data, content_type, status, mention in HOSTILE:
            code, reply = await post_raw(client, data, content_type)
            assert code == status and mention in reply["error"]["message"], (data[:80], code, reply)
            assert "Traceback" not in reply["error"]["message"]
            answered.append(time.monotonic())
        # what clients send by default is served: stop=[], stop=null, temperature 0
        reply = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0,
                                                           "stop": [], "seed": 2**64 - 1})
        assert reply.status == 200, await reply.text()
        answered.append(time.monotonic())
        text, events, finished = await canary
        return (text, events, finished, answered, *await settled(client))
    text, events, finished, answered, status, health = serve(trained, body, step_seconds=0.02)
    assert finished > max(answered), "the canary ended before the hostile requests were all answered"
    assert text == want and events[-1]["choices"][0]["finish_reason"] == "length"
    assert status == 200 and health["status"] == "ok" and health["pending"] == 0, health


def test_a_failure_inside_a_step_fails_only_the_requests_it_touched_and_the_engine_goes_on(trained):
    """A prefill that raises fails its own request (500 JSON); a decode step that raises fails the
    sequences in it (an error event inside a stream, never another response's bytes); the next
    requests are served and equal generate's; /health stays 200."""
    marker = trained.tokenizer.encode(" Zebra").ids[0]

    class Faulty(torch.nn.Module):   # the prompt's reading (the decode step does not call the model)
        def __init__(self, model):
            super().__init__()
            self.model, self.lm_head = model, model.lm_head

        def forward(self, chunk, **kwargs):
            if int(chunk[0, 0]) == marker:
                raise RuntimeError("injected: this prompt's prefill fails")
            return self.model(chunk, **kwargs)
    want = greedy(trained, CANARY, 60)

    async def body(client, engine):
        engine.batcher.model = Faulty(engine.batcher.model)
        canary = asyncio.create_task(stream_text(client, CANARY, 60))
        while not engine.busy():
            await asyncio.sleep(0.01)
        code, reply = await post_raw(client, json.dumps({"prompt": " Zebra crossing", "max_tokens": 5}).encode())
        assert code == 500 and reply["error"]["code"] == "generation_failed", reply
        assert "injected" not in reply["error"]["message"], "the client was shown the exception's text"
        text, events, _ = await canary
        assert text == want, "the canary was touched by another request's failure"
        # the shared decode step fails once: both running sequences fail, each in its own response
        step = engine.batcher.decoder.step
        calls = {"n": 0}

        def fails_once(tokens):   # the first step that decodes both
            if tokens.shape[0] == 2 and not calls["n"]:
                calls["n"] += 1
                raise RuntimeError("injected: the decode step fails")
            return step(tokens)
        engine.batcher.decoder.step = fails_once
        streamed = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": CANARY, "max_tokens": 30, "temperature": 0, "stream": True}))
        whole = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": CANARY, "max_tokens": 30, "temperature": 0}))
        streamed, whole = await streamed, await whole
        lines = [line.decode().strip() async for line in streamed.content]
        errors = [json.loads(line[6:]) for line in lines if line.startswith('data: {"error"')]
        assert streamed.status == 200 and len(errors) == 1, lines
        assert errors[0]["error"]["code"] == "generation_failed" and "data: [DONE]" not in lines
        assert whole.status == 500 and (await whole.json())["error"]["code"] == "generation_failed"
        text, _, _ = await stream_text(client, CANARY, 60)   # served again, the same completion
        return (text, *await settled(client))
    text, status, health = serve(trained, body, step_seconds=0.01)
    assert text == want
    assert status == 200 and health["status"] == "ok" and health["finished"]["error"] == 3, health


def test_an_engine_that_cannot_go_on_says_so_and_asks_the_server_to_stop(trained):
    """The decode step failing on every try: after 3 in a row the engine stops, /health answers
    503 "failed", new requests 503, and on_fatal (the server's exit, code 1) is called."""
    stopped = []

    async def body(client, engine):
        engine.on_fatal = lambda: stopped.append(True)

        def broken(tokens):
            raise RuntimeError("injected: the device is gone")
        engine.batcher.decoder.step = broken
        codes = []
        for _ in range(3):
            reply = await client.post("/v1/completions", json={"prompt": CANARY, "max_tokens": 5, "temperature": 0})
            codes.append((reply.status, (await reply.json())["error"]["code"]))
        for _ in range(100):
            if engine.failure is not None:
                break
            await asyncio.sleep(0.02)
        health = await client.get("/health")
        after = await client.post("/v1/completions", json={"prompt": CANARY, "max_tokens": 5})
        return codes, health.status, await health.json(), after.status, await after.json()
    codes, status, health, after, reply = serve(trained, body)
    assert codes[:2] == [(500, "generation_failed")] * 2 and codes[2][0] in (500, 503), codes
    assert status == 503 and health["status"] == "failed", health
    assert after == 503 and reply["error"]["code"] == "engine_failed", reply
    assert stopped == [True]


def test_access_control_key_content_type_host_origin_and_per_client_limit(trained):
    limits = ServeLimits(api_key="s3cret", allowed_hosts={"localhost", "127.0.0.1"}, max_pending_per_client=1)
    key = {"Authorization": "Bearer s3cret"}

    async def body(client, engine):
        out = {}
        request = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        out["no key"] = await post_raw(client, json.dumps(request).encode())
        out["wrong key"] = await post_raw(client, json.dumps(request).encode(), headers={"Authorization": "Bearer x"})
        out["models without key"] = (await client.get("/v1/models")).status
        out["health without key"] = (await client.get("/health")).status
        out["with key"] = await post_raw(client, json.dumps(request).encode(), headers=key)
        out["text/plain"] = await post_raw(client, json.dumps(request).encode(), "text/plain", headers=key)
        out["foreign host"] = await post_raw(client, json.dumps(request).encode(),
                                             headers={**key, "Host": "attacker.example:8000"})
        out["foreign origin"] = await post_raw(client, json.dumps(request).encode(),
                                               headers={**key, "Origin": "http://attacker.example"})
        out["localhost"] = await post_raw(client, json.dumps(request).encode(), headers={**key, "Host": "localhost:80"})
        unknown = await client.get("/v1/engines", headers=key)
        out["unknown path"] = unknown.status, await unknown.json()
        # one client (this address) with one request running: the second gets 429 (once the engine
        # has closed its books on the requests above: its count of them could pass for the first's)
        await settled(client)
        first = asyncio.create_task(client.post("/v1/completions", headers=key, json={
            "prompt": CANARY, "max_tokens": 60, "temperature": 0}))
        while not engine.busy():
            await asyncio.sleep(0.01)
        out["second of a client"] = await post_raw(client, json.dumps(request).encode(), headers=key)
        out["first"] = (await first).status
        return out
    out = serve(trained, body, limits, step_seconds=0.01)
    assert out["no key"][0] == 401 and out["no key"][1]["error"]["code"] == "invalid_api_key", out["no key"]
    assert out["wrong key"][0] == 401 and out["models without key"] == 401 and out["health without key"] == 200
    assert out["with key"][0] == 200 and out["with key"][1]["choices"][0]["finish_reason"] == "length"
    assert out["text/plain"][0] == 415
    host_code, host_reply = out["foreign host"]
    assert host_code == 403 and "Host 'attacker.example:8000'" in host_reply["error"]["message"], host_reply
    assert out["foreign origin"][0] == 403 and out["foreign origin"][1]["error"]["code"] == "origin_not_allowed"
    assert out["localhost"][0] == 200
    assert out["unknown path"][0] == 404 and "GET /v1/engines" in out["unknown path"][1]["error"]["message"]
    assert out["second of a client"][0] == 429 and "max-pending-per-client" in out["second of a client"][1]["error"][
        "message"]
    assert out["first"] == 200


def test_a_length_over_max_model_len_blames_max_tokens_or_the_prompt_whichever_is_at_fault(trained):
    """Before: max_tokens alone over --max-model-len was blamed on the prompt (param "prompt",
    "send a shorter prompt"), measured on the prompt's bytes before it was tokenized."""
    long_prompt = " ".join(["water"] * 300)   # 300 tokens, but few enough bytes to be tokenized
    canary = len(trained.tokenizer.encode(CANARY).ids)

    async def body(client, engine):
        out = []
        for prompt, max_tokens in (("Hi", 300), ("Hi", 256), (CANARY, 257 - canary), (long_prompt, 1),
                                   (long_prompt, 500)):
            code, reply = await post_raw(client, json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode())
            out.append((code, reply["error"]["param"], reply["error"]["message"]))
        return out
    limit = "over this server's --max-model-len of 256 tokens (prompt + max_tokens)"
    alone, exactly, together, prompt, both = serve(trained, body)
    assert alone == (400, "max_tokens", f"max_tokens 300 after the prompt's 1 token makes 301 tokens, {limit}: ask "
                                        f"for at most 255 max_tokens"), alone
    assert exactly[:2] == (400, "max_tokens") and "ask for at most 255 max_tokens" in exactly[2], exactly
    assert together == (400, "max_tokens", f"max_tokens {257 - canary} after the prompt's {canary} tokens makes "
                                           f"257 tokens, {limit}: ask for at most {256 - canary} max_tokens (or send "
                                           f"a shorter prompt)"), together
    assert prompt == (400, "prompt", "the prompt is 300 tokens, which leaves no room for a completion under this "
                                     "server's --max-model-len of 256 tokens (prompt + max_tokens): send a shorter "
                                     "prompt"), prompt
    assert both[:2] == (400, "prompt") and both[2].endswith(
        "send a shorter prompt (and max_tokens 500 alone is over it too: ask for fewer)"), both


def test_a_client_that_hangs_up_mid_stream_is_cancelled_without_a_traceback_in_the_log(trained, caplog, capsys):
    """Before: a hang-up whose write came before aiohttp's handler cancellation (a token arriving
    in the same turn of the event loop: 1 to 2 streams in 10 on `serve`) left aiohttp's
    "Error handling request" and a 25-line "Cannot write to closing transport" traceback in the
    log. Without handler cancellation every hang-up takes that path (deterministic here); with
    it, as `serve` runs, a few hang-ups more."""
    import logging
    caplog.set_level(logging.DEBUG, logger="aiohttp")

    async def body(client, engine, hang_ups):
        for n in range(1, hang_ups + 1):
            reply = await client.post("/v1/completions", json={"prompt": CANARY, "max_tokens": 200,
                                                               "temperature": 0, "stream": True})
            assert reply.status == 200
            assert (await reply.content.readline()).startswith(b"data: {")
            reply.close()   # hang up mid-stream
            for _ in range(500):
                if engine.finished["cancelled"] == n and not engine.busy():
                    break
                await asyncio.sleep(0.01)
            assert engine.finished["cancelled"] == n and not engine.busy(), engine.finished
        # and the server goes on serving
        text, _, _ = await stream_text(client, CANARY, 5)
        return text
    want = greedy(trained, CANARY, 5)
    for cancellation, hang_ups in ((False, 1), (True, 3)):
        got = serve(trained, lambda client, engine: body(client, engine, hang_ups), step_seconds=0.005,
                    handler_cancellation=cancellation)
        assert got == want
    logged = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not logged, [(r.name, r.getMessage(), r.exc_info and r.exc_info[1]) for r in logged]
    err = capsys.readouterr().err
    assert "Traceback" not in err and "closing transport" not in err, err


def test_the_bearer_scheme_is_read_in_any_case(trained):
    """`curl -H 'Authorization: bearer KEY'` got 401 (the scheme is case-blind: RFC 7235)."""
    async def body(client, engine):
        out = []
        for given in ("bearer s3cret", "BEARER  s3cret", "Basic s3cret", "s3cret", "Bearer s3cre"):
            reply = await client.get("/v1/models", headers={"Authorization": given})
            out.append(reply.status)
        return out
    assert serve(trained, body, ServeLimits(api_key="s3cret")) == [200, 200, 401, 401, 401]


def test_a_body_that_never_arrives_gets_408_and_a_request_past_its_deadline_504(trained):
    """200 connections sending Content-Length 1000 then 10 bytes held their sockets forever."""
    limits = ServeLimits(read_timeout=0.5, request_timeout=0.5)

    async def body(client, engine):
        host, port = client.server.host, client.server.port
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        await writer.drain()
        started = time.monotonic()
        head = await asyncio.wait_for(reader.read(4096), 10)
        waited = time.monotonic() - started
        writer.close()
        late = await client.post("/v1/completions", json={"prompt": CANARY, "max_tokens": 200, "temperature": 0})
        return head.decode(errors="replace"), waited, late.status, await late.json()
    head, waited, status, reply = serve(trained, body, limits, step_seconds=0.02)
    assert head.startswith("HTTP/1.1 408") and "serve --read-timeout" in head and 0.4 < waited < 5, (head, waited)
    assert status == 504 and reply["error"]["code"] == "timeout" and "serve --request-timeout" in \
        reply["error"]["message"], reply


def test_stop_strings_cut_the_text_before_them_streaming_or_not(trained):
    """`stop` was refused; clients send it by default. The text ends before the first stop string
    (not included, as OpenAI does), finish_reason "stop"; a stream never sends a stop string's
    beginning that it later withholds."""
    whole = greedy(trained, CANARY, 60)
    cut = whole[len(whole) // 3: len(whole) // 3 + 4]
    assert cut.strip() and whole.find(cut) > 0
    want = whole[:whole.find(cut)]

    async def body(client, engine):
        plain = await client.post("/v1/completions", json={"prompt": CANARY, "max_tokens": 60, "temperature": 0,
                                                           "stop": ["never appears \u2603", cut]})
        streamed = await stream_text(client, CANARY, 60, stop=cut)
        return await plain.json(), streamed
    plain, (text, events, _) = serve(trained, body)
    assert plain["choices"][0]["text"] == want and plain["choices"][0]["finish_reason"] == "stop", plain
    assert text == want and events[-1]["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] < 60


def test_a_signal_drains_while_still_listening_new_requests_get_503_and_a_second_stops_at_once(trained):
    """After SIGTERM the listening socket was closed first: new clients were refused a connection
    instead of the documented 503. The handler (drain_then_stop, as serve installs it) is called
    here as the signal would."""
    want = greedy(trained, CANARY, 80)

    async def body(client, engine):
        stopped = []
        on_signal = drain_then_stop(client.server.app, lambda: stopped.append(engine.busy()))
        canary = asyncio.create_task(stream_text(client, CANARY, 80))
        while not engine.busy():
            await asyncio.sleep(0.01)
        on_signal()
        code, reply = await post_raw(client, json.dumps({"prompt": "Hi"}).encode())
        health = await (await client.get("/health")).json()
        refused_at = time.monotonic()
        text, _, finished = await canary
        for _ in range(100):
            if stopped:
                break
            await asyncio.sleep(0.02)
        on_signal()   # a second signal: stop now (the server is stopping already: not a second time)
        return code, reply, health, refused_at, text, finished, stopped
    code, reply, health, refused_at, text, finished, stopped = serve(trained, body, step_seconds=0.02)
    assert code == 503 and "shutting down" in reply["error"]["message"] and health["status"] == "draining"
    assert refused_at < finished, "the canary had finished before the new request was refused"
    assert text == want, "the running stream was not let finish whole"
    assert stopped == [0], "the server was stopped before its requests were done, or twice"


def test_the_app_keeps_its_drain_under_a_typed_key(trained):
    """(aiohttp's AppKey: no warning about string keys in the server's log.)"""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        app = build_app(Engine(ContinuousBatcher(trained.model, slots=1, capacity=8), 1, trained.eod),
                        trained.tokenizer, "hf", 8, ServeLimits())
    assert callable(app[DRAIN])


CHATML = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
          "{{ raise_exception('the system message must come first') }}{% endif %}"
          "<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_completions_render_the_tokenizers_template_and_answer_as_openai_does(trained, tmp_path):
    """/v1/chat/completions: the messages rendered by the tokenizer's chat template (found where
    transformers keeps it), then generated as a completion; the reply is OpenAI's chat shape,
    streaming (role first, then content deltas) or not. Without a template, a 400 saying so."""
    from megatron_id.data.tokenizer import chat_template_of
    from megatron_id.inference.api import ChatTemplate
    (tmp_path / "tokenizer.json").write_text("{}")
    assert chat_template_of(tmp_path / "tokenizer.json") is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default",
                                                                                   "template": CHATML}]}))
    assert chat_template_of(tmp_path / "tokenizer.json") == CHATML
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert chat_template_of(tmp_path / "tokenizer.json") == "{{ messages[0].content }}"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The water cycle"}]
    rendered = "<|system|>Be brief.\n<|user|>The water cycle\n<|assistant|>"
    want = greedy(trained, rendered, 12)

    async def body(client, engine):
        ask = {"messages": messages, "max_completion_tokens": 12, "temperature": 0, "logprobs": False}
        plain = await (await client.post("/v1/chat/completions", json=ask)).json()
        reply = await client.post("/v1/chat/completions", json={**ask, "stream": True})
        events = [json.loads(line.decode()[6:]) async for line in reply.content if line.startswith(b"data: {")]
        bad = [await post_raw_to(client, "/v1/chat/completions", b) for b in (
            {"messages": [{"role": "wizard", "content": "hi"}]},
            {"messages": [messages[1], messages[0]]},
            {"messages": messages, "max_tokens": 3, "max_completion_tokens": 3},
            {"messages": messages, "prompt": "x"})]
        return plain, events, bad
    plain, events, bad = serve(trained, body, chat=ChatTemplate(CHATML, {"bos_token": "", "eos_token": ""}))
    assert plain["object"] == "chat.completion" and plain["id"].startswith("chatcmpl-")
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": want}, plain
    assert plain["choices"][0]["finish_reason"] == "length" and plain["usage"]["completion_tokens"] == 12
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    codes = [(code, reply["error"]["message"]) for code, reply in bad]
    assert codes[0][0] == 400 and "messages[0] must be" in codes[0][1], codes
    assert codes[1][0] == 400 and "the chat template refused the messages: the system message must come first" \
        in codes[1][1], codes
    assert codes[2][0] == 400 and "max_tokens or max_completion_tokens, not both" in codes[2][1]
    assert codes[3][0] == 400 and "unknown field(s) prompt" in codes[3][1]

    async def without(client, engine):
        return await post_raw_to(client, "/v1/chat/completions", {"messages": messages})
    code, reply = serve(trained, without)
    assert code == 400 and "this model's tokenizer has no chat template" in reply["error"]["message"], reply


async def post_raw_to(client, path: str, body: dict):
    reply = await client.post(path, json=body)
    return reply.status, await reply.json()


def test_an_export_keeps_its_tokenizers_chat_template_and_renders_it_as_transformers_does(tmp_path):
    """A tokenizer with a chat template (an imported Llama / Qwen keeps the source's) is exported
    with it in tokenizer_config.json: serve finds it there, and renders the messages exactly as
    transformers' apply_chat_template does."""
    import shutil

    from conftest import CONFIGS
    from hf_tiny import TOKENIZER, export_model
    from transformers import AutoTokenizer

    from megatron_id.config import load_config
    from megatron_id.data.tokenizer import chat_template_of
    from megatron_id.inference.api import ChatTemplate
    from megatron_id.model.language_model import LanguageModel
    source = tmp_path / "tok"
    source.mkdir()
    shutil.copy(TOKENIZER, source / "tokenizer.json")
    (source / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    cfg = load_config([CONFIGS / "model" / "tiny.yaml"], ["model.vocab_size=50257"]).model
    folder = export_model(LanguageModel(cfg, seed=1), cfg, tmp_path / "hf", tokenizer=source / "tokenizer.json")
    assert chat_template_of(folder / "tokenizer.json") == CHATML
    assert load_trained(folder).tokenizer_path.parent == folder
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rain?"},
                {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Why?"}]
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True)
    assert ChatTemplate(CHATML, {"bos_token": "", "eos_token": ""}).render(messages) == theirs
