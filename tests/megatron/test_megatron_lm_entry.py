"""Megatron-LM's own entry point with ``use_in_megatron()``, from a Megatron-LM tree (``SHARDWISE_MEGATRON_LM``).

Megatron-LM's sources cannot be part of this repository, and CI has none. So two layers:

- always: the recorded configs (``tests/helpers/data/megatron_lm_configs.json``, which
  ``tests/megatron/test_megatron_lm_configs.py`` wraps) are of the command lines
  ``scripts/megatron_lm_check.py`` runs now: a case changed there without re-recording fails here;
- with ``SHARDWISE_MEGATRON_LM=/path/to/Megatron-LM`` (several trees: ``os.pathsep``-separated),
  the script runs on 4 processes (gloo on CPU, NCCL on GPUs) for each tree: Megatron-LM's
  ``parse_args`` / ``validate_args``, its model builder and ``train``'s set-up build and
  recognise shardwise's chunks for every case (see the script), and the configs it passes
  equal the record's in every field shardwise reads. The tree's Python requirements must be
  importable (``six``, ``triton``). Without the variable this test is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardwise.megatron import DistributedDataParallelConfig, TransformerConfig

from tests.helpers import DATA, REPO
from tests.helpers.megatron_mirrors import mirrored_fields

SCRIPT = REPO / "scripts" / "megatron_lm_check.py"
RECORD = json.loads((DATA / "megatron_lm_configs.json").read_text())
TREES = [p for p in os.environ.get("SHARDWISE_MEGATRON_LM", "").split(os.pathsep) if p]
WORLD = 4  # HSDP: two replicas of two ranks


def _script_cases() -> tuple[str, dict]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import megatron_lm_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return megatron_lm_check.BASE, megatron_lm_check.CASES


def test_the_record_is_of_the_scripts_command_lines():
    base, cases = _script_cases()
    for release, entry in RECORD.items():
        assert entry["base"] == base, f"{release}: re-record with scripts/megatron_lm_check.py --record"
        assert {k: c["cmdline"] for k, c in entry["cases"].items()} == cases, release


@pytest.mark.slow
@pytest.mark.skipif(not TREES, reason="SHARDWISE_MEGATRON_LM (a Megatron-LM tree) not set; CI covers the recorded "
                                      "configs: tests/megatron/test_megatron_lm_configs.py")
@pytest.mark.parametrize("tree", TREES or ["unset"])
def test_megatron_lm_builds_and_recognises_shardwise(tree, tmp_path):
    record = tmp_path / "configs.json"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", str(SCRIPT),
         "--megatron-lm", tree, "--record", str(record)],
        capture_output=True, text=True, timeout=800,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, f"exit {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    summary = json.loads(lines[-1])
    assert summary["failures"] == {}, summary["failures"]
    assert "megatron.training.training.megatron_FSDP" in summary["replaced"]
    _, cases = _script_cases()
    assert set(summary["cases"]) == set(cases)
    for case, result in summary["cases"].items():
        assert result["shardwise"] and result["megatron_FSDP"] and result["unwrap_model"] == "MegatronFSDPLevel", case
    live = json.loads(record.read_text())[summary["megatron_lm"]]["cases"]
    recorded = RECORD.get(summary["megatron_lm"])
    if recorded is None:
        pytest.fail(f"Megatron-LM {summary['megatron_lm']} ran clean but is not in the record: add it with "
                    f"scripts/megatron_lm_check.py --record tests/helpers/data/megatron_lm_configs.json")
    for cls_name, cls in (("TransformerConfig", TransformerConfig), ("DistributedDataParallelConfig",
                                                                    DistributedDataParallelConfig)):
        read = set(mirrored_fields(cls))
        for case in cases:
            mine = {k: v for k, v in live[case][cls_name].items() if k in read}
            theirs = {k: v for k, v in recorded["cases"][case][cls_name].items() if k in read}
            assert mine == theirs, (case, cls_name, {k for k in mine.keys() | theirs.keys()
                                                     if mine.get(k) != theirs.get(k)})
