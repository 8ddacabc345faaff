"""`megatron-id serve` as OpenAI's and vLLM's clients use it (issue 55), in-process (aiohttp's
test client over the real app and engine, a tiny export, test_serve_robust.py's harness): fresh
sampling without a seed, chat without a max_tokens cap, the end-of-text token counted, stop
strings counted as "stop", vLLM's extras (ignore_eos, include_stop_str_in_output, /tokenize,
/detokenize, /version), chat content parts and the developer role; then a real process: 64
clients at once past the slots all served, and a second signal that stops it at once."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from hf_tiny import tiny_export
from test_serve_robust import CANARY, CHATML, greedy, post_raw_to, serve, settled, stream_text

from megatron_id.inference.api import ChatTemplate
from megatron_id.inference.generate import generate_ids, load_trained


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("openai") / "hf")


@pytest.fixture(scope="module")
def trained(folder):
    return load_trained(folder)


def test_sampling_without_a_seed_draws_afresh_and_a_seed_repeats(trained):
    """Before: `seed` defaulted to 0, so every sampled request without one (the openai client
    never sends one) gave the same text, across restarts too."""
    ask = {"prompt": CANARY, "max_tokens": 12, "temperature": 1.5}

    async def body(client, engine):
        unseeded = [await post_raw_to(client, "/v1/completions", ask) for _ in range(3)]
        seeded = [await post_raw_to(client, "/v1/completions", {**ask, "seed": 7}) for _ in range(2)]
        return unseeded, seeded
    unseeded, seeded = serve(trained, body)
    assert all(code == 200 for code, _ in unseeded + seeded)
    texts = [reply["choices"][0]["text"] for _, reply in unseeded]
    assert len(set(texts)) > 1, texts
    assert seeded[0][1]["choices"][0]["text"] == seeded[1][1]["choices"][0]["text"]


def test_chat_without_max_tokens_runs_on_past_16_and_completions_keep_openais_16(trained):
    """Before: a chat request without max_tokens stopped at 16 tokens (finish_reason "length");
    OpenAI's chat has no such cap (its legacy completions do: 16)."""
    messages = [{"role": "user", "content": CANARY}]

    async def body(client, engine):
        chat = await post_raw_to(client, "/v1/chat/completions", {"messages": messages, "temperature": 0})
        plain = await post_raw_to(client, "/v1/completions", {"prompt": CANARY, "temperature": 0})
        return chat, plain
    (code, chat), (_, plain) = serve(trained, body, chat=ChatTemplate(CHATML, {"bos_token": "", "eos_token": ""}))
    assert code == 200, chat
    usage = chat["usage"]
    # the end of text, or all the room the context leaves (MAX_MODEL_LEN 256 in the harness)
    assert usage["completion_tokens"] > 16 and (chat["choices"][0]["finish_reason"] == "stop" or
                                                usage["total_tokens"] == 256), chat
    assert plain["usage"]["completion_tokens"] == 16


def test_the_end_of_text_token_is_counted_and_ignore_eos_runs_past_it(trained):
    """Before: completion_tokens left out the end-of-text token (generate --input-file counts it:
    the same text, 2 against 1), and vLLM's ignore_eos was "unknown field". Here the model's 3rd
    greedy token is made the end-of-text token, so that it comes."""
    ids = trained.tokenizer.encode(CANARY).ids
    greedy_ids = list(generate_ids(trained.model, ids, 8, decode="eager"))
    eos = greedy_ids[2]
    assert eos not in greedy_ids[:2]
    trained_eos = SimpleNamespace(model=trained.model, tokenizer=trained.tokenizer, eod=eos)

    async def body(client, engine):
        ask = {"prompt": CANARY, "max_tokens": 8, "temperature": 0}
        ended = await post_raw_to(client, "/v1/completions", ask)
        ignored = await post_raw_to(client, "/v1/completions", {**ask, "ignore_eos": True})
        return ended, ignored
    (code, ended), (code2, ignored) = serve(trained_eos, body)
    assert code == 200 and code2 == 200, (ended, ignored)
    assert ended["choices"][0]["finish_reason"] == "stop" and ended["usage"]["completion_tokens"] == 3, ended
    assert ended["choices"][0]["text"] == trained.tokenizer.decode(greedy_ids[:2])
    assert ignored["choices"][0]["finish_reason"] == "length" and ignored["usage"]["completion_tokens"] == 8
    assert ignored["choices"][0]["text"] == trained.tokenizer.decode(greedy_ids)


