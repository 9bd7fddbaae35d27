"""The memory estimate printed before launch: measured peaks, offload, strategies, fit check."""

from __future__ import annotations

import pytest
import torch

from shardwise.app.bench.sizes import SIZES, model_config
from shardwise.app.memory import DoesNotFit, activation_bytes, check_fits, estimate_for_run, gpt_units
from shardwise.app.memory_estimate import GIB, BufferSizes, estimate_state_bytes, offloaded_units
from shardwise.models import GPT, GPTConfig

# Peak allocated memory measured by `shardwise bench` on 2 x H200 (torch 2.11, NCCL 2.28.9): ZeRO-3, bf16
# compute, fp32 main weights and gradients, fused AdamW; the embedding and the output head are units.
# Shapes: shardwise/app/bench/sizes.py (0.9b: no activation checkpointing, micro-batch 2; 2.8b and 8b:
# checkpointing, micro-batch 1; seq 4096).
MEASURED_GIB = [
    # (size, wrapper, GiB, source)
    ("0.9b", "shardwise", 20.23, "docs/performance.md change 5, version f (kept)"),
    ("2.8b", "shardwise", 22.12, "docs/benchmarks.md job 1 (docs/bench/bench-0.9b-2.8b.json)"),
    ("8b", "shardwise", 63.75, "docs/benchmarks.md job 1; docs/performance.md change 5, f"),
    ("0.9b", "shardwise-obo", 20.18, "docs/benchmarks.md jobs 2 and 3 (BackwardOptimizer)"),
    ("2.8b", "shardwise-obo", 18.11, "docs/benchmarks.md jobs 2 and 3 (BackwardOptimizer)"),
    ("8b", "shardwise-obo", 52.89, "docs/benchmarks.md jobs 2 and 3 (BackwardOptimizer)"),
    # FSDP2 holds the same state and activations; its own staging differs from ours by 1-2%.
    ("0.9b", "fsdp2", 20.45, "docs/benchmarks.md job 1"),
    ("2.8b", "fsdp2", 22.32, "docs/benchmarks.md job 1"),
    ("8b", "fsdp2", 64.73, "docs/benchmarks.md job 1"),
]


def _bench_estimate(size: str, wrapper: str = "shardwise", **kw):
    s = SIZES[size]
    return estimate_for_run(model_config(s), s.seq_len, s.micro_batch, 2,
                            backward_optimizer=wrapper == "shardwise-obo", **kw)


@pytest.mark.parametrize("size,wrapper,measured,source", MEASURED_GIB)
def test_the_estimate_is_within_10_percent_of_the_measured_peak(size, wrapper, measured, source):
    estimate = _bench_estimate(size, wrapper)
    got = estimate.gpu_bytes / GIB
    assert abs(got / measured - 1) < 0.10, f"{size} {wrapper}: estimate {got:.2f} GiB, measured {measured} ({source})"
    assert sum(estimate.parts.values()) == estimate.gpu_bytes
    assert estimate.host_bytes == 0


def test_the_peak_is_where_the_profiles_put_it():
    # 0.9b: activations at the start of backward; 8b: every gradient shard at the end of backward
    assert _bench_estimate("0.9b").phase == "loss backward"
    assert _bench_estimate("8b").phase == "end of backward"
    big = _bench_estimate("8b")
    assert [name for name, _ in big.dominant(3)] == ["optimizer", "main", "grads"]
    assert big.describe().startswith("per GPU 63.7 GiB at end of backward (optimizer 29.9, main 15.0, grads 15.0")
    assert big.describe().endswith(", per host 0 GiB")
    on_cpu = big.describe("cpu")  # one memory: each rank's, and no empty host part
    assert on_cpu.startswith("per rank 63.7 GiB at end of backward") and "GPU" not in on_cpu and "host" not in on_cpu
    # the whole fp32 model built on the GPU before sharding (the benchmark, --no-meta-init) is a moment too
    built = _bench_estimate("8b", build_on_device=True)
    assert built.phases["model build"] == 8_030_261_248 * 4 + big.parts["main"]
    assert built.gpu_bytes == big.gpu_bytes


def _saved_bytes(config: GPTConfig, tokens: torch.Tensor) -> int:
    """Bytes autograd saves in a real forward (each storage once, parameters left out)."""
    model = GPT(config).to(torch.bfloat16)
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(saved.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_activation_count_is_what_autograd_saves(checkpointing):
    config = GPTConfig(vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=160, max_seq_len=32,
                       activation_checkpointing=checkpointing)
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (3, 32))
    counted = activation_bytes(config, 32, 3, compute_dtype=torch.bfloat16)
    assert counted.saved_at_loss == _saved_bytes(config, tokens)


