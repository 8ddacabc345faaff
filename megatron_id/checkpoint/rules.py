"""What a run may do with its checkpoint folders, decided before any work: where it resumes
from (`check_save_and_load`), the lock that keeps a second live run out of train.save
(`SaveLock`), and which optimizer state a checkpoint can give to the current layout.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..config import ConfigError
from .files import (
    CLIENT_STATE,
    LOCK_FILE,
    SAVE_FOLDER_ENTRIES,
    describe,
    is_checkpoint_root,
    latest_folder,
    read_client_state,
)


def check_save_and_load(save: str | None, load: str | None) -> tuple[Path | None, str | None]:
    """Decide where a run resumes from, before any work, by Megatron's habits made safe:

    - train.load names a folder with `latest`: resume from it;
    - train.load equal to train.save and no checkpoint yet: a fresh start (said in the log);
    - train.load that names nothing else: an error (a typo must not silently start from step 1);
    - train.save holding a checkpoint history is written only by a run that resumes from it
      (train.load = train.save): a run never repoints `latest` of a history it did not load;
    - train.save holding anything but our own files is refused (it is somebody else's folder).
    Returns (the root to resume from or None, a note for the log or None)."""
    save_path = Path(save).resolve() if save else None
    load_path = Path(load).resolve() if load else None
    resume, note = None, None
    if load_path is not None:
        if is_checkpoint_root(load_path):
            latest_folder(load_path)   # `latest` must name an existing folder
            resume = load_path
        elif load_path == save_path:
            note = f"no checkpoint found in {load_path}: starting from scratch"
        elif (load_path / CLIENT_STATE).is_file():
            raise ConfigError(f"train.load={load} is one checkpoint folder; train.load takes the folder "
                              f"that holds `latest` and the iter_ folders: train.load={load_path.parent}.")
        elif (load_path / "config.json").is_file():   # export-hf's output, or a transformers folder
            imported = load_path.parent / f"{load_path.name}-imported"
            raise ConfigError(f"train.load={load} is a Hugging Face folder (it holds config.json), not a train.save "
                              f"folder: import it first (megatron-id import-hf --input {load} --output {imported}), "
                              f"then train from train.load={imported}.")
        else:
            what = "does not exist" if not load_path.exists() else "holds no checkpoint (no `latest` file)"
            raise ConfigError(f"train.load={load} {what}. Give the train.save folder of an earlier run "
                              f"(it holds `latest`), or leave train.load unset to start from scratch.")
    if save_path is not None:
        if save_path.exists() and not save_path.is_dir():
            raise ConfigError(f"train.save={save} is a file, not a folder: choose a folder for checkpoints.")
        if save_path.is_dir() and resume != save_path:   # resuming into its own history is fine
            if is_checkpoint_root(save_path):
                tag = (save_path / "latest").read_text().strip()
                raise ConfigError(
                    f"train.save={save} already holds a checkpoint history (latest: {tag}) that this "
                    f"run does not resume from; writing there would replace its `latest`. To continue "
                    f"it set train.load={save}; to start a new run choose an empty train.save folder.")
            foreign = sorted(p.name for p in save_path.iterdir()
                             if p.name not in SAVE_FOLDER_ENTRIES and not p.name.startswith("iter_"))
            if foreign:
                raise ConfigError(f"train.save={save} holds files that are not checkpoints ({', '.join(foreign[:5])}"
                                  f"{', ...' if len(foreign) > 5 else ''}): a run writes checkpoints only into "
                                  f"an empty folder or its own. Choose another folder (e.g. "
                                  f"{save_path / 'checkpoints'}).")
            if not is_checkpoint_root(save_path) and any(save_path.glob("iter_*")):
                raise ConfigError(f"train.save={save} holds iter_ folders but no `latest`: they are not "
                                  f"a history this run can continue, and pruning could delete them. Move "
                                  f"them away, or restore {save_path / 'latest'} and set train.load={save}.")
    return resume, note


class SaveLock:
    """An exclusive lock on a train.save folder for the life of a run (rank 0 holds it): a
    second live run writing the same folder (a restarted job while an orphan still trains) is
    refused with the holder named. flock is released by the kernel when the process dies, so a
    killed run leaves no stale lock."""

    def __init__(self, folder):
        import fcntl
        import socket
        import time
        self.path = Path(folder) / LOCK_FILE
        self.created_folder = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.path.read_text().strip() or "unknown"
            os.close(self._fd)
            raise ConfigError(f"train.save={folder} is in use by another live run ({holder}): two runs "
                              f"writing one folder corrupt its history. Stop that run (or wait for it), "
                              f"or choose another train.save.") from None
        who = (f"host {socket.gethostname()}, pid {os.getpid()}"
               + (f", SLURM job {os.environ['SLURM_JOB_ID']}" if "SLURM_JOB_ID" in os.environ else "")
               + f", since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        os.ftruncate(self._fd, 0)
        try:
            os.write(self._fd, (who + "\n").encode())
        except OSError as err:   # (a full disk: named with the file, before any work)
            self.release()
            raise OSError(err.errno, err.strerror, str(self.path)) from None

    def release(self) -> None:
        """Drop the lock. A folder this run created and never wrote a checkpoint into (a run
        that failed early) is removed again: nothing is left behind."""
        if self._fd is None:
            return
        folder = self.path.parent
        if self.created_folder and [p.name for p in folder.iterdir()] == [LOCK_FILE]:
            self.path.unlink()
            folder.rmdir()
        os.close(self._fd)   # closing drops the flock; a kept lock file is harmless (reused)
        self._fd = None


def optimizer_state_loadable(saved: dict, current: dict) -> bool:
    """DeepSpeed can restore its optimizer files only into the layout that wrote them (the DP
    size matters only when ZeRO partitions the state over it)."""
    keys = ["tensor", "pipe", "zero_stage"] + (["data"] if current["zero_stage"] > 0 else [])
    return all(saved[k] == current[k] for k in keys)


def cross_layout_error(path: Path, saved: dict, current: dict) -> ConfigError:
    return ConfigError(
        f"checkpoint {path} was saved at {describe(saved)}; this run is {describe(current)}. "
        f"The weights can be re-sharded to this layout but its optimizer state cannot: DeepSpeed "
        f"partitions it by the saving layout, and the checkpoint has no re-shardable copy "
        f"(optim/, written by runs with train.reshardable_optimizer=true; `megatron-id "
        f"convert-checkpoint` adds it to a ZeRO-0/1/2 checkpoint). Set train.load_optimizer=false to "
        f"load the weights with fresh optimizer state (the step, data position and LR schedule "
        f"continue), or run at the saved layout to resume exactly.")


def weights_only_resume_error(path: Path, step: int) -> ConfigError:
    """A checkpoint without optimizer state (train.save_optimizer=false) past step 0, resumed with
    train.load_optimizer=true: refused, as Megatron-LM refuses a --no-save-optim checkpoint
    without --no-load-optim, since Adam would restart silently in the middle of a run."""
    return ConfigError(
        f"checkpoint {path} (step {step}) holds the weights only: it was saved with "
        f"train.save_optimizer=false, so it has no optimizer state to resume exactly. Set "
        f"train.load_optimizer=false to continue from its weights with fresh Adam state (the step, "
        f"data position and LR schedule continue), or resume from a checkpoint saved with "
        f"train.save_optimizer=true.")


def check_resume_batch(folder: Path, global_batch_size: int) -> None:
    """The data position and the LR schedule continue from step x global batch: a resume with
    another global batch would re-read or skip data. Refused before any work [our choice:
    Megatron's batch-size ramp-up is not supported]."""
    client = read_client_state(folder)
    if client.consumed_samples is None or client.step == 0:   # an import records no data position
        return
    saved = client.consumed_samples // client.step
    if saved != global_batch_size:
        raise ConfigError(f"{folder} was trained with train.global_batch_size={saved} ({client.consumed_samples} "
                          f"samples in {client.step} steps); this run has train.global_batch_size="
                          f"{global_batch_size}. Changing the global batch on resume would re-read or skip "
                          f"data: set train.global_batch_size={saved} (the micro-batch and the layout may "
                          f"change), or start a new run.")
