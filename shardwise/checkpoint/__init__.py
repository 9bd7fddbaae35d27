"""Distributed checkpoints of sharded models: DCP save/load on any world size, atomic, exportable.

    from shardwise.checkpoint import CheckpointManager
    manager = CheckpointManager(out_dir / "checkpoints", keep_last=3)
    restored = manager.load_latest(model, optimizer)          # None on a fresh start
    manager.save(step, model, optimizer, extra={"data": loader.state_dict()})

Offline: ``shardwise ckpt info CKPT_DIR``, ``shardwise ckpt verify CKPT_DIR`` and
``shardwise ckpt export CKPT_DIR OUT``.
"""

from .dcp_state import CheckpointMismatchError, LoadedState, load_state, save_state
from .full import gather_full_optimizer_state
from .integrity import CheckpointCorruptError, CheckpointError, CheckpointSaveError, verify_checkpoint
from .manager import CheckpointManager, Restored

__all__ = [
    "CheckpointManager",
    "Restored",
    "CheckpointMismatchError",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointSaveError",
    "verify_checkpoint",
    "LoadedState",
    "save_state",
    "load_state",
    "gather_full_optimizer_state",
    "export_safetensors",
    "checkpoint_info",
    "read_tensors",
]


def __getattr__(name):  # the offline tools load on first use
    if name in ("export_safetensors", "checkpoint_info", "read_tensors"):
        from . import export

        return getattr(export, name)
    raise AttributeError(name)
