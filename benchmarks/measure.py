"""Peak memory and time of a call, as the memory benchmarks measure them (core_memory.py,
attention_memory.py): run in a fresh process per cell, after the inputs exist.

CPU: peak RSS above the RSS before the first call (what the OS gives the process, glibc's heap
growth included), and peak live heap bytes above those before the timed calls (glibc
mallinfo2 sampled every 0.5 ms: the analogue of CUDA's max_memory_allocated). CUDA: max
allocated for both. Time: the minimum over `reps` calls after one warm-up call.
"""
from __future__ import annotations

import ctypes
import os
import resource
import threading
import time


class _MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _heap_bytes() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_and_time(fn, reps: int, device, after_call=lambda: None) -> dict:
    """{'time': s, 'rss': bytes, 'live': bytes} of fn() on `device` (after_call runs after
    every call, outside the timing: e.g. dropping the gradients it left)."""
    import torch
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rss_before = _rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.max_memory_allocated()
    fn()
    sync()
    after_call()
    base, peak, stop = _heap_bytes(), [_heap_bytes()], [False]

    def sample():
        while not stop[0]:
            peak[0] = max(peak[0], _heap_bytes())
            time.sleep(0.0005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
        after_call()
    stop[0] = True
    sampler.join()
    if device.type == "cuda":
        rss_peak = live_peak = torch.cuda.max_memory_allocated() - cuda_before
    else:
        rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
        live_peak = peak[0] - base
    return {"time": best, "rss": max(rss_peak, 0), "live": max(live_peak, 0)}
