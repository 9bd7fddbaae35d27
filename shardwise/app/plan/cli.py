"""``shardwise plan``: which configuration to run, before renting the GPUs.

    shardwise plan --preset 8b --gpus 8 --gpu H100 --seq 4096
    shardwise plan --num-layers 80 --hidden-size 8192 --num-attention-heads 64 --num-query-groups 8 \\
        --ffn-hidden-size 28672 --vocab-size 128256 --gpus 64 --seq 8192 --global-batch 128
    shardwise plan --hf-config path/to/llama --gpus 512 --gpu H200 --json
    shardwise plan --calibrate [--calibration runs/plan/calibration.json]   # this machine's numbers
    shardwise plan --preset tiny --gpus 64 --seq 128 --dry-run   # and real steps of rank 0 here

Prints every candidate ranked (per-GPU peak memory, step time, tokens/s/GPU, MFU, the dominant term), the
recommended one and why; ``--json`` prints the same as JSON. ``docs/plan.md`` explains the model.
"""

from __future__ import annotations

import argparse
import sys

from ...engine.placements import OUTER_STRATEGY_PLACEMENTS, outer_strategy_choices
from .candidates import STRATEGIES
from .hardware import GPUS

__all__ = ["build_parser", "main", "DEFAULT_CALIBRATION"]

DEFAULT_CALIBRATION = "runs/plan/calibration.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardwise plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    model = p.add_argument_group("model (one of)")
    model.add_argument("--preset", help="a shardwise train preset (tiny, small, 1b, 8b, ...)")
    model.add_argument("--hf-config", help="a Hugging Face config folder or config.json (Llama/Mistral/Mixtral)")
    model.add_argument("--num-layers", type=int)
    model.add_argument("--hidden-size", type=int)
    model.add_argument("--num-attention-heads", type=int)
    model.add_argument("--num-query-groups", type=int, help="key/value heads (default: attention heads)")
    model.add_argument("--ffn-hidden-size", type=int)
    model.add_argument("--vocab-size", type=int)
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=int, help="GPUs in all")
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--gpu", default="H100",
                         help=f"{', '.join(GPUS)} or custom:bf16=TFLOPS,fp8=TFLOPS,hbm=GiB,hbm_bw=TB/s,nvlink=GB/s,"
                              "net=GB/s (a named GPU with changes: H100:net=90)")
    shape = p.add_argument_group("training shape")
    shape.add_argument("--seq", type=int, default=4096, help="sequence length (tokens)")
    shape.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: one per GPU)")
    shape.add_argument("--micro-batch", type=int, action="append",
                       help="micro-batch sizes to weigh (repeatable; default: every power of 2 that divides)")
    choice = p.add_argument_group("what to weigh")
    choice.add_argument("--eager", action="store_true", help="uncompiled layers (default: compiled)")
    choice.add_argument("--offload", action="store_true", help="also weigh CPU offload (fractions 0.5, 1)")
    choice.add_argument("--no-fp8", action="store_true", help="leave out FP8 compute (with and without the FP8 gather)")
    choice.add_argument("--no-hybrid", action="store_true", help="leave out HSDP / HFSDP")
    choice.add_argument("--strategy", action="append", choices=list(STRATEGIES),
                        help="weigh only these ZeRO stages (repeatable; HSDP/HFSDP are optim_grads_params)")
    choice.add_argument("--activation-checkpointing", choices=["on", "off", "both"], default="both")
    choice.add_argument("--reshard-after-forward", choices=["on", "off", "both"], default="both")
    choice.add_argument("--replicas", type=int, help="weigh only this HSDP/HFSDP replica count (1: none)")
    choice.add_argument("--outer-strategy", choices=list(OUTER_STRATEGY_PLACEMENTS),
                        help=f"weigh only this one among the hybrid layouts ({outer_strategy_choices()})")
    dry = p.add_argument_group("dry run (docs/plan.md, \"The dry run\")")
    dry.add_argument("--dry-run", action="store_true",
                     help="then run a few real steps of rank 0 of the recommended configuration on this machine's "
                          "device (the fake process group at --gpus ranks, the wire modelled) beside the prediction")
    dry.add_argument("--dry-run-steps", type=int, default=3, help="steps measured after the warm-up (default 3)")
    dry.add_argument("--move-bytes", action="store_true",
                     help="emulated gathers also write their bytes through HBM (default: the stream is only held)")
    dry.add_argument("--cuda-graphs", action="store_true", help="the dry run replays forward and backward from a "
                     "captured CUDA graph (graph_safe=True)")
    out = p.add_argument_group("output")
    out.add_argument("--top", type=int, default=12, help="rows of the table")
    out.add_argument("--json", action="store_true")
    out.add_argument("--calibrate", action="store_true",
                     help="measure this machine's collectives (NCCL over every local GPU; without CUDA gloo, 2 "
                          "processes) and a reference layer's compute, and store them")
    out.add_argument("--calibration", default=None,
                     help=f"the file --calibrate writes (default {DEFAULT_CALIBRATION}); without --calibrate, plan "
                          "for the machine it describes in place of --gpu")
    return p


def _model(args) -> object:
    shape = [args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size, args.vocab_size]
    given = [x for x in (args.preset, args.hf_config) if x] + ([shape] if any(v is not None for v in shape) else [])
    if len(given) != 1:
        raise ValueError("name one model: --preset NAME, --hf-config FOLDER, or the Megatron-style shape "
                         "--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --vocab-size")
    if args.preset:
        return args.preset
    if args.hf_config:
        return args.hf_config
    names = ["--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--vocab-size"]
    missing = [n for n, v in zip(names, shape) if v is None]
    if missing:
        raise ValueError(f"a Megatron-style shape needs {', '.join(missing)} too")
    return dict(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                ffn=args.ffn_hidden_size, vocab=args.vocab_size, kv_heads=args.num_query_groups)


def _choice(value: str) -> bool | None:
    return {"on": True, "off": False, "both": None}[value]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.calibrate:
        import json

        from .calibrate import calibrate, summary

        path = calibrate(args.calibration or DEFAULT_CALIBRATION)
        print(f"shardwise plan: calibration written to {path}")
        for line in summary(json.loads(path.read_text())):
            print(f"  {line}")
        return 0
    from .api import plan
    from .report import as_json, render

    try:
        if not args.gpus:
            raise ValueError("--gpus is needed (GPUs in all)")
        found = plan(_model(args), gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu=args.gpu, seq=args.seq,
                     global_batch=args.global_batch, micro_batches=args.micro_batch, compiled=not args.eager,
                     offload=args.offload, fp8=not args.no_fp8, hybrid=not args.no_hybrid,
                     calibration=args.calibration, strategies=args.strategy,
                     checkpointing=_choice(args.activation_checkpointing),
                     reshard_after_forward=_choice(args.reshard_after_forward), replicas=args.replicas,
                     outer_strategy=args.outer_strategy, dry_run=args.dry_run, dry_run_steps=args.dry_run_steps,
                     move_bytes=args.move_bytes, cuda_graphs=args.cuda_graphs)
    except ValueError as error:
        print(f"shardwise plan: {error}", file=sys.stderr)
        return 2
    print(as_json(found) if args.json else render(found, args.top))
    return 0
