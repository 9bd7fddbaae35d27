"""Megatron-LM's own entry point with ``use_in_megatron()``: what it builds, checked; what it passes, recorded.

Every rank imports ``pretrain_gpt.py`` from the Megatron-LM tree given by
``--megatron-lm`` (its own ``megatron/core`` too) and calls ``use_in_megatron()``
after those imports, where docs/megatron.md puts the one added line. Then, for each
command line of :data:`CASES` (a tiny GPT, mock data, Megatron-FSDP with every
sharding strategy, with and without ``--use-cpu-initialization``, with
``--overlap-grad-reduce --overlap-param-gather``, HSDP, NCCL user buffers), Megatron-LM's own:

1. ``parse_args`` + ``validate_args`` + ``set_global_variables`` on ``pretrain_gpt.py``'s
   command line, ``_initialize_distributed`` (model-parallel groups from the arguments)
   and ``_set_random_seed`` (``initialize_megatron`` without its kernel builds);
2. the model part of its ``setup_model_and_optimizer``: ``core_transformer_config_from_args``,
   the model builder (``get_model`` in 0.16, ``GPTModelBuilder`` / ``dist_utils`` in 0.19)
   with ``pretrain_gpt.py``'s own model provider and the DDP config as ``training.py``
   builds it (Megatron's optimizer allocates on ``'cuda'`` by name: left for the GPU);
3. its ``train`` for zero iterations: the set-up before the loop, where ``training.py``
   installs ``no_sync_func`` / ``grad_sync_func`` / ``param_sync_func`` on the model
   config when ``isinstance(model[0], (megatron_FSDP, DDP))``;

and checks that each chunk is shardwise's, that every ``megatron.*`` module's binding
of Megatron's class (``training.py``'s ``megatron_FSDP`` included) and ``unwrap_model``
see it (``unwrap_model`` stops at ``chunk.module``, the Megatron-FSDP level, as it stops at
Megatron's adapter's ``MegatronFSDP``), and that the sync functions are the chunks'. ``--record FILE`` writes the
``TransformerConfig`` / ``DistributedDataParallelConfig`` values the chunks were given
(Megatron's own objects, ``chunk.config`` / ``chunk.ddp_config``: JSON-plain fields, dtypes
as ``torch.<name>``) under the tree's version, for
``tests/megatron/test_megatron_lm_configs.py``. Run under ``torchrun`` (4 processes:
HSDP needs two replicas of two):

    torchrun --standalone --nproc-per-node 4 scripts/megatron_lm_check.py --megatron-lm PATH [--record FILE]

Megatron-LM needs its own requirements (``six``, ``triton`` to import
``megatron.training``). On a machine without CUDA (``gloo``), the CUDA calls the steps
above make are pointed at the CPU (:func:`cuda_on_the_cpu`: streams, ``.cuda()``, the
RNG state, a Hopper device's properties), so the chunks are built on the CPU; with CUDA
nothing is patched and ``nccl`` is used. Megatron-LM core_r0.19 needs Python 3.12
(``typing.override``): on 3.11 it is given ``typing_extensions.override``, the same
decorator. Prints one JSON line on rank 0: per case, the chunk types and the checks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[1]

# the command line every case shares: pretrain_gpt.py on mock data, the local (non-TE) layers
BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 1e-3 --min-lr 1e-4 --seed 1234 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion --bf16 "
    "--use-megatron-fsdp --use-distributed-optimizer --ckpt-format fsdp_dtensor"
)
ZERO3 = "--data-parallel-sharding-strategy optim_grads_params"
OVERLAP = "--overlap-grad-reduce --overlap-param-gather"
CASES = {
    "zero3_cpu_init": f"{ZERO3} --use-cpu-initialization",
    "zero3": ZERO3,
    "zero3_overlap": f"{ZERO3} {OVERLAP}",
    "zero2_overlap": f"--data-parallel-sharding-strategy optim_grads {OVERLAP}",
    "zero1_overlap": f"--data-parallel-sharding-strategy optim {OVERLAP} --use-cpu-initialization",
    "zero0": "--data-parallel-sharding-strategy no_shard",
    "hsdp_overlap": f"{ZERO3} --num-distributed-optimizer-instances 2 {OVERLAP}",
    # NCCL user buffers, as every published Megatron-FSDP configuration has them (0.19 turns on
    # --fsdp-manual-registration and --fsdp-double-buffer with --use-nccl-ub itself; 0.16 needs the first)
    "zero3_nccl_ub": f"{ZERO3} {OVERLAP} --use-nccl-ub --fsdp-manual-registration --fsdp-double-buffer",
}


# ------------------------------------------------------------------ the tree and the CPU
def put_on_path(tree: Path) -> None:
    """The tree first on ``sys.path`` (as ``python pretrain_gpt.py`` run from it has it): its ``megatron``."""
    sys.path.insert(0, str(tree))
    if sys.version_info < (3, 12):
        import typing

        import typing_extensions

        typing.override = getattr(typing, "override", typing_extensions.override)


@contextlib.contextmanager
def cuda_on_the_cpu():
    """Where there is no CUDA, point the CUDA calls Megatron-LM makes while building at the CPU.

    torch has CPU stand-ins for streams (``torch.cpu.Stream``, ``stream``,
    ``current_stream``, ``synchronize``); ``current_device()`` becomes ``"cpu"`` (where
    Megatron allocates ``device=torch.cuda.current_device()``), ``Module.cuda()`` leaves
    the module where it is, the RNG state is the CPU generator's, ``device_count()`` is 1
    (one GPU per process: Megatron then builds its model-parallel groups and RNG tracker
    as on a GPU) and a device's properties are a Hopper's (``validate_args`` reads the
    arch). ``torch.cuda.is_available()`` stays False. With CUDA, nothing is patched.
    """
    if torch.cuda.is_available():
        yield
        return
    patches = {
        (torch.cuda, "current_device"): lambda: "cpu",
        (torch.cuda, "device_count"): lambda: 1,
        (torch.cuda, "Stream"): torch.cpu.Stream,
        (torch.cuda, "stream"): torch.cpu.stream,
        (torch.cuda, "current_stream"): torch.cpu.current_stream,
        (torch.cuda, "synchronize"): torch.cpu.synchronize,
        (torch.cuda, "get_rng_state"): lambda device="cuda": torch.get_rng_state(),
        (torch.cuda, "set_rng_state"): lambda state, device="cuda": torch.set_rng_state(state),
        (torch.cuda.random, "get_rng_state"): lambda device="cuda": torch.get_rng_state(),
        (torch.cuda.random, "set_rng_state"): lambda state, device="cuda": torch.set_rng_state(state),
        (torch.cuda, "get_device_properties"): lambda device=None: types.SimpleNamespace(
            major=9, minor=0, name="cpu (as Hopper)", total_memory=0),
        (torch.nn.Module, "cuda"): lambda self, device=None: self,
    }
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def shared_process_groups(groups: dict):
    """Without CUDA: every process group Megatron-LM (or shardwise) asks ``torch.distributed.new_group`` for is
    made once per member ranks, backend and options, kept in ``groups`` (the caller's, one per process), and
    handed out again: to later set-ups, and to a set-up's other groups over the same ranks. With CUDA, nothing
    is changed.

    Each Megatron set-up (``initialize_model_parallel``) asks for about 60 groups (a rank a member of about 24)
    over at most 7 different sets of ranks at 4 processes. A gloo group is a TCP connection to each member and
    3 threads, and its device loop wakes 100 times a second (a rank holding 60 idle groups: 6,000 context
    switches a second); ``destroy_model_parallel`` forgets them without destroying them, so made anew per
    set-up they piled up, and the kernel's share of the CPU with them. The groups hold no state a checkpoint
    or a step reads (a gloo collective matches its peers by its order on the group, and every rank issues
    them in one program order), so a set-up over shared groups is the set-up Megatron makes. A call with
    ``pg_options`` is passed through (options are objects, not compared here).
    """
    if torch.cuda.is_available():
        yield
        return
    make = dist.new_group
    signature = inspect.signature(make)

    def new_group(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        if call.arguments["pg_options"] is not None:
            return make(*args, **kwargs)
        key = tuple((name, tuple(value) if name == "ranks" and value is not None else value)
                    for name, value in call.arguments.items() if name != "group_desc")
        if key not in groups:
            groups[key] = make(*args, **kwargs)
        return groups[key]

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = make


class _CudaTensorsOnTheCpu(TorchFunctionMode):
    """Tensors asked for on ``device='cuda'`` by name come on the CPU; ``Tensor.cuda()`` stays put."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_tensors_on_the_cpu():
    """Where there is no CUDA, what Megatron-Core's optimizer allocates on ``'cuda'`` by name goes to the CPU.

    ``MixedPrecisionOptimizer`` makes its loss-scale tensor with ``device='cuda'``;
    with this (a ``TorchFunctionMode``, torch's own hook on its functions) and
    :func:`cuda_on_the_cpu`, ``get_megatron_optimizer`` builds Megatron's real
    ``DistributedOptimizer`` on the CPU. With CUDA, nothing is changed.
    """
    if torch.cuda.is_available():
        yield
        return
    with _CudaTensorsOnTheCpu():
        yield


def megatron_lm_version() -> str:
    """The tree's own ``megatron.core`` version (core_r0.16.0 says 0.16.2, core_r0.19.0 0.19.0)."""
    from megatron.core.package_info import __version__

    return __version__


# ------------------------------------------------------------------ recording
def plain_fields(obj) -> dict:
    """The dataclass fields of a Megatron config whose values are JSON-plain (dtypes as ``torch.<name>``)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, torch.dtype):
            out[f.name] = str(value)
        elif isinstance(value, tuple) and all(isinstance(v, (str, int, float, bool)) for v in value):
            out[f.name] = {"tuple": list(value)}
        elif value is None or isinstance(value, (str, int, float, bool)):
            out[f.name] = value
        elif isinstance(value, list) and all(isinstance(v, (str, int, float, bool)) for v in value):
            out[f.name] = value
    return out


# ------------------------------------------------------------------ one case
def _megatron_classes() -> tuple:
    """Megatron's own Megatron-FSDP classes (kept before ``use_in_megatron`` replaces the names)."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    return tuple(getattr(mcore_fsdp_adapter, n) for n in ("FullyShardedDataParallel", "FullyShardedDataParallelV1",
                                                           "FullyShardedDataParallelV2") if hasattr(mcore_fsdp_adapter, n))


