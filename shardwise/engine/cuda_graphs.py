"""``capture_step``: one training step (every micro-batch, the reductions, optionally clipping and the
optimizer step) captured in a ``torch.cuda.CUDAGraph`` and replayed, the host out of the step.

The name and the arguments follow ``torch.cuda.make_graphed_callables`` (``sample_args``,
``num_warmup_iters``, ``pool``) and ``torch.cuda.graph`` (``capture_error_mode``): the
callable is warmed up, captured once with static inputs, and each call copies new inputs
into them and replays. A sharded model must be wrapped with ``fully_shard(graph_safe=True)``: its
buffers keep their addresses from step to step, which is what a replay writes to (a plain module,
the no-wrapper baseline, is captured by torch's rules alone).

Each warm-up iteration and the capture run ``step_fn`` as written, so whether the captured step
overwrites or adds to the gradients follows the ``.grad`` it finds: start ``step_fn`` with
``optimizer.zero_grad(set_to_none=True)`` (or drop the grads at its end) for a step that
overwrites them, as an eager loop with ``zero_grad`` does.

What the step function may hold: forward and backward (``no_sync`` for all but the last
micro-batch), ``shardwise.clip_grad_norm_`` (in place, or folded into an optimizer stepped in
the same function), and the step of an optimizer that can be captured (``torch.optim.AdamW(...,
fused=True, capturable=True)``; a float ``lr`` is baked into the graph, a tensor ``lr`` can be
changed in place between replays). What runs outside it (an eager ``optimizer.step()`` after
the replay, an evaluation forward) sees the state a real step would leave: each replay puts
back the ``.grad`` tensors the captured step left and marks the weights as changed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn

from .model_ops import is_sharded, sharded_state

__all__ = ["capture_step", "CapturedStep"]


def _check_models(models) -> list[nn.Module]:
    models = [models] if isinstance(models, nn.Module) else list(models)
    if not models:
        raise ValueError("capture_step: models= must name the sharded model(s) the step trains")
    for model in models:
        if not is_sharded(model):  # a plain module (a no-wrapper baseline): torch's own rules, no engine buffers
            off = [n for n, p in model.named_parameters() if not p.is_cuda]
            if off:
                raise RuntimeError(f"capture_step: {type(model).__name__} has parameters off the GPU ({off[:3]}); "
                                   "CUDA graphs capture GPU work only")
            continue
        state = sharded_state(model)
        if not state.graph_safe:
            raise ValueError(f"capture_step: {type(model).__name__} was wrapped with graph_safe=False; its buffers "
                             "are freed and reallocated between steps, so a replay would write to memory it no "
                             "longer owns: wrap it with fully_shard(..., graph_safe=True)")
        if not state.streams.cuda:
            raise RuntimeError(f"capture_step: {type(model).__name__} lives on the CPU (a gloo mesh); CUDA graphs "
                               "capture GPU work only: build the mesh over NCCL on a CUDA device")
    return models


def _static_inputs(sample_args: Sequence[Any]) -> tuple:
    inputs = []
    for i, arg in enumerate(sample_args):
        if isinstance(arg, torch.Tensor):
            if not arg.is_cuda:
                raise ValueError(f"capture_step: sample_args[{i}] is on {arg.device}; the graph reads its inputs "
                                 "from the GPU: pass CUDA tensors")
            inputs.append(arg.detach().clone())
        else:
            inputs.append(arg)  # a constant of the captured step
    return tuple(inputs)


@contextlib.contextmanager
def _fresh_capture_streams() -> Iterator[None]:
    """Autograd nodes that remember a stream outside the capture (made by eager steps before it) take the
    capturing stream instead, where torch has the switch (2.12+); elsewhere the warm-up on the capture
    stream itself keeps them on it."""
    switch = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    if switch is not None:
        switch(True)
    try:
        yield
    finally:
        if switch is not None:
            switch(False)


class CapturedStep:
    """A captured step: ``step(*args)`` copies ``args`` into the static inputs, replays, and returns the
    static outputs (overwritten by the next replay: clone what you keep). ``warmup_outputs``: what each
    warm-up iteration returned (real steps: their losses count)."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", static_inputs: tuple, static_outputs: Any,
                 models: list[nn.Module], grads: list[tuple[nn.Parameter, torch.Tensor | None]]):
        self.graph = graph
        self.static_inputs = static_inputs
        self.static_outputs = static_outputs
        self.models = models
        self.warmup_outputs: list = []
        self.sharded = [m for m in models if is_sharded(m)]
        self._grads = grads

    def __call__(self, *args: Any) -> Any:
        if len(args) != len(self.static_inputs):
            raise ValueError(f"captured step: {len(args)} inputs given, the step was captured with "
                             f"{len(self.static_inputs)}")
        for i, (static, new) in enumerate(zip(self.static_inputs, args)):
            if isinstance(static, torch.Tensor):
                if not isinstance(new, torch.Tensor) or new.shape != static.shape or new.dtype != static.dtype:
                    got = f"{tuple(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else type(new).__name__
                    raise ValueError(f"captured step: input {i} is {got}; the graph was captured with "
                                     f"{tuple(static.shape)} {static.dtype} (a new shape needs a new capture)")
                static.copy_(new, non_blocking=True)
        self.graph.replay()
        for param, grad in self._grads:  # what the captured step left (zero_grad may have dropped them since)
            param.grad = grad
        for model in self.sharded:  # the replay may have stepped the optimizer: eager forwards rebuild weights
            model.mark_weights_modified()
        return self.static_outputs


def capture_step(
    step_fn: Callable[..., Any],
    sample_args: Sequence[Any] = (),
    *,
    models: nn.Module | Iterable[nn.Module],
    num_warmup_iters: int = 2,
    pool=None,
    capture_error_mode: str = "thread_local",
) -> CapturedStep:
    """Capture ``step_fn(*sample_args)`` (a whole training step of ``models``) in a CUDA graph.

    ``num_warmup_iters`` real steps run first (on the capture stream, outside the graph: they train,
    and give the engine its unit order, the optimizer its state and the static buffers their
    addresses), then one capture (which computes nothing). ``capture_error_mode``: torch's
    (``thread_local`` by default: autograd and NCCL's watchdog run in threads of their own).
    ``pool``: ``torch.cuda.graph_pool_handle()`` shared with other graphs.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("capture_step needs CUDA: a CUDA graph records GPU kernels, and this process has no "
                           "CUDA device (torch.cuda.is_available() is False)")
    models = _check_models(models)
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(f"capture_step: num_warmup_iters={num_warmup_iters!r} must be an int >= 1 (the first step "
                         "records the units' order and creates the optimizer state)")
    static_inputs = _static_inputs(sample_args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    warmup_outputs = []
    with torch.cuda.stream(stream):
        for _ in range(num_warmup_iters):
            warmup_outputs.append(step_fn(*static_inputs))
    torch.cuda.current_stream().wait_stream(stream)
    sharded = [m for m in models if is_sharded(m)]
    for model in sharded:  # the captured step starts from changed weights, as every replay will
        model.mark_weights_modified()
        sharded_state(model).remake_buffers_in_capture()
    graph = torch.cuda.CUDAGraph()
    with _fresh_capture_streams():
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            static_outputs = step_fn(*static_inputs)
    grads = [(p, p.grad) for model in models for p in model.parameters()]
    for model in sharded:
        model.mark_weights_modified()
    captured = CapturedStep(graph, static_inputs, static_outputs, models, grads)
    captured.warmup_outputs = warmup_outputs
    return captured
