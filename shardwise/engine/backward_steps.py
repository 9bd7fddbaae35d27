"""Where a ``BackwardOptimizer`` steps each group once its gradients are final.

Three places, one per kind of group:

- an offloaded group (main weights and optimizer state on the host): on the CPU, by one
  worker thread, while the autograd thread goes on launching the rest of the backward;
- a group on a GPU: on the reduce stream, right behind the group's reduction, so the
  step (memory bound: an fp32 AdamW pass reads and writes 28 bytes per parameter) runs
  beside the backward of the units before it instead of after it on the compute stream;
- on the CPU without offload (gloo): inline, there are no streams.

``join()`` at the end of a backward (or of an accumulation window) waits for all of them:
the compute stream waits for the reduce stream, so nothing that runs afterwards (the
next forward's gathers, a checkpoint, ``full_tensor``) reads weights a step is still writing.
"""

from __future__ import annotations

import torch

from .collectives import StreamSet

__all__ = ["step_group", "HostSteps", "BackwardSteps"]


def step_group(group, optimizer: torch.optim.Optimizer) -> None:
    """A backward optimizer's step of one ``ParamGroup``: install its grads, step, free them."""
    group.install_grads()
    optimizer.step()
    group.discard_grads()  # the fp32 grad shard is freed right here


class HostSteps:
    """Backward-optimizer steps of offloaded groups, run on the CPU by one worker thread.

    The step of a group waits for its gradients' copy to the host and runs
    while the autograd thread goes on launching the rest of the backward on
    the GPU (the CPU kernels release the GIL); one worker keeps the steps in
    reduction order. ``wait()`` at the end of backward re-raises a step's error.
    """

    def __init__(self):
        self._pool = None
        self._pending: list = []

    def submit(self, group, optimizer: torch.optim.Optimizer) -> None:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-host-step")
        self._pending.append(self._pool.submit(step_group, group, optimizer))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()


class BackwardSteps:
    """Runs each group's backward-optimizer step where it belongs (see the module's docstring)."""

    def __init__(self, streams: StreamSet):
        self.streams = streams
        self.host = HostSteps()
        self._on_side_stream = False

    def submit(self, group, optimizer: torch.optim.Optimizer) -> None:
        """Step ``group``; its reduction has been waited for on the compute stream."""
        if group.offloaded:
            self.host.submit(group, optimizer)
            return
        side = self.streams.reduce
        if side is None:
            step_group(group, optimizer)
            return
        # The step reads the gradient buffer after the group drops it: the allocator must not hand
        # its memory to the compute stream before the reduce stream's queued work has run.
        grads = group.main_grad
        if grads is not None:
            grads.record_stream(side)
        with self.streams.on(side):  # behind everything queued so far on the compute stream
            step_group(group, optimizer)
        self._on_side_stream = True

    def join(self) -> None:
        """Wait for every step submitted: the host's, and (on the compute stream) the reduce stream's."""
        self.host.wait()
        if self._on_side_stream:
            torch.cuda.current_stream().wait_stream(self.streams.reduce)
            self._on_side_stream = False
