"""Serving throughput and pace: vLLM with megatron_id's plugin, `megatron-id serve`, and vLLM serving a
Llama of the same width and depth (the attention baseline), in one run (issue 54).

    python benchmarks/serve_vllm.py                  # ~5 minutes on 2 cores (a first run also
                                                     # installs vLLM's CPU build: tests/vllm_env.py)
    python benchmarks/serve_vllm.py --streams 8 --tokens 64
    python benchmarks/serve_vllm.py --streams 8 32 --prompt-tokens 768   # a long context: prompts of
                                                     # 768 tokens, no two sharing a prefix

Models (random weights, GPT-2 vocabulary): benchmarks/generation.py's interdomain model (d 256,
4 heads, 4 layers, M 64), exported; and a LlamaForCausalLM of d 256, 4 heads, 4 layers and the
same SwiGLU width, saved by transformers. The three servers run on 127.0.0.1 in float32, started
one after another and then left up (an idle server takes no CPU); N clients stream greedy
completions of a short prompt, --tokens each, at once, against one server at a time. Per N:
tokens/s (all tokens over the wall time from the first request to the last token) and the
streams' inter-token gaps, p50 and p99.

This machine's speed drifts by 10-20% over minutes, more than the differences measured: each
of --rounds rounds loads every server once per N, in an order that turns each round, and the
plugin / Llama ratio is taken within a round (the two measured seconds apart), then its median
over the rounds (and its range) is reported, with the median of each cell. The claim (issue 54):
our model in vLLM at least as fast per token as the same-size Llama in vLLM from 8 streams on.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))
from generation import build, export_random  # noqa: E402  (the same random model as the generation rows)
from vllm_env import stop_server  # noqa: E402

PROMPT = "The water cycle describes how water moves"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_like(folder: Path) -> Path:
    """A random LlamaForCausalLM of the interdomain model's width, depth, heads and SwiGLU width."""
    import torch
    import transformers

    from megatron_id.model.spec import ffn_hidden_size
    cfg = build("interdomain").cfg
    config = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                                      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                                      num_key_value_heads=cfg.n_heads,
                                      intermediate_size=ffn_hidden_size(cfg), max_position_embeddings=2048,
                                      rms_norm_eps=cfg.norm_eps, torch_dtype="float32")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(ROOT / "tests/data/gpt2-tokenizer.json"),
                                         eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


