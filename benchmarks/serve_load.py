"""`megatron-id serve` under a burst of long prompts: do running streams keep their pace, and do
first tokens come in order of arrival? (issue 45, Build item 2)

    python benchmarks/serve_load.py                              # ~6 minutes on 2 cores
    python benchmarks/serve_load.py --configs thread:1 single:1  # only these (prefill:threads)

Model: benchmarks/generation.py's (d 256, 4 heads, 4 layers, M 64, GPT-2 vocabulary, random
weights), interdomain, exported and served with --slots 40 on 127.0.0.1, in each of --configs:
prompts read on the prefill thread beside the decode steps, those waiting read together in
left-padded groups, and by the engine thread too while nothing decodes (thread, the default);
the same without the engine thread's reads (batch: --no-idle-reads); one at a time on the
prefill thread alone (single: --prefill-batch 1 --no-idle-reads, the engine before issue 55);
or on the engine thread between steps (inline: --inline-prefill, the engine before issue 45),
at N torch threads:
  1. 8 clients stream greedy completions of a short prompt; their inter-token gaps over 2 s are
     the unloaded pace (p50);
  2. then 32 clients send 1,024-token prompts (max_tokens 4, streaming), 20 ms apart; the 8
     streams' gaps from the first arrival to the last first token are the loaded pace (p99);
     each prompt's first token is timed from its arrival.
  3. once every server has had its burst: 64 clients at once, each its own prompt of ~100
     tokens (max_tokens 1), after an untimed round of 32: time to first token, p50 and p99, in
     --rounds rounds, every server once a round (the servers run side by side throughout).
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
    arrived = {i: t for t, i in arrivals}
    first_at = [firsts[i][0] for _, i in sorted(arrivals)]          # in order of arrival
    waits = [firsts[i][0] - arrived[i] for i in range(BURST)]
    inversions = sum(1 for a, b in zip(first_at, first_at[1:]) if b < a)
    return {"quiet_p50": statistics.median(quiet), "loaded_p99": percentile(loaded, 0.99),
            "loaded_max": max(loaded), "inversions": inversions, "first_wait_min": min(waits),
            "first_wait_max": max(waits), "burst": burst_to - burst_from, "gaps": (len(quiet), len(loaded))}


async def first_tokens(url: str, round_: int | None) -> list[float]:
    """CLIENTS clients at once, each its own prompt: the seconds from each request to its first
    token. round_ None: half as many, untimed, other prompts (a warm-up: the first reads of a
    group's shape pay for fresh memory, ~0.2 s more at p50, which a server that has been up a
    while does not). Each round's prompts are its own (no prefix cache hits across rounds)."""
    import aiohttp
    words = ["water", "river", "cloud", "rain", "sea", "ice", "snow", "lake"]
    opening = "Warm-up" if round_ is None else f"Round {round_}, client"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async def one(i):
            prompt = f"{opening} {i}: " + " ".join(words[(i + j) % len(words)] for j in range(CLIENT_PROMPT_WORDS))
            marks, start = [], time.monotonic()
            await stream(session, url, {"prompt": prompt, "max_tokens": 1, "temperature": 0}, marks)
            return marks[0] - start
        return await asyncio.gather(*(one(i) for i in range(CLIENTS if round_ is not None else CLIENTS // 2)))


def first_token_rounds(urls: dict, rounds: int) -> dict:
    """The 64-client phase, `rounds` times per server, every server once a round in a turning
    order (as benchmarks/serve_vllm.py: a slow minute of this shared machine falls on all of
    them, not on one); -> key -> [(p50, p99) per round]."""
    for url in urls.values():
        asyncio.run(first_tokens(url, None))
    out = {key: [] for key in urls}
    keys = list(urls)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            ttft = asyncio.run(first_tokens(urls[key], r))
            out[key].append((statistics.median(ttft), percentile(ttft, 0.99)))
    return out


def serve(folder: Path, prefill: str, threads: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "megatron_id.cli", "serve", "--checkpoint", str(folder),
                               "--port", str(port), "--slots", "40", "--threads", str(threads), "--max-model-len",
                               "2048", "--max-pending", "128", *(["--inline-prefill"] if prefill == "inline" else []),
                               *(["--prefill-batch", "1"] if prefill == "single" else []),
                               *(["--no-idle-reads"] if prefill in ("single", "batch") else [])],
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
    p.add_argument("--configs", nargs="+", default=["single:1", "batch:1", "thread:1", "thread:2"],
                   help="prefill:threads pairs; prefill is thread (the default: waiting prompts read together, "
                        "by the engine thread too while nothing decodes), batch (--no-idle-reads), single "
                        "(--prefill-batch 1 --no-idle-reads) or inline (--inline-prefill)")
    p.add_argument("--rounds", type=int, default=7, help="rounds of the 64-client phase (default 7)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"serve_load: error: --rounds {args.rounds}: at least 1")
    configs = []
    if len(set(args.configs)) < len(args.configs):
        raise SystemExit(f"serve_load: error: --configs {' '.join(args.configs)}: each config once (the servers run "
                         f"side by side)")
    for item in args.configs:
        prefill, _, threads = item.partition(":")
        if prefill not in ("thread", "batch", "single", "inline") or not threads.isdigit() or int(threads) < 1:
            raise SystemExit(f"serve_load: error: --configs {item!r}: give prefill:threads, prefill one of thread, "
                             f"batch, single or inline, e.g. thread:1 or inline:2")
        configs.append((prefill, int(threads)))
    print(f"## `megatron-id serve` (d 256 x 4 layers, interdomain, 40 slots): {STREAMS} streams running, then "
          f"{BURST} prompts of {PROMPT_TOKENS:,} tokens {STAGGER * 1000:.0f} ms apart\n")
    print("| prefill | threads | unloaded p50 | loaded p99 (max) | p99 / p50 | first tokens out of arrival order | "
          "first token after arrival (min-max) | burst |")
    print("|---|---|---|---|---|---|---|---|")
    rows, servers = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_random("interdomain", Path(tmp) / "interdomain")
        try:
            for prefill, threads in configs:   # all up at once (an idle one takes ~1% of a core)
                servers[f"{prefill}:{threads}"] = serve(folder, prefill, threads)
            for key, (_, url) in servers.items():
                r = rows[key] = asyncio.run(load(url))
                prefill, threads = key.split(":")
                print(f"| {prefill} | {threads} | {r['quiet_p50'] * 1000:.1f} ms | "
                      f"{r['loaded_p99'] * 1000:.0f} ms ({r['loaded_max'] * 1000:.0f}) | "
                      f"{r['loaded_p99'] / r['quiet_p50']:.1f}x | {r['inversions']} of {BURST - 1} | "
                      f"{r['first_wait_min']:.2f}-{r['first_wait_max']:.2f} s | {r['burst']:.1f} s |", flush=True)
            ttft = first_token_rounds({key: url for key, (_, url) in servers.items()}, args.rounds)
        finally:
            for server, _ in servers.values():
                server.terminate()
            for server, _ in servers.values():
                server.wait(timeout=120)
    print(f"\n## time to first token, {CLIENTS} clients at once (each its own ~{CLIENT_PROMPT_WORDS}-word prompt, "
          f"max_tokens 1), {args.rounds} rounds, every server once a round\n")
    print("| prefill | threads | p50, median of the rounds (range) | p99, median of the rounds |")
    print("|---|---|---|---|")
    for key, results in ttft.items():
        p50s, p99s = [r[0] for r in results], [r[1] for r in results]
        rows[key].update(ttft_p50=statistics.median(p50s), ttft_p99=statistics.median(p99s), ttft_rounds=results)
        prefill, threads = key.split(":")
        print(f"| {prefill} | {threads} | {statistics.median(p50s):.2f} s ({min(p50s):.2f}-{max(p50s):.2f}) | "
              f"{statistics.median(p99s):.2f} s |")
    print()
    if "single:1" in rows and "thread:1" in rows:
        ratios = [a[0] / b[0] for a, b in zip(ttft["single:1"], ttft["thread:1"])]   # within each round
        ratio = statistics.median(ratios)
        print(f"- {'PASS' if ratio >= 2 else 'FAIL'}: time to first token at {CLIENTS} clients, 1 thread: p50 "
              f"{ratio:.1f}x lower (rounds {min(ratios):.1f}-{max(ratios):.1f}x) read together, by both threads while "
              f"nothing decodes, than one at a time by the prefill thread (issue 55: at least 2x)")
    for key, r in rows.items():
        print(f"- {'PASS' if r['loaded_p99'] <= 3 * r['quiet_p50'] else 'FAIL'}: {key}: loaded p99 "
              f"{r['loaded_p99'] / r['quiet_p50']:.1f}x the unloaded p50 (at most 3x)")
    print("\n" + json.dumps({str(k): {n: v for n, v in r.items() if n != "gaps"} for k, r in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
