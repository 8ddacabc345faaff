"""Generation: decode latency per token against the prefix length, and peak prefill memory with
and without chunked prefill.

    python benchmarks/generation.py            # ~11 minutes on 2 cores
    python benchmarks/generation.py --server   # only the server and memory-per-sequence rows (~3 minutes)
    python benchmarks/generation.py --batched  # only the batched fused-step rows (~3 minutes)
    python benchmarks/generation.py --hf       # only transformers' generate on the exports (~1 minute)

Model: a small width (d 256, 4 heads, 4 layers, M 64, GPT-2 vocabulary), random weights (latency
and memory do not depend on the values), batch 1, fp32, on this CPU with 2 threads. Each cell
runs in a fresh process (so peak RSS is its own):
  decode   prefill a random prefix of N tokens (chunks of 2,048), then time 32 decode steps
           (one token each, the model's own state / KV cache); the median per token.
  prefill  a 16K-token prompt in one call vs chunks of 1,024 tokens; peak RSS of the process
           (CUDA: max allocated), minus the RSS after building the model.
  batched  the fused step that `generate` and the server decode with (FusedDecoder, its default
           kernel), batch 1 / 8 / 32 after a prefix of 256 to 16K tokens (one real prefill per
           prefix, loaded into every slot): ms per step and tokens/s, the median of 20 steps
  server   `megatron-id serve` on the model exported (32 slots), N concurrent clients sending
           greedy completions: generated tokens per second of wall time, and the server's RSS;
           then what one sequence's slot holds in the fused step at 1K-16K tokens of context.
  hf       transformers' generate on the exports (trust_remote_code), batch 1, a 32-token prompt,
           greedy: ms per new token ((time of 65 tokens - time of 1) / 64, best of 3), the
           interdomain export on the fused step (its default: the bundled fused_decode, with
           megatron_id's C++ core when megatron_id wrote the export) and on the model's own
           forward (config.fused_decode = False), beside the softmax export, in one run.
(The fused step's own latency at 125M width, batch 1 and 8: benchmarks/decode_step.py.)
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from allocator import ALLOCATOR_ENV  # noqa: E402  (benchmarks/allocator.py, beside this file)

PREFIXES = [512, 1024, 2048, 4096, 8192, 16384]
MIXERS = ["interdomain", "softmax"]


def build(mixer: str):
    import torch

    from megatron_id.config import load_config
    from megatron_id.model import LanguageModel
    cfg = load_config([ROOT / "configs/model/tiny.yaml"], [
        f"model.mixer={mixer}", "model.d_model=256", "model.n_heads=4", "model.n_layers=4",
        "model.state_size=64", "model.vocab_size=50257", "model.seq_length=2048"]).model
    torch.manual_seed(0)
    return LanguageModel(cfg, seed=0).eval()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cell(kind: str, mixer: str, n: int, chunk: int) -> dict:
    import torch
    torch.set_num_threads(2)
    model = build(mixer)
    base = rss_mib()
    tokens = torch.randint(0, 50257, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = None
        for start in range(0, n, chunk):
            logits, states = model(tokens[:, start:start + chunk], states=states, return_states=True)
        if kind == "prefill":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            return {"peak_mib": peak - base}
        times, token = [], logits[:, -1:].argmax(-1)
        for _ in range(32):
            start = time.perf_counter()
            logits, states = model(token, states=states, return_states=True)
            times.append(time.perf_counter() - start)
            token = logits[:, -1:].argmax(-1)
    return {"decode_ms": 1000 * statistics.median(times[4:])}


def run(kind: str, mixer: str, n: int, chunk: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--cell", kind, mixer, str(n), str(chunk)],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **ALLOCATOR_ENV, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def export_random(mixer: str, folder: Path) -> Path:
    """The benchmark's model (random weights) as an exported folder, for `megatron-id serve`."""
    from megatron_id.checkpoint.files import ClientState, model_config_dict
    from megatron_id.checkpoint.read import write_weights_only
    from megatron_id.hf.export import export_hf, write_folder
    model = build(mixer)
    tokenizer = ROOT / "tests/data/gpt2-tokenizer.json"
    client = ClientState(step=0, model=model_config_dict(model.cfg), weights_only=True, tokenizer=str(tokenizer),
                         layout={"tensor": 1, "pipe": 1, "data": 1, "zero_stage": 0})
    shard = {k: v.detach().clone() for k, v in model.state_dict().items()}
    checkpoint = write_folder(folder.with_name(folder.name + "-ckpt"),
                              lambda staging: write_weights_only(staging, [shard], model.cfg, 1, client))
    return export_hf(checkpoint, folder)


