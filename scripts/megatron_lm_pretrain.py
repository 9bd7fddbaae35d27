"""Megatron-LM's own ``pretrain_gpt.py`` with the README's one added line, on a GPU: train, resume, migrate.

For each sharding strategy asked for (ZeRO-1 ``optim`` and ZeRO-3 ``optim_grads_params`` by
default) this runs Megatron-LM's unmodified ``pretrain_gpt.py`` (Megatron's own Megatron-FSDP)
and a copy of it with the README's two lines put before its ``if __name__ == "__main__":``
(shardwise), on mock data with the local layers, ``--ckpt-format fsdp_dtensor``:

1. the uninterrupted runs, one at a time (their times and memory are the comparison):
   ``--train-iters N``, a checkpoint at ``--save-at``;
2. then, side by side on the same GPU (no times taken), each from an iteration-``save-at``
   checkpoint inside Megatron-LM's own ``load_checkpoint``: shardwise from its own
   (resume), shardwise from Megatron's and Megatron from shardwise's (migration), and
   Megatron from its own (how far Megatron's resume is from its uninterrupted run).

With ``--cuda-graphs`` it runs instead, per strategy and one at a time, Megatron's adapter and
shardwise without graphs, then shardwise and Megatron's adapter under Megatron-LM's full-iteration
CUDA graph (``--cuda-graph-impl full_iteration``: forward and backward of every micro-batch
captured once and replayed; the face runs in ``megatron_fsdp_cuda_graph_mode``), no checkpoints,
and compares their step times and the graphed losses with the eager ones.

The lines Megatron-LM prints (``lm loss``, ``grad norm``, ms per iteration, TFLOP/s,
memory) are parsed; ``--out`` gets every run's log, ``runs.json`` and ``summary.md``
(the table of ``docs/benchmarks.md``). One GPU:

    python scripts/megatron_lm_pretrain.py --megatron-lm PATH --out DIR [--ckpt-dir DIR] [--nproc 2]
    python scripts/megatron_lm_pretrain.py --megatron-lm PATH --out DIR --cuda-graphs

Megatron-LM's tree must import with the installed megatron-core (its own ``megatron/core``
or a wheel of the same release); ``shardwise`` must be importable (``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's record of the checkpoint --load takes
ADDED = "from shardwise.megatron import use_in_megatron\n\nuse_in_megatron()\n\n"

MODEL = (
    "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 "
    "--micro-batch-size 4 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 "
    "--weight-decay 0.1 --clip-grad 1.0 --seed 1234 --attention-dropout 0 --hidden-dropout 0 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 "
    "--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
    "--use-megatron-fsdp --use-distributed-optimizer --ckpt-format fsdp_dtensor "
    "--log-interval 1 --log-throughput --eval-iters 0 --eval-interval 100000"
)
# Megatron-LM's full-iteration graph: it refuses its per-step NaN check there (a host sync), and captures
# after the warm-up steps
GRAPHS = "--cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad --cuda-graph-warmup-steps {warmup}"
# (wrapper, graphed), run in this order in graph mode
GRAPH_RUNS = (("megatron", False), ("shardwise", False), ("shardwise", True), ("megatron", True))
# (who loads, whose iteration-save_at checkpoint): resume, the two migrations, Megatron's own resume
RESUMES = (("shardwise", "shardwise"), ("shardwise", "megatron"), ("megatron", "shardwise"), ("megatron", "megatron"))
STRATEGIES = {"zero1": "optim", "zero3": "optim_grads_params"}
FIELDS = {
    "loss": r"lm loss: ([0-9.E+-]+)",
    "grad_norm": r"grad norm: ([0-9.E+-]+)",
    "ms": r"elapsed time per iteration \(ms\): ([0-9.]+)",
    "tflops": r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)",
}


def with_added_line(tree: Path, where: Path) -> Path:
    """``pretrain_gpt.py`` with the README's lines before its ``__main__`` block, nothing else changed."""
    source = (tree / "pretrain_gpt.py").read_text()
    marker = 'if __name__ == "__main__":'
    if source.count(marker) != 1:
        raise SystemExit(f"{tree / 'pretrain_gpt.py'}: expected one {marker!r}")
    path = where / "pretrain_gpt_shardwise.py"
    path.write_text(source.replace(marker, ADDED + marker))
    return path


