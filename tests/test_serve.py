"""`megatron-id serve` under load on 127.0.0.1 (issue 31): 32 concurrent clients through the
openai client library, streaming and not; every greedy completion equals generate_ids one at a
time, none lost or mixed; the server's memory stays flat as clients come and go (fixed-state
model); bad requests get 400 with a message; a burst past --max-pending gets 503; SIGTERM lets
the running streams finish and exits 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ROOT
from hf_tiny import tiny_export

pytestmark = pytest.mark.slow
PROMPTS = ["The water cycle", "Rivers carry", "A", "In 1850 the city of", "Clouds", "Snow falls when the air is",
           "Mountains", "Ocean currents move heat from the equator toward"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, folder, *args, launcher=("-m", "megatron_id.cli")):
        self.port = free_port()
        self.log = open(folder.parent / f"serve-{self.port}.log", "w+")
        self.process = subprocess.Popen(
            [sys.executable, *map(str, launcher), "serve", "--checkpoint", str(folder), "--port", str(self.port),
             "--threads", "1", *map(str, args)], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.process.poll() is None, self.output()
            try:
                if self.get("/health")["status"] == "ok":
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the server did not come up:\n" + self.output())

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path):
        with urllib.request.urlopen(self.url(path), timeout=30) as r:
            return json.loads(r.read())

    def post(self, body) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url("/v1/completions"), data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def rss_mib(self) -> float:
        for line in open(f"/proc/{self.process.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return tiny_export(tmp_path_factory.mktemp("serve") / "hf")


def references(folder, max_tokens: int) -> dict:
    from megatron_id.inference.generate import generate_ids, load_trained
    trained = load_trained(folder)
    out = {}
    for prompt in PROMPTS:
        ids = list(generate_ids(trained.model, trained.tokenizer.encode(prompt).ids, max_tokens, decode="eager"))
        out[prompt] = trained.tokenizer.decode(ids)
    return out


def test_thirty_two_clients_get_what_generate_gives_alone_and_memory_stays_flat(export):
    from openai import OpenAI
    max_tokens = 12
    want = references(export, max_tokens)
    server = Server(export, "--slots", 4, "--max-pending", 8, "--max-model-len", 4096)
    try:
        client = OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=50, timeout=120)
        model = client.models.list().data[0].id
        assert model == "hf"

        def one_client(index: int) -> list:
            got = []
            for k in range(3):
                prompt = PROMPTS[(index + k) % len(PROMPTS)]
                if (index + k) % 2:
                    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True})
                    chunks = list(stream)
                    text = "".join(c.choices[0].text for c in chunks if c.choices)
                    finish = chunks[-2].choices[0].finish_reason
                    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == max_tokens
                else:
                    done = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
                    text, finish = done.choices[0].text, done.choices[0].finish_reason
                    assert done.usage.completion_tokens == max_tokens
                got.append((prompt, text, finish))
            return got

        rss = []
        for wave in range(3):   # clients come and go: 32 at once, three times over
            with ThreadPoolExecutor(32) as pool:
                results = [r for rs in pool.map(one_client, range(32)) for r in rs]
            assert len(results) == 96
            for prompt, text, finish in results:
                assert text == want[prompt] and finish == "length", (prompt, text, want[prompt])
            rss.append(server.rss_mib())
        # after the first wave has touched everything: flat (constant-size state slots)
        assert rss[2] - rss[1] < 25, rss
        health = server.get("/health")
        assert health["pending"] == 0 and health["finished"] == {"length": 288}, health
        # a client that goes away mid-stream: its sequence is cancelled, not decoded to the end
        request = urllib.request.Request(server.url("/v1/completions"), data=json.dumps(
            {"prompt": "The water cycle", "max_tokens": 3000, "temperature": 0, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            assert r.readline().startswith(b"data: {")
        deadline = time.time() + 30
        while server.get("/health")["finished"].get("cancelled") != 1 and time.time() < deadline:
            time.sleep(0.05)
        assert server.get("/health")["pending"] == 0
        # and one that goes away while waiting for a whole (non-streaming) completion: before,
        # its sequence kept its slot to max_tokens
        body = json.dumps({"prompt": "The water cycle", "max_tokens": 3000, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            deadline = time.time() + 30
            while server.get("/health")["pending"] < 1 and time.time() < deadline:
                time.sleep(0.01)
        deadline = time.time() + 30
        while server.get("/health")["finished"].get("cancelled") != 2 and time.time() < deadline:
            time.sleep(0.05)
        health = server.get("/health")
        assert {k: v for k, v in health.items() if k != "prefix_cache"} == \
            {"status": "ok", "pending": 0, "finished": {"length": 288, "cancelled": 2}}, health
        cache = health["prefix_cache"]   # every prompt read once, through the prefix cache
        assert cache["hits"] + cache["misses"] == 290 and cache["hits"] > 0, cache
    finally:
        server.stop()


def test_bad_requests_get_400_a_burst_gets_503_and_sigterm_drains(export):
    want = references(export, 35)["The water cycle"]
    access = export.parent / "access.log"
    server = Server(export, "--slots", 2, "--max-pending", 4, "--max-model-len", 40, "--access-log", access)
    try:
        for body, status, mention in [
                (b"not json", 400, "the body is not JSON"),
                ({"prompt": "Hi", "max_tokens": 100}, 400,
                 "max_tokens 100 after the prompt's 1 token makes 101 tokens, over this server's --max-model-len"),
                ({"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens=-1 is out of range"),
                ({"prompt": ["a", 7]}, 400, "prompt[1] must be a string or a non-empty list of token ids"),
                ({"prompt": "Hi", "temperature": 3}, 400, "temperature=3 is out of range"),
                ({"prompt": "Hi", "n": 0}, 400, "n=0 is out of range"),
                ({"prompt": "Hi", "frobnicate": 1}, 400, "unknown field(s) frobnicate"),
                ({"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options takes only"),
                ({"prompt": ""}, 400, "prompt gives no tokens")]:
            code, reply, _ = server.post(body)
            assert code == status and mention in reply["error"]["message"], (body, code, reply)
            assert reply["error"]["type"] == "invalid_request_error"
        # prompts of ~3.9 MiB are refused on their bytes, before tokenizing: the memory stays flat
        # (before: each was tokenized on the event loop, and ~400 MiB stayed resident)
        before = server.rss_mib()
        for _ in range(5):
            code, reply, _ = server.post({"prompt": "word " * 800_000, "max_tokens": 1})
            assert code == 400 and "send a shorter prompt" in reply["error"]["message"], reply
        assert server.rss_mib() - before < 60, (before, server.rss_mib())
        # a burst of 12 long requests at once: 4 are taken, the rest told to come back
        with ThreadPoolExecutor(12) as pool:
            replies = list(pool.map(lambda _: server.post({"prompt": "The water cycle", "max_tokens": 30,
                                                           "temperature": 0}), range(12)))
        codes = sorted(code for code, _, _ in replies)
        assert codes.count(200) >= 4 and codes.count(503) >= 1 and set(codes) == {200, 503}, codes
        busy = next((reply, headers) for code, reply, headers in replies if code == 503)
        assert "retry later" in busy[0]["error"]["message"] and busy[1].get("Retry-After") == "1"
        texts = {reply["choices"][0]["text"] for code, reply, _ in replies if code == 200}
        assert len(texts) == 1   # every admitted one got the same (greedy) completion
        # SIGTERM while two streams run: both finish whole, then the server exits 0
        streams = []

        def stream():
            request = urllib.request.Request(server.url("/v1/completions"), data=json.dumps(
                {"prompt": "The water cycle", "max_tokens": 35, "temperature": 0, "stream": True}).encode(),
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as r:
                streams.append(r.read().decode())
        threads = [threading.Thread(target=stream) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 30
        while server.get("/health")["pending"] < 2 and time.time() < deadline:
            time.sleep(0.01)
        os.kill(server.process.pid, signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert server.process.wait(timeout=60) == 0, server.output()
        assert len(streams) == 2
        for body in streams:
            events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
            assert body.rstrip().endswith("data: [DONE]")
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert "".join(e["choices"][0]["text"] for e in events) == want
        log = server.output()
        assert "draining 2 request(s)" in log and "megatron-id serve: stopped" in log, log
        lines = access.read_text().splitlines()   # a line per request: 9 + 5 bad, 12 of the burst, 2 streams
        assert sum('"POST /v1/completions HTTP/1.1" 400' in line for line in lines) == 14, lines
        assert sum('"POST /v1/completions HTTP/1.1" 503' in line for line in lines) == codes.count(503), lines
    finally:
        server.stop()


def test_serve_refuses_bad_options_before_loading(tmp_path, capsys):
    from megatron_id.cli import main
    for args, mention in [(["--slots", "0"], "--slots 0: at least 1"),
                          (["--port", "70000"], "--port 70000 / --drain-timeout 30.0: a port up to 65535"),
                          (["--max-model-len", "1"], "--max-model-len 1: at least 2")]:
        assert main(["serve", "--checkpoint", str(tmp_path / "nope"), *args]) == 2, args
        assert mention in capsys.readouterr().err


@pytest.mark.parametrize("where, key, mention", [
    ("env", "  ", "$MEGATRON_ID_API_KEY is blank (only whitespace): every request would get 401. Give a key, or "
                  "unset it to serve without one."),
    ("env", "\n", "$MEGATRON_ID_API_KEY is blank (only whitespace)"),
    ("env", "", "$MEGATRON_ID_API_KEY is empty: every request would get 401"),
    ("env", "s3cret\n", "$MEGATRON_ID_API_KEY has whitespace at its end (a newline read from a key file?): clients "
                        "cannot send it"),
    ("flag", " s3cret", "--api-key has whitespace at its start"),
    ("flag", "s3\x07cret", "--api-key holds a control character ('\\x07' at character 3 of 7)"),
])
def test_an_api_key_no_client_can_send_is_refused_before_loading(where, key, mention, tmp_path, capsys, monkeypatch):
    """Before: MEGATRON_ID_API_KEY="  " started a server on which every request got 401 (and an
    empty one, from KEY=$UNSET, a server without a key)."""
    from megatron_id.cli import main
    monkeypatch.setenv("MEGATRON_ID_API_KEY", key if where == "env" else "ignored: the flag is the key")
    flag = ["--api-key", key] if where == "flag" else []
    assert main(["serve", "--checkpoint", str(tmp_path / "nope"), *flag]) == 2
    err = capsys.readouterr().err
    assert mention in err, err
    assert "s3" not in err, err   # the key itself is not printed


# ---------------------------------------------------------------- issue 41 group B: serve's careless inputs

def test_a_request_for_another_model_gets_404_as_from_openai_servers(export):
    """Before: a body naming any model was served by this one, without a word."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from megatron_id.inference.generate import load_trained
    from megatron_id.inference.server import ServeLimits, build_app

    class Idle:   # no request gets as far as the engine here
        failure, max_pending = None, 1

        def busy(self):
            return 0

    async def ask():
        app = build_app(Idle(), load_trained(export).tokenizer, "hf", 64, ServeLimits(drain_timeout=1.0))
        async with TestClient(TestServer(app)) as client:
            reply = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi"})
            return reply.status, await reply.json()
    status, body = asyncio.run(ask())
    assert status == 404, body
    assert body["error"] == {"message": "The model `gpt-4` does not exist: this server serves `hf` (GET /v1/models; "
                                        "megatron-id serve --served-model-name)", "type": "invalid_request_error",
                             "param": "model", "code": "model_not_found"}