def test_offload_moves_main_weights_grads_and_optimizer_state_to_the_host():
    units, _ = gpt_units(model_config(SIZES["8b"]))
    counts = [n for _, n in units]
    p, world = sum(counts), 2
    none, half, full = (estimate_state_bytes(units=counts, world=world, offload_fraction=f) for f in (0.0, 0.5, 1.0))
    # nothing offloaded: 16 bytes per parameter over the shard degree on the GPU, nothing on the host
    assert none.host_bytes == 0
    assert none.parts["main"] + none.parts["optimizer"] + none.parts["grads"] == 16 * p // world
    # everything: the GPU keeps the bf16 shard (2 bytes/param/N); the host main, grads (registered in
    # place: their own size) and AdamW's two moments, for both ranks of the host
    assert "main" not in full.parts and "optimizer" not in full.parts and "grads" not in full.parts
    assert full.parts["weights"] == 2 * p // world
    assert full.host_parts["optimizer"] == 8 * p // world * world
    assert full.host_parts["main"] == full.host_parts["grads"] == 4 * p // world * world
    assert full.host_bytes == 16 * p // world * world
    # half: the units OffloadPolicy(fraction=0.5) picks (the embedding and the first layers)
    chosen = offloaded_units(counts, 0.5)
    n_off = sum(n for n, c in zip(counts, chosen) if c)
    assert chosen[0] and not chosen[-2] and 0.5 * p <= n_off < 0.5 * p + max(counts)
    assert half.parts["optimizer"] == 8 * (p - n_off) // world
    assert half.parts["weights"] == 2 * n_off // world
    assert half.host_parts["optimizer"] == 8 * n_off // world * world
    assert none.gpu_bytes > half.gpu_bytes > full.gpu_bytes
    # the run estimate moves the same bytes
    runs = [_bench_estimate("8b", offload_fraction=f) for f in (0.0, 0.5, 1.0)]
    assert runs[0].gpu_bytes > runs[1].gpu_bytes > runs[2].gpu_bytes
    assert runs[0].host_bytes == 0 < runs[1].host_bytes < runs[2].host_bytes == full.host_bytes




@pytest.mark.parametrize("accumulate", [False, True])
def test_strategies_order_zero0_zero1_zero2_zero3_per_gpu(accumulate):
    order = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
    state = [estimate_state_bytes(8_030_261_248, world=8, strategy=s, largest_unit_params=218_112_000,
                                  accumulate_grads=accumulate).gpu_bytes for s in order]
    assert state == sorted(state, reverse=True), state
    if accumulate:  # ZeRO-1 keeps unsharded fp32 grads across micro-batches, ZeRO-2 their shards
        assert len(set(state)) == 4, state
    else:  # one micro-batch: both reduce-scatter each unit's grads into its shard at once
        assert state[0] > state[1] == state[2] > state[3], state
    s = SIZES["8b"]
    runs = [estimate_for_run(model_config(s), s.seq_len, 1, 8, strategy, grad_accum=2 if accumulate else 1).gpu_bytes
            for strategy in order]
    assert runs == sorted(runs, reverse=True) and len(set(runs)) == (4 if accumulate else 3), runs


def test_hybrid_sharding_levels():
    p = 1_000_000_000
    hsdp = BufferSizes(8, outer=2, outer_strategy="no_shard")  # shard over 4, replicate over 2
    hfsdp = BufferSizes(8, outer=2, outer_strategy="optim")  # parameters over 4, optimizer over 8
    assert (hsdp.main(p), hsdp.optimizer(p), hsdp.grads(p), hsdp.weights(p)) == (p, 2 * p, p, 0)
    assert (hfsdp.main(p), hfsdp.optimizer(p), hfsdp.grads(p), hfsdp.weights(p)) == (p / 2, p, p / 2, p / 2)
    assert hfsdp.grad_accumulation(p) == p  # Partial over the outer axis at the gradient level