def command(script: Path, strategy: str, iters: int, save: Path | None, load: Path | None, save_at: int,
            nproc: int) -> list:
    args = f"{MODEL} --train-iters {iters} --data-parallel-sharding-strategy {strategy}".split()
    if save is not None:
        args += ["--save", str(save), "--save-interval", str(save_at)]
    if load is not None:
        args += ["--load", str(load), "--exit-on-missing-checkpoint"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script), *args]


def graph_command(script: Path, strategy: str, iters: int, nproc: int, graphed: bool, warmup: int) -> list:
    """A run of the graph comparison: no checkpoints; Megatron-LM's full-iteration graph when ``graphed``."""
    cmd = command(script, strategy, iters, None, None, 0, nproc)
    return cmd + GRAPHS.format(warmup=warmup).split() if graphed else cmd


def environment(tree: Path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # Megatron-FSDP asserts it is unset or > 1
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def parse(log: str) -> dict:
    """Per iteration, the fields Megatron-LM's ``training_log`` prints; and its memory report."""
    iterations = {}
    for line in log.splitlines():
        m = re.search(r"iteration\s+(\d+)/\s*\d+", line)
        if not m:
            continue
        row = {k: float(v.group(1)) for k, rx in FIELDS.items() if (v := re.search(rx, line))}
        row.update({f"{k}_text": v.group(1) for k, rx in FIELDS.items() if k in ("loss", "grad_norm")
                    and (v := re.search(rx, line))})
        iterations[int(m.group(1))] = row
    peaks = [float(v) for v in re.findall(r"max allocated: ([0-9.]+)", log)]  # each report: the peak so far
    return {"iterations": iterations, "max_allocated_mb": max(peaks) if peaks else None}


def launch(name: str, cmd: list, env: dict, out: Path):
    log = open(out / f"{name}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=out), log


def finish(name: str, proc, log, out: Path) -> dict:
    rc = proc.wait()
    log.close()
    text = (out / f"{name}.log").read_text()
    result = parse(text)
    result["rc"] = rc
    if rc != 0:
        result["tail"] = text[-3000:]
    return result


def differences(a: dict, b: dict, first: int, last: int) -> dict:
    """Largest |a - b| of loss and grad norm over iterations first..last, and how many printed the same."""
    out = {}
    for field in ("loss", "grad_norm"):
        pairs = [(a["iterations"].get(i, {}), b["iterations"].get(i, {})) for i in range(first, last + 1)]
        pairs = [(x, y) for x, y in pairs if field in x and field in y]
        if len(pairs) != last - first + 1:
            out[field] = None
            continue
        out[f"{field}_max_abs"] = max(abs(x[field] - y[field]) for x, y in pairs)
        out[f"{field}_equal_as_printed"] = sum(x[f"{field}_text"] == y[f"{field}_text"] for x, y in pairs)
    return out


def timing(run: dict, skip: int) -> dict:
    rows = [r for i, r in run["iterations"].items() if i > skip]
    med = lambda key: statistics.median(r[key] for r in rows) if rows and all(key in r for r in rows) else None
    return {"ms_median": med("ms"), "tflops_median": med("tflops"), "max_allocated_mb": run["max_allocated_mb"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", type=Path, required=True, help="a Megatron-LM tree (has pretrain_gpt.py)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--save-at", type=int, default=20)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="where the checkpoints go (default: OUT/ckpt)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs per run (data-parallel ranks; 1, 2, 4 or 8)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="the graph comparison instead (eager and full-iteration graphed runs, no checkpoints)")
    p.add_argument("--graph-warmup", type=int, default=2, help="eager steps before Megatron-LM captures the graph")
    args = p.parse_args()
    tree, out = args.megatron_lm.resolve(), args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = environment(tree)
    scripts = {"megatron": tree / "pretrain_gpt.py", "shardwise": with_added_line(tree, out)}
    if args.cuda_graphs:
        graphs_main(args, scripts, env, out)
        return
    ckpt = (args.ckpt_dir or out / "ckpt").resolve()
    ckpt.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    for zero in args.strategies:
        strategy = STRATEGIES[zero]
        for impl in ("megatron", "shardwise"):  # one at a time: these are the timed runs
            name = f"{zero}_{impl}_full"
            proc, log = launch(name, command(scripts[impl], strategy, args.iters, ckpt / f"{zero}_{impl}",
                                             None, args.save_at, args.nproc), env, out)
            runs[name] = finish(name, proc, log, out)
            print(name, "rc", runs[name]["rc"], timing(runs[name], skip=5), flush=True)
            # a run also saves at its end: point Megatron-LM's tracker back at the iteration-save_at one
            (ckpt / f"{zero}_{impl}" / TRACKER).write_text(str(args.save_at))
        started = {}  # one GPU: the resumed runs side by side; several: one after another
        for impl, source in RESUMES:
            name = f"{zero}_{impl}_from_{source}"
            cmd = command(scripts[impl], strategy, args.iters, None, ckpt / f"{zero}_{source}", args.save_at,
                          args.nproc)
            started[name] = launch(name, cmd, env, out)
            if args.nproc > 1:
                runs[name] = finish(name, *started.pop(name), out)
        for name, (proc, log) in started.items():
            runs[name] = finish(name, proc, log, out)
        for impl, source in RESUMES:
            print(f"{zero}_{impl}_from_{source}", "rc", runs[f"{zero}_{impl}_from_{source}"]["rc"], flush=True)
    summary = summarize(runs, args)
    (out / "runs.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    (out / "summary.md").write_text(table(summary))
    print(table(summary))
    print(json.dumps(summary, indent=1))


def graphs_main(args, scripts: dict, env: dict, out: Path) -> None:
    """Eager against full-iteration graphed runs, one at a time, timed after the capture."""
    skip = max(5, args.graph_warmup + 2)  # the warm-up steps and the capture are not timed
    runs, summary = {}, {}
    for zero in args.strategies:
        for impl, graphed in GRAPH_RUNS:
            name = f"{zero}_{impl}_{'graphs' if graphed else 'eager'}"
            cmd = graph_command(scripts[impl], STRATEGIES[zero], args.iters, args.nproc, graphed, args.graph_warmup)
            runs[name] = finish(name, *launch(name, cmd, env, out), out)
            print(name, "rc", runs[name]["rc"], timing(runs[name], skip=skip), flush=True)
        times = {name[len(zero) + 1:]: timing(runs[name], skip=skip) for name in runs if name.startswith(zero + "_")}
        baseline = times["megatron_eager"]["ms_median"]
        summary[zero] = {
            "times": times,
            "rc": {name: runs[name]["rc"] for name in runs if name.startswith(zero + "_")},
            "speedup_vs_megatron_eager": {k: baseline / t["ms_median"] for k, t in times.items()
                                          if baseline and t["ms_median"]},
            "shardwise_graphs_vs_eager_1..N": differences(runs[f"{zero}_shardwise_graphs"],
                                                          runs[f"{zero}_shardwise_eager"], 1, args.iters),
        }
    (out / "runs.json").write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))


def summarize(runs: dict, args) -> dict:
    summary = {}
    for zero in args.strategies:
        m, s = runs[f"{zero}_megatron_full"], runs[f"{zero}_shardwise_full"]
        entry = {"megatron": timing(m, skip=5), "shardwise": timing(s, skip=5),
                 "shardwise_vs_megatron_1..N": differences(s, m, 1, args.iters)}
        for impl, source in RESUMES:
            resumed = runs[f"{zero}_{impl}_from_{source}"]
            entry[f"{impl}_from_{source}"] = {
                "rc": resumed["rc"],
                "vs_shardwise_full": differences(resumed, s, args.save_at + 1, args.iters),
                "vs_megatron_full": differences(resumed, m, args.save_at + 1, args.iters),
            }
        summary[zero] = entry
    return summary


def table(summary: dict) -> str:
    lines = ["| strategy | wrapper | ms/iter (median) | TFLOP/s/GPU | max allocated MB |", "|---|---|---|---|---|"]
    for zero, entry in summary.items():
        for impl in ("megatron", "shardwise"):
            t = entry[impl]
            lines.append(f"| {zero} | {impl} | {t['ms_median']} | {t['tflops_median']} | {t['max_allocated_mb']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