def test_a_stop_string_finish_is_counted_as_stop_and_include_stop_str_in_output_keeps_it(trained):
    """Before: /health counted a stop string's finish as "cancelled" while the client was told
    "stop"; include_stop_str_in_output (vLLM's) was "unknown field"."""
    whole = greedy(trained, CANARY, 60)
    cut = whole[len(whole) // 3: len(whole) // 3 + 4]
    assert cut.strip() and whole.find(cut) > 0

    async def body(client, engine):
        kept = await post_raw_to(client, "/v1/completions", {"prompt": CANARY, "max_tokens": 60, "temperature": 0,
                                                              "stop": cut, "include_stop_str_in_output": True})
        streamed, _, _ = await stream_text(client, CANARY, 60, stop=cut)
        _, health = await settled(client)
        return kept, streamed, health
    (code, kept), streamed, health = serve(trained, body)
    assert code == 200 and kept["choices"][0]["text"] == whole[:whole.find(cut) + len(cut)], kept
    assert streamed == whole[:whole.find(cut)]
    assert health["finished"] == {"stop": 2}, health


def test_vllms_tokenize_detokenize_version_and_models_created(trained):
    """vLLM's /tokenize, /detokenize and /version (lm-eval and load generators call them) were 404;
    /v1/models had no `created`."""
    ids = trained.tokenizer.encode(CANARY).ids

    async def body(client, engine):
        out = [await post_raw_to(client, "/tokenize", {"prompt": CANARY}),
               await post_raw_to(client, "/detokenize", {"tokens": ids}),
               await post_raw_to(client, "/detokenize", {"tokens": [ids[0], -1]}),
               await post_raw_to(client, "/tokenize", {"text": CANARY})]
        version = await (await client.get("/version")).json()
        models = await (await client.get("/v1/models")).json()
        return out, version, models
    (tokenized, detokenized, bad_id, bad_field), version, models = serve(trained, body)
    assert tokenized == (200, {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None})
    assert detokenized == (200, {"prompt": CANARY})
    assert bad_id[0] == 400 and "tokens[1] = -1" in bad_id[1]["error"]["message"], bad_id
    assert bad_field[0] == 400 and bad_field[1]["error"]["param"] == "prompt"
    from importlib.metadata import version as installed
    assert version == {"version": installed("megatron_id")}
    assert isinstance(models["data"][0]["created"], int) and models["data"][0]["created"] > 1.7e9


def test_metrics_in_prometheus_text_format_count_what_was_served(trained):
    """vLLM's /metrics (Prometheus) was 404: the sequences by finish reason and pending, the
    tokens read and generated, the prefix cache's counters, as the requests' usage says."""
    from megatron_id.inference.prefix_cache import PrefixCache

    async def body(client, engine):
        usages = []
        for ask in ({"prompt": CANARY, "max_tokens": 5}, {"prompt": [CANARY, "Rivers carry"], "max_tokens": 3}):
            usages.append((await post_raw_to(client, "/v1/completions", {**ask, "temperature": 0}))[1]["usage"])
        await settled(client)
        reply = await client.get("/metrics")
        return usages, reply.status, reply.headers["Content-Type"], await reply.text()
    usages, status, kind, text = serve(trained, body, prefix_cache=PrefixCache(block=8, max_bytes=2**20))
    assert status == 200 and kind.startswith("text/plain"), kind
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["megatron_id_requests_answered_total"] == 2
    assert values["megatron_id_prompt_tokens_total"] == sum(u["prompt_tokens"] for u in usages)
    assert values["megatron_id_generation_tokens_total"] == sum(u["completion_tokens"] for u in usages) == 11
    assert values['megatron_id_sequences_finished_total{finish_reason="length"}'] == 3
    assert values["megatron_id_requests_pending"] == 0 and values["megatron_id_prefix_cache_misses_total"] == 3
    assert "# TYPE megatron_id_prefix_cache_bytes gauge" in text


def test_a_request_aiohttp_cannot_parse_gets_a_json_error_too(trained):
    """Before: a garbage request line or a header over 8 KB got aiohttp's plain-text 400 (it never
    reaches the app's middleware); the server promises a JSON error for every error."""
    from megatron_id.inference.openai_app import json_protocol_errors
    json_protocol_errors()

    async def body(client, engine):
        answers = []
        for raw in (b"GARBAGE\r\n\r\n",
                    b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"):
            reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
            writer.write(raw)
            await writer.drain()
            answers.append((await asyncio.wait_for(reader.read(65536), 10)).decode(errors="replace"))
            writer.close()
        return answers
    for answer in serve(trained, body):
        head, _, payload = answer.partition("\r\n\r\n")
        assert head.split("\r\n")[0].endswith(" 400 Bad Request") and "application/json" in head, answer
        assert json.loads(payload)["error"]["message"].startswith("400 Bad Request: the request could not be read")


def test_chat_content_parts_and_the_developer_role_read_as_text_and_system(trained):
    """The openai client's content parts ([{"type": "text", "text": ...}]) and its `developer`
    role got 400; parts are joined, developer is rendered as system (what templates know)."""
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The water cycle"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "The water cycle"}]}]

    async def body(client, engine):
        ask = {"max_tokens": 8, "temperature": 0}
        return [await post_raw_to(client, "/v1/chat/completions", {**ask, "messages": m}) for m in (
            plain, parts, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])]
    (c1, want), (c2, got), (c3, image) = serve(trained, body, chat=ChatTemplate(CHATML, {"bos_token": "",
                                                                                          "eos_token": ""}))
    assert c1 == c2 == 200
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert c3 == 400 and "text parts only" in image["error"]["message"], image


def test_prompt_lists_token_id_prompts_and_n_give_one_choice_each_by_index(trained):
    """Before: a prompt as a list or as token ids (lm-eval's default sends lists of token ids) and
    n > 1 got 400. Each prompt x n is a sequence of the engine; choices come back by index
    (prompt i's j-th sample at i x n + j), a seeded request's samples differ from each other and
    repeat, greedy samples are equal, and a stream tags each chunk with its choice's index."""
    other = "Rivers carry"
    ids = [trained.tokenizer.encode(p).ids for p in (CANARY, other)]
    want = [greedy(trained, p, 6) for p in (CANARY, other)]

    async def body(client, engine):
        ask = {"max_tokens": 6, "temperature": 0}
        out = {"texts": await post_raw_to(client, "/v1/completions", {**ask, "prompt": [CANARY, other]}),
               "ids": await post_raw_to(client, "/v1/completions", {**ask, "prompt": ids[0]}),
               "id lists": await post_raw_to(client, "/v1/completions", {**ask, "prompt": ids}),
               "greedy n": await post_raw_to(client, "/v1/completions", {**ask, "prompt": CANARY, "n": 2})}
        sampled = {"prompt": CANARY, "max_tokens": 12, "temperature": 1.5, "n": 3, "seed": 5}
        out["sampled"] = await post_raw_to(client, "/v1/completions", sampled)
        out["again"] = await post_raw_to(client, "/v1/completions", sampled)
        reply = await client.post("/v1/completions", json={**ask, "prompt": [CANARY, other], "stream": True})
        out["stream"] = [json.loads(line.decode()[6:]) async for line in reply.content if line.startswith(b"data: {")]
        out["bad"] = [await post_raw_to(client, "/v1/completions", {**ask, **b}) for b in (
            {"prompt": [CANARY, 5]}, {"prompt": [ids[0][0], 10**9]}, {"prompt": []},
            {"prompt": CANARY, "n": 200}, {"prompt": CANARY, "best_of": 2})]
        return out
    out = serve(trained, body, max_pending=16)

    def texts(name):
        code, reply = out[name]
        assert code == 200, reply
        assert [c["index"] for c in reply["choices"]] == list(range(len(reply["choices"])))
        return [c["text"] for c in reply["choices"]]
    assert texts("texts") == want and texts("id lists") == want and texts("ids") == want[:1]
    assert out["texts"][1]["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    assert texts("greedy n") == [want[0], want[0]]
    sampled = texts("sampled")
    assert len(set(sampled)) > 1 and texts("again") == sampled, sampled
    assert out["sampled"][1]["usage"]["prompt_tokens"] == len(ids[0])   # the prompt once, not n times
    streamed = ["", ""]
    for event in out["stream"]:
        for c in event["choices"]:
            streamed[c["index"]] += c["text"]
    assert streamed == want
    codes = [(code, reply["error"]["message"]) for code, reply in out["bad"]]
    assert codes[0][0] == 400 and "prompt[1] must be a string or a non-empty list of token ids" in codes[0][1]
    assert codes[1][0] == 400 and "prompt[1] = 1000000000: token ids are integers from 0 to 50256" in codes[1][1]
    assert codes[2][0] == 400 and "prompt must be a string, a list of strings" in codes[2][1]
    assert codes[3][0] == 400 and "n=200 is out of range" in codes[3][1]
    assert codes[4][0] == 400 and "best_of=2 is not supported" in codes[4][1]


def model_logprobs(trained, ids: list[int]):
    """log p(ids[i] | ids[:i]) for i >= 1 and each place's log-softmax, from the model directly."""
    import torch
    with torch.no_grad():
        logprobs = torch.log_softmax(trained.model(torch.tensor([ids]))[0, :-1].double(), dim=-1)
    return [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)], logprobs


def test_echo_and_logprobs_are_the_models_own_and_lm_evals_parser_reads_them(trained):
    """Before: echo and logprobs got 400 (lm-eval's loglikelihood tasks send both: token-id
    prompts, max_tokens 1, logprobs 1, echo). Each token's log-probability equals the model's own
    log-softmax at its place, the top alternatives are the likeliest there, the prompt's first
    token has none; lm-eval's own parser reads a batched answer into each continuation's sum and
    whether it is greedy."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    context, continuations = "The water cycle", [" moves water", " is"]
    ctx = trained.tokenizer.encode(context).ids
    batch = [ctx + trained.tokenizer.encode(c).ids for c in continuations]

    async def body(client, engine):
        lm_eval_like = await post_raw_to(client, "/v1/completions", {
            "prompt": batch, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234})
        generated = await post_raw_to(client, "/v1/completions", {"prompt": context, "max_tokens": 5,
                                                                   "temperature": 0, "logprobs": 3})
        chat = await post_raw_to(client, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": context}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2})
        return lm_eval_like, generated, chat
    (c1, scored), (c2, generated), (c3, chat) = serve(
        trained, body, chat=ChatTemplate(CHATML, {"bos_token": "", "eos_token": ""}))
    assert c1 == c2 == c3 == 200, (scored, generated, chat)
    for ids, choice in zip(batch, scored["choices"]):
        want, table = model_logprobs(trained, ids + greedy_ids(trained, ids, 1))   # the prompt, then the token given
        got = choice["logprobs"]["token_logprobs"]
        assert got[0] is None and choice["logprobs"]["top_logprobs"][0] is None
        assert len(got) == len(ids) + 1 and max(abs(a - b) for a, b in zip(got[1:], want)) < 1e-4, (got, want)
        assert choice["text"].startswith(context + continuations[choice["index"]])
        for place, top in enumerate(choice["logprobs"]["top_logprobs"][1:]):   # the likeliest token is among them
            best = table[place].argmax().item()
            assert abs(top[trained.tokenizer.decode([best])] - table[place, best].item()) < 1e-4
    parsed = LocalCompletionsAPI.parse_logprobs(scored, tokens=batch, ctxlens=[len(ctx)] * 2)
    for (total, is_greedy), ids in zip(parsed, batch):
        want, table = model_logprobs(trained, ids)
        assert abs(total - sum(want[len(ctx) - 1:])) < 1e-3
        assert is_greedy == all(table[i].argmax().item() == ids[i + 1] for i in range(len(ctx) - 1, len(ids) - 1))
    # the completion's own tokens, without echo: greedy picks the likeliest each time
    logprobs = generated["choices"][0]["logprobs"]
    ctx_completion = ctx + greedy_ids(trained, ctx, 5)
    want, _ = model_logprobs(trained, ctx_completion)
    assert len(logprobs["tokens"]) == 5 and "".join(logprobs["tokens"]) == generated["choices"][0]["text"]
    assert max(abs(a - b) for a, b in zip(logprobs["token_logprobs"], want[len(ctx) - 1:])) < 1e-4
    assert all(max(top.values()) == lp for top, lp in zip(logprobs["top_logprobs"], logprobs["token_logprobs"]))
    assert all(len(top) == 3 for top in logprobs["top_logprobs"]) and logprobs["text_offset"][0] == 0
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and "".join(e["token"] for e in content) == chat["choices"][0]["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"] for e in content)


def test_streams_carry_each_tokens_logprobs_as_it_comes(trained):
    """Before: logprobs with stream got 400. Each chunk carries the logprobs of the tokens it
    sends (the engine's own, from the logits it sampled from): over the stream they equal the
    model's log-softmax, text_offset runs on from the echoed prompt, chat's chunks carry
    content entries; the top alternatives are the likeliest there."""
    context = "The water cycle"
    ctx = trained.tokenizer.encode(context).ids

    async def body(client, engine):
        _, plain, _ = await stream_text(client, context, 6, logprobs=3)
        _, echoed, _ = await stream_text(client, context, 2, logprobs=1, echo=True)
        reply = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": context}], "max_tokens": 4, "temperature": 0, "stream": True,
            "logprobs": True, "top_logprobs": 2})
        chat = [json.loads(line[6:]) for line in (await reply.text()).splitlines() if line.startswith("data: {")]
        return plain, echoed, chat
    plain, echoed, chat = serve(trained, body, chat=ChatTemplate(CHATML, {"bos_token": "", "eos_token": ""}))

    def joined(events):
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in events:
            for choice in e["choices"]:
                for key in out:
                    out[key] += (choice["logprobs"] or {}).get(key, [])
        return out
    got = joined(plain)
    completion = greedy_ids(trained, ctx, 6)
    want, table = model_logprobs(trained, ctx + completion)
    text = "".join(c["text"] for e in plain for c in e["choices"])
    assert len(got["tokens"]) == 6 and "".join(got["tokens"]) == text
    assert max(abs(a - b) for a, b in zip(got["token_logprobs"], want[len(ctx) - 1:])) < 1e-4, got
    assert all(len(top) == 3 and max(top.values()) == lp for top, lp in zip(got["top_logprobs"], got["token_logprobs"]))
    for place, top in zip(range(len(ctx) - 1, len(ctx) + 5), got["top_logprobs"]):
        best = table[place].topk(3).indices.tolist()
        assert {trained.tokenizer.decode([t]) for t in best} == set(top), place
    assert got["text_offset"] == [sum(len(t) for t in got["tokens"][:i]) for i in range(6)]
    # echo: the prompt's tokens first (the first has none), then the completion's, offsets running on
    got = joined(echoed)
    want, _ = model_logprobs(trained, ctx + greedy_ids(trained, ctx, 2))
    assert got["token_logprobs"][0] is None and len(got["tokens"]) == len(ctx) + 2
    assert max(abs(a - b) for a, b in zip(got["token_logprobs"][1:], want)) < 1e-4
    assert got["text_offset"] == [sum(len(t) for t in got["tokens"][:i]) for i in range(len(ctx) + 2)]
    content = [entry for e in chat for c in e["choices"] if c["logprobs"] for entry in c["logprobs"]["content"]]
    said = "".join(c["delta"].get("content", "") for e in chat for c in e["choices"])
    assert len(content) == 4 and "".join(e["token"] for e in content) == said
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"] for e in content)


def test_echo_in_a_stream_sends_each_prompt_first(trained):
    async def body(client, engine):
        reply = await client.post("/v1/completions", json={"prompt": [CANARY, "Rivers carry"], "max_tokens": 4,
                                                           "temperature": 0, "echo": True, "stream": True})
        return [json.loads(line.decode()[6:]) async for line in reply.content if line.startswith(b"data: {")]
    events = serve(trained, body)
    texts = ["", ""]
    for event in events:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == [p + greedy(trained, p, 4) for p in (CANARY, "Rivers carry")]


def test_lm_evals_local_completions_with_its_defaults_scores_as_its_hf_model_does(trained, folder):
    """The acceptance of issue 55: lm-eval 0.4.13's `local-completions` with its default settings
    (prompts sent as token ids, here batches of 2) against the server: loglikelihood and
    generate_until give what `lm_eval --model hf` gives on the export (its HFLM, as
    test_hf_clients.py runs it). Before: 400 for the token-id prompts and for echo."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    pairs = [("The water cycle", " describes how"), ("Rivers", " carry sediment to the sea"), ("A", " B")]
    scoring = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    until = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    generating = [Instance("generate_until", {}, (text, dict(until)), i)
                  for i, text in enumerate(["The water cycle describes", "Rivers", "Photosynthesis is"])]
    hf = HFLM(pretrained=str(folder), trust_remote_code=True, batch_size=1, device="cpu")
    want_scores, want_texts = hf.loglikelihood(scoring), hf.generate_until(generating)

    async def body(client, engine):
        api = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{client.server.port}/v1/completions", model="hf",
                                  tokenizer=str(folder), batch_size=2, max_length=256)
        loop = asyncio.get_running_loop()
        scores = await loop.run_in_executor(None, api.loglikelihood, scoring)
        texts = await loop.run_in_executor(None, api.generate_until, generating)
        return scores, texts
    scores, texts = serve(trained, body, max_pending=16)
    assert texts == want_texts
    for (got, got_greedy), (want, want_greedy) in zip(scores, want_scores):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4) and got_greedy == want_greedy, (scores, want_scores)


