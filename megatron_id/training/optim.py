"""The paper's optimisation recipe: parameter groups and a learning-rate schedule in tokens.

Groups (spec section 6; AdamW):
  decay      matrices and embeddings: weight decay (0.1)
  no_decay   norms and biases of the backbone (1-D parameters): no weight decay
  ssm        the SSM's own parameters, i.e. the SSM-input norms and biases (k_norm, v_norm,
             k_bias, v_bias), Delta (log_dt), A (a_log, a_im), C (c_re, c_im), and the linear
             contraction vector c_vec [our choice: it reads the state as C does]:
             learning rate min(scheduled LR, ssm_lr_max) and no weight decay.
Schedule: linear warmup over `warmup_tokens`, then cosine from lr to min_lr at `total_tokens`,
then min_lr. Tokens (not steps) so that changing the batch size keeps the schedule.
"""
from __future__ import annotations

import math

from torch import nn

SSM_PARAMETERS = {"k_norm.weight", "v_norm.weight", "k_bias", "v_bias", "log_dt", "a_log", "a_im",
                  "c_re", "c_im", "c_vec"}


def group_of(name: str, param) -> str:
    tail2 = ".".join(name.split(".")[-2:])
    if name.split(".")[-1] in SSM_PARAMETERS or tail2 in SSM_PARAMETERS:
        return "ssm"
    return "no_decay" if param.dim() < 2 else "decay"


def parameter_groups(model: nn.Module, opt) -> list[dict]:
    """AdamW parameter groups; each carries `name` and `max_lr` for the scheduler."""
    members = {"decay": [], "no_decay": [], "ssm": []}
    for name, param in model.named_parameters():
        if param.requires_grad:
            members[group_of(name, param)].append(param)
    settings = {"decay": (opt.weight_decay, math.inf), "no_decay": (0.0, math.inf),
                "ssm": (0.0, opt.ssm_lr_max)}
    return [{"params": params, "name": g, "weight_decay": settings[g][0], "max_lr": settings[g][1]}
            for g, params in members.items() if params]


def learning_rate(tokens: float, opt, total_tokens: float) -> float:
    """The scheduled (base) learning rate after `tokens` training tokens."""
    if opt.warmup_tokens > 0 and tokens < opt.warmup_tokens:
        return opt.lr * tokens / opt.warmup_tokens
    decay_tokens = max(total_tokens - opt.warmup_tokens, 1)
    progress = min(max(tokens - opt.warmup_tokens, 0) / decay_tokens, 1.0)
    return opt.min_lr + 0.5 * (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * progress))


def apply_learning_rate(optimizer, lr: float) -> None:
    """Set every group's LR: the scheduled value, capped by the group's max_lr (SSM group)."""
    for group in optimizer.param_groups:
        group["lr"] = min(lr, group.get("max_lr", math.inf))
