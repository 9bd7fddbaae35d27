"""The CPU AdamW benchmark on a tiny size: every variant measured, and they agree."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.cpu_adam import APIS, VARIANTS, main, transformer_shapes


def test_shapes_add_up():
    shapes = transformer_shapes(1_000_000, 40)
    assert len(shapes) == 40
    total = sum(math.prod(s) for s in shapes)
    assert abs(total - 1_000_000) <= shapes[-1][1]  # within one embedding row
    assert all(math.prod(s) > 0 for s in shapes)


@pytest.mark.timeout(60)
def test_cpu_adam_bench_tiny(tmp_path, capsys):
    threads = torch.get_num_threads()
    rc = main(["--numel", "20000", "--tensors", "10", "--threads", "1", "--steps", "1", "--warmup", "1", "--rounds", "1",
               "--out", str(tmp_path)])
    assert rc == 0
    assert torch.get_num_threads() == threads  # restored
    report = json.loads((tmp_path / "cpu_adam.json").read_text())
    assert (tmp_path / "cpu_adam.md").read_text().count("\n| 1 |") == len(VARIANTS) * len(APIS)

    rows = {(r["api"], r["variant"]): r for r in report["results"]}
    assert set(rows) == {(a, v) for a in APIS for v in VARIANTS}
    for (api, variant), row in rows.items():
        assert row["threads"] == 1
        assert row["elements_per_s"] > 0 and math.isfinite(row["elements_per_s"]), (api, variant)
        assert row["gb_per_s"] > 0 and row["step_s"] > 0
        # against the plain for-loop run: fused may round differently, nothing more
        assert row["max_rel_diff"] <= 1e-6, (api, variant, row["max_abs_diff"])
    assert rows[("tensor", "fused")]["resolved"] == "fused"
    assert rows[("tensor", "foreach")]["resolved"] == "foreach"
    assert rows[("tensor", "default")]["resolved"] in ("for-loop", "foreach")
    assert report["config"]["bytes_per_element"] == 28
    assert report["bandwidth_gbs"]["1"]["best"] > 0
    assert set(report["recommendation"]["best"]) == set(APIS)


def test_cpu_adam_bench_rejects_unknown_variant(tmp_path):
    assert main(["--numel", "1000", "--variants", "turbo", "--out", str(tmp_path)]) == 2
