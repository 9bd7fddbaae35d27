"""A simulated world: torch's fake process group at the target size, and FakeTensorMode for the model's tensors.

``simulated_world(world)`` lets one process wrap a model with ``fully_shard`` as rank 0 of ``world`` ranks
would, without any memory or peer: the process group is torch's ``fake`` backend (collectives return at
once), and every tensor the model and the engine create is a ``FakeTensor`` (shape, dtype, no storage).

Two things need help, both because every simulated rank is the same program:

* tensors that are real going in stay real (``RealStaysReal``): a ``DeviceMesh`` keeps its rank layout in
  a real tensor and ``fully_shard``'s rank-consistency check reads it (``tolist()``), which a fake tensor
  cannot answer;
* ``torch.distributed.all_gather_object`` returns this rank's object for every rank: the fake backend moves
  no bytes, and identical ranks would send identical objects.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

__all__ = ["simulated_world", "fake_process_group", "RealStaysReal", "cached_mesh"]

_ACTIVE: dict = {}  # the simulation this process is in: its world size, fake mode and the meshes built in it


class RealStaysReal(TorchFunctionMode):
    """Run an op on real tensors outside fake mode (a mesh's rank tensor); factories and fake inputs stay fake."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _all_real(args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _all_real(*args) -> bool:
    """Whether the arguments (in lists, tuples and dicts) hold a tensor and no FakeTensor; stops at the first
    FakeTensor, as most calls of a simulated step have one (every call walked its arguments with torch's
    ``tree_flatten`` before: an eighth of a trace)."""
    found, stack = False, list(args)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if isinstance(x, FakeTensor):
                return False
            found = True
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return found


def _same_object_everywhere(object_list, obj, group=None):
    object_list[:] = [obj] * len(object_list)


@contextlib.contextmanager
def simulated_world(world: int):
    """Rank 0 of ``world`` fake ranks, FakeTensorMode on; the default process group is gone again after.

    Refuses to run inside a process that already has a process group (a training worker): torch has one
    default group per process.
    """
    if world < 1:
        raise ValueError(f"world={world} must be at least 1")
    if _ACTIVE.get("world") == world:  # inside one already (a planner tracing many candidates): reuse it
        with _ACTIVE["mode"], RealStaysReal():
            yield _ACTIVE["mode"]
        return
    with fake_process_group(world, "simulated_world"):
        try:
            with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True) as mode, RealStaysReal():
                # the engine compares storages' addresses to skip copies; fake ones have none, and torch says so
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                _ACTIVE.update(world=world, mode=mode, meshes={})
                yield mode
        finally:
            _ACTIVE.clear()


@contextlib.contextmanager
def fake_process_group(world: int, who: str = "fake_process_group"):
    """Rank 0 of torch's ``fake`` process group of ``world`` ranks (collectives return at once, moving no bytes),
    with ``all_gather_object`` answering this rank's object for every rank; gone again after. Real tensors: the
    dry run (``dry_run.py``) runs real steps in it; :func:`simulated_world` adds FakeTensorMode."""
    if world < 1:
        raise ValueError(f"world={world} must be at least 1")
    if dist.is_initialized():
        raise RuntimeError(f"{who} needs a process without a process group (torch allows one default "
                           "group per process); plan before launching, or in a subprocess")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torch.distributed._tools.fake_collectives  # noqa: F401  (fake kernels of the c10d ops)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    saved = dist.all_gather_object
    dist.all_gather_object = _same_object_everywhere
    try:
        yield
    finally:
        dist.all_gather_object = saved
        dist.destroy_process_group()


def cached_mesh(key, build):
    """``build()`` once per ``key`` in the current simulation (a mesh's process groups take time to make at a
    large world size), outside fake mode (a mesh keeps its rank layout in a real tensor)."""
    meshes = _ACTIVE.get("meshes")
    if meshes is None:
        with unset_fake_temporarily():
            return build()
    if key not in meshes:
        with unset_fake_temporarily():
            meshes[key] = build()
    return meshes[key]
