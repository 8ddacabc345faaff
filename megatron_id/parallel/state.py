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
    data: object                 # DeepSpeed's data-parallel group: DP x CP ranks
    pipe: object
    tensor_ranks: list
    data_ranks: list
    pipe_ranks: list
    context: object = None       # the CP ranks sharing this rank's samples (consecutive in `data`)
    context_ranks: list = None
    context_size: int = 1


_GROUPS: _Groups | None = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1) -> None:
    """Context parallelism lives inside DeepSpeed's data axis (gradients are averaged over DP x CP,
    as Megatron's "dp-cp" group): its C consecutive members share samples, one block each."""
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
    cp = context_parallel_size
    if len(mine["data"][1]) % cp:
        raise ValueError(f"context_parallel_size={cp} does not divide the data axis ({len(mine['data'][1])} ranks)")
    _GROUPS.context_ranks = [rank]
    for ranks in (topo.get_axis_comm_lists("data") if cp > 1 else []):
        for i in range(0, len(ranks), cp):
            members = ranks[i:i + cp]
            group = dist.new_group(members)
            if rank in members:
                _GROUPS.context, _GROUPS.context_ranks, _GROUPS.context_size = group, members, cp


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


def get_context_parallel_group():
    return _groups().context


def get_context_parallel_world_size() -> int:
    return _groups().context_size


def get_context_parallel_rank() -> int:
    return _groups().context_ranks.index(dist.get_rank())


def get_sample_parallel_rank() -> int:
    """Which share of the samples this rank reads: its data-parallel rank without CP."""
    return get_data_parallel_rank() // _groups().context_size


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
