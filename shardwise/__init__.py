"""shardwise: Fully Sharded Data Parallel training for PyTorch."""

from .compile import compile_units
from .fully_shard import ShardedModule, fully_shard
from .materialize import MetaInitializer, materialize_meta_module, materialize_owned_meta_modules
from .mesh import build_dp_mesh, build_expert_mesh, check_mesh_ranks_and_group_ranks_are_consistent
from .optim import BackwardOptimizer, clip_grad_norm_, grad_norm
from .placements import AxisPlacements, STRATEGY_PLACEMENTS, resolve_strategy, strategy_placements
from .precision import MixedPrecisionPolicy
from .state_dict import full_state_dict

__all__ = [
    "fully_shard",
    "ShardedModule",
    "compile_units",
    "MetaInitializer",
    "materialize_meta_module",
    "materialize_owned_meta_modules",
    "MixedPrecisionPolicy",
    "AxisPlacements",
    "STRATEGY_PLACEMENTS",
    "strategy_placements",
    "resolve_strategy",
    "build_dp_mesh",
    "build_expert_mesh",
    "check_mesh_ranks_and_group_ranks_are_consistent",
    "clip_grad_norm_",
    "BackwardOptimizer",
    "grad_norm",
    "full_state_dict",
]
