"""SwiGLU feed-forward block: ``w2(silu(w1 x) * w3 x)``, hidden width split over TP."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, scaled_init_std

__all__ = ["MLP"]


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        group, std, hidden = config.tp_group, config.init_std, config.ffn_hidden
        self.w1 = ColumnParallelLinear(config.dim, hidden, group=group, init_std=std)  # gate
        self.w3 = ColumnParallelLinear(config.dim, hidden, group=group, init_std=std)  # up
        self.w2 = RowParallelLinear(hidden, config.dim, group=group,
                                    init_std=scaled_init_std(std, config.n_layers))

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
