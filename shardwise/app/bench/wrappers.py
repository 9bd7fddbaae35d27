"""The data-parallel wrappers the benchmark compares, one function each.

Each ``wrap_<name>(model, device, **options)`` takes a freshly built fp32
:class:`shardwise.models.GPT` (already on ``device``, process group initialized)
and returns ``(model, optimizer)``: a module whose ``model(inputs, targets)``
is the loss in bf16 compute, and an AdamW over whatever parameters the wrapper
exposes. Every wrapper keeps fp32 main weights, reduces gradients in fp32 and
computes in bf16; the optimizer settings are the same for all (:func:`make_optimizer`).
The exception is ``none``, the compute-only ceiling: bf16 weights, each rank
training its own replica, no communication at all.

``compile=<torch.compile kwargs>`` compiles each transformer layer's forward,
the same layers under every wrapper that supports it: shardwise through
``shardwise.compile_units`` (after ``fully_shard``; its hooks stay outside the
graphs), the others torchtitan's way, ``torch.compile(layer)`` put back in its
parent before the wrapper is applied (FSDP2 then shards the compiled layer, so
its hooks are outside the graph too).

megatron-fsdp is a benchmark peer only: it is imported when installed and never
vendored; :func:`unavailable_reason` says why a wrapper cannot run here.
"""

from __future__ import annotations

import functools

import importlib.util
from dataclasses import fields
from typing import Callable

import torch
from torch import nn

__all__ = ["WRAPPERS", "DEFAULT_ORDER", "CEILING", "COMPILES", "LR", "CLIP_MODES", "make_optimizer", "make_clip",
           "unavailable_reason",
           "wrapper_version", "compile_layers", "wrap_shardwise", "wrap_shardwise_fsdp2_idiom",
           "wrap_shardwise_optimizer_in_backward",
           "wrap_fsdp2", "wrap_ddp", "wrap_none", "wrap_megatron_fsdp"]

LR = 1e-4
# No weight decay: megatron-fsdp's fully_shard_optimizer takes one step on zero
# gradients to create the optimizer state; without decay that step moves nothing.
WEIGHT_DECAY = 0.0
DEFAULT_ORDER = ("fsdp2", "shardwise", "ddp", "megatron-fsdp", "none")
CEILING = "none"  # the compute-only ceiling every other wrapper is also compared with


def make_optimizer(params, device: torch.device) -> torch.optim.Optimizer:
    """AdamW, lr 1e-4: one fused kernel per step on CUDA, the foreach kernels on CPU."""
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **impl)


CLIP_MODES = ("fold", "in-place")


def make_clip(name: str, model: nn.Module, optimizer, max_norm: float,
              mode: str = "fold") -> tuple[Callable[[], None] | None, str | None]:
    """What clips wrapper ``name``'s gradients to ``max_norm`` between backward and step, and how it
    applies the factor (``(None, None)``: no clipping).

    shardwise: ``shardwise.clip_grad_norm_``, the factor folded into the optimizer's step with
    ``mode="fold"`` when the optimizer is fused (on CUDA), else the gradients scaled in place; the
    others: ``torch.nn.utils.clip_grad_norm_``, in place.
    """
    if max_norm <= 0:
        return None, None
    params = [p for p in model.parameters() if p.requires_grad]
    if name.startswith("shardwise"):
        import shardwise
        from shardwise.engine.optim import takes_clip_factor

        fold = optimizer if mode == "fold" and takes_clip_factor(optimizer) else None
        return (lambda: shardwise.clip_grad_norm_(params, max_norm, optimizer=fold)), ("fold" if fold else "in-place")
    return (lambda: torch.nn.utils.clip_grad_norm_(params, max_norm)), "in-place"


def _layers(model: nn.Module) -> list[nn.Module]:
    from ...models import UNIT_MODULES

    return [m for m in model.modules() if isinstance(m, UNIT_MODULES)]


def compile_layers(model: nn.Module, compile: dict) -> list[nn.Module]:
    """``torch.compile(layer, **compile)`` in place of each layer in its parent (torchtitan's way).

    Returns the compiled layers (``OptimizedModule``): a wrapper applied to them
    afterwards puts its hooks around the compiled call, never inside it.
    """
    targets = {id(m) for m in _layers(model)}
    compiled = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                wrapped = torch.compile(child, **compile)
                parent.register_module(name, wrapped)
                compiled.append(wrapped)
    return compiled


