"""shardwise: Fully Sharded Data Parallel training for PyTorch."""

from .engine.collectives import Collectives
from .engine.compile import compile_units
from .engine.cuda_graphs import CapturedStep, capture_step
from .engine.device import device_for
from .engine.model_ops import (
    broadcast_from_first_replica,
    finish_grad_accumulation,
    install_grads,
    install_static_grads,
    is_sharded,
    load_full_state_dict,
    refresh_model_weights,
    sharded_state,
    wait_for_reductions,
)
from .engine.fp8 import convert_to_fp8
from .engine.fully_shard import ShardedModule, fully_shard
from .engine.host_syncs import count_host_syncs
from .engine.materialize import MetaInitializer, materialize_meta_module, materialize_owned_meta_modules
from .engine.mesh import (build_dp_mesh, build_expert_mesh, check_mesh_ranks_and_group_ranks_are_consistent, experts_by_mark,
                   fold_context_parallel)
from .engine.optim import BackwardOptimizer, clip_grad_norm_, grad_norm
from .engine.placements import AxisPlacements, STRATEGY_PLACEMENTS, resolve_strategy, strategy_placements
from .engine.offload import OffloadPolicy
from .engine.precision import MixedPrecisionPolicy
from .engine.replaced_params import check_optimizer_params
from .engine.state_dict import full_state_dict
from .engine.teardown import destroy_process_groups

__all__ = [
    "fully_shard",
    "ShardedModule",
    "sharded_state",
    "is_sharded",
    "wait_for_reductions",
    "install_grads",
    "install_static_grads",
    "finish_grad_accumulation",
    "refresh_model_weights",
    "broadcast_from_first_replica",
    "load_full_state_dict",
    "experts_by_mark",
    "compile_units",
    "capture_step",
    "CapturedStep",
    "count_host_syncs",
    "convert_to_fp8",
    "MetaInitializer",
    "materialize_meta_module",
    "materialize_owned_meta_modules",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Collectives",
    "AxisPlacements",
    "STRATEGY_PLACEMENTS",
    "strategy_placements",
    "resolve_strategy",
    "device_for",
    "build_dp_mesh",
    "build_expert_mesh",
    "fold_context_parallel",
    "check_mesh_ranks_and_group_ranks_are_consistent",
    "clip_grad_norm_",
    "BackwardOptimizer",
    "check_optimizer_params",
    "grad_norm",
    "full_state_dict",
    "destroy_process_groups",
]
