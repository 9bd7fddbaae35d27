"""The configurations the planner weighs: one ``Candidate`` per way of running the same training shape.

Each field is a ``fully_shard`` / training choice: ZeRO stage (``strategy``), the hybrid mesh's replica count
(``replicas``: HSDP with ``outer_strategy="no_shard"``, HFSDP with ``"optim"``), ``reshard_after_forward``,
activation checkpointing, micro-batch, the ``OffloadPolicy`` fraction and the FP8 weight gather.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator

from ...engine.placements import HYBRID_NAMES, resolve_strategy

__all__ = ["Candidate", "candidates", "replica_choices"]

STRATEGIES = ("optim_grads_params", "optim_grads", "optim")  # ZeRO-3, 2, 1
ZERO = {resolve_strategy(stage): stage for stage in range(4)}  # the engine's ZeRO stage of each strategy name


@dataclass(frozen=True)
class Candidate:
    strategy: str = "optim_grads_params"
    replicas: int = 1
    outer_strategy: str = "no_shard"
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    micro_batch: int = 1
    offload_fraction: float = 0.0
    fp8: bool = False  # torchao's FP8 tensorwise linears
    fp8_gather: bool = False  # and their weights gathered as FP8 bytes (needs fp8)

    def label(self) -> str:
        parts = [f"ZeRO-{ZERO[self.strategy]}"]
        if self.replicas > 1:
            parts.append(f"{HYBRID_NAMES[self.outer_strategy]} x{self.replicas}")
        if not self.reshard_after_forward:
            parts.append("keep weights fwd->bwd")
        parts.append("AC" if self.activation_checkpointing else "no AC")
        parts.append(f"mb {self.micro_batch}")
        if self.offload_fraction:
            parts.append(f"offload {self.offload_fraction:g}")
        if self.fp8:
            parts.append("FP8 + FP8 gather" if self.fp8_gather else "FP8")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return asdict(self)


def replica_choices(gpus: int, gpus_per_node: int) -> list[int]:
    """HSDP replica counts worth weighing: each replica a whole number of nodes (so the shard group's
    collectives stay inside as few nodes as possible), 1 (plain FSDP) first."""
    nodes = max(1, gpus // gpus_per_node)
    out = [1]
    for r in range(2, nodes + 1):
        if nodes % r == 0 and gpus % r == 0:
            out.append(r)
    return out


def candidates(gpus: int, gpus_per_node: int, global_batch: int, *, micro_batches: list[int] | None = None,
               offload: bool = False, fp8: bool = True, hybrid: bool = True) -> Iterator[Candidate]:
    """Every candidate for ``global_batch`` sequences per step on ``gpus``: micro-batches that divide each
    rank's share, ZeRO-1/2/3, HSDP/HFSDP over whole nodes, with and without checkpointing and resharding."""
    if global_batch % gpus:
        raise ValueError(f"global batch {global_batch} must be a multiple of gpus={gpus} (sequences per rank)")
    per_rank = global_batch // gpus
    mbs = micro_batches or [m for m in (1, 2, 4, 8, 16) if per_rank % m == 0]
    layouts = [(s, 1, "no_shard") for s in STRATEGIES]
    if hybrid:
        for r in replica_choices(gpus, gpus_per_node)[1:]:
            layouts += [("optim_grads_params", r, "no_shard"), ("optim_grads_params", r, "optim")]
    for strategy, replicas, outer in layouts:
        for ac in (False, True):
            for raf in ((True, False) if strategy == "optim_grads_params" else (True,)):
                for mb in mbs:
                    for frac in ((0.0, 0.5, 1.0) if offload else (0.0,)):
                        precisions = [(False, False)]
                        if fp8:
                            precisions.append((True, False))
                            if strategy == "optim_grads_params" and not frac:
                                precisions.append((True, True))
                        for f8, gather8 in precisions:
                            yield Candidate(strategy, replicas, outer, raf, ac, mb, frac, f8, gather8)
