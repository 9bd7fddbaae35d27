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
   run's bit for bit, at the saved iteration;
4. for the MoE recipes, another fresh load at each expert-parallel size of :data:`LOAD_EP`:
   every expert (by its global index) and optimizer-state tensor equal to the trained run's.

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
import contextlib
import gc
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
# examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (core_r0.19.0), USE_MEGATRON_FSDP=1, scaled: EP2 (EP=8),
# 4 experts top-2 in 2 groups (256 top-8 in 8), the first layer dense as its first 3 of 61 (MLA: see DROPPED)
DEEPSEEK_V3 = (
    "--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 2 "
    "--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce "
    "--overlap-param-gather --use-mcore-models --sequence-parallel --disable-bias-linear "
    f"--train-samples {8 * ITERATIONS} --exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad --manual-gc "
    "--manual-gc-interval 10 --recompute-granularity selective --recompute-modules mlp moe "
    "--tokenizer-type NullTokenizer --split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader "
    "--num-workers 1 --ffn-hidden-size 448 --num-attention-heads 4 --kv-channels 32 --position-embedding-type rope "
    "--rotary-base 10000 --make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu "
    "--untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 "
    "--clip-grad 1.0 --weight-decay 0.1 --qk-layernorm --lr-decay-samples 12 --lr-warmup-samples 4 "
    "--lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 "
    "--num-experts 4 --moe-layer-freq [0]*1+[1]*1 --moe-ffn-hidden-size 64 --moe-shared-expert-intermediate-size 64 "
    "--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
    "--moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 1 "
    "--moe-router-num-groups 2 --moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 "
    "--moe-router-force-load-balancing --mtp-num-layers 1 "
    "--mtp-loss-scaling-factor 0.1 --auto-detect-ckpt-format --dist-ckpt-strictness log_all --init-method-std 0.02 "
    "--log-num-zeros-in-grad --log-params-norm --log-throughput --logging-level 40 --bf16 --enable-experimental "
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion "
    "--calculate-per-token-loss --init-model-with-meta-device --ckpt-format fsdp_dtensor --fsdp-double-buffer "
    "--use-nccl-ub --megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16"
)
# examples/mixtral/train_mixtral_8x7b_distributed.sh (core_r0.19.0) with the docs' recommended Megatron-FSDP flags
# (NVIDIA publishes no Mixtral Megatron-FSDP script), scaled: 4 experts top-2 (8), EP2 (8), PP1 (4: see DROPPED)
MIXTRAL_8X7B = (
    "--use-mcore-models --disable-bias-linear --ffn-hidden-size 448 --num-attention-heads 4 --init-method-std 0.01 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu "
    "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion "
    "--no-position-embedding --rotary-base 1000000 "
    "--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
    "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce "
    "--tokenizer-type NullTokenizer --split 99990,8,2 "
    f"--lr 1e-4 --train-iters {ITERATIONS} --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 "
    "--weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16 "
    "--tensor-model-parallel-size 1 --expert-model-parallel-size 2 --use-distributed-optimizer --sequence-parallel "
    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor "
    "--no-gradient-accumulation-fusion --init-model-with-meta-device --calculate-per-token-loss "
    "--grad-reduce-in-bf16 --fsdp-double-buffer"
)
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
    "deepseek_v3_ep2": DEEPSEEK_V3,
    "mixtral_8x7b_ep2": MIXTRAL_8X7B,
}
# after the resume, the MoE recipes' checkpoints are loaded again at these expert-parallel sizes (Megatron-LM's
# handle_experts_in_state_dict keys experts by their global index): the same experts, the same optimizer state
LOAD_EP = {"deepseek_v3_ep2": (1, 4), "mixtral_8x7b_ep2": (1,)}
# left out on core_r0.16: flags it does not have (its DeepSeek-V3 script is 0.19's), and --moe-grouped-gemm, for
# which 0.16's local layers build the legacy GroupedMLP (it needs the grouped_gemm CUDA package; 0.19's local
# layers build SequentialMLP)
NOT_IN_016 = (CI_TP2_Z3_019_ONLY, "--megatron-fsdp-grad-comm-dtype bf16 --megatron-fsdp-main-grads-dtype bf16",
              "--moe-grouped-gemm")
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
    "--tokenizer-model, --data-cache-path, --wandb-*, --profile*, --eval-iters, --eval-interval, "
    "--save-interval, --load, --save": "NVIDIA's cluster and schedule: the runner's scaled ones instead",
    # the MoE recipes (DeepSeek-V3, Mixtral)
    "--multi-latent-attention --q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim "
    "--rotary-scaling-factor --mscale --mscale-all-dim, and mla_up_proj in --recompute-modules":
        "Megatron-Core's MLA needs Transformer Engine's attention: the local DotProductAttention takes no "
        "k_channels (TypeError at build)",
    "layernorm in --recompute-modules": "its CheckpointWithoutOutput reads Transformer Engine's "
                                        "FP8GlobalStateManager (NameError without it)",
    "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep":
        "DeepEP / HybridEP GPU kernels: alltoall instead, as Megatron's DeepSeek proxy Megatron-FSDP CI case",
    "--moe-permute-fusion": "Transformer Engine's fused permutation",
    "--use-flash-attn": "flash-attn's CUDA kernels",
    "--pipeline-model-parallel-size 4 (Mixtral)":
        "fsdp_dtensor checkpoints key layers by their index within the stage (state_dict_for_save_checkpoint): "
        "at PP2 both stages write decoder.layers.0 and the second resumes with the first's (measured); "
        "Megatron-FSDP itself has no pipeline stages",
    "--no-load-optim --no-load-rng (Mixtral)": "the script starts from a converted checkpoint; a resume loads both",
}
# without CUDA only: Megatron's clipping asserts CUDA gradients; its fused kernels are CUDA's
CPU_DROPPED = {
    "--clip-grad 1.0": "Megatron's clip_grad_norm asserts torch.cuda.FloatTensor gradients",
    "--moe-token-dispatcher-type alltoall": "its dispatcher records a CUDA event on the stream "
                                           "(torch.cpu.Stream.record_event() returns None): allgather instead",
    "torch.compile of Megatron's jit_fuser functions (the router's expert-bias update)":
        "inductor reads a GPU's properties; torch._dynamo is turned off, the functions run eagerly",
}
CPU_FLAGS = ("--clip-grad 0 --no-masked-softmax-fusion --no-bias-dropout-fusion --no-bias-swiglu-fusion "
             "--no-bias-gelu-fusion --no-rope-fusion --moe-token-dispatcher-type allgather")


