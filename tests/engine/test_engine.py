"""Acceptance 2-4: no_sync and collective counts, memory at rest, early errors."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardwise

from tests.helpers.counting import CountingCollectives
from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import STRATEGY_MESHES, Run, assert_parity, compare, train_both
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

# --------------------------------------------------------------- no_sync


@pytest.mark.parametrize("world,strategy,outer", STRATEGY_MESHES)
def test_no_sync_over_four_micro_batches_equals_one_large_batch(world, strategy, outer):
    run_distributed(assert_parity, world, Run(strategy=strategy, outer=outer, micro_batches=4, global_batch=16))


def _count_step_collectives(strategy, outer, micro_batches):
    """Collectives issued by one steady-state step (refresh + micro-batches), per (kind, axis).

    A gather or reduce-scatter of a group is one coalesced launch of per-parameter
    collectives (one NCCL group call), counted once; all-reduces are flat.
    """
    import shardwise.engine.collectives as buffers_module

    world, rank = dist.get_world_size(), dist.get_rank()
    dev = device()
    config = TinyConfig(reuse_last_block=False)
    torch.manual_seed(0)
    mesh = shardwise.build_dp_mesh(outer=2) if outer else shardwise.build_dp_mesh()
    model = shardwise.fully_shard(
        TinyLM(config), mesh, strategy=strategy, outer_dp_sharding_strategy=outer, unit_modules=[Block]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    axis_of = {id(mesh.get_group(n)): n for n in mesh.mesh_dim_names}
    counts: Counter = Counter()
    counting = [False]
    originals = {}
    for module, name, kind in (
        (buffers_module, "gather_pieces", "all_gather"),
        (buffers_module, "reduce_scatter_pieces", "reduce_scatter"),
        (dist, "all_reduce", "all_reduce"),
    ):
        fn = getattr(module, name)
        originals[(module, name)] = fn

        def wrapper(*args, _fn=fn, _kind=kind, **kwargs):
            if counting[0]:
                if _kind == "all_reduce":
                    axis = axis_of.get(id(kwargs.get("group")), "other")
                else:
                    axis = args[2].name
                counts[(_kind, axis)] += 1
            return _fn(*args, **kwargs)

        setattr(module, name, wrapper)
    try:
        for step in range(2):
            tokens, targets = (t.to(dev) for t in batch(step, 4 * world, config))
            counting[0] = step == 1
            for i in range(micro_batches):
                part = slice(rank * 4 + i, rank * 4 + i + 1)
                if i < micro_batches - 1:
                    with model.no_sync():
                        model(tokens[part], targets[part]).backward()
                else:
                    model(tokens[part], targets[part]).backward()
            counting[0] = False
            opt.step()
            opt.zero_grad()
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
    return dict(counts)


# 3 block units (one trainable group each) + the root (a trainable and a frozen group):
# 4 trainable groups, 5 groups. M = 4 micro-batches.
M, TRAINABLE, UNIT_GATHERS = 4, 4, 3 * 2 + 2  # each block twice (forward, backward), root groups once
EXPECTED = {
    # ZeRO-3: every micro-batch gathers each unit twice and reduce-scatters each trainable group once.
    ("optim_grads_params", None): {("all_gather", "dp_shard"): M * UNIT_GATHERS, ("reduce_scatter", "dp_shard"): M * TRAINABLE},
    # ZeRO-2: grads reduce-scattered every micro-batch; weights refreshed by one gather per step.
    ("optim_grads", None): {("all_gather", "dp_shard"): TRAINABLE, ("reduce_scatter", "dp_shard"): M * TRAINABLE},
    # ZeRO-1: grads stay Partial inside no_sync: one reduce-scatter per group per step.
    ("optim", None): {("all_gather", "dp_shard"): TRAINABLE, ("reduce_scatter", "dp_shard"): TRAINABLE},
    # ZeRO-0 (DDP): one all-reduce per group per step.
    ("no_shard", None): {("all_reduce", "dp_shard"): TRAINABLE},
    # HSDP: inner ZeRO-3 every micro-batch, outer axis all-reduced once per step.
    ("optim_grads_params", "no_shard"): {
        ("all_gather", "dp_shard"): M * UNIT_GATHERS,
        ("reduce_scatter", "dp_shard"): M * TRAINABLE,
        ("all_reduce", "dp_outer"): TRAINABLE,
    },
    # HFSDP: the outer axis is reduce-scattered once per step and gathered once to refresh.
    ("optim_grads_params", "optim"): {
        ("all_gather", "dp_shard"): M * UNIT_GATHERS,
        ("reduce_scatter", "dp_shard"): M * TRAINABLE,
        ("reduce_scatter", "dp_outer"): TRAINABLE,
        ("all_gather", "dp_outer"): TRAINABLE,
    },
}


@pytest.mark.parametrize("strategy,outer", list(EXPECTED))
def test_collectives_per_step_are_what_the_placements_dictate(strategy, outer):
    counts = run_distributed(_count_step_collectives, 4, strategy, outer, M)
    for rank_counts in counts:
        assert rank_counts == EXPECTED[(strategy, outer)]


# ------------------------------------------------------------------ memory


def _memory_at_rest_and_during(strategy):
    world = dist.get_world_size()
    dev = device()
    config = TinyConfig(reuse_last_block=False)
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(config), strategy=strategy, unit_modules=[Block])
    state = model.sharded_state
    units = state.units
    seen = {"after_forward": [], "during_backward": []}

    def storage(unit):
        return sum(g.unsharded.untyped_storage().nbytes() for g in unit.groups)

    def probe(i):
        def after_forward(module, args, output):
            seen["after_forward"].append(storage(units[i]))

            def in_backward(grad):
                # backward has finished with every later unit by now
                seen["during_backward"].append(sum(storage(u) for u in units[i + 1 :]))

            output.register_hook(in_backward)

        return after_forward

    for i, unit in enumerate(units):
        unit.module.register_forward_hook(probe(i))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = (t.to(dev) for t in batch(0, world, config))
    model(tokens[dist.get_rank() :][:1], targets[dist.get_rank() :][:1]).backward()
    opt.step()
    report = {"groups": []}
    for g in state.groups:
        main_grad = g._main_grad_ref() if g._main_grad_ref is not None else None
        report["groups"].append(
            dict(
                opt_total=g.layouts[-1].total,
                full_total=g.layouts[0].total,
                trainable=g.requires_grad,
                unsharded=g.storage_bytes_unsharded // 4 if not g.persistent_unsharded else None,
                model=g.model_shard.numel(),
                main_alias=g.main_aliases_model,
                main_grad=None if main_grad is None else main_grad.untyped_storage().nbytes() // 4,
                grad_acc=g.grad_acc,
            )
        )
    opt.zero_grad()  # dropping the .grad DTensors frees the gradient buffers
    report["grads_after_zero_grad"] = sum(g.resident_bytes()["main_grad"] for g in state.groups)
    report.update(seen)
    return report


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_memory_at_rest_holds_only_the_placements_shards(strategy):
    world = 4
    reports = run_distributed(_memory_at_rest_and_during, world, strategy)
    sharded_params = strategy == "optim_grads_params"
    for report in reports:
        for g in report["groups"]:
            total, opt_total = g["full_total"], g["opt_total"]
            if strategy != "no_shard":  # a 1/world piece of every parameter (+ row and alignment padding)
                assert opt_total < total // world + 32 * 8
            assert g["main_alias"]  # fp32: the main weights are the model weights, one copy
            assert g["model"] == (opt_total if sharded_params else total)
            if sharded_params:
                assert g["unsharded"] == 0, "unsharded storage must be freed at rest"
            # ZeRO-1's full Partial accumulation buffer lives only inside a step's backward
            assert g["grad_acc"] is None
            if g["trainable"]:
                opt_shard = total if strategy == "no_shard" else opt_total
                assert g["main_grad"] == opt_shard, "gradients are held in the optimizer placement"
            else:
                assert g["main_grad"] is None  # frozen groups never allocate gradients
        assert report["grads_after_zero_grad"] == 0
        if sharded_params:
            assert report["after_forward"] == [0, 0, 0], "a unit must free its weights after forward"
            assert report["during_backward"] == [0, 0, 0][: len(report["during_backward"])]
            assert len(report["during_backward"]) == 3


def _no_grad_forward_frees_everything():
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(config), unit_modules=[Block])
    tokens, targets = (t.to(device()) for t in batch(0, world, config))
    with torch.no_grad():
        loss = model(tokens[rank : rank + 1], targets[rank : rank + 1])
    assert all(g.storage_bytes_unsharded == 0 for g in model.sharded_state.groups)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    return loss.item()


def test_eval_forward_without_grad_frees_all_units():
    run_distributed(_no_grad_forward_frees_everything, 2)


# ------------------------------------------------------------ state dict


def _state_dict_round_trip(strategy, outer):
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = device()
    config = TinyConfig()

    def build():
        torch.manual_seed(0)
        mesh = shardwise.build_dp_mesh(outer=2) if outer else None
        model = shardwise.fully_shard(
            TinyLM(config), mesh, strategy=strategy, outer_dp_sharding_strategy=outer, unit_modules=[Block]
        )
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(model, opt, i):
        tokens, targets = (t.to(dev) for t in batch(i, 2 * world, config))
        loss = model(tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = build()
    for i in range(2):
        step(model, opt, i)
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}  # DTensor clones keep the layout
    opt_sd = copy.deepcopy(opt.state_dict())
    expected = [step(model, opt, i) for i in range(2, 4)]

    fresh, fresh_opt = build()
    fresh.load_state_dict(model_sd)
    fresh_opt.load_state_dict(opt_sd)
    got = [step(fresh, fresh_opt, i) for i in range(2, 4)]
    assert got == expected, (got, expected)
    assert all(isinstance(v, torch.distributed.tensor.DTensor) for k, v in model_sd.items())


@pytest.mark.parametrize("strategy,outer", [("optim_grads_params", None), ("optim", None), ("optim_grads_params", "optim")])
def test_state_dict_round_trip_same_world_size(strategy, outer):
    run_distributed(_state_dict_round_trip, 4, strategy, outer)


# ------------------------------------------------------------ bad input


class _IntParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.counts = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


class _ScalarParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.temperature = nn.Parameter(torch.tensor(1.0))


def _bad_inputs():
    from torch.distributed.tensor import Replicate, Shard

    errors = {}

    def capture(key, fn):
        try:
            fn()
        except (ValueError, TypeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
        else:
            errors[key] = None

    model = lambda: TinyLM(TinyConfig())  # noqa: E731
    capture("strategy", lambda: shardwise.fully_shard(model(), strategy="zero5"))
    capture(
        "outer",
        lambda: shardwise.fully_shard(
            model(), shardwise.build_dp_mesh(outer=1), strategy="optim_grads", outer_dp_sharding_strategy="optim"
        ),
    )
    capture("outer_without_mesh", lambda: shardwise.fully_shard(model(), outer_dp_sharding_strategy="no_shard"))
    capture(
        "axis",
        lambda: shardwise.fully_shard(
            model(), shardwise.build_dp_mesh(), placements={"dp_foo": shardwise.AxisPlacements(Shard(0), Shard(0), Shard(0))}
        ),
    )
    capture(
        "placement",
        lambda: shardwise.fully_shard(
            model(), shardwise.build_dp_mesh(), placements={"dp_shard": shardwise.AxisPlacements(Shard(0), Replicate(), Shard(0))}
        ),
    )
    capture("unit_type", lambda: shardwise.fully_shard(model(), unit_modules=[nn.GRU]))
    capture("unit_instance", lambda: shardwise.fully_shard(model(), unit_modules=[nn.Linear(2, 2)]))
    capture("dtype", lambda: shardwise.fully_shard(_IntParam()))
    capture("scalar", lambda: shardwise.fully_shard(_ScalarParam()))
    capture("precision", lambda: shardwise.MixedPrecisionPolicy(param_dtype=torch.int8))
    wrapped = shardwise.fully_shard(model(), unit_modules=[Block])
    capture("twice", lambda: shardwise.fully_shard(wrapped))
    inner = model()
    shardwise.fully_shard(inner.blocks[0])
    shardwise.fully_shard(inner)  # FSDP2's bottom-up order; a call on the inner module after it is not
    capture("inner_after_root", lambda: shardwise.fully_shard(inner.blocks[1]))
    # values of the wrong type that used to be accepted with a surprising meaning
    capture("strategy_bool", lambda: shardwise.fully_shard(model(), strategy=True))
    capture("placements_bool", lambda: shardwise.fully_shard(model(), placements=True))
    capture("bucket_bool", lambda: shardwise.fully_shard(model(), bucket_size=True))
    capture("reshard_str", lambda: shardwise.fully_shard(model(), reshard_after_forward="no"))
    capture("prefetch_int", lambda: shardwise.fully_shard(model(), prefetch=1))
    capture("reduction", lambda: shardwise.fully_shard(model(), gradient_reduction="avg"))
    capture("init_fn", lambda: shardwise.fully_shard(model(), init_fn=5))
    capture("mesh_str", lambda: shardwise.fully_shard(model(), mesh="dp"))
    from shardwise.megatron import DistributedDataParallelConfig, TransformerConfig

    capture("megatron_bool", lambda: TransformerConfig(bf16="false"))
    capture("megatron_int", lambda: DistributedDataParallelConfig(bucket_size=True))
    from shardwise.megatron import FullyShardedDataParallel

    capture("megatron_module", lambda: FullyShardedDataParallel(
        TransformerConfig(), DistributedDataParallelConfig(use_megatron_fsdp=True), "x"))
    capture("megatron_tp_str", lambda: TransformerConfig(tensor_model_parallel_size="2"))
    return errors


EXPECTED_ERRORS = {
    "strategy": "strategy='zero5'",
    "outer": "outer_dp_sharding_strategy='optim'",
    "outer_without_mesh": "outer_dp_sharding_strategy='no_shard' needs a 2-D mesh",
    "axis": "'dp_foo'",
    "placement": "placements['dp_shard']",
    "unit_type": "GRU",
    "unit_instance": "unit_modules entry Linear",
    "dtype": "'counts' has dtype torch.int64",
    "scalar": "'temperature' is 0-dimensional",
    "precision": "MixedPrecisionPolicy.param_dtype=torch.int8",
    "twice": "already sharded",
    "inner_after_root": "is already sharded, by the fully_shard call on an ancestor",
    "strategy_bool": "strategy=True",
    "placements_bool": "strategy=True",
    "bucket_bool": "bucket_size=True",
    "reshard_str": "reshard_after_forward='no' must be a bool, None or an int",
    "prefetch_int": "prefetch=1 must be a bool",
    "reduction": "gradient_reduction='avg'",
    "init_fn": "init_fn=5",
    "mesh_str": "ValueError: mesh='dp' must be a torch.distributed.DeviceMesh or None",
    "megatron_bool": "TransformerConfig.bf16='false' must be bool",
    "megatron_int": "DistributedDataParallelConfig.bucket_size=True must be None or int",
    "megatron_module": "module='x' must be a torch.nn.Module",
    "megatron_tp_str": "TransformerConfig.tensor_model_parallel_size='2' must be int",
}


def test_bad_input_raises_early_naming_the_argument():
    (errors,) = run_distributed(_bad_inputs, 1)
    for key, fragment in EXPECTED_ERRORS.items():
        assert errors[key] is not None, f"{key}: no error raised"
        assert fragment in errors[key], f"{key}: {errors[key]!r} does not mention {fragment!r}"


# ------------------------------------------------- buckets, sum reduction, discard


def _grads_with(bucket_size, reduction, discard_first):
    """Full gradients after one backward (optionally after a discarded no_sync micro-batch)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    torch.manual_seed(0)
    model = shardwise.fully_shard(
        TinyLM(config), unit_modules=[Block], bucket_size=bucket_size, gradient_reduction=reduction
    )
    tokens, targets = (t.to(device()) for t in batch(0, 2 * world, config))
    mine = slice(2 * rank, 2 * rank + 2)
    if discard_first:
        with model.no_sync():
            model(tokens[mine].flip(0), targets[mine]).backward()
        model.zero_grad_buffer()
    model(tokens[mine], targets[mine]).backward()
    root_groups = len(model.sharded_state.root.groups)
    grads = {}
    for group in model.sharded_state.groups:
        for fqn, p in zip(group.fqns, group.sharded_params):
            if p.grad is not None:
                grads[fqn] = p.grad.full_tensor().cpu()
    return root_groups, grads


