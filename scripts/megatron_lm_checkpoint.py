"""Megatron-LM's own ``save_checkpoint`` / ``load_checkpoint`` (``fsdp_dtensor``) with shardwise's chunks.

Every rank imports ``pretrain_gpt.py`` from the Megatron-LM tree given by
``--megatron-lm``, calls ``use_in_megatron()`` (the one added line) and runs, on
Megatron-LM's own argument parsing (``scripts/megatron_lm_check.py``'s ``BASE``
command line, ZeRO-3 unless ``--strategy`` says otherwise, ``--ckpt-format fsdp_dtensor``):

- ``--phase save``: ``training.setup_model_and_optimizer`` (``get_model`` and
  Megatron-Core's ``DistributedOptimizer``), two training steps (forward, backward,
  ``finish_grad_sync``, ``optimizer.step()``), then ``checkpointing.save_checkpoint``
  into ``--folder``; rank 0 also writes every parameter and optimizer-state tensor
  in full (``expected.pt``);
- ``--phase load`` (any data-parallel size): ``setup_model_and_optimizer`` with
  ``--load``, which runs ``checkpointing.load_checkpoint``; then every parameter and
  optimizer-state tensor must equal ``expected.pt`` bit for bit, and the iteration be 2.

Nothing of Megatron-LM is replaced but the class ``use_in_megatron()`` swaps. On a
machine without CUDA (gloo) the CUDA calls are pointed at the CPU
(``megatron_lm_check.cuda_on_the_cpu`` / ``cuda_tensors_on_the_cpu``) and :data:`CPU_FLAGS`
are added (no clipping: Megatron's asserts CUDA gradients; no fused kernels). Run under
``torchrun``; prints ``CHECKPOINT <phase> ok`` on rank 0 when every check holds:

    torchrun --standalone --nproc-per-node 2 scripts/megatron_lm_checkpoint.py --megatron-lm PATH \
        --phase save --folder DIR
    torchrun --standalone --nproc-per-node 1 scripts/megatron_lm_checkpoint.py --megatron-lm PATH \
        --phase load --folder DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import megatron_lm_check as check

STEPS = 2
SEQ, VOCAB = 32, 128  # BASE's --seq-length / --vocab-size
# without CUDA: no clipping (it asserts CUDA grads), no fused kernels (CUDA extensions, torch.compile'd fusions)
CPU_FLAGS = "--clip-grad 0 --no-masked-softmax-fusion --no-bias-dropout-fusion --no-bias-gelu-fusion"


def full_state(model, optimizer) -> dict:
    """The ``fsdp_dtensor`` state ``checkpointing.py`` saves (model and optimizer), every tensor in full."""
    from megatron.core.utils import unwrap_model

    def full(value):
        return value.full_tensor() if isinstance(value, DTensor) else value.clone() if torch.is_tensor(value) else value

    model_sd = unwrap_model(model[0]).state_dict_for_save_checkpoint()
    optim_sd = optimizer.sharded_state_dict({}, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    return {"model": {k: full(v) for k, v in model_sd.items() if not k.endswith("_extra_state")},
            "optimizer": {k: {s: full(v) for s, v in sub.items()} for k, sub in optim_sd["state"].items()}}


def differences(loaded: dict, expected: dict) -> list[str]:
    wrong = []
    for part in ("model", "optimizer"):
        if loaded[part].keys() != expected[part].keys():
            wrong.append(f"{part} keys differ: {sorted(set(loaded[part]) ^ set(expected[part]))[:6]}")
    for key, value in expected["model"].items():
        if key in loaded["model"] and not torch.equal(loaded["model"][key], value):
            wrong.append(f"model {key}")
    for key, sub in expected["optimizer"].items():
        for name, value in sub.items():
            mine = loaded["optimizer"].get(key, {}).get(name)
            if mine is None or not torch.equal(torch.as_tensor(mine), torch.as_tensor(value)):
                wrong.append(f"optimizer {key} {name}")
    return wrong


def train(model, optimizer, steps: int) -> None:
    """Megatron-LM's train_step in miniature on the chunk, each data-parallel rank on its own tokens."""
    chunk = model[0]
    position_ids = torch.arange(SEQ).unsqueeze(0)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
        tokens = torch.randint(0, VOCAB, (1, SEQ), generator=generator)
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        chunk(tokens, position_ids, mask, labels=tokens).float().mean().backward()
        chunk.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok, f"step {step}: optimizer.step() reported a failed update"