def _bindings_of(classes: tuple) -> list[str]:
    """``module.name`` of every ``megatron.*`` module attribute that is one of ``classes``."""
    return sorted(
        f"{module_name}.{name}"
        for module_name, module in list(sys.modules.items())
        if module_name.startswith("megatron.") and module is not None
        for name, value in list(vars(module).items())
        if any(value is c for c in classes)
    )


def _setup(cmdline: str) -> None:
    """This check's flags (``BASE``) and ``cmdline`` through :func:`parse_and_initialize`."""
    parse_and_initialize([*BASE.split(), *cmdline.split()])


def parse_and_initialize(argv: list[str]) -> None:
    """Megatron-LM's own argument parsing and distributed set-up (``initialize_megatron`` minus its kernel builds)."""
    from megatron.training import arguments, global_vars, initialize

    sys.argv = ["pretrain_gpt.py", *argv]
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}  # pretrain_gpt.py's
    if hasattr(arguments, "parse_and_validate_args"):  # 0.19
        arguments.parse_and_validate_args(args_defaults=defaults)
    else:
        args = arguments.parse_args()
        arguments.validate_args(args, defaults)
        global_vars.set_global_variables(args)
    args = global_vars.get_args()
    initialize._initialize_distributed(None, None, None)
    initialize._set_random_seed(args.seed, args.data_parallel_random_init, args.te_rng_tracker,
                                args.inference_rng_tracker)


