"""data.carry_state: each row's fixed state carried from one training window to the next
(truncated backpropagation through time, as recurrent language models were trained).

A fixed-state mixer (interdomain, S4D) reads a document longer than its window when the state
it reached at the end of one window enters the next. What a row carries (`RowStates`):

    layers         every layer's state, as LanguageModel.forward(return_states=True) returns it
                   (the complex S4D state [B, H, M, P] and the short convs' last K-1 inputs)
    position       [B] the next token's position in its document (RoPE's, counted across windows)
    ends_document  [B] the window ended with the end-of-document token: the next window's first
                   token starts a new document, so that row's state is zeroed before it

Inside a window the packed-document rules hold as with data.reset_attention_mask and
data.reset_position_ids (both implied): the state and the convs restart at every document
start, positions count from it. A row's first window starts from zero.

`window_model_inputs` gives a window's seq_idx / position_ids and zeroes the state of the rows
that start a document; `carried_forward` runs a sequence as consecutive windows (the gradient
reaches through all of them, or stops at each boundary with detach=True). One forward of a whole
document and the same document in windows with the state carried compute the same function
(tests/test_carry.py, to 1e-10 in float64, every form of the core).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .documents import document_index


@dataclass
class RowStates:
    layers: list[dict] | None         # None: every row starts from zero (the first window)
    position: torch.Tensor            # [B] int64
    ends_document: torch.Tensor       # [B] bool

    @classmethod
    def fresh(cls, rows: int, device=None) -> "RowStates":
        return cls(None, torch.zeros(rows, dtype=torch.long, device=device),
                   torch.ones(rows, dtype=torch.bool, device=device))

    def detached(self) -> "RowStates":
        """The same values without their history (the gradient stops at this boundary)."""
        return RowStates(None if self.layers is None else [_map_state(s, lambda t: t.detach()) for s in self.layers],
                         self.position, self.ends_document)


def _map_state(state: dict, fn) -> dict:
    """fn on every tensor of one layer's state ({'ssm', 'conv': {name: tail}, 'pos', 'tables'})."""
    out = dict(state)
    if state.get("ssm") is not None:
        out["ssm"] = fn(state["ssm"])
    out["conv"] = {name: fn(tail) for name, tail in state.get("conv", {}).items()}
    out["tables"] = None   # the decode loop's parameter tables: never carried between windows
    return out


def keep_rows(states: list[dict], keep: torch.Tensor) -> list[dict]:
    """Each layer's state with the rows where `keep` [B] is False zeroed (a where(), not a
    product: a non-finite value of an ended document cannot leak into the next)."""
    def masked(t):
        return torch.where(keep.view(-1, *[1] * (t.dim() - 1)), t, torch.zeros((), dtype=t.dtype, device=t.device))
    return [_map_state(s, masked) for s in states]


def window_model_inputs(tokens: torch.Tensor, eod_id: int, carried: RowStates) -> tuple[dict, RowStates]:
    """For input tokens [B, N] of the window after `carried`: the model's keyword arguments
    (states, seq_idx, position_ids) and what to carry into the window after this one (its
    `layers` filled in by the forward)."""
    seq_idx, positions = document_index(tokens, eod_id)
    continues = ~carried.ends_document
    offset = torch.where(continues, carried.position, 0)
    position_ids = positions + torch.where(seq_idx == 0, offset[:, None], 0)
    states = None if carried.layers is None else keep_rows(carried.layers, continues)
    after = RowStates(None, position_ids[:, -1] + 1, tokens[:, -1] == eod_id)
    return {"states": states, "seq_idx": seq_idx, "position_ids": position_ids}, after


def carried_forward(model, tokens: torch.Tensor, eod_id: int, carried: RowStates, windows: int = 1,
                    detach: bool = False, split=None, **forward_kwargs) -> tuple[torch.Tensor, RowStates]:
    """The logits of input tokens [B, N] run as `windows` consecutive windows of N / windows
    tokens, each starting from the state the previous one left (the first from `carried`).
    Returns (logits [B, N, V], what the last window leaves). detach: the gradient stops at every
    window boundary (it always stops at the returned state's: detach it before the next step).
    split: context parallelism's cut of a window [B, n, ...] into this rank's block (the
    documents are found on the whole window); the logits are then this rank's blocks, in order."""
    if tokens.shape[1] % windows:
        raise ValueError(f"{tokens.shape[1]} tokens do not split into {windows} equal windows")
    outputs = []
    for piece in tokens.chunk(windows, dim=1):
        if detach:
            carried = carried.detached()
        kwargs, after = window_model_inputs(piece, eod_id, carried)
        if split is not None:
            piece = split(piece)
            kwargs.update(seq_idx=split(kwargs["seq_idx"]), position_ids=split(kwargs["position_ids"]))
        logits, after.layers = model(piece, return_states=True, **kwargs, **forward_kwargs)
        outputs.append(logits)
        carried = after
    return torch.cat(outputs, dim=1), carried


