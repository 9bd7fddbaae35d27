"""FP8 training through torchao: which linears compute in FP8, and which weights shardwise gathers in FP8.

``convert_to_fp8(model, "tensorwise")`` (before ``fully_shard``) swaps each
chosen linear for torchao's ``Float8Linear``: plain ``nn.Linear`` modules and
the classes models register as ``registry.LINEAR`` (shardwise's own linears,
which keep their own initialization, so a meta-device build still equals a
direct one). ``filter_fn(module, fqn)`` picks them; the default keeps the
output head (``"output"``) in bf16 and skips linears whose sizes FP8 matmuls
cannot take (not multiples of 16). The parameters keep their names and
shapes, and hold no FP8 state: checkpoints and exports are those of the
unconverted model.

With the tensorwise recipe and ``all_gather=True`` (opt-in) the weights are also
marked for shardwise's FP8 all-gather (``shardwise.engine.quantized_gather``): the linear then
receives the gathered e4m3 weight and its shared scale and does not cast it again. A weight tied to
a module that is not an FP8 linear is not marked (it gathers in bf16; the FP8
linear casts it). Rowwise scales each row of each matmul operand by itself, so
its weights gather in bf16.

torchao is optional: ``pip install 'shardwise[fp8]'``.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from .model_ops import is_sharded
from .quantized_gather import GATHER_ATTR, Fp8Tensorwise
from .registry import LINEAR, module_types

__all__ = ["RECIPES", "DEFAULT_SKIP", "INSTALL_HINT", "Fp8Conversion", "require_torchao", "skip_modules",
           "default_filter", "convert_to_fp8", "quiet_torchao_import"]

RECIPES = ("tensorwise", "rowwise")
DEFAULT_SKIP = ("output", "lm_head")  # the GPT head, a Hugging Face head
INSTALL_HINT = "pip install 'shardwise[fp8]' (torchao>=0.17)"
_ALIGN = 16  # FP8 matmuls (torch._scaled_mm) need both sizes to be multiples of 16
_INIT_ATTRS = ("init_std", "rank", "tp", "group")  # what the models' reset_parameters read


@contextlib.contextmanager
def quiet_torchao_import():
    """torchao's import reports its optional CUDA kernels (and triton) missing on a CPU build, and torch a
    deprecated registration of torchao's; FP8 training needs none of it (nor does transformers, which imports
    torchao when it is installed), so those notices are dropped."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*triton.*")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def require_torchao():
    """``torchao.float8``, or an ``ImportError`` of one line saying how to install it."""
    try:
        with quiet_torchao_import():
            import torchao.float8 as float8
            from torchao.float8.float8_linear import Float8Linear  # noqa: F401
    except ImportError as e:
        raise ImportError(f"FP8 training needs torchao, which is not importable here ({e}); {INSTALL_HINT}") from None
    return float8


def _features(module: nn.Module) -> tuple[int, int]:
    out_features, in_features = module.weight.shape
    return in_features, out_features


def _unaligned(module: nn.Module) -> str | None:
    in_features, out_features = _features(module)
    if in_features % _ALIGN or out_features % _ALIGN:
        return f"in_features={in_features}, out_features={out_features} are not multiples of {_ALIGN}"
    return None


def skip_modules(*names: str) -> Callable[[nn.Module, str], bool]:
    """A ``filter_fn`` that converts every linear FP8 can take except those named (an fqn, or its last part:
    ``"output"`` matches ``output`` and ``lm.output``)."""
    wanted = tuple(names)

    def keep(module: nn.Module, fqn: str) -> bool:
        last = fqn.rsplit(".", 1)[-1]
        return fqn not in wanted and last not in wanted and _unaligned(module) is None

    keep.skips = wanted  # shown in the conversion's summary
    return keep


default_filter = skip_modules(*DEFAULT_SKIP)
"""The output head (``output``, ``lm_head``) stays bf16 (its logits feed the loss; FP8 there costs accuracy),
as do unaligned linears."""


