"""Multi-query associative recall (MQAR) as a training data source: `data.source=mqar`.

The synthetic task of Zoology (Arora et al. 2023, "Zoology: measuring and improving recall in
efficient language models"), which separates mixers by how much of the context their state
keeps. Each sequence (model.seq_length + 1 tokens) opens with `num_pairs` key-value pairs, then
asks `num_queries` of those keys again at random places in the rest, each followed by its value;
every other position holds the filler token 0:

    k1 v1 k2 v2 ... kN vN  0 0 k7 v7 0 k2 v2 0 0 0 k5 v5 ...

Keys are ids 1 .. num_keys (distinct within a sequence), values num_keys + 1 .. num_keys +
num_values (distinct within a sequence), so a model that ignores the context can do no better
than 1 / num_values on an answer. The loss counts only the answers: the positions whose input is
a key asked after the pairs, whose label is that key's value (as Zoology's -100 labels elsewhere).

A sample is a function of (seed, split, index) only: any sample can be drawn alone, in any
order, so a resumed run (which restarts the sampler at the consumed samples) reads the same
batches, and the train / valid / test splits never share a sequence's random stream.

Across windows (`data.mqar.query_window=N`, for data.carry_state; training/carry.py): an episode
spans N + 1 windows of the training window W (model.seq_length / train.carry_grad_windows). The
pairs open its first window, the queries lie in window N (past its first 2 x num_pairs
positions), filler between; its last token is the end-of-document id (1 + num_keys +
num_values), so a carried state restarts at the next episode. Each row of the global batch
reads its own stream of episodes (`MQARStreams`): with the state carried, the queries can be
answered from the pairs N windows back; with every window read alone (data.carry_state=false,
the same windows) they cannot, and the accuracy stays at chance.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UserError

SPLITS = {"train": 0, "valid": 1, "test": 2}
FILLER = 0


class MQARConfigError(UserError, ValueError):
    """data.mqar settings that cannot make a sequence."""


@dataclass(frozen=True)
class MQARTask:
    seq_length: int        # the model's context; a sample holds seq_length + 1 tokens
    num_pairs: int
    num_queries: int
    num_keys: int
    num_values: int
    query_window: int = 0  # across windows: the queries this many windows after the pairs (0: one sequence)
    window: int = 0        # the training window W of an episode (0: seq_length)

    @classmethod
    def from_config(cls, mqar, seq_length: int, vocab_size: int | None = None, window: int = 0) -> "MQARTask":
        task = cls(seq_length, int(mqar.num_pairs), int(mqar.num_queries), int(mqar.num_keys), int(mqar.num_values),
                   int(getattr(mqar, "query_window", 0)), window if getattr(mqar, "query_window", 0) else 0)
        task.check(vocab_size)
        return task

    @classmethod
    def of_run(cls, cfg) -> "MQARTask":
        """The task a training config runs: its window is the one each forward reads
        (model.seq_length / train.carry_grad_windows), which an episode across windows spans."""
        return cls.from_config(cfg.data.mqar, cfg.model.seq_length, cfg.model.vocab_size,
                               window=cfg.model.seq_length // max(int(cfg.train.carry_grad_windows), 1))

    @property
    def eod(self) -> int:
        """The id that ends an episode (across windows only)."""
        return 1 + self.num_keys + self.num_values

    @property
    def episode_tokens(self) -> int:
        return (self.query_window + 1) * (self.window or self.seq_length)

    @property
    def first_value(self) -> int:
        return 1 + self.num_keys

    @property
    def vocab_needed(self) -> int:
        return 1 + self.num_keys + self.num_values + (1 if self.query_window else 0)

    @property
    def chance(self) -> float:
        """The best accuracy without the context: a value guessed among num_values."""
        return 1.0 / self.num_values

    def check(self, vocab_size: int | None = None) -> None:
        """Every rule, each naming the key and the fix (before any work)."""
        rules = [("data.mqar.num_pairs", self.num_pairs, self.num_pairs >= 1, "at least 1"),
                 ("data.mqar.num_queries", self.num_queries, 1 <= self.num_queries <= self.num_pairs,
                  f"from 1 to data.mqar.num_pairs ({self.num_pairs}): each query asks a different key"),
                 ("data.mqar.num_keys", self.num_keys, self.num_keys >= self.num_pairs,
                  f"at least data.mqar.num_pairs ({self.num_pairs}): the keys of a sequence are distinct"),
                 ("data.mqar.num_values", self.num_values, self.num_values >= self.num_pairs,
                  f"at least data.mqar.num_pairs ({self.num_pairs}): the values of a sequence are distinct")]
        for key, value, ok, valid in rules:
            if not ok:
                raise MQARConfigError(f"{key}={value} is out of range: it must be {valid}.")
        if self.query_window < 0:
            raise MQARConfigError(f"data.mqar.query_window={self.query_window} is out of range: it must be 0 (one "
                                  f"sequence) or the number of windows between the pairs and the queries.")
        if self.query_window and self._episode_slots() < self.num_queries:
            need = 2 * self.num_pairs + 2 * self.num_queries + 1
            raise MQARConfigError(
                f"data.mqar.query_window={self.query_window}: the window of {self.window or self.seq_length} tokens "
                f"(model.seq_length / train.carry_grad_windows) is too short for num_pairs={self.num_pairs} and "
                f"num_queries={self.num_queries}: the queries' window needs at least {need}; raise "
                f"model.seq_length or lower the counts.")
        slots = (self.seq_length + 1 - 2 * self.num_pairs) // 2
        if not self.query_window and slots < self.num_queries:
            need = 2 * self.num_pairs + 2 * self.num_queries - 1
            raise MQARConfigError(
                f"model.seq_length={self.seq_length} is too short for data.mqar.num_pairs={self.num_pairs} and "
                f"num_queries={self.num_queries}: a sequence needs at least {need} tokens of context "
                f"(2 per pair, 2 per query); raise model.seq_length or lower the counts.")
        if vocab_size is not None and vocab_size < self.vocab_needed:
            raise MQARConfigError(
                f"model.vocab_size={vocab_size} is too small for data.mqar: ids 0 (filler), 1..{self.num_keys} "
                f"(keys) and {self.first_value}..{self.vocab_needed - 1} (values) need {self.vocab_needed}; raise "
                f"model.vocab_size or lower data.mqar.num_keys / num_values.")

    def sample(self, seed: int, split: str, index: int) -> np.ndarray:
        """Sample `index` of `split` for `seed`: int64 [seq_length + 1]."""
        rng = np.random.default_rng([seed, SPLITS[split], index])
        n, q = self.num_pairs, self.num_queries
        keys = 1 + rng.choice(self.num_keys, n, replace=False)
        values = self.first_value + rng.choice(self.num_values, n, replace=False)
        tokens = np.full(self.seq_length + 1, FILLER, dtype=np.int64)
        tokens[0:2 * n:2], tokens[1:2 * n:2] = keys, values
        slots = (self.seq_length + 1 - 2 * n) // 2           # places for a (query, answer) pair
        where = 2 * n + 2 * np.sort(rng.choice(slots, q, replace=False))
        asked = rng.choice(n, q, replace=False)
        tokens[where], tokens[where + 1] = keys[asked], values[asked]
        return tokens

    def _episode_slots(self) -> int:
        """(query, answer) places in the queries' window: past its first 2 x num_pairs positions
        (where answer_mask looks), the answer before the window's last token."""
        return ((self.window or self.seq_length) - 1 - 2 * self.num_pairs) // 2

    def episode(self, seed: int, split: str, row: int, index: int) -> np.ndarray:
        """Episode `index` of `row`'s stream (query_window > 0): int64 [episode_tokens], its
        last token the end-of-document id."""
        rng = np.random.default_rng([seed, SPLITS[split], row, index, 7])
        n, q, W = self.num_pairs, self.num_queries, self.window or self.seq_length
        keys = 1 + rng.choice(self.num_keys, n, replace=False)
        values = self.first_value + rng.choice(self.num_values, n, replace=False)
        tokens = np.full(self.episode_tokens, FILLER, dtype=np.int64)
        tokens[0:2 * n:2], tokens[1:2 * n:2] = keys, values
        where = self.query_window * W + 2 * n + 2 * np.sort(rng.choice(self._episode_slots(), q, replace=False))
        asked = rng.choice(n, q, replace=False)
        tokens[where], tokens[where + 1] = keys[asked], values[asked]
        tokens[-1] = self.eod
        return tokens

    def stream(self, seed: int, split: str, row: int, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of `row`'s stream of episodes."""
        E = self.episode_tokens
        first, last = start // E, (start + count - 1) // E
        joined = np.concatenate([self.episode(seed, split, row, e) for e in range(first, last + 1)])
        return joined[start - first * E:start - first * E + count]

    def answer_mask(self, inputs: torch.Tensor) -> torch.Tensor:
        """[B, N] float: 1 where the input is a key asked after the pairs (its label is the answer).
        A function of the inputs alone, so it is found again on any slice of a batch."""
        positions = torch.arange(inputs.shape[-1], device=inputs.device)
        if self.query_window:   # the position in its window (a sample starts at a window's start)
            positions = positions % (self.window or self.seq_length)
        is_key = (inputs >= 1) & (inputs <= self.num_keys)
        return (is_key & (positions >= 2 * self.num_pairs)).float()


class MQARStreams:
    """query_window > 0: `rows` streams of episodes, read as StreamOrder reads documents: index i
    (what PretrainingSampler hands out) is step i // rows of row i % rows, tokens
    [step x seq_length, (step + 1) x seq_length] of that row's stream. When a sample is one
    window, row r's stream starts r % (query_window + 1) windows in: the rows are at every phase
    of their episodes, so every step holds answers (not one in query_window + 1); when a sample
    holds whole episodes (carried windows), every row starts at its first episode's start."""

    def __init__(self, task: MQARTask, num_samples: int, seed: int, rows: int, split: str = "train"):
        self.task, self.seed, self.rows, self.split = task, seed, rows, split
        self.steps = num_samples // rows

    def __len__(self) -> int:
        return self.steps * self.rows

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        step, row = divmod(int(i), self.rows)
        n, window = self.task.seq_length, self.task.window or self.task.seq_length
        phase = row % (self.task.query_window + 1) if window == n else 0
        return self.task.stream(self.seed, self.split, row, step * n + phase * window, n + 1)


class MQARDataset:
    """`num_samples` generated samples of one split, indexed like the GPT dataset."""

    def __init__(self, task: MQARTask, num_samples: int, seed: int, split: str = "train"):
        self.task, self.num_samples, self.seed, self.split = task, num_samples, seed, split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} of {self.num_samples}")
        return self.task.sample(self.seed, self.split, int(i))


