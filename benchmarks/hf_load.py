"""Measure ``--init-from``: every rank reading its own rows vs every rank loading the whole file.

    python -m benchmarks.hf_load --preset 1b --folder /tmp/hf-1b          # writes the folder first if missing
    python -m benchmarks.hf_load --preset small --nproc 2 --json out.json

The folder is shardwise's GPT preset saved in Hugging Face (Llama) format with
random weights (``--max-shard-size`` shards, an index). Each mode runs in fresh
processes (so peak RSS is that mode's): build the model on the meta device,
``fully_shard`` it (ZeRO-3, one unit per layer) with ``init_fn`` allocating
each unit uninitialized, then fill the shards: ``rows`` reads this rank's rows
with ``safe_open(...).get_slice``; ``whole`` loads every file completely
(``safetensors.torch.load_file``) and cuts its rows from that. Reported per
rank: seconds (fully_shard, load), bytes read, peak RSS (``ru_maxrss``: file
pages mapped while reading count too) and RSS before loading. Both modes
check that the loaded rows equal the file's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

__all__ = ["write_random_folder", "main"]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_random_folder(model_cfg, folder: Path, dtype: torch.dtype = torch.float32,
                        max_shard_size: int | None = None, seed: int = 0) -> int:
    """A ``save_pretrained``-style folder of GPT config ``model_cfg`` as Llama/Mixtral, random normal weights
    (norms 1); one tensor in memory at a time. Returns the bytes of tensors written."""
    from shardwise.checkpoint.export import split_by_size, write_safetensors
    from shardwise.hf.mapping import gpt_hf_keys, gpt_to_hf_config
    from shardwise.models import GPT

    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPT(model_cfg).named_parameters()}
    entries = []
    for gpt_name, hf_name, expert in gpt_hf_keys(model_cfg):
        shape = shapes[gpt_name] if expert is None else shapes[gpt_name][1:]
        entries.append((hf_name, shape, dtype))
    shards = [[entries[i] for i in indices] for indices in split_by_size(entries, max_shard_size or None)]
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def tensors(part):
        for name, shape, _ in part:
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape)
            else:
                yield name, torch.empty(shape).normal_(0.0, model_cfg.init_std, generator=gen)

    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, part in zip(names, shards):
        write_safetensors(folder / name, part, tensors(part), {"format": "pt"})
    total = sum(math.prod(s) * dtype.itemsize for _, s, _ in entries)
    if len(shards) > 1:
        weight_map = {e[0]: names[i] for i, part in enumerate(shards) for e in part}
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = gpt_to_hf_config(model_cfg)
    config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return total


def _worker(mode: str, folder: str, model_cfg, result_dir: str) -> None:
    """One rank: meta build, fully_shard, fill the shards; write this rank's numbers."""
    import torch.distributed as dist

    import shardwise
    from shardwise.hf.load import SafetensorsFolder, local_box
    from shardwise.hf.models import MetaInit
    from shardwise.hf.load import init_from_folder
    from shardwise.models import GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rss_start = _rss_mib()
    with torch.device("meta"):
        model = GPT(model_cfg)
    init_fn = MetaInit(model, torch.device("cpu"), reset=None, buffer_reset=lambda m: m.reset_parameters())
    dist.barrier()
    t0 = time.perf_counter()
    model = shardwise.fully_shard(model, unit_modules=list(dict.fromkeys(type(b) for b in model.layers)),
                                  init_fn=init_fn)
    init_fn.finish()  # no load attached: the RoPE tables
    t1 = time.perf_counter()
    rss_before_load, peak_before_load = _rss_mib(), _peak_mib()
    stats = init_from_folder(model, folder, model_cfg, whole=(mode == "whole"))
    dist.barrier()
    t2 = time.perf_counter()
    peak = _peak_mib()
    # check: this rank's rows equal the file's (a few tensors, read again by rows)
    reader, checked = SafetensorsFolder(folder), 0
    from shardwise.hf.load import gpt_sources

    sources = gpt_sources(model_cfg, reader)
    for name, p in list(model.named_parameters())[:: max(1, len(sources) // 6)]:
        box, shape = local_box(p)
        assert torch.equal(p.to_local(), sources[name].read(box).reshape(shape).to(p.dtype)), name
        checked += 1
    shard_bytes = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    out = dict(mode=mode, rank=rank, fully_shard_s=t1 - t0, load_s=t2 - t1, bytes_read=stats.bytes_read,
               shard_bytes=shard_bytes, rss_start_mib=rss_start, rss_before_load_mib=rss_before_load,
               peak_before_load_mib=peak_before_load, peak_rss_mib=peak, checked_tensors=checked)
    Path(result_dir, f"{mode}-{rank}.json").write_text(json.dumps(out))
    del model
    from shardwise import destroy_process_groups

    destroy_process_groups()


def _run_mode(mode: str, folder: Path, model_cfg, nproc: int, result_dir: Path) -> list[dict]:
    from shardwise.app.launch import launch_local

    code = launch_local(_worker, nproc, (mode, str(folder), model_cfg, str(result_dir)), "benchmarks.hf_load")
    if code != 0:
        raise SystemExit(f"mode {mode}: a rank failed (exit {code})")
    return [json.loads((result_dir / f"{mode}-{r}.json").read_text()) for r in range(nproc)]


def main(argv=None) -> int:
    from shardwise.models import GPTConfig
    from shardwise.app.presets import PRESETS
    from shardwise.checkpoint.export import parse_size

    parser = argparse.ArgumentParser(prog="python -m benchmarks.hf_load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    parser.add_argument("--folder", default=None, help="the HF folder (written first when it has no config.json)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--max-shard-size", default="2GB")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--modes", default="rows,whole")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)

    fields = {f for f in GPTConfig.__dataclass_fields__}
    model_cfg = GPTConfig(**{k: v for k, v in PRESETS[args.preset].items() if k in fields})
    folder = Path(args.folder or f"/tmp/shardwise-hf-{args.preset}-{args.dtype}")
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    if not (folder / "config.json").is_file():
        t = time.perf_counter()
        total = write_random_folder(model_cfg, folder, dtype, parse_size(args.max_shard_size))
        print(f"wrote {folder}: {total / 1e9:.2f} GB of tensors in {time.perf_counter() - t:.1f}s", flush=True)
    files = sorted(folder.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    for f in files:  # page cache warm for both modes alike
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    params = sum(math.prod(s) for s in _shapes(model_cfg))
    print(f"{args.preset}: {params / 1e9:.3f}B parameters, {len(files)} file(s), {total / 1e9:.2f} GB "
          f"({args.dtype}), {args.nproc} processes, ZeRO-3", flush=True)
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            results += _run_mode(mode, folder, model_cfg, args.nproc, Path(tmp))
    print(f"{'mode':6s} {'rank':>4s} {'fully_shard s':>13s} {'load s':>7s} {'read GB':>8s} {'shard GB':>8s} "
          f"{'RSS start':>9s} {'RSS pre-load':>12s} {'peak pre-load':>13s} {'peak RSS':>9s}  (MiB)")
    for r in results:
        print(f"{r['mode']:6s} {r['rank']:4d} {r['fully_shard_s']:13.2f} {r['load_s']:7.2f} "
              f"{r['bytes_read'] / 1e9:8.2f} {r['shard_bytes'] / 1e9:8.2f} {r['rss_start_mib']:9.0f} "
              f"{r['rss_before_load_mib']:12.0f} {r['peak_before_load_mib']:13.0f} {r['peak_rss_mib']:9.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "dtype": args.dtype, "files": len(files),
                                               "file_bytes": total, "params": params, "results": results},
                                              indent=2))
    return 0


def _shapes(model_cfg):
    from shardwise.models import GPT

    with torch.device("meta"):
        return [tuple(p.shape) for p in GPT(model_cfg).parameters()]


if __name__ == "__main__":
    sys.exit(main())