def setup_model_and_optimizer(pretrain_gpt, training):
    """Megatron-LM's ``setup_model_and_optimizer`` as its ``pretrain`` calls it (it loads ``--load`` too).

    0.16: with ``pretrain_gpt.py``'s model provider; 0.19: with the config container
    ``pretrain_gpt.py`` builds and the mpu process groups, as ``pretrain`` passes them.
    """
    from functools import partial

    from megatron.core.enums import ModelType
    from megatron.training import get_args

    if hasattr(pretrain_gpt, "gpt_config_from_args"):  # 0.19
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        args = get_args()
        cfg = pretrain_cfg_container_from_args(args, pretrain_gpt.gpt_config_from_args(args))
        return training.setup_model_and_optimizer(ModelType.encoder_or_decoder, cfg_container=cfg,
                                                  pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    provider = partial(pretrain_gpt.model_provider, pretrain_gpt.gpt_builder)
    return training.setup_model_and_optimizer(provider, ModelType.encoder_or_decoder)


def run(phase: str, folder: Path, strategy: str, extra_flags: str = "") -> list[str]:
    import pretrain_gpt
    from megatron.training import checkpointing, get_args, training

    from shardwise.megatron import FullyShardedDataParallelV1, FullyShardedDataParallelV2, use_in_megatron

    names = use_in_megatron()  # the one added line
    cmdline = (f"--data-parallel-sharding-strategy {strategy} --save {folder / 'ckpt'} --save-interval {STEPS} "
               f"{CPU_FLAGS if not torch.cuda.is_available() else ''} {extra_flags}")
    if phase == "load":
        cmdline += f" --load {folder / 'ckpt'}"
    check._setup(cmdline)
    try:
        model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt, training)
        wrong = [] if all(isinstance(c, (FullyShardedDataParallelV1, FullyShardedDataParallelV2)) for c in model) \
            else [f"chunks are {[type(c).__name__ for c in model]}, not shardwise's"]
        args = get_args()
        if phase == "save":
            train(model, optimizer, STEPS)
            checkpointing.save_checkpoint(STEPS, model, optimizer, scheduler, num_floating_point_operations_so_far=0)
            expected = full_state(model, optimizer)
            if dist.get_rank() == 0:
                torch.save(expected, folder / "expected.pt")
        else:
            if args.iteration != STEPS:
                wrong.append(f"load_checkpoint resumed at iteration {args.iteration}, saved at {STEPS}")
            wrong += differences(full_state(model, optimizer), torch.load(folder / "expected.pt"))
        return wrong
    finally:
        names.restore()
        check._teardown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True, help="a Megatron-LM tree (core_r0.16 .. core_r0.19)")
    parser.add_argument("--phase", choices=["save", "load"], required=True)
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--strategy", default="optim_grads_params")
    parser.add_argument("--swiglu", action="store_true",
                        help="a SwiGLU GPT: checkpointing.py splits each linear_fc1 into _w/_v halves")
    opts = parser.parse_args()
    tree, folder = opts.megatron_lm.resolve(), opts.folder.resolve()
    check.put_on_path(tree)
    sys.path.insert(1, str(check.REPO))
    os.chdir(tree)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    with check.cuda_on_the_cpu(), check.cuda_tensors_on_the_cpu():
        wrong = run(opts.phase, folder, opts.strategy, "--swiglu" if opts.swiglu else "")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, wrong)
    if dist.get_rank() == 0:
        failures = {rank: w for rank, w in enumerate(gathered) if w}
        print(f"CHECKPOINT {opts.phase} {'ok' if not failures else 'FAILED'} (world {dist.get_world_size()}): "
              f"{failures or 'bit-equal' if opts.phase == 'load' else failures or 'saved'}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if any(gathered) else 0)


if __name__ == "__main__":
    main()
