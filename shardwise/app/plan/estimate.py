"""The planner's fast path: the reference GPT's memory counted from parameter counts and shapes, no trace.

There is one memory model, the planner's, and the trace is its truth (``trace.py``: the real model wrapped by
``fully_shard`` and two steps run in a simulated world). This module is its fast path, the same numbers
without running anything, held to the trace by ``tests/app/test_plan.py`` (equal state terms for every layout
the planner weighs; the peak within the RoPE tables and 64 KiB at the bench's 0.9b and 8b). It is used where
a trace cannot be or need not be:

* by the planner itself (``planner.memory_of``), before tracing: a candidate whose :func:`state_bound` (what
  must be live at once: the state at the optimizer step, or at the start of backward the state, every saved
  activation and the weights ``reshard_after_forward=False`` keeps gathered) is over the device cannot fit, so
  it is not traced; its row shows that lower bound (``MemoryTrace.bound``);
* by ``shardwise train``'s pre-launch check and its refusal (``fit.check_run``): a worker already has its
  process group and cannot simulate another world;
* by ``shardwise bench`` (the estimate beside each measured run) and pipeline runs (``pipeline_estimate.py``:
  the planner traces no pipeline).

``estimate_for_run`` adds the model's activations (:func:`activation_bytes`)
to the engine's buffers (:mod:`.engine_bytes`) at the moments of one step
where the GPU peak can be, and takes the largest:
* **loss backward** (start of backward): every activation forward saved, the
  three fp32 ``[tokens, vocab]`` tensors of the cross-entropy backward (saved
  log-softmax output, the NLL gradient, the log-softmax gradient), the output
  head gathered. Here without activation checkpointing (0.9b in the benchmark),
  and with it when the gradients are freed inside backward (``BackwardOptimizer``);
* **first layer backward** (the last layer backward reaches): the gradient
  shards of every unit reduced before it, that layer's activations (recomputed
  under checkpointing) with the gradients of its MLP hidden activations, the
  previous layer's reduction still staged, the layer and its prefetched
  neighbour gathered;
* **end of backward**: every gradient shard, the first unit's (embedding's)
  reduction staged. Here with checkpointing (2.8b, 8b): 16 bytes per
  parameter over the shard degree is most of it;
* **optimizer step**: every gradient shard plus the optimizer's temporaries
  (one state-sized tensor for torch's foreach AdamW, none for fused).

Activations are counted tensor by tensor from what autograd saves in
``TransformerLayer`` (``tests/app/test_memory_estimate.py`` checks the count
against a real forward): per layer and token, two RMSNorms keep their fp32
input and normalized output (16 x dim bytes), attention keeps its input, the
rotated queries and keys, the values and its output, the MLP its input and
four hidden-width tensors (gate, up, SiLU(gate), product). Checkpointing keeps
only each layer's input. MoE and Mamba layers are counted roughly (not
calibrated against a measurement); the estimate says so in its notes.

``check_fits`` compares an estimate with free memory and raises
:class:`DoesNotFit`, naming the numbers; ``check_fits_on_cpu`` does the same
for a CPU run, whose ranks all take their memory from the host's
(``MemAvailable``). What would fit is ``fit.py``'s one search (train's
refusal and the planner's answer alike).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

from .engine_bytes import GIB, BufferSizes, MemoryEstimate, combine, host_parts, offloaded_units
from ...models import GPT, GPTConfig

__all__ = ["Activations", "activation_bytes", "gpt_units", "estimate_for_run", "check_fits", "DoesNotFit",
           "OPTIMIZER_TEMPS", "check_fits_on_cpu", "cpu_bytes", "INTERPRETER_BYTES", "candidate_estimate",
           "state_bound", "kept_gathered"]

#: state-sized temporaries an AdamW implementation allocates during ``step()`` (foreach: ``sqrt(exp_avg_sq)``
#: for a whole parameter group at once; fused and the per-tensor loop: none worth counting)
OPTIMIZER_TEMPS = {"fused": 0, "foreach": 1, "for-loop": 0}

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch on one GPU (see :func:`activation_bytes`)."""

    tokens: int
    layer_saved: tuple[int, ...]  # what each layer's forward saves for its backward (no checkpointing)
    layer_kept: tuple[int, ...]  # what stays per layer until its backward (its input under checkpointing)
    layer_backward: tuple[int, ...]  # a layer's backward working set: its activations + gradient temporaries
    head: int  # final norm, output-head input, token ids
    loss_backward: int  # the cross-entropy backward's three fp32 [tokens, vocab] tensors
    checkpointing: bool
    rough: bool  # MoE/Mamba layers: counted roughly

    @property
    def saved_at_loss(self) -> int:
        """Everything forward leaves for backward."""
        return sum(self.layer_kept) + self.head


