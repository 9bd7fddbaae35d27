"""Weights nothing has written since they stopped being trustworthy: said once, at the first forward.

Two moments leave a sharded model's main weights untrustworthy until something writes them:

- ``fully_shard`` found a parameter holding other values on other data-parallel ranks (the checksums of
  ``rank_consistency``). FSDP2 shards whatever each rank holds, and programs rely on it (a per-rank seed
  and then a checkpoint load; torch's threaded tests; a meta build and then a load). But when nothing is
  loaded, each rank keeps its own rows and the model trains a row-mix of the ranks' models (weights
  loaded on rank 0 only, FSDP1's habit).
- ``to_empty()`` gave them fresh storage: uninitialised memory until the model's init or a load.

FSDP2 trains both silently. The harm starts at the first forward, so that is where the engine looks.
For each such parameter, :meth:`WeightWatch.record` keeps its sharded parameter, the version counters of
that DTensor and of its local rows, and the local rows' sum; the root's first forward compares, on this
rank only. A moved counter or another parameter object is a write (``load_state_dict``,
``set_model_state_dict``, an init through the DTensor, a replacement the engine adopted); a write no
counter shows (``dcp.load``, ``.data``, ``to_local()``) changes the sum, read only when the counters
did not move. ``check_module_states``: ``"warn"`` (the default) gives one warning line per check
naming the first unwritten parameter and the fix; ``"raise"`` raises on every rank of the mesh
together (one flag all-reduce at the first forward, in that mode only; a ``to_empty`` after that forward
is checked at the next one, on each rank alone); ``"off"`` records nothing. Steady steps pay one
attribute test.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .device import device_for
from .param_group import ParamGroup

__all__ = ["CHECK_MODES", "UnwrittenWeightsWarning", "WeightWatch", "resolve_check_mode"]

CHECK_MODES = ("warn", "raise", "off")
DIFFERED = "differed across ranks"
EMPTIED = "emptied"


class UnwrittenWeightsWarning(UserWarning):
    """Weights that differed across data-parallel ranks at ``fully_shard``, or that ``to_empty`` left
    uninitialised, reached a forward with nothing having written them."""


def resolve_check_mode(value) -> str:
    """``fully_shard(check_module_states=...)`` as one of :data:`CHECK_MODES` (``True``: ``"warn"``,
    ``False``: ``"off"``)."""
    if value is True:
        return "warn"
    if value is False:
        return "off"
    if isinstance(value, str) and value in CHECK_MODES:
        return value
    raise ValueError(f"check_module_states={value!r} must be 'warn' (the default: a warning at the first forward), "
                     "'raise' (an error there instead), 'off' (no check), True ('warn') or False ('off')")


@dataclasses.dataclass
class _Entry:
    group: ParamGroup
    index: int
    reason: str
    param: torch.Tensor  # the sharded DTensor parameter when recorded
    versions: tuple[int, int, int]  # (its version, its local rows' version, their address)
    total: torch.Tensor  # the local rows' sum (float64, on their device)


def _stamp(param: torch.Tensor) -> tuple[int, int, int]:
    local = param._local_tensor
    return param._version, local._version, local.data_ptr()


class WeightWatch:
    """The parameters of one sharded model not to be trusted until written, checked at its first forward."""

    def __init__(self, mesh: DeviceMesh, mode: str):
        self.mesh, self.mode = mesh, mode
        self.entries: list[_Entry] = []
        self.forwarded = False
        # "raise" needs every rank of the mesh in the check (its flag all-reduce), entries or not
        self.armed = mode == "raise"

    # ------------------------------------------------------------- recording
    @torch.no_grad()
    def record(self, group: ParamGroup, indices: Iterable[int], reason: str) -> None:
        """Watch parameters ``indices`` of ``group`` from now on (a rank holding none of a parameter's rows
        has nothing of it to mix or leave uninitialised)."""
        if self.mode == "off":
            return
        for i in indices:
            param = group.sharded_params[i]
            local = param._local_tensor
            if local.is_meta or local.numel() == 0:
                continue
            self.entries.append(_Entry(group, i, reason, param, _stamp(param), local.sum(dtype=torch.float64)))
            self.armed = True

    def record_differing(self, groups: Iterable[ParamGroup], params: Iterable[torch.Tensor]) -> None:
        """Watch the sharded parameters ``params`` (those whose values differed across ranks at wrap time)."""
        wanted = {id(p) for p in params}
        for group in groups:
            self.record(group, [i for i, p in enumerate(group.sharded_params) if id(p) in wanted], DIFFERED)

    def record_emptied(self, groups: Iterable[ParamGroup]) -> None:
        """``to_empty`` gave these groups new storage: watch all their parameters (their earlier entries are
        moot)."""
        groups = list(groups)
        ids = {id(g) for g in groups}
        self.entries = [e for e in self.entries if id(e.group) not in ids]
        for group in groups:
            self.record(group, range(len(group.sharded_params)), EMPTIED)

    def forget_differing(self) -> None:
        """The replicas were made to agree (``broadcast_from_first_replica``)."""
        self.entries = [e for e in self.entries if e.reason != DIFFERED]

    def take_over(self, others: Iterable[Optional["WeightWatch"]]) -> None:
        """The entries of the units' earlier ``fully_shard`` calls, which this call's model adopts."""
        for other in others:
            if other is not None:
                self.entries.extend(other.entries)
                other.entries = []
        self.armed = self.armed or bool(self.entries)

    # ------------------------------------------------------------- checking
    def check(self, root: nn.Module) -> None:
        """At the root's forward, before anything reads the weights: warn about (or refuse) what nothing
        has written since it was recorded. ``root``: the model, to name parameters by their full names."""
        entries, self.entries, self.armed = self.entries, [], False
        collective = self.mode == "raise" and not self.forwarded  # every rank of the mesh is here, once
        self.forwarded = True
        unwritten = _unwritten(entries)
        message = _message(unwritten, root, self.mode) if unwritten else None
        if collective and _any_rank(message is not None, self.mesh):
            raise RuntimeError(message or (
                "check_module_states='raise': another rank of the mesh holds parameters that differed across "
                "ranks at fully_shard or that to_empty() left uninitialised, and nothing has written them since "
                "(its own error names them)"))
        if message is not None and self.mode == "raise":  # a to_empty after the first forward: this rank's own
            raise RuntimeError(message)
        if message is not None:
            warnings.warn(message, UnwrittenWeightsWarning, stacklevel=2)


@torch.no_grad()
def _unwritten(entries: list[_Entry]) -> list[_Entry]:
    """The entries nothing wrote: counters unmoved, then (one host read per device) sums unchanged."""
    undecided = [e for e in entries
                 if e.group.sharded_params[e.index] is e.param and _stamp(e.param) == e.versions]
    by_device: dict[torch.device, list[_Entry]] = {}
    for e in undecided:
        by_device.setdefault(e.total.device, []).append(e)
    unchanged = set()
    for group in by_device.values():
        now = torch.stack([e.param._local_tensor.sum(dtype=torch.float64) for e in group])
        then = torch.stack([e.total for e in group])
        same = (now == then) | (now.isnan() & then.isnan())
        unchanged.update(id(e) for e, s in zip(group, same.tolist()) if s)
    return [e for e in undecided if id(e) in unchanged]  # in the order recorded: the first named is the model's


def _message(unwritten: list[_Entry], root: nn.Module, mode: str) -> str:
    names = {id(p): n for n, p in root.named_parameters()}
    first = unwritten[0]
    name = names.get(id(first.param), first.group.fqns[first.index])
    more = f" (and {len(unwritten) - 1} more)" if len(unwritten) > 1 else ""
    if first.reason == DIFFERED:
        what = ("held other values on other data-parallel ranks when fully_shard sharded it, and still holds "
                "them (nothing has written it since, or only its own values): this forward trains a mix of the "
                "ranks' rows. Pass fully_shard(..., "
                "sync_module_states=True) to take the first rank's weights, or load the same weights on every "
                "rank after fully_shard (load_state_dict, set_model_state_dict, dcp.load)")
    else:
        what = ("was given storage by to_empty() and nothing has written it since: it holds uninitialised "
                "memory. Initialise it after to_empty() (the model's init_weights() / reset_parameters()) or "
                "load a checkpoint")
    if mode == "raise":
        return f"check_module_states='raise': parameter {name!r}{more} {what}"
    return (f"shardwise: parameter {name!r}{more} {what}; fully_shard(..., check_module_states='raise') makes "
            "this an error, 'off' silences it")


def _any_rank(flag: bool, mesh: DeviceMesh) -> bool:
    """Whether ``flag`` holds on any rank of ``mesh``: a MAX all-reduce along each of its axes in turn."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], device=device_for(mesh))
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return bool(value.item())


def watch_weights(state, adopted: Iterable, described: nn.Module, differing: Iterable[str], mode: str) -> None:
    """Give ``state`` (a ``StepController`` just built) its watch: the entries of the units it adopted, and the
    parameters of ``described`` (what this ``fully_shard`` call wrapped) named in ``differing``."""
    watch = WeightWatch(state.plan.mesh, mode)
    watch.take_over(getattr(s, "weight_watch", None) for s in adopted)
    names = set(differing)
    if names:
        watch.record_differing(state.groups, [p for n, p in described.named_parameters() if n in names])
    state.weight_watch = watch
