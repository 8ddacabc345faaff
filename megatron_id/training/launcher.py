"""`megatron-id train --nproc N`: the N ranks of one machine, started by megatron-id itself.

The README, launch/local.sh and launch/quickstart.sh start training this way; torchrun, the
deepspeed launcher and srun still work (they set RANK, ...; then --nproc is refused). What it
does that torchrun does not [our choice]:

- The config and the layout are checked once, here, before any rank starts (a refusal is one
  line; under torchrun every refusal is followed by torchrun's 25-line ChildFailedError report).
- The exit status is the ranks' own: 0 finished, 2 refused, 3 stopped by SIGTERM / SIGUSR1 after
  saving, 130 Ctrl-C (torchrun exits 1 for all of them, with a SignalException traceback after
  a SIGTERM). The last line is rank 0's; the launcher adds a line only when a rank died without
  one (killed by a signal: the OOM killer's SIGKILL, a segfault).
- Signals: SIGTERM, SIGUSR1 and SIGINT to the launcher go to every rank once (the ranks run in
  their own sessions, so a Ctrl-C in the terminal reaches them through the launcher only,
  not twice; one signal delivered twice within a second, as launch/local.sh's trap and a
  terminal both do, is passed on once); every rank asks the kernel for SIGTERM when the launcher
  dies (PR_SET_PDEATHSIG, as under torchrun), so a killed launcher leaves no orphan training.
- A rank that fails ends the run: the others get `GRACE` seconds to end by themselves (a problem
  every rank finds ends them all at once), then SIGTERM, then SIGKILL.
- Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free
  MASTER_PORT, as torchrun --standalone gives; OMP_NUM_THREADS=1 unless exported (torchrun's
  default, without its warning), and the allocator settings of megatron_id/allocator.py.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from ..errors import UserError

GRACE = 10.0          # seconds the other ranks get to end by themselves after one failed
KILL_AFTER = 30.0     # then SIGTERM; SIGKILL this long after it (torchrun's 30 s)
LAUNCHER_ENV = "MEGATRON_ID_LAUNCHER_PID"   # set in every rank: the pid to die with


class LaunchError(UserError):
    pass


def check_nproc(nproc: int, env=None, nnodes: int = 1) -> None:
    env = os.environ if env is None else env
    if nproc < 1:
        raise LaunchError(f"--nproc {nproc}: give the number of processes to start on this machine, at least 1 "
                          f"(e.g. --nproc 2; on GPUs one per GPU).")
    if "TORCHELASTIC_RUN_ID" in env or "RANK" in env:
        by = "torchrun" if "TORCHELASTIC_RUN_ID" in env else f"a launcher (RANK={env['RANK']} is set)"
        raise LaunchError(f"--nproc {nproc}: this process is already one rank started by {by}: drop --nproc "
                          f"(it starts the ranks itself), or run `megatron-id train --nproc {nproc} ...` alone.")
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if tasks.isdigit() and int(tasks) > 1 and int(tasks) != nnodes:   # (--nnodes: one task per node)
        raise LaunchError(f"--nproc {nproc}: srun started {tasks} tasks, and each would start {nproc} ranks: drop "
                          f"--nproc under srun (one task per GPU: launch/slurm/train.sbatch), or run one task.")


def check_devices(nproc: int, env=None) -> None:
    """On GPUs one rank per GPU: more ranks than visible GPUs would put two on one (NCCL refuses
    it after the ranks have started)."""
    env = os.environ if env is None else env
    import torch
    if env.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if nproc > gpus:
        raise LaunchError(f"--nproc {nproc}: this machine shows {gpus} GPU(s) and each rank drives one: give --nproc "
                          f"{gpus} or fewer (CUDA_VISIBLE_DEVICES chooses which), or DS_ACCELERATOR=cpu for CPU "
                          f"processes.")


def check_host(cfg, layout, nproc: int, env=None) -> None:
    """On CPU: the ranks' planned memory together against the host's, before any starts (each
    rank checks it too, once torch and DeepSpeed are imported: with --nproc 64 on a small host
    the imports alone could bring the OOM killer first)."""
    env = os.environ if env is None else env
    import torch
    if env.get("DS_ACCELERATOR") != "cpu" and torch.cuda.is_available():
        return
    from .agreement import check_host_memory
    from .plan import run_estimate_gib
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(nproc)   # (what each rank will have)
    try:
        check_host_memory(cfg, layout, run_estimate_gib(cfg, layout, on_gpu=False))
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


# The exit status of a run that a signal (SIGTERM, SIGUSR1) stopped before train_iters, after
# saving: not 0, so that a script or an `afterok` chain does not take it for a finished run, and
# not 1 or 2 (an error) [our choice: 3]. launch/slurm/train.sbatch sets
# MEGATRON_ID_STOPPED_EXIT_STATUS=0: srun's --kill-on-bad-exit would end the other ranks on a
# non-zero exit, and the script tells a stop from a finish by the checkpoint's step itself.
# Here, not in commands/train.py, which imports this module: each rank's `megatron-id train`
# and this launcher both exit with it.
STOPPED_EXIT_STATUS = 3


def stopped_exit_status() -> int:
    """megatron-id train's status for a run a signal stopped (STOPPED_EXIT_STATUS, unless
    MEGATRON_ID_STOPPED_EXIT_STATUS says otherwise)."""
    value = os.environ.get("MEGATRON_ID_STOPPED_EXIT_STATUS", "")
    return int(value) if value.isdigit() else STOPPED_EXIT_STATUS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_environment(base: dict) -> dict:
    """What every rank gets besides its rank variables: the allocator settings (anything exported
    wins; either malloc variable: then neither is added, as allocator.py does), OMP_NUM_THREADS=1
    unless exported, unbuffered output."""
    from ..allocator import ALLOCATOR_ENV
    env = {**({} if any(k in base for k in ALLOCATOR_ENV) else ALLOCATOR_ENV), **base}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def rank_environment(base: dict, rank: int, nproc: int, port: int) -> dict:
    env = ranks_environment(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{LAUNCHER_ENV: str(os.getpid())})
    return env


def launch(nproc: int, train_args: list[str], debug: bool = False, early=()) -> int:
    """Start `megatron-id train <train_args>` as ranks 0..nproc-1 of one process group on this
    machine; return the exit status the run should end with (see the module docstring).
    `early`: SIGTERM / SIGUSR1 received before this (no rank is started then)."""
    check_nproc(nproc)
    if early:
        status = stopped_exit_status()
        print(f"stopped before any rank started ({signal.Signals(early[0]).name}): nothing was trained or saved "
              f"(exit {status})", file=sys.stderr, flush=True)
        return status
    base = dict(os.environ)
    if debug:
        base["MEGATRON_ID_DEBUG"] = "1"
    port = _free_port()
    argv = [sys.executable, "-m", "megatron_id.cli", "train", *train_args]
    received: list[int] = []
    ranks: list[subprocess.Popen] = []

    last = {}

    def forward(signum, frame):
        received.append(signum)
        # one signal sent twice (a terminal's Ctrl-C reaches launch/local.sh and this process,
        # and the script passes it on too): forwarded once
        if time.monotonic() - last.get(signum, -1e9) < 1.0:
            return
        last[signum] = time.monotonic()
        for rank in ranks:
            if rank.poll() is None:
                try:
                    rank.send_signal(signum)
                except ProcessLookupError:
                    pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        for rank in range(nproc):
            ranks.append(subprocess.Popen(argv, env=rank_environment(base, rank, nproc, port),
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        if received:   # a signal while the ranks were being started: the later ones missed it
            for rank in ranks:
                if rank.poll() is None:
                    rank.send_signal(received[-1])
        return _wait(ranks)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch_elastic(nproc: int, train_args: list[str], max_restarts: int, debug: bool = False, early=(),
                   finished=None, nnodes: int = 1, endpoint: str | None = None, run_id: str | None = None) -> int:
    """launch() with in-job restarts (train.max_restarts > 0): the ranks run under
    torch.distributed.elastic's agent (torchrun's), which restarts all of them when one fails,
    up to `max_restarts` times (training/resilience.py). Exit statuses as launch(): a rank stopped
    by SIGTERM / SIGUSR1 after saving exits 0 here (any other status would be restarted), so a stop
    is told from a finish by `finished()` (the run reached its last step); then 3.
    `finished`: a function saying whether the run is complete (reads train.save's `latest`).
    nnodes > 1: this is one node's agent of a multi-node run (one per node, as torchrun), meeting
    the others at `endpoint` under `run_id` (torch's c10d rendezvous)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    check_nproc(nproc, nnodes=nnodes)
    if early:
        return launch(nproc, train_args, debug, early)   # (says so; nothing started)
    os.environ.update(ranks_environment(dict(os.environ)))   # (the agent passes its environment on)
    os.environ["MEGATRON_ID_STOPPED_EXIT_STATUS"] = "0"
    # each rendezvous round's ranks get a store of their own (rank 0 hosts it on a fresh port), as
    # torch's opt-out gives: on the agents' shared store (torch 2.13's default) a restarted round
    # read the previous round's gloo addresses, and across nodes the agents' restart counts differ
    # (a node restarted for a peer's failure counts no restart), so no per-attempt prefix is safe
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if debug:
        os.environ["MEGATRON_ID_DEBUG"] = "1"
    _quiet_elastic_logs()
    config = LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
                          run_id=run_id or f"megatron-id-{os.getpid()}", rdzv_backend="c10d",
                          rdzv_endpoint=endpoint or f"127.0.0.1:{_free_port()}", max_restarts=max_restarts,
                          monitor_interval=0.5, signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                          # (torchrun reads this variable itself; the agent API only takes it as given)
                          shutdown_timeout=_shutdown_timeout())
    try:
        launch_agent(config, sys.executable, ["-m", "megatron_id.cli", "train", *train_args])
    except ChildFailedError as err:
        # the rank that failed first; its peers end within the same poll, exit 2 saying "a peer
        # rank ended" (PeerGoneError), so a failure with another status is the cause when there is one
        causes = {r: f for r, f in err.failures.items() if f.exitcode != 2} or err.failures
        number, failure = min(causes.items(), key=lambda item: item[1].timestamp)
        status = failure.exitcode
        restarts = f"after {max_restarts} in-job restart(s) (train.max_restarts={max_restarts})"
        if status < 0:
            name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
            print(f"megatron-id train: rank {number} was killed by {name} {restarts}; the run ended with it "
                  f"(exit {128 - status})", file=sys.stderr, flush=True)
            return 128 - status
        print(f"megatron-id train: rank {number} failed (exit {status}) {restarts}; the run ended with it",
              file=sys.stderr, flush=True)
        return status
    except SignalException as err:
        if err.sigval == signal.SIGINT:
            return 130
        if err.sigval in (signal.SIGTERM, signal.SIGUSR1):
            return 0 if finished is not None and finished() else stopped_exit_status()
        return 128 + int(err.sigval)
    return 0 if finished is None or finished() else stopped_exit_status()


def _shutdown_timeout() -> int:
    """How long the agent gives the ranks to stop after SIGTERM before SIGKILL (a restart, a
    signal): TORCH_ELASTIC_SHUTDOWN_TIMEOUT as under torchrun, else torchrun's 30 s."""
    value = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    return int(value) if value.isdigit() else 30


def run_finished(save: str, train_iters: int) -> bool:
    """Whether train.save's `latest` is at the run's last step (a finished run, not a stopped one)."""
    from ..checkpoint.files import latest_folder, step_of
    try:
        folder = latest_folder(save)
    except Exception:
        return False
    return folder is not None and step_of(folder.name) >= train_iters


def _quiet_elastic_logs() -> None:
    """The agent's INFO lines (its launch config, each rendezvous) are for torchrun's debugging;
    its warnings (a failed worker group, the restart) are printed, marked as the agent's."""
    import logging
    log = logging.getLogger("torch.distributed.elastic")
    log.setLevel(logging.WARNING)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("megatron-id train (torch elastic agent): %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def _wait(ranks: list[subprocess.Popen]) -> int:
    first_failure = None   # (rank, status) of the first rank that ended with a non-zero status
    failed_at = terminated_at = None
    while True:
        statuses = [rank.poll() for rank in ranks]
        if all(s is not None for s in statuses):
            break
        if first_failure is None:
            for number, status in enumerate(statuses):
                if status not in (None, 0):
                    first_failure, failed_at = (number, status), time.monotonic()
                    break
        now = time.monotonic()
        if failed_at is not None and terminated_at is None and now - failed_at > GRACE:
            terminated_at = now
            for rank in ranks:
                if rank.poll() is None:
                    rank.send_signal(signal.SIGTERM)
        if terminated_at is not None and now - terminated_at > KILL_AFTER:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
        time.sleep(0.05)
    statuses = [rank.returncode for rank in ranks]
    if first_failure is None:
        failed = [(n, s) for n, s in enumerate(statuses) if s != 0]
        first_failure = failed[0] if failed else None
    if first_failure is None:
        return 0
    number, status = first_failure
    if status < 0:   # killed by a signal: the rank said nothing, so the launcher does
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        hint = " (the kernel's OOM killer sends SIGKILL: see dmesg)" if -status == signal.SIGKILL else ""
        print(f"megatron-id train: rank {number} (pid {ranks[number].pid}) was killed by {name}{hint}; the run ended "
              f"with it (exit {128 - status})", file=sys.stderr, flush=True)
        return 128 - status
    return status
