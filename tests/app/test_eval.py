"""``shardwise train --eval-data / --eval-fraction`` and ``--tensorboard`` / ``--wandb``.

Training runs ``shardwise.app.train.train`` (each spawned worker's body) on the gloo pool, with
flags resolved by ``resolve_config``; one run goes through the command line as a user starts it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.app.train import main

from tests.helpers import REPO
from tests.helpers.distributed import run_distributed
from tests.helpers.text_data import documents, train_tokenizer, write_jsonl

TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1", "--ffn-hidden", "64",
        "--seq-len", "16", "--lr", "3e-3", "--warmup-steps", "1", "--timeout", "120"]
TIMING = {"step_time_s", "tokens_per_s", "elapsed_s", "eval_time_s", "mem_gib", "launch"}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A tokenizer and train/eval .jsonl files, tokenized caches in their own folder."""
    root = tmp_path_factory.mktemp("text")
    texts = documents(260, seed=4)
    tok = train_tokenizer(root / "tok.json", texts)
    return {"tok": str(tok), "train": str(write_jsonl(root / "train.jsonl", texts[:220])),
            "eval": str(write_jsonl(root / "eval.jsonl", texts[220:])), "root": root}


def _train(argv: list[str]):
    """On every rank: train with these flags; (cache builds on this rank, rank 0's metrics records)."""
    from shardwise.app import corpus
    from shardwise.app.train import resolve_config, train

    builds, real = [], corpus.build_cache

    def counted(*args, **kwargs):
        builds.append(1)
        return real(*args, **kwargs)

    corpus.build_cache = counted
    try:
        cfg, model_cfg = resolve_config(argv)
        train(cfg, model_cfg)
    finally:
        corpus.build_cache = real
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else None
    return len(builds), records


def _evals(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


def test_eval_loss_is_the_same_on_1_and_2_processes_and_every_zero_stage(text, tmp_path):
    common = ["--data", text["train"], "--tokenizer", text["tok"], "--data-cache", str(tmp_path / "cache"),
              "--eval-fraction", "0.1", "--eval-every", "1", "--eval-batches", "3", "--steps", "2", *TINY]
    runs = {}
    for world, strategy in ((2, 3), (2, 0), (2, 1), (2, 2), (1, 3)):
        micro = 4 // world  # the same global batch of 4 sequences
        out = tmp_path / f"w{world}-z{strategy}"
        ranks = run_distributed(_train, world, [*common, "--micro-batch-size", str(micro), "--strategy",
                                                str(strategy), "--out-dir", str(out)])
        runs[world, strategy] = ranks
    # the first run found no cache: rank 0 tokenized, rank 1 waited; later runs read the cache
    assert [builds for builds, _ in runs[2, 3]] == [1, 0]
    assert all(builds == 0 for key, ranks in runs.items() if key != (2, 3) for builds, _ in ranks)
    reference = _evals(runs[2, 3][0][1])
    assert sorted(reference) == [1, 2] and 4 < reference[1] < 7
    for key, ranks in runs.items():
        records = ranks[0][1]
        assert all(r["eval_tokens"] == 3 * 4 * 16 for r in records)  # 3 global batches of 4 windows
        evals = _evals(records)
        assert evals.keys() == reference.keys()
        for step, loss in evals.items():  # same windows, same weights up to float rounding of the steps
            assert loss == pytest.approx(reference[step], rel=2e-7, abs=0), (key, step)  # seen: <= 3e-9
    # step 1's eval sees the weights after one step: the loss moved, so it measured the model
    assert reference[2] < reference[1]


def test_eval_leaves_training_exact_and_resumes_bit_exactly(text, tmp_path):
    common = ["--data", text["train"], "--tokenizer", text["tok"], "--data-cache", str(tmp_path / "cache"),
              "--steps", "4", "--save-every", "2", "--dropout", "0.1", "--micro-batch-size", "2", *TINY]
    evaluating = ["--eval-data", text["eval"], "--eval-every", "2", "--eval-batches", "2", "--tensorboard"]
    straight, plain, crashed = tmp_path / "straight", tmp_path / "plain", tmp_path / "crashed"
    with_eval = run_distributed(_train, 2, [*common, *evaluating, "--out-dir", str(straight)])[0][1]
    without = run_distributed(_train, 2, [*common, "--out-dir", str(plain)])[0][1]
    assert sorted(_evals(with_eval)) == [2, 4]
    # the evaluation (dropout off, RNG forked, its own windows) changed nothing of the training
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [r[key] for r in with_eval] == [r[key] for r in without], key

    # a run that died during step 4's save resumes from step 2 and repeats steps 3-4 exactly, eval included
    shutil.copytree(straight, crashed)
    os.rename(crashed / "checkpoints" / "step_00000004", crashed / "checkpoints" / "step_00000004.tmp")
    resumed = run_distributed(_train, 2, [*common, *evaluating, "--out-dir", str(crashed), "--resume"])[0][1]
    strip = lambda records: [{k: v for k, v in r.items() if k not in TIMING} for r in records]  # noqa: E731
    assert strip(resumed) == strip(with_eval)
    assert [r["launch"] for r in resumed] == [1, 1, 2, 2]

    # TensorBoard's own reader: each step once (the resumed part purged the redone steps), the metrics' values
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(crashed / "tensorboard"))
    events.Reload()
    assert len(list((crashed / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per launch
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mem_gib", "eval/loss",
            "eval/perplexity"} <= set(events.Tags()["scalars"])
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in resumed], rel=1e-6)
    evals = events.Scalars("eval/loss")
    assert [e.step for e in evals] == [2, 4]
    assert [e.value for e in evals] == pytest.approx([r["eval_loss"] for r in resumed if "eval_loss" in r], rel=1e-6)


