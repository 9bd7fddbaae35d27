"""How a dry run reads: one table, the static plan's prediction beside the dry run's figures, each figure
marked measured or modelled."""

from __future__ import annotations

from .dry_run import DryRun
from .planner import Row

__all__ = ["render_dry_run"]

_NA = "n/a"


def _gib(x) -> str:
    return _NA if x is None else f"{x / 2**30:.3f}"


def _s(x) -> str:
    return _NA if x is None else f"{x:.4f}"


def render_dry_run(dry: DryRun, static: Row | None = None) -> str:
    cpu = dry.device == "cpu"
    st = static
    exposed = None if st is None else st.time.terms["exposed all-gather"] + st.time.terms["exposed reduce-scatter"]
    rows = [
        ("peak allocated GiB", _gib(st.memory.peak) if st else _NA, _gib(dry.peak),
         "measured: traced storages of the real steps (CPU)" if cpu else "measured: torch.cuda.max_memory_allocated"),
        ("  first step included GiB", _NA, _gib(dry.all_steps_peak_allocated),
         "measured: from the wrapped model on (a bench's reset point)" if not cpu else _NA + " on CPU"),
        ("peak reserved GiB", _NA, _gib(dry.peak_reserved),
         "measured: the caching allocator" if not cpu else _NA + " on CPU"),
        ("process device memory GiB", _NA, _gib(dry.process_device_bytes),
         "measured: reserved peak + mem_get_info's rest (context, workspaces)" if not cpu else _NA + " on CPU"),
        (f"NCCL buffers at world {dry.world} GiB", _NA, _gib(dry.nccl_bytes),
         f"modelled: {dry.nccl_communicators} communicators"),
        ("step s", _s(st.time.seconds) if st else _NA, _s(dry.step_s),
         "measured + the wire added (CPU)" if cpu else "measured, the wire held on the engine's streams"),
        ("  wire per step s", _NA, _s(dry.wire_s), f"modelled: {dry.calls_per_step} collectives"),
        ("  exposed wire s", _s(exposed), _s(dry.exposed_wire_s),
         "all of it (CPU)" if cpu else "measured: the step with the wire against without"),
        ("  host s", _s(st.time.terms["host"]) if st else _NA, _s(dry.host_s), "measured"),
        ("tokens/s/GPU", f"{st.tokens_per_s_per_gpu:,.0f}" if st else _NA, f"{dry.tokens_per_s_per_gpu:,.0f}",
         "from the step"),
    ]
    head = (f"dry run: rank 0 of {dry.world} ranks on one {dry.device}, {dry.candidate.label()}; "
            f"{dry.micro_batches} micro-batch(es) per step, {dry.steps} steps measured after the warm-up")
    lines = [head, f"  {'figure':34s} {'static plan':>12s} {'dry run':>12s}  source"]
    lines += [f"  {name:34s} {a:>12s} {b:>12s}  {src}" for name, a, b, src in rows]
    lines.append("  (static host: the GPU's wait on the host; numerics of a dry run are not the job's: no loss shown)")
    lines += [f"  note: {n}" for n in dry.notes]
    return "\n".join(lines)
