"""How many bytes the engine holds per GPU and per host, from parameter counts, strategy and offload.

The buffers of the planner's fast path (:mod:`.estimate`); the trace (``trace.py``) reads the same buffers off
the real engine.

Every term is a buffer :class:`~shardwise.engine.param_group.ParamGroup` builds, or a
temporary the collectives stage (``buffers.py``), at the size its *level* gives
it (level ``j`` = a parameter split over the first ``j`` sharded axes, see
``design.md``). :class:`BufferSizes` mirrors ``ParamGroup.__init__`` buffer by
buffer, for ``n`` parameters of one group kind:

=====================  ==================================================  ==========================
buffer                 size on one rank                                    lives
=====================  ==================================================  ==========================
``main``               main dtype x n / degree(optimizer level)            always (host if offloaded;
                                                                           none when it aliases the
                                                                           model shard: fp32 compute)
``weights``            compute dtype x n / degree(parameter level)         always; none for ZeRO-3
(``model_shard``)                                                          with a lower compute dtype
                                                                           (cast at gather time)
``optimizer``          states x main dtype x n / degree(optimizer level)   always (host if offloaded)
``grads``              grad dtype x n / degree(optimizer level)            from a group's reduction
(``main_grad``)                                                            to ``zero_grad()`` (host
                                                                           when offloaded)
``grad accumulation``  grad dtype x n / degree(gradient level), only when  across ``no_sync``
(``grad_acc``)         gradients are Partial on an axis the optimizer      micro-batches; one unit's
                       state is sharded on (ZeRO-1, HFSDP)                 worth otherwise
``gathered``           compute dtype x n (level 0), when parameters are    a unit's forward/backward,
(``unsharded``)        sharded (none where the model shard is it: one      plus the prefetched next
                       rank per parameter axis, compute = main dtype)
``gather staging``     compute dtype x n / degree(parameter level): the    held by the staging pool
                       cast of the fp32 main shard (ZeRO-3 mixed           between gathers of one
                       precision)                                          unit shape
``unit grads``         compute dtype x n: autograd's gradients of the      a unit's backward until
                       unsharded parameters                                its reduction copies them
``reduce staging``     comm dtype x n (the flat copy of the unit grads)    a unit's reduction, held
                       + reduce-scatter outputs at each level but the      until the next unit's
                       last (that one lands in the buffer it fills)        reduction lands
=====================  ==================================================  ==========================

:func:`estimate_state_bytes` adds them at the end of backward (every gradient
shard reduced, the largest unit's reduction in flight) and at the optimizer
step; :mod:`.estimate` (the planner's fast path) adds a model's activations and walks the
moments of one step. Offloaded groups (``OffloadPolicy``) keep the main
weights, the optimizer state and the finished gradient shard in pinned host
memory; the GPU keeps their compute-dtype shard. The host buffers are
ordinary allocations registered with CUDA in place (``offload.HostMemory``),
so they take exactly their size (torch's pinned allocator would round each up
to a power of two).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from ...engine.placements import resolve_strategy, strategy_placements

__all__ = ["GIB", "MemoryEstimate", "BufferSizes", "estimate_state_bytes", "state_phases", "offloaded_units",
           "host_parts", "combine"]

GIB = 2**30


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _amount(nbytes: float, unit: int) -> str:
    return f"{nbytes / unit:.1f}"


def _unit(nbytes: float) -> tuple[int, str]:
    """GiB, or MiB below 1 GiB."""
    return (GIB, "GiB") if nbytes >= GIB else (2**20, "MiB")


@dataclass
class MemoryEstimate:
    """Peak bytes per GPU and per host, with the terms that make them up.

    gpu_bytes: the largest of ``phases`` (bytes allocated on one GPU at that moment).
    host_bytes: bytes of host memory on one host (``ranks_per_host`` ranks).
    parts: the GPU terms of the peak moment, which add up to ``gpu_bytes``.
    host_parts: the host terms per host, which add up to ``host_bytes``.
    phase: the moment of the step the GPU peak is at; phases: every moment weighed; terms: each moment's
    GPU terms (``phases`` is their sums).
    """

    gpu_bytes: int
    host_bytes: int
    parts: dict[str, int]
    host_parts: dict[str, int] = field(default_factory=dict)
    phase: str = ""
    phases: dict[str, int] = field(default_factory=dict)
    ranks_per_host: int = 1
    notes: tuple[str, ...] = ()
    inputs: dict = field(default_factory=dict, repr=False)  # what it was estimated from (for suggestions)
    terms: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)

    def dominant(self, count: int = 3) -> list[tuple[str, int]]:
        """The ``count`` largest GPU terms, largest first."""
        return sorted(((k, v) for k, v in self.parts.items() if v > 0), key=lambda kv: -kv[1])[:count]

    def describe(self, device_type: str = "cuda") -> str:
        """One line: per GPU (terms of 1% or more, largest first) at its peak moment, and per host. On the
        CPU (``device_type="cpu"``) the device memory is each rank's own: "per rank", and no empty host part."""
        unit, name = _unit(self.gpu_bytes)
        terms = ", ".join(f"{k} {_amount(b, unit)}" for k, b in self.dominant(len(self.parts))
                          if b >= self.gpu_bytes / 100)
        where = f" at {self.phase}" if self.phase else ""
        line = f"per {'GPU' if device_type == 'cuda' else 'rank'} {_amount(self.gpu_bytes, unit)} {name}{where} ({terms})"
        if not self.host_bytes:
            return line + (", per host 0 GiB" if device_type == "cuda" else "")
        unit, name = _unit(self.host_bytes)
        host_terms = ", ".join(f"{k} {_amount(v, unit)}" for k, v in self.host_parts.items() if v > 0)
        ranks = f" for {self.ranks_per_host} ranks" if self.ranks_per_host > 1 else ""
        return line + f", per host {_amount(self.host_bytes, unit)} {name} ({host_terms}){ranks}"


