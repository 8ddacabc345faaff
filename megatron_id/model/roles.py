"""What each parameter is, declared once, beside the module that creates it.

A parameter is declared on the module that builds it, in two places side by side:

    PARAMETER_ROLES     (class attribute) its Role: how tensor parallelism cuts it (`Split`)
                        and which optimizer group it joins (`Group`)
    initial_value(...)  (method) its full-size initial tensor (drawn as init.py says)

    class SwiGLU(nn.Module):
        PARAMETER_ROLES = {"w1": COLUMN_PARALLEL, "w3": COLUMN_PARALLEL, "w2": ROW_PARALLEL}

A key of PARAMETER_ROLES names one of the module's own parameters or one of its child modules;
a role given to a child covers every parameter inside it. Keys may name parts that a config
leaves out (q_proj without query readout). A role may fix one field and leave the other to
someone else: a reusable layer declares what it knows (a Linear's weight takes weight decay)
and the module that uses it declares the rest (the mixer's q_proj is column-parallel). Where
both fix the same field the owner wins (and an owner further out wins over one further in):
the mixer moves its k_norm from RMSNorm's no_decay to the SSM group. A layer used in place of
another (the parallel layers) reuses that layer's declaration.

LanguageModel checks every parameter when it is built (also on the meta device, seed None):
one without a split, a group or an initial_value is an error naming the module, the parameter
and what to declare. What reads the declarations: `parallelize` (which layers become parallel
layers, which parameters are sliced), the checkpoint split/merge and `partition_dim` (from a
model built on the meta device), the optimizer groups (training/optim.py), and the HF export
(which parameters stay float32).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from torch import nn


class Split(Enum):
    """How tensor parallelism cuts a parameter (TP ranks keep contiguous heads)."""
    COLUMN = "column-parallel"        # output features (dim 0): a Linear becomes ColumnParallelLinear
    ROW = "row-parallel"              # input features (dim 1): a Linear becomes RowParallelLinear
    HEADS = "with the heads"          # dim 0 of a per-head tensor, sliced in place (convs, log_dt, ...)
    VOCAB = "vocabulary rows"         # dim 0, padded to the TP vocabulary multiple (embedding, LM head)
    SUMMED_GRADS = "replicated, gradients summed over TP"   # a norm every rank's heads use
    REPLICATED = "replicated"

    @property
    def dim(self) -> int | None:
        """The dim a shard is cut along; None for replicated parameters."""
        return {"COLUMN": 0, "HEADS": 0, "VOCAB": 0, "ROW": 1}.get(self.name)


class Group(Enum):
    """The AdamW group (training/optim.py); the values are the groups' names."""
    DECAY = "decay"          # matrices and embeddings: weight decay
    NO_DECAY = "no_decay"    # norms and biases of the backbone
    SSM = "ssm"              # the SSM's own parameters: no decay, learning rate capped


@dataclass(frozen=True)
class Role:
    split: Split | None = None   # None: left to the owner
    group: Group | None = None

    def under(self, owner: Role) -> Role:
        """This role with every field the owner fixes replaced by the owner's."""
        return Role(self.split if owner.split is None else owner.split,
                    self.group if owner.group is None else owner.group)


# the roles declarations use; each fixes one field, or both
COLUMN_PARALLEL = Role(split=Split.COLUMN)
ROW_PARALLEL = Role(split=Split.ROW)
WITH_HEADS = Role(split=Split.HEADS)
VOCAB_ROWS = Role(split=Split.VOCAB)
REPLICATED = Role(split=Split.REPLICATED)
DECAY = Role(group=Group.DECAY)
NO_DECAY = Role(group=Group.NO_DECAY)
SSM_PER_HEAD = Role(Split.HEADS, Group.SSM)             # Delta, A, C, the SSM-input biases
SSM_SHARED_NORM = Role(Split.SUMMED_GRADS, Group.SSM)   # the SSM-input norms, shared by all heads