@dataclass
class Fp8Conversion:
    """What ``convert_to_fp8`` did: the linears converted, those left alone (and why), the weights marked
    for the FP8 all-gather."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    fp8_gathered: list[str] = field(default_factory=list)

    def describe(self) -> str:
        kept = ", ".join(f"{name} ({why})" for name, why in self.skipped.items()) or "none"
        gather = f"{len(self.fp8_gathered)} weights gathered in FP8" if self.fp8_gathered else "weights gathered in bf16"
        return f"fp8 {self.recipe}: {len(self.converted)} linears in FP8, {gather}; kept in bf16: {kept}"


def _candidates(model: nn.Module, float8_linear: type) -> list[tuple[str, nn.Module]]:
    kinds = (nn.Linear,) + module_types(LINEAR)
    return [(fqn, m) for fqn, m in model.named_modules()
            if fqn and isinstance(m, kinds) and not isinstance(m, float8_linear)]


def _swap(module: nn.Module, config, float8_linear: type) -> nn.Module:
    """A ``Float8Linear`` holding ``module``'s own parameter objects (their marks and values kept)."""
    in_features, out_features = _features(module)
    with torch.device("meta"):  # no storage: the parameters are the old module's
        new = float8_linear(in_features, out_features, bias=False, config=config)
    new.weight = module.weight
    new.bias = getattr(module, "bias", None)
    if not isinstance(module, nn.Linear):  # a registered linear: its own initialization, not nn.Linear's
        for name in _INIT_ATTRS:
            if hasattr(module, name):
                setattr(new, name, getattr(module, name))
        new.reset_parameters = types.MethodType(type(module).reset_parameters, new)
    new.train(module.training)
    return new


def _wrap_for(module: nn.Module, training_tensor: type, weight_role) -> Callable:
    config = module.linear_mm_config

    def wrap(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return training_tensor(data, scale, dtype, config, gemm_input_role=weight_role)

    return wrap


def convert_to_fp8(
    model: nn.Module,
    recipe: str = "tensorwise",
    *,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    all_gather: bool = False,
) -> Fp8Conversion:
    """Swap ``model``'s chosen linears for torchao ``Float8Linear`` s in place (call before ``fully_shard``).

    ``recipe``: ``"tensorwise"`` or ``"rowwise"`` (torchao's recipes). ``filter_fn(module, fqn)`` returns
    whether to convert a linear (default :data:`default_filter`: all but the output head and unaligned
    sizes). ``all_gather=True`` (tensorwise only) marks the converted weights for shardwise's FP8 weight
    all-gather: half the gathered bytes, for several GPUs. It is off by default: on one GPU it moves no
    bytes and a compiled 0.9B step with it measured 0.66-0.92x of the bf16 gather's tokens/s (host
    time around its Float8TrainingTensor parameters; ``docs/performance.md``, "FP8"). Returns what
    was done (:class:`Fp8Conversion`).
    """
    if recipe not in RECIPES:
        raise ValueError(f"convert_to_fp8(recipe={recipe!r}): use one of {', '.join(RECIPES)}")
    if all_gather and recipe != "tensorwise":
        raise ValueError(f"convert_to_fp8(recipe={recipe!r}, all_gather=True): the FP8 weight all-gather is built "
                         "for tensorwise scaling only (one scale per weight); rowwise weights gather in bf16")
    if is_sharded(model):
        raise ValueError(f"{type(model).__name__} is already sharded by fully_shard; convert it to FP8 before "
                         "fully_shard")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"convert_to_fp8(filter_fn={filter_fn!r}): filter_fn must be callable (module, fqn) -> bool")
    float8 = require_torchao()
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    chosen = filter_fn or default_filter
    result = Fp8Conversion(recipe)
    for fqn, module in _candidates(model, Float8Linear):
        if not chosen(module, fqn):
            result.skipped[fqn] = _unaligned(module) or "filter"
            continue
        if getattr(module, "tp", 1) != 1:
            raise ValueError(f"{fqn}: FP8 linears under tensor parallelism (tp={module.tp}) are not built; "
                             "leave them out with filter_fn")
        why = _unaligned(module)
        if why:
            raise ValueError(f"{fqn}: {why}, which FP8 matmuls need; leave it out with filter_fn")
        parent_name, _, attr = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, _swap(module, config, Float8Linear))
        result.converted.append(fqn)
    if all_gather:
        result.fp8_gathered = _mark_weights(model, Float8Linear, Float8TrainingTensor, GemmInputRole.WEIGHT)
    return result


def _mark_weights(model: nn.Module, float8_linear: type, training_tensor: type, weight_role) -> list[str]:
    """Mark for the FP8 gather every FP8 linear's weight that no other kind of module also holds."""
    holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((f"{fqn}.{attr}" if fqn else attr, module, attr))
    marked = []
    for entries in holders.values():
        name, module, attr = entries[0]
        if all(isinstance(m, float8_linear) and a == "weight" for _, m, a in entries):
            setattr(module.weight, GATHER_ATTR, Fp8Tensorwise(_wrap_for(module, training_tensor, weight_role)))
            marked.append(name)
    return marked
