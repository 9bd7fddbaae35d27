"""``shardwise bench``: shardwise against PyTorch FSDP2, DDP and megatron-fsdp, one job, same model and data.

* :mod:`.sizes`: the models (``tiny`` for CPU; ``0.9b``, ``2.8b``, ``8b`` for GPUs);
* :mod:`.wrappers`: one function per wrapper, ``wrap_<name>(model, device) -> (model, optimizer)``;
* :mod:`.runner`: training, timing, memory and exposed-communication measurement;
* :mod:`.report`: JSON, markdown table and bar chart;
* :mod:`.pipeline`: ``--pp N``, a pipeline of shardwise stages (tokens/s, bubble, activations against the estimate);
* :mod:`.cli`: the command (``shardwise bench``, ``python -m shardwise bench``).
"""

from .runner import BenchOptions, exposed_length, interval_length, merge_intervals, run_benchmark
from .sizes import SIZES, BenchSize
from .wrappers import WRAPPERS

__all__ = ["BenchOptions", "BenchSize", "SIZES", "WRAPPERS", "run_benchmark", "merge_intervals",
           "interval_length", "exposed_length"]
