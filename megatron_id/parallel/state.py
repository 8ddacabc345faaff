"""Process groups for tensor x pipeline x data parallelism, and the `mpu` DeepSpeed expects.

The layout is DeepSpeed's PipeModelDataParallelTopology with axes (pipe, data, model): the
model (tensor) axis varies fastest, so consecutive ranks are TP peers (on one node, sharing
NVLink), and a PipelineModule built later sees the same grid. Every group is created on every
rank in the same order (torch.distributed requires it).

    from megatron_id.parallel import state
    state.initialize_model_parallel(tensor_model_parallel_size=2)
    deepspeed.initialize(..., mpu=state)          # this module is the mpu

Problems with the sizes are raised by the layout validator (parallel/layout.py) before any
group is created; this module needs only the sizes, not the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .layout import check_sizes


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


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1) -> None:
    global _GROUPS
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised "
                           "first (torchrun / deepspeed.init_distributed).")
    world, rank = dist.get_world_size(), dist.get_rank()
    data = check_sizes(world, tensor_model_parallel_size, pipeline_model_parallel_size)
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
