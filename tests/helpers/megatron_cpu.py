"""Megatron-Core on a CPU: ``scripts/megatron_lm_check.py``'s patches, for test bodies in gloo workers; the
model-parallel state Megatron-LM sets up and its train step in miniature, shared by the checkpoint tests.

``megatron_on_the_cpu()`` points the CUDA calls Megatron-Core makes while building a
model, its Megatron-FSDP chunk and its ``DistributedOptimizer`` at the CPU (see the
script's ``cuda_on_the_cpu`` and ``cuda_tensors_on_the_cpu``); with CUDA it changes nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util

from tests.helpers import REPO

_SCRIPT = REPO / "scripts" / "megatron_lm_check.py"
# this process's process groups, shared by every megatron_world in it (megatron_lm_check.shared_process_groups)
_GROUPS: dict = {}


def check_script():
    """``scripts/megatron_lm_check.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("megatron_lm_check", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def megatron_on_the_cpu(share_groups: bool = False):
    """The script's CUDA patches; ``share_groups``: its ``shared_process_groups`` too, over this process's
    groups (:data:`_GROUPS`)."""
    script = check_script()
    shared = script.shared_process_groups(_GROUPS) if share_groups else contextlib.nullcontext()
    with script.cuda_on_the_cpu(), script.cuda_tensors_on_the_cpu(), shared:
        yield


@contextlib.contextmanager
def megatron_world(tp: int = 1, instances: int = 1, ep: int = 1):
    """Megatron's model-parallel state on this gloo group (TP ``tp``, EP ``ep``, ``instances`` optimizer
    replicas) on the CPU, with ``use_in_megatron()`` in effect: what Megatron-LM sets up before it builds a
    chunk; torn down after (``destroy_model_parallel``, Megatron's names restored). Without CUDA its process
    groups are the worker's, made at the first set-up that asks for them and handed to every later one
    (``megatron_lm_check.shared_process_groups``): made anew per set-up they piled up, hundreds of gloo
    threads per worker by a file's end."""
    from megatron.core import parallel_state

    from shardwise.megatron import use_in_megatron

    with megatron_on_the_cpu(share_groups=True):
        parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep,
                                                 num_distributed_optimizer_instances=instances)
        names = use_in_megatron()
        try:
            yield
        finally:
            names.restore()
            parallel_state.destroy_model_parallel()


def megatron_train_steps(chunk, optimizer, steps: int, vocab: int, seq: int) -> None:
    """Megatron-LM's train_step in miniature, each data-parallel rank on its own tokens (2 sequences of
    ``seq`` tokens a step): zero the grad buffer, forward and backward, ``finish_grad_sync``, the optimizer."""
    import torch
    import torch.distributed as dist

    position_ids = torch.arange(seq).unsqueeze(0)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
        tokens = torch.randint(0, vocab, (2, seq), generator=generator)
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        chunk(tokens, position_ids, mask, labels=tokens).float().mean().backward()
        chunk.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok
