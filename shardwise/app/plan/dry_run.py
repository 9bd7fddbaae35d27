"""A dry run: a few real training steps of rank 0 of a world-N job, on the one local device.

The static plan (``trace.py``, ``step_time.py``) counts a candidate's storages under FakeTensorMode and models
its step. A dry run builds the same model with real tensors on torch's ``fake`` process group at world N
(``simulate.fake_process_group``): built on the meta device and materialized unit by unit (only this rank's
1/N shard of each parameter ever exists), wrapped by ``fully_shard`` with the candidate's arguments, and
trained for ``warmup + steps`` steps. Every buffer is the engine's own (the full gathered units, staging,
gradients, AdamW's state), every allocation goes through the real allocator, the kernels are the real ones.
Only the wire is modelled (``emulated_wire.py``): on CUDA each collective holds the engine's gather or reduce
stream for its modelled time, so the engine's own events decide what is exposed; on the CPU the calls are
recorded and their time added to the step (a CPU rank runs its collectives one after another).

Measured: the step's wall time, its host time, and on CUDA the caching allocator's peaks and the device memory
the process holds (``torch.cuda.mem_get_info``: CUDA context and library workspaces included). On the CPU the
memory is the traced storages of the real steps (``LiveBytes`` over real tensors) and the device figures are
n/a. Modelled: the wire, and the buffers NCCL would add at world N (``nccl_bytes``). Numerics are not the
job's (no rank's gradients meet another's, see ``emulated_wire.py``): losses are not reported.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from .candidates import Candidate
from .emulated_wire import EmulatedCollectives, WireCall, WireModel
from .hardware import Cluster
from .live_bytes import LiveBytes
from .model_source import ModelSource
from .simulate import fake_process_group

__all__ = ["DryRun", "dry_run", "nccl_bytes", "NCCL_CHANNELS", "NCCL_BYTES_PER_CHANNEL"]

#: NCCL's buffers per communicator: channels x (the Simple protocol's ``NCCL_BUFFSIZE``, 4 MiB by default per
#: NCCL's environment documentation, plus the LL128 and LL protocols' buffers, assumed 4.75 MiB together),
#: with 16 channels assumed (an NVLink node's rings). Assumed, not measured: the GPU check's
#: ``mem_get_info`` at world 2 against world 1 is the measurement to compare with.
NCCL_CHANNELS = 16
NCCL_BYTES_PER_CHANNEL = int((4 + 4.75) * 2**20)


def nccl_bytes(world: int, axes: dict[str, int]) -> tuple[int, int]:
    """(communicators, bytes) NCCL would hold at ``world``: the default group's and each mesh axis's group
    of more than one rank that is not the whole world (a 1-D mesh over every rank uses the default group)."""
    if world <= 1:
        return 0, 0
    comms = 1 + sum(1 for size in axes.values() if 1 < size < world)
    return comms, comms * NCCL_CHANNELS * NCCL_BYTES_PER_CHANNEL


@dataclass
class DryRun:
    """One candidate's dry run on one local device (bytes, seconds; ``None``: n/a on this device)."""

    candidate: Candidate
    world: int
    device: str  # the local device's name
    steps: int
    micro_batches: int  # per optimizer step (all but the last under no_sync)
    step_s: float  # the step: measured on CUDA with the wire held on the streams; CPU: measured + the wire
    host_s: float  # Python and launches per step (CUDA: until the step's last launch returns)
    wire_s: float  # modelled collective time per step (every call, overlapped or not)
    tokens_per_s_per_gpu: float
    calls_per_step: int
    shard_bytes: int  # this rank's main weights (the DTensor parameters' local storage)
    nccl_communicators: int
    nccl_bytes: int  # modelled
    no_wire_step_s: float | None = None  # CUDA: the same steps with every hold removed (compute and host)
    peak_allocated: int | None = None  # CUDA: torch.cuda.max_memory_allocated over the steady steps
    all_steps_peak_allocated: int | None = None  # CUDA: from the wrapped model on, the first step included
    peak_reserved: int | None = None
    process_device_bytes: int | None = None  # CUDA: peak reserved + what the process holds outside the allocator
    traced_peak: int | None = None  # CPU: LiveBytes' peak over the steps (real tensors)
    calls: list[WireCall] = field(default_factory=list, repr=False)  # one measured step's calls, in order
    shards: dict = field(default_factory=dict, repr=False)  # parameter name -> its local (rank 0) shape
    notes: list[str] = field(default_factory=list)

    @property
    def exposed_wire_s(self) -> float:
        """The wire the step waited for: CUDA, the step with it against without; CPU, all of it."""
        if self.no_wire_step_s is None:
            return self.wire_s
        return max(0.0, self.step_s - self.no_wire_step_s)

    @property
    def peak(self) -> int:
        """The peak the static plan predicts (its trace's): allocated on CUDA, traced storages on the CPU."""
        return self.peak_allocated if self.peak_allocated is not None else self.traced_peak

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in (
            "world", "device", "steps", "micro_batches", "step_s", "host_s", "wire_s", "tokens_per_s_per_gpu",
            "calls_per_step", "shard_bytes", "nccl_communicators", "nccl_bytes", "no_wire_step_s", "peak_allocated",
            "all_steps_peak_allocated",
            "peak_reserved", "process_device_bytes", "traced_peak", "notes")}
        return {"config": self.candidate.as_dict(), "label": self.candidate.label(), **out,
                "exposed_wire_s": self.exposed_wire_s}


def _check(cand: Candidate, device: torch.device, cuda_graphs: bool, steps: int, warmup: int) -> None:
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    if warmup < 1:
        raise ValueError(f"warmup={warmup} must be at least 1 (the first step makes AdamW's state)")
    if device.type != "cuda" and cand.fp8:
        raise ValueError(f"{cand.label()}: FP8 compute needs a CUDA device (torchao's scaled matmuls); "
                         f"device={device} (dry-run a bf16 candidate here, or on a GPU)")
    if device.type != "cuda" and cuda_graphs:
        raise ValueError(f"cuda_graphs=True needs a CUDA device; device={device}")


def _build(source: ModelSource, cand: Candidate, device: torch.device, mesh, collectives, cuda_graphs: bool):
    """The candidate's model on ``mesh``: built on meta, each unit materialized as it is sharded."""
    import shardwise

    with torch.device("meta"):
        model = source.build(None, cand.activation_checkpointing)
    if cand.fp8:
        shardwise.convert_to_fp8(model, "tensorwise", all_gather=cand.fp8_gather)
    init = shardwise.MetaInitializer(model, device, replay_rng_order=False)  # values: any (numerics are not run)
    kw = dict(strategy=cand.strategy, unit_modules=source.unit_spec(model), init_fn=init,
              mixed_precision=shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
              reshard_after_forward=cand.reshard_after_forward, collectives=collectives,
              check_module_states=False, graph_safe=cuda_graphs)
    if cand.replicas > 1:
        kw["outer_dp_sharding_strategy"] = cand.outer_strategy
    if cand.offload_fraction:
        kw["offload_policy"] = shardwise.OffloadPolicy(fraction=cand.offload_fraction)
    model = shardwise.fully_shard(model, mesh, **kw)
    init.finish()
    return model


class _Step:
    """One optimizer step of ``micro`` micro-batches (all but the last under ``no_sync``), as ``shardwise
    train`` runs it; with ``cuda_graphs`` forward and backward replay from one captured graph."""

    def __init__(self, model, opt, inputs, micro: int, cuda_graphs: bool, wire: EmulatedCollectives):
        self.model, self.opt, self.inputs, self.micro = model, opt, inputs, micro
        self.capture = cuda_graphs
        self.graph_calls: list[WireCall] = []  # the captured step's calls (a replay runs no Python to record)
        if cuda_graphs:
            import shardwise

            def captured(*inputs):
                wire.clear()  # the last call of this function is the capture: its calls are every replay's
                self._forward_backward(*inputs)

            self.graphed = shardwise.capture_step(captured, inputs, models=model)
            self.graph_calls = list(wire.calls)
        else:
            self.graphed = None

    def _forward_backward(self, *inputs):
        if self.capture:  # a captured step starts by dropping the grads (it overwrites them every replay)
            self.opt.zero_grad(set_to_none=True)
        for m in range(self.micro):
            with contextlib.nullcontext() if m == self.micro - 1 else self.model.no_sync():
                loss = self.model(*inputs)
                loss = loss.float().sum() if loss.dim() else loss  # as the static trace reduces it
                (loss / self.micro if self.micro > 1 else loss).backward()

    def __call__(self) -> None:
        if self.graphed is not None:
            self.graphed(*self.inputs)
        else:
            self._forward_backward(*self.inputs)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _timed(step: _Step, steps: int, cuda: bool) -> tuple[float, float]:
    """(wall, host) seconds per step over ``steps`` steps, the device drained before and after."""
    if cuda:
        torch.cuda.synchronize()
    host = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        step()
        host += time.perf_counter() - t
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, host / steps


