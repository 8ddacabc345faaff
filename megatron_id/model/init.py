"""Deterministic initialisation, one generator per parameter.

Each parameter's initial value is drawn from a generator seeded by (global seed, parameter
name), by the module that owns it (`initial_value`). The value does not depend on the order
modules were built in or on other parameters, and it is always drawn at full size: a tensor
parallel shard draws the full tensor and keeps its slice (module.tp_partitions, set by
megatron_id.parallel), so TP=1 and TP=4 start from identical weights (Megatron's tests assert
the same property).

`initial_value` is one half of a parameter's declaration; the other, beside it on the same
module, is its role (PARAMETER_ROLES: tensor-parallel split and optimizer group, roles.py).
LanguageModel checks both when it is built, so a missing init fails there, before any weights
exist; the check below covers parts initialised on their own (pipeline stages, lone layers).
"""
from __future__ import annotations

import zlib

import torch
from torch import nn


def parameter_generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63))
    return g


@torch.no_grad()
def initialize(model: nn.Module, seed: int, prefix: str = "") -> None:
    """Initialise every parameter of `model`. `prefix` is the module's name inside the whole
    LanguageModel (e.g. "layers.3." for one pipeline-stage block), so a part initialised on its
    own gets exactly the values it would have in the whole model."""
    seen = set()   # a tied parameter (embedding = LM head) is drawn once, by its first owner
    for module_name, module in model.named_modules(prefix=prefix.rstrip(".")):
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{name}" if module_name else name
            if not hasattr(module, "initial_value"):
                raise TypeError(f"{type(module).__name__} owns parameter '{full_name}' but has no "
                                f"initial_value(); every parameter needs a declared init.")
            part = getattr(module, "tp_partitions", {}).get(name)
            shape = part.full_shape if part else tuple(param.shape)
            value = module.initial_value(name, shape, parameter_generator(seed, full_name))
            param.copy_((part.local(value) if part else value).to(param.dtype))
