"""``shardwise plan``: the traced memory against a real gloo run and the reference estimate; the step model."""

from __future__ import annotations

import pytest
import torch

from shardwise.app.plan.candidates import Candidate
from shardwise.app.plan.model_source import gpt_source
from shardwise.app.plan.trace import measure_step, trace_memory, trace_once
from shardwise.models import GPTConfig

# every slot a multiple of the layout's 32-element alignment at 2 and 4 ranks
TINY = GPTConfig(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32)
CANDIDATES = [Candidate(micro_batch=2), Candidate(strategy="optim", activation_checkpointing=True),
              Candidate(reshard_after_forward=False), Candidate(strategy="optim_grads", micro_batch=2)]


def _real(cand: Candidate, world_fn=None):
    torch.manual_seed(0)
    return measure_step(gpt_source(TINY), None, cand, 32)


def _same(fake, real):
    """Every storage the steady step made (phase, op, bytes, in order), its peak above the state it started
    with at every moment, and what the engine, AdamW and autograd hold, equal. (The state before the step is
    compared through its parts: a real run also keeps the tiny tensor of fully_shard's rank-consistency
    exchange, which the simulation answers without one.)"""
    assert fake.allocations == real.allocations
    assert fake.phase == real.phase and fake.peak - fake.before_step == real.peak - real.before_step
    assert {k: v - fake.before_step for k, v in fake.peaks.items()} == \
        {k: v - real.before_step for k, v in real.peaks.items()}
    assert fake.parts == real.parts and fake.host == real.host


@pytest.mark.parametrize("cand", CANDIDATES, ids=lambda c: c.label())
def test_the_simulated_step_allocates_what_a_gloo_run_allocates_at_world_2(cand):
    from tests.helpers.distributed import run_distributed

    fake = trace_once(gpt_source(TINY), 2, cand, 32)
    for real in run_distributed(_real, 2, cand):
        _same(fake, real)


@pytest.mark.slow  # 4 gloo processes
@pytest.mark.parametrize("cand", [Candidate(micro_batch=2), Candidate(replicas=2, outer_strategy="optim"),
                                  Candidate(replicas=2)], ids=lambda c: c.label())
def test_the_simulated_step_allocates_what_a_gloo_run_allocates_at_world_4(cand):
    from tests.helpers.distributed import run_distributed

    fake = trace_once(gpt_source(TINY), 4, cand, 32)
    for real in run_distributed(_real, 4, cand):
        _same(fake, real)


@pytest.mark.slow  # among the quick tier's largest: out of it (docs/testing.md, "How long it takes")
def test_three_shallow_traces_extended_equal_the_whole_trace():
    deep = GPTConfig(**{**TINY.to_dict(), "n_layers": 5})  # the fewest layers past the three traced depths
    for cand, extends in ((Candidate(micro_batch=8), True), (Candidate(strategy="optim", micro_batch=4), True),
                          # checkpointed at this size the peak is at a middle layer: the whole model is traced
                          (Candidate(micro_batch=8, activation_checkpointing=True), False)):
        whole = trace_memory(gpt_source(deep), 8, cand, 32, exact=True)
        extended = trace_memory(gpt_source(deep), 8, cand, 32)
        assert extended.extrapolated == extends
        assert (extended.peak, extended.phase, extended.parts) == (whole.peak, whole.phase, whole.parts)


@pytest.mark.parametrize("size", ["0.9b", "8b"])
def test_the_trace_agrees_with_the_reference_estimate(size):
    """The bench's GPT at 2 ranks: the state terms equal ``app/memory.py``'s, and the peak is its peak plus the
    RoPE tables (model buffers, which the estimate leaves out) and under 64 KiB of per-token scalars."""
    from shardwise.app.bench.sizes import SIZES, model_config
    from shardwise.app.memory import estimate_for_run

    s = SIZES[size]
    config = model_config(s)
    traced = trace_memory(gpt_source(config), 2, Candidate(micro_batch=s.micro_batch,
                                                           activation_checkpointing=s.activation_checkpointing), s.seq_len)
    estimate = estimate_for_run(config, s.seq_len, s.micro_batch, 2)
    assert traced.extrapolated
    assert traced.parts["main"] == estimate.parts["main"] and traced.parts["optimizer"] == estimate.parts["optimizer"]
    rope = 2 * 4 * s.seq_len * config.head_dim // 2
    assert 0 <= traced.peak - estimate.gpu_bytes - rope < 2**16
    assert {"0.9b": "backward head", "8b": "backward layer 0"}[size] == traced.phase
    assert {"0.9b": "loss backward", "8b": "end of backward"}[size] == estimate.phase


