"""`megatron-id train`: train with DeepSpeed, as one rank under torchrun / srun / deepspeed, or
starting the ranks of this machine itself (--nproc N: training/launcher.py)."""
from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import warnings

from ..allocator import keep_freed_memory
from ..config import ConfigError, load_config
from ..errors import UserError
from ..training.launcher import (
    check_devices,
    check_host,
    check_nproc,
    launch,
    launch_elastic,
    run_finished,
    stopped_exit_status,
)
from .options import add_config_args

# Run after main() returns, just before the process exits (see cli.entry()).
TEARDOWN: list = []


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="train with DeepSpeed (--nproc N starts N ranks here; or torchrun / srun / "
                                     "deepspeed)", allow_abbrev=False)
    add_config_args(t)
    t.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="start N ranks on this machine (one per GPU; CPU processes on CPU) with one-line errors "
                        "and the ranks' exit status; leave out under torchrun / srun")
    t.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="with --nproc and train.max_restarts > 0: this is one of N nodes, each running this "
                        "command (one srun task per node: launch/slurm/train.sbatch), joined by torch's c10d "
                        "rendezvous at --rdzv-endpoint")
    t.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="with --nnodes > 1: the rendezvous of the nodes' agents (the first node)")
    t.add_argument("--rdzv-id", default=None, metavar="ID", help="with --nnodes > 1: the run's rendezvous id "
                                                                 "(the same on every node, e.g. the job id)")
    t.set_defaults(func=run)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


# Keys whose empty override (`train.load=$CKPT` with CKPT unset) turns something off without a word
EMPTY_MEANS = {"train.load": "the run would start from step 1 instead of resuming",
               "train.save": "no checkpoint would be saved", "train.tensorboard_dir": "TensorBoard would be off",
               "train.metrics_file": "no metrics file would be written",
               "train.export_hf_at_end": "nothing would be exported at the end"}


def refuse_empty_overrides(overrides) -> None:
    """`key=` of EMPTY_MEANS, before any work: the shell gives it for an unset variable, and the
    schema reads an empty value as unset."""
    for item in overrides:
        key, _, value = str(item).partition("=")
        if key in EMPTY_MEANS and not value.strip():
            raise ConfigError(f"override '{item}' has an empty value (an unset shell variable?), so {key} would be "
                              f"unset: {EMPTY_MEANS[key]}. Give its value, or leave the override out (or write "
                              f"{key}=null) to leave it unset on purpose.")


