"""NVIDIA's published Megatron-FSDP recipes, scaled down, through Megatron-LM's own training code.

For each recipe of :data:`RECIPES` (their flags as published, scaled to 2 layers and hidden
size 128, the local layers instead of Transformer Engine, and :data:`DROPPED` left out
with the reason), every rank runs, with ``use_in_megatron()`` (the one added line):

1. Megatron-LM's ``parse_args`` / ``validate_args``, ``_initialize_distributed`` and
   ``_set_random_seed`` on the recipe's command line plus ``--save``;
2. ``training.setup_model_and_optimizer`` (0.19: with the config container
   ``argument_utils`` builds, as ``pretrain_gpt.py`` does; 0.16: ``pretrain_gpt.py``'s
   model provider) and ``training.train`` for :data:`ITERATIONS` iterations, which saves
   through ``checkpointing.save_checkpoint`` at the last one;
3. a fresh ``setup_model_and_optimizer`` with ``--load`` (and another ``--seed``, so that
   nothing equals the trained run's by being initialized alike): Megatron-LM's
   ``load_checkpoint``; every parameter and optimizer-state tensor must equal the trained
   run's bit for bit, at the saved iteration.

The training code is Megatron-LM's: from a tree (``--megatron-lm``, core_r0.16 or
core_r0.19) or, without one, from the megatron-core 0.19 wheel, which carries
``megatron/training`` (``--wheel``: the unpacked wheel; Python 3.11 gets
``typing.override`` from ``typing_extensions``; Megatron needs ``six`` and ``triton``
importable). ``pretrain_gpt.py`` is not in the wheel, so :func:`forward_step` (its contract:
outputs and a loss function returning the token sum, the token count and the report) and the
data (random tokens per data-parallel rank; ``--mock-data``'s datasets need Megatron's
compiled helpers) are this script's. Without CUDA the CUDA calls are pointed at the CPU
(``megatron_lm_check.py``) and gloo is used; ``CPU_DROPPED`` are dropped there too. Prints
one JSON line on rank 0: per recipe, ``ok`` or what went wrong. Run under ``torchrun``::

    torchrun --standalone --nproc-per-node 4 scripts/megatron_lm_recipes.py --wheel DIR --folder TMP
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import megatron_lm_check as check

ITERATIONS = 2
SEQ, VOCAB = 64, 256
SCALE = (  # every recipe: 2 layers, hidden 128, the local layers, small batches, 2 iterations, no evaluation
    f"--num-layers 2 --hidden-size 128 --seq-length {SEQ} --max-position-embeddings {SEQ} --vocab-size {VOCAB} "
    "--micro-batch-size 1 --global-batch-size 8 --transformer-impl local --no-persist-layer-norm "
    f"--eval-iters 0 --eval-interval 1000 --log-interval 1 --save-interval {ITERATIONS}"
)
# examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh (core_r0.19.0), Megatron-FSDP branch, scaled
LLAMA3_8B = (
    "--use-mcore-models --ffn-hidden-size 448 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--kv-channels 32 --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 "
    "--untie-embeddings-and-output-weights --disable-bias-linear "
    f"--train-samples {8 * ITERATIONS} --lr-decay-samples 12 --lr-warmup-samples 4 --lr 0.00015 --min-lr 0.00001 "
    "--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9 "
    "--adam-beta2 0.95 --bf16 --no-check-for-nan-in-loss-and-grad --manual-gc --empty-unused-memory-level 1 "
    "--exit-duration-in-mins 235 "
    "--use-megatron-fsdp --no-gradient-accumulation-fusion --calculate-per-token-loss --init-model-with-meta-device "
    "--ckpt-format fsdp_dtensor --fsdp-double-buffer "
    "--context-parallel-size 1 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce "
    "--overlap-param-gather --mock-data --tokenizer-type NullTokenizer --split 99,1,0 "
    "--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1"
)
# docs/user-guide/features/megatron_fsdp.md, "Recommended Configuration for Megatron-LM" (core_r0.19.0)
RECOMMENDED = (
    "--num-attention-heads 4 --train-iters 2 --lr 1e-3 --bf16 --mock-data --tokenizer-type NullTokenizer "
    "--use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy optim_grads_params "
    "--ckpt-format fsdp_dtensor --no-gradient-accumulation-fusion "
    "--init-model-with-meta-device --calculate-per-token-loss --grad-reduce-in-bf16 --fsdp-double-buffer"
)
# tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor (core_r0.19.0), scaled
CI_TP2_Z3 = (
    "--num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad --micro-batch-size 1 --train-iters 2 "
    "--timing-log-level 0 --lr-decay-iters 320000 --mock-data --tokenizer-type NullTokenizer --split 949,50,1 "
    "--lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --lr-warmup-fraction .01 "
    "--tensor-model-parallel-size 2 --use-megatron-fsdp --calculate-per-token-loss "
    "--data-parallel-sharding-strategy optim_grads_params --use-distributed-optimizer --deterministic-mode "
    "--no-gradient-accumulation-fusion --megatron-fsdp-main-params-dtype fp32 --megatron-fsdp-main-grads-dtype fp32 "
    "--megatron-fsdp-grad-comm-dtype fp32 --attention-softmax-in-fp32 --use-checkpoint-opt_param-scheduler "
    "--use-mcore-models --ckpt-format fsdp_dtensor --bf16"
)
# the CI case's ENV_VARS (core_r0.16.0's --deterministic-mode asserts NCCL_ALGO)
RECIPE_ENV = {"ci_gpt3_tp2_zp_z3_resume_fsdp_dtensor": {
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}
# core_r0.16.0's own copy of that CI case is the same without these (0.19's flags)
CI_TP2_Z3_019_ONLY = ("--megatron-fsdp-main-params-dtype fp32 --megatron-fsdp-main-grads-dtype fp32 "
                      "--megatron-fsdp-grad-comm-dtype fp32")
RECIPES = {
    "llama3_8b_zero3": f"{LLAMA3_8B} --data-parallel-sharding-strategy optim_grads_params",
    "llama3_8b_zero2": f"{LLAMA3_8B} --data-parallel-sharding-strategy optim_grads",
    "llama3_8b_zero1": f"{LLAMA3_8B} --data-parallel-sharding-strategy optim",
    # the script's TP_SIZE=2 (its --sequence-parallel dropped: see DROPPED)
    "llama3_8b_tp2": LLAMA3_8B.replace(" --sequence-parallel", "")
    + " --data-parallel-sharding-strategy optim_grads_params --tensor-model-parallel-size 2",
    # the script's commented-out HSDP / HFSDP lines (DP-outer 2)
    "llama3_8b_hsdp": f"{LLAMA3_8B} --data-parallel-sharding-strategy optim_grads_params "
                      "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy no_shard",
    "llama3_8b_hfsdp": f"{LLAMA3_8B} --data-parallel-sharding-strategy optim_grads_params "
                       "--num-distributed-optimizer-instances 2 --outer-dp-sharding-strategy optim",
    "recommended": RECOMMENDED,
    "ci_gpt3_tp2_zp_z3_resume_fsdp_dtensor": CI_TP2_Z3,
    # the flags every published Megatron-FSDP configuration carries (NCCL user buffers: on gloo, accepted with
    # one INFO line and no effect; the numbers must not move)
    "recommended_nccl_ub": f"{RECOMMENDED} --use-nccl-ub --fsdp-manual-registration",
    "recommended_nccl_ub_fine_grained": f"{RECOMMENDED} --use-nccl-ub --fsdp-manual-registration "
                                        "--megatron-fsdp-enable-fine-grained-param-gather",
    "llama3_8b_zero3_nccl_ub": f"{LLAMA3_8B} --data-parallel-sharding-strategy optim_grads_params "
                               "--use-nccl-ub --fsdp-manual-registration",
}
# recipes whose flags Megatron-LM core_r0.16 does not have
SINCE_019 = {"recommended_nccl_ub_fine_grained"}
# published flags left out, and why (docs/megatron.md, "Published recipes")
DROPPED = {
    "--attention-backend fused": "Transformer Engine's fused attention (the local layers have none)",
    "--apply-layernorm-1p": "zero-centred gamma: Transformer Engine's norms only",
    "--cross-entropy-loss-fusion": "a fused CUDA kernel",
    "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather":
        "FP8 is Transformer Engine's",
    "--transformer-impl transformer_engine": "the local layers instead",
    "--sequence-parallel (at TP 2; at TP 1 Megatron-LM turns it off itself)":
        "Megatron's local norms refuse sequence parallelism (Transformer Engine's only)",
    "--async-save --use-persistent-ckpt-worker": "asynchronous saves: left for the GPU (a checkpoint worker process)",
    "--data-path, --vocab-file, --merge-file, --tensorboard-dir and its --log-*-to-tensorboard":
        "data, tokenizer and logs of NVIDIA's cluster: mock data and the null tokenizer instead",
}
# without CUDA only: Megatron's clipping asserts CUDA gradients; its fused kernels are CUDA's
CPU_DROPPED = {"--clip-grad 1.0": "Megatron's clip_grad_norm asserts torch.cuda.FloatTensor gradients"}
CPU_FLAGS = ("--clip-grad 0 --no-masked-softmax-fusion --no-bias-dropout-fusion --no-bias-swiglu-fusion "
             "--no-bias-gelu-fusion --no-rope-fusion")


# ------------------------------------------------------------------ Megatron-LM's set-up
def setup(cmdline: str) -> None:
    """Megatron-LM's own argument parsing and distributed set-up (``initialize_megatron`` minus its kernel builds)."""
    from megatron.training import arguments, global_vars, initialize

    sys.argv = ["pretrain_gpt.py", *cmdline.split()]
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}  # pretrain_gpt.py's
    if hasattr(arguments, "parse_and_validate_args"):  # 0.19
        arguments.parse_and_validate_args(args_defaults=defaults)
    else:
        args = arguments.parse_args()
        arguments.validate_args(args, defaults)
        global_vars.set_global_variables(args)
    args = global_vars.get_args()
    initialize._initialize_distributed(None, None, None)
    initialize._set_random_seed(args.seed, args.data_parallel_random_init, args.te_rng_tracker,
                                args.inference_rng_tracker)


