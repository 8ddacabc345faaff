"""Starting torch.distributed from whatever launched us: torchrun / the deepspeed launcher (RANK,
WORLD_SIZE, MASTER_ADDR...), one srun task per process (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID), or a plain `python` (a one-process group).

Under srun-per-process the rendezvous address is the first node of the job, found with
`scontrol show hostnames` and resolved through SLURM's NodeAddr (node names need not resolve
in DNS); the port is MASTER_PORT or derived from the job id, so two jobs sharing a node do not
clash. A missing `scontrol` is an error, never a silent fallback to localhost.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess

import torch


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


def init_distributed_from_env() -> None:
    """gloo on CPU (or with DS_ACCELERATOR=cpu), nccl on GPU."""
    import deepspeed
    os.environ.update(environment_from_slurm(dict(os.environ)))
    if "RANK" not in os.environ:   # plain `python`: a one-process group on a free local port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