def test_sampling_parameters_bias_penalties_top_p_and_min_p_shape_the_draw():
    """The sampler behind top_p, min_p, the penalties and logit_bias (generate.sample_with): each
    against a hand-computed distribution; neutral parameters draw exactly as before."""
    import torch

    from megatron_id.inference.generate import Sampling, sample, sample_with
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))

    def draws(sampling, n=300, temperature=1.0):
        g = torch.Generator().manual_seed(0)
        return {sample_with(logits, temperature, 0, g, sampling, [], []) for _ in range(n)}
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [sample(logits, 1.0, 0, g1) for _ in range(50)] == \
        [sample_with(logits, 1.0, 0, g2, Sampling(), [1], [2]) for _ in range(50)]
    assert draws(Sampling()) == {0, 1, 2, 3}
    assert draws(Sampling(top_p=0.7)) == {0, 1} and draws(Sampling(top_p=0.5)) == {0}
    assert draws(Sampling(top_p=0.81)) == {0, 1, 2}
    assert draws(Sampling(min_p=0.5)) == {0, 1} and draws(Sampling(min_p=0.2)) == {0, 1, 2}
    greedy = lambda sampling, prompt=(), output=(): sample_with(logits, 0.0, 0, None, sampling, list(prompt),  # noqa: E731
                                                                list(output))
    assert greedy(Sampling(logit_bias=((3, 100.0),))) == 3 and greedy(Sampling(logit_bias=((0, -100.0),))) == 1
    # logits are all negative here: a repetition penalty of 2 doubles a seen token's (log 0.5 * 2 < log 0.3)
    assert greedy(Sampling(repetition_penalty=2.0), prompt=[0]) == 1
    assert greedy(Sampling(repetition_penalty=2.0), output=[0]) == 1
    assert greedy(Sampling(repetition_penalty=2.0), output=[0, 1]) == 0   # log .5 x 2 = -1.39 > log .15 = -1.90
    # frequency: log 0.5 - 2 x 0.3 = -1.29 < log 0.3 = -1.20; presence alone (0.3) is not enough
    assert greedy(Sampling(frequency_penalty=0.3), output=[0, 0]) == 1
    assert greedy(Sampling(presence_penalty=0.3), output=[0, 0]) == 0
    assert greedy(Sampling(presence_penalty=0.6), output=[0, 0]) == 1