# ------------------------------------------------------------------ Megatron-LM's set-up
def setup(cmdline: str) -> None:
    """Megatron-LM's own argument parsing and distributed set-up for one recipe's flags."""
    check.parse_and_initialize(cmdline.split())


# (ranks, backend, timeout, ...) -> the group made for it: see megatron_lm_check.shared_process_groups
SHARED_GROUPS: dict = {}


@contextlib.contextmanager
def field_docstrings_read_once():
    """Megatron-LM 0.19's ``parse_args`` reads each config dataclass's help texts from its source
    (``ArgumentGroupFactory._get_field_docstrings``: ``inspect.getsource`` and ``ast.parse``, about 0.12 s of
    CPU a set-up, ~30 set-ups a run): here each class's are read once and handed out again (a copy each time).
    The parsed values do not depend on them. 0.16 has no such factory: nothing is changed.
    """
    try:
        from megatron.training.argument_utils import ArgumentGroupFactory
    except ImportError:
        yield
        return
    read = ArgumentGroupFactory._get_field_docstrings
    cache: dict = {}

    def field_docstrings(self, src_cfg_class: type) -> dict:
        if src_cfg_class not in cache:
            cache[src_cfg_class] = read(self, src_cfg_class)
        return dict(cache[src_cfg_class])

    ArgumentGroupFactory._get_field_docstrings = field_docstrings
    try:
        yield
    finally:
        ArgumentGroupFactory._get_field_docstrings = read


