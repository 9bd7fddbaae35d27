"""shardwise: Fully Sharded Data Parallel training for PyTorch.

The names a user needs, shaped like torch's FSDP2 (``fully_shard``, the module
class it returns, ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``clip_grad_norm_``).
Everything else lives in submodules: the engine in ``shardwise.engine`` (the
faces' per-model operations in ``shardwise.engine.model_ops``), the Megatron-Core
face in ``shardwise.megatron``, checkpoints in ``shardwise.checkpoint``, Hugging
Face models in ``shardwise.hf``. ``shardwise.plan(...)`` (memory and step time of
each configuration before a run) lives in ``shardwise.app.plan`` and loads on first use.
"""

from .engine.collectives import Collectives
from .engine.compile import compile_units
from .engine.cuda_graphs import CapturedStep, capture_step
from .engine.fp8 import convert_to_fp8
from .engine.fully_shard import ShardedModule, fully_shard
from .engine.launch_hint import install_torchrun_hint as _install_torchrun_hint
from .engine.materialize import MetaInitializer
from .engine.mesh import build_dp_mesh, build_expert_mesh
from .engine.offload import OffloadPolicy
from .engine.optim import BackwardOptimizer, clip_grad_norm_
from .engine.placements import AxisPlacements
from .engine.precision import MixedPrecisionPolicy
from .engine.replaced_params import check_optimizer_params
from .engine.state_dict import full_state_dict
from .engine.teardown import destroy_process_groups
from .engine.watchdog import StallWatchdog


__all__ = [
    # wrapping
    "fully_shard",
    "ShardedModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "AxisPlacements",
    "Collectives",
    "MetaInitializer",
    # meshes
    "build_dp_mesh",
    "build_expert_mesh",
    # the training step
    "clip_grad_norm_",
    "BackwardOptimizer",
    "check_optimizer_params",
    "compile_units",
    "capture_step",
    "CapturedStep",
    "convert_to_fp8",
    "StallWatchdog",
    # state and teardown
    "full_state_dict",
    "destroy_process_groups",
]

# The app layer's entry points, offered here though the app sits above this package in docs/design.md's layers:
# loaded on first use (PEP 562), so ``import shardwise`` never imports the app.
_APP_ENTRY_POINTS = ("plan",)


def __getattr__(name: str):
    if name == "plan":
        from .app.plan import plan

        return plan
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_APP_ENTRY_POINTS))


_install_torchrun_hint()  # `python example.py` without torchrun: one line saying to use it
