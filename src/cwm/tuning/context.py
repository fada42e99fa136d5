"""MetaSchedule tune contexts for collection and search."""

from __future__ import annotations

import logging

from ..hardware import physical_cores
from ..schedule.actions import trace_key, trace_to_json

log = logging.getLogger(__name__)


def tune_context(task, target, strategy: str, seed: int, num_threads: int | None = None,
                 measured: set[str] | None = None, seeds: list | None = None, population_size: int | None = None):
    """A TuneContext; with ``measured`` (trace keys), the search skips candidates measured before, and
    ``seeds`` (schedules of the task without postprocessing, e.g. ``cwm.tuning.transfer``) are measured
    first, before anything the search proposes. ``population_size``: the evolutionary search's
    (None: MetaSchedule's default, 512)."""
    import tvm.s_tir.meta_schedule as ms

    search = strategy
    if population_size is not None:  # checked by the caller (tune)
        search = ms.search_strategy.EvolutionarySearch(population_size=population_size)
    if measured is not None or seeds:
        inner = search if population_size is not None else ms.search_strategy.SearchStrategy.create(strategy)
        search = _dedup_search(inner, measured if measured is not None else set(), seeds or [])
    return ms.TuneContext(
        mod=task.mod,
        target=target,
        space_generator="post-order-apply",
        search_strategy=search,
        task_name=task.name,
        rand_state=seed,
        num_threads=num_threads or physical_cores(),
    )


def search_one_task(context, *, trials: int, per_iter: int, work_dir, builder, runner, database, cost_model,
                    callbacks) -> None:
    """MetaSchedule's search of one task for ``trials`` measurements, in batches of at most ``per_iter``."""
    import tvm.s_tir.meta_schedule as ms

    ms.tune_tasks(tasks=[context], task_weights=[1.0], work_dir=str(work_dir), max_trials_global=trials,
                  max_trials_per_task=trials, num_trials_per_iter=min(per_iter, trials), builder=builder,
                  runner=runner, database=database, cost_model=cost_model, measure_callbacks=callbacks,
                  task_scheduler="round-robin")


def _dedup_search(inner, seen: set[str], seeds: list, max_rounds: int = 8):
    """Wrap a search strategy so that it never proposes a candidate whose trace is in ``seen``, and so
    that its first batch is ``seeds`` (postprocessed here; those that fail a postprocessor are dropped).

    MetaSchedule's searches do not look at the database for what was measured already (see the
    TODO on ``measured_workloads_`` in evolutionary_search.cc), so a resumed run with the same seed
    re-measures the first run's candidates. Dropped candidates are not reported back: the inner
    search counts trials by the results it is notified of, and it has marked them as picked.
    """
    import tvm.s_tir.meta_schedule as ms
    from tvm.ir.utils import derived_object

    @derived_object
    class DedupSearch(ms.search_strategy.PySearchStrategy):
        def __init__(self, inner, seen, seeds):
            self.inner, self.seen, self.dropped = inner, seen, 0
            self.seeds, self.context = list(seeds), None

        def _initialize_with_tune_context(self, context):
            self.context = context
            self.inner._initialize_with_tune_context(context)

        def _seed_candidates(self):
            """The seeds as measure candidates; the inner search counts them as its own trials
            (``notify_runner_results``), so they come out of the task's budget."""
            seeds, self.seeds = self.seeds, []
            out = []
            for sch in seeds:
                # As MetaSchedule does: the marker lets a replay of the stored trace drop the postprocessors'
                # instructions (RewriteLayout's TransformLayout) and run them anew. Without it the evolutionary
                # search replayed a seed's TransformLayout onto its mutants and failed a check in TVM.
                sch.enter_postproc()
                if not all(p.apply(sch) for p in self.context.space_generator.postprocs):
                    continue
                key = trace_key(trace_to_json(sch.trace))
                if key not in self.seen:
                    self.seen.add(key)
                    out.append(ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_entry_func(sch.mod, True)))
            return out

        def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
            self.inner.pre_tuning(max_trials, num_trials_per_iter, design_spaces, database, cost_model)

        def post_tuning(self):
            self.inner.post_tuning()

        def generate_measure_candidates(self):
            if self.seeds:
                seeded = self._seed_candidates()
                if seeded:
                    return seeded
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
            return DedupSearch(self.inner.clone(), set(self.seen), list(self.seeds))

    return DedupSearch(inner, seen, seeds)
