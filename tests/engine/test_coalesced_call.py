"""Over NCCL a layer's per-parameter collectives are one call into the process group.

The GPU runs check the values (the torch-tools and parity tests over NCCL);
these check the call itself on a stand-in group: one call per transition, with
every parameter's tensors, synchronous, averaging, under either of torch's
names for it (2.13 renamed them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.engine.collectives import gather_pieces, reduce_scatter_pieces
from shardwise.engine.mesh import AxisGroup


class _Work:
    def __init__(self):
        self.waited = False

    def wait(self):
        self.waited = True


class _Group:
    """Records the coalesced calls it receives, under the method names it is given."""

    def __init__(self, *names: str):
        self.calls = []
        for name in names:
            setattr(self, name, lambda outs, ins, options, name=name: self._record(name, outs, ins, options))

    def _record(self, name, outs, ins, options):
        work = _Work()
        self.calls.append((name, outs, ins, options, work))
        return work


def _pieces(n: int, sizes=(3, 5, 2)):
    ins = [torch.zeros(s) for s in sizes]
    outs = [torch.zeros(n * s) for s in sizes]
    return outs, ins


def test_gather_is_one_synchronous_call_with_every_parameter():
    group = _Group("all_gather_single_coalesced", "allgather_into_tensor_coalesced")
    outs, ins = _pieces(2)
    gather_pieces(outs, ins, AxisGroup("dp", group, 2, 0, True))
    assert len(group.calls) == 1
    name, got_outs, got_ins, options, work = group.calls[0]
    assert name == "all_gather_single_coalesced"
    assert [t is o for t, o in zip(got_outs, outs)] == [True] * 3 and [t is i for t, i in zip(got_ins, ins)] == [True] * 3
    assert options.asyncOp is False and work.waited


def test_reduce_scatter_averages_in_one_call_under_torch_2_11s_name():
    group = _Group("reduce_scatter_tensor_coalesced")  # torch 2.11 has only the old name
    outs, ins = _pieces(2)
    ins, outs = outs, ins  # reduce-scatter: full inputs, piece outputs
    reduce_scatter_pieces(outs, ins, AxisGroup("dp", group, 2, 0, True))
    assert len(group.calls) == 1
    name, _, _, options, work = group.calls[0]
    assert name == "reduce_scatter_tensor_coalesced"
    assert options.reduceOp == dist.ReduceOp.AVG and options.asyncOp is False and work.waited


def test_no_parameters_no_call():
    group = _Group("all_gather_single_coalesced", "reduce_scatter_single_coalesced")
    axis = AxisGroup("dp", group, 2, 0, True)
    gather_pieces([], [], axis)
    reduce_scatter_pieces([], [], axis)
    assert group.calls == []
