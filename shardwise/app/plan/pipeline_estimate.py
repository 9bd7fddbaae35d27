"""Memory of one pipeline rank training the reference GPT: its stages' state plus the micro-batches in flight.

The planner's fast path (:mod:`.estimate`) for ``train --pp`` and ``bench --pp``, where the planner traces
nothing (it weighs no pipeline); ``tests/app/test_pipeline_memory.py`` holds it to real pipeline steps.

A rank holds the stages ``stage_indices(pp_rank, pp, virtual)`` of
:func:`shardwise.models.pipeline_stage` (embedding on the first stage, norm and
head on the last), each sharded over the rank's data-parallel sub-mesh of
``dp`` ranks: their parameters, gradients and optimizer state are the
engine's buffers for those units (:func:`.engine_bytes.state_phases`, with
gradients accumulated over the step's micro-batches, as a stage's backwards run
under ``no_sync``). On top, per micro-batch of each local stage
(:func:`stage_activations`):

* **saved**: what autograd keeps from the stage's forward to its backward (the
  layers' activations of :func:`.estimate.activation_bytes`; the
  token ids on the first stage; on the last the final norm, the head's input,
  the loss's fp32 log-softmax and the targets: torch's schedules compute the
  loss right after the last stage's forward);
* **output**: the stage's output, which torch keeps until the chunk's backward
  (hidden states; logits on the last stage);
* **receive buffers**: torch allocates one activation buffer (stages after the
  first) and one gradient buffer (stages before the last) per micro-batch when
  the stage is set up, and keeps them; they count for every micro-batch.

The schedule decides how many chunks are in flight at once
(:mod:`shardwise.app.pipeline_order`); the peak is the heaviest such moment plus one
layer's backward working set (or the loss backward's, on the last stage).
``return_outputs=True`` (``schedule.step``'s default) also keeps every
micro-batch's logits on the last stage until the step returns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .engine_bytes import MemoryEstimate, combine, state_phases
from ...models import GPTConfig, stage_indices, stage_layer_counts
from ..pipeline_order import in_flight_peak, rank_order
from .estimate import _DTYPES, OPTIMIZER_TEMPS, activation_bytes, gpt_units

__all__ = ["StageActivations", "stage_activations", "estimate_pipeline_rank", "estimate_pipeline"]


@dataclass(frozen=True)
class StageActivations:
    """Bytes of one micro-batch on one stage (see the module docstring)."""

    saved: int
    output: int
    receive: int
    backward: int  # the largest working set one backward adds on top of what is saved


def stage_activations(config: GPTConfig, seq_len: int, micro_batch: int, layer_ids: Sequence[int], *,
                      first: bool, last: bool, checkpointing: bool | None = None,
                      compute_dtype: torch.dtype | None = torch.bfloat16) -> StageActivations:
    """One micro-batch's bytes on the stage running layers ``layer_ids`` (first / last stage of the pipeline)."""
    acts = activation_bytes(config, seq_len, micro_batch, checkpointing=checkpointing, compute_dtype=compute_dtype)
    c = torch.empty((), dtype=compute_dtype or torch.float32).element_size()
    t, d, v = acts.tokens, config.dim, config.vocab_size
    ids = 8 * t  # int64 token ids (embedding) / targets (the loss)
    saved = sum(acts.layer_kept[i] for i in layer_ids) + (ids if first else 0)
    extra = [acts.layer_backward[i] - (0 if acts.checkpointing else acts.layer_saved[i]) for i in layer_ids]
    if last:
        # activation_bytes' head counts the token ids; here they are the targets the loss saves (+ its fp32 weight sum)
        saved += acts.head + 4 * t * v + 4
        extra.append(acts.loss_backward - 4 * t * v)  # the loss backward's buffers beyond the saved log-softmax
    output = c * t * (v if last else d)
    receive = c * t * d * ((not first) + (not last))
    return StageActivations(saved, output, receive, max(extra, default=0))


def _rank_stages(config: GPTConfig, pp: int, pp_rank: int, virtual: int, split) -> tuple[list[int], list[list[int]]]:
    num_stages = pp * virtual
    counts = stage_layer_counts(config.n_layers, num_stages, split)
    starts = [sum(counts[:s]) for s in range(num_stages)]
    indices = stage_indices(pp_rank, pp, virtual)
    return indices, [list(range(starts[s], starts[s] + counts[s])) for s in indices]


