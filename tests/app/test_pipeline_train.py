"""``shardwise train --pp N``: a pipeline of sharded stages trains as one process does (the same losses and
gradient norms, clipping included), with each schedule, data parallelism and HSDP inside the stages; its
checkpoints are the whole model's (a ``--pp 2`` checkpoint resumes at ``--pp 1`` and back, and exports as
safetensors and ``--format hf``); bad combinations are refused by name before any process starts.

Training runs ``shardwise.app.train.train`` (each spawned worker's body) on the gloo pool.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardwise.app.train import main, resolve_config
from tests.helpers import REPO
from tests.helpers.distributed import run_distributed
from tests.helpers.train_runs import train_records

MAX_NORM = 1.0
# 4 layers (4 stages for interleaved x 2), fp32; 8 sequences per step whatever the layout
TINY = ["--preset", "tiny", "--dim", "32", "--n-layers", "4", "--n-heads", "2", "--n-kv-heads", "1",
        "--ffn-hidden", "64", "--seq-len", "32", "--micro-batch-size", "2", "--precision", "fp32",
        "--max-grad-norm", str(MAX_NORM), "--data", str(REPO / "shardwise" / "models"), "--steps", "4",
        "--warmup-steps", "1"]  # so the first steps' rates are the same in a run of 2 steps and one of 4


def _run(world: int, out: Path, *flags: str) -> list[dict]:
    return run_distributed(train_records, world, [*TINY, "--out-dir", str(out), *flags])[0]


def _curve(records: list[dict], key: str = "loss") -> torch.Tensor:
    return torch.tensor([r[key] for r in records], dtype=torch.float64)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference (one process, one model) and the pipelines: those the checkpoint tests read (1f1b,
    interleaved) 4 steps with a checkpoint at 2 and 4, the others 2 steps."""
    root = tmp_path_factory.mktemp("pp")
    save, short = ["--save-every", "2"], ["--steps", "2"]
    layouts = {
        "pp1": (1, ["--grad-accum", "4", *save]),
        "1f1b": (2, ["--pp", "2", "--grad-accum", "4", "--strategy", "optim_grads", "--activation-checkpointing",
                     "--pp-split", "3,1", *save]),
        "interleaved": (2, ["--pp", "2", "--pp-schedule", "interleaved", "--pp-virtual-stages", "2",
                            "--grad-accum", "4", "--compile", "aot_eager", *save]),  # compiled: eager's numbers
        "zb": (2, ["--pp", "2", "--pp-schedule", "zb", "--pp-virtual-stages", "2", "--grad-accum", "4", *short]),
        "gpipe_dp2": (4, ["--pp", "2", "--pp-schedule", "gpipe", "--grad-accum", "2", "--strategy", "3", *short]),
        "hsdp": (4, ["--pp", "2", "--grad-accum", "2", "--outer-dp", "2", "--outer-strategy", "no_shard", *short]),
    }
    return {name: (root / name, _run(world, root / name, *flags)) for name, (world, flags) in layouts.items()}


@pytest.mark.parametrize("layout", ["1f1b", "interleaved", "zb", "gpipe_dp2", "hsdp"])
def test_a_pipeline_trains_as_one_process(runs, layout):
    records = runs[layout][1]
    steps = len(records)
    reference = runs["pp1"][1][:steps]
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and steps >= 2
    torch.testing.assert_close(_curve(records), _curve(reference), rtol=1e-5, atol=0)
    torch.testing.assert_close(_curve(records, "grad_norm"), _curve(reference, "grad_norm"), rtol=1e-5, atol=0)
    assert min(r["grad_norm"] for r in reference) > MAX_NORM  # clipping changed every step
    assert records[-1]["tokens"] == reference[-1]["tokens"] == steps * 8 * 32
    assert all(0 <= r["pp_bubble"] < 1 for r in records) and "pp_bubble" not in reference[0]
    summary = json.loads((runs[layout][0] / "summary.json").read_text())
    assert 0 <= summary["pp_bubble"] < 1


def test_an_offloaded_pipeline_trains_as_one_offloaded_process(tmp_path):
    # host main weights and AdamW state, the optimizer stepping on the CPU (fused), on both sides
    flags = ["--offload", "--grad-accum", "2", "--steps", "2", "--n-layers", "2"]
    reference = _run(1, tmp_path / "pp1", *flags)
    records = _run(2, tmp_path / "pp2", *flags, "--pp", "2")
    torch.testing.assert_close(_curve(records), _curve(reference), rtol=1e-5, atol=0)
    torch.testing.assert_close(_curve(records, "grad_norm"), _curve(reference, "grad_norm"), rtol=1e-5, atol=0)


def _resume_from_step_2(source: Path, target: Path, world: int, *flags: str) -> list[dict]:
    shutil.copytree(source, target)
    shutil.rmtree(target / "checkpoints" / "step_00000004")
    return _run(world, target, "--resume=required", "--grad-accum", "4", *flags)


def test_a_pp2_checkpoint_resumes_at_pp1_and_back(runs, tmp_path):
    straight = _curve(runs["pp1"][1])
    at_pp1 = _resume_from_step_2(runs["1f1b"][0], tmp_path / "at_pp1", 1)
    at_pp2 = _resume_from_step_2(runs["pp1"][0], tmp_path / "at_pp2", 2, "--pp", "2")
    for records in (at_pp1, at_pp2):
        assert [r["step"] for r in records] == [1, 2, 3, 4] and records[2]["launch"] == 2
        torch.testing.assert_close(_curve(records)[2:], straight[2:], rtol=1e-5, atol=0)


