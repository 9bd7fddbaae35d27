"""``shardwise bench --pp``: a pipeline of shardwise stages on 2 gloo processes, measured against the estimate."""

import json

import pytest

from shardwise.app.bench import cli, runner
from shardwise.app.bench.pipeline import format_pipeline_run

from tests.helpers.distributed import device, run_distributed


def _bench_pp(out: str, schedule: str):
    opts = runner.BenchOptions(sizes=["tiny"], device=device().type, steps={"*": 1}, warmup={"*": 1},
                               profile_steps=0, micro_batch=2, seq_len=32, pp=2, pp_schedule=schedule)
    return cli.worker(opts, out, "test")


@pytest.mark.parametrize("schedule,virtual,in_flight", [("1f1b", 1, [2, 1]), ("interleaved", 2, [5, 3])])
def test_a_pipeline_bench_measures_what_the_estimate_predicts(tmp_path, schedule, virtual, in_flight):
    runs = run_distributed(_bench_pp, 2, str(tmp_path), schedule)
    run = runs[0][0]
    assert runs[1][0] == run  # every rank returns the same result
    assert run["status"] == "ok" and (run["pp"], run["dp"], run["virtual"], run["n_microbatches"]) == (2, 1, virtual, 4)
    assert run["tokens_per_s_per_gpu"] > 0 and 0 < run["bubble"] < 1 and run["loss_last"] > 0
    assert run["bubble_textbook"] == pytest.approx(1 / (virtual * 4 + 1))
    # train --pp's pp_bubble (StageTimer): the mean over the ranks, here one per pipeline rank
    assert all(0 <= b < 1 for b in run["bubble_per_pp_rank"])
    assert run["bubble"] == pytest.approx(sum(run["bubble_per_pp_rank"]) / 2)
    # the saved activations held at once: the schedule's chunks in flight times a chunk's bytes, per pipeline rank
    # (1F1B: 2 on the first rank, 1 on the last; interleaved with 4 stages of 1 layer: 5 and 3 chunks)
    for estimate, measured in zip(run["activations_estimate"], run["activations_measured"]):
        assert measured == pytest.approx(estimate, rel=5e-3)
    assert run["in_flight_per_pp_rank"] == in_flight
    assert run["activations_measured"][0] > run["activations_measured"][1]
    saved = json.loads((tmp_path / "bench_pp.json").read_text())
    assert saved["runs"][0]["schedule"] == schedule
    assert f"{schedule} v={virtual} m=4" in format_pipeline_run(run)


def test_pipeline_flags_are_checked(capsys):
    opts, _ = cli.parse_options(["--device", "cpu", "--pp", "2", "--pp-schedule", "looped_bfs"])
    assert (opts.pp, opts.pp_schedule, opts.pp_virtual) == (2, "looped_bfs", 0)
    for argv, message in ((["--pp", "2", "--pp-virtual", "2"], "--pp-schedule 1f1b runs one stage per rank"),
                          (["--pp-microbatches", "4"], "--pp-virtual and --pp-microbatches need --pp"),
                          (["--pp", "-1"], "--pp -1: must not be negative"),
                          (["--pp", "3", "--nproc", "2"], "--pp 3: must divide the number of processes, 2")):
        assert cli.main(["--device", "cpu", *argv]) == 2
        assert message in capsys.readouterr().err
