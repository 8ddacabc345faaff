"""Starting torch.distributed from whatever launched us: torchrun / the deepspeed launcher (RANK,
WORLD_SIZE, MASTER_ADDR...), one srun task per process (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID), or a plain `python` (a one-process group).

Under srun-per-process the rendezvous address is the first node of the job, found with
`scontrol show hostnames` and resolved through SLURM's NodeAddr (node names need not resolve
in DNS); the port is MASTER_PORT or derived from the job id, so two jobs sharing a node do not
clash. A missing `scontrol` is an error, never a silent fallback to localhost.

On GPUs the CUDA device is set from the local rank (modulo the devices this process sees: with
`srun --gpus-per-task=1` each task sees one GPU, as device 0) before the process group exists,
and every collective of ours runs on that device: the group is NCCL only, and NCCL accepts only
CUDA tensors. Every collective carries train.collective_timeout_minutes, so a hung rank ends
the job instead of stalling it (gloo raises; NCCL's watchdog aborts the process).

Under torchrun each worker asks the kernel for SIGTERM when its launcher dies (PR_SET_PDEATHSIG):
torchrun has no SIGUSR1 handler and dies of one, and its workers would otherwise keep training
and writing train.save as orphans; with it they save a checkpoint and stop.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import UserError


def _scontrol(*args: str) -> str:
    if shutil.which("scontrol") is None:
        raise RuntimeError("SLURM_PROCID is set but `scontrol` is not on PATH, so the job's first node "
                           "(the rendezvous host) cannot be found. Run where the SLURM client tools "
                           "are installed, or set MASTER_ADDR and MASTER_PORT yourself.")
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, timeout=60).stdout


def first_node_address(nodelist: str) -> str:
    """The address of the first node of a SLURM node list (NodeAddr when SLURM knows one)."""
    first = _scontrol("show", "hostnames", nodelist).split()[0]
    for field in _scontrol("show", "node", first).split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    return first


def environment_from_slurm(env: dict) -> dict:
    """The torch.distributed variables for an srun-per-process launch (empty when not one)."""
    if "RANK" in env or "SLURM_PROCID" not in env:
        return {}
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
           "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    if "MASTER_ADDR" not in env:
        out["MASTER_ADDR"] = first_node_address(env["SLURM_JOB_NODELIST"])
    if "MASTER_PORT" not in env:
        out["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return out


def uses_cuda() -> bool:
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"


def local_device_index() -> int:
    """The CUDA device of this process: its local rank modulo the devices it can see."""
    return int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)


def die_with_launcher(parent_pid: int | None = None) -> bool:
    """Ask for SIGTERM when the launching process dies (Linux); False where unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return False
    PR_SET_PDEATHSIG = 1
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:   # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def init_distributed_from_env(timeout_minutes: float = 10.0) -> None:
    """gloo on CPU (or with DS_ACCELERATOR=cpu), nccl on GPU; collectives time out after
    `timeout_minutes`."""
    import deepspeed
    os.environ.update(environment_from_slurm(dict(os.environ)))
    if "TORCHELASTIC_RUN_ID" in os.environ:   # started by torchrun: stop with it (see above)
        die_with_launcher(os.getppid())
    elif os.environ.get("MEGATRON_ID_LAUNCHER_PID", "").isdigit():   # by megatron-id train --nproc
        die_with_launcher(int(os.environ["MEGATRON_ID_LAUNCHER_PID"]))
    if "RANK" not in os.environ:   # plain `python`: a one-process group on a free local port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    backend = "nccl" if uses_cuda() else "gloo"
    if backend == "nccl":   # before the group: NCCL binds each rank's communicator to this device
        torch.cuda.set_device(local_device_index())
    if backend == "gloo":
        skip_deepspeed_shm_build()
    timeout = timedelta(minutes=timeout_minutes)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":   # under torch.distributed.elastic's agent
        _init_in_attempt(backend, timeout)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)   # (adopts it)
    set_default_group_timeout(timeout)


def _init_in_attempt(backend: str, timeout: timedelta) -> None:
    """The process group on the elastic agent's store, under a prefix of this restart attempt.
    torch's env:// rendezvous on the agent's store adds none (torch 2.13), so the ranks of a
    restarted attempt read the previous attempt's gloo addresses and fail to connect ("Connection
    refused"): every in-job restart failed, also under plain torchrun --max-restarts."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timeout)
    store = dist.PrefixStore(f"megatron_id/attempt_{attempt}", client)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def skip_deepspeed_shm_build() -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce at
    start. Training never uses it (torch.distributed's gloo all-reduce does the work; the shm
    kernel serves DeepSpeed's inference all-reduce), the build takes tens of seconds on a fresh
    machine, and a rank killed during it leaves torch's build lock behind: every later start on
    that machine then waits on the lock forever. So it is not built."""
    import importlib
    # (`import deepspeed.comm.torch` would give torch itself: deepspeed.comm re-exports it)
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_torch, "build_shm_op"):
        ds_torch.build_shm_op = lambda: None


