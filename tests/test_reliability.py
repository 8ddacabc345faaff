"""Training runs that fail safely (issue 10): bad configs and folders refused before any work,
checkpoints verified against their manifest, a lock on train.save, stale staging cleaned, a
hung rank that ends the job, and launcher signals that reach the workers."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bad_inputs import refused, run_module
from conftest import CONFIGS, ROOT
from distributed import run_distributed

from megatron_id.config import load_config

TINY = str(CONFIGS / "model" / "tiny.yaml")


def train_items(prefix, *extra):
    return [f"data.data_path=[{prefix}]", "data.split=100,0,0", "model.vocab_size=50257",
            "train.zero_stage=0", "train.precision=fp32", "train.micro_batch_size=2",
            "train.global_batch_size=2", "train.train_tokens=256", "optimizer.warmup_tokens=0",
            "train.eval_iters=0", *extra]


def train_command(*items):
    return ["megatron_id.cli", "train", "--config", TINY, *items]


def _save_two_steps(rank, world, items):
    from megatron_id.training.engine import Trainer
    trainer = Trainer(load_config([TINY], items))
    trainer.train(max_steps=2)
    trainer.close()
    return trainer.step


@pytest.fixture(scope="module")
def history(fineweb_prefix, tmp_path_factory):
    """A train.save folder with one committed checkpoint (iter_0000002)."""
    ckpt = tmp_path_factory.mktemp("history") / "ckpt"
    assert run_distributed(_save_two_steps, 1, args=(train_items(fineweb_prefix, f"train.save={ckpt}"),),
                           timeout=300) == [2]
    return ckpt


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------ the battery: configs and folders

CONFIG_CASES = [
    (["train.sav=x"], r"unknown config key 'train.sav'.*Did you mean 'save'"),
    (["optimizer.lr=-1e-3"], r"optimizer.lr=-0.001 is invalid: it must be a positive number"),
    (["optimizer.adam_beta2=1.5"], r"optimizer.adam_beta2=1.5 is invalid"),
    (["optimizer.weight_decay=-0.1"], r"optimizer.weight_decay=-0.1 is invalid"),
    (["optimizer.min_lr=1"], r"optimizer.min_lr=1.0 is invalid: it must be between 0 and optimizer.lr"),
    (["train.collective_timeout_minutes=0"], r"train.collective_timeout_minutes=0.0 is invalid"),
    (["train.zero_stage=5"], r"train.zero_stage=5 is invalid"),
    (["parallel.tensor_model_parallel_size=2"], r"(world|tensor).*2"),
    (["train.global_batch_size=3"], r"train.global_batch_size=3 must be a positive multiple"),
    (["model.vocab_size=512"], r"token id 50256 .*model.vocab_size=512"),   # GPT-2 data, vocab forgotten
    (["data.split=0,100,0"], r"data.split=0,100,0 leaves no training documents"),
    (["data.data_path=[/nonexistent/corpus_text_document]"], r"/nonexistent/corpus_text_document"),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra,mention", CONFIG_CASES, ids=[c[0][0] for c in CONFIG_CASES])
def test_bad_config_is_refused_in_one_line(fineweb_prefix, tmp_path, extra, mention):
    items = train_items(fineweb_prefix, f"train.save={tmp_path / 'ckpt'}")
    items = [i for i in items if i.split("=")[0] not in {e.split("=")[0] for e in extra}] + extra
    refused(train_command(*items), mention=mention, unchanged=[tmp_path])


@pytest.mark.slow
def test_a_mistyped_train_load_does_not_start_from_scratch(fineweb_prefix, tmp_path, history):
    refused(train_command(*train_items(fineweb_prefix, f"train.load={history}-typo",
                                       f"train.save={tmp_path / 'new'}")),
            mention=r"train.load=.*-typo does not exist.*leave train.load unset", unchanged=[tmp_path])


@pytest.mark.slow
def test_a_new_run_never_takes_over_an_existing_history(fineweb_prefix, tmp_path, history):
    ckpt = _copy(history, tmp_path / "ckpt")
    refused(train_command(*train_items(fineweb_prefix, f"train.save={ckpt}")),
            mention=r"already holds a checkpoint history \(latest: iter_0000002\).*train.load=",
            unchanged=[tmp_path])
    other = _copy(history, tmp_path / "other")   # loading from elsewhere does not make it ours either
    refused(train_command(*train_items(fineweb_prefix, f"train.save={ckpt}", f"train.load={other}")),
            mention=r"already holds a checkpoint history", unchanged=[tmp_path])


@pytest.mark.slow
def test_a_resume_with_another_global_batch_is_refused(fineweb_prefix, tmp_path, history):
    """The data position is step x global batch: another global batch would re-read or skip data."""
    ckpt = _copy(history, tmp_path / "ckpt")
    items = [i for i in train_items(fineweb_prefix, f"train.save={ckpt}", f"train.load={ckpt}")
             if not i.startswith(("train.global_batch_size", "train.micro_batch_size"))]
    refused(train_command(*items, "train.micro_batch_size=2", "train.global_batch_size=4"),
            mention=r"trained with train.global_batch_size=2 \(4 samples in 2 steps\).*set train.global_batch_size=2",
            unchanged=[tmp_path])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["foreign-files", "is-a-file", "iter-folder-as-load", "latest-dangling",
                                  "orphan-iter-folders"])
def test_folders_that_are_not_ours_are_refused(fineweb_prefix, tmp_path, history, case):
    save = tmp_path / "ckpt"
    extra, mention = [f"train.save={save}"], None
    if case == "foreign-files":
        save.mkdir()
        (save / "notes.txt").write_text("my notes")
        mention = r"holds files that are not checkpoints \(notes.txt\)"
    elif case == "is-a-file":
        save.write_text("x")
        mention = r"is a file, not a folder"
    elif case == "iter-folder-as-load":
        ckpt = _copy(history, tmp_path / "old")
        extra.append(f"train.load={ckpt / 'iter_0000002'}")
        mention = r"is one checkpoint folder; train.load takes the folder that holds `latest`"
    elif case == "latest-dangling":
        _copy(history, save)
        (save / "latest").write_text("iter_0000009")
        extra.append(f"train.load={save}")
        mention = r"latest names 'iter_0000009' but .* does not exist"
    else:
        _copy(history, save)
        (save / "latest").unlink()
        mention = r"holds iter_ folders but no `latest`"
    refused(train_command(*train_items(fineweb_prefix, *extra)), mention=mention, unchanged=[tmp_path])


@pytest.mark.slow
def test_a_flipped_byte_in_a_shard_is_refused_with_the_file_named(fineweb_prefix, tmp_path, history):
    ckpt = _copy(history, tmp_path / "ckpt")
    shard = ckpt / "iter_0000002" / "mp_rank_00_model_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    # (a longer run, so that it resumes: a rerun of the finished run says so without loading; its
    # decay moves, which a resume takes only with train.override_scheduler=true)
    refused(train_command(*train_items(fineweb_prefix, f"train.save={ckpt}", f"train.load={ckpt}",
                                       "train.train_tokens=512", "train.override_scheduler=true")),
            mention=r"mp_rank_00_model_states.pt does not match its sha256", unchanged=[tmp_path])
    done = run_module("megatron_id.cli", ["check-checkpoint", str(ckpt)])
    assert done.returncode != 0 and "DAMAGED" in done.stderr and "mp_rank_00_model_states.pt" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("megatron-id: error: 1 of 1 checkpoint folders")
    done = run_module("megatron_id.cli", ["check-checkpoint", str(history)])
    assert done.returncode == 0 and f"ok {history / 'iter_0000002'}" in done.stdout, done.stderr


def test_verify_checkpoint_names_truncated_missing_and_unlisted_files(tmp_path):
    from megatron_id.checkpoint.integrity import manifest_entries, verify_checkpoint, write_manifest
    folder = tmp_path / "iter_0000001"
    folder.mkdir()
    for name, size in [("a.pt", 100), ("b.pt", 50), ("c.pt", 10)]:
        (folder / name).write_bytes(bytes(range(size)))
    write_manifest(folder, manifest_entries(folder, ["a.pt", "b.pt", "c.pt"]))
    assert verify_checkpoint(folder) == []
    (folder / "a.pt").write_bytes(bytes(range(99)))
    (folder / "b.pt").unlink()
    (folder / "d.pt").write_bytes(b"new")
    problems = verify_checkpoint(folder)
    assert len(problems) == 3, problems
    assert "a.pt has 99 bytes, the manifest says 100" in problems[0]
    assert "b.pt is missing" in problems[1] and "d.pt is not listed" in problems[2]


@pytest.mark.slow
def test_a_second_live_run_cannot_write_the_same_folder(fineweb_prefix, tmp_path, history):
    from megatron_id.checkpoint.rules import SaveLock
    ckpt = _copy(history, tmp_path / "ckpt")
    lock = SaveLock(ckpt)   # a live run (this process) holds it
    try:
        refused(train_command(*train_items(fineweb_prefix, f"train.save={ckpt}", f"train.load={ckpt}")),
                mention=rf"train.save={ckpt} is in use by another live run \(host .*, pid {os.getpid()}",
                unchanged=[tmp_path])
    finally:
        lock.release()


@pytest.mark.slow
def test_fresh_start_note_stale_staging_removed_and_resume_into_the_same_folder(fineweb_prefix, tmp_path):
    """Megatron's habit train.load = train.save: the first run starts from scratch and says so;
    a killed save's staging folder is removed and reported; the second run resumes."""
    ckpt = tmp_path / "ckpt"
    (ckpt / ".incomplete" / "iter_0000007").mkdir(parents=True)
    (ckpt / ".incomplete" / "iter_0000007" / "partial.pt").write_bytes(b"half")
    items = train_items(fineweb_prefix, f"train.save={ckpt}", f"train.load={ckpt}", "train.train_tokens=128")
    done = run_module("megatron_id.cli", ["train", "--config", TINY, *items])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"no checkpoint found in {ckpt}: starting from scratch" in done.stderr
    assert f"removed {ckpt / '.incomplete' / 'iter_0000007'}, left by an interrupted save" in done.stderr
    assert not (ckpt / ".incomplete").exists() and (ckpt / "latest").read_text() == "iter_0000001"
    done = run_module("megatron_id.cli", ["train", "--config", TINY, *items[:-1], "train.train_tokens=256",
                                          "train.override_scheduler=true"])   # a longer run: its decay moves
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps 2-2" in done.stderr and (ckpt / "latest").read_text() == "iter_0000002"