def dry_run(source: ModelSource, cluster: Cluster, cand: Candidate, seq: int, global_batch: int, *,
            steps: int = 3, warmup: int = 2, device: torch.device | str | None = None, compiled: bool = False,
            cuda_graphs: bool = False, move_bytes: bool = False) -> DryRun:
    """Run ``warmup + steps`` steps of rank 0 of ``cand`` on ``cluster.gpus`` ranks here (``device``: the
    current CUDA device where there is one, else the CPU) and measure the last ``steps``.

    ``compiled``: each unit's forward through ``torch.compile`` (CUDA only; eager on the CPU). ``move_bytes``:
    gathers write their bytes through HBM (see ``emulated_wire.py``). The wire takes only the cluster's links
    (the step model's efficiencies are what the dry run measures instead).
    """
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    _check(cand, device, cuda_graphs, steps, warmup)
    if global_batch % cluster.gpus:
        raise ValueError(f"global_batch={global_batch} must be a multiple of gpus={cluster.gpus}")
    per_rank = global_batch // cluster.gpus
    if per_rank % cand.micro_batch:
        raise ValueError(f"micro_batch={cand.micro_batch} must divide a rank's {per_rank} sequences per step")
    micro = per_rank // cand.micro_batch
    cuda = device.type == "cuda"
    with fake_process_group(cluster.gpus, "a dry run"), _rank_threads(cuda, cluster):
        import shardwise

        mesh = shardwise.build_dp_mesh(outer=cand.replicas if cand.replicas > 1 else None, device_type=device.type)
        axes = {name: mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names)}
        wire = EmulatedCollectives(WireModel(cluster, cand.replicas), device, move_bytes)
        tracker = LiveBytes() if not cuda else None  # the CPU's memory figure; on CUDA the allocator's own
        with tracker if tracker is not None else contextlib.nullcontext():
            model = _build(source, cand, device, mesh, wire, cuda_graphs)
            if compiled and cuda:
                shardwise.compile_units(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not cand.offload_fraction)  # as the static trace
            inputs = tuple(t.to(device) for t in source.inputs(cand.micro_batch, seq))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            step = _Step(model, opt, inputs, micro, cuda_graphs, wire)
            step()  # AdamW's state is made here; the peaks are the steady steps' (the static trace's moment)
            if cuda:
                torch.cuda.synchronize()
                first_peak = torch.cuda.max_memory_allocated()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            if tracker is not None:
                tracker.reset_peak()
            for _ in range(warmup - 1):
                step()
        wire.clear()
        step_s, host_s = _timed(step, steps, cuda)
        calls = step.graph_calls * steps if cuda_graphs else list(wire.calls)
        wire_s = sum(c.seconds for c in calls) / steps
        result = DryRun(cand, cluster.gpus, torch.cuda.get_device_name(device) if cuda else "cpu", steps, micro,
                        step_s if cuda else step_s + wire_s, host_s, wire_s, 0.0, len(calls) // steps,
                        _local_bytes(model), *nccl_bytes(cluster.gpus, axes), calls=calls[:len(calls) // steps])
        if cuda:
            result.peak_allocated = torch.cuda.max_memory_allocated()
            result.all_steps_peak_allocated = max(first_peak, result.peak_allocated)
            result.peak_reserved = torch.cuda.max_memory_reserved()
            free, total = torch.cuda.mem_get_info()
            result.process_device_bytes = result.peak_reserved + (total - free - torch.cuda.memory_reserved())
            if not cuda_graphs:  # a captured graph replays its holds: it cannot drop them
                wire.stream_hold, held = None, wire.stream_hold
                result.no_wire_step_s, _ = _timed(step, steps, cuda)
                wire.stream_hold = held
            else:
                result.notes.append("no wire-free timing under CUDA graphs (the holds are in the graph)")
        else:
            result.traced_peak = tracker.peak
            result.notes.append("CPU: memory is the traced storages of the real steps; allocator and device "
                                "figures n/a; the wire is added to the measured step (nothing overlaps on a CPU "
                                f"rank); eager, {torch.get_num_threads()} thread(s): a rank's share of the cores")
        result.tokens_per_s_per_gpu = per_rank * seq / result.step_s
        result.shards = {n: tuple((p.to_local() if hasattr(p, "to_local") else p).shape)
                         for n, p in model.named_parameters()}
        del step, opt, model
    return result


@contextlib.contextmanager
def _rank_threads(cuda: bool, cluster: Cluster):
    """On the CPU, the threads one of the node's ranks would have (its share of the cores: more threads than
    that measure a machine the job will not have); on CUDA nothing changes."""
    if cuda:
        yield
        return
    from ..launch import available_cores

    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, available_cores() // cluster.gpus_per_node))
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _local_bytes(model) -> int:
    seen = {}
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        seen[local.untyped_storage()._cdata] = local.untyped_storage().nbytes()
    return sum(seen.values())