def set_default_group_timeout(timeout: timedelta) -> None:
    """Make every group created from now on (ours in parallel/state.py, DeepSpeed's data, ZeRO
    and pipeline groups) time out like the world group. torch.distributed gives a new_group
    without an explicit timeout its module default (30 min for gloo, 10 for NCCL), not the
    world group's, and DeepSpeed creates its groups without one."""
    from torch.distributed import distributed_c10d
    distributed_c10d.default_pg_timeout = timeout
    if hasattr(distributed_c10d, "default_pg_nccl_timeout"):
        distributed_c10d.default_pg_nccl_timeout = timeout


def agree_on_rank0(check):
    """Run `check()` on rank 0 only (checks that read files, locks); every rank returns its
    result or raises its UserError, which every rank then reports as the same problem."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = check()
        except UserError as err:
            error = err
    box = [(result, error)]
    dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        error.same_on_every_rank = True
        raise error
    return result


class CollectiveTimeoutError(UserError):
    """A collective did not complete within train.collective_timeout_minutes."""


def is_collective_timeout(err: BaseException) -> bool:
    """gloo's "Timed out waiting Nms for ..." and torch's DistBackendError timeouts."""
    text = str(err)
    return isinstance(err, RuntimeError) and ("Timed out waiting" in text or "timed out" in text.lower()
                                              and ("gloo" in text or "collective" in text.lower()))


class PeerGoneError(UserError):
    """A collective failed because another rank's process ended (killed, crashed, exited): one
    line here, the cause in that rank's own output (its traceback, or the launcher's line)."""


# gloo's words for a peer whose process is gone; NCCL's watchdog aborts the process instead
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_peer_gone(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(words in str(err) for words in PEER_GONE)


class Heartbeat:
    """A daemon thread per rank stamps (time, step, host, pid) into the rendezvous store every
    `period` seconds, on a connection of its own. When a collective times out, the ranks whose
    stamp went stale are the ones that stopped (SIGSTOP, swapping, a dead node): their threads
    stopped with them, while ranks merely waiting in the collective keep stamping. The store is
    torchrun's agent, or rank 0 under srun (MASTER_ADDR:MASTER_PORT); without one (a group
    made from a file) nothing is recorded and the message says less."""

    KEY = "megatron_id/alive/{}"

    def __init__(self, period: float = 2.0):
        import threading
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.host, self.pid, self.period, self.step = socket.gethostname(), os.getpid(), period, 0
        self.store = None
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            try:
                self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=timedelta(seconds=10))
            except Exception:   # no reachable store: progress goes unrecorded
                self.store = None
        self._stop = threading.Event()
        if self.store is not None:
            self._stamp()
            threading.Thread(target=self._run, daemon=True, name="megatron-id-heartbeat").start()

    def _stamp(self) -> None:
        self.store.set(self.KEY.format(self.rank), json.dumps([time.time(), self.step, self.host, self.pid]))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._stamp()
            except Exception:
                return

    def beat(self, step: int) -> None:
        self.step = step

    def close(self) -> None:
        self._stop.set()

    def describe_silent_ranks(self, step: int) -> str:
        """'rank 1 (host a, pid 7) silent for 17 s, at step 3', or '' when unknown."""
        if self.store is None:
            return ""
        now, parts = time.time(), []
        try:
            for r in range(self.world):
                key = self.KEY.format(r)
                if not self.store.check([key]):
                    parts.append(f"rank {r} never reported")
                    continue
                t, _, host, pid = json.loads(self.store.get(key))
                if now - t > 2 * self.period + 1:
                    part = f"rank {r} (host {host}, pid {pid}) silent for {now - t:.0f} s"
                    if host == self.host and r != self.rank and _kill(pid):
                        part += ", killed (a stopped rank holds its launcher back)"
                    parts.append(part)
        except Exception:
            return ""
        return "; ".join(parts)


def _kill(pid: int) -> bool:
    """End a silent rank on this host: its launcher gives a stopped process 30 s to handle the
    SIGTERM it cannot handle before it kills it (torchrun), or waits for the time limit."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except OSError:
        return False


def collective_timeout_error(err: BaseException, step: int, minutes: float, heartbeat) -> CollectiveTimeoutError:
    silent = heartbeat.describe_silent_ranks(step) if heartbeat is not None else ""
    who = (f" Stopped responding: {silent}." if silent else
           " Another rank is hung or died: look at its log.")
    return CollectiveTimeoutError(
        f"a collective of step {step} did not complete within train.collective_timeout_minutes={minutes:g} "
        f"({minutes * 60:.0f} s).{who} A stopped, deadlocked or swapping rank stalls every other rank; "
        f"raise train.collective_timeout_minutes only if a rank legitimately works alone that long "
        f"(e.g. building the data index of a huge dataset). [{str(err).splitlines()[0][:200]}]")
