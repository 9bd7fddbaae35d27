"""``FullyShardedDataParallelV2``: the engine's hooks do everything; unsupported options are rejected by name
(:mod:`shardwise.megatron.options` decides which)."""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Type

import torch
import torch.nn as nn

from .base import (
    check_module,
    warn_if_not_megatron_fsdp,
    _check_strategies,
    _default_unit_types,
    _device_type,
    _has_expert_params,
    _mixed_precision,
    _model_parallel_sizes,
    _placements,
    _present,
    _ShardedDataParallel,
    _unbuilt_model_parallelism,
    logger,
)
from .config import DistributedDataParallelConfig, TransformerConfig, as_ddp_config, as_transformer_config
from .context_parallel import check_context_parallel
from .grads import check_grads_finite, wire_megatron_grads
from .meshes import _build_dense_mesh, _build_expert_mesh_and_placements, _check_model_groups
from .parallelism import annotate_tensor_parallelism, mark_tensor_parallel
from .options import V2, asks_graph_safe, check_options
from .process_groups import ProcessGroupCollection, group_size

__all__ = ["FullyShardedDataParallelV2"]


def _reject(field: str, value, why: str) -> ValueError:
    return ValueError(f"FullyShardedDataParallelV2 does not support {field}={value!r}: {why}")


