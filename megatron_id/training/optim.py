"""The paper's optimisation recipe: parameter groups and a learning-rate schedule in tokens.

Groups (spec section 6; AdamW), declared per parameter beside the model (PARAMETER_ROLES,
megatron_id/model/roles.py), never listed here:
  decay      matrices and embeddings: weight decay (0.1)
  no_decay   norms and biases of the backbone (1-D parameters): no weight decay
  ssm        the SSM's own parameters, i.e. the SSM-input norms and biases (k_norm, v_norm,
             k_bias, v_bias), Delta (log_dt), A (a_log, a_im), C (c_re, c_im), and the linear
             contraction vector c_vec [our choice: it reads the state as C does]:
             learning rate min(scheduled LR, ssm_lr_max) and no weight decay.
Schedule (optimizer.schedule), in tokens (not steps) so that changing the batch size keeps it:
linear warmup from 0 over `warmup_tokens`, then, with p the progress from the warmup's end to
`total_tokens` (0..1):
  cosine     min_lr + (lr - min_lr) (1 + cos(pi p)) / 2            (the paper's)
  linear     lr - (lr - min_lr) p
  constant   lr
  wsd        lr until the last `decay_fraction` of the run, then from lr to min_lr with
             q the progress through that decay: linear 1 - q, cosine (1 + cos(pi q)) / 2,
             1-sqrt 1 - sqrt(q) (Hagele et al. 2024), scaling lr - min_lr. In training the
             decay takes whole steps (round(decay_fraction x train_iters), at least 1) and a
             step's q is the progress at its end, so the first decay step is already below lr
             and the last step is at min_lr whatever the fraction [our choice; Megatron-LM's
             WSD, like the cosine here, evaluates at the step's start and never reaches min_lr]
and min_lr after `total_tokens` (lr for constant). As Megatron-LM's --lr-decay-style
(cosine / linear / constant / WSD with --lr-wsd-decay-style) and torchtitan's lr_scheduler.
The rate is a function of the tokens consumed alone, so a resume continues it exactly.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..model.roles import Group, UndeclaredParameterError, parameter_roles


def groups_by_name(model: nn.Module) -> dict[str, Group]:
    """{parameter name: its declared optimizer group} for `model` (a LanguageModel, parallelised
    or not, or the PipelineModule of a stage: the declarations travel with the modules)."""
    groups = {}
    for name, role in parameter_roles(model).items():
        if role.group is None:
            raise UndeclaredParameterError(f"parameter '{name}' has no declared optimizer group: "
                                           f"declare it in its module's PARAMETER_ROLES (model/roles.py).")
        groups[name] = role.group
    return groups


def parameter_groups(model: nn.Module, opt, named: bool = False) -> list[dict]:
    """AdamW parameter groups; each carries `name` and `max_lr` for the scheduler.
    named: give the optimizer (name, parameter) pairs, so that its state dict names its
    parameters (`param_names`, torch's own field): what lets convert-checkpoint move a ZeRO-0
    checkpoint's optimizer state to another layout."""
    group = groups_by_name(model)
    members = {g: [] for g in Group}
    for name, param in model.named_parameters():
        if param.requires_grad:
            members[group[name]].append((name, param) if named else param)
    settings = group_settings(opt)
    return [{"params": params, "name": g.value, "weight_decay": settings[g.value][0], "max_lr": settings[g.value][1]}
            for g, params in members.items() if params]


def group_settings(opt) -> dict[str, tuple[float, float]]:
    """{group name: (weight decay, max_lr)}: what each parameter group takes from `opt`."""
    return {Group.DECAY.value: (opt.weight_decay, math.inf), Group.NO_DECAY.value: (0.0, math.inf),
            Group.SSM.value: (0.0, opt.ssm_lr_max)}


def wsd_decay_steps(decay_fraction: float, train_iters: int) -> int:
    """The steps the wsd decay takes: decay_fraction of the run rounded to whole steps, at least
    one (as torchtitan's decay_ratio)."""
    return min(max(round(decay_fraction * train_iters), 1), train_iters)


def learning_rate(tokens: float, opt, total_tokens: float, tokens_per_step: float | None = None) -> float:
    """The scheduled (base) learning rate of the step that starts after `tokens` training tokens.
    tokens_per_step (the trainer gives it): wsd's decay takes whole steps, the last
    wsd_decay_steps of the run, the last of them at min_lr; without it (None) the decay is the
    continuous one over the last decay_fraction of total_tokens (the limit of tiny steps)."""
    if opt.warmup_tokens > 0 and tokens < opt.warmup_tokens:
        return opt.lr * tokens / opt.warmup_tokens
    schedule = getattr(getattr(opt, "schedule", "cosine"), "value", getattr(opt, "schedule", "cosine"))
    if schedule == "constant":
        return opt.lr
    if schedule == "wsd":
        if tokens_per_step:   # a step's rate is the decay's value at the end of the step: q = 1 on the last
            iters = math.ceil(total_tokens / tokens_per_step)
            end = iters * tokens_per_step
            decay_start = max((iters - wsd_decay_steps(opt.decay_fraction, iters)) * tokens_per_step,
                              opt.warmup_tokens)
            q = min((tokens + tokens_per_step - decay_start) / max(end - decay_start, 1), 1.0)
            if q <= 0:
                return opt.lr
        else:
            decay_start = max(total_tokens - opt.decay_fraction * total_tokens, opt.warmup_tokens)
            if tokens < decay_start:
                return opt.lr
            q = min((tokens - decay_start) / max(total_tokens - decay_start, 1), 1.0)
        factor = {"linear": 1 - q, "cosine": 0.5 * (1 + math.cos(math.pi * q)),
                  "1-sqrt": 1 - math.sqrt(q)}[opt.decay_shape]
        return opt.min_lr + (opt.lr - opt.min_lr) * factor
    decay_tokens = max(total_tokens - opt.warmup_tokens, 1)
    progress = min(max(tokens - opt.warmup_tokens, 0) / decay_tokens, 1.0)
    if schedule == "linear":
        return opt.lr - (opt.lr - opt.min_lr) * progress
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * progress))