def teardown() -> None:
    """Megatron-LM's global state gone, so the next recipe (or the fresh load) starts clean, and the process
    groups not shared (``megatron_lm_check.shared_process_groups``) destroyed with their threads.

    ``destroy_model_parallel`` only forgets Megatron's groups: each set-up's dozens of groups (gloo copies
    included) kept their threads: ~30 set-ups piled up about 1,800 per rank, which slowed everything beside the
    run. Destroying them alone made the next set-up fail with "Could not resolve the process group
    registered under the name N": DTensor's sharding-propagation cache keeps output specs whose DeviceMesh
    holds the destroyed groups' names, and a mesh of the next set-up over the same ranks compares equal to
    it (DeviceMesh equality leaves the groups out), so an op on the new model's parameters got the old mesh
    back. The cache is cleared with the groups. shardwise's Megatron face forgets the groups it keeps for
    reuse (its single-rank group for a parameter without a TP axis, ``build_process_groups``'s), so that
    the next set-up asks for them again. A destroyed group's threads end when its last reference goes (the
    model's meshes, in reference cycles): at Python's next collection, not forced here (a ``gc.collect()`` per
    teardown cost more CPU than the threads it ended sooner). Without CUDA the groups ``new_group`` makes are
    shared and kept to the end (:data:`SHARED_GROUPS`); only others (one made with ``pg_options``) are
    destroyed here.
    """
    from megatron.core import rerun_state_machine
    from torch.distributed import distributed_c10d
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from shardwise.megatron import dist_index, process_groups

    check._teardown()
    rerun_state_machine.destroy_rerun_state_machine()
    keep = [distributed_c10d._get_default_group(), *SHARED_GROUPS.values()]
    for group in [g for g in distributed_c10d._world.pg_map if not any(g is k for k in keep)]:
        dist.destroy_process_group(group)
    _clear_sharding_prop_cache()
    dist_index._OWN_GROUPS.clear()
    process_groups._GROUP_CACHE.clear()


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
def all_experts(state: dict) -> dict:
    """The full state with each local expert under its global index (the model's local keys renamed as
    ``handle_experts_in_state_dict`` does), every rank's experts on every rank."""
    import re

    from megatron.core import parallel_state
    from megatron.training import get_args

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local = get_args().num_experts // parallel_state.get_expert_model_parallel_world_size()

    def rename(key: str) -> str:
        return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m[1]) + ep_rank * local}.", key)

    # the optimizer's fsdp_dtensor state is keyed by global expert index already
    mine = {"model": {rename(k): v for k, v in state["model"].items()}, "optimizer": state["optimizer"]}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged = {"model": {}, "optimizer": {}}
    for rank_state in gathered:
        for part in merged:
            for key, value in rank_state[part].items():
                merged[part].setdefault(key, value)
    return merged



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
        for missing in NOT_IN_016:
            recipe = recipe.replace(missing, "")
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
        if LOAD_EP.get(name):
            expected = all_experts(expected)
    finally:
        teardown()
    for ep in LOAD_EP.get(name, ()):  # the same checkpoint at another expert-parallel size
        setup(f"{flags} --load {folder / name} --seed 4321 --expert-model-parallel-size {ep}")
        try:
            model, optimizer, scheduler = setup_model_and_optimizer()
            wrong += [f"loaded at EP{ep}: {w}" for w in differences(all_experts(full_state(model, optimizer)),
                                                                      expected)]
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
    if not torch.cuda.is_available():  # Megatron's jit_fuser (torch.compile) functions run eagerly: see CPU_DROPPED
        torch._dynamo.config.disable = True
    if opts.recipes is None:
        old = check.megatron_lm_version().startswith("0.16")
        opts.recipes = [name for name in RECIPES if not (old and name in SINCE_019)]
    results = {}
    with check.cuda_on_the_cpu(), check.cuda_tensors_on_the_cpu(), check.shared_process_groups(SHARED_GROUPS):
        import megatron.training.training  # noqa: F401  (imported before the added line, as pretrain_gpt.py does)
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # 0.16's router reads it, undefined without TE (0.19: None)
            moe_utils.te_general_gemm = None
        from shardwise.megatron import use_in_megatron

        names = use_in_megatron()  # the one added line
        # what is loaded now lives to the end: out of the collector's reach, so that Megatron-LM's gc.collect()
        # (--manual-gc: at every train's start, the collector then off for the rest of the run) walks only what
        # the set-ups made, not the objects of torch's and Megatron-LM's modules
        gc.freeze()
        try:
            with field_docstrings_read_once():
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
            gc.unfreeze()
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
    # nothing is left to write: the interpreter's own clean-up (torch's operator libraries' finalizers, the
    # modules' teardown) would cost about 1.5 s of CPU a rank
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
