"""``shardwise bench``: exposed-communication arithmetic, report writers, options, a tiny run on 2 processes."""

import json
import random
from types import SimpleNamespace

import pytest
import torch

from shardwise.app.bench import cli, report, runner
from shardwise.app.bench.runner import exposed_length, interval_length, merge_intervals

from tests.helpers.bench import tiny_options
from tests.helpers.distributed import device, run_distributed


# ------------------------------------------------------------------ interval arithmetic
def test_merge_and_length():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (7, 8), (4, 4)]) == [(0, 3), (5, 8)]
    assert interval_length([(0, 10), (2, 3), (9, 12), (20, 21)]) == 13
    assert merge_intervals([]) == [] and interval_length([]) == 0


@pytest.mark.parametrize("comm,compute,exposed", [
    ([(0, 10)], [], 10),                              # nothing to hide behind
    ([(0, 10)], [(0, 10)], 0),                        # fully overlapped
    ([(0, 10)], [(-5, 3), (8, 20)], 5),               # covered at both ends
    ([(0, 10)], [(1, 2), (4, 5), (7, 8)], 7),         # holes inside one comm kernel
    ([(0, 4), (2, 6), (10, 12)], [(3, 11)], 3 + 1),   # overlapping comm counted once
    ([(0, 2)], [(5, 9)], 2),                          # disjoint
    ([(3, 5), (0, 1)], [(4, 6), (0, 0.5)], 1 + 0.5),  # unsorted input
])
def test_exposed_length(comm, compute, exposed):
    assert exposed_length(comm, compute) == pytest.approx(exposed)


def test_exposed_length_matches_a_brute_force_count():
    rng = random.Random(0)
    for _ in range(200):
        def spans(n):
            out = []
            for _ in range(n):
                s = rng.randrange(0, 60)
                out.append((s, s + rng.randrange(0, 15)))
            return out
        comm, compute = spans(rng.randrange(0, 6)), spans(rng.randrange(0, 8))
        brute = sum(1 for t in range(80)
                    if any(s <= t < e for s, e in comm) and not any(s <= t < e for s, e in compute))
        assert exposed_length(comm, compute) == brute


def test_kernel_intervals_classifies_gpu_events():
    from torch.autograd import DeviceType

    def event(name, kind, start, dur, device_type=DeviceType.CUDA):
        return SimpleNamespace(name=lambda: name, activity_type=lambda: kind, start_ns=lambda: start,
                               duration_ns=lambda: dur, device_type=lambda: device_type,
                               is_user_annotation=lambda: kind.endswith("annotation"))

    events = [
        event("ncclDevKernel_AllGather_RING_LL", "kernel", 0, 100),
        event("ampere_bf16_gemm", "kernel", 50, 100),
        event("Memcpy DtoD", "gpu_memcpy", 160, 10),
        event("FSDP::all_gather", "gpu_user_annotation", 0, 1000),    # a range on the GPU timeline
        event("aten::mm", "cpu_op", 0, 500, DeviceType.CPU),           # host side
    ]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    comm, other = runner.kernel_intervals(prof)
    assert comm == [(0, 100)] and other == [(50, 150), (160, 170)]
    assert exposed_length(comm, other) == 50


# ------------------------------------------------------------------ reports
def _run(size, wrapper, repeat=0, tok=1000.0, mem=10.0, loss=5.0, status="ok", **extra):
    base = {"size": size, "wrapper": wrapper, "repeat": repeat, "status": status, "device": "cuda",
            "world_size": 2, "params": 890_000_000 if size == "0.9b" else 8_030_000_000}
    if status != "ok":
        return {**base, "reason": extra.get("reason", "not installed")}
    return {**base, "tokens_per_s_per_gpu": tok, "mfu": 0.45, "peak_alloc_gib": mem, "peak_reserved_gib": mem + 1,
            "exposed_comm_frac": 0.03, "exposed_comm_ms_per_step": 4.0, "loss_first": 10.4, "loss_last": loss,
            "wrap_s": 1.0, "step_s": 0.1}