def test_the_server_takes_top_p_min_p_penalties_and_logit_bias_and_refuses_bad_ones(trained):
    """Before: top_p != 1, penalties, logit_bias (even {}) got 400, min_p and repetition_penalty
    "unknown field"."""
    ask = {"prompt": CANARY, "max_tokens": 6, "temperature": 0}
    forced = trained.tokenizer.encode(" river").ids[0]

    async def body(client, engine):
        out = [await post_raw_to(client, "/v1/completions", {**ask, **extra}) for extra in (
            {"logit_bias": {str(forced): 100}}, {"logit_bias": {}}, {"temperature": 1.5, "top_p": 1e-9, "seed": 3},
            {"temperature": 1.5, "min_p": 1.0, "seed": 4}, {"presence_penalty": 0.5, "frequency_penalty": 0.5,
                                                             "repetition_penalty": 1.2},
            {"top_p": 0}, {"logit_bias": {"x": 1}}, {"logit_bias": {str(10**9): 1}}, {"presence_penalty": 3})]
        return out
    out = serve(trained, body)
    want = greedy(trained, CANARY, 6)
    assert [code for code, _ in out[:5]] == [200] * 5, out[:5]
    assert out[0][1]["choices"][0]["text"] == trained.tokenizer.decode([forced] * 6)
    assert out[1][1]["choices"][0]["text"] == want
    assert out[2][1]["choices"][0]["text"] == want and out[3][1]["choices"][0]["text"] == want   # one token left
    params = [(code, reply["error"]["param"]) for code, reply in out[5:]]
    assert params == [(400, "top_p"), (400, "logit_bias"), (400, "logit_bias"), (400, "presence_penalty")], params