@torch.no_grad()
def score(model, task: MQARTask, seed: int, samples: int, batch_size: int = 64, device="cpu",
          split: str = "test", carry: bool = True) -> dict:
    """Accuracy (argmax == the value) and the answers' mean loss over `samples` sequences of
    `split`; `model(inputs)` returns logits [B, N, V]. Across windows (query_window > 0) a
    sample is an episode: read whole with carry (the state carried through its windows is the
    same function: training/carry.py), else each window alone, as a model trained without
    data.carry_state reads them."""
    correct, total, loss = 0, 0, 0.0
    for start in range(0, samples, batch_size):
        count = min(start + batch_size, samples) - start
        if task.query_window:
            batch = np.stack([task.episode(seed, split, start + i, 0) for i in range(count)])
        else:
            batch = np.stack([task.sample(seed, split, start + i) for i in range(count)])
        tokens = torch.from_numpy(batch).to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        mask = task.answer_mask(inputs).bool()
        if task.query_window and not carry:
            W = task.window or task.seq_length
            logits = torch.cat([model(piece).float() for piece in inputs.split(W, dim=1)], dim=1)
        else:
            logits = model(inputs).float()
        picked, answers = logits[mask], labels[mask]
        correct += int((picked.argmax(-1) == answers).sum())
        loss += float(torch.nn.functional.cross_entropy(picked, answers, reduction="sum"))
        total += int(mask.sum())
    return {"accuracy": correct / total, "answer_loss": loss / total, "answers": total, "samples": samples,
            "chance": task.chance}


