"""Megatron-Core on a CPU: ``scripts/megatron_lm_check.py``'s patches, for test bodies in gloo workers.

``megatron_on_the_cpu()`` points the CUDA calls Megatron-Core makes while building a
model, its Megatron-FSDP chunk and its ``DistributedOptimizer`` at the CPU (see the
script's ``cuda_on_the_cpu`` and ``cuda_tensors_on_the_cpu``); with CUDA it changes nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util

from tests.helpers import REPO

_SCRIPT = REPO / "scripts" / "megatron_lm_check.py"


def check_script():
    """``scripts/megatron_lm_check.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("megatron_lm_check", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def megatron_on_the_cpu():
    script = check_script()
    with script.cuda_on_the_cpu(), script.cuda_tensors_on_the_cpu():
        yield