class FullyShardedDataParallelV2(_ShardedDataParallel):
    """MFSDP v2 wrapper: the engine's hooks gather, reduce and finalize; the sync calls are no-ops."""

    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        fsdp_unit_modules: Optional[List[Type[nn.Module]]] = None,
        disable_bucketing: bool = False,
        device: Optional[torch.device] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        """Initialize the MFSDP v2 wrapper.

        Args:
            config: Transformer configuration for the model.
            ddp_config: Data-parallel and sharding configuration.
            module: Root model module to shard.
            fsdp_unit_modules: Module types to shard as child FSDP units. If
                unspecified, transformer, MoE transformer, and Mamba layers are used.
            disable_bucketing: Compatibility argument that must remain False.
            device: Device whose type is used to build the data-parallel mesh
                (default: CUDA with NCCL, else CPU).
            pg_collection: Explicit process groups; ``dp_cp`` defines the
                data-parallel mesh, ``tp`` its tensor-parallel axis, ``ep`` and
                ``expt_dp`` the expert mesh. The model must be built with the same
                ``tp`` / ``ep`` groups.

        Raises:
            ValueError: A required process group is missing, a group disagrees with
                the config or the mesh, or the configuration requests a feature V2
                does not support (the message names the field).
        """
        check_module(module, "FullyShardedDataParallelV2")
        self._validate_config(config, ddp_config, module, pg_collection, disable_bucketing)
        super().__init__(config=config, module=module)
        cfg, ddp = as_transformer_config(config), as_ddp_config(ddp_config)
        self.ddp_config = ddp_config
        logger.info("Setting up FullyShardedDataParallelV2 with config %s", ddp)
        warn_if_not_megatron_fsdp(ddp, "FullyShardedDataParallelV2")
        device_type = _device_type(device)
        hybrid = ddp.num_distributed_optimizer_instances > 1
        self.mesh = _build_dense_mesh(pg_collection, hybrid, device_type)
        self._grad_check_groups = (pg_collection.dp_cp, getattr(pg_collection, "tp", None))
        self.moe_mesh, expert_placements = _build_expert_mesh_and_placements(cfg, ddp, pg_collection, device_type, module)
        tp = group_size(getattr(pg_collection, "tp", None))
        if tp > 1:
            unknown = mark_tensor_parallel(module, annotate_tensor_parallelism(module))
            if unknown:
                logger.warning(
                    "tensor_model_parallel_size=%d: the tensor-parallel layout of %s is unknown; they are "
                    "treated as replicated over the TP ranks (initialized from TP rank 0)", tp, unknown,
                )
        _check_model_groups(module, getattr(pg_collection, "tp", None), getattr(pg_collection, "ep", None),
                            getattr(pg_collection, "expt_tp", None))
        if fsdp_unit_modules is None:
            fsdp_unit_modules = _present(module, _default_unit_types())
        self.fsdp_unit_modules = list(fsdp_unit_modules)
        self._shard(
            mesh=self.mesh,
            placements=_placements(ddp, hybrid),
            unit_types=self.fsdp_unit_modules,
            policy=_mixed_precision(cfg, ddp, ddp_config, module),
            init_on_meta=cfg.init_model_with_meta_device,
            prefetch=True,
            expert_mesh=self.moe_mesh,
            expert_placements=expert_placements,
            graph_safe=asks_graph_safe(ddp_config),
        )
        wire_megatron_grads(self.sharded_model, config, ddp_config)

    @staticmethod
    def _validate_config(config, ddp_config, module: nn.Module, pg_collection, disable_bucketing: bool = False) -> None:
        """Validate that the model and configuration are supported by MFSDP v2.

        Raises:
            ValueError: naming the field, for a missing process group or an
                unsupported feature, topology or data-parallel option.
        """
        cfg, ddp = as_transformer_config(config), as_ddp_config(ddp_config)
        check_options(V2, config, ddp_config, dict(disable_bucketing=disable_bucketing, pg_collection=pg_collection))
        if getattr(pg_collection, "dp_cp", None) is None:
            raise ValueError("FullyShardedDataParallelV2 needs pg_collection.dp_cp, the data-parallel process group")
        if cfg.pipeline_model_parallel_size != 1:
            raise _reject("pipeline_model_parallel_size", cfg.pipeline_model_parallel_size,
                          "composing FSDP with pipeline parallelism is not built yet")
        size = group_size(getattr(pg_collection, "pp", None))
        if size != 1:
            raise ValueError(f"FullyShardedDataParallelV2 needs pg_collection.pp of size 1, got {size}: "
                             "composing FSDP with pipeline parallelism is not built yet")
        check_context_parallel("FullyShardedDataParallelV2", cfg.context_parallel_size, pg_collection, module)
        sizes = _model_parallel_sizes(cfg, pg_collection)
        unbuilt = _unbuilt_model_parallelism(sizes, module)
        if unbuilt is not None:
            raise _reject(*unbuilt)
        if sizes.ep > 1:
            if getattr(pg_collection, "expt_dp", None) is None:
                raise ValueError(
                    f"expert_model_parallel_size={sizes.ep} needs pg_collection.expt_dp (expert data parallel)"
                )
            if not _has_expert_params(module):
                raise ValueError(
                    f"expert_model_parallel_size={sizes.ep} but the model has no MoE layers "
                    "(no parameter under '.experts.')"
                )
        _check_strategies(ddp, "FullyShardedDataParallelV2")
        if ddp.num_distributed_optimizer_instances > 1:
            for name in ("intra_dp_cp", "inter_dist_opt"):
                if getattr(pg_collection, name, None) is None:
                    raise ValueError(
                        f"num_distributed_optimizer_instances={ddp.num_distributed_optimizer_instances} needs "
                        f"pg_collection.{name}"
                    )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Suppress gradient finalization for a non-final micro-batch.

        HSDP/HFSDP leave the outer data-parallel axis Partial across micro-batches
        and reduce it on the last backward of a step, so the engine has to be told
        which backward that is. Without it every backward finalizes that axis and
        the next micro-batch starts over, so only the last micro-batch's gradient
        would reach the optimizer. Megatron's schedules wrap every micro-batch but
        the last in ``no_sync_func``.
        """
        with self.sharded_model.no_sync():
            yield

    def start_param_sync(self, *unused, **unused_kwargs) -> None:
        """No-op: parameters are gathered by the forward pre-hooks."""

    def start_grad_sync(self, *unused, **unused_kwargs) -> None:
        """No-op: gradients are reduced during backward."""

    def finish_grad_sync(self, *unused, **unused_kwargs) -> None:
        """Gradient reduction is complete when backward returns; with ``check_for_nan_in_grad`` the
        reduced gradients are checked here (``finalize_model_grads`` calls it on every chunk)."""
        if getattr(self.ddp_config, "check_for_nan_in_grad", False):
            check_grads_finite(self.sharded_model, self._grad_check_groups, V2)

    def synchronize_param_gather(self, *unused, **unused_kwargs) -> None:
        """No-op: parameter gathers complete inside the module hooks."""

    def broadcast_params(self) -> None:
        """Reject parameter broadcast, which V2 does not support."""
        raise NotImplementedError(
            "FullyShardedDataParallelV2 does not support broadcast_params (data-parallel random "
            "initialization); initialize the model identically on every rank, e.g. with the same seed"
        )

    def stop_communication(self) -> None:
        """No-op: communication is complete when backward returns."""