def test_the_fast_path_counts_the_traced_state_and_bounds_the_peak_from_below():
    """The planner's fast path (``estimate.state_bound``) rules a candidate out before tracing it: for every
    layout the planner weighs, its state terms equal the trace's (less the padding of slots that do not split
    evenly: at 4 ranks the norms' 64 elements), its saved activations are no more than the trace's, what it
    counts live at the optimizer step and at the start of backward (with ``reshard_after_forward=False`` every
    unit's gathered weights too) is no more than the trace's peak of that moment, and so the bound is under the traced peak (a candidate it rules out could not fit). The traces are
    the gloo tests' above (one trace per step and process: ``trace._TRACES``)."""
    from shardwise.app.plan.estimate import _AT_LOSS, _AT_STEP, candidate_estimate, kept_gathered, state_bound

    hybrid = [Candidate(replicas=2), Candidate(replicas=2, outer_strategy="optim")]  # two axes: 4 ranks
    for world, cand in [*((2, c) for c in CANDIDATES), *((4, c) for c in hybrid)]:
        traced = trace_once(gpt_source(TINY), world, cand, 32)
        estimate = candidate_estimate(TINY, world, cand, 32)
        step, loss = estimate.terms["optimizer step"], estimate.terms["loss backward"]
        # HFSDP's model shard at rest is the engine's own buffer, which the trace's "weights" (the compute
        # parameters' storage: freed at rest) does not read; it is in the trace's peaks (below)
        terms = ("main", "optimizer", "grads") + (("weights",) if cand.outer_strategy != "optim" else ())
        for k in terms:
            assert 0 <= traced.parts[k] - step.get(k, 0) < (1 if world == 2 else 4096), (cand, k)
        assert loss["activations"] <= traced.parts["activations"], cand
        assert sum(step.get(k, 0) for k in _AT_STEP) <= traced.peaks["optimizer step"], cand
        kept = kept_gathered(TINY, world, cand)  # every unit's gathered weights, kept to its backward
        assert (kept > 0) == (not cand.reshard_after_forward), cand
        assert sum(loss.get(k, 0) for k in _AT_LOSS) + kept <= traced.peaks["backward head"], cand
        assert state_bound(TINY, world, cand, 32) <= traced.peak, cand
    offloaded = Candidate(offload_fraction=0.5)  # the trace keeps offloaded state on the device: over the bound
    assert state_bound(TINY, 2, offloaded, 32) <= trace_once(gpt_source(TINY), 2, offloaded, 32).peak


