"""``shardwise plan --dry-run`` on the CPU: the mechanics (docs/plan.md, "The dry run").

Why: a dry run is only worth its figures if rank 0 of world N is really built as at world N (each
parameter's rank-0 chunk), if its memory is the engine's (the same storages the static trace counts), and if
each emulated collective costs exactly the static model's alpha-beta term over the link its axis spans.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.app.plan.candidates import Candidate
from shardwise.app.plan.cli import main
from shardwise.app.plan.dry_run import NCCL_BYTES_PER_CHANNEL, NCCL_CHANNELS, dry_run, nccl_bytes
from shardwise.app.plan.emulated_wire import WireModel
from shardwise.app.plan.hardware import Cluster, parse_gpu
from shardwise.app.plan.model_source import preset_source
from shardwise.app.plan.step_time import collective_time
from shardwise.app.plan.trace import trace_memory

SEQ = 32
SOURCE = preset_source("tiny", seq=SEQ)


def _cluster(world: int) -> Cluster:
    return Cluster(world, min(8, world), parse_gpu("H100"))


def _full_shapes() -> dict:
    with torch.device("meta"):
        model = SOURCE.build(None, False)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 1024])
def test_rank_zero_holds_its_chunk_at_world_n(world):
    """Each parameter's local tensor is rank 0's ``torch.chunk`` of it over ``world`` (dim 0), and every
    emulated call costs the step model's term over its axis's link."""
    dry = dry_run(SOURCE, _cluster(world), Candidate(micro_batch=1), SEQ, world, steps=1, warmup=2)
    full = _full_shapes()
    assert set(dry.shards) == set(full)
    for name, shape in full.items():
        expected = tuple(torch.chunk(torch.empty(shape, device="meta"), world, dim=0)[0].shape)
        assert dry.shards[name] == expected, name
    kinds = {c.kind for c in dry.calls}
    assert kinds == {"all_gather", "reduce_scatter"}
    for call in dry.calls:
        assert call.ranks == world and call.axis == "dp_shard"
        bw, latency = _cluster(world).link(world, kind=call.kind)
        assert call.seconds == collective_time(call.kind, call.nbytes, world, bw, latency)
    assert dry.wire_s == pytest.approx(sum(c.seconds for c in dry.calls), rel=1e-12)
    assert dry.exposed_wire_s == dry.wire_s  # a CPU rank overlaps nothing
    assert dry.peak_allocated is None and dry.process_device_bytes is None  # n/a on the CPU


def test_memory_is_the_static_traces_storages():
    """The real steps make the storages the static trace counts under FakeTensorMode: the same peak, but for
    the DeviceMesh rank tensor (int32, one per rank) the rank-consistency description keeps, which the trace
    leaves out as a real tensor (on a GPU it is host memory)."""
    world, cand = 4, Candidate(micro_batch=1)
    dry = dry_run(SOURCE, _cluster(world), cand, SEQ, world, steps=1, warmup=2)
    static = trace_memory(SOURCE, world, cand, SEQ, exact=True)
    assert 0 <= dry.traced_peak - static.peak <= world * 4
    assert dry.shard_bytes == static.parts["main"]


def test_hybrid_axes_take_their_links():
    """HSDP's outer axis: ranks ``gpus / replicas`` apart, so over nodes the network's bandwidth and ring
    latency; its inner axis stays in a node."""
    cluster = _cluster(32)
    wire = WireModel(cluster, replicas=4)
    nbytes = 2**26
    inner = wire.seconds("all_gather", "dp_shard", 8, nbytes)
    assert inner == collective_time("all_gather", nbytes, 8, cluster.gpu.nvlink_bw, cluster.gpu.nvlink_latency)
    outer = wire.seconds("all_reduce", "dp_outer", 4, nbytes)
    assert outer == collective_time("all_reduce", nbytes, 4, *cluster.link(4, stride=8, kind="all_reduce"))
    assert cluster.link(4, stride=8)[0] == cluster.gpu.net_bw
    with pytest.raises(ValueError, match="replicas=3"):
        WireModel(cluster, replicas=3)


def test_nccl_buffers_are_modelled_per_communicator():
    assert nccl_bytes(1, {"dp_shard": 1}) == (0, 0)
    assert nccl_bytes(64, {"dp_shard": 64}) == (1, NCCL_CHANNELS * NCCL_BYTES_PER_CHANNEL)
    assert nccl_bytes(64, {"dp_outer": 8, "dp_shard": 8}) == (3, 3 * NCCL_CHANNELS * NCCL_BYTES_PER_CHANNEL)


@pytest.mark.parametrize("kw, match", [
    (dict(cand=Candidate(fp8=True)), "FP8 compute needs a CUDA device"),
    (dict(cuda_graphs=True), "cuda_graphs=True needs a CUDA device"),
    (dict(steps=0), "steps=0"),
    (dict(warmup=0), "warmup=0"),
    (dict(cand=Candidate(micro_batch=3)), "micro_batch=3"),
    (dict(global_batch=3), "global_batch=3"),
])
def test_refusals_name_the_argument(kw, match):
    cand = kw.pop("cand", Candidate(micro_batch=1))
    global_batch = kw.pop("global_batch", 4)
    with pytest.raises(ValueError, match=match):
        dry_run(SOURCE, _cluster(2), cand, SEQ, global_batch, device="cpu", **kw)


def test_cli_prints_the_dry_run_beside_the_plan(capsys):
    """``shardwise plan --dry-run``: the table has the static and the dry-run column, and says which figures
    are n/a on the CPU and which are modelled."""
    code = main(["--preset", "tiny", "--gpus", "16", "--seq", str(SEQ), "--global-batch", "32", "--micro-batch", "1",
                 "--eager", "--no-fp8", "--strategy", "optim_grads_params", "--activation-checkpointing", "off",
                 "--reshard-after-forward", "on", "--replicas", "2", "--outer-strategy", "no_shard",
                 "--dry-run", "--dry-run-steps", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "recommended: ZeRO-3, HSDP x2, no AC, mb 1" in out
    assert "dry run: rank 0 of 16 ranks on one cpu, ZeRO-3, HSDP x2, no AC, mb 1; 2 micro-batch(es)" in out
    assert "peak reserved GiB" in out and "n/a on CPU" in out
    assert "modelled: 3 communicators" in out


def test_train_dry_run_says_whether_the_job_fits(monkeypatch):
    """``shardwise train --dry-run``: the job's flags become the dry run's candidate; it says fits and the
    expected tokens/s, and stops the job (``DoesNotFit``) where the measured memory exceeds what is there."""
    from shardwise.app.config import resolve_config
    from shardwise.app.memory import DoesNotFit
    from shardwise.app.plan import job_dry_run

    cfg, model_cfg = resolve_config(["--preset", "tiny", "--seq-len", str(SEQ), "--micro-batch-size", "2",
                                     "--strategy", "optim", "--dry-run", "--device", "cpu"])
    assert job_dry_run.job_candidate(cfg, model_cfg) == Candidate(strategy="optim", micro_batch=2)
    found, line = job_dry_run.dry_run_job(cfg, model_cfg, 2, "cpu")
    assert found.world == 2 and found.candidate.label() in line and ": fits; expected" in line
    monkeypatch.setattr(job_dry_run, "host_available_bytes", lambda: found.traced_peak)  # one rank's, not two
    with pytest.raises(DoesNotFit, match="does not fit"):
        job_dry_run.dry_run_job(cfg, model_cfg, 2, "cpu")


def test_plan_dry_run_at_world_one_has_no_wire():
    """``shardwise.plan(..., dry_run=True)`` at one GPU (the GPU check's world 1): no collective, no NCCL
    communicator, the whole model on rank 0; the JSON carries the dry run beside the rows."""
    import json

    import shardwise
    from shardwise.app.plan.report import as_json

    found = shardwise.plan("tiny", gpus=1, seq=SEQ, global_batch=1, compiled=False, fp8=False, hybrid=False,
                           strategies=["optim_grads_params"], checkpointing=False, reshard_after_forward=True,
                           dry_run=True, dry_run_steps=1)
    dry = json.loads(as_json(found))["dry_run"]
    assert dry["world"] == 1 and dry["calls_per_step"] == 0 and dry["wire_s"] == 0.0
    assert (dry["nccl_communicators"], dry["nccl_bytes"]) == (0, 0)
    assert found.dry_run.shards == _full_shapes()
    assert dry["traced_peak"] > 0 and dry["peak_allocated"] is None