def batched_rows(prefixes=(256, 1024, 4096, 16384), batches=(1, 8, 32), steps: int = 20) -> None:
    """ms per step of the fused step at batch B after a prefix of L tokens (every slot at L)."""
    import torch

    from megatron_id.inference.fused_decode import FusedDecoder
    torch.set_num_threads(2)
    print("\n## the fused decode step (what `generate` and `serve` run), 4 layers, d 256: ms per step "
          f"(tokens/s), median of {steps} steps\n")
    print("| prefix | batch | " + " | ".join(MIXERS) + " | interdomain / softmax tokens/s |")
    print("|---|---|" + "---|" * (len(MIXERS) + 1))
    results = {}
    for mixer in MIXERS:
        model = build(mixer)
        tokens = torch.randint(0, 50257, (1, max(prefixes)), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            states, done = None, 0
            for L in prefixes:   # the prefill grows from one prefix to the next
                for start in range(done, L, 2048):
                    _, states = model(tokens[:, start:min(start + 2048, L)], states=states, return_states=True)
                done = L
                decoder = FusedDecoder(model, slots=max(batches), capacity=L + steps + 8)
                for slot in range(max(batches)):
                    decoder.load(slot, states, L)
                for B in batches:
                    step = torch.zeros(B, dtype=torch.long)
                    times = []
                    for _ in range(steps + 2):
                        start = time.perf_counter()
                        decoder.step(step)
                        times.append(time.perf_counter() - start)
                        decoder.positions[:B] -= 1   # stay at L: a softmax step's cost grows with it
                        decoder.lengths[:B] = [L] * B
                    results[(mixer, L, B)] = statistics.median(times[2:])
                del decoder
    for L in prefixes:
        for B in batches:
            cells = [f"{results[(m, L, B)] * 1e3:.2f} ({B / results[(m, L, B)]:,.0f})" for m in MIXERS]
            ratio = results[("softmax", L, B)] / results[("interdomain", L, B)]
            print(f"| {L:,} | {B} | " + " | ".join(cells) + f" | {ratio:.2f}x |", flush=True)


def slot_bytes(mixer: str, context: int) -> int:
    """What one sequence holds in the fused step's buffers at `context` tokens (its slot)."""
    from megatron_id.inference.fused_decode import FusedDecoder
    decoder = FusedDecoder(build(mixer), slots=1, capacity=context)
    total = 0
    for layer in decoder.layers:
        tensors = list(layer.buffers.values())   # the mixer's per-slot buffers (allocate_decode_state)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def server_rows(clients=(1, 8, 32), prefix: int = 256, max_tokens: int = 32, requests: int = 2) -> None:
    """Tokens/s of `megatron-id serve` (32 slots) under N concurrent clients, each sending
    `requests` greedy completions of max_tokens after a prefix-token prompt, one after the other."""
    import socket
    import tempfile
    import threading
    import urllib.request
    print(f"\n## through `megatron-id serve` (32 slots, 2 threads): {prefix}-token prompts, {max_tokens} new tokens, "
          f"{requests} requests per client\n")
    print("| mixer | clients | tokens/s | wall | server RSS |")
    print("|---|---|---|---|---|")
    prompt = " the" * prefix   # one GPT-2 token each
    with tempfile.TemporaryDirectory() as tmp:
        for mixer in MIXERS:
            folder = export_random(mixer, Path(tmp) / mixer)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            server = subprocess.Popen([sys.executable, "-m", "megatron_id.cli", "serve", "--checkpoint", str(folder),
                                       "--port", str(port), "--slots", "32", "--threads", "2", "--max-pending", "256",
                                       "--max-model-len", str(prefix + max_tokens + 8)],
                                      cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, **ALLOCATOR_ENV, "PYTHONPATH": str(ROOT)})
            url = f"http://127.0.0.1:{port}"
            try:
                for _ in range(600):
                    try:
                        urllib.request.urlopen(url + "/health", timeout=5).read()
                        break
                    except OSError:
                        time.sleep(0.2)

                def client():
                    for _ in range(requests):
                        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
                        reply = json.loads(urllib.request.urlopen(urllib.request.Request(
                            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}),
                            timeout=1800).read())
                        assert reply["usage"]["completion_tokens"] == max_tokens
                client()   # warm-up
                for n in clients:
                    threads = [threading.Thread(target=client) for _ in range(n)]
                    start = time.perf_counter()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    wall = time.perf_counter() - start
                    rss = int(next(line for line in open(f"/proc/{server.pid}/status")
                                   if line.startswith("VmRSS")).split()[1]) / 1024
                    print(f"| {mixer} | {n} | {n * requests * max_tokens / wall:,.0f} | {wall:.1f} s | "
                          f"{rss:,.0f} MiB |", flush=True)
            finally:
                server.terminate()
                server.wait(timeout=120)
    print("\n## memory per sequence (one slot of the fused step: states, conv tails, KV cache)\n")
    print("| mixer | " + " | ".join(f"{n:,} tokens" for n in (1024, 4096, 16384)) + " |")
    print("|---|---|---|---|")
    for mixer in MIXERS:
        print(f"| {mixer} | " + " | ".join(f"{slot_bytes(mixer, n) / 2**20:,.2f} MiB" for n in (1024, 4096, 16384))
              + " |", flush=True)


