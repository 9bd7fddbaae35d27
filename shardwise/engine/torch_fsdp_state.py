"""What torch's own code reads of an FSDP2 module's state, answered by the engine.

Three pieces of torch reach past ``FSDPModule``'s public methods into FSDP2's
state: ``register_fsdp_forward_method`` (``_get_fsdp_state()._pre_forward`` /
``_post_forward``), the pipeline stage's reduce-grad point
(``fully_shard.state(module)._state_ctx.all_states``, each state's
``_fsdp_param_groups[i].post_backward()``, then
``_root_post_backward_final_callback()``) and ``share_comm_ctx`` (each state's
``_comm_ctx``, read from one and set on the others). :class:`TorchStateView`
answers exactly those reads for one shardwise unit module, so torch's
``PipelineStage``, ``register_fsdp_forward_method`` and ``share_comm_ctx`` drive
shardwise units as they drive FSDP2's. :func:`install` registers it where
``torch.distributed.fsdp.fully_shard.state(module)`` looks (and
:func:`state`, ``shardwise.fully_shard.state``, reads it there).

torch's own walks over a model (``_get_managed_modules``: which modules a
``fully_shard`` call manages) ask another registry, the composable API's
module-to-state map, for an ``FSDPState``, and stop at a module that has one.
:func:`install` puts an inert ``FSDPState`` there for each unit module (no
parameter group: a torch root that lists it in its lazy init finds nothing to
gather, reduce or finalize), so torch's ``fully_shard`` on an ancestor leaves
the shardwise units' parameters to shardwise, as it leaves a nested FSDP2
module's to that module.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn
from collections import OrderedDict

from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed._composable_state import _insert_module_state, _module_state_mapping
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

from .step_controller import WindowEnd

__all__ = ["TorchStateView", "install", "state"]

_MARKER_ATTR = "_shardwise_torch_marker"  # keeps the inert FSDPState alive (torch's map holds it weakly)


class _UnitGroupView:
    """One unit, read as torch reads an ``FSDPParamGroup``."""

    def __init__(self, view: "TorchStateView"):
        self._view = view

    def post_backward(self) -> None:
        self._view.state.reduce_unit_now(self._view.unit)

    def lazy_init(self) -> None:
        pass

    def unshard(self, async_op: bool = False) -> None:
        self._view.unit.start_unshard()

    def wait_for_unshard(self) -> None:
        self._view.unit.unshard()

    def reshard(self) -> None:
        self._view.unit.reshard()


class TorchStateView:
    """FSDP2's ``FSDPState`` of one unit module, as far as torch's own callers read it."""

    def __init__(self, module: nn.Module, state_attr: str, unit_attr: str):
        self._module, self._state_attr, self._unit_attr = module, state_attr, unit_attr

    @property
    def state(self):
        return getattr(self._module, self._state_attr)

    @property
    def unit(self):
        return getattr(self._module, self._unit_attr)

    @property
    def _fsdp_param_groups(self) -> list[_UnitGroupView]:
        return [_UnitGroupView(self)]

    @property
    def _comm_ctx(self):
        """The unit's side streams (FSDP2's communication context), as torch's ``share_comm_ctx`` reads them."""
        return self.state.streams

    @_comm_ctx.setter
    def _comm_ctx(self, shared) -> None:
        """torch's ``share_comm_ctx`` hands the first module's context to the others: this model's collectives
        move to ``shared``'s streams."""
        if shared is not self.state.streams:
            self.state.streams.share_side_streams(shared)

    @property
    def _is_root(self) -> bool:
        return self.unit is self.state.root

    def _lazy_init(self) -> None:
        """The engine's state is complete once ``fully_shard`` returns; what FSDP2's lazy init still decides here
        (this unit's role, and its refusals) is the engine's ``lazy_init``, as at the unit's first forward."""
        self.state.lazy_init(self.unit)

    @property
    def _modules_to_run_forward(self) -> set:
        """A grouped unit's modules still to run in this forward (FSDP2 tracks none for one module)."""
        unit = self.unit
        return {m for m in unit.modules if id(m) in unit.modules_to_run} if len(unit.modules) > 1 else set()

    @property
    def _state_ctx(self) -> SimpleNamespace:
        state = self.state
        views = {}
        for unit in [state.root] + state.units:  # FSDP2's order: the root's state first, then the model's order
            view = unit.module.__dict__.get(STATE_KEY, {}).get(torch_fully_shard.__wrapped__)
            if isinstance(view, TorchStateView):
                views[id(unit)] = view
        return SimpleNamespace(all_states=list(views.values()), is_last_backward=state.is_last_backward)

    def _root_post_backward_final_callback(self) -> None:
        self.state.end_window(WindowEnd.MANUAL)

    def _pre_forward(self, module: nn.Module, args, kwargs):
        state, unit = self.state, self.unit
        if unit is state.root:
            return state.root_pre_forward(module, args, kwargs)
        return state.unit_pre_forward(unit, module, args, kwargs)

    def _post_forward(self, module: nn.Module, args, output):
        state, unit = self.state, self.unit
        if unit is state.root:
            return state.root_post_forward(module, args, output)
        return state.unit_post_forward(unit, module, args, output)

    def _reset_iter_state(self) -> None:
        self.state.reset_iteration_state()


def install(module: nn.Module, state_attr: str, unit_attr: str) -> None:
    """Make ``torch.distributed.fsdp.fully_shard.state(module)`` answer with the engine's view, and torch's
    walks over the model (``_get_managed_modules``) stop at ``module`` as at an FSDP2 unit."""
    module.__dict__.setdefault(STATE_KEY, {})[torch_fully_shard.__wrapped__] = TorchStateView(
        module, state_attr, unit_attr)
    # The composable APIs' name registry: torch's ``replicate`` (DDP) leaves a module that has "fully_shard"
    # here to FSDP2, as it leaves FSDP2's units (it would otherwise turn their DTensors into local tensors).
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault("fully_shard", RegistryItem())
    if module not in _module_state_mapping:  # an ancestor's shardwise call installs again: one marker is enough
        marker = module.__dict__[_MARKER_ATTR] = FSDPState()
        _insert_module_state(module, marker)


def state(module: nn.Module):
    """``shardwise.fully_shard.state(module)``: what torch's ``fully_shard.state(module)`` answers, the
    engine's :class:`TorchStateView` for a shardwise unit module (FSDP2's state for a module torch's
    ``fully_shard`` wrapped; ``None`` for any other)."""
    return torch_fully_shard.state(module)
