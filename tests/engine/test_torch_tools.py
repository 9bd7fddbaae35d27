"""Acceptance: every DTensor shardwise hands out is honest in torch's own terms.

Parameters, ``.grad``, optimizer state and ``state_dict()`` values are judged
only with torch's tools (``full_tensor``, ``redistribute``, ``distribute_tensor``,
``get/set_model_state_dict``, ``get/set_optimizer_state_dict``, plain DCP,
``dcp_to_torch_save``, FSDP2 checkpoints) against the same model trained
unsharded on the global batch. One worker task per (configuration, world
size) checks everything for it; the bodies live in ``torch_tools_cases``.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


from tests.helpers import torch_tools_cases as cases
from tests.helpers.distributed import run_distributed
from tests.helpers.torch_tools_cases import Report

CONFIGURATIONS = [pytest.param(c.name, world, id=f"{c.name}-{world}proc") for c in cases.CONFIGS for world in c.worlds]


@pytest.mark.parametrize("name,world", CONFIGURATIONS)
def test_dtensors_and_state_dict_api(name, world):
    """1, 2, 5: honest parameters, grads, optimizer state and state dicts; torch's state-dict API round trips."""
    run_distributed(cases.check_configuration, world, name)


# world size, strategy, steps trained there (the reference trains the same steps on one process)
DCP_CHAIN = [(4, "optim_grads_params", (0, 2)), (2, "optim", (2, 3)), (1, "no_shard", (3, 4))]


def test_plain_dcp_reshards_4_to_2_to_1(tmp_path):
    """3: dcp.save of model.state_dict() + get_optimizer_state_dict loads bit for bit at another world
    size and strategy; dcp_to_torch_save of each checkpoint gives the reference weights."""
    previous, expected = None, None
    with Report("plain DCP chain 4 -> 2 -> 1, driver side") as report:
        for world, strategy, steps in DCP_CHAIN:
            path = str(tmp_path / f"{strategy}-{world}proc")
            saved, reference = run_distributed(cases.dcp_save_load, world, strategy, previous, expected, path, steps)[0]
            plain = tmp_path / f"{strategy}-{world}proc.pt"
            dcp_to_torch_save(path, plain)
            plain = torch.load(plain, weights_only=False)
            report.equal(f"dcp_to_torch_save({path})['model']", plain["model"], saved[0])
            report.equal(f"dcp_to_torch_save({path})['optim']", plain["optim"], saved[1])
            report.same_keys(f"dcp_to_torch_save({path})['model']", plain["model"], reference)
            for key in sorted(set(plain["model"]) & set(reference)):
                report.close_to(f"dcp_to_torch_save({path})[{key!r}] vs reference", plain["model"][key], reference[key])
            previous, expected = path, saved


@pytest.mark.parametrize("source,target", [("fsdp2", "shardwise"), ("shardwise", "fsdp2")])
def test_checkpoint_migrates_between_fsdp2_and_shardwise(source, target, tmp_path):
    """4: a DCP checkpoint of one engine loads into the other (get_*_state_dict, dcp.load, set_*_state_dict),
    which then trains exactly as the first one goes on training."""
    run_distributed(cases.migrate, 2, source, target, str(tmp_path / "checkpoint"))


def test_hugging_face_llama_zero3_matches_one_process():
    """6: a tiny tied-embedding LlamaForCausalLM, ZeRO-3 with LlamaDecoderLayer units on 2 processes."""
    run_distributed(cases.hf_llama, 2)