def hf_rows(prompt_tokens: int = 32, new_tokens: int = 64) -> None:
    """transformers' generate on the interdomain export (fused step, and its own forward) and on
    the softmax export: ms per new token, side by side."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM
    print(f"\n## transformers' generate on the exports: ms per new token, batch 1, {prompt_tokens}-token prompt, "
          f"greedy, {torch.get_num_threads()} threads\n")
    print("| export | decode | ms per token |")
    print("|---|---|---|")
    ids = torch.randint(0, 50000, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        folders = {mixer: export_random(mixer, Path(tmp) / mixer) for mixer in ("interdomain", "softmax")}
        for mixer, fused in (("interdomain", True), ("interdomain", False), ("softmax", False)):
            model = AutoModelForCausalLM.from_pretrained(folders[mixer], trust_remote_code=True).eval()
            model.config.fused_decode = fused

            def run(n):
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                return time.perf_counter() - start
            run(4)   # warm-up (and the C++ core's build, once)
            per_token = (min(run(new_tokens + 1) for _ in range(3)) - min(run(1) for _ in range(3))) / new_tokens
            how = "fused step" if fused else "the model's forward"
            print(f"| {mixer} | {how} | {per_token * 1000:.2f} |", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--cell"]:
        kind, mixer, n, chunk = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(cell(kind, mixer, n, chunk)))
        return
    if any(os.environ.get(k) != v for k, v in ALLOCATOR_ENV.items()):   # read when malloc starts
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR_ENV})
    if sys.argv[1:2] == ["--server"]:   # only the server and memory-per-sequence rows (~3 minutes)
        server_rows()
        return
    if sys.argv[1:2] == ["--batched"]:
        batched_rows()
        return
    if sys.argv[1:2] == ["--hf"]:
        hf_rows()
        return
    print("## decode latency per token (4 layers, d 256, batch 1, median of 28 steps)\n")
    print("| prefix | " + " | ".join(MIXERS) + " |")
    print("|---|" + "---|" * len(MIXERS))
    for n in PREFIXES:
        row = [f"{run('decode', m, n, 2048)['decode_ms']:.2f} ms" for m in MIXERS]
        print(f"| {n:,} | " + " | ".join(row) + " |", flush=True)
    print("\n## peak prefill memory above the model, 16K-token prompt\n")
    print("| mixer | one call | chunks of 1,024 |")
    print("|---|---|---|")
    for m in MIXERS:
        full, chunked = run("prefill", m, 16384, 16384), run("prefill", m, 16384, 1024)
        print(f"| {m} | {full['peak_mib']:,.0f} MiB | {chunked['peak_mib']:,.0f} MiB |", flush=True)
    batched_rows()
    server_rows()
    hf_rows()


if __name__ == "__main__":
    main()
