"""The application built on the library: the ``shardwise`` command and what only it uses.

* :mod:`.cli`: the ``shardwise`` command (``python -m shardwise <command>``);
  it dispatches to ``train``, ``ckpt`` and ``bench``;
* :mod:`.train`: ``shardwise train`` (the command and its worker), with
  :mod:`.errors` (``ConfigError``), :mod:`.config` (flags and checks),
  :mod:`.run_folder`, :mod:`.lr`, :mod:`.resume`, :mod:`.loop` (the steps,
  metrics) and :mod:`.summary`;
  :mod:`.data` (token files, the loader), :mod:`.presets` (model sizes),
  :mod:`.hf_train` (``--hf-config`` / ``--init-from``), :mod:`.corpus` (the
  run's data from its flags), :mod:`.tokenized` (tokenizing, packing, the
  cache), :mod:`.evaluate` (held-out loss), :mod:`.loggers` (TensorBoard, W&B);
* :mod:`.launch`: local worker processes watched like torchrun, error lines;
* :mod:`.ckpt`: ``shardwise ckpt`` (info, verify, export);
* :mod:`.bench`: ``shardwise bench`` (shardwise against FSDP2, DDP and
  megatron-fsdp); the stand-alone benchmarks live in the repository's
  ``benchmarks/`` folder (``python -m benchmarks.<name>``);
* :mod:`.plan`: ``shardwise plan``, and the one memory model (the trace its truth, the reference GPT's
  estimate its fast path: ``plan/estimate.py``, which ``train`` and ``bench`` read); :mod:`.memory`,
  :mod:`.memory_estimate` and :mod:`.pipeline_memory` are that fast path's old homes (re-exports);
  :mod:`.host_memory`: this machine's measured memory; :mod:`.pipeline_order`: the order torch's pipeline
  schedules run a rank's chunks in.

The library (``shardwise``'s engine modules, ``checkpoint/``, ``hf/``,
``megatron/``, ``models/``) never imports from here.
"""