def teardown() -> None:
    """Megatron-LM's global state gone, so the next recipe (or the fresh load) starts clean."""
    from megatron.core import rerun_state_machine

    check._teardown()
    rerun_state_machine.destroy_rerun_state_machine()


def setup_model_and_optimizer():
    """``training.setup_model_and_optimizer`` as ``pretrain`` calls it (it loads ``--load`` too)."""
    from megatron.core.enums import ModelType
    from megatron.training import get_args, training

    args = get_args()
    try:
        from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    except ImportError:  # 0.16: pretrain_gpt.py's model provider, from the tree
        import pretrain_gpt

        provider = partial(pretrain_gpt.model_provider, pretrain_gpt.gpt_builder)
        return training.setup_model_and_optimizer(provider, ModelType.encoder_or_decoder)
    from megatron.core.process_groups_config import ProcessGroupCollection

    cfg = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    return training.setup_model_and_optimizer(ModelType.encoder_or_decoder, cfg_container=cfg,
                                              pg_collection=ProcessGroupCollection.use_mpu_process_groups())


# ------------------------------------------------------------------ data and the forward step
def batches():
    """Random tokens, different on each data-parallel rank and micro-batch, the same on a TP group's ranks."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    args = get_args()
    rank = parallel_state.get_data_parallel_rank()
    step = 0
    while True:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        data = torch.randint(0, VOCAB, (args.micro_batch_size, SEQ + 1), generator=generator)
        step += 1
        yield {"tokens": data[:, :-1], "labels": data[:, 1:], "loss_mask": torch.ones(args.micro_batch_size, SEQ),
               "position_ids": torch.arange(SEQ).unsqueeze(0).expand(args.micro_batch_size, -1)}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """``pretrain_gpt.py``'s contract: the masked token-loss sum, the token count, and the report."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model, *unused, **unused_kwargs):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


