"""Prefix caching of the state (inference/prefix_cache.py, issue 55): the same ~1,000-token system
prompt before 32 different questions, time to first token with the cache and without.

    python benchmarks/prefix_cache.py                # ~1 minute on 2 cores

Model: benchmarks/generation.py's (d 256, 4 heads, 4 layers, M 64, GPT-2 vocabulary, random
weights), interdomain, float32, 1 torch thread. The engine `megatron-id serve` runs (a
ContinuousBatcher: the prompt read, then the fused decode step), in this process; the 32 requests
one after another, each timed from its submission to its first token, then run to 8 greedy
tokens. The first request reads the whole prompt; the second, which shares the system prompt,
saves the state at its last block boundary; the rest start there. The claim (issue 55): time to
first token at least 5x lower with the cache, the same tokens.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import build  # noqa: E402

QUESTIONS = 32


def system_prompt(tokenizer, tokens: int = 1000) -> str:
    """About `tokens` GPT-2 tokens of FineWeb-Edu text (tests/data's sample)."""
    text = " ".join(json.loads(line)["text"] for line in (ROOT / "tests/data/fineweb-edu-sample-150.jsonl").open())
    return tokenizer.decode(tokenizer.encode(text).ids[:tokens])


def run(model, prompts: list[list[int]], cache) -> tuple[list[float], list[list[int]]]:
    from megatron_id.inference.batching import ContinuousBatcher, Request
    batcher = ContinuousBatcher(model, slots=4, prefix_cache=cache)
    firsts, outputs = [], []
    try:
        for prompt in prompts:
            start = time.perf_counter()
            sequence = batcher.submit(Request(prompt, 8))
            first = None
            while batcher.busy():
                events = batcher.step()
                if first is None and any(s is sequence for s, _, _ in events):
                    first = time.perf_counter() - start
            firsts.append(first)
            outputs.append(list(sequence.tokens))
    finally:
        batcher.close()
    return firsts, outputs


def main() -> int:
    import torch
    from tokenizers import Tokenizer

    from megatron_id.inference.prefix_cache import PrefixCache
    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_file(str(ROOT / "tests/data/gpt2-tokenizer.json"))
    model = build("interdomain")
    system = system_prompt(tokenizer)
    prompts = [tokenizer.encode(f"{system}\n\nQuestion {i}: what does the text say about topic number {i}?").ids
               for i in range(QUESTIONS)]
    with torch.no_grad():
        run(model, prompts[:2], None)   # warm-up (the C++ core built and loaded)
        plain, want = run(model, prompts, None)
        cache = PrefixCache(block=model.cfg.chunk_size, max_bytes=512 * 2**20)
        cached, got = run(model, prompts, cache)
    counters = cache.counters()
    steady = slice(2, None)   # the first reads all, the second saves the shared state
    ratio = statistics.median(plain[steady]) / statistics.median(cached[steady])
    print(f"\n## Prefix cache: a {len(tokenizer.encode(system).ids)}-token system prompt, {QUESTIONS} questions "
          f"(prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens), d 256 x 4, 1 thread\n")
    print("| | time to first token, median of requests 3-32 | request 1 | request 2 |")
    print("|---|---|---|---|")
    print(f"| without the cache | {statistics.median(plain[steady]) * 1e3:.1f} ms | {plain[0] * 1e3:.1f} ms | "
          f"{plain[1] * 1e3:.1f} ms |")
    print(f"| with the cache | {statistics.median(cached[steady]) * 1e3:.1f} ms | {cached[0] * 1e3:.1f} ms | "
          f"{cached[1] * 1e3:.1f} ms |")
    print(f"\n{ratio:.1f}x lower with the cache; {counters['entries']} state(s) kept ({counters['bytes'] / 2**20:.1f} "
          f"MiB), {counters['hits']} hits, {counters['tokens_saved']:,} prompt tokens not read again; the same "
          f"tokens: {'yes' if got == want else 'NO'}")
    print(f"- {'PASS' if ratio >= 5 and got == want else 'FAIL'}: at least 5x, the same tokens (issue 55)")
    return 0 if got == want else 1


if __name__ == "__main__":
    sys.exit(main())