def _norm(t: int, d: int, c: int) -> int:
    # x.float() and x * rsqrt(...): fp32 input and normalized output; rsqrt per token; weight.float()
    return 8 * t * d + 4 * t + (4 * d if c != 4 else 0)


def _attention(cfg: GPTConfig, t: int, c: int) -> int:
    q = cfg.n_heads * cfg.head_dim
    kv = cfg.n_kv_heads * cfg.head_dim
    # input (shared by wq/wk/wv), rotated q and k, v, output (= wo's input), log-sum-exp per head
    return _norm(t, cfg.dim, c) + c * t * cfg.dim + c * t * (2 * q + 2 * kv) + 4 * t * cfg.n_heads


def _layer_saved(kind: str, cfg: GPTConfig, t: int, c: int) -> tuple[int, int]:
    """(bytes saved by one layer's forward, hidden width whose gradients its backward holds)."""
    d = cfg.dim
    if kind == "A":
        f = cfg.ffn_hidden
        return _attention(cfg, t, c) + _norm(t, d, c) + c * t * d + 4 * c * t * f, f
    if kind == "E":  # router probs (fp32), routed copies in and out, each routed token through a SwiGLU
        k, f, e = cfg.moe_top_k, cfg.moe_ffn_hidden, cfg.moe_num_experts
        moe = c * t * d + 4 * t * e + 2 * c * t * k * d + 4 * c * t * k * f + 3 * 8 * t * k
        return _attention(cfg, t, c) + _norm(t, d, c) + moe, k * f
    # "M": in_proj output, conv in/out, the chunked scan's [chunk x chunk x heads] decays, gates, out_proj input
    inner = cfg.mamba_expand * d
    heads = inner // cfg.mamba_head_dim
    proj = 2 * inner + 2 * cfg.mamba_d_state + heads
    scan = 3 * c * t * cfg.mamba_chunk_size * heads
    conv = 2 * c * t * (inner + 2 * cfg.mamba_d_state)
    return _norm(t, d, c) + c * t * d + c * t * proj + conv + scan + 6 * c * t * inner, inner


def _context_parallel_attention(cfg: GPTConfig, seq_len: int, micro_batch: int, cp: int, c: int,
                                materialized_mask: bool = False) -> int:
    """What one attention layer saves beyond its own tokens' under context parallelism
    (``models.context_parallel.attend_gathered``): the gathered keys and values of the whole sequence stay
    saved (each of a rank's two query chunks, ``L = seq / 2cp`` tokens, reads a prefix of them as a view),
    ``2 cp`` chunks of every sequence in place of its own two; the attention output is kept twice (per chunk by SDPA, concatenated by ``wo``). Flash and
    memory-efficient SDPA (CUDA) take the lower-right causal mask as a flag; where
    ``materialized_mask`` (the CPU path) SDPA builds and keeps it, ``[L, keys seen]`` per chunk in the compute
    dtype, at most ``(2 cp + 1) L^2`` per rank (ranks other than 0)."""
    if cp == 1:
        return 0
    kv = cfg.n_kv_heads * cfg.head_dim
    chunk = seq_len // (2 * cp)
    kv_bytes = c * micro_batch * (2 * cp - 2) * chunk * 2 * kv
    # the attention output twice: each chunk's SDPA keeps its own, ``wo`` the concatenated copy
    output = c * micro_batch * 2 * chunk * cfg.n_heads * cfg.head_dim
    return kv_bytes + output + (c * (2 * cp + 1) * chunk * chunk if materialized_mask else 0)


