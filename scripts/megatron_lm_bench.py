"""Megatron-LM's ``pretrain_gpt.py`` at real shapes: Megatron-FSDP against the shardwise face, one job.

Runs Megatron-LM's unmodified ``pretrain_gpt.py`` (its own Megatron-FSDP) and the copy with the README's
added line (shardwise) at the shapes of issue 55 (Llama-style, bf16, local layers, ZeRO-3
``optim_grads_params``, mock data, gradient accumulation), interleaved (A B A B ...) so both see the same
machine, with and without ``--overlap-grad-reduce --overlap-param-gather``, and prints one table: median
ms per iteration after the warm-up, tokens/s, the ratio to Megatron-FSDP, and the peak allocated and
reserved memory Megatron-LM reports. ``--profile`` adds one profiled iteration per run (torch's
profiler through Megatron-LM's own ``--profile --use-pytorch-profiler``) and prints, per run, the GPU
time by kernel kind, idle time and the host's lead (``scripts/trace_summary.py``) and the Python
functions that took the most host time::

    python scripts/megatron_lm_bench.py --megatron-lm PATH --out DIR [--shapes 0.9b 2.8b] [--repeats 2]
        [--overlap off on] [--iters 20] [--profile] [--variant NAME=SHARDWISE_TREE ...]

``--variant`` adds a wrapper that runs the shardwise script with another shardwise tree first on the path (an
A/B of two versions in one job).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_lm_pretrain import environment, finish, launch, with_added_line  # noqa: E402

COMMON = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --no-rope-fusion --untie-embeddings-and-output-weights "
    "--disable-bias-linear --group-query-attention --num-query-groups 8 --seq-length 4096 "
    "--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 "
    "--lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 --seed 1234 "
    "--attention-dropout 0 --hidden-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 "
    "--bf16 --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --use-megatron-fsdp --use-distributed-optimizer "
    "--data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor "
    "--log-interval 1 --log-throughput --eval-iters 0 --eval-interval 100000"
)
SHAPES = {
    "0.9b": "--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632",
    "2.8b": ("--num-layers 26 --hidden-size 3072 --num-attention-heads 24 --ffn-hidden-size 8192 "
             "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"),
}
OVERLAP = "--overlap-grad-reduce --overlap-param-gather"
TOKENS_PER_ITERATION = 8 * 4096  # global batch x sequence
MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
MEMORY = {"max_allocated_mb": re.compile(r"max allocated: ([0-9.]+)"),
          "max_reserved_mb": re.compile(r"max reserved: ([0-9.]+)")}
LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")


def command(script: Path, shape: str, overlap: bool, iters: int, profile_dir: Path | None) -> list:
    args = f"{COMMON} {SHAPES[shape]} --train-iters {iters}".split()
    if overlap:
        args += OVERLAP.split()
    if profile_dir is not None:  # one iteration near the end, after the timed ones settled
        args += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(iters - 2),
                 "--profile-step-end", str(iters - 1), "--pytorch-profiler-collect-callstack",
                 "--tensorboard-dir", str(profile_dir / "tb")]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script),
            *args]


def read(log: str, skip: int) -> dict:
    times = [float(m.group(1)) for m in MS.finditer(log)][skip:]
    out = {"ms_median": statistics.median(times) if times else None,
           "losses": [float(m.group(1)) for m in LOSS.finditer(log)]}
    for key, rx in MEMORY.items():
        values = [float(v) for v in rx.findall(log)]
        out[key] = max(values) if values else None
    return out


def python_hotspots(trace: Path, top: int = 25) -> str:
    """The Python functions with the most inclusive host time in the trace (shardwise's and Megatron's)."""
    with gzip.open(trace, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    total = collections.Counter()
    count = collections.Counter()
    for e in events:
        if e.get("cat") == "python_function" and ("shardwise" in e["name"] or "megatron" in e["name"]):
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return "\n".join(f"   {v / 1e3:9.2f} ms {count[k]:6d}x  {k}" for k, v in total.most_common(top))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", type=Path, required=True, help="a folder holding Megatron-LM's pretrain_gpt.py")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=["0.9b", "2.8b"], choices=list(SHAPES))
    p.add_argument("--overlap", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--repeats", type=int, default=1, help="runs of each wrapper per setting, interleaved")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--skip", type=int, default=5, help="iterations not timed (warm-up)")
    p.add_argument("--wrappers", nargs="+", default=["megatron", "shardwise"], choices=["megatron", "shardwise"])
    p.add_argument("--profile", action="store_true", help="profile one iteration of each wrapper's first run")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=PATH",
                   help="another shardwise tree (a folder holding shardwise/) run as wrapper NAME")
    args = p.parse_args()
    tree, out = args.megatron_lm.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trace_summary import summarize  # noqa: E402  (shardwise's bench helpers, imported with the repo on the path)

    env = environment(tree)
    scripts = {"megatron": tree / "pretrain_gpt.py", "shardwise": with_added_line(tree, out)}
    envs = {name: env for name in scripts}
    for variant in args.variant:
        name, path = variant.split("=", 1)
        scripts[name] = scripts["shardwise"]
        envs[name] = dict(env, PYTHONPATH=f"{Path(path).resolve()}:{env['PYTHONPATH']}")
    wrappers = args.wrappers + [v.split("=", 1)[0] for v in args.variant]
    rows = []
    for shape in args.shapes:
        for overlap in args.overlap:
            results = collections.defaultdict(list)
            for r in range(args.repeats):
                for impl in wrappers:
                    name = f"{shape}_{impl}_overlap-{overlap}_r{r}"
                    profile_dir = out / name if args.profile and r == 0 else None
                    cmd = command(scripts[impl], shape, overlap == "on", args.iters, profile_dir)
                    run = finish(name, *launch(name, cmd, envs[impl], out), out)
                    got = read((out / f"{name}.log").read_text(), args.skip)
                    got["rc"] = run["rc"]
                    results[impl].append(got)
                    print(name, json.dumps({k: v for k, v in got.items() if k != "losses"}), flush=True)
                    if run["rc"] != 0:
                        print(run.get("tail", ""), flush=True)
                    if profile_dir is not None:
                        for trace in sorted(profile_dir.glob("torch_profile/*.json.gz")):
                            print(summarize(str(trace)), flush=True)
                            print(f"## Python host time (inclusive), {name}:\n{python_hotspots(trace)}", flush=True)
            megatron_ms = [x["ms_median"] for x in results.get("megatron", []) if x["ms_median"]]
            base = statistics.median(megatron_ms) if megatron_ms else None
            for impl, runs in results.items():
                ms = [x["ms_median"] for x in runs if x["ms_median"]]
                med = statistics.median(ms) if ms else None
                rows.append({"shape": shape, "overlap": overlap, "wrapper": impl, "ms": med,
                             "tokens_per_s": TOKENS_PER_ITERATION / med * 1e3 if med else None,
                             "vs_megatron": base / med if base and med else None,
                             "max_allocated_mb": max((x["max_allocated_mb"] or 0) for x in runs),
                             "max_reserved_mb": max((x["max_reserved_mb"] or 0) for x in runs),
                             "runs_ms": ms})
    lines = ["| shape | overlap flags | wrapper | ms/iteration | tokens/s | vs Megatron-FSDP | max allocated MB "
             "| max reserved MB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda v, f: format(v, f) if v is not None else "-"
        lines.append(f"| {r['shape']} | {r['overlap']} | {r['wrapper']} | {fmt(r['ms'], '.1f')} | "
                     f"{fmt(r['tokens_per_s'], ',.0f')} | {fmt(r['vs_megatron'], '.3f')} | "
                     f"{fmt(r['max_allocated_mb'], ',.0f')} | {fmt(r['max_reserved_mb'], ',.0f')} |")
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