class BufferSizes:
    """Bytes of each buffer of ``n`` parameters on one rank, for one strategy, precision and offload choice.

    world: data-parallel ranks; outer: size of a hybrid mesh's outer axis (``None`` = one axis),
    with ``outer_strategy`` ``"no_shard"`` (HSDP) or ``"optim"`` (HFSDP). param_dtype ``None``
    computes in the model's own dtype (taken to be ``main_dtype``).
    """

    def __init__(
        self,
        world: int,
        strategy: str | int = "optim_grads_params",
        outer: int | None = None,
        outer_strategy: str | None = "no_shard",
        param_dtype: torch.dtype | None = torch.bfloat16,
        main_dtype: torch.dtype = torch.float32,
        grad_dtype: torch.dtype = torch.float32,
        comm_dtype: torch.dtype | None = None,
        optimizer_states: int = 2,
        offload: bool = False,
    ):
        if world < 1:
            raise ValueError(f"world={world} must be at least 1")
        if outer is not None and (outer < 1 or world % outer):
            raise ValueError(f"outer={outer} must be a positive divisor of world={world}")
        self.world, self.outer, self.offload = world, outer, offload
        self.strategy = resolve_strategy(strategy)
        placements = strategy_placements(self.strategy, outer_strategy if outer else None, "inner", "outer")
        sizes = {"outer": outer, "inner": world // (outer or 1)}
        order = [a for a in ("outer", "inner") if a in placements]  # mesh order

        def sharded(kind: str) -> list[str]:
            return [a for a in order if isinstance(getattr(placements[a], kind), Shard)]

        param_axes = sharded("parameter")
        grad_axes = param_axes + [a for a in sharded("gradient") if a not in param_axes]
        opt_axes = grad_axes + [a for a in sharded("optimizer") if a not in grad_axes]
        self.kp, self.kg, self.m = len(param_axes), len(grad_axes), len(opt_axes)
        self.degree = [1]
        for a in opt_axes:
            self.degree.append(self.degree[-1] * sizes[a])
        self.allreduce_axes = [  # all-reduced in place at finalize: no buffer of their own
            a for a in order
            if isinstance(placements[a].gradient, Partial) and isinstance(placements[a].optimizer, Replicate)
        ]
        self.compute = _size(param_dtype or main_dtype)
        self.main_b, self.grad_b = _size(main_dtype), _size(grad_dtype)
        self.comm_b = _size(comm_dtype or grad_dtype)
        self.states = optimizer_states
        same = (param_dtype or main_dtype) == main_dtype
        # ParamGroup.__init__'s three choices
        self.main_aliases_model = same and not offload
        self.casts_on_gather = not self.main_aliases_model and self.kp == self.m and self.kp > 0 and not offload
        self.main_in_model = self.main_aliases_model and self.m in (self.kp, self.kp + 1)
        # the gathered parameters are the model shard itself, kept: nothing gathered, nothing staged
        # (``persistent_unsharded``: parameters replicated, or one rank per parameter axis with the compute
        # weights the main ones; the engine also asks that the slots match, which a mean count cannot see)
        self.keeps_unsharded = self.kp == 0 or (self.main_aliases_model and self.degree[self.kp] == 1)

    # ----------------------------------------------------------- persistent
    def at(self, level: int, n: float, nbytes: int) -> float:
        """Bytes of ``n`` parameters' level-``level`` slots at ``nbytes`` per element on one rank."""
        return n / self.degree[level] * nbytes

    def weights(self, n: float) -> float:
        """The compute-dtype model shard (``model_shard``), on the GPU."""
        return 0.0 if self.casts_on_gather else self.at(self.kp, n, self.compute)

    def main(self, n: float) -> float:
        """The main weights' own buffer (0 when they live inside the model shard); host when offloaded."""
        return 0.0 if self.main_in_model else self.at(self.m, n, self.main_b)

    def optimizer(self, n: float) -> float:
        """Optimizer state beside the main weights (``states`` tensors like each parameter)."""
        return self.states * self.at(self.m, n, self.main_b)

    def grads(self, n: float) -> float:
        """The finished gradient shards (``main_grad``) at the optimizer level."""
        return self.at(self.m, n, self.grad_b)

    def grad_accumulation(self, n: float) -> float:
        """The Partial accumulation buffer at the gradient level (ZeRO-1, HFSDP); 0 when it is ``main_grad``."""
        return self.at(self.kg, n, self.grad_b) if self.kg < self.m else 0.0

    # ------------------------------------------------------------ transient
    def gathered(self, n: float) -> float:
        """A unit's unsharded compute-dtype parameters (0 when they are the model shard, kept: parameters
        replicated, or one rank per parameter axis with the compute dtype the main weights')."""
        return 0.0 if self.keeps_unsharded else self.at(0, n, self.compute)

    def gather_staging(self, n: float) -> float:
        """What one gather stages: the cast main shard (ZeRO-3 mixed precision) and intermediate levels."""
        if self.keeps_unsharded:
            return 0.0
        staged = self.at(self.kp, n, self.compute) if self.casts_on_gather else 0.0
        return staged + sum(self.at(level, n, self.compute) for level in range(1, self.kp))

    def unit_grads(self, n: float) -> float:
        """Autograd's gradients of a unit's unsharded parameters (compute dtype, level 0)."""
        return self.at(0, n, self.compute)

    def reduce_staging(self, n: float, accumulating: bool = False) -> float:
        """A unit's reduction: the flat comm-dtype copy, the reduce-scatter outputs of every level, the
        accumulation buffer it opens when not accumulating (ZeRO-1, HFSDP), and the device gradient shard an
        offloaded group copies to the host.

        The last level of a chain lands in the fresh buffer it fills, not in a
        staged one: a micro-batch's reduction in the accumulation buffer when it is
        the window's first and travels in the gradient dtype (the flat copy itself
        when there is no level to reduce), the finalizing one in the gradient shard.
        """
        direct = not accumulating and self.comm_b == self.grad_b
        staged = 0.0 if direct and self.kg == 0 else self.at(0, n, self.comm_b)
        staged += sum(self.at(level, n, self.comm_b) for level in range(1, self.kg + 1)
                      if not (direct and level == self.kg))
        if self.kg < self.m:  # finalize: grad_acc reduce-scattered further into the gradient shard
            staged += sum(self.at(level, n, self.grad_b) for level in range(self.kg + 1, self.m))
            if not accumulating:
                staged += self.grad_accumulation(n)
        if self.offload:
            staged += self.grads(n)
        return staged

    # ----------------------------------------------------------------- host
    def host(self, units: Sequence[float]) -> dict[str, float]:
        """Host bytes of offloaded groups of ``units`` parameters each (one rank): main weights, gradient
        shard (page-locked in place, at their own size) and optimizer state."""
        if not self.offload:
            return {"main": 0.0, "grads": 0.0, "optimizer": 0.0}
        return {
            "main": sum(self.at(self.m, n, self.main_b) for n in units),
            "grads": sum(self.at(self.m, n, self.grad_b) for n in units),
            "optimizer": sum(self.optimizer(n) for n in units),
        }


def offloaded_units(units: Sequence[int], fraction: float) -> list[bool]:
    """Which of ``units`` (parameter counts in ``unit_modules`` order, the root last) an
    ``OffloadPolicy(fraction=...)`` offloads: the same walk as ``offload.choose_offloaded``."""
    total, taken, chosen = sum(units), 0, []
    for count in units:
        take = fraction > 0 and taken < fraction * total - 1e-9 * total
        chosen.append(take)
        taken += count if take else 0
    return chosen


def state_phases(
    n_params: int | None = None,
    *,
    world: int,
    strategy: str | int = "optim_grads_params",
    outer: int | None = None,
    outer_strategy: str = "no_shard",
    param_dtype: torch.dtype | None = torch.bfloat16,
    main_dtype: torch.dtype = torch.float32,
    grad_dtype: torch.dtype = torch.float32,
    comm_dtype: torch.dtype | None = None,
    optimizer_states: int = 2,
    optimizer_temps: float = 0.0,
    offload_fraction: float = 0.0,
    largest_unit_params: int = 0,
    units: Sequence[int] | None = None,
    accumulate_grads: bool = False,
    backward_optimizer: bool = False,
    ranks_per_host: int | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, int], dict]:
    """The terms of :func:`estimate_state_bytes` at each moment, the host terms and the inputs (for estimates
    that add their own terms to a moment: the pipeline's activations).

    The GPU peak is the larger of two moments: the end of backward (every
    gradient shard reduced; the largest unit and its prefetched neighbour
    gathered, its gradients and reduction staged) and the optimizer step
    (``optimizer_temps`` state-sized temporaries: 0 for torch's fused AdamW, 1
    for its foreach AdamW). ``units``: parameters of each unit in
    ``unit_modules`` order, the root last; with it the offloaded units are the
    ones ``OffloadPolicy(fraction=offload_fraction)`` picks; without it a
    fraction ``offload_fraction`` of every term moves. ``backward_optimizer``: gradients stepped and freed inside
    backward (``BackwardOptimizer``). ``ranks_per_host`` defaults to ``world``.
    """
    if units is not None:
        units = [int(u) for u in units]
        n_params = sum(units) if n_params is None else n_params
        largest_unit_params = largest_unit_params or max(units, default=0)
    if n_params is None:
        raise ValueError("estimate_state_bytes needs n_params or units")
    if not 0.0 <= offload_fraction <= 1.0:
        raise ValueError(f"offload_fraction={offload_fraction} must be in [0, 1]")
    kw = dict(world=world, strategy=strategy, outer=outer, outer_strategy=outer_strategy, param_dtype=param_dtype,
              main_dtype=main_dtype, grad_dtype=grad_dtype, comm_dtype=comm_dtype, optimizer_states=optimizer_states)
    on, off = BufferSizes(**kw), BufferSizes(**kw, offload=True)
    if units is not None:
        chosen = offloaded_units(units, offload_fraction)
        n_off = sum(u for u, c in zip(units, chosen) if c)
        off_units = [u for u, c in zip(units, chosen) if c]
    else:
        n_off, off_units = offload_fraction * n_params, None
    n_on = n_params - n_off
    unit = largest_unit_params or 0
    u_sizes = off if n_on == 0 else on  # the largest unit's buffers: offloaded only when everything is
    rest = {
        "main": on.main(n_on),
        "weights": on.weights(n_on) + off.weights(n_off),
        "optimizer": on.optimizer(n_on),
    }
    grads = u_sizes.grads(unit) if backward_optimizer else on.grads(n_on)
    accumulation = 0.0
    if accumulate_grads:  # across no_sync micro-batches, on the device (offloaded groups too)
        if on.kg == on.m:  # the gradient shards themselves, offloaded ones until the last micro-batch
            accumulation, grads = on.grads(n_on) + off.grads(n_off), 0.0
        else:  # Partial buffers at the gradient level (ZeRO-1, HFSDP) beside the shards finalized
            accumulation = on.grad_accumulation(n_on) + off.grad_accumulation(n_off)
    end_of_backward = {
        **rest,
        "grads": grads,
        "grad accumulation": accumulation,
        "gathered units": 2 * u_sizes.gathered(unit),  # the unit and the one prefetched
        "gather staging": u_sizes.gather_staging(unit),
        "unit grads": u_sizes.unit_grads(unit),
        "reduce staging": u_sizes.reduce_staging(unit, accumulate_grads),
    }
    step = {**rest, "grads": on.grads(n_on), "optimizer temporaries": optimizer_temps * on.at(on.m, n_on, on.main_b)}
    if backward_optimizer:  # stepped per group inside backward: no step with every gradient alive
        step = {**rest, "grads": grads, "optimizer temporaries": optimizer_temps * u_sizes.at(on.m, unit, on.main_b)}
    host = host_parts(off, off_units, n_off, ranks_per_host or world)
    inputs = {"n_params": n_params, **kw, "offload_fraction": offload_fraction,
              "largest_unit_params": largest_unit_params, "units": units,
              "accumulate_grads": accumulate_grads, "backward_optimizer": backward_optimizer,
              "optimizer_temps": optimizer_temps, "ranks_per_host": ranks_per_host or world}
    return {"end of backward": end_of_backward, "optimizer step": step}, host, inputs


