"""`megatron-id serve` under a burst of long prompts: do running streams keep their pace, and do
first tokens come in order of arrival? (issue 45, Build item 2)

    python benchmarks/serve_load.py                              # ~4 minutes on 2 cores
    python benchmarks/serve_load.py --configs thread:1 single:1  # only these (prefill:threads)

Model: benchmarks/generation.py's (d 256, 4 heads, 4 layers, M 64, GPT-2 vocabulary, random
weights), interdomain, exported and served with --slots 40 on 127.0.0.1, in each of --configs:
prompts read on the prefill thread beside the decode steps, those waiting read together in
left-padded groups (thread, the default), one at a time there (single: --prefill-batch 1, the
engine before issue 55), or on the engine thread between steps (inline: --inline-prefill, the
engine before issue 45), at N torch threads:
  1. 8 clients stream greedy completions of a short prompt; their inter-token gaps over 2 s are
     the unloaded pace (p50);
  2. then 32 clients send 1,024-token prompts (max_tokens 4, streaming), 20 ms apart; the 8
     streams' gaps from the first arrival to the last first token are the loaded pace (p99);
     each prompt's first token is timed from its arrival.
  3. then 64 clients at once, each its own prompt of ~100 tokens (max_tokens 1): time to first
     token, p50 and p99.
The claims: loaded p99 under 3x unloaded p50, and first tokens in order of arrival (issue 45);
time to first token at 64 clients at least 2x lower than `single`'s (issue 55).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import export_random  # noqa: E402  (the same random model as the generation rows)

STREAMS, BURST, PROMPT_TOKENS, STAGGER = 8, 32, 1024, 0.02
CLIENTS, CLIENT_PROMPT_WORDS = 64, 100


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream(session, url: str, body: dict, marks: list, stop: asyncio.Event | None = None) -> None:
    """Append the arrival time of every event of a streaming completion to `marks`."""
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status == 200, await reply.text()
        async for line in reply.content:
            if line.startswith(b"data: {"):
                marks.append(time.monotonic())
            if stop is not None and stop.is_set():
                return


async def load(url: str) -> dict:
    import aiohttp
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        stop = asyncio.Event()
        marks = [[] for _ in range(STREAMS)]
        running = [asyncio.create_task(stream(session, url, {"prompt": "The water cycle", "max_tokens": 1900,
                                                             "temperature": 0}, marks[i], stop))
                   for i in range(STREAMS)]
        while min(len(m) for m in marks) < 5:
            await asyncio.sleep(0.05)
        quiet_from = time.monotonic()
        await asyncio.sleep(2.0)
        quiet_to = time.monotonic()
        firsts = [[] for _ in range(BURST)]
        arrivals = []
        # one GPT-2 token each, opened by the prompt's number: no two share a prefix (the server's
        # prefix cache would otherwise read one prompt for all)
        prompts = [f"{i}" + " the" * (PROMPT_TOKENS - 1) for i in range(BURST)]

        async def late(i):
            await asyncio.sleep(i * STAGGER)
            arrivals.append((time.monotonic(), i))
            await stream(session, url, {"prompt": prompts[i], "max_tokens": 4, "temperature": 0}, firsts[i])
        await asyncio.gather(*(late(i) for i in range(BURST)))
        burst_from, burst_to = min(a for a, _ in arrivals), max(f[0] for f in firsts)
        stop.set()
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def gaps(start, end):
        return [b - a for m in marks for a, b in zip(m, m[1:]) if start <= a and b <= end]
    quiet, loaded = gaps(quiet_from, quiet_to), gaps(burst_from, burst_to)
    ttft = await first_tokens(url)
    arrived = {i: t for t, i in arrivals}
    first_at = [firsts[i][0] for _, i in sorted(arrivals)]          # in order of arrival
    waits = [firsts[i][0] - arrived[i] for i in range(BURST)]
    inversions = sum(1 for a, b in zip(first_at, first_at[1:]) if b < a)
    return {"quiet_p50": statistics.median(quiet), "loaded_p99": percentile(loaded, 0.99),
            "loaded_max": max(loaded), "inversions": inversions, "first_wait_min": min(waits),
            "first_wait_max": max(waits), "burst": burst_to - burst_from, "gaps": (len(quiet), len(loaded)),
            "ttft_p50": statistics.median(ttft), "ttft_p99": percentile(ttft, 0.99)}


async def first_tokens(url: str) -> list[float]:
    """CLIENTS clients at once, each its own prompt: the seconds from each request to its first token."""
    import aiohttp
    words = ["water", "river", "cloud", "rain", "sea", "ice", "snow", "lake"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async def one(i):
            prompt = f"Client {i}: " + " ".join(words[(i + j) % len(words)] for j in range(CLIENT_PROMPT_WORDS))
            marks, start = [], time.monotonic()
            await stream(session, url, {"prompt": prompt, "max_tokens": 1, "temperature": 0}, marks)
            return marks[0] - start
        return await asyncio.gather(*(one(i) for i in range(CLIENTS)))


def serve(folder: Path, prefill: str, threads: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "megatron_id.cli", "serve", "--checkpoint", str(folder),
                               "--port", str(port), "--slots", "40", "--threads", str(threads), "--max-model-len",
                               "2048", "--max-pending", "128", *(["--inline-prefill"] if prefill == "inline" else []),
                               *(["--prefill-batch", "1"] if prefill == "single" else [])],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    import urllib.request
    for _ in range(900):
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return server, url
        except OSError:
            assert server.poll() is None, "the server exited"
            time.sleep(0.2)
    raise SystemExit("serve_load: the server did not come up in 3 minutes")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["single:1", "thread:1", "thread:2"],
                   help="prefill:threads pairs; prefill is thread (the default: waiting prompts read together), "
                        "single (--prefill-batch 1) or inline (--inline-prefill)")
    args = p.parse_args(argv)
    configs = []
    for item in args.configs:
        prefill, _, threads = item.partition(":")
        if prefill not in ("thread", "single", "inline") or not threads.isdigit() or int(threads) < 1:
            raise SystemExit(f"serve_load: error: --configs {item!r}: give prefill:threads, e.g. thread:1 or inline:2")
        configs.append((prefill, int(threads)))
    print(f"## `megatron-id serve` (d 256 x 4 layers, interdomain, 40 slots): {STREAMS} streams running, then "
          f"{BURST} prompts of {PROMPT_TOKENS:,} tokens {STAGGER * 1000:.0f} ms apart; then {CLIENTS} clients "
          f"at once\n")
    print("| prefill | threads | unloaded p50 | loaded p99 (max) | p99 / p50 | first tokens out of arrival order | "
          f"first token after arrival (min-max) | burst | time to first token at {CLIENTS} clients, p50 / p99 |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_random("interdomain", Path(tmp) / "interdomain")
        for prefill, threads in configs:
            server, url = serve(folder, prefill, threads)
            try:
                r = rows[f"{prefill}:{threads}"] = asyncio.run(load(url))
            finally:
                server.terminate()
                server.wait(timeout=120)
            print(f"| {prefill} | {threads} | {r['quiet_p50'] * 1000:.1f} ms | "
                  f"{r['loaded_p99'] * 1000:.0f} ms ({r['loaded_max'] * 1000:.0f}) | "
                  f"{r['loaded_p99'] / r['quiet_p50']:.1f}x | {r['inversions']} of {BURST - 1} | "
                  f"{r['first_wait_min']:.2f}-{r['first_wait_max']:.2f} s | {r['burst']:.1f} s | "
                  f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} s |", flush=True)
    if "single:1" in rows and "thread:1" in rows:
        ratio = rows["single:1"]["ttft_p50"] / rows["thread:1"]["ttft_p50"]
        print(f"\n- {'PASS' if ratio >= 2 else 'FAIL'}: time to first token at {CLIENTS} clients, 1 thread: "
              f"{ratio:.1f}x lower read together than one at a time (issue 55: at least 2x)")
    for key, r in rows.items():
        print(f"- {'PASS' if r['loaded_p99'] <= 3 * r['quiet_p50'] else 'FAIL'}: {key}: loaded p99 "
              f"{r['loaded_p99'] / r['quiet_p50']:.1f}x the unloaded p50 (at most 3x)")
    print("\n" + json.dumps({str(k): {n: v for n, v in r.items() if n != "gaps"} for k, r in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