def _teardown() -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training import global_vars

    parallel_state.destroy_model_parallel()
    destroy_num_microbatches_calculator()
    global_vars.unset_global_variables()


def _build():
    """``pretrain_gpt.py``'s model, as Megatron-LM's ``setup_model_and_optimizer`` builds it.

    0.16: ``get_model`` over ``pretrain_gpt.py``'s model provider; 0.19: the config
    container ``pretrain_gpt.py`` builds and its ``GPTModelBuilder.build_distributed_models``
    (``dist_utils``), with the arguments ``setup_model_and_optimizer`` gives it.
    """
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import get_args, training

    args = get_args()
    if hasattr(pretrain_gpt, "gpt_config_from_args"):  # 0.19
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        from megatron.core.process_groups_config import ProcessGroupCollection

        cfg = pretrain_cfg_container_from_args(args, pretrain_gpt.gpt_config_from_args(args))
        builder = cfg.model.get_builder_cls()(cfg.model)
        return pretrain_gpt, builder.build_distributed_models(
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),  # what pretrain passes
            ddp_config=cfg.ddp,
            overlap_param_gather_with_optimizer_step=cfg.optimizer.overlap_param_gather_with_optimizer_step,
            use_megatron_fsdp=cfg.dist.use_megatron_fsdp,
            use_torch_fsdp2=cfg.dist.use_torch_fsdp2,
            wrap_with_ddp=True,
            data_parallel_random_init=cfg.rng.data_parallel_random_init,
        )
    from functools import partial

    provider = partial(pretrain_gpt.model_provider, pretrain_gpt.gpt_builder)
    return pretrain_gpt, training.get_model(provider, ModelType.encoder_or_decoder)