def test_check_fits_raises_naming_the_numbers_and_what_would_fit():
    """check_fits names the numbers; train's refusal (plan.fit.check_run) adds the one search's answer, whose
    numbers are that configuration's own estimate and fit."""
    from shardwise.app.plan.fit import check_run

    s = SIZES["8b"]
    estimate = estimate_for_run(model_config(s), s.seq_len, s.micro_batch, 1)  # 8B on one 80 GiB GPU
    assert estimate.gpu_bytes > 120 * GIB
    with pytest.raises(DoesNotFit) as error:
        check_fits(estimate, gpu_free_bytes=79 * GIB, host_free_bytes=250 * GIB)
    message = str(error.value)
    assert f"{estimate.gpu_bytes / GIB:.1f} GiB per GPU needed, 79.0 GiB free" in message
    with pytest.raises(DoesNotFit) as error:
        check_run(estimate, gpu_free=79 * GIB, host_free=250 * GIB)
    assert str(error.value).startswith(message + " What fits: ") and "--offload-fraction" in str(error.value)
    # the host side: everything offloaded on a small host; the search offloads less
    offloaded = estimate_for_run(model_config(s), s.seq_len, s.micro_batch, 2, offload_fraction=1.0)
    with pytest.raises(DoesNotFit, match=r"GiB of host memory needed, 64.0 GiB free.*What fits: .*"
                                         r"--offload-fraction 0.5\) \(per GPU [\d.]+ GiB, per host [\d.]+ GiB\)"):
        check_run(offloaded, gpu_free=139 * GIB, host_free=64 * GIB)
    # 0.9b without checkpointing on a 16 GiB GPU: checkpointing alone, with its numbers
    small = _bench_estimate("0.9b")
    checkpointed = estimate_for_run(**{**small.inputs, "activation_checkpointing": True})
    with pytest.raises(DoesNotFit, match=r"What fits: .*\(--strategy optim_grads_params --micro-batch-size "
                                         rf"{small.inputs['micro_batch']} --activation-checkpointing\) "
                                         rf"\(per GPU {checkpointed.gpu_bytes / GIB:.1f} GiB\)\.$"):
        check_run(small, gpu_free=16 * GIB, host_free=None)
    assert check_fits(small, gpu_free_bytes=139 * GIB) == ""
    assert "tight" in check_fits(small, gpu_free_bytes=21 * GIB)


def _engine_bytes(strategy: str, fraction: float):
    """What the engine's groups hold on this rank after a backward, next to the estimate of the same model."""
    import torch.distributed as dist

    import shardwise
    from shardwise.models import TransformerLayer

    # every slot a multiple of the layout's 32-element alignment on 2 ranks, so the bytes are exact
    config = GPTConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=16)
    torch.manual_seed(0)
    model = GPT(config)
    policy = shardwise.OffloadPolicy(fraction=fraction) if fraction else None
    model = shardwise.fully_shard(
        model, strategy=strategy, unit_modules=[TransformerLayer, model.embed, model.output],
        mixed_precision=shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16), offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 64, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    groups = model.sharded_state.groups
    device = {k: sum(g.resident_bytes()[k] for g in groups) for k in ("model_shard", "main", "main_grad")}
    host = {k: sum(g.host_bytes()[k] for g in groups) for k in ("main", "main_grad")}
    offloaded = {id(p) for g in groups if g.offloaded for p in g.sharded_params}
    state = {"cpu": 0, "device": 0}
    for p in model.parameters():
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                local = v.to_local() if hasattr(v, "to_local") else v
                state["cpu" if id(p) in offloaded else "device"] += local.untyped_storage().nbytes()
    counts = [n for _, n in gpt_units(config)[0]]
    est = estimate_state_bytes(units=counts, world=dist.get_world_size(), strategy=strategy,
                               offload_fraction=fraction, ranks_per_host=1)
    return device, host, state, est.parts, est.host_parts


@pytest.mark.parametrize("strategy,fraction", [
    ("no_shard", 0.0), ("optim", 0.0), ("optim_grads", 0.0), ("optim_grads_params", 0.0),
    ("optim_grads_params", 0.5), ("optim_grads_params", 1.0), ("optim", 1.0),
])
def test_the_terms_are_the_engines_buffers(strategy, fraction):
    """2 gloo ranks: every rank's main weights, model shard, gradient shards and AdamW state, on the
    device and on the host, are the bytes BufferSizes says (at scale the layout's slot alignment adds
    under 32 elements per parameter and buffer, which the estimate leaves out)."""
    from tests.helpers.distributed import run_distributed

    for device, host, state, parts, host_parts in run_distributed(_engine_bytes, 2, strategy, fraction):
        assert device["model_shard"] == parts.get("weights", 0)
        assert device["main"] == parts.get("main", 0)
        assert device["main_grad"] == parts.get("grads", 0)
        assert state["device"] == parts.get("optimizer", 0)
        assert host["main"] == host_parts.get("main", 0) and host["main_grad"] == host_parts.get("grads", 0)
        assert state["cpu"] == host_parts.get("optimizer", 0)
