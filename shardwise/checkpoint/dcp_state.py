"""A sharded model and optimizer <-> ``torch.distributed.checkpoint``, on DCP's default planners.

Every value shardwise hands out is an honest DTensor (its local piece is a
``torch.chunk`` shard), so the standard path does all the work: the model's
``get_model_state_dict`` and the optimizer's ``get_optimizer_state_dict``
are saved as they are with ``dcp.save`` and DCP's ``DefaultSavePlanner``;
a load asks DCP's ``DefaultLoadPlanner`` to read into the current model's
DTensors (the parameters themselves: DCP writes into their local shards) and
hands the optimizer's to ``set_optimizer_state_dict``. DCP reads whichever
saved chunks overlap, so any world size and strategy loads any checkpoint,
including those written before shardwise's shards followed ``torch.chunk``
(they were written with true global offsets).

What is left here is what the standard path does not do:

- Keys stay flat strings, as before, so old checkpoints still load
  (``flatten_state_dict=False``: DCP's flattening would spread the caller's
  ``extra`` dict over many keys):

  - ``model/<fqn>``: fp32 main weights of each parameter and each persistent
    buffer; a tensor with several names (tied weights) once, under its first
    name (``nn.Module.state_dict()`` and torch's functions name it twice);
  - ``optim/<fqn>/<key>``: optimizer state (``exp_avg``... DTensors like the
    parameter; ``step`` and other tensors whole; anything else pickled);
  - ``optim_groups``: the optimizer's hyperparameters, with FQNs for ``params``;
  - ``extra/rank<r>``, ``rng/rank<r>``: the caller's dict and each rank's RNG states.

- Keys, shapes and the optimizer's class are checked before DCP reads
  anything, with one message listing every difference (``strict=False``
  loads what fits); a checkpoint may name a tied weight by any of its names.
- An optimizer without state is saved without calling
  ``get_optimizer_state_dict``: that function first runs a zero-lr step to
  create the state, which would change a live run (AdamW's step count).
- The optimizer state to read into is built from the checkpoint's keys
  (DTensors laid out like their parameter), not from a template step.

``describe_model`` / ``describe_optimizer`` give the JSON-friendly facts the
manager stores next to the DCP files (``shardwise.json``), which
``shardwise ckpt info`` and ``export`` read without a process group.

Pipeline stages: ``model`` may be a list of this rank's stage modules (each
``fully_shard``-wrapped, under the whole model's names) and ``optimizer`` then a
list of one optimizer per stage (torch's state-dict functions map an
optimizer's parameters through one module). The checkpoint is the whole
model's, whatever the pipeline: every rank writes its stages' keys, the
optimizer's param groups are merged over stages and ranks (group ``j`` of every
stage, with the same hyperparameters, is the checkpoint's group ``j``), and a
load checks the keys of all ranks together, so a checkpoint saved at one
pipeline and data-parallel layout loads at any other, or unsplit.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from ..engine.model_ops import sharded_state, sharding_plan
from .integrity import read_dcp_metadata
from .rng_state import capture_rng_state, restore_rng_state

__all__ = [
    "CheckpointMismatchError",
    "LoadedState",
    "MODEL_PREFIX",
    "OPTIM_PREFIX",
    "model_tensors",
    "param_names",
    "describe_model",
    "describe_optimizer",
    "save_state",
    "load_state",
]

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
OPTIM_GROUPS_KEY = "optim_groups"
# Wrappers whose names torch's state-dict functions leave out of FQNs (as ``_get_fqns`` does).
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


# ------------------------------------------------------------- the model
def _clean(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _names(model: nn.Module, keys=None) -> tuple[dict[int, str], dict[str, str], dict[str, str]]:
    """(tensor id -> first FQN, {alias: first FQN}, {FQN: name with wrapper parts}) over the parameters and
    buffers (only those whose FQN is in ``keys``, if given)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    raw: dict[str, str] = {}
    named = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        fqn = _clean(name)
        if keys is not None and fqn not in keys:
            continue
        if fqn != name:
            raw[fqn] = name
        canonical = first.setdefault(id(tensor), fqn)
        if canonical != fqn:
            aliases[fqn] = canonical
    return first, aliases, raw


