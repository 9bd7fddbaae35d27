"""Mistakes on the command line, in ``--config`` files and in ``clip_grad_norm_`` calls: each one is
refused with one line naming the argument and its value; the learning-rate schedule says what it is."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from shardwise.app.train import (ConfigError, LRSchedule, global_batch_plan, lr_schedule, main, resolve_config,
                             resumed_schedule, summarize)

from tests.helpers.distributed import run_distributed

TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1", "--ffn-hidden", "64",
        "--seq-len", "32", "--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(Path(json.__file__).read_bytes() * 4)  # small and fast to load
    return str(path)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------ flags
OUT = "<out>"


@pytest.mark.parametrize("argv,message", [
    (["--timeout", "0", "--out-dir", OUT], "--timeout 0.0: must be a positive number of seconds"),
    (["--timeout", "nan", "--out-dir", OUT], "--timeout nan: must be a finite number"),
    (["--max-grad-norm", "nan", "--out-dir", OUT], "--max-grad-norm nan: must be a finite number"),
    (["--lr", "inf", "--out-dir", OUT], "--lr inf: must be a finite number"),
    (["--rope-theta", "nan", "--out-dir", OUT], "--rope-theta nan: must be a finite number"),
    (["--beta2", "1.5", "--out-dir", OUT], "--beta2 1.5: must be in [0, 1)"),
    (["--min-lr-ratio", "2", "--out-dir", OUT], "--min-lr-ratio 2.0: must be at most 1"),
    (["--resume=maybe", "--out-dir", OUT], "--resume=maybe: use --resume"),
    (["--resume"], "--resume=auto: needs --out-dir (or --name)"),
    (["--resume", "--overwrite", "--out-dir", OUT], "--overwrite: cannot be combined with --resume"),
    (["--name", "a/../../.."], "--name a/../../..: must be a plain folder name under runs/"),
    (["--name", ".."], "--name ..: must be a plain folder name"),
    (["--ffn-hidden", "-5", "--out-dir", OUT], "--ffn-hidden -5: must be at least 1"),
    (["--mamba-head-dim", "0", "--layer-pattern", "M", "--out-dir", OUT], "--mamba-head-dim 0: must be at least 1"),
    (["--norm-eps", "-1", "--out-dir", OUT], "--norm-eps -1.0: must be positive"),
    (["--init-std", "0", "--out-dir", OUT], "--init-std 0.0: must be positive"),
])
def test_bad_flags_are_one_line_naming_flag_and_value(argv, message, capsys, tmp_path, data, monkeypatch):
    argv = [str(tmp_path / "run") if a == OUT else a for a in argv]
    monkeypatch.chdir(tmp_path)  # --name writes under ./runs
    assert main(argv + ["--data", data]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("shardwise train: error: ") and message in line, line
    assert sorted(os.listdir(tmp_path)) == []  # nothing written anywhere


@pytest.mark.parametrize("field,value,message", [
    ("steps", True, "steps=true: needs a whole number"),
    ("steps", 2.5, "steps=2.5: needs a whole number"),
    ("lr", "0.1", 'lr="0.1": needs a number'),
    ("lr", False, "lr=false: needs a number"),
    ("strategy", True, "strategy=true: needs a string"),
    ("activation_checkpointing", "false", 'activation_checkpointing="false": needs true or false'),
    ("bf16-ish", 1, "unknown field 'bf16-ish'"),
])
def test_config_file_values_must_have_the_field_type(field, value, message, tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({field: value}))
    with pytest.raises(ConfigError) as e:
        resolve_config(["--config", str(path)])
    assert f"--config {path}" in str(e.value) and message in str(e.value)


def test_help_shows_the_defaults_that_run():
    from shardwise.app.train import build_parser

    cfg, model_cfg = resolve_config([])  # what runs without flags: the tiny preset
    helps = {a.dest: a.help for a in build_parser()._actions if a.help}
    for name in ("steps", "lr", "warmup_steps", "weight_decay", "beta1", "dim", "n_layers", "vocab_size"):
        value = getattr(cfg if hasattr(cfg, name) else model_cfg, name)
        assert f"(default: {value!r}" in helps[name], (name, value, helps[name])
    assert "from the preset tiny" in helps["steps"] and "0.1 under one that does not set it" in helps["weight_decay"]
    assert [n for n, h in helps.items() if h.count("(default") > 1] == []  # said once


@pytest.mark.parametrize("command,argv,error", [
    ("train", ["--n-layerz", "2"], "unrecognized arguments: --n-layerz 2 (did you mean --n-layers?)"),
    ("train", ["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    ("ckpt", ["export"], "the following arguments are required: CKPT_DIR, OUT"),
])
def test_argparse_errors_are_the_error_not_forty_lines_of_usage(command, argv, error, capsys):
    from shardwise.app.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_:
        cli_main([command, *argv])
    err = capsys.readouterr().err.splitlines()
    prog = f"shardwise {command}{' export' if command == 'ckpt' else ''}"
    assert exit_.value.code == 2 and err == [f"usage: {prog} [flags]", f"{prog}: error: {error}",
                                             f"({prog} --help lists every flag)"], err


def test_config_file_accepts_whole_floats_and_resume_bools(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"steps": 20.0, "lr": 1, "resume": True, "name": "x"}))
    cfg, _ = resolve_config(["--config", str(path)])
    assert cfg.steps == 20 and isinstance(cfg.steps, int) and cfg.lr == 1.0 and cfg.resume == "auto"
    cfg, _ = resolve_config(["--name", "x", "--resume=required"])
    assert cfg.resume == "required"
    cfg, _ = resolve_config(["--name", "x", "--resume", "--no-resume"])
    assert cfg.resume == ""


def test_every_problem_of_the_flags_is_reported_at_once(tmp_path, capsys, monkeypatch):
    """``--nproc 3 --pp 2`` has two problems (1F1B's micro-batches, the pipeline's divisibility): both in one run,
    one line each, as every other independent problem; a setting derived from a refused one is not reported."""
    from shardwise.app import train

    monkeypatch.setattr(train, "launch_local", _no_launch)
    out = ["--out-dir", str(tmp_path / "run")]
    assert main(["--nproc", "3", "--pp", "2", *out]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "shardwise train: error: 2 problems:",
        "  --grad-accum 1: is the number of micro-batches, of which torch's 1F1B schedule needs at least one per "
        "stage (2 with --pp 2)",
        "  --pp 2: must divide the number of processes (3): each of the world / pp data-parallel replicas is a whole "
        "pipeline"]
    assert main(["--lr", "nan", "--steps", "0", "--strategy", "zero9", "--dim", "0", *out]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "shardwise train: error: 4 problems:" and [line.split(":")[0] for line in err[1:]] == [
        "  --lr nan", "  --steps 0", "  --dim 0", "  --strategy zero9"], err
    with pytest.raises(ConfigError, match=r"2 problems:\n  --beta1 2\.0: must be in \[0, 1\)\n  --beta2 -1\.0"):
        resolve_config(["--beta1", "2", "--beta2", "-1"])
    assert not (tmp_path / "run").exists()


def _no_launch(*args, **kwargs):
    raise AssertionError("the run was launched")


# ------------------------------------------------------------------ before any process starts
@pytest.mark.parametrize("argv,needed", [
    (["--preset", "8b"], "2 ranks x (74.8 GiB + 0.21 GiB interpreter) per rank = 150.0 GiB needed, 23.0 GiB available "
                         "(MemAvailable)"),
    (["--preset", "1b", "--fp8", "tensorwise"], "2 ranks x (20.4 GiB + 0.21 GiB interpreter) per rank = 41.3 GiB needed"),
    (["--preset", "1b", "--pp", "2", "--grad-accum", "2"], "2 pipeline ranks need 37.6 GiB together"),
])
def test_a_cpu_run_larger_than_the_host_is_refused_before_it_starts(argv, needed, tmp_path, capsys, monkeypatch):
    """On the CPU every rank takes the host's memory: the estimate times the ranks, against MemAvailable (here
    a 23 GiB machine), refused in one line with what would fit, before any process starts."""
    from shardwise.app import host_memory, train

    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: 23 * 2**30)
    monkeypatch.setattr(train, "launch_local", _no_launch)
    assert main(argv + ["--device", "cpu", "--out-dir", str(tmp_path / "run")]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("shardwise train: error: this configuration does not fit in this machine's memory: ")
    # what would fit: the planner's search (plan.fit), its answer or "a smaller model" where nothing it tries
    # does (a pipeline run: the changes that shrink a stage)
    assert needed in line and ("What fits: ZeRO" in line or "a smaller model" in line), line
    assert not (tmp_path / "run").exists()


def test_fp8_on_the_cpu_says_it_is_emulated_and_compiled(tmp_path, capsys, monkeypatch, data):
    from shardwise.app import train

    launched = []
    monkeypatch.setattr(train, "launch_local", lambda *args, **kwargs: launched.append(args) or 0)
    assert main(["--fp8", "tensorwise", "--precision", "bf16", "--device", "cpu", *TINY, "--data", data,
                 "--out-dir", str(tmp_path / "run")]) == 0 and launched
    assert ("shardwise train: --fp8 tensorwise on the CPU: the FP8 matmuls are emulated (no FP8 hardware), so each "
            "layer is compiled (inductor) at the first step, which takes minutes") in capsys.readouterr().err


# ------------------------------------------------------------------ shardwise ckpt
@pytest.mark.parametrize("layout,target,message", [
    ("run", "run/checkpoints", "{t}: no such checkpoint folder; the run folder {r} has no checkpoints: shardwise "
     "train writes checkpoints (into <run folder>/checkpoints/) only with --save-every N"),
    ("run", "run", "{t} holds no complete checkpoint; the run folder {r} has no checkpoints"),
    ("", "run/checkpoints", "{t}: no such checkpoint folder; there is no run folder {r}: shardwise train writes"),
    ("empty", "run/checkpoints", "{t} holds no complete checkpoint; {r} is not a run folder"),
])
def test_ckpt_without_a_checkpoint_says_where_it_looked(layout, target, message, tmp_path, capsys):
    from shardwise.app.ckpt import main as ckpt_main

    run = tmp_path / "run"
    if layout == "run":  # what `train` without --save-every leaves
        run.mkdir()
        (run / "config.json").write_text("{}")
        (run / "metrics.jsonl").write_text("")
    elif layout == "empty":
        (run / "checkpoints").mkdir(parents=True)
    assert ckpt_main(["export", str(tmp_path / target), str(tmp_path / "out"), "--format", "hf"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("shardwise ckpt export: error: ")
    assert message.format(t=tmp_path / target, r=run) in line, line


def test_ckpt_takes_a_run_folder_for_its_checkpoints(tmp_path, capsys):
    """``ckpt info/verify/export RUN`` read ``RUN/checkpoints`` (where train writes them), not "no checkpoints"."""
    from shardwise.app.ckpt import main as ckpt_main
    from tests.checkpoint.test_checkpoint_export import _export_source

    run = tmp_path / "run"
    run_distributed(_export_source, 2, str(run / "checkpoints"))
    (run / "config.json").write_text("{}")
    assert ckpt_main(["info", str(run)]) == 0
    assert f"checkpoint: {run / 'checkpoints' / 'step_00000002'}\nstep: 2" in capsys.readouterr().out
    assert ckpt_main(["verify", str(run)]) == 0
    assert f"ok       {run / 'checkpoints' / 'step_00000002'}" in capsys.readouterr().out
    assert ckpt_main(["export", str(run), str(tmp_path / "out")]) == 0
    assert f"exported {run / 'checkpoints' / 'step_00000002'}: wrote 1 file(s)" in capsys.readouterr().out
    in_the_way = tmp_path / "notes.txt"  # OUT an existing file: one line, no FileExistsError traceback
    in_the_way.write_text("keep me")
    for fmt in ("safetensors", "hf"):
        assert ckpt_main(["export", str(run), str(in_the_way), "--format", fmt, "--config", str(tmp_path / "c.json")]
                         if fmt == "hf" else ["export", str(run), str(in_the_way)]) == 2
        line = _one_error_line(capsys)
        assert line.startswith(f"shardwise ckpt export: error: {in_the_way}") and "file" in line, line
    assert in_the_way.read_text() == "keep me"


# ------------------------------------------------------------------ learning-rate schedule
def test_warmup_is_capped_by_steps_and_a_short_run_decays():
    cfg, _ = resolve_config(["--preset", "tiny", "--steps", "30"])  # the preset warms up for 30 steps
    schedule = lr_schedule(cfg)
    lrs = [schedule(s) for s in range(1, 31)]
    assert max(lrs) == pytest.approx(cfg.lr) and lrs.index(max(lrs)) == 14  # peak at step 15
    assert lrs[-1] == pytest.approx(cfg.lr * cfg.min_lr_ratio)  # and decays to the floor at the end
    assert "warm-up capped at half of --steps 30" in schedule.describe()
    assert schedule.describe().startswith("lr: linear warm-up to 0.002 over steps 1-15, then cosine decay")


@pytest.mark.parametrize("old_steps,new_steps,resume_at,warmup", [
    (100, 300, 100, 10),  # a finished run extended: was at the floor
    (100, 300, 50, 10),  # mid-decay
    (30, 300, 5, 20),  # still warming up (warm-up was capped at 15, now 20)
    (300, 100, 50, 10),  # shortened
])
def test_resuming_with_other_steps_keeps_the_rate_continuous(old_steps, new_steps, resume_at, warmup):
    old, _ = resolve_config(["--steps", str(old_steps), "--warmup-steps", str(warmup), "--lr", "1.0"])
    new, _ = resolve_config(["--steps", str(new_steps), "--warmup-steps", str(warmup), "--lr", "1.0"])
    saved = LRSchedule.from_dict(json.loads(json.dumps(lr_schedule(old).to_dict())))
    before = saved(resume_at)
    schedule = resumed_schedule(saved, new, resume_at)
    after = [schedule(s) for s in range(resume_at + 1, new_steps + 1)]
    step_size = max(abs(saved(s + 1) - saved(s)) for s in range(1, old_steps)) + 1e-9
    assert abs(after[0] - before) <= 2 * step_size, (before, after[:3])  # no jump
    assert after[-1] == pytest.approx(new.lr * new.min_lr_ratio) or new_steps <= resume_at
    assert "--steps" in schedule.describe() and f"at step {resume_at}" in schedule.describe()
    at_floor = f"the rate already decayed to its floor 0.1 by step {resume_at}, so steps {resume_at + 1}-{new_steps} " \
               f"stay there: for a decay over all {new_steps} steps, start a new run with --steps {new_steps}"
    assert (at_floor in schedule.describe()) == (resume_at == old_steps), schedule.describe()  # said when flat
    assert "\n" not in schedule.describe()
    assert resumed_schedule(saved, old, resume_at) is saved  # same flags: the same schedule, exactly


def test_lr_lines_never_read_backwards():
    """A resumed run whose new floor is above its current rate rises (and says so); no range runs backwards."""
    old, _ = resolve_config(["--steps", "10", "--warmup-steps", "2", "--lr", "0.002"])
    new, _ = resolve_config(["--steps", "20", "--warmup-steps", "2", "--lr", "0.01"])  # floor 0.001 > rate at 10
    saved = lr_schedule(old)
    rising = resumed_schedule(saved, new, 10)
    assert rising(20) > rising(11) and "cosine rise from 0.0002 up to 0.001 over steps 11-20" in rising.describe()
    assert "decay" not in rising.describe()
    shorter, _ = resolve_config(["--steps", "4", "--warmup-steps", "2", "--lr", "0.002"])
    past_the_end = resumed_schedule(saved, shorter, 6).describe()
    assert "no steps left (--steps 4)" in past_the_end and "7-4" not in past_the_end, past_the_end
    for steps in range(1, 6):
        cfg, _ = resolve_config(["--steps", str(steps), "--warmup-steps", "3"])
        line = lr_schedule(cfg).describe()
        assert all(int(a) <= int(b) for a, b in re.findall(r"steps (\d+)-(\d+)", line)), line


# ------------------------------------------------------------------ resuming on another world size
def test_another_world_size_is_announced_or_kept_with_grad_accum():
    run = {"world_size": 2, "micro_batch_size": 4, "grad_accum": 1, "global_batch": 8}
    cfg, _ = resolve_config(["--micro-batch-size", "4"])
    accum, line = global_batch_plan(run, cfg, 1)
    assert accum == 1 and "global batch changes from 8 to 4 sequences per step" in line and "\n" not in line
    cfg, _ = resolve_config(["--micro-batch-size", "4", "--keep-global-batch"])
    accum, line = global_batch_plan(run, cfg, 1)
    assert accum == 2 and "global batch kept at 8" in line
    assert global_batch_plan(run, cfg, 2) == (1, "")
    cfg, _ = resolve_config(["--micro-batch-size", "3", "--keep-global-batch"])
    with pytest.raises(ConfigError, match=r"--keep-global-batch: .*global batch of 8 sequences"):
        global_batch_plan(run, cfg, 1)


# ------------------------------------------------------------------ summary of a resumed run
def test_summary_describes_the_whole_run_from_its_metrics():
    def record(step, tokens, step_time, launch, elapsed):
        return {"step": step, "loss": 6.0 - step, "tokens": tokens, "step_time_s": step_time,
                "tokens_per_s": 0.0, "mfu": None, "mem_gib": 0.1 * step, "elapsed_s": elapsed, "launch": launch}

    records = [record(1, 1000, 9.0, 1, 9.0), record(2, 2000, 1.0, 1, 10.0),  # 2 ranks, 1000 tokens a step
               record(3, 2500, 7.0, 2, 7.0), record(4, 3000, 0.5, 2, 7.5)]  # resumed on 1 rank: 500 a step
    summary = summarize(records)
    assert summary["steps"] == 4 and summary["launches"] == 2 and summary["resumed_at"] == [3]
    assert summary["first_loss"] == 5.0 and summary["tokens"] == 3000
    assert summary["tokens_per_s"] == pytest.approx((1000 + 500) / (1.0 + 0.5))  # first step of each launch left out
    assert summary["train_time_s"] == pytest.approx(17.5) and summary["peak_mem_gib"] == pytest.approx(0.4)


# ------------------------------------------------------------------ clip_grad_norm_
def _clip_refusals() -> list[str]:
    import shardwise

    messages = []
    model = shardwise.fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    model(torch.ones(2, 4)).sum().backward()
    for kwargs in ({"max_norm": -1.0}, {"max_norm": float("nan")}, {"max_norm": True},
                   {"max_norm": 1.0, "norm_type": -2.0}):
        try:
            shardwise.clip_grad_norm_(model.parameters(), **kwargs)
            messages.append(f"accepted {kwargs}")
        except ValueError as e:
            messages.append(str(e))
    norm = shardwise.clip_grad_norm_(model.parameters(), float("inf"))  # measuring only stays allowed
    messages.append(f"inf ok {float(norm) > 0}")

    stepped = shardwise.fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    shardwise.BackwardOptimizer(stepped, torch.optim.SGD, lr=0.1)
    stepped(torch.ones(2, 4)).sum().backward()
    try:
        shardwise.clip_grad_norm_(stepped.parameters(), 1.0)
        messages.append("accepted BackwardOptimizer")
    except ValueError as e:
        messages.append(str(e))

    # folding the factor into the step: a fused optimizer over exactly these parameters, once per step
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    first = list(model.parameters())[:2]
    for params, opt in ((model.parameters(), torch.optim.AdamW(model.parameters())),
                        (first, fused), (model.parameters(), fused), (model.parameters(), fused)):
        try:
            shardwise.clip_grad_norm_(params, 1.0, optimizer=opt)
            messages.append("folded")
        except ValueError as e:
            messages.append(str(e))
    fused.step()
    shardwise.clip_grad_norm_(model.parameters(), 1.0, optimizer=fused)  # a new step: fine again
    messages.append(f"after step {hasattr(fused, 'grad_scale')}")

    early = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optimizer = torch.optim.AdamW(early.parameters())  # built before fully_shard: holds the originals
    early = shardwise.fully_shard(early)
    early(torch.ones(2, 4)).sum().backward()
    try:
        optimizer.step()  # refused at its first step, for every user (torch's global step pre-hook)
        messages.append("stepped a stale optimizer")
    except ValueError as e:
        messages.append(str(e))
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 4))
    on_meta = torch.optim.SGD(meta.parameters(), lr=0.1)  # before fully_shard of a meta model
    meta = shardwise.fully_shard(meta, init_fn=shardwise.MetaInitializer(meta))
    try:
        on_meta.step()
        messages.append("stepped a stale optimizer of meta parameters")
    except ValueError as e:
        messages.append(str(e))
    try:
        shardwise.check_optimizer_params(torch.optim.AdamW(meta.parameters()), early)  # another model's
        messages.append("accepted another model's optimizer")
    except ValueError as e:
        messages.append(str(e))
    after = torch.optim.AdamW(early.parameters())  # built after: steps, and is looked at once only
    after.step()
    from shardwise.engine.replaced_params import _checked
    messages.append(f"after fully_shard ok {_checked.get(after) == 1}")
    after.add_param_group({"params": list(on_meta.param_groups[0]["params"])})  # a stale group added later
    try:
        after.step()
        messages.append("stepped a stale parameter group")
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_clip_grad_norm_refuses_bad_arguments_a_backward_optimizer_and_an_unfit_optimizer():
    messages = run_distributed(_clip_refusals, 1)[0]
    assert "clip_grad_norm_: max_norm=-1.0 must be a non-negative number" in messages[0]
    assert "clip_grad_norm_: max_norm=nan must be a non-negative number" in messages[1]
    assert "clip_grad_norm_: max_norm=True" in messages[2]
    assert "clip_grad_norm_: norm_type=-2.0" in messages[3]
    assert messages[4] == "inf ok True"
    assert "clip_grad_norm_: 4 of the 4 parameters are stepped by a BackwardOptimizer" in messages[5]
    assert "clip_grad_norm_: optimizer=AdamW must be a fused torch optimizer" in messages[6]
    assert "clip_grad_norm_: optimizer=AdamW steps 2 parameters with gradients that are not in parameters, " \
           "and parameters has 0" in messages[7]
    assert messages[8] == "folded"
    assert "clip_grad_norm_: optimizer=AdamW already carries a clipping factor for these gradients" in messages[9]
    assert messages[10] == "after step True"
    assert ("optimizer=AdamW: 2 of its 2 parameters were replaced by fully_shard after the optimizer was built, "
            "so its step would update discarded tensors") in messages[11]
    assert "build the optimizer from model.parameters() after fully_shard" in messages[11]
    assert "optimizer=SGD: 2 of its 2 parameters were replaced by meta materialization" in messages[12]
    assert "optimizer=AdamW: 2 of its 2 parameters are not parameters of the model" in messages[13]
    assert messages[14] == "after fully_shard ok True"
    assert "optimizer=AdamW: 2 of its 4 parameters were replaced by meta materialization" in messages[15]
    assert all("\n" not in m for m in messages)


# ------------------------------------------------------------------ Ctrl-C in any command
def test_ctrl_c_in_a_command_is_one_line_and_130(monkeypatch, capsys):
    import types

    from shardwise.app import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "fake_command", types.SimpleNamespace(main=interrupted))
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_command", "raises KeyboardInterrupt"))
    assert cli.main(["fake"]) == 130
    assert _one_error_line(capsys) == "shardwise fake: interrupted (Ctrl-C)"