# ------------------------------------------------------------ in the trainer

CARRIED_FILE = "carried_state_rank{:05d}.pt"
LOAD_KEY = "train.load_carried_state"   # false: a resume starts every row from zero, on purpose


def check_carry_layout(cfg, layout) -> None:
    """data.carry_state against the rest of the run, before any work (training/layout.py): every
    setting it cannot run with is named, not only the first."""
    from ..config import ConfigError, DataSource
    from ..model.pattern import layer_mixer
    d, t, m = cfg.data, cfg.train, cfg.model
    if not d.carry_state:
        if t.carry_grad_windows != 1:
            raise ConfigError(f"train.carry_grad_windows={t.carry_grad_windows} splits each row into windows "
                              f"with the state carried between them: set data.carry_state=true, or leave it at 1.")
        return
    softmax = sorted({layer_mixer(m, i) for i in range(m.n_layers)} & {"softmax", "sliding"})
    mixer = getattr(m.mixer, "value", m.mixer)
    mixers = f"model.layer_pattern={m.layer_pattern}" if m.layer_pattern else f"model.mixer={mixer}"
    window = m.seq_length // max(t.carry_grad_windows, 1)
    given = getattr(cfg, "given_keys", None) or frozenset()
    # (refused?, the setting, why): a list, so that every reason that applies is named
    why = [
        (t.carry_grad_windows < 1 or m.seq_length % max(t.carry_grad_windows, 1),
         f"train.carry_grad_windows={t.carry_grad_windows}",
         f"it must be >= 1 and divide model.seq_length={m.seq_length} into equal windows"),
        (bool(softmax), f"{'/'.join(softmax)} layers ({mixers})",
         "their state is a KV cache that grows with every window; carry runs interdomain and S4D layers "
         "(letters I and S)"),
        (layout.pipe > 1, f"parallel.pipeline_model_parallel_size={layout.pipe}",
         "the carried state would have to stay with each stage's layers; use TP x DP"),
        (layout.context > 1 and window % layout.context,
         f"parallel.context_parallel_size={layout.context} with train.carry_grad_windows={t.carry_grad_windows}",
         f"each window of {window} tokens splits into {layout.context} equal blocks; use a window divisible by it"),
        (d.source == DataSource.mqar and not d.mqar.query_window, "data.source=mqar and data.mqar.query_window=0",
         "the classic task's sequences are independent; set data.mqar.query_window=N for episodes whose queries "
         "come N windows after their pairs"),
        (d.source == DataSource.gpt and len(d.data_path) > 1,   # (a weight, a prefix, ...)
         "a blend of several data.data_path prefixes", "a row's stream comes from one dataset; give one prefix"),
        (any(len(path) > 1 for path in d.valid_sets.values()), "a blend in data.valid_sets",
         "each validation row's stream comes from one dataset; give one prefix"),
        (t.distill.teacher is not None, "train.distill", "the teacher would need the same carried state"),
        (t.activation_checkpointing, "train.activation_checkpointing=true",
         "a block recomputed in the backward would run without its carried state"),
        (t.compile, "train.compile=true", "the compiled forward takes no carried state"),
    ]
    # the carried state restarts at every document and positions count from it: a switch set
    # to false on purpose would be overridden without a word
    why += [(f"data.{key}" in given and not getattr(d, key), f"data.{key}=false",
             "carrying the state implies it (a document's state and positions restart at its first token); "
             f"remove data.{key}") for key in ("reset_attention_mask", "reset_position_ids")]
    refused = [f"{setting}: {reason}" for bad, setting, reason in why if bad]
    if refused:
        raise ConfigError(f"data.carry_state=true cannot run with {'; nor with '.join(refused)}.")