def param_names(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): FQN}``, a tied parameter under its first name (as torch's optimizer state dict names it)."""
    return _names(model)[0]


def model_parts(model) -> list[nn.Module]:
    """``model`` as a list of modules: itself, or the stage modules of a list (a pipeline rank's stages)."""
    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    wrong = [type(p).__name__ for p in parts if not isinstance(p, nn.Module)]
    if not parts or wrong:
        raise ValueError(f"model must be a module or a non-empty list of this rank's pipeline stage modules, "
                         f"got {wrong or 'an empty list'}")
    return parts


def _pairs(model, optimizer) -> list[tuple[nn.Module, Any]]:
    """``[(stage module, its optimizer or None)]``: one optimizer per stage when there are several."""
    parts = model_parts(model)
    if optimizer is None:
        return [(part, None) for part in parts]
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if len(optimizers) != len(parts):
        raise ValueError(f"optimizer: {len(optimizers)} optimizer(s) for {len(parts)} stage module(s); with several "
                         "stages give one optimizer per stage, in the same order (torch's state-dict functions map "
                         "an optimizer's parameters through one module)")
    return list(zip(parts, optimizers))


def model_tensors(model) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(``{FQN: value}`` each tensor once, DTensors for parameters; ``{alias: FQN}``) from ``get_model_state_dict``.

    The values share storage with the model: DCP reads into them in place. ``model`` may be a list of
    stage modules: their tensors together (a name in two stages is refused).
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for part in model_parts(model):
        sharded_state(part)
        state = get_model_state_dict(part)
        _, part_aliases, _ = _names(part, state.keys())
        twice = sorted(k for k in state if k in tensors)
        if twice:
            raise ValueError(f"model: stage modules {type(part).__name__} and an earlier one both hold {twice[:4]}; "
                             "each of the whole model's names belongs to one stage")
        tensors.update({k: v for k, v in state.items() if k not in part_aliases and isinstance(v, torch.Tensor)})
        aliases.update(part_aliases)
    return tensors, aliases


def describe_model(model: nn.Module) -> dict:
    """JSON-friendly facts: tensors (shape, dtype, kind), tied aliases, mesh and placements."""
    from ..engine.placements import STRATEGY_PLACEMENTS, describe

    plan = sharding_plan(model_parts(model)[0])
    tensors, aliases = model_tensors(model)
    params = {_clean(n): p for part in model_parts(model) for n, p in part.named_parameters()}
    described = {}
    for fqn, value in tensors.items():
        row = {"shape": list(value.shape), "dtype": _dtype_name(value.dtype)}
        if fqn in params:
            row.update(kind="param", requires_grad=bool(params[fqn].requires_grad))
        else:
            row["kind"] = "buffer"
        described[fqn] = row
    names = {v: k for k, v in STRATEGY_PLACEMENTS.items()}
    axes = {}
    for i, (axis, placements) in enumerate(plan.placements.items()):
        axes[axis] = {"size": plan.mesh.size(i), "strategy": names.get(placements, describe({axis: placements}))}
    return {
        "tensors": described,
        "tied": aliases,
        "mesh": {"dim_names": list(plan.mesh.mesh_dim_names), "shape": list(plan.mesh.mesh.shape)},
        "placements": describe(plan.placements),
        "axes": axes,
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------ the optimizer
def _optimizer_params(model: nn.Module, optimizer) -> list[tuple[dict, list[tuple[str, torch.Tensor]]]]:
    """Each param group with its ``(FQN, parameter)`` pairs; refuses parameters that are not the model's."""
    names = param_names(model)
    out = []
    for group in optimizer.param_groups:
        pairs = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    "the optimizer holds a parameter that is not one of the model's sharded parameters "
                    f"(shape {tuple(p.shape)}); build the optimizer from model.parameters() after fully_shard")
            pairs.append((names[id(p)], p))
        out.append((group, pairs))
    return out


def _state_kind(value: Any, param: torch.Tensor) -> str:
    if isinstance(value, DTensor):
        return "sharded"
    if isinstance(value, torch.Tensor):
        on_param = value.device.type != "cpu" and value.device == param.device
        return "tensor@param" if on_param else "tensor@cpu"
    return "object"


def _optimizer_entries(model: nn.Module, optimizer) -> dict[str, Any]:
    groups = _optimizer_params(model, optimizer)
    if optimizer.state:
        osd = get_optimizer_state_dict(model, optimizer)
    else:  # see the module docstring: torch's function would step the optimizer to create state
        osd = {"state": {}, "param_groups": [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [fqn for fqn, _ in pairs]}
            for group, pairs in groups]}
    entries: dict[str, Any] = {}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            entries[f"{OPTIM_PREFIX}{fqn}/{key}"] = value.detach() if isinstance(value, torch.Tensor) else value
    entries[OPTIM_GROUPS_KEY] = osd["param_groups"]
    return entries


def optimizer_class(optimizer) -> str:
    return type(optimizer).__name__