def test_reports_contain_every_wrapper(tmp_path):
    runs = [_run("0.9b", "fsdp2", tok=1000, mem=10), _run("0.9b", "shardwise", tok=1100, mem=9, loss=5.001),
            _run("0.9b", "ddp", tok=900, mem=20, loss=5.2), _run("0.9b", "megatron-fsdp", status="skipped"),
            _run("8b", "fsdp2", tok=100, mem=60), _run("8b", "shardwise", tok=110, mem=50),
            _run("8b", "ddp", status="skipped", reason="does not fit")]
    meta = {"date": "today", "command": "shardwise bench --sizes 0.9b,8b", "loss_rtol": 1.6e-2,
            "torch": "2.11", "nccl": "2.28.9", "world_size": 2}
    table = report.write_reports(tmp_path, meta, runs)
    data = json.loads((tmp_path / "bench.json").read_text())
    md = (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for wrapper in ("fsdp2", "shardwise", "ddp", "megatron-fsdp"):
        assert f"| {wrapper} |" in md and f"| {wrapper} |" in table
        assert any(r["wrapper"] == wrapper for r in data["summary"])
    rows = {(r["size"], r["wrapper"]): r for r in data["summary"]}
    assert rows[("0.9b", "shardwise")]["tokens_ratio"] == pytest.approx(1.1)
    assert rows[("0.9b", "shardwise")]["mem_ratio"] == pytest.approx(0.9)
    assert rows[("0.9b", "shardwise")]["loss_ok"] is True
    assert rows[("0.9b", "ddp")]["loss_ok"] is False and "FAIL" in md
    assert rows[("8b", "ddp")]["status"] == "skipped" and "does not fit" in md
    assert "2.28.9" in md and "shardwise bench --sizes 0.9b,8b" in md


def test_repeats_average_and_compare_per_repeat(tmp_path):
    runs = [_run("0.9b", "fsdp2", 0, tok=1000), _run("0.9b", "shardwise", 0, tok=1200),
            _run("0.9b", "shardwise", 1, tok=1000), _run("0.9b", "fsdp2", 1, tok=1000)]
    rows = report.summarize(runs, 1.6e-2)
    mine = next(r for r in rows if r["wrapper"] == "shardwise")
    assert mine["tokens_per_s_per_gpu"] == pytest.approx(1100) and mine["tokens_ratio"] == pytest.approx(1.1)
    assert [r["tokens_ratio"] for r in runs if r["wrapper"] == "shardwise"] == pytest.approx([1.2, 1.0])
    assert "1,200, 1,000" in report.markdown_table(rows)


def test_cpu_runs_are_reported_per_rank(tmp_path):
    runs = [{**_run("0.9b", "fsdp2"), "device": "cpu"}, {**_run("0.9b", "shardwise", tok=900), "device": "cpu"}]
    assert "1,000 tok/s/rank" in report.format_run(runs[0]) and "GPU" not in report.format_run(runs[0])
    report.write_reports(tmp_path, {"date": "today", "loss_rtol": 1.6e-2}, runs)
    md = (tmp_path / "bench.md").read_text()
    assert "| tokens/s/rank |" in md and "tokens/s/GPU" not in md and "a smoke test" in md
    assert "tok/s/GPU" in report.format_run(_run("0.9b", "fsdp2"))  # on GPUs it stays per GPU


# ------------------------------------------------------------------ options
def test_help_says_each_default_once():
    parser = cli.build_parser()
    helps = {a.dest: parser._get_formatter()._expand_help(a) for a in parser._actions if a.help}
    assert [d for d, h in helps.items() if h.count("(default") > 1] == []
    assert helps["steps"].endswith("(default: 10)") and helps["seed"].endswith("(default: 0)")


def test_options_per_size_steps_and_errors(capsys):
    opts, _ = cli.parse_options(["--device", "cpu", "--steps", "7,tiny=2", "--warmup", "0", "--size", "tiny"])
    assert opts.compile == "off" and "none" in opts.wrappers
    assert cli.parse_options(["--device", "cpu", "--compile"])[0].compile == "on"
    assert cli.parse_options(["--device", "cpu", "--compile", "both"])[0].compile == "both"
    size = runner.SIZES["tiny"]
    assert opts.steps_for(size) == 2 and opts.warmup_for(size) == 0 and opts.sizes == ["tiny"]
    assert opts.steps_for(runner.SIZES["8b"]) == 7 and opts.warmup_for(runner.SIZES["8b"]) == 0
    for argv, message in ((["--sizes", "3b"], "unknown size '3b'"),
                          (["--wrappers", "fsdp2,zero"], "unknown wrapper 'zero'"),
                          (["--steps", "8b=x"], "is not an integer"),
                          (["--strategy", "zero9"], "--strategy zero9"),
                          (["--compile", "--compile-backend", "nope"], "--compile-backend nope: unknown backend")):
        assert cli.main(["--device", "cpu", *argv]) == 2
        assert message in capsys.readouterr().err


# ------------------------------------------------------------------ end to end on 2 processes
def _bench_tiny(out: str, compile: str = "off", wrappers=("shardwise", "fsdp2", "ddp", "none")):
    opts = tiny_options(wrappers, 2, profile_steps=1, compile=compile, compile_backend="aot_eager")
    return cli.worker(opts, out, "test")


def test_tiny_benchmark_on_two_processes(tmp_path):
    runs = run_distributed(_bench_tiny, 2, str(tmp_path))[0]
    assert [r["wrapper"] for r in runs] == ["shardwise", "fsdp2", "ddp", "none"]
    assert all(r["status"] == "ok" for r in runs), runs
    ref = next(r for r in runs if r["wrapper"] == "fsdp2")
    ceiling = next(r for r in runs if r["wrapper"] == "none")
    for r in runs:
        assert r["tokens_per_s_per_gpu"] > 0 and r["world_size"] == 2 and r["compiled"] is False
        assert abs(r["loss_first"] - ref["loss_first"]) / ref["loss_first"] < 1e-2  # same weights, same data
        assert r["loss_ok"] is True
        assert r["ceiling_ratio"] == pytest.approx(r["tokens_per_s_per_gpu"] / ceiling["tokens_per_s_per_gpu"])
    summary = json.loads((tmp_path / "bench.json").read_text())["summary"]
    assert {r["wrapper"] for r in summary} == {"shardwise", "fsdp2", "ddp", "none"}
    md = (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").exists() and "| shardwise |" in md and "| none |" in md


@pytest.mark.slow  # among the quick tier's largest: out of it (docs/testing.md, "How long it takes")
def test_tiny_benchmark_compiled_and_eager_interleaved(tmp_path):
    runs = run_distributed(_bench_tiny, 2, str(tmp_path), "both", ("shardwise", "fsdp2", "none"))[0]
    # repeat 0: eager runs, then compiled ones, in --wrappers order
    assert [(r["wrapper"], r["compiled"]) for r in runs] == [
        ("shardwise", False), ("fsdp2", False), ("none", False),
        ("shardwise", True), ("fsdp2", True), ("none", True)]
    assert all(r["status"] == "ok" for r in runs), runs
    for r in runs:
        if r["compiled"]:  # every layer's forward whole in one graph, compiled once
            assert r["graph_breaks"] == 0 and r["frames_compiled_timed"] == 0, r
            assert r["first_step_s"] > 0
        else:
            assert r["graph_breaks"] is None
        assert r["loss_ok"] is True
    rows = {(r["wrapper"], r["compiled"]): r for r in json.loads((tmp_path / "bench.json").read_text())["summary"]}
    assert len(rows) == 6 and all(r["tokens_ratio"] is not None for r in rows.values())
    for compiled in (False, True):  # each mode is compared with FSDP2 and the ceiling of its own mode
        assert rows[("fsdp2", compiled)]["tokens_ratio"] == 1.0 and rows[("none", compiled)]["ceiling_ratio"] == 1.0
    md = (tmp_path / "bench.md").read_text()
    assert "| shardwise +compile |" in md and "| none +compile |" in md and "| shardwise |" in md


def _profile_tiny():
    from torch.nn.parallel import DistributedDataParallel

    from shardwise.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(GPTConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = runner._make_batches(64, 2, 16, 2, 0, torch.distributed.get_rank(), torch.device("cpu"))
    return runner._profile(model, optimizer, None, batches, torch.device("cpu"), runner.BenchOptions(), "t")


def test_profile_gathers_every_rank():
    if device().type != "cpu":
        pytest.skip("CPU profile path")
    out = run_distributed(_profile_tiny, 2)
    assert out[0] == out[1]
    assert out[0]["exposed_comm_frac"] == 0.0 and len(out[0]["exposed_comm_frac_per_rank"]) == 2
    assert out[0]["profiled_steps"] == 2


def test_the_fsdp2_idiom_trains_as_the_one_call_form(tmp_path):
    """``shardwise-fsdp2-idiom`` (fully_shard on each layer, the embedding and the head, then the root) builds
    the same units as ``shardwise``'s one call: the same losses, bit for bit."""
    runs = run_distributed(_bench_tiny, 2, str(tmp_path), "off", ("shardwise", "shardwise-fsdp2-idiom"))[0]
    one_call, idiom = runs
    assert one_call["status"] == idiom["status"] == "ok", runs
    assert (idiom["loss_first"], idiom["loss_last"]) == (one_call["loss_first"], one_call["loss_last"])


def _bench_tiny_offloaded(out: str):
    opts = tiny_options(["shardwise", "fsdp2"], 2, profile_steps=0, offload=0.5)
    return cli.worker(opts, out, "test")


def test_tiny_benchmark_offloaded(tmp_path):
    runs = run_distributed(_bench_tiny_offloaded, 2, str(tmp_path))[0]
    ours = next(r for r in runs if r["wrapper"] == "shardwise")
    assert ours["status"] == "ok" and ours["tokens_per_s_per_gpu"] > 0 and ours["host_peak_gib"] > 0
    fsdp2 = next(r for r in runs if r["wrapper"] == "fsdp2")
    if device().type == "cpu":  # FSDP2's CPUOffloadPolicy needs an accelerator to offload from
        assert fsdp2["status"] == "skipped" and "accelerator" in fsdp2["reason"]
    else:
        assert fsdp2["status"] == "ok"


def _bench_tiny_grad_comm(out: str, grad_comm_dtype: str):
    opts = tiny_options(["shardwise"], 3, profile_steps=0, grad_comm_dtype=grad_comm_dtype)
    return cli.worker(opts, out, "test")


def test_gradients_can_travel_in_bf16(tmp_path):
    """--grad-comm-dtype bf16 reaches shardwise's policy: the same first loss, a last loss near fp32's
    but not bit-equal (the reduction rounded)."""
    fp32 = run_distributed(_bench_tiny_grad_comm, 2, str(tmp_path / "fp32"), "fp32")[0][0]
    bf16 = run_distributed(_bench_tiny_grad_comm, 2, str(tmp_path / "bf16"), "bf16")[0][0]
    assert fp32["status"] == bf16["status"] == "ok"
    assert bf16["loss_first"] == fp32["loss_first"]
    assert bf16["loss_last"] != fp32["loss_last"]
    assert abs(bf16["loss_last"] - fp32["loss_last"]) < 1.6e-2 * abs(fp32["loss_last"])


def _bench_tiny_clipped(out: str, max_grad_norm: float, wrappers=("shardwise", "fsdp2", "shardwise-obo")):
    opts = tiny_options(wrappers, 3, profile_steps=0, max_grad_norm=max_grad_norm)
    return cli.worker(opts, out, "test")


def test_every_wrapper_clips_when_asked(tmp_path):
    """--max-grad-norm clips under shardwise and FSDP2 alike (losses agree, and move away from the
    unclipped run's); a BackwardOptimizer cannot clip, so its run is skipped with the reason."""
    plain = run_distributed(_bench_tiny_clipped, 2, str(tmp_path / "plain"), 0.0, ("shardwise",))[0]
    # AdamW hardly sees a uniform scale (m / sqrt(v)) until the clipped gradients fall below its eps
    clipped = run_distributed(_bench_tiny_clipped, 2, str(tmp_path / "clipped"), 1e-7)[0]
    ours, fsdp2, obo = clipped
    assert ours["status"] == fsdp2["status"] == "ok" and obo["status"] == "skipped"
    assert "cannot clip by the global norm" in obo["reason"]
    # the CPU runs step with foreach AdamW: the factor is applied in place (fold needs a fused optimizer)
    assert ours["clip_mode"] == fsdp2["clip_mode"] == "in-place" and plain[0]["clip_mode"] is None
    assert ours["loss_first"] == plain[0]["loss_first"] and ours["loss_last"] != plain[0]["loss_last"]
    assert abs(ours["loss_last"] - fsdp2["loss_last"]) < 2e-6 * abs(fsdp2["loss_last"])
    assert abs(plain[0]["loss_last"] - fsdp2["loss_last"]) > 2e-5 * abs(fsdp2["loss_last"])


def test_max_grad_norm_must_not_be_negative(capsys):
    assert cli.main(["--device", "cpu", "--max-grad-norm", "-1"]) == 2
    assert "--max-grad-norm -1.0: must be 0 (no clipping) or positive" in capsys.readouterr().err


def test_unknown_grad_comm_dtype_is_refused():
    with pytest.raises(SystemExit):
        cli.parse_options(["--grad-comm-dtype", "fp8"])


def test_the_fp32_main_ceiling_runs_beside_the_bf16_one(tmp_path):
    """``none-fp32main``: the no-wrapper ceiling with fp32 main weights, gradients and AdamW state (shardwise's
    optimizer bytes); same weights and data as ``none``, so the same first loss, and it trains. Beside them
    ``shardwise-bf16main``, shardwise with the bf16 ceiling's recipe, so one job compares both pairs."""
    runs = run_distributed(_bench_tiny, 2, str(tmp_path), "off", ("none", "none-fp32main", "shardwise-bf16main"))[0]
    assert [r["wrapper"] for r in runs] == ["none", "none-fp32main", "shardwise-bf16main"]
    assert all(r["status"] == "ok" for r in runs), [(r["status"], r.get("error"), r.get("loss_ok")) for r in runs]
    bf16, fp32, shardwise_bf16 = runs
    assert fp32["loss_first"] == bf16["loss_first"]  # the same bf16 forward before any step
    assert fp32["tokens_per_s_per_gpu"] > 0


def test_fp32_main_optimizer_keeps_fp32_copies_and_writes_the_bf16_weights():
    import torch

    from shardwise.app.bench.wrappers import Fp32MainOptimizer

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    opt = Fp32MainOptimizer(layer.parameters(), torch.device("cpu"))
    before = [m.detach().clone() for m in opt.main]
    layer(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    opt.zero_grad()
    assert all(m.dtype == torch.float32 for m in opt.main)
    assert all(not torch.equal(m, b) for m, b in zip(opt.main, before))
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(layer.parameters(), opt.main))
    assert all(p.grad is None for p in layer.parameters())
    assert {type(v) for s in opt.state.values() for v in s.values() if v.dim()} == {torch.Tensor}
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")
