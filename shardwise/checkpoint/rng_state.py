"""This process's random number generator states, for checkpoints.

``shardwise.rng`` (Python, NumPy, torch CPU and CUDA, plus the tensor-parallel
tracker's named streams) when it is there; otherwise the four generators
directly. The saved dict records which of the two wrote it.
"""

from __future__ import annotations

import random

import torch

__all__ = ["capture_rng_state", "restore_rng_state"]


def _shardwise_rng():
    try:
        from ..engine.rng import get_rng_state_dict, load_rng_state_dict
    except ImportError:
        return None
    return get_rng_state_dict, load_rng_state_dict


def capture_rng_state() -> dict:
    rng = _shardwise_rng()
    if rng is not None:
        return {"source": "shardwise.rng", "state": rng[0]()}
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return {"source": "generators", "state": state}


def restore_rng_state(saved: dict) -> None:
    if saved["source"] == "shardwise.rng":
        rng = _shardwise_rng()
        if rng is None:
            raise RuntimeError("this checkpoint's RNG state was written by shardwise.rng, which is missing")
        rng[1](saved["state"])
        return
    import numpy as np

    state = saved["state"]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:  # another number of visible devices: restore the current one
            torch.cuda.set_rng_state(cuda[torch.cuda.current_device() % len(cuda)])