def describe_optimizer(model, optimizer) -> dict:
    kinds: dict[str, dict[str, str]] = {}
    pairs_of = _pairs(model, optimizer)
    for part, opt in pairs_of:
        for _, pairs in _optimizer_params(part, opt):
            for fqn, p in pairs:
                state = opt.state.get(p, {})
                if state:
                    kinds[fqn] = {key: _state_kind(v, p) for key, v in state.items()}
    first = pairs_of[0][1]
    return {"class": optimizer_class(first), "groups": len(first.param_groups), "state": kinds}


def merge_descriptions(described: list[tuple[dict, dict | None]]) -> tuple[dict, dict | None]:
    """One ``(describe_model, describe_optimizer)`` for the whole model from every rank's (pipeline stages
    hold different tensors); the mesh and placements are the first rank's."""
    model = dict(described[0][0])
    model["tensors"] = {k: v for d, _ in described for k, v in d["tensors"].items()}
    model["tied"] = {k: v for d, _ in described for k, v in d["tied"].items()}
    optim = described[0][1]
    if optim is not None:
        optim = {**optim, "state": {k: v for _, o in described for k, v in (o or {}).get("state", {}).items()}}
    return model, optim


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    return a == b


def merge_param_groups(lists: list[list[dict]]) -> list[dict]:
    """Param groups of several stages (or ranks) as the whole model's: group ``j`` of each, its ``params``
    joined in order (each name once), its hyperparameters the same everywhere (else refused)."""
    merged = [dict(g, params=list(g["params"])) for g in lists[0]]
    for groups in lists[1:]:
        if len(groups) != len(merged):
            raise ValueError(f"optimizer: the stages' optimizers have {len(merged)} and {len(groups)} param groups; "
                             "a pipeline checkpoint needs the same groups (by index) on every stage")
        for j, (into, group) in enumerate(zip(merged, groups)):
            differ = sorted(k for k in set(into) | set(group) if k != "params"
                            and not _same(into.get(k), group.get(k)))
            if differ:
                raise ValueError(f"optimizer: param group {j} has different {differ} on different stages; a pipeline "
                                 "checkpoint needs group j's hyperparameters to be the same on every stage")
            seen = set(into["params"])
            into["params"] += [p for p in group["params"] if p not in seen]
    return merged


def _all_gather(value: Any, process_group) -> list:
    """``value`` of every rank of ``process_group`` (just this one's without a process group)."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, value, group=process_group)
    return out


# ------------------------------------------------------------------- save
def save_state(
    path: str | Path,
    model: nn.Module | list[nn.Module],
    optimizer=None,
    extra: Any = None,
    *,
    save_rng: bool = True,
    process_group=None,
) -> Metadata:
    """Write this rank's shard of ``model`` (and ``optimizer``) into the DCP folder ``path`` (a collective).

    ``model``: a module, or this rank's pipeline stage modules with ``optimizer`` one per stage.
    """
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    pairs = _pairs(model, optimizer)
    tensors, _ = model_tensors([part for part, _ in pairs])
    state: dict[str, Any] = {MODEL_PREFIX + k: v.detach() for k, v in tensors.items()}
    if optimizer is not None:
        groups = []
        for part, opt in pairs:
            entries = _optimizer_entries(part, opt)
            groups.append(entries.pop(OPTIM_GROUPS_KEY))
            state.update(entries)
        # every rank writes the same optim_groups: the whole model's (pipeline ranks hold different parameters);
        # merged after the gather, so that a refusal is every rank's
        state[OPTIM_GROUPS_KEY] = merge_param_groups([g for mine in _all_gather(groups, process_group) for g in mine])
    state[f"extra/rank{rank}"] = extra
    if save_rng:
        state[f"rng/rank{rank}"] = capture_rng_state()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(str(path)),
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )


# ------------------------------------------------------------------- load
class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model (missing or extra keys, shape mismatch, another optimizer)."""

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


