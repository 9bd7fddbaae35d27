"""``shardwise bench --fp8``: the flag's checks, rows per FP8 mode, and FP8 runs of shardwise and FSDP2 (with
torchao's FP8 all-gather) that agree on CPU, on 2 processes."""

from __future__ import annotations

import pytest

from shardwise.app.bench import cli, report
from tests.helpers.bench import tiny_options
from tests.helpers.distributed import run_distributed


def test_fp8_options(capsys):
    opts, _ = cli.parse_options(["--device", "cpu", "--fp8", "off,tensorwise"])
    assert opts.fp8 == ("off", "tensorwise") and opts.compile == "on"  # FP8 compiles by default
    assert cli.parse_options(["--device", "cpu", "--fp8", "rowwise", "--compile", "off"])[0].compile == "off"
    assert cli.parse_options(["--device", "cpu"])[0].fp8 == ("off",)
    for argv, message in ((["--fp8", "mxfp8"], "--fp8 mxfp8: unknown mode 'mxfp8'"),
                          (["--fp8", "rowwise,rowwise"], "name each mode once")):
        assert cli.main(["--device", "cpu", *argv]) == 2
        assert message in capsys.readouterr().err


def test_fp8_rows_compare_within_their_mode():
    def run(wrapper, fp8, tok):
        return {"size": "2.8b", "wrapper": wrapper, "repeat": 0, "status": "ok", "params": 2_800_000_000,
                "device": "cuda", "world_size": 1, "compiled": True, "fp8": fp8, "tokens_per_s_per_gpu": tok,
                "peak_alloc_gib": 10.0, "peak_reserved_gib": 11.0, "mfu": 0.4, "loss_first": 5.0,
                "loss_last": 4.0, "exposed_comm_frac": None, "exposed_comm_ms_per_step": None}

    runs = [run("fsdp2", None, 100), run("none", None, 125), run("shardwise", None, 110),
            run("fsdp2", "tensorwise", 120), run("none", "tensorwise", 150), run("shardwise", "tensorwise", 140)]
    rows = {report.label(r): r for r in report.summarize(runs, 1.6e-2)}
    fp8 = rows["shardwise +compile +fp8 tensorwise"]
    assert fp8["tokens_ratio"] == pytest.approx(140 / 120) and fp8["ceiling_ratio"] == pytest.approx(140 / 150)
    assert rows["shardwise +compile"]["ceiling_ratio"] == pytest.approx(110 / 125)


def _bench_fp8(out: str):
    opts = tiny_options(["shardwise-fp8ag", "fsdp2-fp8ag", "megatron-fsdp"], 2, profile_steps=1, fp8=("tensorwise",))
    return cli.worker(opts, out, "test")


@pytest.mark.slow  # among the quick tier's largest: out of it (docs/testing.md, "How long it takes")
def test_tiny_fp8_benchmark_shardwise_and_fsdp2_fp8_gathers_agree(tmp_path):
    runs = {r["wrapper"]: r for r in run_distributed(_bench_fp8, 2, str(tmp_path))[0]}
    assert runs["megatron-fsdp"]["status"] == "skipped"
    mine, theirs = runs["shardwise-fp8ag"], runs["fsdp2-fp8ag"]
    assert mine["status"] == theirs["status"] == "ok" and mine["fp8"] == "tensorwise"
    # both cast each weight from its fp32 main values with the global amax: the same FP8 training
    assert mine["loss_last"] == pytest.approx(theirs["loss_last"], rel=1e-4), (mine, theirs)
    assert "shardwise-fp8ag +fp8 tensorwise" in (tmp_path / "bench.md").read_text()
