"""Splitting a tuning budget over a network's tasks before the search starts.

MetaSchedule's gradient task scheduler warms up by giving each task one batch in extraction order,
so a budget below ``num_trials_per_iter`` times the number of tasks is spent on the first tasks and
the rest keep the default schedule (48 of 63 tasks of a CNN at 400 trials). Here every task gets a
floor first, the rest goes to the tasks by their estimated share of the network's time, and the
tasks are tuned heaviest first, each with its own budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import CwmError, check_positive_int

# Trials every task gets before the rest of the budget is shared by estimated time.
MIN_TRIALS_PER_TASK = 4
# For the expected tuning time on a 2-core machine: about 1 s a trial (build, run), and about 15 s a
# task for MetaSchedule's search itself (sampling and evolving its population of 512, whatever the
# task's budget): on Zen 3, mobilenet_v3_small's 22 heaviest tasks took 661 s for 253 trials.
SECONDS_PER_TRIAL = 1.0
SEARCH_SECONDS_PER_TASK = 15.0
# A tuned kernel's rough throughput on the 2-core machines measured so far (large convolutions and
# matmuls reach 100-215 GFLOP/s, the memory-bound ones stream about 20 GB/s): the roofline of
# ``estimated_seconds``, which only needs the tasks' relative times to be right.
TUNED_FLOPS_PER_SECOND = 100e9
TUNED_BYTES_PER_SECOND = 20e9


def estimated_seconds(task) -> float:
    """One call of the task after tuning, by a roofline of its FLOPs and the bytes of its buffers,
    times its weight (occurrences in the network): its share of the network's time."""
    return task.weight * max(task.flops / TUNED_FLOPS_PER_SECOND, task.nbytes / TUNED_BYTES_PER_SECOND)


@dataclass(frozen=True)
class TrialPlan:
    """Trials per task id, heaviest task first (the order in which they are tuned)."""

    trials: dict[str, int]
    budget: int
    floor: int

    @property
    def budget_for_every_task(self) -> int:
        return self.floor * len(self.trials)

    @property
    def covers_every_task(self) -> bool:
        return all(n > 0 for n in self.trials.values())

    def remaining(self, done: dict[str, int]) -> dict[str, int]:
        """Trials left per task id when ``done`` (task id -> records) are already measured."""
        return {tid: max(0, n - done.get(tid, 0)) for tid, n in self.trials.items()}

    def describe(self, tasks, done: dict[str, int] | None = None) -> str:
        """What the user reads before tuning: tasks, trials per task, expected time (of the trials
        not yet in the database, ``done``), and what a budget too small for every task leaves out."""
        counts = sorted(self.trials.values())
        remaining = self.remaining(done or {})
        left = sum(remaining.values())
        searches = sum(n > 0 for n in remaining.values())
        minutes = (left * SECONDS_PER_TRIAL + searches * SEARCH_SECONDS_PER_TASK) / 60
        resumed = f"{self.budget - left} already measured, " if left < self.budget else ""
        text = (f"{len(counts)} task(s) share {self.budget} trials: {counts[0]} to {counts[-1]} per task "
                f"(median {counts[len(counts) // 2]}), heaviest first; {resumed}expected tuning time about "
                f"{minutes:.0f} min ({SECONDS_PER_TRIAL:g} s a trial, {SEARCH_SECONDS_PER_TASK:g} s of search a task)")
        if self.budget < self.budget_for_every_task:
            text += (f"\nthe budget of {self.budget} trials is below {self.floor} for each of {len(counts)} tasks; "
                     f"{self.budget_for_every_task} trials would give every task {self.floor}")
        if not self.covers_every_task:
            names = {t.id: t.name for t in tasks}
            left = [names[tid] for tid, n in self.trials.items() if n == 0]
            text += (f"\n{len(left)} task(s) get no trial and keep MetaSchedule's default schedule: "
                     f"{', '.join(left[:3])}{', ...' if len(left) > 3 else ''}")
        return text


def plan_trials(tasks, budget: int, floor: int = MIN_TRIALS_PER_TASK) -> TrialPlan:
    """Split ``budget`` trials over ``tasks`` (``cwm.workloads.Task``).

    Each task gets ``floor`` trials, and what is left goes to the tasks in proportion to
    ``estimated_seconds`` (largest remainders). A budget below ``floor`` per task is spread evenly,
    the heaviest tasks taking what does not divide, so that as many tasks as possible get a trial.
    """
    check_positive_int(budget, "the trial budget")
    check_positive_int(floor, "the trials per task")
    if len({t.id for t in tasks}) != len(tasks):
        raise CwmError("the same task is listed twice")
    # Heaviest first; ties keep the given order (sorted is stable).
    ordered = sorted(tasks, key=lambda t: -estimated_seconds(t))
    if budget < floor * len(ordered):
        each, rest = divmod(budget, len(ordered))
        return TrialPlan({t.id: each + (i < rest) for i, t in enumerate(ordered)}, budget, floor)
    extra = budget - floor * len(ordered)
    times = [estimated_seconds(t) for t in ordered]
    total = sum(times)
    shares = [extra * s / total if total > 0 else extra / len(ordered) for s in times]
    whole = [math.floor(s) for s in shares]
    by_remainder = sorted(range(len(ordered)), key=lambda i: -(shares[i] - whole[i]))
    for i in by_remainder[:extra - sum(whole)]:
        whole[i] += 1
    return TrialPlan({t.id: floor + w for t, w in zip(ordered, whole)}, budget, floor)
