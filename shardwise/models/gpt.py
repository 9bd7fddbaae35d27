"""The decoder model: embedding, a stack of layers from the layer pattern, norm, head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import GPTConfig
from .context_parallel import global_token_mean, zigzag_positions
from .mamba import MambaLayer
from .norm_rope import RMSNorm, rope_tables
from .tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_tp_region,
    group_rank,
    group_size,
)
from .transformer import MoETransformerLayer, TransformerLayer

__all__ = ["GPT", "init_weights", "LAYER_CLASSES"]

LAYER_CLASSES = {"A": TransformerLayer, "E": MoETransformerLayer, "M": MambaLayer}


def init_weights(model: nn.Module) -> None:
    """Initialize ``model`` by calling each module's ``reset_parameters`` in ``modules()`` order.

    Every module initializes only the tensors it holds itself, so this is the one
    place that sets the order in which the default RNG is consumed: a model built
    on ``meta``, materialized with ``to_empty`` and passed here after
    ``torch.manual_seed(s)`` equals one built directly after the same seed.

    A module whose own tensors are all on ``meta`` is left alone: there are no values to write, meta
    ops draw nothing from the RNG, and torch's meta ``normal_``/``arange`` import ``torch._dynamo``
    (about as long as importing torch), paid by every process that only counts a model's parameters
    (the ``shardwise train`` launcher's memory estimate, ``shardwise plan``).
    """
    for module in model.modules():
        if hasattr(module, "reset_parameters") and not _all_meta(module):
            module.reset_parameters()


def _all_meta(module: nn.Module) -> bool:
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return bool(own) and all(t.is_meta for t in own)


def run_layers(layers, x, rope_cos, rope_sin, recompute: bool):
    """``x`` through ``layers`` in order (each recomputed in backward when ``recompute``), and the MoE layers'
    load-balancing losses (the whole GPT's forward and a pipeline stage's share it)."""
    aux = []
    for layer in layers:
        if recompute:
            # A layer that draws no random numbers (dropout 0) recomputes the same without the RNG states
            # stashed and restored: that read of the CUDA generator is what a CUDA graph capture cannot hold.
            draws = getattr(layer, "dropout", 1.0) > 0
            x = checkpoint(layer, x, rope_cos, rope_sin, use_reentrant=False, preserve_rng_state=draws)
        else:
            x = layer(x, rope_cos, rope_sin)
        if isinstance(layer, MoETransformerLayer):
            aux.append(layer.aux_loss)
    return x, aux


class GPT(nn.Module):
    """Llama-style decoder. ``forward(tokens)`` gives logits, ``forward(tokens, targets)`` the loss.

    The loss is the mean cross entropy plus ``moe_aux_loss_coef`` times the summed
    load-balancing losses of the MoE layers (also left on ``self.aux_loss``).
    With ``config.tp_group`` the embedding, attention, MLP and head are split
    over the TP ranks and the logits are gathered to the full vocabulary. With
    ``config.cp_group`` (context parallelism) ``tokens`` and ``targets`` are this CP
    rank's zig-zag slice of each sequence (``context_parallel.zigzag_split``): RoPE
    uses the tokens' global positions, attention sees the whole sequence, the logits
    are this rank's tokens' and the loss is the token mean over whole sequences.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        config.validate()
        self.cp = group_size(config.cp_group)
        if self.cp > 1 and set(config.layer_kinds) != {"A"}:
            raise NotImplementedError(
                f"layer_pattern={config.layer_pattern!r}: context parallelism (cp_group of {self.cp} ranks) is built "
                "for attention layers (A) only; MoE (E, its load-balancing loss) and Mamba (M, its scan) are not yet")
        self.config = config
        tp, std = config.tp_group, config.init_std
        self.embed = VocabParallelEmbedding(config.vocab_size, config.dim, group=tp, init_std=std)
        self.layers = nn.ModuleList(LAYER_CLASSES[kind](config) for kind in config.layer_kinds)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = None if config.tie_embeddings else ColumnParallelLinear(
            config.dim, config.vocab_size, group=tp, gather_output=True, init_std=std)
        half = config.head_dim // 2
        self.register_buffer("rope_cos", torch.empty(config.max_seq_len, half), persistent=False)
        self.register_buffer("rope_sin", torch.empty(config.max_seq_len, half), persistent=False)
        self.aux_loss = None
        init_weights(self)

    def reset_parameters(self) -> None:
        """Recompute the RoPE tables (GPT holds no parameters of its own)."""
        cos, sin = rope_tables(self.config.max_seq_len, self.config.head_dim,
                               self.config.rope_theta, device=self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, tokens, targets=None):
        if tokens.shape[1] * self.cp > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1] * self.cp} > max_seq_len={self.config.max_seq_len}")
        x = F.dropout(self.embed(tokens), self.config.dropout, self.training)
        recompute = self.config.activation_checkpointing and self.training and torch.is_grad_enabled()
        cos, sin = self.rope_cos, self.rope_sin
        if self.cp > 1:  # this rank's tokens sit at their global positions
            positions = zigzag_positions(tokens.shape[1], group_rank(self.config.cp_group), self.cp, cos.device)
            cos, sin = cos[positions], sin[positions]
        x, aux = run_layers(self.layers, x, cos, sin, recompute)
        x = self.norm(x)
        if self.output is not None:
            logits = self.output(x)
        else:
            local = F.linear(copy_to_tp_region(x, self.config.tp_group), self.embed.weight)
            logits = gather_from_tp_region(local, self.config.tp_group)
        self.aux_loss = torch.stack(aux).sum() if aux else None
        if targets is None:
            return logits
        if self.cp > 1:
            token_losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            loss = global_token_mean(token_losses, (targets != -100).sum().float(), self.config.cp_group)
        else:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if self.aux_loss is not None:
            loss = loss + self.config.moe_aux_loss_coef * self.aux_loss
        return loss

    def num_params(self) -> int:
        """Parameters of the whole model (tied weights once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x params + 12 x layers x dim x seq (attention)."""
        c = self.config
        return 6 * self.num_params() + 12 * c.n_layers * c.dim * seq_len
