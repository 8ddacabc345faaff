"""Run a function on N gloo ranks (spawned processes) with every wait bounded.

    results = run_distributed(fn, world_size=4, args=(...), timeout=120)

`fn(rank, world_size, *args)` must be a module-level function. The first rank that raises
ends the run: the others are killed and its traceback is raised here as RankError. A run
that does not finish within `timeout` seconds is killed and raises TimeoutError naming the
ranks still running. Process-group init and collectives carry their own timeout too, so a
hung collective inside a rank also ends.
"""
from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    pass


def _follow_output_of(pid: int) -> None:
    """Write to what the caller's stdout and stderr are now (pytest's capture of this test): a
    rank forked from the fork server would otherwise write where the server's were when it
    started, another test's capture. Linux /proc; elsewhere the output stays where it is."""
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(target, fd)
        os.close(target)


def _worker(fn, rank, world_size, init_file, results, args, collective_timeout, environment=None, caller=None):
    if caller is not None:
        _follow_output_of(caller)
    if environment is not None:   # the caller's environment now (the fork server's is from its start)
        os.environ.clear()
        os.environ.update(environment)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # what torchrun sets, which DeepSpeed checks
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=collective_timeout))
        out = fn(rank, world_size, *args)
        buffer = io.BytesIO()   # plain bytes: shared-memory tensors would die with this process
        torch.save(out, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:   # report everything, including assertion errors, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _kill(procs):
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


# What every rank imports, imported once by the fork server: each rank is then forked from it
# (~0.1 s) instead of spawned and importing torch and DeepSpeed anew (~2 s a run on 2 cores).
PRELOAD = ["torch", "torch.distributed", "deepspeed", "megatron_id.training.engine", "megatron_id.model"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)   # (read when the server starts: the first run)
    return ctx


def run_distributed(fn, world_size: int, args=(), timeout: float = 180, collective_timeout: float = 60):
    ctx = _context()
    results = ctx.Queue()
    init_file = tempfile.mktemp(prefix="megatron_id_pg_")
    # each rank starts its own wandb service, as a real rank does: a WANDB_SERVICE left in this
    # process's environment by an in-process wandb.init of another test would make every rank of
    # every later test share that one service (a SIGKILLed rank's run then stays "in use" there)
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(fn, r, world_size, init_file, results, args, collective_timeout, env, os.getpid()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    done, deadline = {}, time.monotonic() + timeout
    try:
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout} s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in done and p.exitcode is not None and results.empty():
                        time.sleep(0.2)   # its message may still be in flight
                        if results.empty():
                            raise RankError(f"rank {r} exited with code {p.exitcode} without a result")
                continue
            if not ok:
                raise RankError(f"rank {rank} of {world_size} raised:\n{payload}")
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        _kill(procs)
        if os.path.exists(init_file):
            os.remove(init_file)
    return [done[r] for r in range(world_size)]