def apply_learning_rate(optimizer, lr: float) -> None:
    """Set every group's LR: the scheduled value, capped by the group's max_lr (SSM group)."""
    for group in optimizer.param_groups:
        group["lr"] = min(lr, group.get("max_lr", math.inf))


class GuardedAdamW(torch.optim.AdamW):
    """AdamW that refuses an update whose gradients are not all finite, on any rank.

    DeepSpeed's ZeRO-1/2 optimiser already skips a step whose global gradient norm is inf/NaN
    (this step is then never called); its ZeRO-0 fp32 path and the pipeline engine without
    ZeRO would apply it and turn every weight into NaN. So every update passes here first:
    with `clip_grad` set (ZeRO-0, where DeepSpeed's own clipping is turned off) this computes
    the global gradient norm over all TP x PP x DP ranks, skips if it is not finite and clips
    otherwise; under ZeRO (clip_grad None; the gradients are this rank's partition, already
    clipped) it only checks finiteness. `updates` counts applied calls: a step during which it
    did not move was skipped.

    Loss spikes (training/spikes.py): with `loss_limit` set for a step, the mean of the losses
    observed over every rank (their sum and count ride in the same all-reduce) above it vetoes the
    update too, and `spiked` says so; `loss_factor` (a fault drill's poison, training/faults.py)
    multiplies every observed training loss of the step, before backward.

    Norm rule (as Megatron's): a TP shard counts on its own rank; a parameter replicated over
    TP counts on TP rank 0 only; every pipeline stage counts its own; data-parallel replicas
    hold the same gradients after the all-reduce, so the world-wide sum is divided by DP; a
    weight tied across pipeline stages counts on its first stage only (DeepSpeed marks the other
    copies ds_pipe_replicated).
    """

    def __init__(self, params, *, clip_grad: float | None, tp_rank: int = 0, data_parallel: int = 1, **kwargs):
        super().__init__(params, **kwargs)
        self.clip_grad, self.tp_rank, self.data_parallel = clip_grad, tp_rank, data_parallel
        self.updates, self.last_grad_norm = 0, None
        self._nonfinite_losses = None   # on the loss's device: no host sync per micro-batch
        self._loss_sum = None            # (sum, count) of the step's observed losses, same device
        self.loss_limit, self.loss_factor, self.spiked = None, 1.0, False

    def observe_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Called with each micro-batch loss: a non-finite one vetoes the next update even if
        its gradients came out finite. Evaluation (no grad) is not observed."""
        if not torch.is_grad_enabled():
            return loss
        if self.loss_factor != 1.0:
            loss = loss * self.loss_factor
        bad = (~torch.isfinite(loss.detach())).float().sum()
        self._nonfinite_losses = bad if self._nonfinite_losses is None else self._nonfinite_losses + bad
        observed = torch.stack([loss.detach().float().reshape(()), torch.ones((), device=loss.device)])
        self._loss_sum = observed if self._loss_sum is None else self._loss_sum + observed
        return loss

    def begin_step(self, loss_limit: float | None = None, loss_factor: float = 1.0) -> None:
        """The trainer calls this before each global batch: the loss above which its update is a
        spike (None: no check) and the factor on its training losses (1: none injected)."""
        self.loss_limit, self.loss_factor, self.spiked = loss_limit, loss_factor, False

    def end_of_step(self) -> None:
        """The trainer calls this after each global batch: the batch's loss veto applies to every
        step() call of that batch (one per parameter group under ZeRO; none at all when
        DeepSpeed skipped the step for a non-finite gradient norm) and to no later batch."""
        self._nonfinite_losses, self._loss_sum = None, None

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [(p, p.grad) for p in params if p.grad is not None]
        device = params[0].device if params else torch.device("cpu")
        flag = torch.zeros(3, device=device)   # summed over all ranks below; [1:]: the losses' sum, count
        if self.clip_grad is None:   # ZeRO partition: count non-finite entries
            for _, g in grads:
                flag[0] += (~torch.isfinite(g)).sum()
        else:                        # squared norm of what this rank counts
            for p, g in grads:
                if not getattr(p, "ds_pipe_replicated", False) and (
                        getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0):
                    flag[0] += g.float().pow(2).sum()
        if self._nonfinite_losses is not None:
            bad_loss = self._nonfinite_losses.to(device) > 0
            flag[0] += torch.where(bad_loss, math.inf, 0.0)   # kept for the batch's other groups:
            # DeepSpeed's ZeRO calls step() once per parameter group; end_of_step() clears it
        if self.loss_limit is not None and self._loss_sum is not None:
            flag[1:] += self._loss_sum.to(device)
        if dist.is_initialized():
            dist.all_reduce(flag)   # a NaN or inf anywhere makes the sum non-finite everywhere
        total, loss_sum, count = flag.tolist()
        if self.clip_grad is None:
            finite = total == 0
        else:
            norm = math.sqrt(total / self.data_parallel) if math.isfinite(total) else math.inf
            self.last_grad_norm = norm
            finite = math.isfinite(norm)
            if finite and self.clip_grad > 0 and norm > self.clip_grad:
                for _, g in grads:
                    g.mul_(self.clip_grad / (norm + 1e-6))
        self.spiked = finite and self.loss_limit is not None and count > 0 and loss_sum / count > self.loss_limit
        if not finite or self.spiked:
            return None
        self.updates += 1
        return super().step(closure)
