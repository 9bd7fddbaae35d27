"""``FullyShardedDataParallelV1``: the engine driven through Megatron's schedule calls."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from ..placements import AxisPlacements
from ..rng import sync_rng_states
from .base import (
    _check_strategies,
    _default_unit_types,
    _device_type,
    _mixed_precision,
    _placements,
    _present,
    _ShardedDataParallel,
    logger,
)
from .config import DistributedDataParallelConfig, TransformerConfig, as_ddp_config, as_transformer_config
from .meshes import INNER_AXIS, _build_expert_mesh_and_placements, _build_hybrid_dp_mesh, _get_dp_tp_mesh, _get_hsdp_tp_mesh
from .parallelism import MODULE_TYPE_REGISTRY, TENSOR_PARALLEL_MODE_ATTR, annotate_tensor_parallelism, detect_parallelism_type
from .process_groups import ProcessGroupCollection, build_process_groups, group_size

__all__ = ["FullyShardedDataParallelV1"]


@dataclass
class _DistIndex:
    """Where this rank sits: the data-parallel mesh the engine shards over, and the groups around it."""

    mesh: DeviceMesh
    placements: dict[str, AxisPlacements]
    dp_tp_ranks: torch.Tensor  # this rank's (dp..., tp) rank table
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup  # the whole data-parallel domain (dp_cp)
    hybrid_fsdp_group: Optional[dist.ProcessGroup] = None
    expert_mesh: Optional[DeviceMesh] = None
    expert_placements: Optional[dict] = None


# ----------------------------------------------------------------------- V1
class FullyShardedDataParallelV1(_ShardedDataParallel):
    """Fully Sharded Data Parallel (FSDP) wrapper for a Megatron-style model, driven by Megatron's schedule.

    All four ``data_parallel_sharding_strategy`` values, and hybrid sharding when
    ``num_distributed_optimizer_instances > 1`` (outer ``no_shard`` = HSDP,
    ``optim`` = HFSDP). Units default to the transformer, MoE transformer and
    Mamba layers (none for ``no_shard``). With ``pg_collection=None`` the groups
    are built from the configs' parallel sizes over all ranks.
    """

    _MODULE_TYPE_REGISTRY: Dict[str, set] = {mode: set(names) for mode, names in MODULE_TYPE_REGISTRY.items()}

    @staticmethod
    def _fine_grained_recurse_module_types(config, ddp_config) -> Tuple[Type[nn.Module], ...]:
        """Module classes needing ``parameters(recurse=True)`` for fine-grained hooks.

        Only the expert MLPs, and only when expert-parallel communication overlap
        runs with ZeRO-3; otherwise none.
        """
        if not (
            getattr(config, "overlap_moe_expert_parallel_comm", False)
            and getattr(ddp_config, "data_parallel_sharding_strategy", None) == "optim_grads_params"
        ):
            return ()
        from ..models import Experts

        types: list = [Experts]
        for module_name, name in (
            ("megatron.core.transformer.moe.experts", "TEGroupedMLP"),
            ("megatron.core.transformer.moe.shared_experts", "SharedExpertMLP"),
        ):
            try:
                if importlib.util.find_spec("megatron") is not None:
                    types.append(getattr(importlib.import_module(module_name), name))
            except Exception:
                pass
        return tuple(types)

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
        super().__init__(config=config, module=module)
        cfg, ddp = as_transformer_config(config), as_ddp_config(ddp_config)
        self.ddp_config = ddp_config
        logger.info("Setting up FullyShardedDataParallelV1 with config %s", ddp)
        _check_strategies(ddp, "FullyShardedDataParallelV1")
        self._reject_unbuilt(cfg, ddp, pg_collection)
        self._calculate_per_token_loss = cfg.calculate_per_token_loss
        self.device_type = _device_type(device)
        self.megatron_fsdp_dist_index = self._init_dist_index(pg_collection)
        # The engine packs the parameters that no unit owns into one group per dtype
        # (one bucket); `bucket_size` is recorded for Megatron's code that reads it.
        self.bucket_size = None if disable_bucketing else ddp.bucket_size
        if fsdp_unit_modules is not None:
            self.fsdp_unit_modules = list(fsdp_unit_modules)
        elif ddp.data_parallel_sharding_strategy == "no_shard":
            self.fsdp_unit_modules = []
        else:
            self.fsdp_unit_modules = _present(module, _default_unit_types())
        modes = self._annotate_tensor_parallelism(module)
        self._shard(
            mesh=self.megatron_fsdp_dist_index.mesh,
            placements=self.megatron_fsdp_dist_index.placements,
            unit_types=self.fsdp_unit_modules,
            policy=_mixed_precision(cfg, ddp),
            init_on_meta=cfg.init_model_with_meta_device,
            prefetch=ddp.overlap_param_gather,
        )
        # The sharded parameters are new objects: carry the annotations over by name.
        for name, param in self.module.named_parameters():
            if name in modes:
                setattr(param, TENSOR_PARALLEL_MODE_ATTR, modes[name])
        self.sync_rng_states_across_tp_group()

    # ------------------------------------------------------------ building
    @staticmethod
    def _reject_unbuilt(cfg: TransformerConfig, ddp: DistributedDataParallelConfig, pg) -> None:
        tp = max(cfg.tensor_model_parallel_size, group_size(getattr(pg, "tp", None)))
        ep = max(cfg.expert_model_parallel_size, group_size(getattr(pg, "ep", None)))
        etp = max(cfg.expert_tensor_parallel_size or 1, group_size(getattr(pg, "expt_tp", None)))
        for field, value in (("tensor_model_parallel_size", tp), ("expert_model_parallel_size", ep),
                             ("expert_tensor_parallel_size", etp)):
            if value > 1:
                raise NotImplementedError(
                    f"FullyShardedDataParallelV1 with {field}={value}: composing FSDP with tensor or "
                    "expert parallelism is not built yet; use a size of 1 (data parallelism only)"
                )
        for field in ("fp8_param_gather", "fp4_param_gather"):
            if getattr(ddp, field):
                raise NotImplementedError(
                    f"FullyShardedDataParallelV1 with {field}=True: low-precision parameter gathers are not built yet"
                )
        if cfg.gradient_accumulation_fusion:
            raise ValueError(
                "FullyShardedDataParallelV1 with gradient_accumulation_fusion=True: shardwise reduces autograd's "
                ".grad and gives parameters no .main_grad to fuse into; set gradient_accumulation_fusion=False"
            )

    def _init_dist_index(self, pg_collection: Optional[ProcessGroupCollection]) -> _DistIndex:
        """Initialize the distributed index: the data-parallel mesh from the process groups.

        Without ``pg_collection`` the groups are built from the configs' sizes over
        all ranks (Megatron would read its global parallel state instead).
        """
        cfg, ddp = as_transformer_config(self.config), as_ddp_config(self.ddp_config)
        hybrid = ddp.num_distributed_optimizer_instances > 1
        if pg_collection is None:
            pg_collection = build_process_groups(
                tensor_model_parallel_size=cfg.tensor_model_parallel_size,
                pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                context_parallel_size=cfg.context_parallel_size,
                expert_model_parallel_size=cfg.expert_model_parallel_size,
                expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
                num_distributed_optimizer_instances=ddp.num_distributed_optimizer_instances,
            )
        tp_group = getattr(pg_collection, "tp", None)
        if tp_group is None:  # this rank alone (the default layout's TP groups, created by every rank)
            tp_group = build_process_groups().tp
        dp_group = getattr(pg_collection, "dp_cp", None)
        if dp_group is None:
            raise ValueError("FullyShardedDataParallelV1 needs pg_collection.dp_cp (the data-parallel group)")
        if hybrid:
            outer = getattr(pg_collection, "inter_dist_opt", None)
            inner = getattr(pg_collection, "intra_dp_cp", None)
            if outer is None or inner is None:
                raise ValueError(
                    f"num_distributed_optimizer_instances={ddp.num_distributed_optimizer_instances} needs "
                    "pg_collection.inter_dist_opt and pg_collection.intra_dp_cp"
                )
            ranks = _get_hsdp_tp_mesh(outer, inner, tp_group)
            mesh = _build_hybrid_dp_mesh(outer, inner, self.device_type)
        else:
            ranks = _get_dp_tp_mesh(dp_group, tp_group)
            mesh = DeviceMesh.from_group(dp_group, self.device_type, mesh_dim_names=(INNER_AXIS,))
        expert_mesh, expert_placements = _build_expert_mesh_and_placements(cfg, ddp, pg_collection, self.device_type)
        self.tp_group = tp_group
        return _DistIndex(
            mesh=mesh,
            placements=_placements(ddp, hybrid),
            dp_tp_ranks=ranks,
            tp_group=tp_group,
            dp_group=dp_group,
            hybrid_fsdp_group=dp_group if hybrid else None,
            expert_mesh=expert_mesh,
            expert_placements=expert_placements,
        )

    def _detect_parallelism_type(self, param_name: str, module: nn.Module) -> Optional[str]:
        """Infer the tensor-parallel layout of ``module``'s parameter ``param_name``.

        Returns ``"column"``, ``"row"`` or ``"replicated"`` when the rules of
        :mod:`shardwise.megatron.parallelism` decide it, else ``None``.
        """
        return detect_parallelism_type(param_name, module, self._MODULE_TYPE_REGISTRY)

    def _annotate_tensor_parallelism(self, root_module: nn.Module) -> dict[str, str]:
        """Set ``_tensor_parallel_mode`` ("column", "row" or "replicated") on every parameter
        under ``root_module`` whose layout can be inferred; return ``{name: mode}``."""
        return annotate_tensor_parallelism(root_module, self._MODULE_TYPE_REGISTRY)

    # ------------------------------------------------------ schedule API
    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """Rebuild the compute weights from the main weights updated by the optimizer step, now.

        Where the optimizer state is sharded but the parameters are not (ZeRO-1/2,
        HFSDP's outer axis) this is the all-gather of the updated shards; ZeRO-3
        units are gathered later by their forward hooks. Without this call the
        engine does the same at the next forward.
        """
        for group in self.sharded_state.groups:
            group.refresh_model_weights()

    def synchronize_param_gather(self, *unused, **unused_kwargs) -> None:
        """Nothing to wait for: ``start_param_sync`` returns with its gathers done, and
        unit gathers are waited for inside the forward hooks."""

    def start_grad_sync(self, *unused, **unused_kwargs) -> None:
        """Nothing to start: each unit's gradients are reduced by a hook as soon as its backward ends."""

    def finish_grad_sync(self, *unused, **unused_kwargs) -> None:
        """Wait for outstanding gradient reductions and make sure ``.grad`` is installed.

        The engine already does both in its end-of-backward callback, so after
        the last micro-batch's ``backward()`` this only confirms it (idempotent).
        """
        self._wait_for_reductions()
        for unit in self.sharded_state.all_units:
            unit.install_grads()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply the gradients by ``scaling_factor``.

        With ``calculate_per_token_loss`` Megatron reduces gradients as sums over
        the data-parallel ranks and then calls this with ``1 / total tokens``; the
        engine averages, so the data-parallel size is folded in here.
        """
        if self._calculate_per_token_loss:
            scaling_factor = scaling_factor * self.sharded_state.plan.dp_size
        super().scale_gradients(scaling_factor)

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Make every data-parallel replica hold the first replica's weights.

        On each mesh axis where the main weights are replicated, the axis's first
        rank broadcasts them (an axis that shards them has nothing to agree on);
        the compute weights are rebuilt at the next forward.
        """
        state = self.sharded_state
        for name, placement in state.plan.placements.items():
            axis = state.plan.axes[name]
            if axis.size == 1 or not isinstance(placement.optimizer, Replicate):
                continue
            src = dist.get_global_rank(axis.group, 0)
            for group in state.groups:
                if group.main.numel():
                    dist.broadcast(group.main, src=src, group=axis.group)
        self.module.mark_weights_modified()

    def stop_communication(self) -> None:
        """Wait for every outstanding gradient reduction."""
        self._wait_for_reductions()

    def sync_rng_states_across_tp_group(self) -> None:
        """Give every tensor-parallel rank TP rank 0's Python, NumPy, torch, CUDA and tracker RNG states.

        Nothing happens when the TP group has one rank.
        """
        sync_rng_states(self.tp_group)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load the model's state dict (sharded tensors from ``state_dict()``, or full tensors).

        ``_extra_state`` entries (Transformer Engine fp8 metadata) the model does
        not have are skipped.
        """
        own = set(self.module.state_dict().keys())
        kept = {k: v for k, v in state_dict.items() if not (k.endswith("._extra_state") and k not in own)}
        return super().load_state_dict(kept, strict=strict)
