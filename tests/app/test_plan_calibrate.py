"""``shardwise plan --calibrate``'s pure parts, with no GPU: which row a device name is, the efficiencies a
layer's timings give, the file ``build_record`` writes read back by ``load_calibration`` and planned with;
and the measuring functions themselves on the CPU (gloo, the same code the NCCL branch runs)."""

from __future__ import annotations

import json

import pytest

from shardwise.app.plan.calibrate import (
    GPU_SIZES, build_record, fit_alpha_beta, fit_efficiency, identify_gpu, measure_collectives, measure_layer,
    summary,
)
from shardwise.app.plan.hardware import EFFICIENCY, GPUS, load_calibration

H100 = GPUS["H100"]


def _layer(width, flops, compiled, matmul, elementwise, seq=4096, micro_batch=1, gpu=H100):
    """A layer point as ``measure_layer`` returns it, timed by the step model's own compute term."""
    per_token = 3 * flops / (matmul * gpu.bf16_flops) + elementwise * width / gpu.hbm_bw
    seconds = per_token * seq * micro_batch
    return {"shape": f"w{width}", "width": width, "seq": seq, "micro_batch": micro_batch, "compiled": compiled,
            "flops_per_token": flops, "seconds": seconds, "flops_per_s": 3 * flops * seq * micro_batch / seconds}


def _layers(matmul=0.55, eager=700.0, compiled=150.0):
    return [_layer(w, f, c, matmul, compiled if c else eager) for c in (False, True)
            for w, f in ((2048, 128e6), (4096, 503e6))]


def _collectives(world, latency=15e-6, bw=230e9, sizes=GPU_SIZES):
    line = lambda b: latency + (world - 1) / world * b / bw  # noqa: E731
    return {"all_gather": [(b, line(b)) for b in sizes], "reduce_scatter": [(b, line(b)) for b in sizes]}


def test_fit_alpha_beta_recovers_the_line_and_clamps_latency_at_zero():
    assert fit_alpha_beta([(b, 1e-4 + b / 2 / 5e9) for b in (1e6, 4e6, 16e6)], 2) == pytest.approx((1e-4, 5e9))
    assert fit_alpha_beta([(b, 2e-5 + 7 / 8 * b / 2.4e11) for b in GPU_SIZES], 8) == pytest.approx((2e-5, 2.4e11))
    # a line through below the origin: latency 0, the bandwidth fitted alone
    latency, bw = fit_alpha_beta([(1e6, 0.4e-3), (4e6, 2.1e-3), (16e6, 8.2e-3)], 2)
    assert latency == 0.0 and 1e9 < bw < 1.3e9


@pytest.mark.parametrize("name,row", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100"), ("NVIDIA H200", "H200"),
    ("NVIDIA B200", "B200"), ("NVIDIA GB200", "GB200"), ("nvidia gb200", "GB200"),
    ("NVIDIA GH200 480GB", None), ("NVIDIA A100-SXM4-80GB", None), ("NVIDIA GeForce RTX 4090", None), ("", None),
])
def test_identify_gpu_from_the_device_name(name, row):
    assert identify_gpu(name) == row


def test_fit_efficiency_recovers_matmul_and_both_elementwise_terms():
    eff, notes = fit_efficiency(_layers(), H100.bf16_flops, H100.hbm_bw)
    assert eff == pytest.approx({"matmul": 0.55, "elementwise_eager": 700.0, "elementwise_compiled": 150.0})
    assert notes == []