def _check_model(path, md: Metadata, wanted: dict[str, torch.Size], aliases: dict[str, str],
                 raw: dict[str, str], strict: bool, process_group=None) -> tuple[dict[str, str], list[str]]:
    """Match the model's keys against the checkpoint: ``({FQN: saved key}, skipped FQNs)``.

    A checkpoint may name a tied weight by another of its names, or a weight
    by its name with wrapper parts (``_checkpoint_wrapped_module``...). The
    ranks' findings are joined (a collective), so pipeline stages together
    must cover the checkpoint, and every rank raises the same error.
    """
    saved = {k[len(MODEL_PREFIX):] for k in md.state_dict_metadata if k.startswith(MODEL_PREFIX)}
    others: dict[str, list[str]] = {}
    for alias, canonical in aliases.items():
        others.setdefault(canonical, []).append(alias)
    rename: dict[str, str] = {}
    for name in wanted:
        if name not in saved:
            found = [n for n in [raw.get(name)] + others.get(name, []) + [raw.get(a) for a in others.get(name, [])]
                     if n is not None and n in saved]
            if found:
                rename[name] = found[0]
    used = {rename.get(n, n) for n in wanted}
    missing = sorted(n for n in wanted if rename.get(n, n) not in saved)
    known = set(wanted) | set(aliases) | set(raw.values())
    expected = used | {s for s in saved if s in known and aliases.get(s, s) in wanted}
    mismatched = []
    for name, shape in wanted.items():
        size = _saved_size(md, MODEL_PREFIX + rename.get(name, name))
        if size is not None and tuple(size) != tuple(shape):
            mismatched.append((name, tuple(size), tuple(shape)))
    skip = set(missing) | {m[0] for m in mismatched}
    found = _all_gather((expected, missing, mismatched), process_group)
    expected = set().union(*(e for e, _, _ in found))
    unexpected = sorted(saved - expected)
    missing = sorted({n for _, m, _ in found for n in m})
    mismatched = sorted({row for _, _, m in found for row in m})
    if (missing or unexpected or mismatched) and strict:
        raise CheckpointMismatchError(path, missing, unexpected, mismatched)
    if skip or unexpected:
        warnings.warn(
            f"strict=False: loading {path} without {sorted(skip)}; ignoring checkpoint keys {unexpected}",
            stacklevel=3,
        )
    return {name: MODEL_PREFIX + rename.get(name, name) for name in wanted if name not in skip}, sorted(skip)


def load_state(
    path: str | Path,
    model: nn.Module | list[nn.Module],
    optimizer=None,
    *,
    strict: bool = True,
    restore_rng: bool = True,
    meta: dict | None = None,
    process_group=None,
) -> LoadedState:
    """Read this rank's part of ``model`` (and ``optimizer``) from the DCP folder ``path`` (a collective).

    Works for any world size and strategy: DCP's default load planner reads,
    for each DTensor, the saved chunks that overlap its local shard. ``meta``
    is the manager's ``shardwise.json`` (optimizer class and state kinds,
    saved world size); without it they are inferred from the DCP metadata.
    ``model``: a module, or this rank's pipeline stage modules with ``optimizer``
    one per stage; the checkpoint may come from any other pipeline layout.
    """
    pairs = _pairs(model, optimizer)
    path = Path(path)
    meta = meta or {}
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    reader = dcp.FileSystemReader(str(path))
    md = read_dcp_metadata(path, reader)

    parts = [part for part, _ in pairs]
    tensors, _ = model_tensors(parts)
    aliases, raw = {}, {}
    for part in parts:
        _, part_aliases, part_raw = _names(part)
        aliases.update(part_aliases)
        raw.update(part_raw)
    keep, skipped = _check_model(path, md, {k: v.shape for k, v in tensors.items()}, aliases, raw, strict,
                                 process_group)
    state: dict[str, Any] = {saved_key: tensors[name] for name, saved_key in keep.items()}
    renamed = {name: key[len(MODEL_PREFIX):] for name, key in keep.items()}

    installer = None
    if optimizer is not None:
        installer = _plan_optimizer_load(path, md, pairs, meta, state, strict, skipped, renamed, process_group)

    saved_world = meta.get("world_size")
    extra_key = f"extra/rank{rank}" if saved_world == world else "extra/rank0"
    if extra_key in md.state_dict_metadata:
        state[extra_key] = None
    rng_key = f"rng/rank{rank}"
    want_rng = restore_rng and saved_world == world and rng_key in md.state_dict_metadata
    if want_rng:
        state[rng_key] = None

    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, storage_reader=reader, planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 process_group=process_group, no_dist=not dist.is_initialized())
    for part in parts:
        part.mark_weights_modified()  # the parameters' local shards were written in place

    if installer is not None:
        installer(state)
    if want_rng:
        restore_rng_state(state[rng_key])
    elif restore_rng and saved_world is not None and saved_world != world and rank == 0:
        warnings.warn(
            f"{path} was saved on {saved_world} ranks and is loaded on {world}: RNG states are not restored "
            "(they are per rank)", stacklevel=2)
    return LoadedState(step=meta.get("step"), extra=state.get(extra_key), rng_restored=want_rng, skipped=skipped)


