"""``nccl_ub`` / ``fsdp_manual_registration``: Megatron-FSDP's NCCL user buffers, on the engine's pool.

With ``--use-nccl-ub`` Megatron-FSDP allocates its parameter and gradient buffers
from a memory pool registered with the NCCL communicators of its data-parallel
groups (the dense ``dp_cp`` / ``intra_dp_cp`` and ``inter_dist_opt`` groups, and
``expt_dp`` with experts), at once or, with ``fsdp_manual_registration`` (which
0.19's ``--use-nccl-ub`` turns on), when Megatron-LM calls
``param_and_grad_buffer.manual_buffer_registration()`` after the first iteration.
Here the pool is :class:`shardwise.engine.nccl_buffers.NcclUserBuffers`, handed to
``fully_shard`` as the chunk's collectives, registered with the data-parallel axes
of the chunk's meshes. On gloo (CPU) NCCL has nothing to register: the option is
accepted, logged once as having no effect there, and the buffers stay with
PyTorch's allocator (the numbers are the same either way).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .meshes import EXPERT_AXIS, INNER_AXIS, OUTER_AXIS

__all__ = ["user_buffers", "register_manually"]

logger = logging.getLogger("shardwise.megatron.mcore_fsdp_adapter")  # the face's one logger

_DATA_PARALLEL_AXES = (OUTER_AXIS, INNER_AXIS, EXPERT_AXIS)


def _data_parallel_groups(meshes: Sequence[Optional[DeviceMesh]]) -> list:
    """The process groups of the meshes' data-parallel axes (what the engine's collectives run over)."""
    return [mesh.get_group(name) for mesh in meshes if mesh is not None
            for name in mesh.mesh_dim_names if name in _DATA_PARALLEL_AXES]


def user_buffers(ddp_config: Any, meshes: Sequence[Optional[DeviceMesh]], face: str):
    """The chunk's collectives for ``nccl_ub``: an ``NcclUserBuffers`` over the meshes' data-parallel groups on
    NCCL, registered now unless ``fsdp_manual_registration``; ``None`` (the default collectives) without
    ``nccl_ub``, or on another backend, where one INFO line says it has no effect."""
    if not getattr(ddp_config, "nccl_ub", False):
        return None
    manual = bool(getattr(ddp_config, "fsdp_manual_registration", False))
    groups = _data_parallel_groups(meshes)
    if meshes[0].device_type != "cuda":
        backend = dist.get_backend(groups[0]) if groups else "single-process"
        logger.info("%s: nccl_ub=True%s has no effect on the %s backend: NCCL user-buffer registration needs "
                    "NCCL; the buffers come from PyTorch's allocator and the numbers are the same", face,
                    " (fsdp_manual_registration=True)" if manual else "", backend)
        return None
    from ..engine.nccl_buffers import NcclUserBuffers

    symmetric = not getattr(ddp_config, "disable_symmetric_registration", False)
    try:
        return NcclUserBuffers(groups, register_now=not manual, symmetric=symmetric)
    except RuntimeError as error:
        if "not supported in this NCCL version" not in str(error):
            raise
        # measured on an H200 with torch 2.11.0+cu130 (NCCL 2.28.9): its ProcessGroupNCCL has no ncclMemAlloc
        # allocator; the run goes on with PyTorch's allocator, as it would without the flag
        logger.warning("%s: nccl_ub=True, but this PyTorch's NCCL cannot allocate registered buffers (%s): the "
                       "buffers come from PyTorch's allocator, unregistered; the numbers are the same", face, error)
        return None


def register_manually(ddp_config: Any, buffers) -> None:
    """``param_and_grad_buffer.manual_buffer_registration()``: register the pool now (on NCCL), once.

    Megatron-LM calls it after the first iteration under ``--use-nccl-ub`` (0.19) or
    ``--use-nccl-ub --fsdp-manual-registration`` (0.16); anywhere else it is an error, as in
    Megatron-FSDP. On a backend without NCCL there is nothing to register.
    """
    if not (getattr(ddp_config, "nccl_ub", False) and getattr(ddp_config, "fsdp_manual_registration", False)):
        raise RuntimeError(
            "param_and_grad_buffer.manual_buffer_registration() needs nccl_ub=True and fsdp_manual_registration=True "
            "(--use-nccl-ub, and --fsdp-manual-registration in 0.16); got nccl_ub="
            f"{getattr(ddp_config, 'nccl_ub', None)!r}, fsdp_manual_registration="
            f"{getattr(ddp_config, 'fsdp_manual_registration', None)!r}")
    if buffers is not None:
        buffers.register()
