"""Every strategy trains to the reference's losses and parameters."""

import pytest


from tests.helpers.distributed import run_distributed
from tests.helpers.parity import Run, assert_parity

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_matches_reference_fp32(world, strategy):
    run_distributed(assert_parity, world, Run(strategy=strategy))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_hybrid_matches_reference_fp32(world, outer):
    # world 4 is the (2, 2) mesh; 2 is (2, 1) and 1 is (1, 1): degenerate but legal meshes
    run_distributed(assert_parity, world, Run(outer=outer))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy,outer", [("optim_grads_params", None), ("optim", None), ("optim_grads_params", "optim")])
def test_bf16_compute_fp32_main_within_bf16_tolerance(world, strategy, outer):
    # SGD: Adam would turn bf16 noise in near-zero gradients into full-size steps.
    run_distributed(assert_parity, world, Run(strategy=strategy, outer=outer, bf16=True, optimizer="sgd"))


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adam_foreach", "sgd"])
def test_torch_optimizers_work_on_sharded_parameters(optimizer):
    run_distributed(assert_parity, 2, Run(optimizer=optimizer))


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_activation_checkpointing(checkpointing, strategy):
    run_distributed(assert_parity, 2, Run(strategy=strategy, checkpointing=checkpointing))


@pytest.mark.parametrize("world", [2, 4])
def test_clip_grad_norm_matches_torch(world):
    run_distributed(assert_parity, world, Run(clip=0.5, outer="optim" if world == 4 else None))


@pytest.mark.parametrize("world,strategy,outer,micro_batches", [
    (1, "optim_grads_params", None, 2),  # one process: what a one-GPU run checks of the reduce-stream steps
    (2, "optim_grads_params", None, 1),
    (2, "optim", None, 4),
    (4, "optim_grads_params", "optim", 2),
])
def test_optimizer_in_backward_matches_a_step_after_backward(world, strategy, outer, micro_batches):
    run = Run(strategy=strategy, outer=outer, optimizer="adamw_in_backward", micro_batches=micro_batches,
              global_batch=16)
    run_distributed(assert_parity, world, run)
