"""Process groups for tensor x pipeline x data parallelism, and the `mpu` DeepSpeed expects.

The layout is DeepSpeed's PipeModelDataParallelTopology with axes (pipe, data, model): the
model (tensor) axis varies fastest, so consecutive ranks are TP peers (on one node, sharing
NVLink), and a PipelineModule built later sees the same grid. Every group is created on every
rank in the same order (torch.distributed requires it).

    from megatron_id.parallel import state
    state.initialize_model_parallel(tensor_model_parallel_size=2)
    deepspeed.initialize(..., mpu=state)          # this module is the mpu

Problems with the sizes are raised by `check_parallel_sizes` before any group is created.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..errors import UserError


class ParallelConfigError(UserError, ValueError):
    """A parallel layout that cannot work, with the numbers and the fix."""


@dataclass
class _Groups:
    topology: object
    tensor: object
    data: object
    pipe: object
    tensor_ranks: list
    data_ranks: list
    pipe_ranks: list


_GROUPS: _Groups | None = None


def check_parallel_sizes(world_size: int, tensor: int, pipe: int = 1, model_cfg=None) -> int:
    """Validate a layout before any computation; return the data-parallel size."""
    if tensor < 1 or pipe < 1:
        raise ParallelConfigError(f"tensor ({tensor}) and pipeline ({pipe}) parallel sizes must be >= 1.")
    if world_size % (tensor * pipe):
        raise ParallelConfigError(
            f"world size {world_size} does not factor into TP={tensor} x PP={pipe} x DP: "
            f"{world_size} is not a multiple of {tensor * pipe}. Launch a multiple of "
            f"{tensor * pipe} processes or change parallel.tensor_model_parallel_size / "
            f"parallel.pipeline_model_parallel_size.")
    if model_cfg is not None:
        from .tensor_parallel import check_divisibility
        check_divisibility(model_cfg, tensor)
    return world_size // (tensor * pipe)


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1, model_cfg=None) -> None:
    global _GROUPS
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised "
                           "first (torchrun / deepspeed.init_distributed).")
    world, rank = dist.get_world_size(), dist.get_rank()
    data = check_parallel_sizes(world, tensor_model_parallel_size, pipeline_model_parallel_size,
                                model_cfg)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    topo = PipeModelDataParallelTopology(num_pp=pipeline_model_parallel_size,
                                         num_mp=tensor_model_parallel_size, num_dp=data)
    mine = {}
    for axis in ("model", "data", "pipe"):
        for ranks in topo.get_axis_comm_lists(axis):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[axis] = (group, ranks)
    _GROUPS = _Groups(topo, mine["model"][0], mine["data"][0], mine["pipe"][0],
                      mine["model"][1], mine["data"][1], mine["pipe"][1])


def model_parallel_is_initialized() -> bool:
    return _GROUPS is not None


def destroy_model_parallel() -> None:
    global _GROUPS
    _GROUPS = None


def _groups() -> _Groups:
    if _GROUPS is None:
        raise RuntimeError("model parallel groups are not initialised: call "
                           "megatron_id.parallel.state.initialize_model_parallel first.")
    return _GROUPS


def get_topology():
    return _groups().topology


# --- the mpu interface (Megatron and DeepSpeed names; "model parallel" = tensor parallel) ---
def get_tensor_model_parallel_group():
    return _groups().tensor


def get_tensor_model_parallel_world_size() -> int:
    return len(_groups().tensor_ranks)


def get_tensor_model_parallel_rank() -> int:
    return _groups().tensor_ranks.index(dist.get_rank())


def get_tensor_model_parallel_src_rank() -> int:
    return _groups().tensor_ranks[0]


def get_data_parallel_group():
    return _groups().data


def get_data_parallel_world_size() -> int:
    return len(_groups().data_ranks)


def get_data_parallel_rank() -> int:
    return _groups().data_ranks.index(dist.get_rank())


def get_pipe_parallel_group():
    return _groups().pipe


def get_pipe_parallel_world_size() -> int:
    return len(_groups().pipe_ranks)


def get_pipe_parallel_rank() -> int:
    return _groups().pipe_ranks.index(dist.get_rank())


get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank
get_pipeline_model_parallel_group = get_pipe_parallel_group
get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
get_pipeline_model_parallel_rank = get_pipe_parallel_rank
