"""``FullyShardedDataParallelV1``: the engine driven through Megatron's schedule calls."""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..engine.model_ops import (
    broadcast_from_first_replica,
    finish_grad_accumulation,
    refresh_model_weights,
    wait_for_reductions,
)
from ..engine.placements import AxisPlacements
from ..engine.registry import EXPERTS, module_types
from ..engine.rng import sync_rng_states
from .base import (
    check_module,
    warn_if_not_megatron_fsdp,
    _check_strategies,
    _default_unit_types,
    _device_type,
    _has_expert_params,
    _mixed_precision,
    _model_parallel_sizes,
    _ModelParallelSizes,
    _placements,
    _present,
    _ShardedDataParallel,
    _unbuilt_model_parallelism,
    logger,
)
from .config import DistributedDataParallelConfig, TransformerConfig, as_ddp_config, as_transformer_config
from .context_parallel import check_context_parallel
from .grads import check_grads_finite, wire_megatron_grads
from .meshes import (
    _build_dense_mesh,
    _build_expert_mesh_and_placements,
    _check_model_groups,
    _get_dp_tp_mesh,
    _get_hsdp_tp_mesh,
)
from .parallelism import (
    MODULE_TYPE_REGISTRY,
    TENSOR_PARALLEL_MODE_ATTR,
    annotate_tensor_parallelism,
    detect_parallelism_type,
    mark_tensor_parallel,
)
from .options import V1, asks_graph_safe, check_options
from .process_groups import ProcessGroupCollection, build_process_groups, group_size

__all__ = ["FullyShardedDataParallelV1"]


@dataclass
class _DistIndex:
    """Where this rank sits: the meshes the engine shards over, and the groups around them.

    ``mesh`` is ``(dp_shard,)`` or ``(dp_outer, dp_shard)``, with a last ``tp``
    axis when tensor parallelism is on; ``expert_mesh`` is ``(expert_dp, ep)``
    when expert parallelism is on.
    """

    mesh: DeviceMesh
    placements: dict[str, AxisPlacements]
    dp_tp_ranks: torch.Tensor  # this rank's (dp..., tp) rank table
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup  # the whole data-parallel domain (dp_cp)
    hybrid_fsdp_group: Optional[dist.ProcessGroup] = None
    expert_mesh: Optional[DeviceMesh] = None
    expert_placements: Optional[dict] = None
    ep_group: Optional[dist.ProcessGroup] = None
    expert_dp_group: Optional[dist.ProcessGroup] = None
    expert_tp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None  # this chunk's pipeline: its stage's peers on other stages


def _check_pipeline_size(cfg: TransformerConfig, pg) -> None:
    """``pipeline_model_parallel_size`` must be the size of ``pg_collection.pp`` when a collection is given.

    Megatron builds each stage's layers from the config's size and its schedules and
    ``finalize_model_grads`` talk over the ``pp`` group; a collection without it, or
    of another size, would shard over a data-parallel group that does not match the
    stages (``ValueError`` naming both).
    """
    if pg is None:
        return
    configured, group = cfg.pipeline_model_parallel_size, getattr(pg, "pp", None)
    if group is None and configured == 1:
        return
    if group_size(group) != configured:
        found = "missing" if group is None else f"{group_size(group)} ranks"
        raise ValueError(
            f"pipeline_model_parallel_size={configured} needs pg_collection.pp with {configured} ranks, got {found}"
        )


def _megatron_model(module: nn.Module) -> nn.Module:
    """The module Megatron's ``finalize_model_grads`` reads stage attributes from: the first one
    down the ``.module`` chain with ``pre_process`` (a GPTModel under Float16Module), else ``module``."""
    found = module
    while not hasattr(found, "pre_process") and isinstance(getattr(found, "module", None), nn.Module):
        found = found.module
    return found if hasattr(found, "pre_process") else module


