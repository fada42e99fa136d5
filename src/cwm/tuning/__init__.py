"""Tuning: MetaSchedule search with a choice of cost model, data collection and measurement.

The world model's cost model is ``cwm.tuning.cost_model.WorldModelCostModel``; it is not re-exported
here, since defining it imports TVM.
"""

from __future__ import annotations

from .collect import collect
from .registry import cost_model_names, create_cost_model
from .tuner import TuneResult, tune, tune_layout_tasks

__all__ = [
    "TuneResult",
    "collect",
    "cost_model_names",
    "create_cost_model",
    "tune",
    "tune_layout_tasks",
]
