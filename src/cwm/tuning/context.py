"""MetaSchedule tune contexts for collection and search."""

from __future__ import annotations

import logging

from ..hardware import physical_cores
from ..schedule.actions import trace_key, trace_to_json

log = logging.getLogger(__name__)


def tune_context(task, target, strategy: str, seed: int, num_threads: int | None = None,
                 measured: set[str] | None = None):
    """A TuneContext; with ``measured`` (trace keys), the search skips candidates measured before."""
    import tvm.s_tir.meta_schedule as ms

    search = strategy
    if measured is not None:
        search = _dedup_search(ms.search_strategy.SearchStrategy.create(strategy), measured)
    return ms.TuneContext(
        mod=task.mod,
        target=target,
        space_generator="post-order-apply",
        search_strategy=search,
        task_name=task.name,
        rand_state=seed,
        num_threads=num_threads or physical_cores(),
    )


def _dedup_search(inner, seen: set[str], max_rounds: int = 8):
    """Wrap a search strategy so that it never proposes a candidate whose trace is in ``seen``.

    MetaSchedule's searches do not look at the database for what was measured already (see the
    TODO on ``measured_workloads_`` in evolutionary_search.cc), so a resumed run with the same seed
    re-measures the first run's candidates. Dropped candidates are not reported back: the inner
    search counts trials by the results it is notified of, and it has marked them as picked.
    """
    import tvm.s_tir.meta_schedule as ms
    from tvm.ir.utils import derived_object

    @derived_object
    class DedupSearch(ms.search_strategy.PySearchStrategy):
        def __init__(self, inner, seen):
            self.inner, self.seen, self.dropped = inner, seen, 0

        def _initialize_with_tune_context(self, context):
            self.inner._initialize_with_tune_context(context)

        def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
            self.inner.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database, cost_model)

        def post_tuning(self):
            self.inner.post_tuning()

        def generate_measure_candidates(self):
            for _ in range(max_rounds):
                candidates = self.inner.generate_measure_candidates()
                if candidates is None:
                    return None
                fresh = []
                for cand in candidates:
                    key = trace_key(trace_to_json(cand.sch.trace))
                    if key in self.seen:
                        self.dropped += 1
                    else:
                        self.seen.add(key)
                        fresh.append(cand)
                if fresh:
                    return fresh
            log.info("%d batches in a row held only measured candidates; the search stops", max_rounds)
            return None

        def notify_runner_results(self, measure_candidates, results):
            self.inner.notify_runner_results(measure_candidates, results)

        def clone(self):
            return DedupSearch(self.inner.clone(), set(self.seen))

    return DedupSearch(inner, seen)
