"""``shardwise train``: data, loader, configuration checks and an end-to-end smoke run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from shardwise.app import cli
from shardwise.app.data import TokenLoader, load_tokens, stdlib_corpus
from shardwise.app.train import ConfigError, main, resolve_config

from tests.helpers import REPO
from tests.helpers.distributed import run_distributed
from tests.helpers.schedules import lr_at
from tests.helpers.train_runs import train_records


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


@pytest.mark.slow
def test_smoke_run_writes_metrics_and_plot(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "shardwise", "train", "--preset", "tiny", "--steps", "4", "--nproc", "2",
           "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1", "--ffn-hidden", "64",
           "--seq-len", "32", "--micro-batch-size", "2", "--grad-accum", "2", "--strategy", "3",
           "--compile", "aot_eager", "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mem_gib"} <= set(records[0])
    assert records[-1]["tokens"] == 4 * 2 * 32 * 2 * 2
    assert all(np.isfinite(r["loss"]) for r in records) and records[0]["loss"] > 4.5
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 2
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["dim"] == 32 and config["train"]["strategy"] == "optim_grads_params"
    assert config["train"]["compile"] == "aot_eager"  # each layer's forward compiled
    assert "loss" in proc.stdout and str(out) in proc.stdout
    # the long phases say what they are, as they start; the CPU estimate is per rank, not per GPU
    assert "shardwise train: memory estimate: per rank " in proc.stderr, proc.stderr
    assert "shardwise train: building the model on the meta device and sharding it (fully_shard, optim_grads_params) " \
           "over 2 ranks" in proc.stderr
    assert "shardwise train: step 1: the first step: each layer is compiled first (torch.compile, aot_eager)" in \
        proc.stderr
    # wall time counts from the process's start (imports included), and says how much came before step 1
    assert summary["wall_time_s"] >= summary["startup_time_s"] + summary["train_time_s"] > summary["startup_time_s"] > 1
    assert f"(of which {summary['startup_time_s']:.1f}s start-up before the first step" in proc.stdout


@pytest.mark.slow
def test_bad_data_path_fails_in_the_parent(tmp_path):
    cmd = [sys.executable, "-m", "shardwise", "train", "--data", str(tmp_path / "missing.txt")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"--data {tmp_path / 'missing.txt'}: no such file or directory" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv,message", [
    (["--strategy", "zero9"], "--strategy zero9: unknown strategy"),
    (["--preset", "huge"], "--preset huge: unknown preset"),
    (["--outer-strategy", "optim"], "--outer-strategy optim: needs --outer-dp"),
    (["--outer-strategy", "optim", "--outer-dp", "3", "--nproc", "2"], "--outer-dp 3: must divide"),
    (["--outer-strategy", "optim_grads", "--outer-dp", "2"], "--outer-strategy optim_grads: is not supported; "
     "expected one of ['no_shard', 'optim']"),
    (["--outer-strategy", "optim", "--outer-dp", "2", "--strategy", "2"], "--outer-strategy optim: (HFSDP) needs "
     "--strategy='optim_grads_params' on the inner axis, got --strategy='optim_grads'"),
    (["--precision", "fp8"], "--precision fp8: use fp32 or bf16"),
    (["--n-kv-heads", "3"], "--n-kv-heads 3: must divide n_heads"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--layer-pattern", "AZ"], "--layer-pattern AZ: unknown letters"),
    (["--vocab-size", "100"], "--vocab-size 100: data (stdlib) holds token id"),
])
def test_bad_flags_name_flag_and_value(argv, message, capsys, tmp_path):
    assert main(argv + ["--out-dir", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_offload_flags(capsys, tmp_path):
    cfg = resolve_config(["--offload", "--offload-fraction", "0.5"])[0]
    assert cfg.offload is True and cfg.offload_fraction == 0.5
    assert resolve_config([])[0].offload is False
    assert main(["--offload", "--offload-fraction", "1.5", "--out-dir", str(tmp_path / "x")]) == 2
    assert "--offload-fraction 1.5: must be a fraction in [0, 1]" in capsys.readouterr().err


def test_compile_flag_alone_means_inductor_and_unknown_backends_are_refused(capsys, tmp_path):
    assert resolve_config(["--compile"])[0].compile == "inductor"
    assert resolve_config(["--compile", "aot_eager"])[0].compile == "aot_eager"
    assert resolve_config(["--compile", "--no-compile"])[0].compile == ""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"compile": True}))
    assert resolve_config(["--config", str(path)])[0].compile == "inductor"
    assert main(["--compile", "nope", "--out-dir", str(tmp_path / "x")]) == 2
    assert "--compile nope: unknown torch.compile backend" in capsys.readouterr().err


def test_argparse_type_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        resolve_config(["--steps", "many"])
    assert exc.value.code == 2 and "--steps" in capsys.readouterr().err


def test_precedence_preset_then_json_then_flags(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"preset": "small", "n-layers": 3, "lr": 0.5, "activation_checkpointing": True}))
    cfg, model = resolve_config(["--config", str(path), "--lr", "0.25", "--strategy", "1"])
    assert cfg.preset == "small" and model.dim == 512 and model.n_layers == 3
    assert cfg.lr == 0.25 and cfg.strategy == "optim" and model.activation_checkpointing
    assert model.max_seq_len == cfg.seq_len == 512
    path.write_text(json.dumps({"not_a_field": 1}))
    with pytest.raises(ConfigError, match="unknown field 'not_a_field'"):
        resolve_config(["--config", str(path)])


def test_lr_schedule_warms_up_then_decays():
    cfg, _ = resolve_config(["--steps", "100", "--warmup-steps", "10", "--lr", "1.0"])
    lrs = [lr_at(cfg, s) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(cfg.min_lr_ratio) and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_data_sources(tmp_path):
    corpus = stdlib_corpus()
    assert corpus.dtype == np.uint8 and len(corpus) > 1_000_000
    assert np.array_equal(corpus[:1000], stdlib_corpus()[:1000])
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text(" world")
    (tmp_path / "blob").write_bytes(b"\0\1\2")
    assert bytes(load_tokens(str(tmp_path))) == b"hello world"
    assert bytes(load_tokens(str(tmp_path / "a.txt"))) == b"hello"
    ids = np.arange(1000, 1100, dtype=np.uint16)
    ids.tofile(tmp_path / "t.bin")
    assert np.array_equal(load_tokens(str(tmp_path / "t.bin"), "uint16"), ids)
    np.arange(50, dtype=np.uint8).tofile(tmp_path / "u.bin")
    assert np.array_equal(load_tokens(str(tmp_path / "u.bin"), "uint8"), np.arange(50))


def test_loader_slices_global_batch_and_resumes():
    tokens = np.arange(10_000, dtype=np.uint16)
    ranks = [TokenLoader(tokens, 16, 2, rank=r, world_size=2, seed=3) for r in range(2)]
    single = TokenLoader(tokens, 16, 4, seed=3)  # same global batch on one rank
    for _ in range(3):
        parts = [next(loader) for loader in ranks]
        x, y = next(single)
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), x)
        torch.testing.assert_close(x[:, 1:], y[:, :-1])
    assert not set(parts[0][0][:, 0].tolist()) & set(parts[1][0][:, 0].tolist())
    state = single.state_dict()
    expected = [next(single)[0] for _ in range(700)]  # crosses epochs (624 windows)
    resumed = TokenLoader(tokens, 16, 4, seed=0)
    resumed.load_state_dict(state)
    for want in expected:
        torch.testing.assert_close(next(resumed)[0], want)


def test_cli_dispatch(capsys):
    assert cli.main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0 and "train" in capsys.readouterr().out
    assert set(cli.COMMANDS) >= {"train"}


# The two pairs of runs below train through the command's worker body on the gloo pool (no new launcher):
# what they compare lives in the training; test_smoke_run_writes_metrics_and_plot goes through the command line.
SMALL = ["--preset", "tiny", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1",
         "--ffn-hidden", "64", "--seq-len", "32", "--micro-batch-size", "2"]


def test_meta_init_trains_exactly_like_a_direct_build(tmp_path):
    losses = {}
    for flag in ("--meta-init", "--no-meta-init"):
        records = run_distributed(train_records, 2, [*SMALL, "--steps", "2", flag, "--out-dir", str(tmp_path / flag)])[0]
        losses[flag] = [r["loss"] for r in records]
    assert len(losses["--meta-init"]) == 2 and losses["--meta-init"] == losses["--no-meta-init"]


def test_offloaded_run_clips_through_the_fused_step_as_the_device_run_clips_in_place(tmp_path):
    # --offload steps with the fused CPU AdamW, which takes the clipping factor in its kernel;
    # the plain CPU run scales the gradients in place. A tiny max norm makes every step clip.
    records = {}
    for flags in ((), ("--offload",)):
        out = tmp_path / ("offload" if flags else "plain")
        argv = [*SMALL, "--steps", "3", "--max-grad-norm", "0.01", *flags, "--out-dir", str(out)]
        records[flags] = run_distributed(train_records, 1, argv)[0]
    plain, offloaded = records[()], records[("--offload",)]
    assert len(plain) == 3 and all(r["grad_norm"] > 0.1 for r in plain)  # clipped at every step
    assert offloaded[0]["loss"] == plain[0]["loss"] and offloaded[0]["grad_norm"] == plain[0]["grad_norm"]
    # fused and per-tensor AdamW round differently (~5e-7); an unapplied factor would move the loss by far more
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in offloaded], [r[key] for r in plain], rtol=1e-5, atol=0)