def activation_bytes(config: GPTConfig, seq_len: int, micro_batch: int, *, checkpointing: bool | None = None,
                     compute_dtype: torch.dtype | None = torch.bfloat16, cp: int = 1,
                     materialized_mask: bool = False) -> Activations:
    """Activation bytes of :class:`shardwise.models.GPT` for one micro-batch (no tensor parallelism, dropout 0).

    checkpointing: ``None`` takes ``config.activation_checkpointing``. compute_dtype ``None`` is fp32.
    cp: context-parallel ranks sharing each sequence: a rank holds ``seq_len / cp`` tokens of each, and
    its attention layers the keys and values its query chunks see besides (``materialized_mask``: and the
    causal masks, as on the CPU; see :func:`_context_parallel_attention`).
    """
    c = torch.empty((), dtype=compute_dtype or torch.float32).element_size()
    ckpt = config.activation_checkpointing if checkpointing is None else checkpointing
    t, d, v = seq_len * micro_batch // cp, config.dim, config.vocab_size
    gathered = _context_parallel_attention(config, seq_len, micro_batch, cp, c, materialized_mask)
    saved, kept, working = [], [], []
    for kind in config.layer_kinds:
        layer, hidden = _layer_saved(kind, config, t, c)
        layer += gathered if kind in "AE" else 0
        saved.append(layer)
        kept.append(c * t * d if ckpt else layer)
        # its activations, the gradients of two hidden-width tensors, the first weight gradient, the output grad
        working.append(layer + 2 * c * t * hidden + c * hidden * d + c * t * d)
    head = _norm(t, d, c) + c * t * d + 8 * t
    if cp > 1:  # the RoPE tables at this rank's positions, shared by every layer
        head += 2 * c * (seq_len // cp) * (config.head_dim // 2)
    return Activations(t, tuple(saved), tuple(kept), tuple(working), head, 3 * 4 * t * v, ckpt,
                       rough=any(k != "A" for k in config.layer_kinds))


def gpt_units(config: GPTConfig, vocab_units: bool = True) -> tuple[list[tuple[str, int]], dict]:
    """Parameter counts of the units ``fully_shard`` builds for GPT, in ``unit_modules`` order, the root last.

    vocab_units: the embedding and the output head are units of their own (``shardwise bench``);
    otherwise only the layers are (``shardwise train``) and the root holds them. Tied embeddings
    stay in the root. Also returns the sizes the phases need: ``embed``, ``head``, ``layer`` (largest).
    """
    key = (json.dumps(config.to_dict(), sort_keys=True), vocab_units)
    if key not in _UNITS_CACHE:
        _UNITS_CACHE[key] = _count_units(replace(config, tp_group=None, ep_group=None), vocab_units)
    units, sizes = _UNITS_CACHE[key]
    return list(units), dict(sizes)


_UNITS_CACHE: dict[tuple, tuple] = {}


def _count_units(cfg: GPTConfig, vocab_units: bool) -> tuple[list[tuple[str, int]], dict]:
    with torch.device("meta"):  # exact counts for every layer kind, no memory
        model = GPT(cfg)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    layers = [(f"layers.{i}", count(layer)) for i, layer in enumerate(model.layers)]
    embed = count(model.embed)
    head = count(model.output) if model.output is not None else 0
    total = count(model)
    separate = vocab_units and model.output is not None
    units = ([("embed", embed)] if separate else []) + layers + ([("output", head)] if separate else [])
    root = total - sum(n for _, n in units)
    units.append(("<root>", root))
    return units, {"embed": embed, "head": head, "layer": max((n for _, n in layers), default=0),
                   "separate": separate, "total": total}


def estimate_for_run(
    config: GPTConfig,
    seq_len: int,
    micro_batch: int,
    world: int,
    strategy: str | int = "optim_grads_params",
    offload_fraction: float = 0.0,
    *,
    outer: int | None = None,
    outer_strategy: str = "no_shard",
    precision: str = "bf16",
    activation_checkpointing: bool | None = None,
    vocab_units: bool = True,
    grad_accum: int = 1,
    optimizer: str = "fused",
    backward_optimizer: bool = False,
    ranks_per_host: int | None = None,
    build_on_device: bool = False,
    cp: int = 1,
    materialized_mask: bool = False,
) -> MemoryEstimate:
    """Peak bytes per GPU and per host of training ``config`` with AdamW (fp32 main weights and gradients).

    precision: compute dtype, ``bf16`` or ``fp32``. optimizer: how AdamW steps, ``fused``, ``foreach``,
    ``for-loop`` or ``default`` (``torch.optim.AdamW(params)``: foreach when every parameter is on the GPU,
    DTensors included, else the for-loop); foreach is counted as one temporary the size of all the
    optimizer state's tensors of one kind (an upper bound: it is per parameter group).
    vocab_units: see :func:`gpt_units`. grad_accum > 1: gradients accumulate under ``no_sync``.
    backward_optimizer: ``shardwise.BackwardOptimizer`` (each group steps inside backward).
    ``ranks_per_host`` defaults to ``world`` (one host). build_on_device: the whole fp32 model is built on
    each GPU before ``fully_shard`` (``--no-meta-init``; the benchmark), a moment of its own.
    cp: context parallelism (``--cp``): activations per rank of ``seq_len / cp`` tokens of each sequence
    (:func:`activation_bytes`; ``materialized_mask``: the CPU's SDPA builds the causal masks); the buffers
    are sharded over all ``world`` ranks as without it.
    """
    if precision not in _DTYPES:
        raise ValueError(f"precision={precision!r} must be one of {sorted(_DTYPES)}")
    if optimizer == "default":  # torch picks foreach only when every parameter is on the GPU
        optimizer = "foreach" if offload_fraction == 0 else "for-loop"
    if optimizer not in OPTIMIZER_TEMPS:
        raise ValueError(f"optimizer={optimizer!r} must be one of {sorted(OPTIMIZER_TEMPS) + ['default']}")
    inputs = dict(config=config, seq_len=seq_len, micro_batch=micro_batch, world=world, strategy=strategy,
                  offload_fraction=offload_fraction, outer=outer, outer_strategy=outer_strategy, precision=precision,
                  activation_checkpointing=activation_checkpointing, vocab_units=vocab_units, grad_accum=grad_accum,
                  optimizer=optimizer, backward_optimizer=backward_optimizer, ranks_per_host=ranks_per_host,
                  build_on_device=build_on_device, cp=cp, materialized_mask=materialized_mask)
    param_dtype = _DTYPES[precision]
    acts = activation_bytes(config, seq_len, micro_batch, checkpointing=activation_checkpointing,
                            compute_dtype=param_dtype, cp=cp, materialized_mask=materialized_mask)
    kw = dict(world=world, strategy=strategy, outer=outer, outer_strategy=outer_strategy, param_dtype=param_dtype)
    on, off = BufferSizes(**kw), BufferSizes(**kw, offload=True)
    units, sizes = gpt_units(config, vocab_units)
    counts = [n for _, n in units]
    is_off = offloaded_units(counts, offload_fraction)
    sz = [off if o else on for o in is_off]
    accumulate = grad_accum > 1
    temps = OPTIMIZER_TEMPS[optimizer]

    def total(fn, which=None) -> float:
        """``fn(sizes, n)`` summed over the units (those in ``which``)."""
        idx = range(len(units)) if which is None else which
        return sum(fn(sz[i], counts[i]) for i in idx)

    names = [name for name, _ in units]
    root = len(units) - 1
    layers = [i for i, name in enumerate(names) if name.startswith("layers.")]
    first_layer, second_layer = layers[0], (layers[1] if len(layers) > 1 else None)
    embed_i = names.index("embed") if "embed" in names else None
    head_i = names.index("output") if "output" in names else None

    rest = {
        "main": total(lambda s, n: 0.0 if s.offload else s.main(n)),
        "weights": total(lambda s, n: s.weights(n)),
        "optimizer": total(lambda s, n: 0.0 if s.offload else s.optimizer(n)),
    }
    # Accumulated over no_sync micro-batches, on the device (offloaded groups too, until the last one):
    # the gradient shards themselves, or Partial buffers at the gradient level (ZeRO-1, HFSDP)
    shards_accumulate = on.kg == on.m
    accumulated = {"grad accumulation": total(lambda s, n: s.grads(n) if shards_accumulate
                                              else s.grad_accumulation(n))} if accumulate else {}
    grad_of = lambda i: 0.0 if sz[i].offload else sz[i].grads(counts[i])  # noqa: E731

    def grads(reduced: list[int]) -> float:
        """Gradient shards on the GPU once the units ``reduced`` (in backward order) have reduced."""
        if backward_optimizer:  # a group's shard is freed once its step ran, at the next unit's reduction
            return grad_of(reduced[-1]) if reduced else 0.0
        return sum(grad_of(i) for i in reduced)

    def reduction(i: int) -> float:
        """Unit ``i``'s reduction at its flat copy: autograd's grads and the flat buffer, or the reduce outputs."""
        s, n = sz[i], counts[i]
        flat = s.at(0, n, s.comm_b)
        return flat + max(s.unit_grads(n), s.reduce_staging(n) - flat)

    phases: dict[str, dict[str, float]] = {}
    # -- loss backward: the output head (or the root holding it) gathered, every saved activation
    head_unit = head_i if head_i is not None else root
    gathered = sz[head_unit].gathered(counts[head_unit]) + (sz[root].gathered(counts[root]) if head_unit != root else 0)
    phases["loss backward"] = {
        **rest,
        **accumulated,
        "gathered units": gathered,
        "gather staging": sz[head_unit].gather_staging(counts[head_unit]),
        "activations": acts.saved_at_loss,
        "loss buffers": acts.loss_backward,
    }
    # -- the first layer's backward (the last layer backward reaches)
    before = [i for i in range(root - 1, first_layer, -1)]  # reduced already, in backward order
    neighbour = first_layer - 1 if first_layer > 0 else None  # prefetched (the embedding)
    # a head in the root: its gradients wait, unreduced, for the root's reduction at the end
    root_held = sz[root].unit_grads(sizes["head"] or sizes["embed"]) if head_i is None else 0.0
    staged = sz[second_layer].reduce_staging(counts[second_layer], accumulate) if second_layer is not None else 0.0
    phases["first layer backward"] = {
        **rest,
        **accumulated,
        "grads": 0.0 if accumulate and shards_accumulate else grads(before),
        "gathered units": sz[first_layer].gathered(counts[first_layer]) + sz[root].gathered(counts[root])
        + (sz[neighbour].gathered(counts[neighbour]) if neighbour is not None else 0.0),
        "gather staging": sz[neighbour if neighbour is not None else first_layer].gather_staging(
            counts[neighbour if neighbour is not None else first_layer]),
        "unit grads": root_held,
        "reduce staging": staged,
        "activations": acts.layer_backward[0] + (acts.layer_kept[0] if acts.checkpointing else 0),
    }
    # -- end of backward: the unit reduced last (embedding unit, else the root)
    last = embed_i if embed_i is not None else root
    order = [i for i in range(root - 1, -1, -1) if i != last] + [last]  # backward order, ``last`` reducing
    phases["end of backward"] = {
        **rest,
        "grads": grads(order) if not backward_optimizer else grad_of(last),
        "gathered units": sz[last].gathered(counts[last]) + (sz[root].gathered(counts[root]) if last != root else 0.0),
        "reduce staging": reduction(last),
    }
    # -- optimizer step
    if not backward_optimizer:
        phases["optimizer step"] = {
            **rest,
            "grads": total(lambda s, n: 0.0 if s.offload else s.grads(n)),
            "optimizer temporaries": temps * total(lambda s, n: 0.0 if s.offload else s.at(s.m, n, s.main_b)),
        }
    if build_on_device:  # the unsharded fp32 model beside the sharded buffers made from it
        phases["model build"] = {"main": rest["main"], "weights": rest["weights"],  # no optimizer state yet
                                 "unsharded model": sum(counts) * on.main_b}
    off_units = [n for n, o in zip(counts, is_off) if o]
    hosts = ranks_per_host or world
    host = host_parts(off, off_units, sum(off_units), hosts)
    if temps and off_units:
        host["optimizer temporaries"] = int(temps * sum(off.at(off.m, n, off.main_b) for n in off_units) * hosts)
    notes = ["MoE/Mamba layers: activations counted roughly (not calibrated)"] if acts.rough else []
    estimate = combine(phases, host, hosts, notes, inputs)
    return estimate


# ------------------------------------------------------------------------------- the planner's fast path
def candidate_estimate(config: GPTConfig, world: int, cand, seq: int, *, vocab_units: bool = True) -> MemoryEstimate:
    """:func:`estimate_for_run` of a planner candidate (``candidates.Candidate``) as the trace runs it: bf16
    compute, fused AdamW, one micro-batch per step (``reshard_after_forward`` and FP8 are not in the estimate;
    :func:`state_bound` does not depend on them)."""
    return estimate_for_run(config, seq, cand.micro_batch, world, cand.strategy, cand.offload_fraction,
                            outer=cand.replicas if cand.replicas > 1 else None, outer_strategy=cand.outer_strategy,
                            activation_checkpointing=cand.activation_checkpointing, vocab_units=vocab_units,
                            optimizer="fused")


#: the terms of :func:`state_bound`'s two moments that are live through the whole of that moment
_AT_STEP = ("main", "weights", "optimizer", "grads")
_AT_LOSS = ("main", "weights", "optimizer", "activations")


def state_bound(config: GPTConfig, world: int, cand, seq: int, *, vocab_units: bool = True) -> int:
    """A lower bound of the candidate's traced peak, from terms each equal to the trace's or under it
    (``tests/app/test_plan.py``; the trace's slots add their padding, its saved tensors the RoPE tables), the
    larger of two moments:

    * the optimizer step: main weights, compute weights at rest, every gradient shard and AdamW's state
      (offloaded state left out; fused AdamW has no temporaries);
    * the start of backward: the same state but the gradients (``zero_grad`` dropped them), every activation
      forward saved (not counted for MoE and Mamba layers, whose activations are counted roughly) and, with
      ``reshard_after_forward=False``, every unit's gathered weights (each kept from its forward to its backward:
      :func:`kept_gathered`).

    Each is live all at once at that moment, so a candidate whose bound is over the device cannot fit: the
    planner does not trace it."""
    est = candidate_estimate(config, world, cand, seq, vocab_units=vocab_units)
    at_loss = [k for k in _AT_LOSS if k != "activations" or not est.notes]  # notes: MoE/Mamba, counted roughly
    return max(sum(est.terms["optimizer step"].get(k, 0) for k in _AT_STEP),
               sum(est.terms["loss backward"].get(k, 0) for k in at_loss)
               + kept_gathered(config, world, cand, vocab_units=vocab_units))


def kept_gathered(config: GPTConfig, world: int, cand, *, vocab_units: bool = True) -> int:
    """Bytes of gathered (unsharded, compute-dtype) weights live at the start of backward that
    :func:`estimate_for_run` does not count: with ``reshard_after_forward=False`` every unit keeps its gathered
    weights from its forward to its backward (none where the parameters are not sharded); else 0."""
    if cand.reshard_after_forward:
        return 0
    sizes = BufferSizes(world=world, strategy=cand.strategy, outer=cand.replicas if cand.replicas > 1 else None,
                        outer_strategy=cand.outer_strategy, param_dtype=torch.bfloat16)
    units, _ = gpt_units(config, vocab_units)
    return int(sum(sizes.gathered(n) for _, n in units))


# ---------------------------------------------------------------------------------------------- fit check
class DoesNotFit(RuntimeError):
    """The estimated peak passes the free GPU or host memory; the message names the numbers and what would fit."""

    one_line = True
    exit_code = 2


def _fits(est: MemoryEstimate, gpu_free: float, host_free: float | None) -> bool:
    return est.gpu_bytes <= gpu_free and (host_free is None or est.host_bytes <= host_free)


def check_fits(estimate: MemoryEstimate, gpu_free_bytes: float, host_free_bytes: float | None = None,
               *, warn_within: float = 0.10) -> str:
    """Raise :class:`DoesNotFit` when ``estimate`` passes the free memory of a GPU or of the host, naming the
    numbers (``plan.fit.check_run`` adds what would fit: the one search, ``plan.fit.search``).

    Returns a warning line when it fits with less than ``warn_within`` of the free memory to spare
    (the allocator's fragmentation takes a few percent more than the allocated peak), else ``""``.
    """
    over = []
    if estimate.gpu_bytes > gpu_free_bytes:
        over.append(f"{estimate.gpu_bytes / GIB:.1f} GiB per GPU needed, {gpu_free_bytes / GIB:.1f} GiB free")
    if host_free_bytes is not None and estimate.host_bytes > host_free_bytes:
        over.append(f"{estimate.host_bytes / GIB:.1f} GiB of host memory needed, {host_free_bytes / GIB:.1f} GiB free")
    if over:
        raise DoesNotFit("this configuration does not fit: " + "; ".join(over) + f". Estimate: {estimate.describe()}.")
    tight = []
    if estimate.gpu_bytes > (1 - warn_within) * gpu_free_bytes:
        tight.append(f"per GPU {estimate.gpu_bytes / GIB:.1f} of {gpu_free_bytes / GIB:.1f} GiB free")
    if host_free_bytes is not None and estimate.host_bytes > (1 - warn_within) * host_free_bytes:
        tight.append(f"per host {estimate.host_bytes / GIB:.1f} of {host_free_bytes / GIB:.1f} GiB free")
    return ("memory is tight (" + ", ".join(tight) + "): the allocator may need a few percent more") if tight else ""


# What each worker's interpreter holds before it builds anything: the private (anonymous) memory of a Python
# with torch and shardwise.app.train imported, RssAnon 218 MiB with torch 2.13 CPU on Linux x86-64 (measured
# from /proc/self/status); the shared library pages are counted once by the host, so they are not added.
INTERPRETER_BYTES = 220 * 2**20


def cpu_bytes(estimate: MemoryEstimate, ranks_on_host: int) -> int:
    """Host memory a CPU run takes on one host: each rank's own peak (the estimate's device part, plus its
    interpreter) times the ranks there, plus the host part (offloaded state, already for every rank)."""
    return (estimate.gpu_bytes + INTERPRETER_BYTES) * ranks_on_host + estimate.host_bytes


def check_fits_on_cpu(estimate: MemoryEstimate, available_bytes: float | None, ranks_on_host: int) -> None:
    """Raise :class:`DoesNotFit` when a CPU run's ranks together pass the host's available memory.

    Without this a run too large for the machine starts and swaps, or is killed after minutes without a word.
    ``available_bytes`` ``None`` (not Linux) checks nothing. ``plan.fit.check_run_on_cpu`` adds what would fit.
    """
    needed = cpu_bytes(estimate, ranks_on_host)
    if available_bytes is None or needed <= available_bytes:
        return
    ranks = f"{ranks_on_host} ranks x " if ranks_on_host > 1 else ""
    host = f" + {estimate.host_bytes / GIB:.1f} GiB offloaded" if estimate.host_bytes else ""
    raise DoesNotFit(
        f"this configuration does not fit in this machine's memory: {ranks}({estimate.gpu_bytes / GIB:.1f} GiB + "
        f"{INTERPRETER_BYTES / GIB:.2f} GiB interpreter) per rank{host} = {needed / GIB:.1f} GiB needed, {available_bytes / GIB:.1f} GiB available (MemAvailable). "
        f"Estimate: {estimate.describe('cpu')}.")
