"""Cost models for MetaSchedule's search: the world model, and a timing wrapper for any model."""

from __future__ import annotations

import time

import numpy as np
import tvm.s_tir.meta_schedule as ms
from tvm.ir.utils import derived_object


@derived_object
class TimedCostModel(ms.cost_model.PyCostModel):
    """Delegate to another cost model and count the seconds spent inside it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seconds_spent = 0.0
        self.predicted = 0

    def load(self, path: str) -> None:
        self.inner.load(path)

    def save(self, path: str) -> None:
        self.inner.save(path)

    def update(self, context, candidates, results) -> None:
        start = time.perf_counter()
        self.inner.update(context, candidates, results)
        self.seconds_spent += time.perf_counter() - start

    def predict(self, context, candidates) -> np.ndarray:
        start = time.perf_counter()
        scores = self.inner.predict(context, candidates)
        self.seconds_spent += time.perf_counter() - start
        self.predicted += len(candidates)
        return scores