def _warn_if_tied_across_stages(module: nn.Module, pp_size: int) -> None:
    """Say when Megatron-Core's own ``finalize_model_grads`` cannot finish this chunk's step.

    With tied word embeddings over several stages it all-reduces the first and
    last stages' gradient shards (right: both stages shard the weight alike) and
    then assigns the local shard as the DTensor parameter's ``.grad``, which torch
    refuses (a shard of another shape) or which leaves a plain tensor (one
    data-parallel rank), in 0.16.1 to 0.19.2, for Megatron-FSDP's chunks as for these.
    """
    model = _megatron_model(module)
    holds_end = getattr(model, "pre_process", False) or getattr(model, "post_process", False)
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    if pp_size > 1 and holds_end and tied:
        warnings.warn(
            f"FullyShardedDataParallelV1: share_embeddings_and_output_weights=True with "
            f"pipeline_model_parallel_size={pp_size}: Megatron-Core's finalize_model_grads (0.16.1 to 0.19.2) "
            "all-reduces the tied embedding's local gradient shard between the first and last stage and then "
            "assigns that shard as the parameter's .grad, which torch refuses for a sharded DTensor parameter; "
            "untie them (--untie-embeddings-and-output-weights), or all-reduce weight.grad.to_local() over "
            "the embedding group in your own finalize_model_grads_func",
            UserWarning,
            stacklevel=3,
        )


