"""Pre-norm decoder layers: attention followed by a dense or mixture-of-experts MLP."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .config import GPTConfig
from .mlp import MLP
from .moe import MoE
from .norm_rope import RMSNorm

__all__ = ["TransformerLayer", "MoETransformerLayer"]


class TransformerLayer(nn.Module):
    """``x + attn(norm(x))``, then ``+ mlp(norm(.))`` (layer letter "A")."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.dropout = config.dropout
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = self._build_mlp(config)

    def _build_mlp(self, config: GPTConfig) -> nn.Module:
        return MLP(config)

    def forward(self, x, cos, sin):
        x = x + F.dropout(self.attention(self.attention_norm(x), cos, sin), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout, self.training)


class MoETransformerLayer(TransformerLayer):
    """Same layer with the MLP replaced by experts (layer letter "E").

    ``aux_loss`` is the load-balancing loss of the latest forward.
    """

    def _build_mlp(self, config: GPTConfig) -> nn.Module:
        return MoE(config)

    @property
    def aux_loss(self):
        return self.mlp.aux_loss
