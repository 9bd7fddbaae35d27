"""NVIDIA's published Megatron-FSDP recipes, scaled down, through Megatron-LM's own training code (4 gloo processes).

``scripts/megatron_lm_recipes.py`` runs each recipe (Llama-3 8B from ``examples/megatron_fsdp/`` at
ZeRO-3/2/1, TP2, HSDP and HFSDP; the docs' recommended Megatron-FSDP flags; Megatron's
``gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor`` CI case; DeepSeek-V3 from ``examples/megatron_fsdp/`` and
Mixtral 8x7B with the recommended flags, both at EP2, loaded again at EP1 / EP4) through Megatron-LM's ``parse_args``,
``setup_model_and_optimizer``, ``train`` (which saves with ``save_checkpoint``) and a fresh
``setup_model_and_optimizer`` with ``--load`` (``load_checkpoint``), and checks every parameter
and optimizer-state tensor bit-equal after the load (docs/megatron.md, "Published recipes").

- always: Megatron-LM's training code from the megatron-core 0.19.2 wheel (pip; it carries
  ``megatron/training``), on Python 3.11;
- with ``SHARDWISE_MEGATRON_LM`` (Megatron-LM trees, ``os.pathsep``-separated, e.g. core_r0.16.0):
  the same from each tree, with its ``pretrain_gpt.py``'s model provider.

The Llama recipes use ``--swiglu``: their checkpoints hold Megatron-FSDP's ``linear_fc1.weight_w`` /
``_v`` halves, checked here in the TP2 one's DCP metadata.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.megatron_wheel import megatron_core_019

SCRIPT = REPO / "scripts" / "megatron_lm_recipes.py"
TREES = [p for p in os.environ.get("SHARDWISE_MEGATRON_LM", "").split(os.pathsep) if p]
WORLD = 4  # TP2 x DP2, HSDP: two replicas of two
# torchrun on 4 processes (a subprocess, minutes): out of the quick tier (docs/testing.md)
pytestmark = pytest.mark.slow


def _recipes() -> list[str]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import megatron_lm_recipes
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return list(megatron_lm_recipes.RECIPES)


def run_recipes(source: list[str], folder) -> dict:
    """The script on ``WORLD`` gloo processes; its summary (one JSON line on rank 0)."""
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", str(SCRIPT),
         *source, "--folder", str(folder)],
        capture_output=True, text=True, timeout=840, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, f"exit {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def wheel_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recipes")
    return folder, run_recipes(["--wheel", str(megatron_core_019())], folder)


@pytest.mark.parametrize("recipe", _recipes())
def test_recipe_trains_saves_and_resumes_bit_equal_on_megatron_lm_019(wheel_run, recipe):
    _, summary = wheel_run
    assert summary["megatron_core"].startswith("0.19"), summary
    assert summary["recipes"][recipe] == "ok", summary["recipes"][recipe]


def test_swiglu_checkpoint_holds_megatron_fsdps_halves(wheel_run):
    import torch.distributed.checkpoint as dcp

    folder, _ = wheel_run
    metadata = dcp.FileSystemReader(str(folder / "llama3_8b_tp2" / "iter_0000002")).read_metadata()
    sizes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    for layer in (0, 1):
        key = f"model.module.decoder.layers.{layer}.mlp.linear_fc1.weight"
        assert key not in sizes
        # --ffn-hidden-size 448 --hidden-size 128: fc1 is [2 x 448, 128], split over TP2; each half whole
        assert sizes[f"{key}_w"] == sizes[f"{key}_v"] == (448, 128), sizes
        optimizer = f"optimizer.state.module.module.module.decoder.layers.{layer}.mlp.linear_fc1.weight"
        assert sizes[f"{optimizer}_w.exp_avg"] == sizes[f"{optimizer}_v.exp_avg_sq"] == (448, 128)


def test_moe_checkpoint_holds_every_expert_by_global_index(wheel_run):
    """DeepSeek-V3 at EP2 (4 experts, 2 per EP rank): Megatron-FSDP's keys, one whole tensor per global expert."""
    import torch.distributed.checkpoint as dcp

    folder, _ = wheel_run
    metadata = dcp.FileSystemReader(str(folder / "deepseek_v3_ep2" / "iter_0000002")).read_metadata()
    sizes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    # layer 1 is the MoE layer (--moe-layer-freq [0]*1+[1]*1); the MTP layer is one too
    for moe in ("model.module.decoder.layers.1.mlp", "model.module.mtp.layers.0.mtp_model_layer.mlp"):
        for expert in range(4):  # --moe-ffn-hidden-size 64, --hidden-size 128
            key = f"{moe}.experts.local_experts.{expert}"
            assert sizes[f"{key}.linear_fc1.weight_w"] == sizes[f"{key}.linear_fc1.weight_v"] == (64, 128), sizes
            assert sizes[f"{key}.linear_fc2.weight"] == (128, 64)
        assert f"{moe}.experts.local_experts.4.linear_fc2.weight" not in sizes
        assert sizes[f"{moe}.shared_experts.linear_fc2.weight"] == (128, 64)
        assert sizes[f"{moe}.router.weight"] == (4, 128) and sizes[f"{moe}.router.expert_bias"] == (4,)


@pytest.mark.skipif(not TREES, reason="SHARDWISE_MEGATRON_LM (a Megatron-LM tree, e.g. core_r0.16.0) not set; "
                                      "the wheel's 0.19 training code runs above")
@pytest.mark.parametrize("tree", TREES or ["unset"])
def test_recipes_on_a_megatron_lm_tree(tree, tmp_path):
    summary = run_recipes(["--megatron-lm", tree], tmp_path)
    assert all(result == "ok" for result in summary["recipes"].values()), summary