class _OptimizerLeftForTheGPU:
    """What ``train`` reads of the optimizer before its loop (``scale_loss``, never called here).

    Megatron's ``get_megatron_optimizer`` allocates on ``device='cuda'`` by name
    (``MixedPrecisionOptimizer``), which no patch points at the CPU: it is left for the GPU runs.
    """

    def scale_loss(self, loss):
        raise AssertionError("the training loop must not run here")


def _train_zero_iterations(pretrain_gpt, model):
    """Megatron-LM's ``train`` with nothing left to run: its set-up, where it installs the sync functions."""
    from megatron.core.utils import get_model_config
    from megatron.training import get_args, training

    args = get_args()
    args.iteration = args.num_floating_point_operations_so_far = 0  # as setup_model_and_optimizer sets them
    args.train_iters = args.iteration  # with no checkpoint to load; and the loop body never runs
    config = get_model_config(model[0])
    training.train(pretrain_gpt.forward_step, model, _OptimizerLeftForTheGPU(), None, None, None, None, config, {},
                   None)
    return config


def _sync_function(fn, chunk) -> str | None:
    """``"chunk.no_sync"`` where ``fn`` is that bound method of the chunk, ``None`` where unset."""
    if fn is None:
        return None
    owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", repr(fn))
    return f"chunk.{name}" if owner is chunk else repr(fn)


def _sync_expected(args) -> dict:
    """What ``train`` installs for a Megatron-FSDP chunk under these arguments (``training.py``'s rule)."""
    overlap = bool(args.overlap_grad_reduce)
    return {
        "no_sync_func": "chunk.no_sync" if overlap else None,
        "grad_sync_func": "chunk.start_grad_sync" if overlap and args.align_grad_reduce else None,
        "param_sync_func": "chunk.start_param_sync" if args.overlap_param_gather and args.align_param_gather else None,
    }


def case_failures(result: dict) -> list[str]:
    """What is wrong with one case's result (empty: Megatron-LM builds and recognises shardwise's chunk)."""
    wrong = []
    if not result["shardwise"]:
        wrong.append(f"chunks are {result['chunk']}, not shardwise's")
    if not result["megatron_FSDP"]:
        wrong.append("training.py's megatron_FSDP does not see the chunk")
    if result["unwrap_model"] != "MegatronFSDPLevel":  # as it stops at Megatron's adapter's MegatronFSDP
        wrong.append(f"unwrap_model stops at {result['unwrap_model']}, not at the chunk's Megatron-FSDP level")
    if result["megatrons_class_still_bound"]:
        wrong.append(f"Megatron's class still bound at {result['megatrons_class_still_bound']}")
    if result["sync"] != result["sync_expected"]:
        wrong.append(f"sync functions {result['sync']}, training.py's rule gives {result['sync_expected']}")
    if not result["finalize_model_grads_func"]:
        wrong.append("finalize_model_grads_func is not Megatron's finalize_model_grads")
    return wrong


