"""Stand-alone benchmarks, run from the repository root with ``python -m benchmarks.<name>``.

Measurements behind docs/performance.md that are not ``shardwise bench`` (which lives in
``shardwise/app/bench/`` and is a command of the installed package):

* :mod:`.checkpoint`: a checkpoint save, a resharded load and an export; time and peak host memory;
* :mod:`.hf_load`: ``--init-from``, every rank reading its rows against every rank loading whole files;
* :mod:`.cpu_adam`: torch's AdamW step on the CPU (what an offloaded run's optimizer step costs).

They import ``shardwise`` like any user script; nothing in ``shardwise`` imports them.
"""
