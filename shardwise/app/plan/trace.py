"""Memory of one candidate, from the real model: wrapped by ``fully_shard`` in a simulated world, one step run.

The model is built under FakeTensorMode on rank 0 of a fake process group of the target size
(:mod:`.simulate`), wrapped with the candidate's arguments, and two training steps run (the first makes
AdamW's state; the second is the steady state). :class:`.live_bytes.LiveBytes` follows every storage the
engine, autograd and the optimizer make and free, so the peak is the allocator's own account of the real
code path; the parts beside it are read off the engine (its groups' buffers), the optimizer's state and
autograd's saved tensors.

A model of identical layers is traced at three small depths; when the three agree on a straight line
(every quantity grows by the same bytes per layer) the line is extended to the whole depth, else the
whole model is traced. ``tests/app/test_plan.py`` holds both to a whole trace and to a real gloo run.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch

from ... import Collectives
from ...engine.model_ops import compute_parameters
from .candidates import Candidate
from .live_bytes import LiveBytes
from .model_source import ModelSource
from .simulate import cached_mesh, simulated_world

__all__ = ["MemoryTrace", "trace_memory", "trace_once"]

_DEPTHS = (2, 3, 4)


@dataclass
class MemoryTrace:
    """Bytes per rank. peak: the steady step's peak on the device; phase: the moment it was at; peaks: the
    peak of each moment (``forward``, ``backward head`` (the loss and the output head), ``backward top layer``
    and ``backward layer j`` (from the backward hook of that layer on), ``optimizer step``); parts: the persistent terms after the
    step and the activations autograd saved; host: offloaded state; allocations: the steady step's new
    storages in order (phase, bytes). ``bound``: not a trace but the fast path's lower bound of the peak
    (``estimate.state_bound``) for a candidate it showed cannot fit (:func:`.planner.memory_of`)."""

    peak: int
    parts: dict[str, int]
    host: int = 0
    phase: str = ""
    allocations: list = field(default_factory=list, repr=False)
    extrapolated: bool = False
    at_peak: dict = field(default_factory=dict, repr=False)  # "phase:op" -> bytes live at the peak (explain)
    peaks: dict = field(default_factory=dict, repr=False)
    before_step: int = 0  # live bytes as the steady step starts (the state it inherits)
    bound: bool = False  # not traced: ``peak`` is the fast path's lower bound (``estimate.state_bound``), over the device


_ENDS = ("forward", "backward head", "backward top layer", "backward layer 0", "optimizer step")


def _line(a: dict, b: dict, keys, steps: int) -> dict:
    """``a + steps (b - a)`` for each of ``keys``."""
    return {k: a.get(k, 0) + steps * (b.get(k, 0) - a.get(k, 0)) for k in keys}


def extend(traces: list[MemoryTrace], depths: tuple[int, ...], layers: int) -> MemoryTrace | None:
    """The trace at ``layers`` layers from traces at three ``depths`` one layer apart, or None where they are
    not on one line.

    Each moment's live bytes is a line in depth at the moments at the ends of forward and backward (every
    saved activation, every gradient shard, the optimizer step: each layer adds the same bytes), and the
    moments between them are below the ends (one layer's activations go as one layer's gradient shard
    comes); the deepest trace is checked for both before the line is extended.
    """
    a, b, c = traces
    parts_keys = set(a.parts) | set(b.parts) | set(c.parts)
    ends = [k for k in _ENDS if all(k in t.peaks for t in traces)]
    for keys, get in ((ends, lambda t: t.peaks), (parts_keys, lambda t: t.parts)):
        if _line(get(a), get(b), keys, 2) != {k: get(c).get(k, 0) for k in keys}:
            return None
    if a.host + 2 * (b.host - a.host) != c.host or _middle_above_ends(c, ends):
        return None
    steps = layers - depths[1]
    peaks = _line(b.peaks, c.peaks, ends, steps)
    phase = max(peaks, key=peaks.get)
    return MemoryTrace(peaks[phase], _line(b.parts, c.parts, parts_keys, steps), b.host + steps * (c.host - b.host),
                       phase, [], True, peaks=peaks)


def _middle_above_ends(trace: MemoryTrace, ends=None) -> bool:
    """Whether a moment between the ends (a middle layer's backward) peaks above them: the line cannot say it."""
    ends = [k for k in _ENDS if k in trace.peaks] if ends is None else ends
    return max(trace.peaks.values()) > max(trace.peaks[k] for k in ends)


class BackendCollectives(Collectives):
    """shardwise's collectives, with what the backend allocates inside a call left out of the count.

    NCCL's calls write into the buffers they are given and allocate nothing through torch; gloo's
    reduce-scatter makes its own temporaries and the one-by-one gather copies an input that shares its
    output's storage (which every fake storage seems to, having no address). Leaving them out makes a
    gloo run, the simulation and a GPU run count the same step."""

    def __init__(self, tracker: LiveBytes):
        self.tracker = tracker

    def _quiet(self, method, tensors, *args):
        held = [_holders(t) for t in tensors]
        self.tracker.quiet += 1
        try:
            return method(*args)
        finally:
            self.tracker.quiet -= 1
            _let_go(tensors, held)

    def gather(self, outs, ins, axis):
        self._quiet(super().gather, [*outs, *ins], outs, ins, axis)

    def reduce_scatter(self, outs, ins, axis):
        self._quiet(super().reduce_scatter, [*outs, *ins], outs, ins, axis)

    def all_reduce(self, t, axes, average=True):
        self._quiet(super().all_reduce, [t], t, axes, average)

    def all_reduce_max(self, t, axes):
        self._quiet(super().all_reduce_max, [t], t, axes)


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """How many references hold ``t`` and its storage (C++ ones included)."""
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _let_go(tensors, held, limit_s: float = 1.0) -> None:
    """Wait until the backend holds none of ``tensors`` any more. gloo's worker thread marks a collective done,
    then drops its references to the tensors: a storage the engine lets go of right after the call was freed
    either then or a moment later, so a real run's peak moved by that buffer from run to run (a fake backend
    keeps none). Bounded: a reference kept past ``limit_s`` is left as it is."""
    deadline = time.monotonic() + limit_s
    for t, before in zip(tensors, held):
        while time.monotonic() < deadline and any(now > then for now, then in zip(_holders(t), before)):
            time.sleep(1e-4)


def is_sharded(model) -> bool:
    import shardwise

    return isinstance(model, shardwise.ShardedModule)


def run_step(model, opt, inputs, tracker: LiveBytes | None, saved: dict | None = None, after_step=None,
             layers: list | None = None) -> None:
    """One training step (forward, backward, optimizer step, ``zero_grad``), phases named for the tracker;
    ``saved`` collects the storages autograd saves, ``after_step()`` runs before ``zero_grad``."""
    import contextlib
    import gc

    def phase(name):
        if tracker is not None:
            tracker.set_phase(name)

    handles = []
    for j, layer in enumerate(layers or []):  # the moment each layer's backward starts (its output's gradient)
        def mark(module, args, output, j=j):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                name = "backward top layer" if j == len(layers) - 1 else f"backward layer {j}"
                output.register_hook(lambda grad: phase(name))
        handles.append(layer.register_forward_hook(mark))

    weights = {p.untyped_storage()._cdata for p in model.parameters()}  # the sharded main weights
    if saved is not None and is_sharded(model):
        weights |= {p.untyped_storage()._cdata for p in compute_parameters(model)}  # gathered, same every step

    def pack(t):
        storage = t.untyped_storage()
        if saved is not None and storage._cdata not in weights:
            saved[storage._cdata] = storage.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if saved is not None else contextlib.nullcontext()
    gc.collect()  # what the last step left in reference cycles goes now, not at a moment that differs by run
    phase("forward")
    with hooks:
        loss = model(*inputs)
    if loss.dim():
        loss = loss.float().sum()
    phase("backward head")
    loss.backward()
    for h in handles:
        h.remove()
    phase("optimizer step")
    opt.step()
    if after_step is not None:
        after_step()
    opt.zero_grad(set_to_none=True)
    phase("")


#: traces already made in this process, by what they depend on (``_trace_key``), the oldest dropped past
#: ``_KEPT``: the planner's candidates and its search for what would fit, and tests, trace the same step again
_TRACES: OrderedDict = OrderedDict()
_KEPT = 256


def _trace_key(source: ModelSource, world: int, cand: Candidate, seq: int, depth: int | None):
    """What a trace depends on: the reference GPT's config (a source without one, a factory, is not kept), the
    world, the candidate less FP8 (timed, not traced), the sequence and the depth. A config holding process
    groups (which ``to_dict`` leaves out) is not kept either."""
    cfg = source.config
    if cfg is None or any(getattr(cfg, f, None) is not None for f in ("tp_group", "ep_group", "cp_group")):
        return None
    model = json.dumps(source.config.to_dict(), sort_keys=True, default=str)
    return model, source.vocab_units, world, replace(cand, fp8=False, fp8_gather=False), seq, depth


def trace_once(source: ModelSource, world: int, cand: Candidate, seq: int, depth: int | None = None,
               explain: bool = False) -> MemoryTrace:
    """Wrap ``source`` (at ``depth`` layers; None: whole) as ``cand`` says on rank 0 of ``world`` and trace a step.
    ``explain``: also the live bytes at the peak by the phase and op that made them (slower). The same step is
    traced once per process (``_TRACES``)."""
    key = None if explain else _trace_key(source, world, cand, seq, depth)
    if key is not None and key in _TRACES:
        _TRACES.move_to_end(key)
        return _TRACES[key]
    with simulated_world(world):
        mesh = cached_mesh((cand.replicas,), lambda: _mesh(cand))
        found = measure_step(source, mesh, cand, seq, depth, explain)
    if key is not None:
        _TRACES[key] = found
        while len(_TRACES) > _KEPT:
            _TRACES.popitem(last=False)
    return found


def _mesh(cand: Candidate):
    import shardwise

    return shardwise.build_dp_mesh(outer=cand.replicas if cand.replicas > 1 else None)


_SET_ASIDE = [0]  # how many settled_heap blocks are open: the outermost freezes and unfreezes


@contextlib.contextmanager
def settled_heap(collect: bool = False):
    """The objects alive before (torch, the caller's; ``collect``: their garbage collected first) set aside from
    the garbage collector until the outermost such block ends: each traced step starts with a full
    ``gc.collect()`` (:func:`run_step`) so that what the last step left in reference cycles goes at the same
    moment every run, and without this each of those collections walked every object of the process (0.15 s
    each under pytest, two a trace); the step's own objects are still collected. Nested blocks (a plan's
    traces) leave it to the outermost."""
    outermost = _SET_ASIDE[0] == 0
    if outermost:
        if collect:
            gc.collect()
        gc.freeze()
    _SET_ASIDE[0] += 1
    try:
        yield
    finally:
        _SET_ASIDE[0] -= 1
        if outermost:
            gc.unfreeze()


def measure_step(source: ModelSource, mesh, cand: Candidate, seq: int, depth: int | None = None,
                 explain: bool = False) -> MemoryTrace:
    """Build, wrap and run two steps on ``mesh`` (``None``: the data-parallel mesh ``cand`` names over the
    default process group), following every storage: the simulation's path, and a real gloo run's."""
    with settled_heap():
        return _measure_step(source, mesh, cand, seq, depth, explain)


def _measure_step(source, mesh, cand, seq, depth, explain) -> MemoryTrace:
    import shardwise

    mesh = _mesh(cand) if mesh is None else mesh
    tracker = LiveBytes()
    with tracker:
        model = source.build(depth, cand.activation_checkpointing)
        kw = dict(strategy=cand.strategy, unit_modules=source.unit_spec(model),
                  mixed_precision=shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                  reshard_after_forward=cand.reshard_after_forward, collectives=BackendCollectives(tracker),
                  check_module_states=False)  # fake weights have no values to compare across ranks
        if cand.replicas > 1:
            kw["outer_dp_sharding_strategy"] = cand.outer_strategy
        if cand.offload_fraction:
            kw["offload_policy"] = shardwise.OffloadPolicy(fraction=cand.offload_fraction)
        model = shardwise.fully_shard(model, mesh, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not cand.offload_fraction)
        inputs = source.inputs(cand.micro_batch, seq)
        layers = source.layer_modules(model) if source.layer_modules else None
        run_step(model, opt, inputs, tracker, layers=layers)  # AdamW's state is made here
        tracker.reset_peak()
        before = tracker.current
        saved: dict[int, int] = {}
        held: dict = {}
        tracker.explain = explain
        run_step(model, opt, inputs, tracker, saved, after_step=lambda: held.update(_held(model, opt)), layers=layers)
        peak, phase, log, peaks = tracker.peak, tracker.peak_phase, list(tracker.log), dict(tracker.peaks)
        at_peak = dict(sorted(tracker.at_peak.items(), key=lambda kv: -kv[1]))
    host = held.pop("host")
    parts = {**held, "activations": sum(saved.values())}
    # on a machine with GPUs the offloaded state is host memory; the simulation kept it beside the rest
    return MemoryTrace(peak - host, parts, host, phase, log, at_peak=at_peak,
                       peaks={k: v - host for k, v in peaks.items()}, before_step=before - host)


def _held(model, opt) -> dict[str, int]:
    """What the engine and AdamW hold after the optimizer step, read through public faces: the main weights
    (the DTensor parameters' local storage), the compute weights at rest (the gathered parameters' storage:
    freed under ZeRO-3, the model shard under ZeRO-1/2), the gradient shards (``.grad``'s local storage) and
    AdamW's state. Offloaded state is counted with the rest (an upper bound for the GPU)."""
    def unique(tensors) -> int:
        seen = {}
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            seen[local.untyped_storage()._cdata] = local.untyped_storage().nbytes()
        return sum(seen.values())

    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"main": unique(params), "weights": unique(compute_parameters(model)),
            "grads": unique(p.grad for p in params if p.grad is not None), "optimizer": unique(state), "host": 0}


def trace_memory(source: ModelSource, world: int, cand: Candidate, seq: int, exact: bool = False) -> MemoryTrace:
    """The candidate's memory per rank: a whole trace, or three shallow ones extended (see :func:`extend`). The
    deepest is traced first: where a middle layer's moment peaks above the ends there, no line will do, and the
    whole model is traced without the other two."""
    layers = source.layers
    if exact or layers is None or layers <= _DEPTHS[-1]:
        return trace_once(source, world, cand, seq)
    deepest = trace_once(source, world, cand, seq, _DEPTHS[-1])
    if _middle_above_ends(deepest):  # no line will do: the shallower two are not traced
        return trace_once(source, world, cand, seq)
    extended = extend([*(trace_once(source, world, cand, seq, d) for d in _DEPTHS[:-1]), deepest], _DEPTHS, layers)
    return extended if extended is not None else trace_once(source, world, cand, seq)