def carried_eod_id(cfg) -> int:
    """The token that starts a row's state over (a document's end): the generated task's EOD for
    data.source=mqar, else the data's (an error naming the sidecar and the fix when unknown)."""
    from ..config import ConfigError, DataSource
    if cfg.data.source == DataSource.mqar:
        from ..data.mqar import MQARTask
        eod, given = MQARTask.of_run(cfg).eod, cfg.data.eod_token_id
        if given is not None and given != eod:   # the task writes its own: a given id would be ignored
            raise ConfigError(f"data.eod_token_id={given} is not what data.source=mqar ends its episodes with: the "
                              f"task's end-of-document id is {eod} (1 + data.mqar.num_keys + num_values), and "
                              f"data.carry_state restarts each row's state there. Remove data.eod_token_id.")
        return eod
    from .documents import resolve_eod_id
    return resolve_eod_id(cfg.data, "data.carry_state needs")


class CarriedRows:
    """The state every row of this rank's micro-batches carries into the next step: one
    RowStates per micro-batch of the step (micro-batch m of every step continues the same rows:
    StreamOrder keeps each row's stream in its place of the global batch)."""

    def __init__(self, micro_batches: int, rows: int, eod_id: int, windows: int):
        self.eod_id, self.windows, self.rows = eod_id, windows, rows
        self.states = [RowStates.fresh(rows) for _ in range(micro_batches)]
        self.next = 0   # the micro-batch of the step that runs next
        self.restarted = 0   # rows restarted because their state was not finite

    def fresh(self) -> "CarriedRows":
        """The same rows from zero (a validation round starts its rows this way)."""
        return CarriedRows(len(self.states), self.rows, self.eod_id, self.windows)

    def forward(self, model, tokens: torch.Tensor, split=None, **forward_kwargs) -> torch.Tensor:
        """The model's output for this micro-batch's input tokens, from and into its rows' state
        (split: context parallelism's, see carried_forward)."""
        m = self.next
        carried = self.states[m]
        if carried.position.device != tokens.device:
            carried = RowStates(carried.layers, carried.position.to(tokens.device),
                                carried.ends_document.to(tokens.device))
        out, after = carried_forward(model, tokens, self.eod_id, carried, self.windows, split=split,
                                     **forward_kwargs)
        self.states[m] = self._finite(after.detached())
        self.next = (m + 1) % len(self.states)
        return out

    def _finite(self, carried: RowStates) -> RowStates:
        """A row whose state is not finite (a step the guard will skip) starts its next window from
        zero, as at a document start, instead of carrying the NaN on."""
        finite = torch.ones(self.rows, dtype=torch.bool, device=carried.position.device)
        for layer in carried.layers:
            for t in [layer["ssm"], *layer["conv"].values()]:
                finite &= torch.isfinite(torch.view_as_real(t) if t.is_complex() else t).flatten(1).all(1)
        if bool(finite.all()):
            return carried
        self.restarted += int((~finite).sum())
        return RowStates(keep_rows(carried.layers, finite), torch.where(finite, carried.position, 0),
                         carried.ends_document | ~finite)

    def split_like_outputs(self, x: torch.Tensor, split) -> torch.Tensor:
        """x [B, N] (labels, a loss mask) cut as forward(split=...) cuts the outputs: each
        window's block of this rank, in order."""
        return x if split is None else torch.cat([split(w) for w in x.chunk(self.windows, dim=1)], dim=1)

    def state_dict(self, layout: dict) -> dict:
        """What a checkpoint keeps of this rank's rows (plain tensors: loads with weights_only)."""
        def plain(carried: RowStates) -> dict:
            layers = None if carried.layers is None else [
                {"ssm": s["ssm"].cpu(), "conv": {k: v.cpu() for k, v in s["conv"].items()}, "pos": int(s["pos"])}
                for s in carried.layers]
            return {"layers": layers, "position": carried.position.cpu(),
                    "ends_document": carried.ends_document.cpu()}
        return {"layout": {**layout, "windows": self.windows}, "next": self.next,
                "states": [plain(c) for c in self.states]}

    def load_state_dict(self, saved: dict, layout: dict, path, device) -> None:
        """Rows continue from a checkpoint's; saved at another layout they cannot (each rank's
        rows and heads are its own): refused with the reason (check_carried_resume refuses it
        first, before any work; this is for a file that disagrees with its checkpoint)."""
        from ..config import ConfigError
        differ = layout_differences(saved["layout"], layout)
        if differ:
            raise ConfigError(f"{path} holds the carried state of every row (data.carry_state) for another layout "
                              f"({differ}): each rank's rows and heads are its own. Resume at the saved layout, "
                              f"or set {LOAD_KEY}=false to start every row from zero.")

        def restore(plain: dict) -> RowStates:
            layers = None if plain["layers"] is None else [
                {"ssm": s["ssm"].to(device), "conv": {k: v.to(device) for k, v in s["conv"].items()},
                 "pos": s["pos"], "tables": None} for s in plain["layers"]]
            return RowStates(layers, plain["position"].to(device), plain["ends_document"].to(device))
        self.states, self.next = [restore(p) for p in saved["states"]], saved["next"]


