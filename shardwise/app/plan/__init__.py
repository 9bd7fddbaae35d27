"""``shardwise plan``: memory and step time of every configuration of a training run, before it runs.

Memory has one model, this package's: the real model wrapped by ``fully_shard`` in a simulated world
(``trace.py``) is its truth, and the reference GPT's analytical estimate (``estimate.py``, ``engine_bytes.py``,
``pipeline_estimate.py``) its fast path: the planner rules out with it what cannot fit before tracing, and
``shardwise train``'s pre-launch check (``fit.py``) and ``shardwise bench`` read their numbers from it. Step time
comes from a model of compute and collectives one can read (``step_time.py``), with its constants in one place
(``hardware.py``). ``docs/plan.md`` has the model, the constants' sources and the validation.

The library call is ``shardwise.plan(model, gpus=..., ...)`` (``api.py``): the top-level package loads it on
first use, since ``shardwise`` sits below ``app`` in the layers of ``docs/design.md``; this package loads it on
first use too, so the fast path's users (a training worker) do not import the tracer.
"""

__all__ = ["plan"]


def __getattr__(name: str):
    if name == "plan":
        from .api import plan

        globals()["plan"] = plan
        return plan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