def test_the_step_model_hides_prefetched_gathers_and_exposes_the_ends():
    """8b on 8 x H100: a layer hides the next unit's gather (forward) and the previous unit's gather and the
    next one's reduction (backward). Exposed: the first gather, the head's again at backward's start, and
    wherever a unit's pass is shorter than what travels beside it: the embedding's lookup (no FLOPs) behind
    which the first layer gathers and reduces, the last layer behind which the (vocabulary-wide) head gathers.
    Across nodes the network makes the collectives longer; FP8 compute is faster."""
    from shardwise.app.plan.hardware import EFFICIENCY, GPUS, Cluster
    from shardwise.app.plan.model_source import preset_source
    from shardwise.app.plan.step_time import collective_time, step_time, unit_costs

    src = preset_source("8b", seq=4096)
    units = unit_costs(src, 4096, True)
    h100 = GPUS["H100"]
    one_node = step_time(units, Candidate(activation_checkpointing=True), Cluster(8, 8, h100), 4096, 8)
    host = EFFICIENCY.host_per_unit_compiled
    for _, _, compute, ag, rs, exposed in one_node.timeline:
        assert exposed == max(0.0, ag + rs - max(compute, host))
    exposed = [(p, u) for p, u, *_, e in one_node.timeline if e > 0]
    assert exposed == [("forward", "embed"), ("forward", "layers.31"), ("backward", "embed")]
    first = collective_time("all_gather", 2 * units[0].params, 8, h100.nvlink_bw, h100.nvlink_latency)
    head = collective_time("all_gather", 2 * units[-1].params, 8, h100.nvlink_bw, h100.nvlink_latency)
    last = collective_time("reduce_scatter", 4 * units[0].params, 8, h100.nvlink_bw, h100.nvlink_latency)
    forward_excess = sum(e for p, *_, e in one_node.timeline if p == "forward")
    backward_excess = sum(e for p, *_, e in one_node.timeline if p == "backward")
    assert one_node.terms["exposed all-gather"] == pytest.approx(first + head + forward_excess, rel=1e-12)
    assert one_node.terms["exposed reduce-scatter"] == pytest.approx(last + backward_excess, rel=1e-12)
    assert one_node.dominant() == "compute"
    two_nodes = step_time(units, Candidate(activation_checkpointing=True), Cluster(16, 8, h100), 4096, 16)
    assert two_nodes.terms["exposed all-gather"] > one_node.terms["exposed all-gather"]
    fp8 = step_time(units, Candidate(activation_checkpointing=True, fp8=True), Cluster(16, 8, h100), 4096, 16)
    gathered8 = step_time(units, Candidate(activation_checkpointing=True, fp8=True, fp8_gather=True),
                          Cluster(16, 8, h100), 4096, 16)
    assert fp8.terms["compute"] < two_nodes.terms["compute"] and gathered8.terms["compute"] == fp8.terms["compute"]
    assert gathered8.terms["exposed all-gather"] < fp8.terms["exposed all-gather"]


def test_a_ring_across_nodes_pays_a_latency_per_step():
    """Inside a node a collective costs the link's latency; a ring across nodes adds NCCL's latency per step:
    ``n - 1`` steps (twice for an all-reduce), one per node boundary on the network, the rest on NVLink."""
    from shardwise.app.plan.hardware import GPUS, Cluster

    h100 = GPUS["H100"]
    cluster = Cluster(1024, 8, h100)
    assert cluster.link(8) == (h100.nvlink_bw, h100.nvlink_latency)
    nvl, net, base = h100.ring_step_nvlink, h100.ring_step_net, h100.net_latency
    assert cluster.link(16) == pytest.approx((h100.net_bw, base + 14 * nvl + 1 * net))  # 2 nodes: 15 steps
    assert cluster.link(1024)[1] == pytest.approx(base + (1023 - 127) * nvl + 127 * net)
    # HSDP's replicas: one rank per node, every step on the network; the all-reduce makes twice the steps
    assert cluster.link(64, stride=8, kind="all_reduce")[1] == pytest.approx(base + 2 * 63 * net)
    assert cluster.link(64, stride=8, kind="reduce_scatter")[1] == pytest.approx(base + 63 * net)


def test_train_refuses_a_run_that_cannot_fit_naming_a_configuration_that_does():
    from shardwise.app.bench.sizes import SIZES, model_config
    from shardwise.app.memory import DoesNotFit, estimate_for_run
    from shardwise.app.plan.fit import check_run

    s = SIZES["8b"]
    estimate = estimate_for_run(model_config(s), s.seq_len, 2, 1, "optim", activation_checkpointing=False)
    with pytest.raises(DoesNotFit, match=r"What fits: .*\(--strategy \S+ "
                                         r"--micro-batch-size \d+.*--offload --offload-fraction") as error:
        check_run(estimate, gpu_free=79 * 2**30, host_free=2**40)
    import re

    named = float(re.search(r"What fits: .*\(per GPU ([\d.]+) GiB", str(error.value)).group(1))
    assert named <= 79


def test_the_search_tries_fewest_changes_first_then_other_worlds():
    """fit.search (train's refusal and the planner's): one changed field before two, then the start on more
    GPUs; the first that fits is returned with what weighed it."""
    from shardwise.app.plan.fit import search

    start = Candidate(strategy="optim", micro_batch=4)
    weighed = []

    def weigh(cand, gpus):
        weighed.append((cand, gpus))
        return gpus

    assert search(start, 2, weigh, lambda gpus: gpus >= 8, worlds=[4, 8, 16]).gpus == 8
    changed = [sum(getattr(c, f) != getattr(start, f) for f in ("strategy", "activation_checkpointing", "micro_batch",
                                                                 "offload_fraction")) for c, g in weighed if g == 2]
    assert changed == sorted(changed) and changed[0] == 1 and start not in [c for c, g in weighed if g == 2]
    assert [g for _, g in weighed if g != 2] == [4, 8]
    assert search(start, 2, weigh, lambda gpus: False, worlds=[4]) is None