# ----------------------------------------------------------------------- V1
class FullyShardedDataParallelV1(_ShardedDataParallel):
    """Fully Sharded Data Parallel (FSDP) wrapper for a Megatron-style model, driven by Megatron's schedule.

    All four ``data_parallel_sharding_strategy`` values, and hybrid sharding when
    ``num_distributed_optimizer_instances > 1`` (outer ``no_shard`` = HSDP,
    ``optim`` = HFSDP). Units default to the transformer, MoE transformer and
    Mamba layers (none for ``no_shard``). With ``pg_collection=None`` the groups
    are built from the configs' parallel sizes over all ranks.

    Tensor parallelism (``tensor_model_parallel_size > 1``): the model's TP
    slices are sharded over the data-parallel axes of a ``dp x tp`` mesh and
    their DTensors describe the global tensors. Expert parallelism
    (``expert_model_parallel_size > 1``): expert parameters (under ``.experts.``) are sharded
    over ``expt_dp`` on an ``(expert_dp, ep)`` mesh, the rest over ``dp_cp``.
    Both at once with whole experts (``expert_tensor_parallel_size=1``, as
    Megatron runs MoE models): the dense layers on the ``dp x tp`` mesh, the
    experts on the ``(expert_dp, ep)`` one, over the same ranks.
    The model must be built with ``pg_collection``'s ``tp`` / ``ep`` groups.

    Pipeline parallelism (``pipeline_model_parallel_size > 1``): ``module`` is
    one stage's model chunk (one wrapper per chunk with virtual stages), sharded
    over that stage's ``dp_cp``; Megatron's pipelined schedules and
    ``finalize_model_grads`` drive it through ``no_sync``, ``start_grad_sync``
    and ``finish_grad_sync`` as they drive Megatron-FSDP.
    """

    _MODULE_TYPE_REGISTRY: Dict[str, set] = {mode: set(names) for mode, names in MODULE_TYPE_REGISTRY.items()}

    @staticmethod
    def _fine_grained_recurse_module_types(config, ddp_config) -> Tuple[Type[nn.Module], ...]:
        """Module classes needing ``parameters(recurse=True)`` for fine-grained hooks.

        Only the expert MLPs (the classes registered as ``EXPERTS``, and Megatron-Core's
        when installed), and only when expert-parallel communication overlap runs
        with ZeRO-3; otherwise none.
        """
        if not (
            getattr(config, "overlap_moe_expert_parallel_comm", False)
            and getattr(ddp_config, "data_parallel_sharding_strategy", None) == "optim_grads_params"
        ):
            return ()
        types: list = list(module_types(EXPERTS))
        if importlib.util.find_spec("megatron") is None:  # Megatron-Core absent: only the registered classes
            return tuple(types)
        for module_name, name in (
            ("megatron.core.transformer.moe.experts", "TEGroupedMLP"),
            ("megatron.core.transformer.moe.shared_experts", "SharedExpertMLP"),
        ):
            try:
                found = getattr(importlib.import_module(module_name), name, None)
            except ModuleNotFoundError as err:  # a Megatron without this module; any other error is a real one
                if err.name is None or not module_name.startswith(err.name):
                    raise
                continue
            if found is not None:  # a Megatron version without this class
                types.append(found)
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
        check_module(module, "FullyShardedDataParallelV1")
        check_options(V1, config, ddp_config, dict(fsdp_unit_modules=fsdp_unit_modules, disable_bucketing=disable_bucketing,
                                                   device=device, pg_collection=pg_collection))
        cfg, ddp = as_transformer_config(config), as_ddp_config(ddp_config)
        super().__init__(config=config, module=module)
        self.ddp_config = ddp_config
        logger.info("Setting up FullyShardedDataParallelV1 with config %s", ddp)
        warn_if_not_megatron_fsdp(ddp, "FullyShardedDataParallelV1")
        _check_strategies(ddp, "FullyShardedDataParallelV1")
        sizes = self._reject_unbuilt(cfg, ddp, pg_collection, module)
        self.device_type = _device_type(device)
        self.megatron_fsdp_dist_index = index = self._init_dist_index(pg_collection)
        _warn_if_tied_across_stages(module, group_size(index.pp_group))
        # Parameters no unit owns (embeddings, head, final norm) are packed in groups of at
        # most `bucket_size` elements; one group per dtype with `disable_bucketing`.
        self.bucket_size = None if disable_bucketing else ddp.bucket_size
        if fsdp_unit_modules is not None:
            self.fsdp_unit_modules = list(fsdp_unit_modules)
        elif ddp.data_parallel_sharding_strategy == "no_shard":
            self.fsdp_unit_modules = []
        else:
            self.fsdp_unit_modules = _present(module, _default_unit_types())
        modes = self._annotate_tensor_parallelism(module)
        if sizes.tp > 1:
            unknown = mark_tensor_parallel(module, modes)
            if unknown:
                logger.warning(
                    "tensor_model_parallel_size=%d: the tensor-parallel layout of %s is unknown; they are "
                    "treated as replicated over the TP ranks (initialized from TP rank 0)", sizes.tp, unknown,
                )
        _check_model_groups(module, index.tp_group, index.ep_group, index.expert_tp_group)
        # With per-token losses Megatron sums gradients over the data-parallel ranks and then
        # scales them by 1 / (total tokens) in scale_gradients.
        self._shard(
            mesh=index.mesh,
            placements=index.placements,
            unit_types=self.fsdp_unit_modules,
            policy=_mixed_precision(cfg, ddp, ddp_config, module),
            init_on_meta=cfg.init_model_with_meta_device,
            prefetch=ddp.overlap_param_gather,
            expert_mesh=index.expert_mesh,
            expert_placements=index.expert_placements,
            gradient_reduction="sum" if cfg.calculate_per_token_loss else "mean",
            bucket_size=self.bucket_size,
            graph_safe=asks_graph_safe(ddp_config),
        )
        wire_megatron_grads(self.sharded_model, config, ddp_config)
        # The sharded parameters are new objects: carry the annotations over by name.
        for name, param in self.sharded_model.named_parameters():
            if name in modes:
                setattr(param, TENSOR_PARALLEL_MODE_ATTR, modes[name])
        self.sync_rng_states_across_tp_group()

    # ------------------------------------------------------------ building
    @staticmethod
    def _reject_unbuilt(
        cfg: TransformerConfig, ddp: DistributedDataParallelConfig, pg, module: nn.Module
    ) -> _ModelParallelSizes:
        """Reject what the engine cannot do yet; return the checked TP / EP / expert-TP sizes.

        ``ValueError`` for a config and ``pg_collection`` that disagree or options that
        cannot work, ``NotImplementedError`` for what is not built yet.
        """
        sizes = _model_parallel_sizes(cfg, pg)
        _check_pipeline_size(cfg, pg)
        unbuilt = _unbuilt_model_parallelism(sizes, module)
        if unbuilt is not None:
            field, value, why = unbuilt
            raise NotImplementedError(f"FullyShardedDataParallelV1 with {field}={value}: {why}")
        if sizes.ep > 1 and not _has_expert_params(module):
            raise ValueError(
                f"FullyShardedDataParallelV1 with expert_model_parallel_size={sizes.ep}: the model has no MoE "
                "layers (no parameter under '.experts.')"
            )
        return sizes

    def _init_dist_index(self, pg_collection: Optional[ProcessGroupCollection]) -> _DistIndex:
        """Initialize the distributed index: the meshes from the process groups, checked against them.

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
        check_context_parallel("FullyShardedDataParallelV1", cfg.context_parallel_size, pg_collection, self.sharded_model)
        tp_group = getattr(pg_collection, "tp", None)
        if tp_group is None:  # this rank alone (the default layout's TP groups, created by every rank)
            tp_group = build_process_groups().tp
        dp_group = getattr(pg_collection, "dp_cp", None)
        if dp_group is None:
            raise ValueError("FullyShardedDataParallelV1 needs pg_collection.dp_cp (the data-parallel group)")
        if hybrid and (getattr(pg_collection, "inter_dist_opt", None) is None
                       or getattr(pg_collection, "intra_dp_cp", None) is None):
            raise ValueError(
                f"num_distributed_optimizer_instances={ddp.num_distributed_optimizer_instances} needs "
                "pg_collection.inter_dist_opt and pg_collection.intra_dp_cp"
            )
        if hybrid:
            ranks = _get_hsdp_tp_mesh(pg_collection.inter_dist_opt, pg_collection.intra_dp_cp, tp_group)
        else:
            ranks = _get_dp_tp_mesh(dp_group, tp_group)
        mesh = _build_dense_mesh(pg_collection, hybrid, self.device_type)
        expert_mesh, expert_placements = _build_expert_mesh_and_placements(cfg, ddp, pg_collection, self.device_type,
                                                                          self.sharded_model)
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
            ep_group=getattr(pg_collection, "ep", None),
            expert_tp_group=getattr(pg_collection, "expt_tp", None),
            expert_dp_group=getattr(pg_collection, "expt_dp", None) if expert_mesh is not None else None,
            pp_group=getattr(pg_collection, "pp", None),
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
        engine does the same at the next forward. In graph-safe mode with
        ``fsdp_all_gather_in_start_param_sync=False`` (Megatron-LM's full-iteration graph) nothing is
        gathered here: the weights are marked changed and the next forward, the captured one, rebuilds them.
        """
        if self.graph_safe and not getattr(self.ddp_config, "fsdp_all_gather_in_start_param_sync", True):
            self.sharded_model.mark_weights_modified()
            return
        refresh_model_weights(self.sharded_model)

    def synchronize_param_gather(self, *unused, **unused_kwargs) -> None:
        """Nothing to wait for: ``start_param_sync`` returns with its gathers done, and
        unit gathers are waited for inside the forward hooks."""

    def start_grad_sync(self, *unused, **unused_kwargs) -> None:
        """Reduce now what backwards run under ``no_sync`` accumulated, and install ``.grad``.

        Megatron's pipelined schedules, given ``grad_sync_func``, run every backward of
        a stage other than the first (every backward of a virtual chunk) under
        ``no_sync`` and call this once after the chunk's last: there is no syncing
        backward to reduce them. After a syncing backward there is nothing left and
        nothing happens. A collective over the chunk's data-parallel group.
        """
        finish_grad_accumulation(self.sharded_model)

    def finish_grad_sync(self, *unused, **unused_kwargs) -> None:
        """Finish the step's gradient reduction: whatever ``no_sync`` left open, then wait and install ``.grad``.

        After a syncing last backward (or ``start_grad_sync``) the engine has already
        done it all and this only confirms it (idempotent); ``finalize_model_grads``
        calls it on every chunk whichever schedule ran. With ``check_for_nan_in_grad``
        the reduced gradients are then checked (a ``RuntimeError`` on every rank).
        """
        finish_grad_accumulation(self.sharded_model)
        if getattr(self.ddp_config, "check_for_nan_in_grad", False):
            index = self.megatron_fsdp_dist_index
            check_grads_finite(self.sharded_model, (index.dp_group, index.tp_group), V1)

    def broadcast_params(self) -> None:
        """Make every data-parallel replica hold the first replica's weights.

        On each data-parallel axis of a parameter group's mesh where its main
        weights are replicated, the axis's first rank broadcasts them (an axis that
        shards them has nothing to agree on; expert groups use the expert mesh, so
        EP ranks keep their own experts); the compute weights are rebuilt at the
        next forward.
        """
        broadcast_from_first_replica(self.sharded_model)

    def stop_communication(self) -> None:
        """Wait for every outstanding gradient reduction."""
        wait_for_reductions(self.sharded_model)

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
        own = set(self.sharded_model.state_dict().keys())
        kept = {k: v for k, v in state_dict.items() if not (k.endswith("._extra_state") and k not in own)}
        return super().load_state_dict(kept, strict=strict)