def check_mqar_run(cfg, layout) -> None:
    """data.source=mqar before training: the task can make a sequence, and nothing in the config
    expects files or a tokenizer the generated data does not have."""
    d = cfg.data
    conflicts = [(bool(d.data_path), f"data.data_path={list(d.data_path)}", "remove it: the samples are generated"),
                 (bool(d.valid_sets), f"data.valid_sets ({', '.join(d.valid_sets)})",
                  "remove them: validation is the task's own held-out stream"),
                 (bool(cfg.train.export_hf_at_end), f"train.export_hf_at_end={cfg.train.export_hf_at_end}",
                  "remove it: an MQAR model has no tokenizer to ship"),
                 (layout.pipe > 1, f"parallel.pipeline_model_parallel_size={layout.pipe}",
                  "use 1: the answers' loss mask is not passed between pipeline stages"),
                 (any((d.reset_attention_mask, d.reset_position_ids, d.eod_mask_loss)),
                  "a packed-document switch (data.reset_attention_mask / reset_position_ids / eod_mask_loss)",
                  "turn it off: the sequences have no end-of-document token")]
    for present, what, fix in conflicts:
        if present:
            raise MQARConfigError(f"data.source=mqar does not go with {what}: {fix}.")
    MQARTask.of_run(cfg)