# ------------------------------------------------------------------ shardwise
def wrap_shardwise(model: nn.Module, device: torch.device, strategy: str = "optim_grads_params",
                   compile: dict | None = None, offload: float = 0.0, grad_comm_dtype: torch.dtype | None = None,
                   graph_safe: bool = False, bf16_main: bool = False, shard_placement_fn=None):
    """shardwise.fully_shard: each layer, the embedding and the output head are units.

    ``offload``: the share of the parameters whose main weights and optimizer state live on the host.
    ``grad_comm_dtype``: the dtype gradients travel in (``None``: fp32, like the other wrappers); they are
    accumulated in fp32 either way. ``graph_safe``: for a step captured in a CUDA graph (``bench/graphs.py``).
    ``bf16_main``: main weights, gradients and so AdamW state in bf16, the ceiling's numerical recipe (the
    wrapper's own cost against :func:`wrap_none`, without fp32 main weights' extra work).
    ``shard_placement_fn``: ``fully_shard``'s (``--optimizer muon``: the layers' matrices ``Owned()``).
    """
    import shardwise

    unit_types = list(dict.fromkeys(type(m) for m in _layers(model)))
    units = unit_types + [m for m in (model.embed, model.output) if m is not None]
    model = shardwise.fully_shard(model, unit_modules=units, shard_placement_fn=shard_placement_fn,
                                  **_shardwise_options(strategy, offload, grad_comm_dtype, graph_safe, bf16_main))
    if compile is not None:  # the layers, as for the other wrappers (not the embedding or head)
        shardwise.compile_units(model, modules=unit_types, **compile)
    return model, make_optimizer(model.parameters(), device)


def _shardwise_options(strategy: str, offload: float, grad_comm_dtype: torch.dtype | None, graph_safe: bool,
                       bf16_main: bool) -> dict:
    import shardwise

    return dict(
        strategy=strategy, graph_safe=graph_safe,
        mixed_precision=shardwise.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, grad_comm_dtype=grad_comm_dtype,
            **({"main_params_dtype": torch.bfloat16, "main_grads_dtype": torch.bfloat16} if bf16_main else {})),
        offload_policy=shardwise.OffloadPolicy(fraction=offload) if offload else None)


def wrap_shardwise_fsdp2_idiom(model: nn.Module, device: torch.device, strategy: str = "optim_grads_params",
                               compile: dict | None = None, offload: float = 0.0,
                               grad_comm_dtype: torch.dtype | None = None, graph_safe: bool = False,
                               bf16_main: bool = False):
    """As :func:`wrap_shardwise`, written in FSDP2's idiom: ``shardwise.fully_shard`` on each layer, the
    embedding and the output head, then on the root (the same units, so the same steps and numbers)."""
    import shardwise

    options = _shardwise_options(strategy, offload, grad_comm_dtype, graph_safe, bf16_main)
    if options["offload_policy"] is not None:
        raise ValueError("offload with the FSDP2 idiom: the offloaded fraction is chosen over the whole model, "
                         "so use the 'shardwise' wrapper (one call) for --offload")
    layers = _layers(model)
    for module in layers + [m for m in (model.embed, model.output) if m is not None]:
        shardwise.fully_shard(module, **options)
    shardwise.fully_shard(model, **options)
    if compile is not None:
        shardwise.compile_units(model, modules=list(dict.fromkeys(type(m) for m in layers)), **compile)
    return model, make_optimizer(model.parameters(), device)


def wrap_shardwise_optimizer_in_backward(model: nn.Module, device: torch.device, strategy: str = "optim_grads_params",
                                         compile: dict | None = None, offload: float = 0.0,
                                         grad_comm_dtype: torch.dtype | None = None):
    """As wrap_shardwise, with AdamW stepped per group inside backward (gradients freed at once)."""
    import shardwise

    model, _ = wrap_shardwise(model, device, strategy, compile, offload, grad_comm_dtype)
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return model, shardwise.BackwardOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY, **impl)


