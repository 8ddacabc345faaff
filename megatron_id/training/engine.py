"""The training step on DeepSpeed's engine: tensor x data parallelism with ZeRO 0/1/2.

Status (issue 5, in progress): the plain engine (TP x DP, ZeRO 0/1/2) with checkpoints, logging,
periodic validation, activation checkpointing and `megatron-id train`. Not built yet: pipeline
stages (PipelineModule), skipping non-finite steps, loading at another TP/PP layout, the
quickstart.

    trainer = Trainer(cfg)            # torch.distributed already initialised (torchrun, srun)
    trainer.train()                   # resumes from train.load; saves to train.save

Checkpoints: `<save>/iter_0000100/` (DeepSpeed's model and ZeRO optimizer files, plus our
client state: step, evaluations done, RNG states; tokens and data position follow from step) and `<save>/latest` naming the newest complete one.
A save goes to `<save>/.incomplete/<tag>` first, is renamed into place when every rank has
written, and only then is `latest` replaced (atomically): a kill at any moment leaves `latest`
on a complete checkpoint. The last `train.keep_last` are kept. SIGTERM and SIGUSR1 (SLURM
preemption, `#SBATCH --signal=USR1@120`) finish the current step, save and exit.

Order of a step: the scheduled LR (in tokens) is applied to every group (the SSM group capped),
then `gradient_accumulation` micro-batches go through forward (bf16 autocast when
train.precision=bf16; the SSM core runs in float32 regardless), the vocab-parallel loss and
DeepSpeed's backward/step, which averages gradients over the data-parallel group, clips and
steps at the accumulation boundary. The returned loss is the mean over the global batch.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..config import Config
from ..data.gpt_dataset import PretrainingSampler, build_gpt_datasets, parse_data_path
from ..model import LanguageModel
from ..parallel import parallelize, state, vocab_parallel_cross_entropy
from .layout import deepspeed_config, training_layout
from .metrics import Metrics
from .optim import apply_learning_rate, learning_rate, parameter_groups


class Trainer:
    def __init__(self, cfg: Config):
        import deepspeed
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed first (torchrun, srun or "
                               "deepspeed.init_distributed).")
        self.cfg = cfg
        self.layout = training_layout(cfg, dist.get_world_size())   # all checks before any work
        if self.layout.pipe > 1:
            raise NotImplementedError("pipeline parallelism is not built yet (issue 5); use "
                                      "parallel.pipeline_model_parallel_size=1.")
        torch.manual_seed(cfg.seed)
        state.initialize_model_parallel(self.layout.tensor, self.layout.pipe, cfg.model)
        self.tp_group = state.get_tensor_model_parallel_group()
        model = parallelize(LanguageModel(cfg.model, seed=cfg.seed), self.tp_group,
                            sequence_parallel=cfg.parallel.sequence_parallel)
        model.activation_checkpointing = cfg.train.activation_checkpointing
        o = cfg.optimizer
        optimizer = torch.optim.AdamW(parameter_groups(model, o), lr=o.lr,
                                      betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=deepspeed_config(cfg, self.layout), mpu=state)
        self.device = getattr(self.engine, "device", "cpu")
        self.train_data = self._datasets()
        self.step, self.evaluations = 0, 0
        if cfg.train.load and (Path(cfg.train.load) / "latest").is_file():
            self.load_checkpoint(cfg.train.load)
        self._restart_sampler()
        self.stop_requested, self.saved_step = False, self.step

    @property
    def consumed_tokens(self) -> int:
        return self.step * self.layout.tokens_per_step

    def _restart_sampler(self):
        """The data position is the number of samples consumed: resuming continues the order."""
        consumed = self.step * self.layout.global_batch_size
        self.sampler = iter(PretrainingSampler(len(self.train_data), consumed, self.layout.micro_batch_size,
                                               state.get_data_parallel_rank(), self.layout.data))

    def _datasets(self):
        d = self.cfg.data
        if not d.data_path:
            raise ValueError("data.data_path is empty: give a preprocessed dataset prefix "
                             "(data.data_path=[data/my_corpus_text_document]).")
        cache = d.index_cache_dir or str(Path(parse_data_path(d.data_path)[0][1]).parent / "index-cache")
        n_train = self.layout.train_iters * self.layout.global_batch_size
        evals = self.layout.train_iters // max(self.cfg.train.eval_interval, 1) + 1
        n_valid = evals * self.cfg.train.eval_iters * self.layout.global_batch_size
        train, self.valid_data, _ = build_gpt_datasets(d.data_path, d.split, (n_train, n_valid, 0),
                                                       self.cfg.model.seq_length, self.cfg.seed, cache)
        return train

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        bf16 = self.cfg.train.precision.value == "bf16"
        with torch.autocast(device_type=batch.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = self.engine(batch[:, :-1])
        return vocab_parallel_cross_entropy(logits, batch[:, 1:], self.tp_group,
                                            self.cfg.model.vocab_size).mean()

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over train.eval_iters global batches of the validation split (None without
        one). Each evaluation reads the next batches, so successive evaluations see new data."""
        if self.valid_data is None or self.cfg.train.eval_iters < 1:
            return None
        self.engine.eval()
        per_eval = self.cfg.train.eval_iters * self.layout.global_batch_size
        start = (self.evaluations * per_eval) % max(len(self.valid_data) - per_eval + 1, 1)
        sampler = PretrainingSampler(start + per_eval, start, self.layout.micro_batch_size,
                                     state.get_data_parallel_rank(), self.layout.data)
        total, count = torch.zeros(1), 0
        for indices in sampler:
            total += self._loss(self._batch(self.valid_data, indices)).float().cpu()
            count += 1
        dist.all_reduce(total, group=state.get_data_parallel_group())
        self.engine.train()
        self.evaluations += 1
        return total.item() / (count * self.layout.data)

    def _batch(self, dataset, indices) -> torch.Tensor:
        return torch.stack([torch.from_numpy(dataset[i]) for i in indices]).to(self.device)

    def train_step(self) -> float:
        lr = learning_rate(self.consumed_tokens, self.cfg.optimizer, self.cfg.train.train_tokens)
        apply_learning_rate(self.optimizer, lr)
        self.last_lr = lr
        total = torch.zeros(1)
        for _ in range(self.layout.gradient_accumulation):
            loss = self._loss(self._batch(self.train_data, next(self.sampler)))
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach().float().cpu()
        dist.all_reduce(total, group=state.get_data_parallel_group())
        self.step += 1
        return total.item() / (self.layout.gradient_accumulation * self.layout.data)

    # ------------------------------------------------------------ the loop

    def train(self, max_steps: int | None = None) -> list[float]:
        """Train to train_iters (or max_steps more steps); save every save_interval, and at the
        end or on SIGTERM / SIGUSR1. Returns the losses of the steps run."""
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}
        losses = []
        metrics = Metrics(self.cfg, self.layout, is_logger=dist.get_rank() == 0)
        start_step = self.step
        try:
            end = self.layout.train_iters if max_steps is None else min(self.layout.train_iters, self.step + max_steps)
            while self.step < end and not self._stop_agreed():
                losses.append(self.train_step())
                metrics.step(self.step, losses[-1], self.last_lr, self.engine.get_global_grad_norm(), start_step)
                if self.step % self.cfg.train.eval_interval == 0 or self.step == end:
                    metrics.validation(self.step, self.evaluate())
                if self.cfg.train.save and self.step % self.cfg.train.save_interval == 0:
                    self.save_checkpoint(self.cfg.train.save)
            if self.cfg.train.save and self.step != self.saved_step:
                self.save_checkpoint(self.cfg.train.save)
        finally:
            metrics.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return losses

    def _request_stop(self, signum, frame):
        self.stop_requested = True

    def _stop_agreed(self) -> bool:
        """Every rank stops at the same step if any one of them was signalled."""
        flag = torch.tensor([1.0 if self.stop_requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, root) -> Path:
        root, tag = Path(root), f"iter_{self.step:07d}"
        staging = root / ".incomplete"
        rank0 = dist.get_rank() == 0
        if rank0:
            shutil.rmtree(staging / tag, ignore_errors=True)
            staging.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        client = {"step": self.step, "evaluations": self.evaluations,
                  "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                          "python": random.getstate()}}
        self.engine.save_checkpoint(str(staging), tag=tag, client_state=client, save_latest=False)
        dist.barrier()   # every rank's files are written
        if rank0:
            final = root / tag
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging / tag, final)
            tmp = root / ".latest.tmp"
            tmp.write_text(tag)
            os.replace(tmp, root / "latest")   # the commit point
            self._prune(root, keep=self.cfg.train.keep_last, current=tag)
        dist.barrier()
        self.saved_step = self.step
        return root / tag

    @staticmethod
    def _prune(root: Path, keep: int, current: str) -> None:
        tags = sorted(p.name for p in root.glob("iter_*") if p.is_dir())
        for old in tags[:-keep] if keep > 0 else []:
            if old != current:
                shutil.rmtree(root / old, ignore_errors=True)

    def load_checkpoint(self, root) -> None:
        root = Path(root)
        tag = (root / "latest").read_text().strip()
        if not (root / tag).is_dir():
            raise FileNotFoundError(f"{root}/latest names '{tag}' but {root / tag} does not exist.")
        _, client = self.engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                                load_lr_scheduler_states=False)
        if client is None:
            raise RuntimeError(f"could not load the checkpoint {root / tag}.")
        self.step = client["step"]
        self.evaluations = client.get("evaluations", 0)
        torch.set_rng_state(client["rng"]["torch"])
        np.random.set_state(client["rng"]["numpy"])
        random.setstate(client["rng"]["python"])


def init_distributed_from_env() -> None:
    """torchrun / srun / deepspeed launcher environments; gloo on CPU, nccl on GPU. A plain
    `python` start becomes a one-process group."""
    import deepspeed
    if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu" else "gloo"
    deepspeed.init_distributed(dist_backend=backend)