class Server:
    def __init__(self, command: list[str], env: dict, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([*command, "--port", str(self.port)], stdout=log.open("w"),
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.log = log
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"serve_vllm: {command[:4]} exited:\n{log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SystemExit(f"serve_vllm: {command[:4]} did not come up in 10 minutes")

    def stop(self):
        stop_server(self.process)


async def stream(session, url: str, body: dict, marks: list) -> None:
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            if line.startswith(b"data: {"):
                marks.append(time.monotonic())


def long_prompt(stream: int, tokens: int) -> str:
    """About `tokens` GPT-2 tokens of text, opened by the stream's number: the streams share no
    prefix (vLLM's prefix caching would otherwise read one prompt for all of them)."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(ROOT / "tests/data/gpt2-tokenizer.json"))
    text = f"Stream {stream}. " + " ".join([PROMPT + " between the oceans, the air and the land."] * (tokens // 8 + 1))
    return tokenizer.decode(tokenizer.encode(text).ids[:tokens])


async def load(url: str, model: str, streams: int, tokens: int, vllm: bool, prompt_tokens: int = 0) -> dict:
    import aiohttp
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    if vllm:
        body["ignore_eos"] = True   # (megatron-id serve has no such field; a random model rarely ends early)
    prompts = [long_prompt(i, prompt_tokens) if prompt_tokens else PROMPT for i in range(streams + 1)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await stream(session, url, {**body, "prompt": prompts[-1], "max_tokens": 4}, [])   # warm-up
        marks = [[] for _ in range(streams)]
        start = time.monotonic()
        await asyncio.gather(*(stream(session, url, {**body, "prompt": prompts[i]}, marks[i]) for i in range(streams)))
    gaps = [b - a for m in marks for a, b in zip(m, m[1:])]
    count = sum(len(m) for m in marks)
    return {"tokens_per_s": count / (max(m[-1] for m in marks) - start), "p50": statistics.median(gaps),
            "p99": percentile(gaps, 0.99), "tokens": count}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tokens", type=int, default=128, help="tokens each stream generates (default 128)")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="each stream's prompt this many tokens long, no two sharing a prefix (default: a "
                        "short prompt, the same for all; at most 1024 - --tokens)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of measurements, each server once per N a round (default 5; the ratio's median "
                        "and range over them)")
    p.add_argument("--vllm-python", default=None,
                   help="the python of a venv with vLLM and this checkout (default: tests/vllm_env.py's cached one)")
    args = p.parse_args(argv)
    if min(args.streams) < 1 or args.tokens < 2 or args.rounds < 1:
        raise SystemExit(f"serve_vllm: error: --streams {args.streams}, --tokens {args.tokens}, --rounds "
                         f"{args.rounds}: --streams and --rounds at least 1, --tokens at least 2")
    if args.prompt_tokens < 0:
        raise SystemExit(f"serve_vllm: error: --prompt-tokens {args.prompt_tokens}: at least 0 (0: a short prompt)")
    if args.prompt_tokens + args.tokens > 1024:
        raise SystemExit(f"serve_vllm: error: --prompt-tokens {args.prompt_tokens} with --tokens {args.tokens}: "
                         f"the two together at most 1024 (the servers' --max-model-len)")
    if args.vllm_python is None:
        from vllm_env import vllm_python
        args.vllm_python = str(vllm_python())
    slots = max(args.streams)
    vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "",
                "VLLM_NO_USAGE_STATS": "1"}

    def vllm(folder):
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                "--served-model-name", "m", "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024",
                "--max-num-seqs", str(slots), "--seed", "0"]
    names = ["vLLM + plugin, interdomain", "megatron-id serve, interdomain", "vLLM, Llama (softmax)"]
    runs = {(name, n): [] for name in names for n in args.streams}   # one result a round
    ratios = {n: [] for n in args.streams}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as up:
        tmp = Path(tmp)
        ours = export_random("interdomain", tmp / "interdomain")
        llama = llama_like(tmp / "llama")
        commands = {
            names[0]: (vllm(ours), vllm_env, True),
            names[1]: ([sys.executable, "-m", "megatron_id.cli", "serve", "--checkpoint", str(ours), "--slots",
                        str(slots), "--max-model-len", "1024", "--max-pending", str(4 * slots),
                        "--served-model-name", "m"], {**os.environ, "PYTHONPATH": str(ROOT)}, False),
            names[2]: (vllm(llama), vllm_env, True),
        }
        servers = {}
        for i, (name, (command, env, is_vllm)) in enumerate(commands.items()):
            servers[name] = (Server(command, env, tmp / f"{i}.log"), is_vllm)
            up.callback(servers[name][0].stop)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]   # each server first in turn
            for n in args.streams:
                for name in order:
                    server, is_vllm = servers[name]
                    result = asyncio.run(load(server.url, "m", n, args.tokens, is_vllm, args.prompt_tokens))
                    runs[(name, n)].append(result)
                    print(f"  round {r + 1}, {name}, {n} stream(s): {result}", file=sys.stderr, flush=True)
                ratios[n].append(runs[(names[0], n)][-1]["tokens_per_s"] / runs[(names[2], n)][-1]["tokens_per_s"])
    prompts = f"prompts of {args.prompt_tokens} tokens" if args.prompt_tokens else "a short prompt"
    print(f"\n## Serving d 256 x 4 layers (random weights, float32), {prompts}, {args.tokens} tokens per stream, "
          f"greedy; medians of {args.rounds} rounds: tokens/s (inter-token p50 / p99)\n")
    print("| streams | " + " | ".join(names) + " | plugin / Llama tokens/s, median (range) |")
    print("|---|" + "---|" * (len(names) + 1))
    for n in args.streams:
        cells = []
        for name in names:
            rounds = runs[(name, n)]
            cells.append(f"{statistics.median(x['tokens_per_s'] for x in rounds):.0f} "
                         f"({statistics.median(x['p50'] for x in rounds) * 1000:.1f} / "
                         f"{statistics.median(x['p99'] for x in rounds) * 1000:.1f} ms)")
        print(f"| {n} | " + " | ".join(cells) + f" | {statistics.median(ratios[n]):.2f}x "
              f"({min(ratios[n]):.2f}-{max(ratios[n]):.2f}) |")
    print("\n" + json.dumps({"rounds": {f"{name} @ {n}": r for (name, n), r in runs.items()},
                             "plugin / Llama": {str(n): r for n, r in ratios.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