def _choose_accelerator() -> None:
    """DeepSpeed's accelerator, unless DS_ACCELERATOR says it: CUDA where torch sees a GPU."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")


def check_nodes(args) -> None:
    if args.nnodes < 1:
        raise UserError(f"--nnodes {args.nnodes}: give the number of nodes of the run, at least 1.")
    if args.nnodes > 1 and (args.nproc is None or not args.rdzv_endpoint or not args.rdzv_id):
        raise UserError(f"--nnodes {args.nnodes}: also give --nproc (ranks per node), --rdzv-endpoint HOST:PORT (the "
                        f"first node) and --rdzv-id (the same on every node), as launch/slurm/train.sbatch does.")
    if args.nnodes == 1 and (args.rdzv_endpoint or args.rdzv_id):
        raise UserError("--rdzv-endpoint / --rdzv-id: only with --nnodes > 1 (one node finds its ranks by itself).")


def run(args) -> int:
    # SIGTERM / SIGUSR1 during the minutes of imports and setup must not kill the rank (their
    # default action): note them, and the trainer stops at its first step boundary
    early_stop = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda signum, frame: early_stop.append(signum))
    keep_freed_memory()   # glibc keeps freed blocks: ~1.5x on CPU steps (allocator.py)
    refuse_empty_overrides(args.overrides)
    if args.nproc is not None:
        check_nproc(args.nproc, nnodes=args.nnodes)
    check_nodes(args)
    # DeepSpeed calls a torch.distributed function that torch has deprecated: not the user's concern
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated")
    if args.nproc is not None:   # start the ranks of this machine (training/launcher.py)
        said = io.StringIO()   # its warnings: rank 0 says them, or this process before its error
        try:
            with contextlib.redirect_stderr(said):
                # errors: once, before any rank starts, and before torch's import (a refused
                # config takes 0.5 s, not 2)
                cfg = load_config(args.config, args.overrides)
                _choose_accelerator()
                from ..training.layout import training_layout  # torch: not at import (cli.py)
                check_devices(args.nproc)
                layout = training_layout(cfg, args.nproc * args.nnodes)   # as is a layout the ranks cannot hold
                check_host(cfg, layout, args.nproc)   # and, on CPU, more memory than the host has
                from ..training.faults import ENV, parse_faults
                from ..training.resilience import check_resilience
                check_resilience(cfg)   # (a rank's refusal would be restarted train.max_restarts times)
                parse_faults(os.environ.get(ENV, ""))
                if cfg.train.max_restarts > 0 and args.nnodes == 1:   # (job-prepare did it under SLURM)
                    from ..training.distributed import uses_cuda
                    from ..training.engine import check_run
                    check_run(cfg, layout, on_gpu=uses_cuda())   # everything rank 0 checks, here, once
        except BaseException:
            sys.stderr.write(said.getvalue())
            raise
        debug = "--debug" in sys.argv[1:]
        train_args = [*(a for c in args.config for a in ("--config", c)), *args.overrides]
        if cfg.train.max_restarts > 0 or args.nnodes > 1:   # torch.distributed.elastic's agent (training/resilience.py)
            return launch_elastic(args.nproc, train_args, cfg.train.max_restarts, debug, early=early_stop,
                                  finished=lambda: run_finished(cfg.train.save, layout.train_iters),
                                  nnodes=args.nnodes, endpoint=args.rdzv_endpoint, run_id=args.rdzv_id)
        return launch(args.nproc, train_args, debug, early=early_stop)
    cfg = load_config(args.config, args.overrides)   # config errors first, before heavy imports
    _choose_accelerator()
    # torch and DeepSpeed: not at import (cli.py)
    import torch.distributed as dist

    from ..training.distributed import init_distributed_from_env
    from ..training.engine import Trainer
    init_distributed_from_env(cfg.train.collective_timeout_minutes)
    # from here on the process ends by os._exit, an error too (a refused config after the
    # process group started aborted at teardown now and then: exit -6 instead of 2; see cli.entry)
    TEARDOWN.append(lambda: None)
    trainer, status = None, 0
    t = cfg.train
    try:
        trainer = Trainer(cfg, skip_finished=True)   # a finished run is not built again
        trainer.stop_requested = early_stop[0] if early_stop else False
        trainer.train()
        iters = trainer.layout.train_iters
        if trainer.step < iters and trainer.stop_signal:
            status = stopped_exit_status()
            if dist.get_rank() == 0:
                name = signal.Signals(trainer.stop_signal).name
                if not t.save or trainer.step == 0:
                    why = "train.save unset" if not t.save else "no step was trained"
                    saved = f"nothing saved ({why}): a rerun starts from step 1"
                else:
                    saved = (f"checkpoint {trainer._last_checkpoint()}; resume with the same command and "
                             f"train.load={t.save}")
                print(f"stopped at step {trainer.step:,} of {iters:,} ({name}): {saved} (exit {status})",
                      file=sys.stderr, flush=True)
        elif dist.get_rank() == 0 and trainer.finished_at is None:   # (else "already finished at ...")
            print(f"finished at step {trainer.step}; checkpoint: {t.save or 'not saved (train.save unset)'}; "
                  f"TensorBoard: {t.tensorboard_dir or 'off (train.tensorboard_dir unset)'}",
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        # Ctrl-C stops at once (no save, as in Megatron); say what is on disk, not only "interrupted"
        if dist.get_rank() == 0:
            where = (f"at step {trainer.step:,} of {trainer.layout.train_iters:,}; last checkpoint: "
                     f"{trainer._last_checkpoint()}" if trainer is not None else
                     "before training started: nothing was saved")
            print(f"megatron-id: interrupted (SIGINT) {where}", file=sys.stderr, flush=True)
        return 130
    finally:
        if trainer is not None:
            trainer.close()
    # every rank reaches the end before any exits; then cli.entry() ends the process without the
    # interpreter's teardown of the process group and DeepSpeed (see cli.entry)
    TEARDOWN.append(dist.barrier)
    return status