def estimate_pipeline_rank(
    config: GPTConfig,
    seq_len: int,
    micro_batch: int,
    *,
    pp: int,
    pp_rank: int,
    dp: int,
    schedule: str,
    n_microbatches: int,
    virtual: int = 1,
    split: Sequence[int] | None = None,
    strategy: str | int = "optim_grads_params",
    outer: int | None = None,
    outer_strategy: str = "no_shard",
    precision: str = "bf16",
    activation_checkpointing: bool | None = None,
    vocab_units: bool = True,
    optimizer: str = "fused",
    return_outputs: bool = False,
    ranks_per_host: int | None = None,
) -> MemoryEstimate:
    """Peak bytes on one GPU of pipeline rank ``pp_rank`` (AdamW, fp32 main weights and gradients).

    ``micro_batch``: sequences per micro-batch; ``n_microbatches`` per step. ``vocab_units``: the embedding and
    head are units of their own (else the stage's root holds them). Other arguments as
    :func:`.estimate.estimate_for_run`'s, over the ``dp`` ranks of the stage's sub-mesh.
    """
    if precision not in _DTYPES:
        raise ValueError(f"precision={precision!r} must be one of {sorted(_DTYPES)}")
    if optimizer not in OPTIMIZER_TEMPS:
        raise ValueError(f"optimizer={optimizer!r} must be one of {sorted(OPTIMIZER_TEMPS)}")
    if config.tie_embeddings and pp * virtual > 1:
        raise ValueError("tie_embeddings=True: pipeline stages cannot share the embedding with the head")
    order = rank_order(schedule, pp, pp_rank, n_microbatches, virtual)  # checks schedule, pp, rank, m, virtual
    indices, layer_ids = _rank_stages(config, pp, pp_rank, virtual, split)
    last_stage = pp * virtual - 1
    dtype = _DTYPES[precision]
    per_stage = [stage_activations(config, seq_len, micro_batch, ids, first=s == 0, last=s == last_stage,
                                   checkpointing=activation_checkpointing, compute_dtype=dtype)
                 for s, ids in zip(indices, layer_ids)]

    named, sizes = gpt_units(config, vocab_units=True)
    count = dict(named)
    units, root = [], 0
    for s, ids in zip(indices, layer_ids):
        head = [count["embed"]] if s == 0 else []
        tail = [count["output"]] if s == last_stage else []
        units += ([*head] if vocab_units else []) + [count[f"layers.{i}"] for i in ids] + (tail if vocab_units else [])
        root += (count["<root>"] if s == last_stage else 0) + (0 if vocab_units else sum(head) + sum(tail))
    units.append(root)
    phases, host, _ = state_phases(
        units=units, world=dp, strategy=strategy, outer=outer, outer_strategy=outer_strategy, param_dtype=dtype,
        optimizer_temps=OPTIMIZER_TEMPS[optimizer], accumulate_grads=n_microbatches > 1,
        ranks_per_host=ranks_per_host or dp * pp)

    _, live = in_flight_peak(order, [a.saved + a.output for a in per_stage])
    receive = sum(n_microbatches * a.receive for a in per_stage)
    in_flight = {
        "activations in flight": sum(n * a.saved for n, a in zip(live, per_stage)),
        "stage outputs in flight": sum(n * a.output for n, a in zip(live, per_stage)),
        "receive buffers": receive,
        "backward working set": max(a.backward for a in per_stage),
    }
    if return_outputs and last_stage in indices:
        in_flight["returned logits"] = n_microbatches * per_stage[indices.index(last_stage)].output
    moments = {"backward, micro-batches in flight": {**phases["end of backward"], **in_flight},
               "optimizer step": {**phases["optimizer step"], "receive buffers": receive}}
    inputs = {"pipeline": dict(pp=pp, pp_rank=pp_rank, dp=dp, schedule=schedule, n_microbatches=n_microbatches,
                               virtual=virtual, stages=indices, layers=layer_ids, in_flight=live)}
    rough = set(config.layer_kinds) - {"A"}
    notes = ["MoE/Mamba layers: activations counted roughly (not calibrated)"] if rough else []
    return combine(moments, host, ranks_per_host or dp * pp, notes, inputs)


def estimate_pipeline(config: GPTConfig, seq_len: int, micro_batch: int, *, pp: int, **kwargs) -> list[MemoryEstimate]:
    """:func:`estimate_pipeline_rank` for every pipeline rank, in rank order."""
    return [estimate_pipeline_rank(config, seq_len, micro_batch, pp=pp, pp_rank=r, **kwargs) for r in range(pp)]