@pytest.mark.slow  # two traces of the tiny model: out of the quick tier
def test_the_planner_names_what_would_fit_when_no_candidate_does():
    """Only ZeRO-3 without checkpointing weighed, on a GPU whose limit (92% of 1.4 MiB) is under its traced peak:
    no row fits, and the plan names what the same search finds, traced: the fewest changes, checkpointing."""
    from shardwise.app.plan import plan
    from shardwise.app.plan.fit import flags

    found = plan(TINY, gpus=2, gpus_per_node=2, gpu="custom:bf16=1000,fp8=2000,hbm=0.0013671875,hbm_bw=3,nvlink=400,"
                 "net=50", seq=32, fp8=False, hybrid=False, checkpointing=False, reshard_after_forward=True,
                 strategies=["optim_grads_params"])
    limit = (1 - 0.08) * 1.4 * 2**20
    assert [r.fits for r in found.rows] == [False] and found.rows[0].memory.peak > limit
    fit = found.would_fit
    assert (fit.candidate, fit.gpus) == (Candidate(activation_checkpointing=True), 2) and fit.memory.peak <= limit
    assert found.why() == (f"no candidate fits. What fits: {fit.candidate.label()} ({flags(fit.candidate)}) "
                           f"(peak {fit.memory.peak / 2**20:.1f} MiB per GPU).")

@pytest.mark.slow  # among the quick tier's largest: out of it (docs/testing.md, "How long it takes")
def test_the_command_plans_a_preset_and_names_what_it_recommends(capsys):
    from shardwise.app.cli import main

    # ZeRO-1/2/3 without checkpointing (4 traces, not 16): hybrid and checkpointed candidates are traced by the
    # tests above, and docs/plan.md's worked examples (test_plan_doc.py) run the command over every candidate
    assert main(["plan", "--preset", "tiny", "--gpus", "4", "--gpus-per-node", "2", "--gpu", "H100", "--seq", "128",
                 "--global-batch", "8", "--micro-batch", "2", "--no-fp8", "--no-hybrid",
                 "--activation-checkpointing", "off"]) == 0
    out = capsys.readouterr().out
    assert "recommended: ZeRO-" in out and "why: " in out and "dominates" in out
    assert main(["plan", "--preset", "tiny", "--hf-config", "x", "--gpus", "2"]) == 2
    assert "name one model" in capsys.readouterr().err


@pytest.mark.slow  # calibrate() spawns its gloo processes
def test_calibrate_measures_this_machine_and_plan_reads_it_back(tmp_path):
    """``--calibrate``: a gloo all-gather line (latency, bandwidth) through the points it timed, a layer's rate,
    written where asked; ``--calibration`` then plans for that machine in place of a named GPU."""
    import json

    from shardwise.app.plan.api import plan
    from shardwise.app.plan.calibrate import calibrate, fit_alpha_beta

    assert fit_alpha_beta([(b, 1e-4 + b / 2 / 5e9) for b in (1e6, 4e6, 16e6)], 2) == pytest.approx((1e-4, 5e9))
    path = calibrate(tmp_path / "calibration.json")
    data = json.loads(path.read_text())
    assert data["gpu"]["nvlink_bw"] > 0 and data["gpu"]["bf16_flops"] > 0
    assert [len(c["points"]) for c in data["measured"]["collectives"].values()] == [5, 5]
    found = plan(dict(layers=2, hidden=64, heads=4, ffn=128, vocab=128), gpus=2, gpus_per_node=2, seq=32,
                 global_batch=4, micro_batches=[2], compiled=False, fp8=False, hybrid=False, calibration=path,
                 strategies=["optim_grads_params"], checkpointing=False, reshard_after_forward=True)
    assert found.cluster.gpu.name == "cpu (calibrated)" and found.recommended is not None
    with pytest.raises(ValueError, match="calibration=.*no such file"):
        plan("tiny", gpus=2, calibration=tmp_path / "missing.json")
