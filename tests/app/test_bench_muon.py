"""``shardwise bench --optimizer adamw,muon`` on 2 gloo processes: both optimizers run beside each other in one
job, FSDP2 (whose DTensors Muon would orthogonalise with collectives) is skipped with the reason, and the Muon
run shows the mechanism: each rank's Newton-Schulz FLOPs within 10% of the mean, Muon's step time per rank."""

from __future__ import annotations

import dataclasses

from shardwise.app.bench import cli
from tests.helpers.bench import tiny_options
from tests.helpers.distributed import run_distributed


def _bench(out: str):
    opts = dataclasses.replace(tiny_options(("shardwise", "fsdp2"), 2, profile_steps=0), optimizers=("adamw", "muon"))
    return cli.worker(opts, out, "test")


def test_muon_beside_adamw_shows_balanced_newton_schulz_work(tmp_path):
    runs = run_distributed(_bench, 2, str(tmp_path))[0]
    by = {(r["wrapper"], r["optimizer"]): r for r in runs}
    assert set(by) == {("shardwise", "adamw"), ("fsdp2", "adamw"), ("shardwise", "muon"), ("fsdp2", "muon")}
    assert by[("fsdp2", "muon")]["status"] == "skipped" and "Owned()" in by[("fsdp2", "muon")]["reason"]
    muon = by[("shardwise", "muon")]
    assert muon["status"] == "ok" and by[("shardwise", "adamw")]["status"] == "ok"
    assert len(muon["ns_flops_per_rank"]) == 2 and min(muon["ns_flops_per_rank"]) > 0
    assert muon["ns_imbalance"] <= 1.10, muon["ns_flops_per_rank"]
    assert len(muon["muon_step_s_per_rank"]) == 2 and min(muon["muon_step_s_per_rank"]) > 0
    assert "| shardwise +muon |" in (tmp_path / "bench.md").read_text()


def test_unknown_optimizer_is_refused(capsys):
    assert cli.main(["--device", "cpu", "--optimizer", "adamw,lion"]) == 2
    assert "--optimizer adamw,lion" in capsys.readouterr().err