SYSTEM = ("You answer questions about the water cycle, rivers, clouds and the sea in one short sentence, "
          "plainly, for a reader who is twelve years old and curious about how water moves on Earth. ")


def test_a_shared_prefix_is_saved_once_seen_twice_and_later_prompts_start_from_it_with_the_same_tokens(trained):
    """Prefix caching of the state (issue 55): the first prompt is read whole, the second (which
    shares the system prompt) saves the state at the last block boundary inside the shared
    prefix, the rest start there. Every completion equals the model's alone, and the counters
    say what happened. A cache too small for one state keeps nothing and changes nothing."""
    from megatron_id.inference.prefix_cache import PrefixCache
    questions = ["Why does it rain?", "Where do rivers go?", "What is a cloud?", "Why is the sea salty?"]
    prompts = [SYSTEM + q for q in questions]
    want = [greedy(trained, p, 8) for p in prompts]
    ids = [trained.tokenizer.encode(p).ids for p in prompts]
    shared = min(next(i for i, (a, b) in enumerate(zip(ids[0], other)) if a != b) for other in ids[1:])
    block = trained.cfg.chunk_size
    boundary = shared // block * block
    assert boundary >= 2 * block, (shared, block)

    async def body(client, engine):
        texts, healths = [], []
        for prompt in prompts:
            _, reply = await post_raw_to(client, "/v1/completions", {"prompt": prompt, "max_tokens": 8,
                                                                      "temperature": 0})
            texts.append(reply["choices"][0]["text"])
            healths.append((await settled(client))[1]["prefix_cache"])
        return texts, healths
    cache = PrefixCache(block=block, max_bytes=64 * 2**20)
    texts, healths = serve(trained, body, prefix_cache=cache)
    assert texts == want
    assert [(h["entries"], h["hits"], h["misses"]) for h in healths] == [(0, 0, 1), (1, 0, 2), (1, 1, 2), (1, 2, 2)]
    assert healths[-1]["tokens_saved"] == 2 * boundary and 0 < healths[-1]["bytes"] <= 64 * 2**20
    tiny = PrefixCache(block=block, max_bytes=1024)
    texts, healths = serve(trained, body, prefix_cache=tiny)
    assert texts == want and healths[-1]["entries"] == 0 and healths[-1]["hits"] == 0