def test_a_checkpoint_of_two_stages_per_rank_resumes_in_one_process(runs, tmp_path):
    # interleaved: each rank saved its two stage modules with one optimizer each (StageOptimizers)
    records = _resume_from_step_2(runs["interleaved"][0], tmp_path / "at_pp1", 1)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[2]["launch"] == 2
    torch.testing.assert_close(_curve(records), _curve(runs["pp1"][1]), rtol=1e-5, atol=0)


def test_a_pp2_checkpoint_exports_the_whole_model(runs, tmp_path):
    from safetensors.torch import load_file

    from shardwise.checkpoint.export import export_safetensors
    from shardwise.models import GPT
    from tests.helpers.hf_cases import export_and_compare, tokens

    _, model_cfg = resolve_config(TINY)
    models = {}
    for name in ("1f1b", "pp1"):
        files = export_safetensors(runs[name][0] / "checkpoints", tmp_path / name)
        models[name] = GPT(model_cfg)
        models[name].load_state_dict(load_file(str(files[0])), strict=True)  # every key, no other
    for key, value in models["pp1"].state_dict().items():
        torch.testing.assert_close(models["1f1b"].state_dict()[key], value, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        logits = models["1f1b"].eval()(tokens())
    export_and_compare(runs["1f1b"][0], logits, tmp_path / "hf")  # transformers loads it: the same logits


@pytest.mark.parametrize("argv,message", [
    (["--pp", "3", "--nproc", "4", "--grad-accum", "3"], "--pp 3: must divide the number of processes (4)"),
    (["--pp", "8", "--nproc", "8", "--grad-accum", "8"], "--pp 8: num_stages=8 is more stages than n_layers=4"),
    (["--pp", "2", "--pp-virtual-stages", "2", "--grad-accum", "4"],
     "--pp-virtual-stages 2: --pp-schedule 1f1b runs one stage per rank"),
    (["--pp", "2", "--pp-schedule", "interleaved"], "--pp-schedule interleaved: runs several stages per rank"),
    (["--pp", "2", "--pp-schedule", "zb", "--grad-accum", "4"],
     "--pp-virtual-stages 1: --pp-schedule zb (torch's ZBV zero-bubble schedule) runs exactly two stages"),
    (["--pp", "2", "--pp-schedule", "dualpipe"], "--pp-schedule dualpipe: unknown schedule"),
    (["--pp", "2"], "--grad-accum 1: is the number of micro-batches, of which torch's 1F1B schedule needs at least one per stage (2"),
    (["--pp", "2", "--grad-accum", "2", "--tie-embeddings"], "--tie-embeddings: with --pp is not built"),
    (["--pp", "2", "--grad-accum", "2", "--pp-split", "3,5"], "--pp-split 3,5: split=[3, 5] sums to 8"),
    (["--pp", "2", "--grad-accum", "2", "--pp-split", "3;1"], "--pp-split 3;1: needs a comma list"),
    (["--pp-split", "3,1"], "--pp-split 3,1: needs --pp 2 or more"),
    (["--pp", "2", "--grad-accum", "2", "--eval-fraction", "0.1"], "--eval-fraction 0.1: with --pp: evaluation"),
    (["--pp", "0"], "--pp 0: must be at least 1"),
])
def test_bad_pipeline_flags_name_flag_and_value(argv, message, capsys, tmp_path):
    assert main([*TINY, *argv, "--out-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    # one line for the refusal (a machine with fewer cores than --nproc also gets the cores warning before it)
    refusal = [line for line in err.strip().splitlines() if not line.startswith("shardwise train: warning: --nproc")]
    assert message in err and len(refusal) == 1, err
    assert not (tmp_path / "x").exists()


def test_the_bubble_is_the_step_outside_the_stages_work(monkeypatch):
    # busy: forward, backward, the zero-bubble weight pass and the gradient reduction; the wait between is bubble.
    # A clock the test advances by hand (the CPU path reads time.perf_counter): the fractions are exact.
    from types import SimpleNamespace

    from shardwise.app import pipeline_train
    from shardwise.app.pipeline_train import StageTimer

    now = [0.0]
    monkeypatch.setattr(pipeline_train, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def advance(seconds: float) -> None:
        now[0] += seconds

    called = []

    def work(name, seconds):
        def method(*args, **kwargs):
            called.append(name)
            advance(seconds)
            return name
        return method

    timed = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "perform_reduce_grad")
    stage = SimpleNamespace(**{name: work(name, 0.25) for name in timed})
    timer = StageTimer([stage], torch.device("cpu"))
    assert timer.bubble() == 0.0  # no step yet
    assert stage.forward_one_chunk(1, x=2) == "forward_one_chunk"  # wrapped: arguments in, result out
    assert timer.steps == [] and called == ["forward_one_chunk"]
    called.clear()

    def step(wait: float, between: float = 0.0):
        for name in timed:
            getattr(stage, name)()
            advance(between)  # as if waiting on a neighbour's send between two chunks
        advance(wait)  # the schedule's tail: the last send, bookkeeping

    timer.run(lambda: step(1.0))
    assert called == list(timed)
    assert timer.bubble() == pytest.approx(0.5, rel=1e-12)  # 1 s of 2: 4 x 0.25 s busy
    assert timer.bubble() == 0.0  # a step is read once
    timer.run(lambda: step(0.0, between=0.75))  # 3 s waiting of 4 s
    timer.run(lambda: step(0.0))  # no wait: no bubble
    assert timer.bubble() == pytest.approx((0.75 + 0.0) / 2, rel=1e-12)  # the mean over the steps since the last read
