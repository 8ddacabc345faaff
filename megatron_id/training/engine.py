"""The training step on DeepSpeed's engine: tensor x data parallelism with ZeRO 0/1/2.

Status (issue 5, in progress): this is the plain-engine core. Pipeline stages
(PipelineModule), checkpoints, logging, the `megatron-id train` command and the quickstart are
not built yet.

    trainer = Trainer(cfg)            # torch.distributed already initialised (torchrun, srun)
    for step in range(n):
        loss = trainer.train_step()   # one optimizer step over the global batch

Order of a step: the scheduled LR (in tokens) is applied to every group (the SSM group capped),
then `gradient_accumulation` micro-batches go through forward (bf16 autocast when
train.precision=bf16; the SSM core runs in float32 regardless), the vocab-parallel loss and
DeepSpeed's backward/step, which averages gradients over the data-parallel group, clips and
steps at the accumulation boundary. The returned loss is the mean over the global batch.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Config
from ..data.gpt_dataset import PretrainingSampler, build_gpt_datasets, parse_data_path
from ..model import LanguageModel
from ..parallel import parallelize, state, vocab_parallel_cross_entropy
from .layout import deepspeed_config, training_layout
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
        o = cfg.optimizer
        optimizer = torch.optim.AdamW(parameter_groups(model, o), lr=o.lr,
                                      betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=deepspeed_config(cfg, self.layout), mpu=state)
        self.train_data = self._datasets()
        self.sampler = iter(PretrainingSampler(len(self.train_data), 0, self.layout.micro_batch_size,
                                               state.get_data_parallel_rank(), self.layout.data))
        self.step, self.consumed_tokens = 0, 0

    def _datasets(self):
        d = self.cfg.data
        if not d.data_path:
            raise ValueError("data.data_path is empty: give a preprocessed dataset prefix "
                             "(data.data_path=[data/my_corpus_text_document]).")
        cache = d.index_cache_dir or str(Path(parse_data_path(d.data_path)[0][1]).parent / "index-cache")
        n_train = self.layout.train_iters * self.layout.global_batch_size
        train, _, _ = build_gpt_datasets(d.data_path, d.split, (n_train, 0, 0),
                                         self.cfg.model.seq_length, self.cfg.seed, cache)
        return train

    def _micro_batch(self) -> torch.Tensor:
        indices = next(self.sampler)
        return torch.stack([torch.from_numpy(self.train_data[i]) for i in indices])

    def train_step(self) -> float:
        lr = learning_rate(self.consumed_tokens, self.cfg.optimizer, self.cfg.train.train_tokens)
        apply_learning_rate(self.optimizer, lr)
        bf16 = self.cfg.train.precision.value == "bf16"
        device = self.engine.device if hasattr(self.engine, "device") else "cpu"
        total = torch.zeros(1)
        for _ in range(self.layout.gradient_accumulation):
            batch = self._micro_batch().to(device)
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                logits = self.engine(batch[:, :-1])
            loss = vocab_parallel_cross_entropy(logits, batch[:, 1:], self.tp_group,
                                                self.cfg.model.vocab_size).mean()
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach().float().cpu()
        dist.all_reduce(total, group=state.get_data_parallel_group())
        self.step += 1
        self.consumed_tokens += self.layout.tokens_per_step
        return total.item() / (self.layout.gradient_accumulation * self.layout.data)


def init_distributed_from_env() -> None:
    """torchrun / srun / deepspeed launcher environments; gloo on CPU, nccl on GPU."""
    import deepspeed
    backend = "nccl" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu" else "gloo"
    deepspeed.init_distributed(dist_backend=backend)