def run_case(cmdline: str, megatron_classes: tuple) -> dict:
    """One command line through Megatron-LM (steps 1-3 above), and what it built."""
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args, training

    from shardwise.megatron import FullyShardedDataParallelV1, FullyShardedDataParallelV2

    _setup(cmdline)
    try:
        pretrain_gpt, model = _build()
        config = _train_zero_iterations(pretrain_gpt, model)
        args = get_args()
        chunk = model[0]
        ours = (FullyShardedDataParallelV1, FullyShardedDataParallelV2)
        return {
            "chunk": [type(c).__name__ for c in model],
            "shardwise": all(isinstance(c, ours) for c in model),
            "megatron_FSDP": isinstance(chunk, training.megatron_FSDP),
            "unwrap_model": type(unwrap_model(chunk)).__name__ if unwrap_model(chunk) is chunk.module else "?",
            "megatrons_class_still_bound": _bindings_of(megatron_classes),
            "sync": {name: _sync_function(getattr(config, name), chunk)
                     for name in ("no_sync_func", "grad_sync_func", "param_sync_func")},
            "sync_expected": _sync_expected(args),
            "finalize_model_grads_func": config.finalize_model_grads_func is training.finalize_model_grads,
            "strategy": chunk.ddp_config.data_parallel_sharding_strategy,
            "config": {"TransformerConfig": plain_fields(chunk.config),
                       "DistributedDataParallelConfig": plain_fields(chunk.ddp_config)},
        }
    finally:
        _teardown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", type=Path, required=True, help="a Megatron-LM tree (core_r0.16 .. core_r0.19)")
    parser.add_argument("--record", type=Path, help="merge the configs into this JSON file (tests/helpers/data/...)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    opts = parser.parse_args()
    tree = opts.megatron_lm.resolve()
    record_path = opts.record.resolve() if opts.record else None
    put_on_path(tree)
    sys.path.insert(1, str(REPO))
    os.chdir(tree)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    results = {}
    with cuda_on_the_cpu():
        megatron_classes = _megatron_classes()
        import pretrain_gpt  # noqa: F401  (its imports: megatron.training.training and the rest)
        from shardwise.megatron import use_in_megatron

        names = use_in_megatron()  # the one added line
        replaced = names.names
        try:
            for name in opts.cases:
                results[name] = run_case(CASES[name], megatron_classes)
        finally:
            names.restore()
        results_restored = _bindings_of(megatron_classes)
    version = megatron_lm_version()
    failures = {name: case_failures(r) for name, r in results.items() if case_failures(r)}
    if "megatron.training.training.megatron_FSDP" not in replaced:
        failures["use_in_megatron"] = [f"training.py's megatron_FSDP not replaced; replaced: {replaced}"]
    if not set(replaced) <= set(results_restored):
        failures["restore"] = [f"restore() left {sorted(set(replaced) - set(results_restored))} shardwise's"]
    if dist.get_rank() == 0:
        summary = {"megatron_lm": version, "python": sys.version.split()[0], "torch": torch.__version__,
                   "world": dist.get_world_size(), "replaced": replaced, "failures": failures,
                   "cases": {k: {f: v for f, v in r.items() if f != "config"} for k, r in results.items()}}
        if record_path:
            record = json.loads(record_path.read_text()) if record_path.exists() else {}
            record[version] = {"world": dist.get_world_size(), "base": BASE,
                               "cases": {k: {"cmdline": CASES[k], **r["config"]} for k, r in results.items()}}
            record_path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(json.dumps(summary, sort_keys=True), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
