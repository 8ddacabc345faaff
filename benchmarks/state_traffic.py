"""Why a fixed-state layer's decode is slower per token than a short-context softmax layer's on
this CPU (issue 54): the state's bytes. Each decoded token reads and writes its slot's whole
state, [H, 2 Dh, 2M] float32 a layer (256 KB at serve_vllm.py's d 256, 4 heads, M 64), where a
softmax layer reads 2 d floats a token of context (2 KB) and writes one token's worth.

    python benchmarks/state_traffic.py            # ~1 minute on 2 cores

Per number of slots B: the C++ decode core (inference/csrc/fixed_state_step.cpp, what the vLLM
plugin and `megatron-id generate` run on a CPU) over serve_vllm.py's model's 4 layers, one step
of B slots, with 64 MB written between steps as a serving step's LM head and weights evict the
caches (the LM head alone is 51 MB at this size); the state bytes that step moves (read and
written), its rate, and the machine's own rate for an in-place pass over a buffer of the same
size (the most the core could reach). Then the context at which a softmax layer's KV cache reads
as many bytes a token as the state update moves: below it, attention moves fewer bytes.
1 thread, as vLLM's worker runs on this 2-core machine.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generation import build  # noqa: E402  (serve_vllm.py's model)

EVICT_BYTES = 64 << 20


def median_seconds(run, before, reps: int) -> float:
    times = []
    for _ in range(reps):
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    import torch

    from megatron_id.inference import cpu_kernel
    from megatron_id.model.mixers.decode import fixed_state_between_kernel
    torch.set_num_threads(1)
    kernel = cpu_kernel.fixed_state_step_kernel()
    if kernel is None:
        raise SystemExit("state_traffic: the C++ decode core could not be built here (see the warning above)")
    model = build("interdomain")
    evict = torch.zeros(EVICT_BYTES // 4)
    slots = [8, 32]
    print("# one decode step of the 4 fixed-state layers (d 256, 4 heads, M 64, float32), 1 thread, caches "
          "evicted between steps\n")
    print("| slots | state bytes moved a step | ms a step | GB/s | this machine's in-place pass over as many "
          "bytes, GB/s |")
    print("|---|---|---|---|---|")
    state_bytes = None
    for B in slots:
        layers = []
        for block in model.layers:
            tables, static = block.mixer.decode_tables()
            layers.append(({**tables, **block.mixer.allocate_decode_state(B)}, static))
        state_bytes = layers[0][0]["state"][0].numel() * layers[0][0]["state"].element_size()   # a slot, a layer
        rope = model.layers[0].mixer.decode_facts().rope
        angles = torch.randn(B, 1, rope[0] // 2) if rope else None
        cos_sin = (angles.cos(), angles.sin()) if rope else None
        y = torch.randn(B, layers[0][0]["w_in"].shape[0])

        def step():
            for tables, static in layers:
                fixed_state_between_kernel(y, cos_sin, tables, static, kernel)
        step()
        seconds = median_seconds(step, lambda: evict.add_(1), reps=30)
        moved = 2 * state_bytes * B * len(layers)   # read and written
        buffer = torch.randn(moved // 2 // 4)
        machine = median_seconds(lambda: buffer.mul_(1.0001), lambda: evict.add_(1), reps=30)
        print(f"| {B} | {moved / 2**20:.0f} MiB | {seconds * 1e3:.2f} | {moved / seconds / 1e9:.1f} | "
              f"{moved / machine / 1e9:.1f} |", flush=True)
    d = model.cfg.d_model
    kv_bytes = 2 * d * 4   # a token's key and value, float32, a layer
    print(f"\nA slot's state: {state_bytes // 1024} KB a layer, read and written each token "
          f"({2 * state_bytes // 1024} KB moved). A softmax layer of the same width reads {kv_bytes // 1024} KB "
          f"a token of context: it moves as many bytes a token at a context of {2 * state_bytes // kv_bytes} "
          f"tokens. Below that, on a machine whose decode is bound by memory, attention decodes faster; above "
          f"it, the fixed state does (serve_vllm.py --prompt-tokens 768: the plugin's inter-token p50 1.45x "
          f"shorter).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
