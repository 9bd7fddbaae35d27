"""``shardwise ckpt``: inspect a checkpoint or export it as safetensors (no GPU, no process group).

    shardwise ckpt info CKPT_DIR [--json]
    shardwise ckpt export CKPT_DIR OUT [--dtype bf16] [--max-shard-size 2GB] [--include-tied]

CKPT_DIR is one checkpoint (``.../step_00000100``) or a folder of them, which
means its latest complete checkpoint. OUT is a ``.safetensors`` file or a
folder (which gets ``model.safetensors``); with ``--max-shard-size`` the model
is split into ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise ckpt", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True, metavar="{info,export}")
    info = sub.add_parser("info", help="print what a checkpoint holds (world size, strategy, step, tensors, sizes)")
    info.add_argument("ckpt", metavar="CKPT_DIR")
    info.add_argument("--json", action="store_true", help="print the full description as JSON")
    export = sub.add_parser("export", help="write the model as safetensors, streaming one tensor at a time")
    export.add_argument("ckpt", metavar="CKPT_DIR")
    export.add_argument("out", metavar="OUT", help="a .safetensors file, or a folder (gets model.safetensors)")
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="cast floating tensors (default: as saved, fp32)")
    export.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="split into files of at most SIZE (e.g. 2GB, 500MB, 1GiB) with an index json")
    export.add_argument("--include-tied", action="store_true",
                        help="also write tied weights under their other names (default: once, like Hugging Face)")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .export import checkpoint_info, export_safetensors, format_info, parse_size

    try:
        if args.action == "info":
            info = checkpoint_info(args.ckpt)
            print(json.dumps(info, indent=1) if args.json else format_info(info))
            return 0
        if args.max_shard_size is not None:
            parse_size(args.max_shard_size)
        started = time.perf_counter()
        files = export_safetensors(args.ckpt, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                   include_tied=args.include_tied)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"shardwise ckpt {args.action}: error: {e}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} file(s), {total / 1e6:.1f} MB in {time.perf_counter() - started:.1f}s "
          f"(peak RSS {peak:.0f} MiB):")
    for f in files:
        print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