def _plan_optimizer_load(path, md, pairs_of, meta, state, strict, skipped, renamed, process_group):
    """Add the optimizers' entries to ``state``; return what installs them once DCP has read them."""
    saved_opt = meta.get("optimizer") or {}
    saved_class, current_class = saved_opt.get("class"), optimizer_class(pairs_of[0][1])
    if OPTIM_GROUPS_KEY not in md.state_dict_metadata:
        if strict:
            raise CheckpointMismatchError(path, what="optimizer", detail="the checkpoint holds no optimizer state")
        warnings.warn(f"{path} holds no optimizer state; the optimizer is left as it is", stacklevel=3)
        return None
    if saved_class is not None and saved_class != current_class:
        detail = (f"its optimizer state is {saved_class}'s and this optimizer is {current_class}: their states do "
                  "not carry over (load the model alone with optimizer=None to start a new optimizer)")
        if strict:
            raise CheckpointMismatchError(path, what="optimizer", detail=detail)
        warnings.warn(f"{path}: {detail}; strict=False: the optimizer is left as it is", stacklevel=3)
        return None

    kinds = saved_opt.get("state") or {}
    saved_keys: dict[str, list[str]] = {}
    for key in md.state_dict_metadata:
        if key.startswith(OPTIM_PREFIX):
            fqn, _, name = key[len(OPTIM_PREFIX):].rpartition("/")
            saved_keys.setdefault(fqn, []).append(name)
    skip = set(skipped)
    plans = []  # per stage: (module, optimizer, its groups, {FQN: {state key: checkpoint key}})
    for part, optimizer in pairs_of:
        groups = _optimizer_params(part, optimizer)
        layout: dict[str, dict[str, str]] = {}
        for _, pairs in groups:
            for fqn, p in pairs:
                source = renamed.get(fqn, fqn)
                if fqn in skip:
                    continue
                for name in saved_keys.get(source, []):
                    key = f"{OPTIM_PREFIX}{source}/{name}"
                    entry = md.state_dict_metadata[key]
                    kind = kinds.get(source, {}).get(name) or _infer_kind(entry, p)
                    if isinstance(entry, BytesStorageMetadata) or kind == "object":
                        state[key] = None
                    elif kind == "sharded" and isinstance(p, DTensor):
                        state[key] = torch.empty_like(p, dtype=entry.properties.dtype)  # laid out like p
                    else:
                        device = p.device if kind == "tensor@param" else "cpu"
                        state[key] = torch.empty(entry.size, dtype=entry.properties.dtype, device=device)
                    layout.setdefault(fqn, {})[name] = key
        plans.append((part, optimizer, groups, layout))
    state[OPTIM_GROUPS_KEY] = None

    def install(loaded: dict[str, Any]) -> None:
        saved_groups = loaded[OPTIM_GROUPS_KEY]
        # The whole model's groups: every stage's and every rank's group j together (a collective).
        mine = [[[renamed.get(fqn, fqn) for fqn, _ in pairs] for _, pairs in groups] for _, _, groups, _ in plans]
        everyone = [names for rank in _all_gather(mine, process_group) for names in rank]
        counts = {len(names) for names in everyone}
        fits = counts == {len(saved_groups)} and all(
            set(s["params"]) == {n for names in everyone for n in names[j]} for j, s in enumerate(saved_groups))
        if not fits:
            current = [[n for names in everyone for n in names[j]] for j in range(max(counts))]
            message = ("the optimizer's parameter groups differ from the checkpoint's "
                       f"(checkpoint: {[s['params'] for s in saved_groups]}, optimizer: {current})")
            if strict:
                raise CheckpointMismatchError(path, what="optimizer", detail=message)
            warnings.warn(f"{path}: {message}; hyperparameters are not restored", stacklevel=4)
        for part, optimizer, groups, layout in plans:
            if fits:
                hyper = [{k: v for k, v in s.items() if k != "params"} for s in saved_groups]
            else:
                hyper = [{k: v for k, v in group.items() if k != "params"} for group, _ in groups]
            osd = {
                "state": {fqn: {name: loaded[key] for name, key in keys.items()} for fqn, keys in layout.items()},
                "param_groups": [{**h, "params": [fqn for fqn, _ in pairs]} for h, (_, pairs) in zip(hyper, groups)],
            }
            # strict=False: a parameter that never had a gradient has no state, in the checkpoint as in a run.
            set_optimizer_state_dict(part, optimizer, osd, options=StateDictOptions(strict=False))

    return install


def _infer_kind(entry, param: torch.Tensor) -> str:
    if isinstance(entry, BytesStorageMetadata):
        return "object"
    if len(entry.size) and tuple(entry.size) == tuple(param.shape):
        return "sharded"
    return "tensor@cpu"
