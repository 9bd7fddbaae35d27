"""Megatron-LM's training step, unchanged, over Megatron's own FSDP adapter or shardwise's face.

Builds Megatron-Core's ``GPTModel`` (local layer spec) under ``Float16Module``,
wraps it with the Megatron-FSDP class Megatron itself imports
(``megatron.core.distributed.FullyShardedDataParallel``; for shardwise after
``shardwise.megatron.use_in_megatron()``), builds the optimizer with
``get_megatron_optimizer`` (distributed optimizer, clipping, weight decay) and
runs Megatron-LM's ``train_step`` in miniature: ``zero_grad_buffer`` and
``optimizer.zero_grad()``, ``get_forward_backward_func()`` over the
micro-batches with ``no_sync_func`` / ``grad_sync_func`` /
``finalize_model_grads``, then ``optimizer.step()`` -> ``(ok, grad_norm, num_zeros)``.
Needs CUDA and megatron-core (0.19.2 tested); one process per GPU under torchrun,
or a plain ``python`` for one GPU. Prints one JSON line (losses, grad norms,
tokens/s, peak memory) and writes it to ``--out``:

    python scripts/megatron_lm_step.py --wrapper shardwise --version 1 --strategy optim_grads_params
    python scripts/megatron_lm_step.py --wrapper megatron --strategy optim

``--pp N`` splits the model over N pipeline stages (``--vpp V``: V virtual chunks per
stage, one wrapper per chunk, bucketing off after the first as Megatron-LM does):
``GPTModel`` per chunk with its ``pre_process`` / ``post_process`` (untied embeddings,
GPTModel's default), and ``get_forward_backward_func()`` then returns Megatron's
pipelined (interleaved) schedule, given per-chunk ``no_sync_func`` / ``grad_sync_func``;
the data-parallel group is each stage's. On 2 GPUs (PP2 x DP1; not run yet), both
wrappers, whose lines in ``pp2.jsonl`` should carry the same losses and grad norms:

    for w in megatron shardwise; do torchrun --nproc-per-node 2 scripts/megatron_lm_step.py --wrapper $w --pp 2 --vpp 2 --layers 4 --hidden 512 --heads 8 --seq 512 --micro-batches 4 --strategy optim_grads_params --out pp2.jsonl; done

``--save-at N --ckpt DIR`` writes the model's and optimizer's DCP state
(``state_dict_for_save_checkpoint()`` and the optimizer's ``fsdp_dtensor``
state dict) after step N; ``--load DIR`` starts from such a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--wrapper", choices=["megatron", "shardwise"], required=True)
    p.add_argument("--version", type=int, default=1, help="shardwise's megatron_fsdp_version (1 or 2)")
    p.add_argument("--strategy", default="optim_grads_params")
    p.add_argument("--instances", type=int, default=1, help="num_distributed_optimizer_instances")
    p.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size")
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per stage (with --pp > 1)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--ckpt", default="")
    p.add_argument("--load", default="")
    p.add_argument("--out", default="")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms, for bit-exact resume checks")
    p.add_argument("--show-keys", action="store_true", help="print sample checkpoint and parameter names")
    p.add_argument("--profile", default="", help="write a chrome trace of the two steps after --warmup here")
    return p.parse_args(argv)


def batches(args, step: int, dp_rank: int, dp_size: int):
    """This data-parallel rank's micro-batches of step ``step`` (random tokens, same on every run)."""
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    size = args.micro_batch * dp_size
    out = []
    for _ in range(args.micro_batches):
        tokens = torch.randint(0, args.vocab, (size, args.seq + 1), generator=g)
        mine = tokens[dp_rank * args.micro_batch:(dp_rank + 1) * args.micro_batch].cuda()
        out.append({"tokens": mine[:, :-1].contiguous(), "labels": mine[:, 1:].contiguous()})
    return out


