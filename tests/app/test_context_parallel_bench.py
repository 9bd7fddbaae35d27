"""``shardwise bench --cp N``: refusals by flag and value before any process starts, and a
CP run on gloo that trains and reports its activations next to the estimate."""

from __future__ import annotations

import json
import math

import pytest

from shardwise.app.bench.cli import main
from shardwise.app.bench.context_parallel import format_context_parallel_run

SMALL = ["--device", "cpu", "--sizes", "tiny", "--steps", "2", "--warmup", "1", "--micro-batch", "1"]


@pytest.mark.parametrize("argv,message", [
    (["--cp", "-1"], "--cp -1: must not be negative"),
    (["--cp", "2", "--seq-len", "30"], "--seq-len 30: the sequence length must be divisible by 2 x --cp = 4"),
    (["--cp", "3", "--nproc", "3"], "--sizes tiny (seq_len 128): the sequence length must be divisible by 2 x --cp = 6"),
    (["--cp", "4", "--nproc", "2", "--seq-len", "64"], "--cp 4: must divide the number of processes, 2"),
    (["--cp", "2", "--pp", "2"], "--pp 2: with --cp 2 is not built yet in the benchmark"),
    (["--cp", "2", "--compile"], "--compile on: with --cp 2 is not built yet in the benchmark"),
    (["--cp", "2", "--offload"], "--offload 1.0: with --cp 2 is not built yet in the benchmark"),
    (["--cp", "2", "--wrappers", "fsdp2,shardwise"], "--wrappers fsdp2,shardwise: --cp 2 trains shardwise only"),
])
def test_cp_flags_are_refused_naming_flag_and_value(argv, message, capsys, tmp_path):
    assert main(SMALL + argv + ["--out", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_cp2_bench_trains_and_reports_its_activations(tmp_path):
    out = tmp_path / "bench"
    assert main(SMALL + ["--nproc", "2", "--cp", "2", "--seq-len", "64", "--out", str(out)]) == 0
    (run,) = json.loads((out / "bench_cp.json").read_text())["runs"]
    assert run["status"] == "ok" and run["cp"] == 2 and run["dp"] == 1 and run["tokens_per_rank"] == 32
    assert run["tokens_per_s_per_gpu"] > 0 and math.isfinite(run["loss_last"])
    # both reported (the estimate's count is held exactly to autograd's saved bytes for the bare GPT in
    # tests/app/test_context_parallel_train.py; under fully_shard's bf16 policy the bench measures more)
    assert run["activations_measured"] > 0 and run["activations_estimate"] > 0
    line = format_context_parallel_run(run)  # what rank 0 prints (in its own process)
    assert line.startswith("tiny cp=2 dp=1 seq=64 mb=1: ") and "activations MiB estimate/measured" in line