# ------------------------------------------------------------ resuming

def rows_layout(layout) -> dict:
    """What decides which rows and heads each rank's carried state holds (training_layout's
    Layout): a checkpoint's carried state continues only at the same."""
    return {"tensor": layout.tensor, "data": layout.data, "micro_batch_size": layout.micro_batch_size,
            "gradient_accumulation": layout.gradient_accumulation,
            "world": layout.tensor * layout.pipe * layout.data * layout.context}


def layout_differences(saved: dict, now: dict) -> str:
    """'data: saved 1, now 2, ...' for each key of rows_layout that differs; '' when none.
    train.carry_grad_windows ("windows", recorded too) may change: the state a row reaches at the
    end of its sample is the same in any number of windows, only the gradient's reach differs."""
    keys = sorted((set(saved) | set(now)) - {"windows"})
    return ", ".join(f"{k}: saved {saved.get(k)}, now {now.get(k)}" for k in keys if saved.get(k) != now.get(k))


def check_carried_resume(folder: Path, cfg, layout) -> None:
    """A resume continues the rows of the checkpoint in `folder` as they were (check_run: rank 0,
    before any work, so that one line stops every rank). Refused, naming what would change and
    the key to accept it (train.load_carried_state=false), when this run's data.carry_state is
    not the checkpoint's (the carried state would be dropped, or every row start from zero, and
    the data order change), when the rows or heads would sit on other ranks, or when another
    train.train_tokens cuts the data into other streams."""
    from ..checkpoint.files import read_client_state
    from ..config import ConfigError, DataSource
    client = read_client_state(folder)
    if not cfg.train.load_carried_state or client.data is None or not client.step:
        return   # accepted on purpose; or no data position to continue (an import, a conversion, step 0)
    saved, now = bool(client.data.get("carry_state")), bool(cfg.data.carry_state)
    resumes = f"train.load resumes {folder} (step {client.step:,})"
    shuffled, streams = "shuffled windows", "each row's stream of consecutive windows"
    if saved and not now:
        raise ConfigError(f"{resumes}, trained with data.carry_state=true, and this run has data.carry_state=false: "
                          f"the state every row carried would be dropped and the data order would change from "
                          f"{streams} to {shuffled} (samples re-read or skipped). Set data.carry_state=true to "
                          f"continue the run as it was, or {LOAD_KEY}=false to go on without it on purpose.")
    if now and not saved:
        raise ConfigError(f"{resumes}, trained without data.carry_state, and this run has data.carry_state=true: "
                          f"the data order would change from {shuffled} to {streams} (samples re-read or "
                          f"skipped), every row starting from a zero state. Set data.carry_state=false to continue "
                          f"the run as it was, or {LOAD_KEY}=false to start carrying the state here on purpose.")
    if not now:
        return
    changes = []
    iters = client.data.get("train_iters")
    if cfg.data.source == DataSource.gpt and iters is not None and iters != layout.train_iters:
        # StreamOrder: row r reads the samples from r x (the run's steps) on
        changes.append(f"this run's train.train_tokens={cfg.train.train_tokens:,} makes {layout.train_iters:,} steps "
                       f"where the checkpoint's run had {iters:,}, and row r's stream starts r x the run's steps "
                       f"into the data: every row but the first would go on in another place of the data, with "
                       f"the state of the last (and samples would be re-read or skipped)")
    try:   # (mapped: only the layout record is read)
        saved_layout = torch.load(folder / CARRIED_FILE.format(0), map_location="cpu", weights_only=True,
                                  mmap=True)["layout"]
    except Exception:   # none (the load says every row starts from zero) or damaged (the load's check names it)
        saved_layout = None
    if saved_layout is not None:
        differ = layout_differences(saved_layout, rows_layout(layout))
        if differ:
            changes.append(f"its carried state is for another layout ({differ}): each rank's rows and heads are "
                           f"its own")
    if changes:
        raise ConfigError(f"{resumes}, whose rows carried their state (data.carry_state), and this run cannot "
                          f"continue them: {'; '.join(changes)}. Resume with the checkpoint's settings, or set "
                          f"{LOAD_KEY}=false to start every row from a zero state on purpose.")
