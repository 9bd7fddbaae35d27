"""Which parameters AdamW decays in ``shardwise train``: the matrices, not embeddings, norms or biases.

One rule for both ways a run builds its model (one sharded model, or pipeline stages cut from the
whole GPT): the names are the whole model's, read before it is sharded or cut.
"""

from __future__ import annotations

import torch

__all__ = ["decayed_names", "param_groups"]


def decayed_names(model: torch.nn.Module) -> set[str]:
    """The names of ``model``'s matrices that are not embeddings (GPT's ``embed.``, HF's ``embed_tokens``...)."""
    embeddings = {
        f"{module_name}.{name}" if module_name else name
        for module_name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)
        for name, _ in module.named_parameters(recurse=False)
    }
    return {n for n, p in model.named_parameters()
            if p.dim() >= 2 and not n.startswith("embed.") and n not in embeddings}


def param_groups(model: torch.nn.Module, decayed: set[str], weight_decay: float) -> list[dict]:
    """AdamW's two groups over ``model``'s parameters: those named in ``decayed``, and the rest (no decay)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if name in decayed else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