@pytest.mark.slow
def test_command_line_run_tokenizes_once_and_reports_eval(text, tmp_path):
    """The launcher tokenizes before starting the workers; progress bar, summary, loss.png and TensorBoard."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardwise", "train", "--nproc", "1", "--data", text["train"], "--tokenizer",
           text["tok"], "--data-cache", str(tmp_path / "cache"), "--eval-fraction", "0.05", "--steps", "2",
           "--micro-batch-size", "2", "--tensorboard", "--out-dir", str(out), *TINY]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.count("tokenized with") == 1, proc.stderr  # once, by the launcher
    assert "--vocab-size 300 (from --tokenizer" in proc.stderr
    assert "eval=" in proc.stderr  # the progress bar shows the last eval loss
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_step"] == 2 and summary["eval_perplexity"] == pytest.approx(2.718281828 ** summary["eval_loss"])
    assert f"eval loss {summary['eval_loss']:.3f} (perplexity {summary['eval_perplexity']:.2f}) at step 2" in proc.stdout
    assert json.loads((out / "config.json").read_text())["model"]["vocab_size"] == 300
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("argv,message", [
    (["--eval-every", "5"], "--eval-every 5: needs --eval-data PATH or --eval-fraction F"),
    (["--eval-fraction", "1.5"], "--eval-fraction 1.5: must be a fraction in [0, 1)"),
    (["--eval-fraction", "1e-9"], "--eval-fraction 1e-09: holds out 1 of the"),
    (["--eval-data", "missing.jsonl"], "--eval-data missing.jsonl: no such file or directory"),
    (["--eval-batches", "-1", "--eval-fraction", "0.1"], "--eval-batches -1: must not be negative"),
])
def test_bad_eval_flags_fail_before_training(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv + ["--out-dir", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag,module", [("wandb", "wandb"), ("tensorboard", "torch.utils.tensorboard")])
def test_a_logger_whose_package_is_missing_says_how_to_install_it(flag, module, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if it were not installed
    assert main([f"--{flag}", "--out-dir", str(tmp_path / "run")]) == 2
    assert (f"shardwise train: error: --{flag}: needs the {flag} package, which is not installed (an optional "
            f"extra): pip install 'shardwise[{flag}]' (or pip install {flag})") in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_wandb_logs_offline_and_a_resumed_run_continues_the_same_run(tmp_path, monkeypatch):
    """The W&B calls, against a stand-in module (wandb itself is no test dependency; its offline run was
    checked by hand with wandb 0.31)."""
    import types

    from shardwise.app.loggers import RunLoggers
    from shardwise.app.train import resolve_config

    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg, _ = resolve_config(["--wandb"])
    first = RunLoggers(cfg, tmp_path, 1, {"train": {"steps": 4}})
    first.log({"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 100.0, "mem_gib": 0.1,
               "mfu": None})
    first.log({"step": 2, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.4, "tokens_per_s": 90.0, "mem_gib": 0.1,
               "mfu": None, "eval_loss": 2.2, "eval_perplexity": 9.0})
    first.close()
    (_, opened), *_ = calls
    run_id = (tmp_path / "wandb-run-id").read_text().strip()
    assert opened["mode"] == "offline" and opened["dir"] == str(tmp_path) and opened["id"] == run_id
    assert opened["config"] == {"train": {"steps": 4}} and opened["resume"] == "allow"
    assert calls[1] == ("log", {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5,
                                "train/tokens_per_s": 100.0, "train/mem_gib": 0.1}, 1)
    assert calls[2][1]["eval/loss"] == 2.2 and calls[2][1]["eval/perplexity"] == 9.0 and calls[-1] == ("finish",)
    monkeypatch.setenv("WANDB_MODE", "online")
    calls.clear()
    RunLoggers(cfg, tmp_path, 3, {}).close()  # resumed at step 3: the same W&B run
    assert calls[0][1]["id"] == run_id and calls[0][1]["mode"] == "online"
    calls.clear()
    RunLoggers(cfg, tmp_path, 1, {}).close()  # a new run in the folder (--overwrite): a new id
    assert calls[0][1]["id"] != run_id


def test_overwrite_deletes_the_earlier_runs_logger_files(tmp_path):
    from shardwise.app.train import prepare_run_folder, resolve_config

    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / "events.out.tfevents.1").write_bytes(b"old")
    (out / "wandb").mkdir()
    (out / "wandb-run-id").write_text("abc\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    prepare_run_folder(resolve_config(["--out-dir", str(out), "--overwrite"])[0], announce=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # a new run does not mix with the old curves


def test_the_eval_line_says_how_much_of_the_held_out_data_it_covers():
    """By default an evaluation reads --eval-batches 10 global batches: a few percent of a large file, said."""
    import numpy as np

    from shardwise.app.evaluate import Evaluator

    tokens = np.zeros(4000 * 32 + 1, dtype=np.uint16)  # 4000 windows of 32 tokens
    part = Evaluator(tokens, 32, 2, 8, 10, 0, 5)
    assert part.describe() == ("eval: 80 windows of 32 tokens, 2% of the 4000 held-out windows (the first ones; "
                               "--eval-batches 0 evaluates all, more batches more of them)")
    assert Evaluator(tokens, 32, 2, 8, 0, 0, 5).describe() == \
        "eval: 4000 windows of 32 tokens, all of the held-out data"
    assert Evaluator(tokens[:33 * 10], 32, 2, 8, 10, 0, 5).describe().endswith(
        "all of the held-out data (fewer than --eval-batches asks for)")