def estimate_state_bytes(n_params: int | None = None, **kwargs) -> MemoryEstimate:
    """Bytes the engine holds for ``n_params`` parameters, without activations (arguments: :func:`state_phases`).

    The GPU peak is the larger of two moments: the end of backward (every
    gradient shard reduced; the largest unit and its prefetched neighbour
    gathered, its gradients and reduction staged) and the optimizer step.
    """
    phases, host, inputs = state_phases(n_params, **kwargs)
    return combine(phases, host, inputs["ranks_per_host"], inputs=inputs)


def host_parts(off: BufferSizes, off_units: Sequence[float] | None, n_off: float,
               ranks_per_host: int) -> dict[str, int]:
    """Host bytes per host of the offloaded parameters: unit by unit when ``off_units`` lists them,
    else ``n_off`` parameters as one block."""
    if off_units is None:
        per_rank = off.host([n_off] if n_off else [])
    else:
        per_rank = off.host(off_units)
    return {k: int(v * ranks_per_host) for k, v in per_rank.items()}


def combine(phases: dict[str, dict[str, float]], host_parts: dict[str, int], ranks_per_host: int,
            notes: Sequence[str] = (), inputs: dict | None = None) -> MemoryEstimate:
    """The estimate of the largest of ``phases`` (moment -> GPU terms) with the given host terms."""
    totals = {name: int(sum(terms.values())) for name, terms in phases.items()}
    peak = max(totals, key=totals.get)
    parts = {k: int(v) for k, v in phases[peak].items() if v}
    return MemoryEstimate(
        gpu_bytes=sum(parts.values()), host_bytes=sum(host_parts.values()), parts=parts,
        host_parts={k: v for k, v in host_parts.items() if v}, phase=peak, phases=totals,
        ranks_per_host=ranks_per_host, notes=tuple(notes), inputs=dict(inputs or {}),
        terms={name: {k: int(v) for k, v in t.items() if v} for name, t in phases.items()},
    )
