"""``shardwise ckpt``: inspect, verify or export a checkpoint as safetensors (no GPU, no process group).

    shardwise ckpt info CKPT_DIR [--json]
    shardwise ckpt verify CKPT_DIR
    shardwise ckpt export CKPT_DIR OUT [--dtype bf16] [--max-shard-size 2GB] [--tied-once] [--no-verify]

CKPT_DIR is one checkpoint (``.../step_00000100``), a folder of them, which
means its latest complete checkpoint (``verify``: every complete one), or a
run folder of ``shardwise train`` (its ``checkpoints/`` folder). OUT is
a ``.safetensors`` file or a folder (which gets ``model.safetensors``); with
``--max-shard-size`` the model is split into
``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``.
``verify`` exits 0 when every file matches the sha256 recorded at save, 1
when one does not (each problem named), 2 when there is nothing to verify.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import warnings
from pathlib import Path

__all__ = ["main", "checkpoint_folder"]

_CKPT_HELP = "a checkpoint (step_N), a folder of them (its latest), or a train run folder (its checkpoints/)"


def _parser() -> argparse.ArgumentParser:
    from .errors import ShortUsageParser

    parser = ShortUsageParser(prog="shardwise ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True, metavar="{info,verify,export}")
    info = sub.add_parser("info", help="print what a checkpoint holds (world size, strategy, step, tensors, sizes)")
    info.add_argument("ckpt", metavar="CKPT_DIR", help=_CKPT_HELP)
    info.add_argument("--json", action="store_true", help="print the full description as JSON")
    verify = sub.add_parser("verify", help="check every file of a checkpoint (or of each in a folder) against "
                                           "the sizes and sha256 recorded at save")
    verify.add_argument("ckpt", metavar="CKPT_DIR", help=_CKPT_HELP)
    export = sub.add_parser("export", help="write the model as safetensors, streaming one tensor at a time")
    export.add_argument("ckpt", metavar="CKPT_DIR", help=_CKPT_HELP)
    export.add_argument("out", metavar="OUT", help="a .safetensors file, or a folder (gets model.safetensors)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="cast floating tensors (default: as saved, fp32)")
    export.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="split into files of at most SIZE (e.g. 2GB, 500MB, 1GiB) with an index json")
    export.add_argument("--format", choices=["safetensors", "hf"], default="safetensors",
                        help="hf: a Hugging Face folder (config.json, HF key names; the GPT model as "
                             "LlamaForCausalLM/MixtralForCausalLM) that transformers' from_pretrained loads")
    export.add_argument("--config", default=None, metavar="FILE",
                        help="with --format hf: the run's config.json or a transformers config.json "
                             "(default: the config.json of the run the checkpoint belongs to)")
    export.add_argument("--tied-once", action="store_true",
                        help="write tied weights once, under their first name, as Hugging Face does (default: "
                             "under every name, like nn.Module.state_dict())")
    export.add_argument("--include-tied", action="store_true", help=argparse.SUPPRESS)  # the default now
    export.add_argument("--no-verify", action="store_true", help="skip checking the files' sha256 first")
    return parser


def _verify(target: str) -> int:
    from ..checkpoint.export import resolve_checkpoints
    from ..checkpoint.integrity import verify_checkpoint

    bad = 0
    for path in resolve_checkpoints(target):
        started = time.perf_counter()
        report = verify_checkpoint(path)
        took = time.perf_counter() - started
        if report["ok"]:
            size = f", {report['bytes'] / 1e6:.1f} MB" if report["files"] else ""
            print(f"ok       {path}  ({report['checked']}: {report['files']} files{size}, {took:.2f}s)")
        else:
            bad += 1
            print(f"DAMAGED  {path}")
            for problem in report["problems"]:
                print(f"           {problem}")
    return 1 if bad else 0


def checkpoint_folder(target: str) -> str:
    """``target``, or its ``checkpoints/`` folder when ``target`` is a run folder (``shardwise train``'s
    ``--out-dir``, which holds its checkpoints one level down) rather than a checkpoint or a folder of them."""
    path = Path(target)
    if path.is_dir() and not any(path.glob("step_*")) and (path / "checkpoints").is_dir():
        return str(path / "checkpoints")
    return target


def _where_checkpoints_come_from(target: str) -> str:
    """For a CKPT_DIR with no checkpoint: which run folder was looked in, and that ``train`` writes
    checkpoints only with ``--save-every`` ("" when CKPT_DIR holds step folders: the error says enough)."""
    path = Path(target)
    if path.is_file() or (path.is_dir() and any(path.glob("step_*"))):
        return ""
    run = path.parent.parent if path.name.startswith("step_") else path.parent if path.name == "checkpoints" else path
    if any((run / name).is_file() for name in ("config.json", "metrics.jsonl")):
        looked = f"the run folder {run} has no checkpoints"
    else:
        looked = f"{run} is not a run folder" if run.is_dir() else f"there is no run folder {run}"
    return (f"; {looked}: shardwise train writes checkpoints (into <run folder>/checkpoints/) only with "
            f"--save-every N")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_, **__: print(
            f"shardwise ckpt {args.action}: warning: {message}", file=sys.stderr)
        return _run(args)


def _run(args) -> int:
    from ..checkpoint.export import checkpoint_info, export_safetensors, format_info, parse_size, resolve_checkpoint
    from ..checkpoint.integrity import CheckpointError

    args.ckpt = checkpoint_folder(args.ckpt)
    try:
        if args.action == "info":
            info = checkpoint_info(args.ckpt)
            print(json.dumps(info, indent=1) if args.json else format_info(info))
            return 0
        if args.action == "verify":
            return _verify(args.ckpt)
        if args.max_shard_size is not None:
            parse_size(args.max_shard_size)
        started = time.perf_counter()
        args.ckpt = str(resolve_checkpoint(args.ckpt))  # a folder of checkpoints: its latest, named below
        if args.format == "hf":
            from ..hf.export import export_hf

            files = export_hf(args.ckpt, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                              config=args.config)
        else:
            files = export_safetensors(args.ckpt, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                       include_tied=not args.tied_once, verify=not args.no_verify)
    except (OSError, ValueError, KeyError, CheckpointError) as e:  # OSError: a file in the way, no permission
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError) and e.filename:
            message = f"{e.filename}: {e.strerror}"
        hint = _where_checkpoints_come_from(args.ckpt) if isinstance(e, FileNotFoundError) else ""
        print(f"shardwise ckpt {args.action}: error: {message}{hint}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    total = sum(f.stat().st_size for f in files)
    print(f"exported {args.ckpt}: wrote {len(files)} file(s), {total / 1e6:.1f} MB in "
          f"{time.perf_counter() - started:.1f}s (peak RSS {peak:.0f} MiB):")
    for f in files:
        print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
