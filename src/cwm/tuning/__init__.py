"""Tuning: MetaSchedule search with a choice of cost model, data collection and measurement."""

from __future__ import annotations

from .collect import collect
from .cost_model import WorldModelCostModel
from .tuner import TuneResult, tune, tune_layout_tasks

__all__ = [
    "TuneResult",
    "WorldModelCostModel",
    "collect",
    "tune",
    "tune_layout_tasks",
]
