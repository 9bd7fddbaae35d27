"""A sharded model and optimizer <-> ``torch.distributed.checkpoint`` with true offsets.

The flat layout gives every rank a contiguous range of each group's flat
buffer, so a rank holds whole rows ``[first, last)`` of some parameters and
none of others: shards are uneven and follow the layout, not ``torch.chunk``.
DTensor's own offset arithmetic (what DCP's default planner asks a DTensor
for) assumes even chunks, so this module describes each local piece to DCP
itself: a ``Piece`` is a local tensor, the global shape and the global row of
its first row, and two small planners turn pieces into write items (save) and
into read items over whatever chunks the checkpoint holds (load). DCP then
reads exactly the overlapping rows, so any world size and strategy loads any
checkpoint.

Keys in the checkpoint (plain strings, ``/`` never appears in an FQN):

- ``model/<fqn>``: fp32 main weights of each parameter (tied parameters once,
  under their first name), and each persistent buffer;
- ``optim/<fqn>/<key>``: optimizer state (``exp_avg``... sharded like the
  parameter; ``step`` and other tensors whole; anything else pickled);
- ``optim_groups``: the optimizer's hyperparameters, with FQNs for ``params``;
- ``extra/rank<r>``, ``rng/rank<r>``: the caller's dict and the RNG states of
  each rank.

``describe_model`` / ``describe_optimizer`` give the JSON-friendly facts the
manager stores next to the DCP files (``shardwise.json``), which
``shardwise ckpt info`` and ``export`` read without a process group.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from .rng_state import capture_rng_state, restore_rng_state

__all__ = [
    "Piece",
    "CheckpointMismatchError",
    "LoadedState",
    "MODEL_PREFIX",
    "OPTIM_PREFIX",
    "sharded_groups",
    "tied_aliases",
    "describe_model",
    "describe_optimizer",
    "save_state",
    "load_state",
]

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
OPTIM_GROUPS_KEY = "optim_groups"


# ------------------------------------------------------------------ pieces
@dataclass(frozen=True)
class Piece:
    """The block of a tensor of global ``shape`` that starts at ``offsets`` and is held here.

    Data-parallel sharding moves the start along dim 0 (whole rows); tensor or
    expert parallelism moves it along the parameter's partition dimension.
    """

    local: torch.Tensor
    shape: torch.Size
    offsets: torch.Size

    @property
    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.shape)

    def write_item(self, key: str) -> WriteItem:
        return WriteItem(
            index=MetadataIndex(key, self.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=self.chunk,
                properties=TensorProperties.create_from_tensor(self.local),
                size=self.shape,
            ),
        )


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with pieces written at their true offsets."""

    def __init__(self, pieces: dict[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = pieces

    def create_local_plan(self):
        plain = {k: v for k, v in self.state_dict.items() if k not in self._pieces}
        plan = create_default_local_save_plan(plain, self.is_coordinator)
        items = list(plan.items)
        items += [p.write_item(k) for k, p in self._pieces.items() if p.local.numel()]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        piece = self._pieces.get(index.fqn)
        return piece.local if piece is not None else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with pieces read from every saved chunk they overlap."""

    def __init__(self, pieces: dict[str, Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=False)
        self._pieces = pieces

    def create_local_plan(self) -> LoadPlan:
        plain = {k: v for k, v in self.state_dict.items() if k not in self._pieces}
        plan = create_default_local_load_plan(plain, self.metadata, True)
        items = list(plan.items)
        for key, piece in self._pieces.items():
            if piece.local.numel():
                saved = self.metadata.state_dict_metadata[key]
                items += create_read_items_for_chunk_list(key, saved, [piece.chunk])
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        piece = self._pieces.get(index.fqn)
        return piece.local if piece is not None else super().lookup_tensor(index)


# ------------------------------------------------------------- the model
def _state(model: nn.Module):
    state = getattr(model, "_shardwise_state", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not sharded by shardwise.fully_shard")
    return state


@dataclass
class _ParamInfo:
    fqn: str
    param: nn.Parameter  # the sharded DTensor parameter
    main: torch.Tensor  # this rank's rows of the fp32 main weights (a view)
    offsets: torch.Size  # where ``main`` starts in the global tensor
    shape: torch.Size  # the global shape (across data and model parallelism)


def sharded_groups(model: nn.Module) -> list[_ParamInfo]:
    """Every sharded parameter with the rows of main weights this rank holds (views)."""
    out = []
    for group in _state(model).groups:
        for fqn, param in zip(group.fqns, group.sharded_params):
            _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            out.append(_ParamInfo(fqn, param, param.to_local(), torch.Size(offsets), torch.Size(param.shape)))
    return out


def _persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out, seen = {}, set()
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is None or name in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for parameters held under more than one name (tied weights)."""
    canonical = {id(info.param): info.fqn for info in sharded_groups(model)}
    return {
        name: canonical[id(p)]
        for name, p in model.named_parameters(remove_duplicate=False)
        if id(p) in canonical and canonical[id(p)] != name
    }


def _model_entries(model: nn.Module) -> tuple[dict[str, Piece], dict[str, torch.Tensor]]:
    pieces, plain = {}, {}
    for info in sharded_groups(model):
        key = MODEL_PREFIX + info.fqn
        if info.shape.numel() == 0:
            plain[key] = info.main
        else:
            pieces[key] = Piece(info.main, info.shape, info.offsets)
    for name, buf in _persistent_buffers(model).items():
        plain[MODEL_PREFIX + name] = buf.detach()
    return pieces, plain


def describe_model(model: nn.Module) -> dict:
    """JSON-friendly facts: tensors (shape, dtype, kind), tied aliases, mesh and placements."""
    from ..placements import STRATEGY_PLACEMENTS, describe

    state = _state(model)
    plan = state.plan
    tensors = {
        info.fqn: {"shape": list(info.shape), "dtype": _dtype_name(info.main.dtype), "kind": "param",
                   "requires_grad": bool(info.param.requires_grad)}
        for info in sharded_groups(model)
    }
    for name, buf in _persistent_buffers(model).items():
        tensors[name] = {"shape": list(buf.shape), "dtype": _dtype_name(buf.dtype), "kind": "buffer"}
    names = {v: k for k, v in STRATEGY_PLACEMENTS.items()}
    axes = {}
    for i, (axis, placements) in enumerate(plan.placements.items()):
        axes[axis] = {"size": plan.mesh.size(i), "strategy": names.get(placements, describe({axis: placements}))}
    return {
        "tensors": tensors,
        "tied": tied_aliases(model),
        "mesh": {"dim_names": list(plan.mesh.mesh_dim_names), "shape": list(plan.mesh.mesh.shape)},
        "placements": describe(plan.placements),
        "axes": axes,
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------ the optimizer
def _param_index(model: nn.Module) -> dict[int, _ParamInfo]:
    return {id(info.param): info for info in sharded_groups(model)}


def _optimizer_fqn(index: dict[int, _ParamInfo], p: torch.Tensor) -> _ParamInfo:
    info = index.get(id(p))
    if info is None:
        raise ValueError(
            "the optimizer holds a parameter that is not one of the model's sharded parameters "
            f"(shape {tuple(p.shape)}); build the optimizer from model.parameters() after fully_shard"
        )
    return info


def _state_kind(value: Any, info: _ParamInfo) -> str:
    if isinstance(value, DTensor):
        return "sharded"
    if isinstance(value, torch.Tensor):
        on_param = value.device.type != "cpu" and value.device == info.main.device
        return "tensor@param" if on_param else "tensor@cpu"
    return "object"


def _optimizer_entries(model: nn.Module, optimizer) -> tuple[dict[str, Piece], dict[str, Any]]:
    index = _param_index(model)
    pieces: dict[str, Piece] = {}
    plain: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            info = _optimizer_fqn(index, p)
            names.append(info.fqn)
            for key, value in optimizer.state.get(p, {}).items():
                full_key = f"{OPTIM_PREFIX}{info.fqn}/{key}"
                if isinstance(value, DTensor):
                    local = value.to_local()
                    if local.shape != info.main.shape or tuple(value.shape) != tuple(info.shape):
                        raise ValueError(
                            f"optimizer state {key!r} of {info.fqn!r} is a DTensor of shape {tuple(value.shape)} "
                            f"with local shape {tuple(local.shape)}; expected the parameter's "
                            f"{tuple(info.shape)} / {tuple(info.main.shape)}"
                        )
                    if info.shape.numel():
                        pieces[full_key] = Piece(local.detach(), info.shape, info.offsets)
                    else:
                        plain[full_key] = local.detach()
                elif isinstance(value, torch.Tensor):
                    plain[full_key] = value.detach()
                else:
                    plain[full_key] = value
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    plain[OPTIM_GROUPS_KEY] = groups
    return pieces, plain


def describe_optimizer(model: nn.Module, optimizer) -> dict:
    index = _param_index(model)
    kinds: dict[str, dict[str, str]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            info = _optimizer_fqn(index, p)
            state = optimizer.state.get(p, {})
            if state:
                kinds[info.fqn] = {key: _state_kind(v, info) for key, v in state.items()}
    return {"class": type(optimizer).__name__, "groups": len(optimizer.param_groups), "state": kinds}


# ------------------------------------------------------------------- save
def save_state(
    path: str | Path,
    model: nn.Module,
    optimizer=None,
    extra: Any = None,
    *,
    save_rng: bool = True,
    process_group=None,
) -> Metadata:
    """Write this rank's shard of ``model`` (and ``optimizer``) into the DCP folder ``path`` (a collective)."""
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    pieces, plain = _model_entries(model)
    if optimizer is not None:
        opt_pieces, opt_plain = _optimizer_entries(model, optimizer)
        pieces.update(opt_pieces)
        plain.update(opt_plain)
    plain[f"extra/rank{rank}"] = extra
    if save_rng:
        plain[f"rng/rank{rank}"] = capture_rng_state()
    state_dict = {**plain, **{k: p.local for k, p in pieces.items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(str(path)),
            planner=_SavePlanner(pieces),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )


# ------------------------------------------------------------------- load
class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model (missing or extra keys, shape mismatch)."""

    def __init__(self, path, missing=(), unexpected=(), mismatched=(), what="model", detail=None):
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        lines = [f"checkpoint {path} does not fit the {what}:"]
        if detail:
            lines.append(f"  {detail}")
        if self.missing:
            lines.append(f"  missing from the checkpoint ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"  in the checkpoint but not the {what} ({len(self.unexpected)}): "
                         f"{', '.join(self.unexpected)}")
        for name, saved, current in self.mismatched:
            lines.append(f"  shape mismatch for {name}: checkpoint {tuple(saved)}, {what} {tuple(current)}")
        lines.append("  (pass strict=False to load the keys that fit and skip the rest)")
        super().__init__("\n".join(lines))


@dataclass
class LoadedState:
    step: int | None
    extra: Any
    rng_restored: bool
    skipped: list[str]  # keys left as they were (strict=False)


def _saved_size(md: Metadata, key: str) -> torch.Size | None:
    entry = md.state_dict_metadata.get(key)
    return entry.size if isinstance(entry, TensorStorageMetadata) else None


def _check_model(path, md: Metadata, pieces, plain, aliases: dict[str, str], strict: bool):
    """Match the model's keys against the checkpoint; return the keys to load, renamed for tied aliases."""
    saved = {k[len(MODEL_PREFIX):] for k in md.state_dict_metadata if k.startswith(MODEL_PREFIX)}
    wanted = {k[len(MODEL_PREFIX):]: p.shape for k, p in {**plain, **pieces}.items()}
    # A checkpoint may name a tied weight by another of its names.
    reverse: dict[str, list[str]] = {}
    for alias, canonical in aliases.items():
        reverse.setdefault(canonical, []).append(alias)
    rename: dict[str, str] = {}
    for name in wanted:
        if name not in saved:
            found = [a for a in reverse.get(name, []) if a in saved]
            if found:
                rename[name] = found[0]
    used = {rename.get(n, n) for n in wanted}
    missing = sorted(n for n in wanted if rename.get(n, n) not in saved)
    unexpected = sorted(s for s in saved - used if aliases.get(s) not in wanted)
    mismatched = []
    for name, shape in wanted.items():
        size = _saved_size(md, MODEL_PREFIX + rename.get(name, name))
        if size is not None and tuple(size) != tuple(shape):
            mismatched.append((name, size, shape))
    if (missing or unexpected or mismatched) and strict:
        raise CheckpointMismatchError(path, missing, unexpected, mismatched)
    skip = set(missing) | {m[0] for m in mismatched}
    if skip or unexpected:
        warnings.warn(
            f"strict=False: loading {path} without {sorted(skip)}; ignoring checkpoint keys {unexpected}",
            stacklevel=3,
        )
    return {name: MODEL_PREFIX + rename.get(name, name) for name in wanted if name not in skip}, sorted(skip)


def load_state(
    path: str | Path,
    model: nn.Module,
    optimizer=None,
    *,
    strict: bool = True,
    restore_rng: bool = True,
    meta: dict | None = None,
    process_group=None,
) -> LoadedState:
    """Read this rank's rows of ``model`` (and ``optimizer``) from the DCP folder ``path`` (a collective).

    Works for any world size and strategy: each rank asks for the rows its
    current layout holds and DCP reads them from whichever saved chunks
    overlap. ``meta`` is the manager's ``shardwise.json`` (optimizer state
    kinds, saved world size); without it they are inferred from the DCP
    metadata.
    """
    path = Path(path)
    meta = meta or {}
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    reader = dcp.FileSystemReader(str(path))
    md = reader.read_metadata()

    model_pieces, model_plain = _model_entries(model)
    keep, skipped = _check_model(path, md, model_pieces, model_plain, tied_aliases(model), strict)
    pieces: dict[str, Piece] = {}
    plain: dict[str, Any] = {}
    for name, saved_key in keep.items():
        mine = MODEL_PREFIX + name
        if mine in model_pieces:
            pieces[saved_key] = model_pieces[mine]
        else:
            plain[saved_key] = model_plain[mine]

    new_state: dict[tuple[int, str], tuple[str, nn.Parameter]] = {}
    if optimizer is not None:
        new_state = _plan_optimizer_load(path, md, model, optimizer, meta, pieces, plain, strict, skipped)

    saved_world = meta.get("world_size")
    extra_key = f"extra/rank{rank}" if saved_world == world else "extra/rank0"
    if extra_key in md.state_dict_metadata:
        plain[extra_key] = None
    rng_key = f"rng/rank{rank}"
    want_rng = restore_rng and saved_world == world and rng_key in md.state_dict_metadata
    if want_rng:
        plain[rng_key] = None

    state_dict = {**plain, **{k: p.local for k, p in pieces.items()}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state_dict, storage_reader=reader, planner=_LoadPlanner(pieces),
                 process_group=process_group, no_dist=not dist.is_initialized())
    model.mark_weights_modified()

    if optimizer is not None:
        _finish_optimizer_load(path, model, optimizer, state_dict, new_state, strict)
    if want_rng:
        restore_rng_state(state_dict[rng_key])
    elif restore_rng and saved_world is not None and saved_world != world and rank == 0:
        warnings.warn(
            f"{path} was saved on {saved_world} ranks and is loaded on {world}: RNG states are not restored "
            "(they are per rank)", stacklevel=2)
    return LoadedState(step=meta.get("step"), extra=state_dict.get(extra_key),
                       rng_restored=want_rng, skipped=skipped)


def _plan_optimizer_load(path, md, model, optimizer, meta, pieces, plain, strict, skipped):
    """Add the optimizer's state to the load; return the state tensors to install afterwards."""
    if OPTIM_GROUPS_KEY not in md.state_dict_metadata:
        if strict:
            raise CheckpointMismatchError(path, what="optimizer", detail="the checkpoint holds no optimizer state")
        warnings.warn(f"{path} holds no optimizer state; the optimizer is left as it is", stacklevel=3)
        return {}
    plain[OPTIM_GROUPS_KEY] = None
    kinds = (meta.get("optimizer") or {}).get("state") or {}
    saved_keys: dict[str, list[str]] = {}
    for key in md.state_dict_metadata:
        if key.startswith(OPTIM_PREFIX):
            fqn, _, name = key[len(OPTIM_PREFIX):].rpartition("/")
            saved_keys.setdefault(fqn, []).append(name)
    index = _param_index(model)
    new_state = {}
    skip = set(skipped)
    for group in optimizer.param_groups:
        for p in group["params"]:
            info = _optimizer_fqn(index, p)
            if info.fqn in skip:
                continue
            current = optimizer.state.get(p, {})
            for name in saved_keys.get(info.fqn, []):
                key = f"{OPTIM_PREFIX}{info.fqn}/{name}"
                entry = md.state_dict_metadata[key]
                kind = kinds.get(info.fqn, {}).get(name) or _infer_kind(entry, info)
                existing = current.get(name)
                if kind == "sharded":
                    local = existing.to_local() if isinstance(existing, DTensor) else None
                    if local is None or local.shape != info.main.shape or local.dtype != entry.properties.dtype:
                        local = torch.empty(info.main.shape, dtype=entry.properties.dtype, device=info.main.device)
                        new_state[(id(p), name)] = ("sharded", p, local)
                    if info.shape.numel():
                        pieces[key] = Piece(local, info.shape, info.offsets)
                    else:
                        plain[key] = local
                elif kind.startswith("tensor"):
                    ok = (isinstance(existing, torch.Tensor) and not isinstance(existing, DTensor)
                          and existing.shape == entry.size and existing.dtype == entry.properties.dtype)
                    if not ok:
                        device = info.main.device if kind == "tensor@param" else "cpu"
                        existing = torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
                    plain[key] = existing
                    new_state[(id(p), name)] = ("tensor", p, existing)
                else:
                    plain[key] = None
                    new_state[(id(p), name)] = ("object", p, key)
    return new_state


def _infer_kind(entry, info: _ParamInfo) -> str:
    if isinstance(entry, BytesStorageMetadata):
        return "object"
    if len(entry.size) and tuple(entry.size) == tuple(info.shape):
        return "sharded"
    return "tensor@cpu"


def _finish_optimizer_load(path, model, optimizer, state_dict, new_state, strict) -> None:
    if OPTIM_GROUPS_KEY not in state_dict:
        return
    saved_groups = state_dict[OPTIM_GROUPS_KEY]
    index = _param_index(model)
    current = [[_optimizer_fqn(index, p).fqn for p in g["params"]] for g in optimizer.param_groups]
    if len(saved_groups) != len(current) or any(s["params"] != c for s, c in zip(saved_groups, current)):
        message = (
            "the optimizer's parameter groups differ from the checkpoint's "
            f"(checkpoint: {[s['params'] for s in saved_groups]}, optimizer: {current})"
        )
        if strict:
            raise CheckpointMismatchError(path, what="optimizer", detail=message)
        warnings.warn(f"{path}: {message}; hyperparameters are not restored", stacklevel=3)
    else:
        for group, saved in zip(optimizer.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    for (pid, name), (kind, p, value) in new_state.items():
        if kind == "sharded":
            value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
        elif kind == "object":
            value = state_dict[value]
        optimizer.state[params[pid]][name] = value
