"""The one "sharded vs single process" harness: train a model sharded and unsharded; compare.

:func:`train_both` builds a model, keeps an unsharded copy as the reference and
wraps the model; it trains the wrapped model on this rank's slice of every
global batch (split again into micro-batches when asked) and the reference, in
this same process, on the whole global batch, so a test needs no second job.
:func:`compare` holds the two runs to one standard: the losses, and every full
value of the state dict (tensor-wise relative error, and no element off by more
than a fraction of its tensor's scale).

The engine, Megatron adapter and TP/EP tests train through it; :class:`Run`
and :func:`assert_parity` at the bottom are the engine's tiny-model case.
Tests that hold two sharded runs to each other bit for bit (offload, compile,
injected collectives), a resumed run to a straight one (checkpoints), or check
DTensors with torch's tools between steps (``torch_tools_cases``) keep their
own loops; the last measures with :func:`relative_error` too.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

import shardwise
from tests.helpers.distributed import device
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

# (world size, strategy, outer strategy): ZeRO 0-3 on 2 ranks, HSDP and HFSDP on a (2, 2) mesh
STRATEGY_MESHES = [
    (2, "no_shard", None),
    (2, "optim", None),
    (2, "optim_grads", None),
    (2, "optim_grads_params", None),
    (4, "optim_grads_params", "no_shard"),
    (4, "optim_grads_params", "optim"),
]


@dataclass
class Trained:
    """One run: the loss of each step (the sharded run's: the mean over its data ranks), the full
    values of its state dict on the CPU, and the model and optimizer for further checks."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    model: torch.nn.Module
    optimizer: object


@dataclass
class Hooks:
    """What a wrapper adds around the plain training step (the sharded run only)."""

    before_step: Callable | None = None  # (model) first thing in a step: Megatron's zero_grad_buffer
    no_sync: Callable = lambda model: model.no_sync()  # (model) -> context of all micro-batches but the last
    after_micro_batch: Callable | None = None  # (model, last) after each micro-batch's backward
    after_backward: Callable | None = None  # (model) after the last micro-batch: finish_grad_sync
    after_step: Callable | None = None  # (model) after optimizer.step(): start_param_sync


def megatron_hooks(param_sync: bool = True, after_micro_batch: Callable | None = None) -> Hooks:
    """Megatron's loop: zero_grad_buffer, no_sync on all micro-batches but the last, finish_grad_sync,
    the optimizer step, then (``param_sync``) start_param_sync."""
    return Hooks(
        before_step=lambda w: w.zero_grad_buffer(),
        after_micro_batch=after_micro_batch,
        after_backward=lambda w: w.finish_grad_sync(),
        after_step=(lambda w: w.start_param_sync()) if param_sync else None,
    )


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An unsharded module's state dict, detached, on the CPU."""
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def train_clipped(model, opt, batches, loss_fn: Callable, max_norm: float) -> tuple[list[float], list[float]]:
    """One process's reference run: for each ``(tokens, targets)``, ``loss_fn(model(tokens), targets)``,
    backward, torch's clipping to ``max_norm``, a step. Returns the losses and the norms before clipping."""
    losses, norms = [], []
    for tokens, targets in batches:
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def micro_batch_losses(model, loss_fn: Callable, tokens, targets, micro_batches: int) -> list[float]:
    """What a pipeline's last stage computes for these rows: ``tokens`` cut into ``micro_batches`` along
    dim 0 (as torch's schedules cut them), each part's loss by ``model`` as it is now, without gradients.
    A rank's own losses, checked against these before any reduction, show it trained its own rows."""
    with torch.no_grad():
        return [loss_fn(model(x), y).item() for x, y in zip(tokens.tensor_split(micro_batches),
                                                            targets.tensor_split(micro_batches), strict=True)]


def _call(model, *batch):
    return model(*batch)


def _backward(loss: Callable, divide: int = 1) -> Callable:
    def backward(model, *batch):
        value = loss(model, *batch) / divide
        value.backward()
        return value

    return backward


def _train(model, opt, batch, steps, backward, rows: slice, micro_batches=1, hooks=Hooks(), clip=None, group=None):
    """``steps`` steps on ``rows`` of each global batch, yielding each step's loss (averaged over ``group``)."""
    dev = device()
    per_micro = (rows.stop - rows.start) // micro_batches
    for step in range(steps):
        data = [t.to(dev) for t in batch(step)]
        if hooks.before_step is not None:
            hooks.before_step(model)
        total = torch.zeros((), device=dev)
        for i in range(micro_batches):
            part = slice(rows.start + i * per_micro, rows.start + (i + 1) * per_micro)
            last = i == micro_batches - 1
            with contextlib.nullcontext() if last else hooks.no_sync(model):
                loss = backward(model, *(t[part] for t in data))
            if hooks.after_micro_batch is not None:
                hooks.after_micro_batch(model, last)
            total += loss.detach().float()
        if hooks.after_backward is not None:
            hooks.after_backward(model)
        if clip is not None:
            clip(model.parameters(), opt)
        opt.step()
        if hooks.after_step is not None:
            hooks.after_step(model)
        opt.zero_grad()
        if group is not None:
            dist.all_reduce(total, group=group)
            yield total.item() / dist.get_world_size(group)
        else:
            yield total.item()


def train_both(
    build: Callable[[], torch.nn.Module],
    wrap: Callable[[torch.nn.Module], torch.nn.Module],
    optimizer: Callable[[torch.nn.Module], object],
    batch: Callable[[int], tuple[torch.Tensor, ...]],
    steps: int,
    *,
    loss: Callable = _call,
    data_rank: int | None = None,
    data_ranks: int | None = None,
    micro_batches: int = 1,
    clip: float | None = None,
    clip_into_optimizer: bool = False,
    hooks: Hooks = Hooks(),
    loss_group=None,
    full_state: Callable = shardwise.full_state_dict,
    reference: Callable[[], torch.nn.Module] | None = None,
    reference_optimizer: Callable | None = None,
    reference_backward: Callable | None = None,
) -> tuple[Trained, Trained]:
    """Train ``wrap(build())`` and an unsharded reference ``steps`` steps; return (sharded, reference).

    - ``build()`` makes the model (seeded); the reference is ``copy.deepcopy`` of it, taken before
      ``wrap``, or ``reference()`` when the wrapped model cannot be copied (a TP/EP-built model).
    - ``optimizer(model)`` makes each run's optimizer (``reference_optimizer`` the reference's, when it
      differs); ``batch(step)`` gives step's global batch, a tuple of tensors cut along dim 0;
      ``loss(model, *rows)`` the loss of some of its rows (default ``model(*rows)``).
    - The sharded run trains rows ``data_rank`` of ``data_ranks`` (default: this rank of the world)
      in ``micro_batches`` parts, each loss divided by ``micro_batches``, ``hooks`` around the step,
      ``shardwise.clip_grad_norm_`` with ``clip`` (the factor folded into the optimizer's step with
      ``clip_into_optimizer``); its losses are averaged over ``loss_group`` (default:
      the world) and its state is ``full_state(model)``.
    - The reference trains the whole global batch in one part (``reference_backward(model, *batch)``
      computes its loss and gradients when that is not ``loss(...).backward()``), with
      ``torch.nn.utils.clip_grad_norm_`` and no hooks.
    """
    dev = device()
    model = build()
    ref = (reference() if reference is not None else copy.deepcopy(model)).to(dev)
    sharded = wrap(model)
    opt = optimizer(sharded)
    ref_opt = (reference_optimizer or optimizer)(ref)
    data_rank = dist.get_rank() if data_rank is None else data_rank
    data_ranks = dist.get_world_size() if data_ranks is None else data_ranks
    size = batch(0)[0].shape[0]
    rows = size // data_ranks
    sharded_steps = _train(sharded, opt, batch, steps, _backward(loss, micro_batches),
                           slice(data_rank * rows, (data_rank + 1) * rows), micro_batches, hooks,
                           clip=None if clip is None else (lambda ps, opt: shardwise.clip_grad_norm_(
                               ps, clip, optimizer=opt if clip_into_optimizer else None)),
                           group=dist.group.WORLD if loss_group is None else loss_group)
    reference_steps = _train(ref, ref_opt, batch, steps, reference_backward or _backward(loss), slice(0, size),
                             clip=None if clip is None else (lambda ps, _: torch.nn.utils.clip_grad_norm_(ps, clip)))
    losses, ref_losses = [], []
    # step by step, the reference's after the sharded one's: on an oversubscribed CPU a rank's
    # reference step fills the time it would otherwise wait for the others in a collective
    for value, ref_value in zip(sharded_steps, reference_steps):
        losses.append(value)
        ref_losses.append(ref_value)
    return Trained(losses, full_state(sharded), sharded, opt), Trained(ref_losses, state_of(ref), ref, ref_opt)


# ------------------------------------------------------------------ judging
def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``|got - expected| / |expected|`` (Frobenius norms, in float64; ``|got|`` when expected is 0)."""
    got, expected = got.detach().cpu().double(), expected.detach().cpu().double()
    scale = expected.norm().item()
    return (got - expected).norm().item() / (scale if scale > 0 else 1.0)


def assert_close_states(got: dict, expected: dict, *, rtol: float = 1e-5, element_rtol: float | None = 1e-4) -> None:
    """The same keys (tied aliases included) and shapes; every tensor within ``rtol`` tensor-wise
    relative error, and no element off by more than ``element_rtol`` of its tensor's largest value."""
    assert set(got) == set(expected), f"keys differ: {sorted(set(got) ^ set(expected))}"
    for name, expected_value in expected.items():
        value = got[name]
        assert value.shape == expected_value.shape, f"{name}: shape {tuple(value.shape)}, " \
                                                    f"expected {tuple(expected_value.shape)}"
        rel = relative_error(value, expected_value)
        assert rel <= rtol, f"{name}: relative error {rel:.3g} > {rtol}"  # NaN fails too
        if element_rtol is not None:
            value, expected_value = value.detach().cpu().double(), expected_value.detach().cpu().double()
            scale = expected_value.abs().max().item()
            worst = (value - expected_value).abs().max().item()
            assert worst <= element_rtol * scale, f"{name}: element off by {worst:.3g} (scale {scale:.3g})"


def compare(run: Trained, reference: Trained, *, loss_rtol: float = 1e-5, rtol: float = 1e-5,
            element_rtol: float | None = 1e-4, trained_by: float | None = None) -> None:
    """``run`` trained as ``reference`` did: every step's loss within ``loss_rtol`` (relative, no
    absolute slack) and the full state by :func:`assert_close_states`; with ``trained_by``, also that
    the loss fell by more than that (so the agreement is not two untrained models agreeing)."""
    torch.testing.assert_close(torch.tensor(run.losses, dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=loss_rtol, atol=0)
    assert_close_states(run.state, reference.state, rtol=rtol, element_rtol=element_rtol)
    if trained_by is not None:
        assert run.losses[-1] < run.losses[0] - trained_by, run.losses


# ------------------------------------------------------------------ the engine's tiny-model case
@dataclass
class Run:
    strategy: object = "optim_grads_params"
    outer: str | None = None  # "no_shard" (HSDP) / "optim" (HFSDP) on a (2, N/2) mesh
    bf16: bool = False
    optimizer: str = "adamw"  # adamw | adamw_fused | adam_foreach | sgd | adamw_in_backward
    checkpointing: str = "none"
    micro_batches: int = 1
    steps: int = 5
    clip: float | None = None
    clip_into_optimizer: bool = False  # the clipping factor goes to the (fused) optimizer's step
    global_batch: int = 8
    model: TinyConfig = field(default_factory=TinyConfig)


def _optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "adam_foreach":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.01, foreach=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    raise ValueError(kind)


def bf16_reference_backward(parts: int) -> Callable:
    """The textbook bf16 recipe with the sharded run's rounding: a bf16 copy of the fp32 weights computes
    each of ``parts`` equal slices of the batch (each data rank's rows, the same shapes and so the same
    kernels as the sharded run's), and their bf16 gradients are averaged in fp32, as the ranks' are.

    Against one big bf16 batch the sharded run would differ by how a processor's bf16 kernels round a
    long reduction against several short ones, which changes from one CPU to the next (AMX against AVX2);
    with the same slices only the fp32 order of the average differs, on every machine.
    """

    def backward(reference, tokens, targets) -> torch.Tensor:
        shadow = copy.deepcopy(reference).to(torch.bfloat16)  # deepcopy and .to keep the embedding tie
        rows = tokens.shape[0] // parts
        sums = [None] * len(list(reference.parameters()))
        loss = torch.zeros((), dtype=torch.float32, device=tokens.device)
        for k in range(parts):
            part = slice(k * rows, (k + 1) * rows)
            part_loss = shadow(tokens[part], targets[part])
            part_loss.backward()
            loss += part_loss.detach().float()
            for i, q in enumerate(shadow.parameters()):
                if q.grad is not None:
                    sums[i] = q.grad.float() if sums[i] is None else sums[i] + q.grad.float()
                    q.grad = None
        for p, total in zip(reference.parameters(), sums):
            if total is not None:
                p.grad = total / parts
        return loss / parts

    return backward


def train_tiny(run: Run) -> tuple[Trained, Trained]:
    """The tiny model of ``run.model`` trained by ``fully_shard`` as ``run`` says, and its reference."""
    world = dist.get_world_size()
    config = copy.deepcopy(run.model)
    config.checkpointing = run.checkpointing

    def build():
        torch.manual_seed(0)
        return TinyLM(config)

    def wrap(model):
        mesh = shardwise.build_dp_mesh(outer=2 if world > 1 else 1) if run.outer else None
        policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if run.bf16 else None)
        return shardwise.fully_shard(model, mesh, strategy=run.strategy, outer_dp_sharding_strategy=run.outer,
                                     unit_modules=[Block], mixed_precision=policy)

    if run.optimizer == "adamw_in_backward":  # stepped group by group inside backward
        def optimizer(model):
            return shardwise.BackwardOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)

        reference_kind = "adamw"
    else:
        def optimizer(model):
            return _optimizer(run.optimizer, model.parameters())

        reference_kind = run.optimizer
    return train_both(
        build, wrap, optimizer, lambda step: batch(step, run.global_batch, config), run.steps,
        micro_batches=run.micro_batches, clip=run.clip, clip_into_optimizer=run.clip_into_optimizer,
        reference_optimizer=lambda model: _optimizer(reference_kind, model.parameters()),
        reference_backward=bf16_reference_backward(world) if run.bf16 else None,
    )


def assert_parity(run: Run) -> None:
    sharded, reference = train_tiny(run)
    if run.bf16:
        # The reference computes each rank's rows in bf16 as the ranks do (bf16_reference_backward), so the two
        # differ only in the fp32 order of the gradient average. Through the main weights that can flip the
        # bf16 rounding of a compute weight: one rounding, half a bf16 epsilon relative, bounds the losses and
        # tensors; one epsilon of its tensor's scale bounds an element. No bound depends on the processor.
        rounding = torch.finfo(torch.bfloat16).eps / 2
        compare(sharded, reference, loss_rtol=rounding, rtol=rounding, element_rtol=2 * rounding, trained_by=1.0)
    else:
        # fp32: tensor-wise relative error 1e-5; no element may be off by more than 1e-4 of
        # the tensor's scale (isolated near-zero elements inherit Adam's amplification of
        # summation-order noise, a localized bug such as a wrong row does not hide under it).
        compare(sharded, reference, trained_by=1.0)
