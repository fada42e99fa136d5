"""Scheduling actions (MetaSchedule trace instructions as JSON, replay, trace keys) and TensorIR helpers."""

from __future__ import annotations

from .actions import (
    actions_from_trace_json,
    changes_ir,
    model_actions,
    replay,
    replay_states,
    trace_key,
    trace_to_json,
)
from .tir import block_names, workload_module
from .transfer import TRANSFER_FILE, TransferSource, write_transfer_schedules

__all__ = [
    "TRANSFER_FILE",
    "TransferSource",
    "actions_from_trace_json",
    "block_names",
    "changes_ir",
    "model_actions",
    "replay",
    "replay_states",
    "trace_key",
    "trace_to_json",
    "workload_module",
    "write_transfer_schedules",
]
