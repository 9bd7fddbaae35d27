"""``FullyShardOptions``: every ``fully_shard`` argument but the module, as one frozen object.

``fully_shard`` builds it once from its keyword arguments; the construction
steps and the rank-consistency check read it by field name. The option list is written here once:
``fully_shard`` copies its arguments into it by these field names (:meth:`FullyShardOptions.from_call`), the
options every rank must pass alike are the fields marked ``agree`` (:meth:`FullyShardOptions.must_agree`), and
``tests/engine/test_fully_shard_options.py`` checks that ``fully_shard``'s signature names exactly these
fields (and FSDP2's two arguments it translates), with the same defaults.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Type, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .placements import resolve_axis_placements

if TYPE_CHECKING:  # types only (layer 2 with rank_consistency, which reads it)
    from .collectives import Collectives
    from .offload import OffloadPolicy
    from .placements import AxisPlacements
    from .precision import MixedPrecisionPolicy

__all__ = ["FullyShardOptions", "UnitSpec"]

UnitSpec = Union[Type[nn.Module], nn.Module]

#: ``fully_shard``'s arguments that are FSDP2's spelling of a field, translated before they are stored:
#: ``mp_policy`` (into ``mixed_precision``), ``dp_mesh_dims`` (into ``mesh``, ``placements`` and ``tp_axis``)
TRANSLATED_ARGUMENTS = ("mp_policy", "dp_mesh_dims")


def _agreed(default: Any) -> Any:
    """A field every rank of a mesh must pass alike: it changes the collectives' schedule or sizes, so a rank
    that differs hangs or corrupts (the rank-consistency check compares :meth:`FullyShardOptions.must_agree`)."""
    return dataclasses.field(default=default, metadata={"agree": True})


@dataclasses.dataclass(frozen=True, eq=False)
class FullyShardOptions:
    """What ``fully_shard(module, mesh, **options)`` was asked, unresolved (see ``fully_shard`` for each)."""

    mesh: DeviceMesh | None = None
    placements: Mapping[str, AxisPlacements] | str | int | None = None
    strategy: str | int | None = None
    outer_dp_sharding_strategy: str | None = None
    unit_modules: Iterable[UnitSpec] | UnitSpec | None = None
    mixed_precision: MixedPrecisionPolicy | None = _agreed(None)  # the engine's policy (torch's mp_policy translated)
    init_fn: Callable[[nn.Module, torch.device], None] | None = None
    reshard_after_forward: bool | int | None = _agreed(None)
    prefetch: bool = _agreed(True)
    tp_axis: str = "tp"
    expert_mesh: DeviceMesh | None = None
    expert_placements: Mapping[str, AxisPlacements] | None = None
    ep_axis: str = "ep"
    gradient_reduction: str = _agreed("mean")
    bucket_size: int | None = _agreed(None)
    plan_fn: Callable[[str, nn.Parameter], str] | None = None
    offload_policy: OffloadPolicy | None = None
    collectives: Collectives | None = None
    graph_safe: bool = _agreed(False)
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None
    ignored_params: frozenset | None = None
    sync_module_states: bool = _agreed(False)
    check_module_states: str = _agreed("warn")  # weight_origin.CHECK_MODES, resolved

    @property
    def model_parallel_axes(self) -> tuple[str, str]:
        """The mesh axes that are no data parallelism: ``(tp_axis, ep_axis)``."""
        return (self.tp_axis, self.ep_axis)

    def axis_placements(self, axis_names: tuple[str, ...] | None) -> dict[str, AxisPlacements]:
        """Each data-parallel axis's placements on a mesh with these axis names (``None``: the default 1-D mesh):
        ``placements.resolve_axis_placements`` with this call's arguments and model-parallel axes. The build
        (``arguments.resolve_placements``) and the rank-consistency check both resolve through here, so the
        check compares (and names) what the build will use."""
        return resolve_axis_placements(axis_names, self.placements, self.strategy, self.outer_dp_sharding_strategy,
                                       self.model_parallel_axes)

    @classmethod
    def from_call(cls, arguments: Mapping[str, Any], **resolved: Any) -> "FullyShardOptions":
        """The options of one ``fully_shard`` call: each field from the call's argument of the same name
        (``arguments``, its locals), or from ``resolved`` where the call resolved or translated it first."""
        return cls(**{f.name: resolved[f.name] if f.name in resolved else arguments[f.name]
                      for f in dataclasses.fields(cls)})

    def must_agree(self) -> dict[str, Any]:
        """The options every rank of a mesh must pass alike (the fields marked :func:`_agreed`) that the
        consistency check does not already read as meshes, placements, units or the expert plan."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("agree")}
