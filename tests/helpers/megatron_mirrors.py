"""What a mirror of a Megatron-Core config class declares, for the checks against Megatron's own classes."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any


def mirrored_fields(cls) -> dict[str, tuple[str, Any]]:
    """``{field: (annotation, default)}`` of one mirror class (``shardwise.megatron.config``)."""
    return {f.name: (str(f.type), None if f.default is MISSING else f.default) for f in fields(cls)}
