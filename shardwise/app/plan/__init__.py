"""``shardwise plan``: memory and step time of every configuration of a training run, before it runs.

Memory comes from the real model wrapped by ``fully_shard`` in a simulated world (``trace.py``); step time
from a model of compute and collectives one can read (``step_time.py``), with its constants in one place
(``hardware.py``). ``docs/plan.md`` has the model, the constants' sources and the validation.

The library call is ``shardwise.plan(model, gpus=..., ...)`` (``api.py``): the top-level package loads it on
first use, since ``shardwise`` sits below ``app`` in the layers of ``docs/design.md``.
"""

from .api import plan

__all__ = ["plan"]