def test_the_prefix_cache_evicts_the_least_recently_used_within_its_bytes():
    import torch

    from megatron_id.inference.prefix_cache import PrefixCache
    state = [{"ssm": torch.zeros(256), "conv": {"k": torch.zeros(64)}, "pos": 8, "tables": torch.zeros(10**6)}]
    size = 4 * (256 + 64)   # float32, "tables" not counted (parameter-only, rebuilt)
    cache = PrefixCache(block=4, max_bytes=2 * size)
    keys = [b"a" * 16, b"b" * 16, b"c" * 16]
    cache.put(keys[0], state)
    cache.put(keys[1], state)
    cache.entries.move_to_end(keys[0])   # (a hit on the first)
    cache.put(keys[2], state)
    assert list(cache.entries) == [keys[0], keys[2]] and cache.bytes == 2 * size
    assert cache.entries[keys[0]][0][0]["tables"] is None and cache.entries[keys[0]][0][0]["ssm"] is not state[0]["ssm"]


def test_the_openai_clients_n_logprobs_top_p_and_echo(trained):
    """The acceptance's wording: the openai client library's own calls with n, logprobs, top_p and
    echo (completions) and logprobs / top_logprobs (chat), as a client sends them."""
    from openai import OpenAI

    def calls(port):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        plain = client.completions.create(model="hf", prompt=CANARY, max_tokens=4, temperature=0, n=2,
                                          logprobs=2, top_p=0.9, echo=True)
        chat = client.chat.completions.create(model="hf", messages=[{"role": "user", "content": CANARY}],
                                              max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
        return plain, chat

    async def body(client, engine):
        return await asyncio.get_running_loop().run_in_executor(None, calls, client.server.port)
    plain, chat = serve(trained, body, chat=ChatTemplate(CHATML, {"bos_token": "", "eos_token": ""}))
    want = greedy(trained, CANARY, 4)
    assert [c.index for c in plain.choices] == [0, 1]
    for c in plain.choices:
        assert c.text == CANARY + want and c.finish_reason == "length"
        assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
        assert "".join(c.logprobs.tokens) == c.text and all(len(top) >= 2 for top in c.logprobs.top_logprobs[1:])
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 2 for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content


def greedy_ids(trained, ids, n):
    return list(generate_ids(trained.model, ids, n, decode="eager"))


def test_a_real_server_queues_64_clients_past_its_slots_and_a_second_sigterm_stops_it_at_once(tmp_path):
    """Before: with the default 8 slots and 32 pending, 64 clients at once got 8 refusals (503)
    that the client's retries did not absorb (128: 77). And a second SIGTERM during the drain
    drained again (12-30 s), then the process exited 1 with no closing line."""
    from test_serve import Server
    export = tiny_export(tmp_path / "hf")
    server = Server(export, "--max-model-len", "100000", "--drain-timeout", "60")
    try:
        codes = []

        def one(i):
            request = urllib.request.Request(server.url("/v1/completions"), data=json.dumps(
                {"prompt": f"{CANARY} {i}", "max_tokens": 8, "temperature": 0}).encode(),
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as r:
                    codes.append(r.status)
            except urllib.error.HTTPError as e:
                codes.append(e.code)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert codes == [200] * 64, sorted(codes)

        # a long stream runs; SIGTERM starts the drain (up to --drain-timeout 60 s), a second stops now
        request = urllib.request.Request(server.url("/v1/completions"), data=json.dumps(
            {"prompt": CANARY, "max_tokens": 90000, "temperature": 0, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        reply = urllib.request.urlopen(request, timeout=120)
        assert reply.readline().startswith(b"data: {")
        server.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert server.process.poll() is None, "the first signal stopped the server without a drain"
        second = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=30)
        took = time.monotonic() - second
        lines = [line for line in reply.read().decode().splitlines() if line.startswith("data: {")]
        reply.close()
    finally:
        server.stop()
    output = server.output() if not server.log.closed else open(server.log.name).read()
    assert code == 0 and took < 10, (code, took, output[-2000:])
    assert "megatron-id serve: stopped" in output, output[-2000:]
    assert json.loads(lines[-1][6:])["choices"][0]["finish_reason"] == "cancelled", lines[-1]


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", __file__]))