# ------------------------------------------------------------ hangs and launcher signals

def _workers(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the worker processes torchrun started."""
    out = {}
    for child in subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True,
                                text=True).stdout.split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = int(child)
    return out


def _torchrun(items, log: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "megatron_id.cli", "train", "--config", TINY, *items]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_for_step(proc, log: Path, step: int, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f"step {step}/" in log.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended (exit {proc.returncode}) before step {step}:\n"
                                 + log.read_text()[-3000:])
        time.sleep(0.2)
    raise TimeoutError(f"waited {timeout} s for step {step}")


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"waited {timeout} s for {what}")


def _kill_all(proc, workers):
    """torchrun starts its workers in sessions of their own: kill them by pid, then torchrun."""
    for pid in list(workers.values()) + [proc.pid]:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    proc.wait(timeout=30)


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout(fineweb_prefix, tmp_path):
    """SIGSTOP on rank 1 mid-run: rank 0's collective times out after
    train.collective_timeout_minutes (here 15 s); it names rank 1, kills it (it is on this
    host; torchrun would give the stopped process 30 s more) and exits non-zero."""
    log = tmp_path / "log"
    items = train_items(fineweb_prefix, "train.train_tokens=1000000", "train.log_interval=1",
                        "train.global_batch_size=4", "train.collective_timeout_minutes=0.25")
    proc, workers = _torchrun(items, log), {}
    try:
        _wait_for_step(proc, log, 3)
        workers = _workers(proc.pid)
        os.kill(workers[1], signal.SIGSTOP)
        stopped = time.monotonic()
        proc.wait(timeout=15 + 30 + 30)
        elapsed = time.monotonic() - stopped
    finally:
        _kill_all(proc, workers)
    text = log.read_text()
    assert proc.returncode != 0
    assert elapsed <= 15 + 30, elapsed
    assert "did not complete within train.collective_timeout_minutes=0.25 (15 s)" in text, text[-3000:]
    assert "Stopped responding: rank 1 (host" in text and "rank 0 (host" not in text, text[-3000:]
    assert "killed (a stopped rank holds its launcher back)" in text
    print(f"stopped rank: job ended {elapsed:.1f} s after the SIGSTOP")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_to_torchrun_makes_every_worker_save_and_stop(fineweb_prefix, tmp_path, sig):
    """SIGTERM: torchrun forwards it. SIGUSR1: torchrun has no handler and dies; its workers
    get SIGTERM from the kernel (PR_SET_PDEATHSIG) instead of training on as orphans. Either
    way every worker saves a checkpoint and exits, and the folder is free for the next run."""
    from megatron_id.checkpoint.rules import SaveLock
    log, ckpt = tmp_path / "log", tmp_path / "ckpt"
    items = train_items(fineweb_prefix, "train.train_tokens=1000000", "train.log_interval=1",
                        "train.global_batch_size=4", f"train.save={ckpt}", "train.save_interval=100000")
    proc, workers = _torchrun(items, log), {}
    try:
        _wait_for_step(proc, log, 3)
        workers = _workers(proc.pid)
        assert sorted(workers) == [0, 1]
        os.kill(proc.pid, sig)
        _wait_for(lambda: all(not Path(f"/proc/{pid}").exists() or
                              Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
                              for pid in workers.values()), 90, "the workers to exit")
        proc.wait(timeout=30)
    finally:
        _kill_all(proc, workers)
    text = log.read_text()
    step = int((ckpt / "latest").read_text().removeprefix("iter_"))
    assert step >= 3, text[-2000:]
    assert (ckpt / f"iter_{step:07d}" / "manifest.json").is_file()
    # rank 0 says the run stopped early, where, and how to resume; workers exit 3 (a plain run)
    assert re.search(rf"stopped at step {step:,} of 3,907 \(SIG(TERM|USR1)\): checkpoint {ckpt}/iter_{step:07d}",
                     text), text[-2000:]
    assert f"resume with the same command and train.load={ckpt} (exit 3)" in text
    SaveLock(ckpt).release()   # nobody holds the folder any more


# ------------------------------------------------------------ issue 52: room for the checkpoints, before step 1

def _build_with_free_space(rank, world, items, free):
    """Trainer() with the file system of train.save said to have `free` bytes: the refusal's
    message, or None and (the bytes of its step-1 checkpoint on disk) after one step and a save."""
    import megatron_id.checkpoint.space as space
    from megatron_id.errors import DiskFullError
    from megatron_id.training.engine import Trainer
    space.free_bytes = lambda folder: free
    try:
        trainer = Trainer(load_config([TINY], items))
    except DiskFullError as err:
        return str(err), err.exit_status, None
    try:
        trainer.train(max_steps=1)
        folder = Path(trainer.cfg.train.save) / "iter_0000001"
        return None, None, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    finally:
        trainer.close()


def test_a_disk_too_small_for_a_checkpoint_is_refused_before_step_1(fineweb_prefix, tmp_path, capfd):
    """It was found at the first save, after every step before it. The estimate (DeepSpeed's
    files sized as a save sizes them, plus Adam's moments that exist only after step 1) is
    checked against the checkpoint then written."""
    save = tmp_path / "ckpt"
    items = train_items(fineweb_prefix, f"train.save={save}", "train.train_tokens=512", "train.save_interval=1")
    message, status, _ = run_distributed(_build_with_free_space, 1, args=(items, 30 * 2**20), timeout=300)[0]
    assert status == 1 and re.match(
        rf"no space left on device for a checkpoint of this run in train.save={save}: one needs about "
        r"(?P<needed>[\d,]+) bytes \(75.\d MiB\), 31,457,280 bytes \(30.0 MiB\) free there. Refused before step 1: "
        r"nothing was trained or written. Free space there, set train.save to a folder with room, or save weights "
        r"only \(train.save_optimizer=false: about 25.\d MiB each; they resume with train.load_optimizer=false, Adam "
        r"afresh\)\.$", message), message
    assert not save.exists()   # nothing left behind (the lock's folder is removed again)
    needed = int(re.search(r"one needs about ([\d,]+) bytes", message)[1].replace(",", ""))
    # room for one but not for the 4 kept at once (train.keep_last=3, and the one being written): a warning
    message, _, written = run_distributed(_build_with_free_space, 1, args=(items, 2 * needed), timeout=300)[0]
    assert message is None and abs(written - needed) < 0.01 * needed, (written, needed)
    assert re.search(rf"warning: train.save={save} has 15\d.\d MiB free and this run will hold up to 4 more "
                     r"checkpoints there at once \(train.keep_last=3 with one more while each new one is written\), "
                     r"about 30\d.\d MiB: a later save will fail", capfd.readouterr().err)
