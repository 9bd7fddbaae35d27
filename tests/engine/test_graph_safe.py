"""Graph-safe mode (``fully_shard(graph_safe=True)``) on gloo: the bookkeeping a CUDA graph relies on.

A replayed graph writes to the addresses it was captured with, so every engine buffer
(gathered weights, gradient buffers, staging temporaries) must keep its storage from one
step to the next, no new one may appear after the first step, and the step must not make
the host wait (a capture fails on that). And the mode must train exactly as the normal one.
Capture and replay themselves need a GPU: ``scripts/cuda_graph_check.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from shardwise import (BackwardOptimizer, MixedPrecisionPolicy, OffloadPolicy, build_dp_mesh, capture_step,
                       clip_grad_norm_, fully_shard)
from shardwise.engine.model_ops import sharded_state
from shardwise.engine.param_group import RefreshState
from shardwise.models import GPT, GPTConfig, TransformerLayer
from tests.helpers.distributed import run_distributed
from tests.helpers.graph_safe import engine_addresses
from tests.helpers.host_syncs import count_host_syncs

STEPS = 4
CASES = [  # (strategy, outer (HSDP), grad_accum, activation checkpointing, clip, bf16)
    ("optim", None, 1, False, False, False),
    ("optim_grads", None, 2, True, True, False),
    ("optim_grads_params", None, 2, True, True, False),
    ("optim_grads_params", None, 2, False, True, True),
    ("optim_grads", None, 1, False, False, True),
    ("optim_grads_params", 2, 2, True, True, False),  # HSDP
]


def _config(checkpointing: bool) -> GPTConfig:
    return GPTConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, max_seq_len=16,
                     activation_checkpointing=checkpointing)


def _wrap(strategy, outer, checkpointing, bf16, graph_safe):
    torch.manual_seed(0)
    model = GPT(_config(checkpointing))
    mesh = build_dp_mesh(outer=outer, device_type="cpu") if outer else None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    return fully_shard(model, mesh=mesh, strategy=strategy, outer_dp_sharding_strategy="no_shard" if outer else None,
                       unit_modules=[TransformerLayer], mixed_precision=policy, graph_safe=graph_safe)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    tokens = torch.randint(0, 64, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _step(model, opt, step, accum, clip):
    losses = []
    for micro in range(accum):
        last = micro == accum - 1
        with contextlib.nullcontext() if last else model.no_sync():
            tokens, targets = _batch(step, micro)
            loss = model(tokens, targets) / accum
            loss.backward()
            losses.append(loss.detach())
    norm = clip_grad_norm_(model.parameters(), 0.05) if clip else None
    return losses, norm


def _train(strategy, outer, accum, checkpointing, clip, bf16, graph_safe):
    model = _wrap(strategy, outer, checkpointing, bf16, graph_safe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, addresses, grad_addresses, syncs = [], [], [], []
    for step in range(STEPS):
        with count_host_syncs() as seen:  # forward, backward, reductions, clipping: no host wait
            step_losses, norm = _step(model, opt, step, accum, clip)
        syncs.append(seen.events)
        grad_addresses.append([p.grad.to_local().data_ptr() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(step_losses).sum().item() if norm is None else
                      (torch.stack(step_losses).sum().item(), norm.item()))
        addresses.append(engine_addresses(model))
    weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return losses, weights, addresses, grad_addresses, syncs


def _compare(world, case):
    strategy, outer, accum, checkpointing, clip, bf16 = case
    normal = run_distributed(_train, world, strategy, outer, accum, checkpointing, clip, bf16, False)
    safe = run_distributed(_train, world, strategy, outer, accum, checkpointing, clip, bf16, True)
    for (n_loss, n_w, n_addr, _, _), (s_loss, s_w, s_addr, s_grads, s_syncs) in zip(normal, safe):
        assert s_loss == n_loss, "graph-safe mode must train bit for bit as the normal mode"
        for k in n_w:
            assert torch.equal(s_w[k], n_w[k]), k
        first = s_addr[0]
        assert all(addr == first for addr in s_addr[1:]), "an engine buffer moved or a new one appeared"
        assert all(v != 0 for k, v in first.items() if k.endswith(("unsharded", "main_grad", "grad_acc")))
        assert all(g == s_grads[0] for g in s_grads[1:]), ".grad must view the same buffers every step"
        assert s_syncs == [[]] * STEPS, f"host synchronisations in the step: {s_syncs}"
    return normal, safe


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-outer{c[1]}-acc{c[2]}-ckpt{c[3]}-clip{c[4]}-bf16{c[5]}")
def test_graph_safe_buffers_stay_put_and_train_as_normal_2proc(case):
    _compare(2, case)


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"{c[0]}-acc{c[2]}-ckpt{c[3]}")
def test_graph_safe_buffers_stay_put_and_train_as_normal_1proc(case):
    _compare(1, case)


def _normal_mode_moves_buffers():
    # bf16 compute over fp32 main weights: at one rank too a gather (the cast) fills a buffer freed at rest
    # (fp32 everywhere at one rank gathers nothing: its gathered parameters are the model shard, kept)
    model = _wrap("optim_grads_params", None, False, True, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    for step in range(2):
        _step(model, opt, step, 1, False)
        seen.append(engine_addresses(model))
        opt.step()
        opt.zero_grad()
    return seen


def test_the_address_check_can_fail_normal_mode_frees_at_rest():
    # Without graph-safe mode the gathered weights are freed between steps (address 0 at rest):
    # the check above would catch a graph-safe mode that behaved like it.
    (seen,) = run_distributed(_normal_mode_moves_buffers, 1)
    assert any(v == 0 for k, v in seen[0].items() if k.endswith("unsharded"))


def test_host_sync_counter_sees_item_and_data_dependent_sizes():
    x = torch.arange(4.0)
    with count_host_syncs() as syncs:
        x.sum().item()
        torch.nonzero(x)
        y = x * 2  # no sync
    assert syncs.events == ["_local_scalar_dense", "nonzero"] and y.shape == x.shape


def _refusals():
    errors = {}
    model = GPT(_config(False))
    for name, kwargs in {"offload": dict(offload_policy=OffloadPolicy(fraction=1.0)),
                         "graph_safe_type": dict(graph_safe_value=1)}.items():
        try:
            kw = dict(kwargs)
            value = kw.pop("graph_safe_value", True)
            fully_shard(GPT(_config(False)), unit_modules=[TransformerLayer], graph_safe=value, **kw)
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    try:
        moe = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16, layer_pattern="E",
                            moe_num_experts=2, moe_top_k=1))
        fully_shard(moe, graph_safe=True)
    except ValueError as e:
        errors["moe"] = str(e)
    safe = fully_shard(model, unit_modules=[TransformerLayer], graph_safe=True)
    try:
        BackwardOptimizer(safe, torch.optim.AdamW, lr=1e-3)
    except ValueError as e:
        errors["backward_optimizer"] = str(e)
    try:
        from shardwise.engine.pipeline import ShardedPipelineStage
        ShardedPipelineStage(safe, 0, 1, torch.device("cpu"))
    except ValueError as e:
        errors["pipeline"] = str(e)
    try:
        capture_step(lambda: None, models=safe)
    except RuntimeError as e:
        errors["cpu_capture"] = str(e)
    normal = fully_shard(GPT(_config(False)), unit_modules=[TransformerLayer])
    try:
        capture_step(lambda: None, models=normal)
    except (RuntimeError, ValueError) as e:
        errors["not_graph_safe"] = str(e)
    return errors


def test_what_cannot_be_captured_is_refused_by_name():
    (errors,) = run_distributed(_refusals, 1)
    assert "graph_safe=True with offload_policy" in errors["offload"]
    assert "graph_safe=1 must be a bool" in errors["graph_safe_type"]
    assert "graph_safe=True with MoE experts" in errors["moe"]
    assert "BackwardOptimizer on a model wrapped with graph_safe=True" in errors["backward_optimizer"]
    assert "ShardedPipelineStage on a model wrapped with graph_safe=True" in errors["pipeline"]
    assert "capture_step needs CUDA" in errors["cpu_capture"] or "lives on the CPU" in errors["cpu_capture"]
    assert "not_graph_safe" in errors  # refused either for CUDA or for graph_safe=False


def test_expert_parallel_is_refused_by_name():
    from shardwise.engine.graph_safe import check_graph_safe

    with pytest.raises(ValueError, match="graph_safe=True with expert_mesh"):
        check_graph_safe(torch.nn.Linear(2, 2), True, None, expert_mesh=object())


def _fp8_gather_case():
    from shardwise import convert_to_fp8

    out = []
    for graph_safe in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16))
        convert_to_fp8(model, "tensorwise", all_gather=True)
        model = fully_shard(model, strategy="optim_grads_params", unit_modules=[TransformerLayer],
                            mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16), graph_safe=graph_safe)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, addresses = [], []
        for step in range(3):
            with count_host_syncs() as seen:
                step_losses, _ = _step(model, opt, step, 2, False)
            assert not graph_safe or not seen.events, seen.events
            opt.step()
            opt.zero_grad()
            losses.append(torch.stack(step_losses).sum().item())
            addresses.append(engine_addresses(model))
        out.append((losses, addresses))
    return out


def test_fp8_weight_gather_graph_safe_1proc():
    # FP8 tensorwise linears with the FP8 weight gather (uint8 gathered slots, shared scales): the same
    # losses as the normal mode, and every buffer in place from step to step.
    (((normal, _), (safe, addresses)),) = run_distributed(_fp8_gather_case, 1)
    assert safe == normal
    assert all(a == addresses[0] for a in addresses[1:])


class _ReplayedByHand:
    """Stands in for a CUDAGraph on the CPU: ``replay`` runs the step eagerly on the static inputs."""

    def __init__(self, fn, static):
        self.fn, self.static, self.replays = fn, static, 0

    def replay(self):
        self.replays += 1
        self.fn(*self.static)


def _captured_step_bookkeeping():
    from shardwise.engine.cuda_graphs import CapturedStep

    model = _wrap("optim_grads_params", None, False, False, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    static = _batch(0, 0)
    static = tuple(t.clone() for t in static)
    out = torch.zeros(())

    def step(tokens, targets):
        opt.zero_grad(set_to_none=True)
        out.copy_(model(tokens, targets).detach())
        model(tokens, targets).backward()
    step(*static)
    grads = [(p, p.grad) for p in model.parameters()]
    graph = _ReplayedByHand(step, static)
    captured = CapturedStep(graph, static, out, [model], grads)
    new = _batch(5, 0)
    captured(*new)
    copied = all(torch.equal(s, n) for s, n in zip(static, new))
    opt.zero_grad(set_to_none=True)  # dropped after the replay ...
    captured(*new)
    restored = all(p.grad is g for p, g in grads)  # ... and put back by the next one
    stale = all(g.refresh_state is RefreshState.STALE for g in sharded_state(model).groups)
    try:
        captured(new[0][:, :4], new[1])
        shape_refused = None
    except ValueError as e:
        shape_refused = str(e)
    return copied, restored, stale, shape_refused, graph.replays


def test_a_captured_step_copies_inputs_restores_grads_and_marks_weights_changed():
    ((copied, restored, stale, refused, replays),) = run_distributed(_captured_step_bookkeeping, 1)
    assert copied and restored and stale and replays == 2
    assert "a new shape needs a new capture" in refused


def _static_grads_come_back():
    from shardwise.engine.model_ops import install_graph_safe_grads

    model = _wrap("optim_grads_params", None, False, False, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, 0, 1, False)
    kept = {n: (p.grad.to_local().data_ptr(), p.grad.full_tensor().clone()) for n, p in model.named_parameters()}
    opt.zero_grad(set_to_none=True)
    install_graph_safe_grads(model)
    return all(p.grad is not None and p.grad.to_local().data_ptr() == kept[n][0]
               and torch.equal(p.grad.full_tensor(), kept[n][1]) for n, p in model.named_parameters())


def test_install_graph_safe_grads_points_grad_at_the_kept_buffers_again():
    assert run_distributed(_static_grads_come_back, 2) == [True, True]


# Main grads of another dtype than the main weights (Megatron-Core 0.19's default under Megatron-LM: fp32 main
# weights, bf16 main grads) are handed out as cast ``.grad`` copies. Megatron-LM's schedule without
# --overlap-grad-reduce syncs every micro-batch (no no_sync), so each backward adds its reduced grads to those
# copies; graph-safe mode keeps the main-grad buffer alive, which must not make a window add onto an earlier
# window's sum (the second micro-batch then counted the first twice: grad norm 6.03 against 3.87 on an H200).
CAST_GRADS = MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_grads_dtype=torch.bfloat16)


def _accumulate_by_syncing(strategy, graph_safe, in_place_zero, micros=(0, 1)):
    """Three steps of a syncing backward per micro-batch in ``micros``; ``.grad`` after each backward."""
    from shardwise.engine.model_ops import zero_grads_in_place

    torch.manual_seed(0)
    model = fully_shard(GPT(_config(False)), strategy=strategy, unit_modules=[TransformerLayer],
                        mixed_precision=CAST_GRADS, graph_safe=graph_safe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen, addresses = [], []
    for step in range(3):
        if in_place_zero:
            zero_grads_in_place(model)  # the Megatron face's zero_grad_buffer in graph mode
        else:
            opt.zero_grad(set_to_none=True)
        for micro in micros:
            tokens, targets = _batch(step, micro)
            (model(tokens, targets) / 2).backward()
            seen.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        addresses.append(sorted(p.grad.to_local().data_ptr() for p in model.parameters()))
        opt.step()
    return seen, addresses


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_cast_grads_accumulate_once_per_micro_batch_in_graph_safe_mode(strategy):
    # The reference counts each micro-batch once: after the second backward .grad is the first's .grad plus
    # what the second alone gives (fp32 .grad, each added as the same cast: bit for bit). One step only: the
    # later steps' weights differ once the optimizer has stepped on other grads.
    normal = run_distributed(_accumulate_by_syncing, 2, strategy, False, False)
    second_alone = run_distributed(_accumulate_by_syncing, 2, strategy, False, False, (1,))
    for (seen, _), (alone, _) in zip(normal, second_alone):
        first, both, second = seen[0], seen[1], alone[0]
        assert all(torch.equal(both[n], first[n] + second[n]) for n in both)
    for in_place_zero in (False, True):
        safe = run_distributed(_accumulate_by_syncing, 2, strategy, True, in_place_zero)
        for (n_seen, _), (s_seen, s_addr) in zip(normal, safe):
            for n_grads, s_grads in zip(n_seen, s_seen, strict=True):
                assert all(torch.equal(s_grads[n], n_grads[n]) for n in n_grads), in_place_zero
            if in_place_zero:  # the copies are kept buffers too: a replay writes where the optimizer reads
                assert all(a == s_addr[0] for a in s_addr[1:]), ".grad copies moved between steps"


def _gathers_per_step(graph_safe: bool, checkpointing: bool) -> list[int]:
    from tests.helpers.counting import CountingCollectives

    counting = CountingCollectives()
    torch.manual_seed(0)
    model = fully_shard(GPT(_config(checkpointing)), strategy="optim_grads_params", unit_modules=[TransformerLayer],
                        graph_safe=graph_safe, collectives=counting)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counts = []
    for step in range(3):
        before = counting.calls["gather"]
        _step(model, opt, step, 2, False)
        counts.append(counting.calls["gather"] - before)
        opt.step()
        opt.zero_grad()
    return counts


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "ckpt"])
def test_graph_safe_units_keep_their_weights_from_forward_to_backward(checkpointing):
    # The gathered buffers stay allocated in graph-safe mode, so resharding after forward would free nothing:
    # each micro-batch gathers a layer once (its forward; backward and a checkpointed recompute reuse it),
    # where the normal mode gathers it again for backward. The root (embedding, head) stays gathered in both.
    normal = run_distributed(_gathers_per_step, 2, False, checkpointing)[0]
    safe = run_distributed(_gathers_per_step, 2, True, checkpointing)[0]
    layers, micro_batches = _config(checkpointing).n_layers, 2
    assert all(n - s == layers * micro_batches for n, s in zip(normal, safe, strict=True)), (normal, safe)


def _train_remaking_before(remake_at: int | None):
    """Graph-safe ZeRO-3, bf16 compute, accumulation 2, clipping; ``remake_at``: the step before which the kept
    buffers are let go, as ``capture_step`` does right before its capture."""
    model = _wrap("optim_grads_params", None, False, True, True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, addresses, old = [], [], []
    for step in range(STEPS):
        if step == remake_at:  # the old buffers held here, so a new one cannot reuse a freed address
            old = [t for g in sharded_state(model).groups for t in g.window.graph_safe_buffers.values()]
            sharded_state(model).remake_buffers_in_capture()
        opt.zero_grad(set_to_none=True)  # the captured step's own zero_grad: nothing holds the old buffers
        step_losses, norm = _step(model, opt, step, 2, True)
        opt.step()
        losses.append((torch.stack(step_losses).sum().item(), norm.item()))
        addresses.append(engine_addresses(model))
    del old
    return losses, {k: v.full_tensor() for k, v in model.state_dict().items()}, addresses


def test_kept_buffers_are_made_again_by_the_captured_step_and_stay_put_after():
    """``capture_step`` lets the warm-up's kept gradient and staging buffers go right before it captures, so
    the captured step makes them inside the graph's memory pool (where gradients can take memory forward's
    activations freed, as a plain module's do): the step after trains bit for bit as if nothing happened,
    its buffers are new, and from then on they stay put."""
    for kept, remade in zip(run_distributed(_train_remaking_before, 2, None),
                            run_distributed(_train_remaking_before, 2, 2)):
        assert remade[0] == kept[0]
        for name, value in kept[1].items():
            assert torch.equal(remade[1][name], value), name
        before, after = remade[2][1], remade[2][2]
        grads = [k for k in before if k.endswith(("main_grad", "grad_acc"))]
        assert grads and all(before[k] != after[k] for k in grads), "the kept gradient buffers were not made again"
        assert remade[2][3] == after, "the buffers made by the captured step must stay put"
        assert kept[2][1] == kept[2][3], "without the remake nothing moves (the probe sees addresses)"