def test_bucket_size_sum_reduction_and_zero_grad_buffer():
    world = 2
    base_groups, base = run_distributed(_grads_with, world, None, "mean", False)[0]
    bucket_groups, bucketed = run_distributed(_grads_with, world, 40, "mean", False)[0]
    assert bucket_groups > base_groups  # the root's own parameters were split into buckets
    _, summed = run_distributed(_grads_with, world, None, "sum", False)[0]
    _, discarded = run_distributed(_grads_with, world, None, "mean", True)[0]
    for name, grad in base.items():
        torch.testing.assert_close(bucketed[name], grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(summed[name], grad * world, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(discarded[name], grad, rtol=1e-6, atol=0)


def _backward_optimizer_frees_grads():
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(config), unit_modules=[Block])
    opt = shardwise.BackwardOptimizer(model, torch.optim.AdamW, lr=1e-2)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    tokens, targets = (t.to(device()) for t in batch(0, world, config))
    model(tokens[rank : rank + 1], targets[rank : rank + 1]).backward()
    opt.step()
    resident = sum(g.resident_bytes()["main_grad"] for g in model.sharded_state.groups)
    moved = sum(not torch.equal(a, p.detach().to_local()) for a, p in zip(before, model.parameters()))
    return resident, moved, all(p.grad is None for p in model.parameters())


def test_backward_optimizer_steps_during_backward_and_frees_gradients():
    for resident, moved, no_grads in run_distributed(_backward_optimizer_frees_grads, 2):
        assert resident == 0 and no_grads
        assert moved > 0


def _freed_when_dropped():
    import gc
    import weakref

    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    model = shardwise.fully_shard(TinyLM(config), unit_modules=[Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = (t.to(device()) for t in batch(0, world, config))
    model(tokens[rank : rank + 1], targets[rank : rank + 1]).backward()
    opt.step()
    state = weakref.ref(model.sharded_state)
    group = weakref.ref(model.sharded_state.groups[0])
    del model, opt
    gc.collect()
    shardwise.fully_shard(TinyLM(config), unit_modules=[Block])  # a second model: no second hook
    return state() is None and group() is None, len(_global_optimizer_post_hooks), len(_global_optimizer_pre_hooks)


def test_a_dropped_model_is_freed_and_no_global_hooks_are_installed():
    for freed, post_hooks, pre_hooks in run_distributed(_freed_when_dropped, 2):
        assert freed, "the sharded state outlived its model"
        assert post_hooks == 0, "importing shardwise must not hook every optimizer in the process"
        assert pre_hooks == 1, "one step pre-hook per process (refusing optimizers built before fully_shard)"


class _UncountedSGD(torch.optim.Optimizer):
    """SGD whose update moves no version counter, as torch's foreach AdamW over DTensors on CUDA does."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = p.to_local() if hasattr(p, "to_local") else p
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                with torch.autograd._unsafe_preserve_version_counter(local):
                    local.add_(grad, alpha=-group["lr"])


def _update_without_version_bump(strategy: str):
    config = TinyConfig()

    def build():
        torch.manual_seed(0)
        return TinyLM(config).to(device())

    sharded, reference = train_both(
        build, lambda model: shardwise.fully_shard(model, strategy=strategy, unit_modules=[Block]),
        lambda model: _UncountedSGD(model.parameters(), 0.5), lambda step: batch(step, dist.get_world_size(), config), 3,
    )
    compare(sharded, reference)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_an_update_that_moves_no_version_counter_still_reaches_the_next_forward(strategy):
    """The model weights are rebuilt after every step that had grads, whatever the optimizer's kernels do."""
    run_distributed(_update_without_version_bump, 2, strategy)


def _buffers_held_after_step(strategy: str, offload: bool):
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    model = shardwise.fully_shard(
        TinyLM(config).to(device()), strategy=strategy, unit_modules=[Block],
        offload_policy=shardwise.OffloadPolicy(fraction=1.0) if offload else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = (t.to(device()) for t in batch(0, world, config))
    model(tokens[rank : rank + 1], targets[rank : rank + 1]).backward()
    opt.step()
    opt.zero_grad()
    # Buffers a reduction read (ZeRO-1's accumulation buffer, an offloaded group's device grads)
    # belong to its in-flight record only: once that is waited on, nothing may keep them.
    return sum(len(g._released) for g in model.sharded_state.groups)


@pytest.mark.parametrize("strategy,offload", [("optim", False), ("optim_grads_params", True)])
def test_no_reduction_buffer_outlives_its_step(strategy, offload):
    assert run_distributed(_buffers_held_after_step, 2, strategy, offload) == [0, 0]


def _with_collectives(collectives):
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    torch.manual_seed(0)
    mesh = shardwise.build_dp_mesh(outer=min(2, world))
    model = shardwise.fully_shard(TinyLM(config).to(device()), mesh=mesh,
                                  strategy="optim_grads_params", outer_dp_sharding_strategy="no_shard",
                                  unit_modules=[Block], collectives=collectives)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        tokens, targets = (t.to(device()) for t in batch(step, world, config))
        loss = model(tokens[rank : rank + 1], targets[rank : rank + 1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, dict(collectives.calls) if collectives is not None else None


def _both_collectives():
    return _with_collectives(None), _with_collectives(CountingCollectives())


def test_injected_collectives_carry_every_transition():
    for (losses, _), (counted_losses, calls) in run_distributed(_both_collectives, 4):
        assert counted_losses == losses  # the same collectives, only counted
        assert calls["gather"] > 0 and calls["reduce_scatter"] > 0 and calls["all_reduce"] > 0, calls


def _counted():
    return _with_collectives(CountingCollectives())[1]


def test_axes_of_one_rank_issue_no_collectives():
    # world 1: a (1, 1) mesh splits nothing; world 2: a (2, 1) mesh, only the outer replicas' all-reduce
    assert run_distributed(_counted, 1) == [{}]
    for calls in run_distributed(_counted, 2):
        assert "gather" not in calls and "reduce_scatter" not in calls and calls["all_reduce"] > 0, calls


def _wrap_with(collectives):
    shardwise.fully_shard(TinyLM(TinyConfig()), collectives=collectives)


def test_collectives_of_the_wrong_type_are_refused_at_wrap_time():
    with pytest.raises(AssertionError, match="collectives must be a shardwise.Collectives or None, got dict"):
        run_distributed(_wrap_with, 1, {})
