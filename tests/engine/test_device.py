"""The one device rule (``shardwise.engine.device.device_for``), in one process.

A gloo run on a CUDA host must keep everything on the CPU: the mesh, the
meta-device materialization, the RNG tracker and ``fully_shard``'s buffers all
ask ``device_for`` and so agree. CUDA is faked (``torch.cuda.is_available``
and ``current_device`` patched); nothing here touches a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import shardwise
from shardwise.engine import materialize, mesh as mesh_module, rng
from shardwise.engine.device import device_for


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA host: CUDA is available and the current device is 3."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


@pytest.fixture
def gloo_group():
    """A 1-process gloo default group, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_backend_names(fake_cuda):
    assert device_for("nccl") == torch.device("cuda", 3)
    assert device_for("gloo") == torch.device("cpu")  # whatever hardware is present
    assert device_for("cpu:gloo,cuda:nccl") == torch.device("cuda", 3)
    with pytest.raises(TypeError, match="device_for takes a DeviceMesh"):
        device_for(3)


def test_no_process_group_follows_the_hardware(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_for() == torch.device("cuda", 1)
    assert materialize.default_device() == torch.device("cuda", 1)
    assert mesh_module.default_device_type() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_for() == torch.device("cpu")
    assert materialize.default_device() == torch.device("cpu")
    assert rng.RNGStatesTracker().device_type == "cpu"


def test_gloo_on_a_cuda_host_is_the_cpu_everywhere(fake_cuda, gloo_group):
    group = dist.group.WORLD
    assert device_for() == device_for(group) == torch.device("cpu")
    mesh = shardwise.build_dp_mesh()
    assert mesh.device_type == "cpu"  # mesh and materialize agree
    assert device_for(mesh) == materialize.default_device() == torch.device("cpu")
    assert mesh_module.default_device_type() == "cpu"
    assert rng.RNGStatesTracker().device_type == "cpu"

    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    model.register_buffer("scale", torch.ones(2, device="cpu"))
    init = shardwise.MetaInitializer(model)
    assert init.device == torch.device("cpu")
    init.plan()
    shardwise.fully_shard(model, unit_modules=[nn.Linear], init_fn=init)
    init.finish()
    devices = {p.to_local().device for p in model.parameters()} | {b.device for b in model.buffers()}
    assert devices == {torch.device("cpu")}
    assert {g.device for g in model.sharded_state.groups} == {torch.device("cpu")}
    out = model(torch.randn(3, 4))
    out.sum().backward()
    assert all(p.grad is not None and p.grad.to_local().device.type == "cpu" for p in model.parameters())


def test_a_cuda_mesh_is_the_current_cuda_device(fake_cuda):
    class CudaMesh(DeviceMesh):  # the rule reads only a mesh's device type
        device_type = "cuda"

    assert device_for(object.__new__(CudaMesh)) == torch.device("cuda", 3)