def test_fit_efficiency_holds_what_the_points_cannot_separate():
    eager_only = [p for p in _layers() if not p["compiled"]]  # torch.compile failed: compiled keeps its constant
    eff, notes = fit_efficiency(eager_only, H100.bf16_flops, H100.hbm_bw)
    assert eff == pytest.approx({"matmul": 0.55, "elementwise_eager": 700.0,
                                 "elementwise_compiled": EFFICIENCY.elementwise_compiled})
    assert notes == [f"elementwise_compiled: kept at {EFFICIENCY.elementwise_compiled:g} (not measured)"]
    one_width = [_layer(4096, 503e6, True, 0.6, EFFICIENCY.elementwise_compiled)]  # matmul alone
    eff, notes = fit_efficiency(one_width, H100.bf16_flops, H100.hbm_bw)
    assert eff["matmul"] == pytest.approx(0.6) and eff["elementwise_compiled"] == EFFICIENCY.elementwise_compiled
    assert "elementwise_compiled: kept at 146 (one width measured)" in notes
    # the wider layer relatively slower than its FLOPs: elementwise would come out below 0, held at 0
    skewed = [_layer(2048, 128e6, True, 0.7, 0.0), _layer(4096, 503e6, True, 0.6, 0.0)]
    eff, notes = fit_efficiency(skewed, H100.bf16_flops, H100.hbm_bw)
    assert eff["elementwise_compiled"] == 0.0 and 0.6 < eff["matmul"] < 0.7
    assert "elementwise_compiled: fitted below 0, held at 0" in notes


def _write(tmp_path, record):
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(record))
    return path


def test_gpu_record_round_trips_through_load_calibration_and_plans(tmp_path):
    from shardwise.app.plan.api import plan

    record = build_record(_collectives(8), _layers(), backend="nccl", world=8, device_name="NVIDIA H100 80GB HBM3",
                          memory=79e9, versions={"torch": "2.x", "cuda": "12.x", "nccl": "2.27.3"})
    eff, gpu = load_calibration(_write(tmp_path, record))
    assert gpu["name"] == "H100 (calibrated)" and gpu["bf16_flops"] == H100.bf16_flops
    assert (gpu["nvlink_bw"], gpu["nvlink_latency"]) == pytest.approx((230e9, 15e-6))
    assert (gpu["net_bw"], gpu["net_latency"]) == (H100.net_bw, H100.net_latency)  # one node: not measured
    assert (eff.matmul, eff.elementwise_eager, eff.elementwise_compiled) == pytest.approx((0.55, 700.0, 150.0))
    assert eff.fp8_speedup == EFFICIENCY.fp8_speedup and "nccl" in eff.source
    m = record["measured"]
    assert (m["backend"], m["world"], m["gpu_row"], m["nccl"]) == ("nccl", 8, "H100", "2.27.3")
    assert m["collectives"]["reduce_scatter"]["dtype"] == "float32" and len(m["layers"]) == 4
    assert "not measured" in m["links"] and m["when"]
    assert any("230.00 GB/s" in line for line in summary(record))
    found = plan(dict(layers=2, hidden=64, heads=4, ffn=128, vocab=128), gpus=8, seq=32, global_batch=8,
                 micro_batches=[1], fp8=False, hybrid=False, calibration=tmp_path / "calibration.json",
                 strategies=["optim_grads_params"], checkpointing=False, reshard_after_forward=True)
    assert found.cluster.gpu.name == "H100 (calibrated)" and found.recommended is not None


def test_one_gpu_keeps_the_rows_links_and_an_unknown_gpu_keeps_its_rate(tmp_path):
    record = build_record({}, _layers(), backend="nccl", world=1, device_name="NVIDIA H200", memory=140e9,
                          versions={})
    eff, gpu = load_calibration(_write(tmp_path, record))
    h200 = GPUS["H200"]
    assert (gpu["nvlink_bw"], gpu["nvlink_latency"], gpu["net_bw"]) == (h200.nvlink_bw, h200.nvlink_latency,
                                                                        h200.net_bw)
    assert record["measured"]["collectives"] == {} and "no collectives" in record["measured"]["links"]
    assert eff.matmul == pytest.approx(0.55 * H100.bf16_flops / h200.bf16_flops)  # same peak: 0.55

    layers = _layers()
    record = build_record(_collectives(4), layers, backend="nccl", world=4, device_name="NVIDIA A100-SXM4-80GB",
                          memory=80e9, versions={})
    eff, gpu = load_calibration(_write(tmp_path, record))
    widest_compiled = layers[-1]["flops_per_s"]
    assert gpu["name"] == "custom (calibrated): NVIDIA A100-SXM4-80GB" and gpu["hbm_bytes"] == 80e9
    assert gpu["bf16_flops"] == gpu["fp8_flops"] == pytest.approx(widest_compiled)
    assert (eff.matmul, eff.elementwise_compiled, eff.elementwise_eager) == (1.0, 0.0, 0.0)
    assert gpu["nvlink_bw"] == pytest.approx(230e9)
    assert any("names no GPU row" in n for n in record["measured"]["notes"])


