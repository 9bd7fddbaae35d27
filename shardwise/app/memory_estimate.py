"""The old home of the engine's buffer arithmetic, kept for its public names: it is part of the planner's one
memory model (its fast path), now ``plan/engine_bytes.py`` (re-exported here)."""

from .plan.engine_bytes import (GIB, BufferSizes, MemoryEstimate, combine, estimate_state_bytes, host_parts,
                                offloaded_units, state_phases)

__all__ = ["GIB", "MemoryEstimate", "BufferSizes", "estimate_state_bytes", "state_phases", "offloaded_units",
           "host_parts", "combine"]