def build_chunks(args, config, GPTModel, spec, Float16Module):
    """This rank's model chunks: one GPTModel under Float16Module per virtual stage, each with the
    embedding only on the first stage and the output layer only on the last (Megatron-LM's get_model)."""
    from megatron.core import parallel_state

    virtual = args.vpp if args.pp > 1 else 1
    chunks = []
    for v in range(virtual):
        kwargs = {} if virtual == 1 else {"vp_stage": v}
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=virtual == 1, **kwargs)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=virtual == 1, **kwargs)
        model = GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq,
                         pre_process=first, post_process=last, **kwargs)
        chunks.append(Float16Module(config, model))
    return chunks


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if args.pp > 1 and (args.save_at or args.load):
        raise SystemExit(f"--pp {args.pp}: --save-at / --load are written for one chunk (--pp 1) only")
    virtual = args.vpp if args.pp > 1 and args.vpp > 1 else None
    parallel_state.initialize_model_parallel(1, args.pp, virtual_pipeline_model_parallel_size=virtual,
                                             num_distributed_optimizer_instances=args.instances)
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)

    if args.wrapper == "shardwise":
        from shardwise.megatron import use_in_megatron

        use_in_megatron()  # the one line a Megatron-LM user adds

    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn or 4 * args.hidden, bf16=True, params_dtype=torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        pipeline_model_parallel_size=args.pp, virtual_pipeline_model_parallel_size=virtual,
        pipeline_dtype=torch.bfloat16 if args.pp > 1 else None,
    )
    chunks = build_chunks(args, config, GPTModel, get_gpt_layer_local_spec(), Float16Module)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, use_megatron_fsdp=True, overlap_grad_reduce=True, overlap_param_gather=True,
        data_parallel_sharding_strategy=args.strategy, grad_reduce_in_fp32=True,
        num_distributed_optimizer_instances=args.instances,
        megatron_fsdp_main_params_dtype=torch.float32, megatron_fsdp_main_grads_dtype=torch.float32,
    )
    if args.wrapper == "shardwise":
        ddp_config.megatron_fsdp_version = args.version  # the next release's field; 0.19 has none
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    chunks = [FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=v > 0,
                                       pg_collection=pg_collection) for v, chunk in enumerate(chunks)]
    model = chunks[0]
    wrapper_class = f"{type(model).__module__}.{type(model).__name__}"

    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr, weight_decay=0.1, adam_beta1=0.9,
                        adam_beta2=0.95, clip_grad=1.0, bf16=True, use_distributed_optimizer=True),
        chunks,
    )
    # Megatron-LM's train(): one function per chunk, or the function itself for one chunk
    per_chunk = (lambda name: [getattr(c, name) for c in chunks] if len(chunks) > 1 else getattr(model, name))
    config.no_sync_func = per_chunk("no_sync")
    config.grad_sync_func = per_chunk("start_grad_sync")
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()

    dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_rank, dp_size = dist.get_rank(dp), dist.get_world_size(dp)
    position_ids = torch.arange(args.seq, device="cuda").unsqueeze(0)
    attention_mask = torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool, device="cuda").triu(1)  # True = masked

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)  # a later stage's GPTModel reads its input from the schedule instead
        per_token = chunk(batch["tokens"], position_ids, attention_mask, labels=batch["labels"])

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"lm loss": loss.detach()}

        return per_token, loss_func

    if args.show_keys and dist.get_rank() == 0:
        names = [n for n, _ in model.named_parameters()]
        state = model.state_dict_for_save_checkpoint()
        print("KEYS params", names[:3], "state", list(state)[:3], type(next(iter(state.values()))).__name__)
    start_step = 0
    if args.load:
        start_step = load_checkpoint(args.load, model, optimizer)

    losses, grad_norms, step_times, phase_times = [], [], [], []
    profiler = None
    torch.cuda.reset_peak_memory_stats()
    for step in range(start_step, args.steps):
        if args.profile and step == start_step + args.warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
            profiler.start()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for chunk in chunks:  # Megatron-LM's train_step
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        data = [iter(batches(args, step, dp_rank, dp_size)) for _ in chunks]
        out = forward_backward(
            forward_step_func=forward_step, data_iterator=data if len(chunks) > 1 else data[0], model=chunks,
            num_microbatches=args.micro_batches, seq_length=args.seq, micro_batch_size=args.micro_batch,
            forward_only=False,
        )
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        ok, grad_norm, num_zeros = optimizer.step()
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        phase_times.append((t1 - t0, step_times[-1] - (t1 - t0)))
        if profiler is not None and step == start_step + args.warmup + 1:
            profiler.stop()
            if dist.get_rank() == 0:
                profiler.export_chrome_trace(args.profile)
            profiler = None
        # only the last stage has the losses: the mean over its data ranks, then to every stage
        loss = torch.stack([o["lm loss"] for o in out]).mean() if out else torch.zeros((), device="cuda")
        dist.all_reduce(loss, group=dp)
        if args.pp > 1:
            dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
        losses.append(loss.item() / dp_size)
        grad_norms.append(float(grad_norm))
        assert ok, f"step {step}: optimizer.step() reported a failed update"
        if args.save_at and step + 1 == args.save_at:
            save_checkpoint(args.ckpt, model, optimizer, step + 1)

    first_timed = args.warmup + (2 if args.profile else 0)  # profiled steps are slower: not timed
    timed = step_times[first_timed:] or step_times
    phases = phase_times[first_timed:] or phase_times
    tokens = args.micro_batch * args.micro_batches * args.seq / args.pp  # a stage holds 1/pp of the model
    result = {
        "wrapper": args.wrapper if args.wrapper == "megatron" else f"shardwise-v{args.version}",
        "class": wrapper_class, "strategy": args.strategy, "instances": args.instances, "world": dist.get_world_size(),
        "pp": args.pp, "vpp": len(chunks),
        "layers": args.layers, "hidden": args.hidden, "seq": args.seq, "start_step": start_step,
        "tokens_per_s_per_gpu": round(tokens * len(timed) / sum(timed), 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        # where a step goes (synchronized between them, so a little slower than an unprofiled step)
        "forward_backward_s": round(sum(f for f, _ in phases) / len(phases), 4),
        "optimizer_step_s": round(sum(o for _, o in phases) / len(phases), 4),
        "losses": losses, "grad_norms": grad_norms,  # full precision: resume checks compare bits
    }
    if dist.get_rank() == 0:  # the losses are every stage's; tokens/s and memory are rank 0's (first stage)
        print("RESULT " + json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    return result


def _checkpoint_state(model, optimizer, loading: bool) -> dict:
    """Megatron-LM's ``fsdp_dtensor`` state (``checkpointing.py``): the chunk's
    ``state_dict_for_save_checkpoint()`` and the optimizer's ``fsdp_dtensor`` state dict, with
    Megatron-FSDP's uneven-DTensor chunk metadata added, as Megatron-LM does before DCP."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    state = {"model": model.state_dict_for_save_checkpoint(),
             "optimizer": optimizer.sharded_state_dict({}, is_loading=loading,
                                                      metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})}
    raw = {"model": dict(state["model"]), "optimizer": dict(state["optimizer"])}
    preprocess_state_dict_for_uneven_dtensor(state)
    return state, raw


def save_checkpoint(folder, model, optimizer, step):
    import torch.distributed.checkpoint as dcp

    state, _ = _checkpoint_state(model, optimizer, loading=False)
    dcp.save(state, checkpoint_id=os.path.join(folder, f"step_{step}"))
    if dist.get_rank() == 0:
        with open(os.path.join(folder, "latest"), "w") as f:
            f.write(str(step))


def load_checkpoint(folder, model, optimizer) -> int:
    import torch.distributed.checkpoint as dcp

    step = int(open(os.path.join(folder, "latest")).read())
    state, raw = _checkpoint_state(model, optimizer, loading=True)
    dcp.load(state, checkpoint_id=os.path.join(folder, f"step_{step}"))  # in place, into the DTensors
    try:  # Megatron-LM's load_model_state_dict: strict, then (on an error) not strict
        model.load_state_dict(raw["model"], strict=True)
    except Exception as err:  # noqa: BLE001
        print(f"strict model load failed ({type(err).__name__}: {str(err)[:200]}); loading with strict=False")
        model.load_state_dict(raw["model"], strict=False)
    optimizer.load_state_dict(raw["optimizer"])
    return step


if __name__ == "__main__":
    main()
    from shardwise import destroy_process_groups

    destroy_process_groups()