def test_a_file_from_before_the_gpu_calibration_still_loads(tmp_path):
    old = {"measured": {"all_gather_points": [[65536, 4e-4], [16777216, 0.018]], "world": 2,
                        "layer_flops_per_s": 6e10, "when": "2026-01-01 00:00:00"},
           "gpu": {"name": "cpu (calibrated)", "bf16_flops": 6e10, "fp8_flops": 6e10, "hbm_bytes": 1.2e10,
                   "hbm_bw": 1e12, "nvlink_bw": 4.5e8, "net_bw": 4.5e8, "nvlink_latency": 0.0, "net_latency": 0.0,
                   "source": "shardwise plan --calibrate (2 gloo processes, this machine)"},
           "efficiency": {"matmul": 1.0, "elementwise_compiled": 0.0, "elementwise_eager": 0.0, "hbm": 1.0}}
    old["gpu"]["a_later_key"] = 1  # keys GpuSpec does not have are left out
    eff, gpu = load_calibration(_write(tmp_path, old))
    assert gpu["name"] == "cpu (calibrated)" and "a_later_key" not in gpu and eff.matmul == 1.0
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_calibration(tmp_path / "broken.json")


@pytest.mark.slow  # measure_collectives spawns 2 gloo processes
def test_the_measuring_functions_on_the_cpu():
    """The functions the NCCL branch calls, with gloo and the CPU as their parameters."""
    sizes = [2**16, 2**18]
    found = measure_collectives("gloo", 2, sizes, calls=2, repeats=2)
    assert sorted(found) == ["all_gather", "reduce_scatter"]
    for points in found.values():
        assert [b for b, _ in points] == sizes and all(t > 0 for _, t in points)
    point = measure_layer("tiny", 32, 2, device="cpu", repeats=2)
    assert (point["width"], point["seq"], point["compiled"]) == (128, 32, False)
    assert point["seconds"] > 0 and point["flops_per_s"] == pytest.approx(3 * point["flops_per_token"] * 64
                                                                           / point["seconds"])


@pytest.mark.slow  # measure_engine spawns its gloo process
def test_the_engines_own_time_becomes_host_per_unit_and_on_the_cpu_adamws_rate(tmp_path):
    from shardwise.app.plan.calibrate_engine import measure_engine
    from shardwise.app.plan.step_time import ADAM_BYTES

    engine = {"size": "tiny", "units": 6, "params": 1_000_000, "ceiling_s": 0.040, "wrapped_s": 0.046,
              "adam_s": 0.004, "host_per_unit": 0.0005}
    record = build_record(_collectives(2, 2e-4, 1e9, [2**16, 2**20]), [_layer(128, 4e5, False, 1.0, 0.0)],
                          backend="gloo", world=2, device_name="cpu", memory=8e9, versions={"torch": "2.x"},
                          cores=2, engine=engine)
    eff, gpu = load_calibration(_write(tmp_path, record))
    assert eff.host_per_unit_eager == eff.host_per_unit_compiled == 0.0005 and eff.fp8_speedup == 1.0
    assert gpu["hbm_bw"] == pytest.approx(ADAM_BYTES * 1e6 / 0.004) and gpu["cores"] == 2
    assert any("0.50 ms per unit" in line for line in summary(record))
    gpu_record = build_record(_collectives(8), _layers(), backend="nccl", world=8, device_name="NVIDIA H100",
                              memory=79e9, versions={}, engine=engine)
    assert gpu_record["gpu"]["hbm_bw"] == H100.hbm_bw and gpu_record["gpu"]["cores"] == 0  # HBM: the row's
    assert gpu_record["efficiency"]["host_per_unit_eager"] == 0.0005
    assert "host_per_unit_compiled" not in gpu_record["efficiency"]

    found = measure_engine("gloo", repeats=2)  # the real thing, one gloo rank
    assert found["units"] == 6 and found["params"] > 0 and found["adam_s"] > 0
    assert found["host_per_unit"] == pytest.approx(max(0.0, found["wrapped_s"] - found["ceiling_s"]) / 12)
