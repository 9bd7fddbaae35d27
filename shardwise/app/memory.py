"""The old home of the memory estimate, kept for its public names.

There is one memory model, the planner's (``shardwise/app/plan/``): the trace is its truth, and the reference
GPT's analytical estimate is its fast path, now ``plan/estimate.py`` (re-exported here). This machine's
measured memory (``host_available_bytes``, ``host_peak_bytes``, ...) is ``host_memory.py``'s.
"""

from .host_memory import host_available_bytes, host_peak_bytes, host_resident_bytes, reset_host_peak
from .plan.estimate import (INTERPRETER_BYTES, OPTIMIZER_TEMPS, Activations, DoesNotFit, activation_bytes,
                            check_fits, check_fits_on_cpu, cpu_bytes, estimate_for_run, gpt_units)

__all__ = ["Activations", "activation_bytes", "gpt_units", "estimate_for_run", "check_fits", "DoesNotFit",
           "host_available_bytes", "OPTIMIZER_TEMPS", "check_fits_on_cpu", "cpu_bytes", "INTERPRETER_BYTES",
           "host_peak_bytes", "host_resident_bytes", "reset_host_peak"]