# ------------------------------------------------------------------ one recipe
def train(model, optimizer, scheduler) -> int:
    from megatron.core.utils import get_model_config
    from megatron.training import get_args, training

    config = get_model_config(model[0])
    out = training.train(forward_step, model, optimizer, scheduler, batches(), None, None, config, {}, None)
    return out[0] if isinstance(out, tuple) else get_args().iteration


def run_recipe(name: str, folder: Path) -> list[str]:
    from megatron.training import get_args

    from megatron_lm_checkpoint import differences, full_state
    from shardwise.megatron import FullyShardedDataParallelV1, FullyShardedDataParallelV2

    recipe = RECIPES[name]
    if check.megatron_lm_version().startswith("0.16"):
        recipe = recipe.replace(CI_TP2_Z3_019_ONLY, "")
    flags = f"{SCALE} {recipe} --save {folder / name}"
    if not torch.cuda.is_available():
        flags += f" {CPU_FLAGS}"
    setup(flags)
    try:
        model, optimizer, scheduler = setup_model_and_optimizer()
        wrong = [] if all(isinstance(c, (FullyShardedDataParallelV1, FullyShardedDataParallelV2)) for c in model) \
            else [f"chunks are {[type(c).__name__ for c in model]}, not shardwise's"]
        iteration = train(model, optimizer, scheduler)
        if iteration != ITERATIONS:
            wrong.append(f"train ran to iteration {iteration}, not {ITERATIONS}")
        expected = full_state(model, optimizer)
    finally:
        teardown()
    setup(f"{flags} --load {folder / name} --seed 4321")  # another initialization: nothing equal by chance
    try:
        model, optimizer, scheduler = setup_model_and_optimizer()
        if get_args().iteration != ITERATIONS:
            wrong.append(f"load_checkpoint resumed at iteration {get_args().iteration}, saved at {ITERATIONS}")
        wrong += differences(full_state(model, optimizer), expected)
    finally:
        teardown()
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--megatron-lm", type=Path, help="a Megatron-LM tree (core_r0.16 .. core_r0.19)")
    source.add_argument("--wheel", type=Path, help="the unpacked megatron-core wheel (0.19: with megatron/training)")
    parser.add_argument("--folder", type=Path, required=True, help="where the checkpoints go")
    parser.add_argument("--recipes", nargs="*", default=None, choices=list(RECIPES),
                        help="default: every recipe the tree's Megatron-LM has the flags of")
    opts = parser.parse_args()
    tree = (opts.megatron_lm or opts.wheel).resolve()
    folder = opts.folder.resolve()
    check.put_on_path(tree)
    sys.path.insert(1, str(check.REPO))
    if opts.megatron_lm:
        os.chdir(tree)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if opts.recipes is None:
        old = check.megatron_lm_version().startswith("0.16")
        opts.recipes = [name for name in RECIPES if not (old and name in SINCE_019)]
    results = {}
    with check.cuda_on_the_cpu(), check.cuda_tensors_on_the_cpu():
        import megatron.training.training  # noqa: F401  (imported before the added line, as pretrain_gpt.py does)
        from shardwise.megatron import use_in_megatron

        names = use_in_megatron()  # the one added line
        try:
            for name in opts.recipes:
                env = RECIPE_ENV.get(name, {})
                saved_env = {key: os.environ.get(key) for key in env}
                os.environ.update(env)
                try:
                    results[name] = run_recipe(name, folder)
                except (Exception, SystemExit) as error:  # one recipe's failure is its result (argparse exits)
                    results[name] = [f"{type(error).__name__}: {error}", traceback.format_exc()[-3000:]]
                finally:
                    for key, value in saved_env.items():
                        if value is None:
                            os.environ.pop(key, None)
                        else:
                            os.environ[key] = value
        finally:
            names.restore()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        summary = {"megatron_core": check.megatron_lm_version(), "world": dist.get_world_size(),
                   "recipes": {name: sorted({w for rank in gathered for w in rank[name]}) or "ok"
                               for name in opts.recipes}}
        print(json.dumps(summary, sort_keys=True), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