def test_a_host_or_port_that_cannot_be_listened_on_is_named_before_loading(export, tmp_path, capsys):
    """Before: `--host 999.1.1.1` failed after the model was loaded, with an OSError naming no flag."""
    from bad_inputs import refused

    from megatron_id.cli import main
    refused(["megatron_id.cli", "serve", "--checkpoint", tmp_path / "not-loaded", "--host", "999.1.1.1"],
            mention=r"--host 999.1.1.1: not an address or a host name that resolves .*give an address of this "
                    r"machine, e.g. 127.0.0.1", unchanged=[tmp_path])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, mention in [(["--port", str(port)], f"--port {port}: already in use on 127.0.0.1"),
                              (["--host", "192.0.2.1"], "--host 192.0.2.1: not an address of this machine")]:
            assert main(["serve", "--checkpoint", str(tmp_path / "not-loaded"), *args]) == 2, args
            assert mention in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_kv_pool_larger_than_the_memory_is_refused_before_it_is_allocated(export, tmp_path, capsys, monkeypatch):
    """Before: `serve --max-model-len 10000000` on a hybrid allocated 20 GB of KV cache (and the
    out-of-memory killer ended it). Now the pool is compared with the memory first, named, and
    the largest --max-model-len that fits is said."""
    import re

    from megatron_id.cli import main
    from megatron_id.inference import fused_decode
    hybrid = tiny_export(tmp_path / "hf", "hybrid")
    monkeypatch.setattr(fused_decode, "available_memory", lambda device: (8 * 2**30, "of host memory available"))
    assert main(["serve", "--checkpoint", str(hybrid), "--max-model-len", "10000000", "--slots", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"--max-model-len 10,000,000 x --slots 8: the KV cache of the model's 2 softmax layer\(s\) would "
                     r"take 38.1 GiB \([\d,]+ bytes, allocated at start\), more than 80% of the 8.0 GiB of host memory "
                     r"available. Lower --max-model-len or --slots \(at most 1,677,261 tokens fit with 8 slot\(s\)\)",
                     err), err
    # fixed-state layers: no KV cache, but each slot's state and logits row (10M slots: 2 TiB)
    assert main(["serve", "--checkpoint", str(export), "--slots", "10000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"--max-model-len 64 \(the seq_length of the model\) x --slots 10,000,000: the recurrent states "
                     r"and logits of 10,000,000 slot\(s\) would take [\d,.]+ GiB .*more than 80% of the 8.0 GiB "
                     r"of host "
                     r"memory available. Lower --max-model-len or --slots \(at most [\d,]+ slot\(s\) fit\)", err), err
    # generate refuses the same way before the prompt is echoed, one prompt or a file of them
    (tmp_path / "prompts.txt").write_text("Rivers\n")
    for args in (["--prompt", "Rivers"], ["--input-file", str(tmp_path / "prompts.txt")]):
        assert main(["generate", "--checkpoint", str(hybrid), "--max-new-tokens", "100000000", *args]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "--max-new-tokens 100,000,000 after a prompt" in captured.err.replace(
            "after prompts", "after a prompt"), captured


def test_an_engine_that_cannot_go_on_makes_the_server_exit_1_for_its_supervisor(export, tmp_path):
    """Before: the engine thread died, every request and /health answered 500 for good, and the
    process stayed up (SIGTERM then exited 0): a supervisor saw nothing wrong. Here the decode
    step always fails (a device gone): each request gets its JSON error, and after 3 failed steps
    in a row the server drains and exits 1."""
    script = tmp_path / "broken_device.py"
    script.write_text("import sys\n"
                      "from megatron_id.inference.fused_decode import FusedDecoder\n"
                      "def gone(self, tokens):\n"
                      "    raise RuntimeError('injected: the device is gone')\n"
                      "FusedDecoder.step = gone\n"
                      "from megatron_id.cli import main\n"
                      "sys.exit(main(sys.argv[1:]))\n")
    server = Server(export, "--slots", 1, launcher=[script])
    try:
        replies = [server.post({"prompt": "The water cycle", "max_tokens": 4, "temperature": 0}) for _ in range(2)]
        assert [(code, reply["error"]["code"]) for code, reply, _ in replies] == [(500, "generation_failed")] * 2
        assert "injected" not in json.dumps(replies), "the client was shown the exception's text"
        try:
            server.post({"prompt": "The water cycle", "max_tokens": 4, "temperature": 0})
        except OSError:
            pass   # (the server may be gone already)
        assert server.process.wait(timeout=60) == 1, server.output()
        log = server.output()
        assert "the decode step failed 3 times in a row" in log and "stopped after an engine failure" in log, log
        assert "injected: the device is gone" in log   # the cause is in the log, for the operator
    finally:
        server.stop()
