"""One GPU: a training step captured in a CUDA graph (``shardwise.capture_step``) against the same steps eager.

Check mode (default): for each case (ZeRO-1/2/3, HSDP on a (1, 1) mesh; activation checkpointing,
gradient accumulation 2, clipping folded into the fused AdamW step, bf16; ``--fp8``: torchao
tensorwise linears, and ZeRO-3 with the FP8 weight gather), three models from one seed train ``--steps``
steps on the same batches: graph_safe=False eager, graph_safe=True eager, and through ``capture_step``
(its first step the eager warm-up, the rest replays). Writes the max abs differences of the losses,
grads and weights (bit-exact expected: the same kernels) and ms/step of each after them.

Bench mode (``--bench``): the 0.9b size of ``shardwise bench``, layers compiled, bf16, fused AdamW:
shardwise ZeRO-3 eager (graph_safe off, on) vs graphed, the ceiling (``none``) eager vs graphed, tokens/s.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --nproc-per-node 1 scripts/cuda_graph_check.py --out $OUT/graphs.json [--fp8] [--compile]
    torchrun --nproc-per-node 1 scripts/cuda_graph_check.py --bench --out $OUT/graphs-bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shardwise  # noqa: E402
from shardwise.models import GPT, GPTConfig  # noqa: E402

DEVICE = "cuda"  # every tensor and model of the script lives here
SMALL = dict(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, max_seq_len=512)  # train's "small"
CASES = [  # name, strategy, HSDP, activation checkpointing, grad accumulation, clip
    ("zero1", "optim", False, False, 1, False),
    ("zero2-acc2-clip", "optim_grads", False, False, 2, True),
    ("zero3-ckpt-acc2-clip", "optim_grads_params", False, True, 2, True),
    ("zero3", "optim_grads_params", False, False, 1, False),
    ("hsdp-ckpt-acc2-clip", "optim_grads_params", True, True, 2, True),
]
# bf16 main grads next to fp32 main weights (Megatron-Core 0.19's default under Megatron-LM), so .grad is a cast
# copy, with every micro-batch syncing and adding to it (Megatron-LM's schedule without --overlap-grad-reduce)
CAST_GRAD_CASES = [
    ("zero1-acc2-sync-bf16grads", "optim", False, False, 2, False),
    ("zero3-acc2-sync-clip-bf16grads", "optim_grads_params", False, False, 2, True),
]


def _init() -> torch.device:
    alone = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    for key, value in alone.items():  # started without torchrun: one process
        os.environ.setdefault(key, value)
    # captured NCCL work is not watched by the watchdog thread (torch's CUDA-graph notes for DDP say so too)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    if not torch.cuda.is_available():
        raise SystemExit("cuda_graph_check.py needs a CUDA GPU (CUDA graphs capture GPU work)")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    return torch.device("cuda", torch.cuda.current_device())


def _release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _build(config: GPTConfig, strategy: str, hsdp: bool, fp8: str, fp8_gather: bool, compile_: bool, seed: int,
           graph_safe: bool = True, cast_grads: bool = False):
    torch.manual_seed(seed)
    with torch.device(DEVICE):
        model = GPT(config)
    if fp8:
        shardwise.convert_to_fp8(model, fp8, all_gather=fp8_gather)
    layer_types = list(dict.fromkeys(type(layer) for layer in model.layers))
    mesh = shardwise.build_dp_mesh(outer=1, device_type=DEVICE) if hsdp else None
    model = shardwise.fully_shard(
        model, mesh=mesh, strategy=strategy, outer_dp_sharding_strategy="no_shard" if hsdp else None,
        unit_modules=layer_types + [model.embed, model.output],
        mixed_precision=shardwise.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, **({"main_grads_dtype": torch.bfloat16} if cast_grads else {})),
        graph_safe=graph_safe)
    if compile_:
        shardwise.compile_units(model, modules=layer_types, backend="inductor")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    return model, optimizer


def _step_fn(model, optimizer, accum: int, clip: bool, sync_each: bool = False):
    """One whole step: every micro-batch (``no_sync`` but the last, or each syncing), (clipping,) the optimizer;
    returns (summed loss, grad norm)."""
    params = list(model.parameters())

    def step(tokens: torch.Tensor):
        optimizer.zero_grad(set_to_none=True)  # the captured step then overwrites the grads, as eager does
        loss_sum = torch.zeros((), device=tokens.device)
        for micro in range(accum):
            last = micro == accum - 1
            with contextlib.nullcontext() if last or sync_each else model.no_sync():
                loss = model(tokens[micro, :, :-1], tokens[micro, :, 1:]) / accum
                loss.backward()
            loss_sum += loss.detach().float()
        norm = (shardwise.clip_grad_norm_(params, 1.0, optimizer=optimizer) if clip
                else torch.zeros((), device=tokens.device))
        optimizer.step()
        return loss_sum, norm
    return step


def _batches(steps: int, accum: int, micro_batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (accum, micro_batch, seq + 1), generator=g).to(DEVICE) for _ in range(steps)]


def _grads(model) -> dict:
    return {n: p.grad.full_tensor().float() for n, p in model.named_parameters() if p.grad is not None}


def _weights(model) -> dict:
    return {n: p.full_tensor().float() for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(((a[k] - b[k]).abs().max().item() for k in a), default=0.0)


def _ms_per_step(fn, steps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def check_case(name, strategy, hsdp, ckpt, accum, clip, args, fp8="", fp8_gather=False, cast_grads=False) -> dict:
    config = GPTConfig(**SMALL, activation_checkpointing=ckpt)
    batches = _batches(args.steps, accum, args.micro_batch, args.seq, config.vocab_size)
    runs = {}
    for mode in ("normal", "eager", "graphed"):  # normal: graph_safe=False, eager: graph_safe=True
        _release()
        model, optimizer = _build(config, strategy, hsdp, fp8, fp8_gather, args.compile, seed=0,
                                  graph_safe=mode != "normal", cast_grads=cast_grads)
        step = _step_fn(model, optimizer, accum, clip, sync_each=cast_grads)
        t0 = time.perf_counter()
        if mode != "graphed":
            outs = [tuple(t.clone() for t in step(b)) for b in batches]
            timed = lambda: step(batches[-1])  # noqa: E731
        else:
            graphed = shardwise.capture_step(step, (batches[0],), models=model, num_warmup_iters=1)
            outs = [tuple(t.clone() for t in graphed.warmup_outputs[0])]
            outs += [tuple(t.clone() for t in graphed(b)) for b in batches[1:]]
            timed = lambda: graphed(batches[-1])  # noqa: E731
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        runs[mode] = dict(losses=[o[0].item() for o in outs], norms=[o[1].item() for o in outs],
                          grads=_grads(model), weights=_weights(model), first_s=first_s)
        runs[mode]["ms_per_step"] = _ms_per_step(timed, args.timed_steps)
        runs[mode]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del model, optimizer, step, timed
        if mode == "graphed":
            del graphed
    normal, eager, graphed = runs["normal"], runs["eager"], runs["graphed"]
    result = {
        "case": name, "strategy": strategy, "hsdp": hsdp, "activation_checkpointing": ckpt, "grad_accum": accum,
        "clip": clip, "bf16_main_grads_syncing_micro_batches": cast_grads, "fp8": fp8 or None, "fp8_all_gather": fp8_gather, "compiled": args.compile,
        "losses_eager": eager["losses"], "losses_graphed": graphed["losses"],
        "max_abs_diff_loss": max(abs(a - b) for a, b in zip(eager["losses"], graphed["losses"])),
        "max_abs_diff_norm": max(abs(a - b) for a, b in zip(eager["norms"], graphed["norms"])),
        "max_abs_diff_grads": _max_diff(eager["grads"], graphed["grads"]),
        "max_abs_diff_weights": _max_diff(eager["weights"], graphed["weights"]),
        "max_abs_diff_loss_vs_normal_mode": max(abs(a - b) for a, b in zip(normal["losses"], graphed["losses"])),
        "max_abs_diff_weights_vs_normal_mode": _max_diff(normal["weights"], graphed["weights"]),
        "ms_per_step_normal_mode": normal["ms_per_step"], "peak_gib_normal_mode": normal["peak_gib"],
        "weights_moved": _max_diff(eager["weights"], _weights_at_start(config)),
        "ms_per_step_eager": eager["ms_per_step"], "ms_per_step_graphed": graphed["ms_per_step"],
        "speedup": eager["ms_per_step"] / graphed["ms_per_step"],
        "first_step_s_eager": eager["first_s"] / args.steps, "capture_and_first_step_s": graphed["first_s"],
        "peak_gib_eager": eager["peak_gib"], "peak_gib_graphed": graphed["peak_gib"],
    }
    result["bit_exact"] = all(result[k] == 0 for k in ("max_abs_diff_loss", "max_abs_diff_norm",
                                                       "max_abs_diff_grads", "max_abs_diff_weights",
                                                       "max_abs_diff_loss_vs_normal_mode",
                                                       "max_abs_diff_weights_vs_normal_mode"))
    return result


def _weights_at_start(config) -> dict:
    """The initial weights (the steps must have moved them: a graph that replays nothing would not)."""
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = GPT(config)
    return {n: p.detach().float() for n, p in model.named_parameters()}


def bench(args) -> list[dict]:
    """As ``shardwise bench --sizes 0.9b --wrappers shardwise,none --compile --cuda-graphs off,on`` (the same
    wrappers and graphed step), timed with CUDA events over ``--bench-steps`` steps after 3."""
    from shardwise.app.bench.graphs import graphed_step
    from shardwise.app.bench.runner import _make_batches, _train_step
    from shardwise.app.bench.sizes import SIZES, model_config
    from shardwise.app.bench.wrappers import WRAPPERS

    device = torch.device("cuda", torch.cuda.current_device())
    size = SIZES["0.9b"]
    config, seq, micro_batch = model_config(size), size.seq_len, size.micro_batch
    config.max_seq_len = max(config.max_seq_len, seq)
    batches = _make_batches(config.vocab_size, micro_batch, seq, args.bench_steps + 4, 0, 0, device)
    compile_kwargs = {"backend": "inductor", "fullgraph": True, "dynamic": False}
    results = []
    runs = [("shardwise", False, False, False), ("shardwise", True, False, False), ("shardwise", True, True, False),
            ("none", False, False, False), ("none", False, True, False)]
    if args.bf16_main:  # the ceiling's recipe under shardwise too: bf16 main weights, grads and AdamW state
        runs += [("shardwise", False, False, True), ("shardwise", True, True, True)]
    for wrapper, graph_safe, graphs, bf16_main in runs:
        _release()
        row = {"size": "0.9b", "wrapper": wrapper, "graph_safe": graph_safe, "cuda_graphs": graphs,
               "bf16_main": bf16_main, "seq_len": seq, "micro_batch": micro_batch, "compiled": True}
        try:
            torch.manual_seed(0)
            with torch.device(device):
                model = GPT(config)
            extra = {"graph_safe": graph_safe, "bf16_main": bf16_main} if wrapper == "shardwise" else {}
            model, optimizer = WRAPPERS[wrapper](model, device, compile=compile_kwargs, **extra)
            if graphs:
                step, _ = graphed_step(model, optimizer, None, batches[0])
            else:
                step = lambda batch: _train_step(model, optimizer, batch)  # noqa: E731
                step(batches[0])
            for b in batches[1:4]:
                step(b)
            i = iter(batches[4:])
            ms = _ms_per_step(lambda: step(next(i)), args.bench_steps)
            row.update(status="ok", ms_per_step=ms, tokens_per_s=micro_batch * seq / ms * 1e3,
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30)
            del model, optimizer, step
        except Exception as e:  # noqa: BLE001 - recorded; the other runs still go
            traceback.print_exc()
            row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:500])
        print(json.dumps(row), flush=True)
        results.append(row)
    ceilings = [r["tokens_per_s"] for r in results if r["wrapper"] == "none" and r.get("tokens_per_s")]
    eager_ceiling = next((r["tokens_per_s"] for r in results if r["wrapper"] == "none" and not r["cuda_graphs"]
                          and r.get("tokens_per_s")), None)
    for r in results:
        if r.get("tokens_per_s") and ceilings:
            r["vs_best_ceiling"] = r["tokens_per_s"] / max(ceilings)
            r["vs_eager_ceiling"] = r["tokens_per_s"] / eager_ceiling if eager_ceiling else None
    return results


def _write(path: str, out: dict) -> None:
    if dist.get_rank() == 0:  # every rank computed the same; one writes
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=2) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--steps", type=int, default=5, help="steps compared (the first is the eager warm-up)")
    p.add_argument("--timed-steps", type=int, default=20)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--fp8", action="store_true", help="also the cases with torchao tensorwise FP8 linears")
    p.add_argument("--compile", action="store_true", help="each layer compiled (inductor) in the check cases")
    p.add_argument("--cases", default="", help="comma list of case names (default: all)")
    p.add_argument("--bench", action="store_true", help="the 0.9b benchmark instead of the check")
    p.add_argument("--bench-steps", type=int, default=10)
    p.add_argument("--bf16-main", action="store_true",
                   help="with --bench: shardwise with bf16 main weights too (the ceiling's numerical recipe)")
    args = p.parse_args()
    _init()
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": []}
    if args.bench:
        out["results"] = bench(args)
    else:
        todo = [(c, "", False, False) for c in CASES] + [(c, "", False, True) for c in CAST_GRAD_CASES]
        if args.fp8:
            todo += [(CASES[2], "tensorwise", False, False), (CASES[2], "tensorwise", True, False),
                     (CASES[1], "tensorwise", False, False)]
        chosen = set(filter(None, args.cases.split(",")))
        for case, fp8, gather, cast_grads in todo:
            if chosen and case[0] not in chosen:
                continue
            label = case[0] + (f"-fp8-{fp8}{'-gather' if gather else ''}" if fp8 else "")
            try:
                row = check_case(label, *case[1:], args, fp8=fp8, fp8_gather=gather, cast_grads=cast_grads)
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - recorded; the other cases still run
                traceback.print_exc()
                row = {"case": label, "status": "failed", "reason": f"{type(e).__name__}: {e}"[:500]}
            if dist.get_rank() == 0:
                print(json.dumps({k: v for k, v in row.items() if not k.startswith("losses")}), flush=True)
            out["results"].append(row)
            _write(args.out, out)
    _write(args.out, out)
    dist.destroy_process_group()
    return 0 if all(r.get("status") == "ok" for r in out["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