# ------------------------------------------------------------------ PyTorch FSDP2
def wrap_fsdp2(model: nn.Module, device: torch.device, compile: dict | None = None, offload: float = 0.0):
    """torch.distributed.fsdp.fully_shard on each layer, then the root; bf16 params, fp32 reduce.

    ``offload`` > 0: ``CPUOffloadPolicy`` (FSDP2 offloads all or nothing: any fraction offloads all).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    # cast_forward_inputs=False: the layers take fp32 RoPE tables, and FSDP2's input cast is
    # not re-applied when activation checkpointing recomputes a layer (dtype mismatch error);
    # shardwise does not cast inputs either, so both compute alike.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    where = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
    for layer in (_layers(model) if compile is None else compile_layers(model, compile)):
        fully_shard(layer, mp_policy=policy, offload_policy=where)
    fully_shard(model, mp_policy=policy, offload_policy=where)
    return model, make_optimizer(model.parameters(), device)


# ------------------------------------------------------------------ DDP
class AutocastForward(nn.Module):
    """Runs the wrapped module's forward under ``torch.autocast(bf16)``; backward runs outside."""

    def __init__(self, module: nn.Module, device_type: str):
        super().__init__()
        self.module = module
        self.device_type = device_type

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.module(*args, **kwargs)


def wrap_ddp(model: nn.Module, device: torch.device, compile: dict | None = None):
    """DistributedDataParallel over fp32 weights, forward under bf16 autocast."""
    from torch.nn.parallel import DistributedDataParallel

    if compile is not None:
        compile_layers(model, compile)
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True)
    return AutocastForward(ddp, device.type), make_optimizer(ddp.parameters(), device)