class UndeclaredParameterError(TypeError):
    """A parameter whose split, group or init nobody declared."""


@dataclass(frozen=True)
class _Found:
    role: Role
    module: nn.Module         # the module holding the parameter
    local_name: str           # the parameter's name inside `module`
    owner: nn.Module | None   # the module holding `module`, and its name for it
    child_name: str


def declarations(module: nn.Module) -> dict[str, Role]:
    """The module's own PARAMETER_ROLES (inherited by subclasses); {} when it declares none."""
    return getattr(type(module), "PARAMETER_ROLES", {})


def _walk(module, module_name, from_owners, owner, child_name, found):
    declared = declarations(module)
    for name, _ in module.named_parameters(recurse=False, remove_duplicate=False):
        full_name = f"{module_name}.{name}" if module_name else name
        role = declared.get(name, Role()).under(from_owners)
        found[full_name] = _Found(role, module, name, owner, child_name)
    for name, child in module.named_children():
        path = f"{module_name}.{name}" if module_name else name
        # what this module (and those above it) declare for the child covers all of its parameters
        _walk(child, path, declared.get(name, Role()).under(from_owners), module, name, found)


def _find(model: nn.Module) -> dict[str, _Found]:
    found: dict[str, _Found] = {}
    _walk(model, "", Role(), None, "", found)
    return found


def parameter_roles(model: nn.Module) -> dict[str, Role]:
    """{full parameter name: the role its declarations add up to} for every parameter of
    `model` (a tied parameter under each of its names, as in state_dict). Fields that nobody
    declared are None; `check_declarations` makes that an error."""
    return {name: found.role for name, found in _find(model).items()}


def _missing(found: _Found) -> list[str]:
    missing = [field for field in ("split", "group") if getattr(found.role, field) is None]
    if not hasattr(found.module, "initial_value"):
        missing.append("init")
    return missing


def _what_to_declare(found: _Found, missing: list[str]) -> str:
    holder = type(found.module).__name__
    todo = []
    if "split" in missing or "group" in missing:
        declared_here = declarations(found.module)
        if found.owner is not None and (not declared_here or found.local_name in declared_here):
            # a layer that declares nothing, or only its part: the rest is its owner's to say
            todo.append(f"add '{found.child_name}': <Role> to {type(found.owner).__name__}.PARAMETER_ROLES "
                        f"(e.g. COLUMN_PARALLEL; model/roles.py lists the roles)")
        else:
            todo.append(f"add '{found.local_name}': Role(split=Split..., group=Group...) to "
                        f"{holder}.PARAMETER_ROLES (e.g. SSM_PER_HEAD; model/roles.py lists the roles)")
    if "init" in missing:
        todo.append(f"give {holder} an initial_value(name, shape, generator) method (model/init.py)")
    return " and ".join(todo)


def check_declarations(model: nn.Module) -> None:
    """Raise UndeclaredParameterError naming every parameter whose split, optimizer group or
    initial value is not declared (once per omission, not once per layer)."""
    problems: dict[tuple[str, str], list[str]] = {}   # (which parameter, what is missing) -> full names
    for name, found in _find(model).items():
        missing = _missing(found)
        if missing:
            which = f"{type(found.module).__name__} '{found.local_name}'"
            what = f"has no declared {' / '.join(missing)}: {_what_to_declare(found, missing)}"
            problems.setdefault((which, what), []).append(name)
    if problems:
        lines = []
        for (which, what), names in problems.items():
            more = f"; {len(names) - 1} more like it" if len(names) > 1 else ""
            lines.append(f"parameter '{names[0]}' ({which}{more}) {what}")
        raise UndeclaredParameterError("; ".join(lines) + ".")


def names_in_group(module_class: type, group: Group) -> list[str]:
    """The names `module_class` declares in `group` (own parameters and children)."""
    return [name for name, role in module_class.PARAMETER_ROLES.items() if role.group is group]
