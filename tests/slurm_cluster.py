"""A real SLURM cluster on this one machine, for tests: munged, slurmctld and one slurmd per
emulated node, all under one scratch folder (config, munge key, state, logs, pid files), on
free ports, stopped by pid file whatever happens. Debian's SLURM (22.05) is installed when
missing and we are root (CI); elsewhere the tests that need it are skipped with the reason.

    with SlurmCluster(tmp_path, nodes=2, cpus_per_node=2) as cluster:
        job = cluster.sbatch(["--nodes=2", "--time=2", "script.sbatch"])
        info = cluster.wait(job, timeout=120)     # {'JobState': 'COMPLETED', 'ExitCode': '0:0', ...}

Every wait has a timeout. `sbatch --wait` polls at 2 s, 8 s, 32 s, so `wait` polls
`scontrol show job` every 0.3 s instead. The emulated node names do not resolve in DNS; SLURM
knows their address (NodeAddr=127.0.0.1), which is what the job script asks it for.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]


class SlurmUnavailable(RuntimeError):
    pass


def ensure_slurm_installed() -> None:
    """Install Debian's SLURM without starting its stock services (policy-rc.d exits 101)."""
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmUnavailable("SLURM is not installed and this is not a root Debian machine: "
                               f"apt-get install {' '.join(PACKAGES)}")
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=300)
        done = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        if made_policy:
            policy.unlink()
    if done.returncode != 0:
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed:\n{done.stderr[-2000:]}")


def _free_ports(n: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def _wait_for(predicate, timeout: float, what: str, log: Path | None = None, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    tail = ""
    if log is not None and log.exists():
        tail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{tail}")


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: int = 2):
        self.root = Path(root)
        self.node_names = [f"node{i + 1}" for i in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.host = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge.socket"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self, timeout: float = 60) -> None:
        ensure_slurm_installed()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(exist_ok=True)
        self._started = True
        key = self.root / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        subprocess.run(["munged", "--force", f"--socket={self.socket}", f"--key-file={key}",
                        f"--pid-file={self.root / 'munged.pid'}", f"--log-file={self.root / 'munged.log'}",
                        f"--seed-file={self.root / 'munged.seed'}"], check=True, timeout=30)
        ctl_port, *node_ports = _free_ports(1 + len(self.node_names))
        self.conf.write_text(self._slurm_conf(ctl_port, node_ports))
        subprocess.run(["slurmctld", "-f", str(self.conf), "-c"], env=self.env, check=True, timeout=30)
        for name in self.node_names:
            subprocess.run(["slurmd", "-f", str(self.conf), "-N", name], env=self.env, check=True, timeout=30)
        self.wait_until_idle(timeout)

    def _slurm_conf(self, ctl_port: int, node_ports: list[int]) -> str:
        r = self.root
        lines = [
            "ClusterName=megatronidtest",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none", "MailProg=/bin/true",
            # without these the scheduler waits ~3 s before starting each job
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "ReturnToService=2", "SlurmdParameters=config_overrides",
            # SIGTERM -> SIGKILL grace on cancel / time limit (30 s by default)
            "KillWait=10",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}", f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdSpoolDir={r}/slurmd-%n", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmdLogFile={r}/slurmd-%n.log",
        ]
        for name, port in zip(self.node_names, node_ports):
            lines.append(f"NodeName={name} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={self.cpus_per_node} RealMemory=4000")
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def wait_until_idle(self, timeout: float) -> None:
        _wait_for(self._all_idle, timeout, "every emulated node to be idle", self.root / "slurmctld.log")

    def _all_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], env=self.env,
                             capture_output=True, text=True, timeout=30).stdout.split()
        return set(self.node_names) <= set(out)

    def stop(self, timeout: float = 30) -> None:
        """scancel every job (job processes outlive a slurmd TERM), then stop the daemons by pid file."""
        if not self._started:
            return
        self._started = False
        if self.conf.exists():
            subprocess.run(["scancel", "--full", "--quiet", "--partition=debug"], env=self.env,
                           capture_output=True, timeout=30)
            try:
                _wait_for(lambda: not self._jobs_left(), timeout, "cancelled jobs to end")
            except (TimeoutError, subprocess.SubprocessError):
                pass
        pids = [self.root / f"slurmd-{name}.pid" for name in self.node_names]
        pids += [self.root / "slurmctld.pid", self.root / "munged.pid"]
        for pid_file in pids:
            pid = _read_pid(pid_file)
            if pid is None:
                continue
            _terminate(pid, timeout=10)

    def _jobs_left(self) -> bool:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True,
                             text=True, timeout=30).stdout
        return bool(out.strip())

    # ------------------------------------------------------------------ jobs

    def run(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def sbatch(self, args: list[str], cwd: Path | None = None, env: dict | None = None) -> str:
        done = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd,
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {done.stderr}")
        return done.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict:
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        info = {}
        for field in out.split():
            if "=" in field:
                key, value = field.split("=", 1)
                info.setdefault(key, value)
        return info

    def wait(self, job_id: str, timeout: float, until=None) -> dict:
        """Poll until the job has ended (or `until(info)` holds); the last `scontrol show job`."""
        ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                 "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
        deadline = time.monotonic() + timeout
        info = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if until is not None and until(info):
                return info
            if until is None and info.get("JobState") in ended:
                return info
            # a job whose dependency failed stays PENDING forever (unless --kill-on-invalid-dep)
            if until is None and info.get("Reason") == "DependencyNeverSatisfied":
                return info
            time.sleep(0.3)
        self.run("scancel", job_id, check=False)
        raise TimeoutError(f"job {job_id} did not {'reach the condition' if until else 'end'} within "
                           f"{timeout:.0f} s; last state: {info.get('JobState')}")


def cluster_for_tests(root: Path, nodes: int = 2, cpus_per_node: int = 2):
    """A pytest fixture's body: yields a started cluster and stops it afterwards, whatever
    happens. Where SLURM cannot be installed or started: a failure under CI (CI=true), a skip
    with the reason elsewhere."""
    import pytest
    cluster = SlurmCluster(root, nodes=nodes, cpus_per_node=cpus_per_node)
    try:
        cluster.__enter__()   # stops whatever it started when it fails
    except (SlurmUnavailable, OSError, subprocess.SubprocessError, TimeoutError) as err:
        reason = f"no SLURM cluster could be started here: {err}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        yield cluster
    finally:
        cluster.__exit__(None, None, None)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """Running, and not a zombie (a daemon's zombie stays until init reaps it; in a container
    init may never do so)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _terminate(pid: int, timeout: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