def _bf16_parameters(model: nn.Module) -> None:
    """Cast parameters (not buffers: the RoPE tables stay fp32) to bf16 in place."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)


# ------------------------------------------------------------------ the ceiling
def wrap_none(model: nn.Module, device: torch.device, compile: dict | None = None):
    """The compute-only ceiling: bf16 weights, gradients and AdamW state, each rank its own replica.

    No communication and no fp32 main weights: the same forward and backward as
    every other wrapper (bf16 compute, the same layers compiled or not) with the
    cheapest optimizer step, so no data-parallel wrapper can be faster. Its loss
    differs from FSDP2's by the bf16 rounding of the weight updates.
    """
    _bf16_parameters(model)
    if compile is not None:
        compile_layers(model, compile)
    return model, make_optimizer(model.parameters(), device)


class Fp32MainOptimizer:
    """AdamW over fp32 main copies of a bf16 model's weights: the classic mixed-precision recipe, no wrapper.

    Backward leaves bf16 gradients on the bf16 weights; ``step`` copies them into fp32 gradient buffers, steps
    AdamW on the fp32 main weights (its state fp32 too: the optimizer bytes of shardwise's default recipe) and
    copies the result back into the bf16 weights. ``param_groups`` and ``state`` are the inner AdamW's, so a
    captured step (``bench/graphs.py``) makes it capturable as it does any optimizer.
    """

    def __init__(self, params, device: torch.device):
        self.params = [p for p in params if p.requires_grad]
        self.main = [nn.Parameter(p.detach().float()) for p in self.params]
        for m in self.main:
            m.grad = torch.zeros_like(m)  # kept: filled from the bf16 gradients every step
        self.inner = make_optimizer(self.main, device)
        self.param_groups, self.state, self.defaults = self.inner.param_groups, self.inner.state, self.inner.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)

    @torch.no_grad()
    def step(self, closure=None):
        with_grads = [(m, p) for m, p in zip(self.main, self.params) if p.grad is not None]
        if with_grads:
            torch._foreach_copy_([m.grad for m, _ in with_grads], [p.grad for _, p in with_grads])
        self.inner.step()
        torch._foreach_copy_([p for p in self.params], self.main)

    def state_dict(self) -> dict:
        return self.inner.state_dict()


def wrap_none_fp32_main(model: nn.Module, device: torch.device, compile: dict | None = None):
    """The ceiling with shardwise's optimizer bytes: bf16 weights computing, fp32 main weights, gradients and
    AdamW state beside them (:class:`Fp32MainOptimizer`), each rank its own replica, no communication. The fair
    mark for shardwise's default recipe (fp32 main weights), as ``none`` is for its bf16 one."""
    _bf16_parameters(model)
    if compile is not None:
        compile_layers(model, compile)
    return model, Fp32MainOptimizer(model.parameters(), device)


# ------------------------------------------------------------------ megatron-fsdp


def wrap_megatron_fsdp(model: nn.Module, device: torch.device):
    """megatron_fsdp.fully_shard_model, ZeRO-3, fp32 main weights and grads, bf16 compute.

    megatron-fsdp computes in the dtype of the model's own parameters, so they
    are cast to bf16 first (the fp32 main weights are made from them); the
    layers are its units. Its ``fully_shard_optimizer`` takes one step on zero
    gradients to create the Adam state; the step counters are reset afterwards
    so every wrapper's first real step has the same bias correction.
    """
    import megatron_fsdp

    layer_types = list(dict.fromkeys(type(m) for m in _layers(model)))
    _bf16_parameters(model)
    names = {f.name for f in fields(megatron_fsdp.MixedPrecisionPolicy)}
    policy_kwargs = {"main_params_dtype": torch.float32, "main_grads_dtype": torch.float32,
                     "grad_comm_dtype": torch.float32}
    policy = megatron_fsdp.MixedPrecisionPolicy(**{k: v for k, v in policy_kwargs.items() if k in names})
    wrapped = megatron_fsdp.fully_shard_model(
        module=model, fsdp_unit_modules=layer_types, zero_dp_strategy="optim_grads_params",
        device=device, mixed_precision_policy=policy)
    optimizer = megatron_fsdp.fully_shard_optimizer(make_optimizer(wrapped.parameters(), device))
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0
    return wrapped, optimizer


WRAPPERS: dict[str, Callable] = {
    "fsdp2": wrap_fsdp2,
    "fsdp2-fp8ag": wrap_fsdp2,  # with --fp8 tensorwise: torchao's FP8 all-gather (bench/fp8.py converts the model)
    "shardwise": wrap_shardwise,
    "shardwise-fsdp2-idiom": wrap_shardwise_fsdp2_idiom,
    "shardwise-fp8ag": wrap_shardwise,  # with --fp8 tensorwise: shardwise gathering FP8 bytes
    "shardwise-obo": wrap_shardwise_optimizer_in_backward,
    "shardwise-bf16main": functools.partial(wrap_shardwise, bf16_main=True),  # the ceiling's recipe, against none
    "ddp": wrap_ddp,
    "megatron-fsdp": wrap_megatron_fsdp,
    "none": wrap_none,
    "none-fp32main": wrap_none_fp32_main,
}
COMPILES = ("fsdp2", "fsdp2-fp8ag", "shardwise", "shardwise-fsdp2-idiom", "shardwise-fp8ag", "shardwise-obo",
            "shardwise-bf16main", "ddp", "none", "none-fp32main")  # the wrappers that take compile=


def unavailable_reason(name: str, device: torch.device, compiled: bool = False, fp8: str = "off") -> str | None:
    """Why wrapper ``name`` cannot run on ``device`` (compiled, in FP8 mode ``fp8``, when asked; ``None`` when
    it can)."""
    from .fp8 import unavailable_reason as fp8_reason

    if name not in WRAPPERS:
        return f"unknown wrapper (choose from {', '.join(WRAPPERS)})"
    why = fp8_reason(name, fp8)
    if why:
        return why
    if compiled and name not in COMPILES:
        return "no compiled variant in the benchmark"
    if name == "megatron-fsdp":
        if importlib.util.find_spec("megatron_fsdp") is None:
            return "not installed (pip install megatron-fsdp)"
        if device.type != "cuda":
            return "needs CUDA/NCCL (skipped on CPU)"
    return None


def wrapper_version(name: str) -> str:
    """Version string of the code behind wrapper ``name``."""
    if name == "megatron-fsdp":
        if importlib.util.find_spec("megatron_fsdp") is None:
            return "megatron-fsdp not installed"
        try:
            from importlib.metadata import version

            return "megatron-fsdp " + version("megatron-fsdp")
        except Exception:
            return "megatron-fsdp (version unknown)"
    if name.startswith("shardwise"):
        try:
            from importlib.metadata import version

            return "shardwise " + version("shardwise")
        except Exception:
            return "shardwise (source tree)"
    return "torch " + torch.__version__
