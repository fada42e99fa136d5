"""Features of a trajectory: the action vocabulary and action features, and loop-nest features."""

from __future__ import annotations

from .action_features import (
    STRUCT_NAMES,
    encode_actions,
    encode_actions_batch,
    structured_features_batch,
)
from .loop_nest import SCHEDULE_FEATURE_NAMES, schedule_features

__all__ = [
    "SCHEDULE_FEATURE_NAMES",
    "STRUCT_NAMES",
    "encode_actions",
    "encode_actions_batch",
    "schedule_features",
    "structured_features_batch",
]
