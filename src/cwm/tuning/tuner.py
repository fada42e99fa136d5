"""Tuning: MetaSchedule's evolutionary search with a choice of cost model.

``tune`` takes one task or several (a network, with weights), runs the search against a
resumable JSON database, shows progress and writes a report: the best-so-far curve (JSON and
PNG) and the final best latency with its schedule.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..data.database import FAILURE_FILE, open_database, write_task_index
from ..data.dataset import load_dataset
from ..errors import CwmError, check_positive_int
from ..hardware import hardware_for_target, make_target
from ..io import atomic_write_text, save_figure
from ..schedule.actions import (
    actions_from_trace_json,
    replay,
    trace_json_from_actions,
    trace_to_json,
)
from ..schedule.transfer import TRANSFER_CANDIDATES, TransferSource
from ..workloads import Task, resolve_task
from ..workloads.networks import LAYOUT_TRIALS_PER_TASK, tunable
from .budget import MIN_TRIALS_PER_TASK, plan_trials
from .collect import existing_counts, log_failures, measured_trace_keys
from .context import search_one_task, tune_context
from .measure import (
    EvaluatorSettings,
    compile_schedule,
    error_kind,
    make_builder,
    make_runner,
)
from .registry import check_cost_model, create_cost_model

log = logging.getLogger(__name__)


@dataclass
class TuneResult:
    work_dir: Path
    tasks: list
    best: dict = field(default_factory=dict)  # task id -> {latency, trace, name}
    curve: list = field(default_factory=list)  # best-so-far weighted latency after each trial
    trial_latencies: list = field(default_factory=list)  # (task id, latency or None) in order
    seconds: float = 0.0
    cost_model_seconds: float = 0.0
    trials: int = 0
    resumed_records: int = 0  # earlier valid records the cost model learned before a resumed search
    transferred: dict = field(default_factory=dict)  # task id -> transferred schedules measured first

    @property
    def weighted_latency(self) -> float | None:
        if len(self.best) < len(self.tasks):
            return None
        return sum(t.weight * self.best[t.id]["latency"] for t in self.tasks)

    def as_json(self) -> dict:
        return {
            "tasks": [t.summary() for t in self.tasks],
            "trials": self.trials,
            "seconds": round(self.seconds, 2),
            "cost_model_seconds": round(self.cost_model_seconds, 3),
            "resumed_records": self.resumed_records,
            "transferred": self.transferred,
            "weighted_latency_seconds": self.weighted_latency,
            "best": self.best,
            "curve": self.curve,
        }


def _callbacks(result: TuneResult, tuned, bar, failure_path: Path):
    """Callbacks of one ``ms.tune_tasks`` call over ``tuned`` (its task list, in order); the best-so-far
    curve is over all of ``result.tasks``."""
    import tvm.s_tir.meta_schedule as ms
    from tvm.ir.utils import derived_object

    weights = {t.id: t.weight for t in result.tasks}
    flops = {t.id: t.flops for t in result.tasks}
    id_of_index = [t.id for t in tuned]

    @derived_object
    class Progress(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_index, measure_candidates, builder_results, runner_results):
            tid = id_of_index[task_index]
            log_failures(failure_path, tid, measure_candidates, builder_results, runner_results)
            for cand, b, r in zip(measure_candidates, builder_results, runner_results):
                result.trials += 1
                lat = None
                if error_kind(b.error_msg, r.error_msg) is None:
                    secs = sorted(float(s) for s in r.run_secs)
                    lat = secs[len(secs) // 2]
                    best = result.best.get(tid)
                    if best is None or lat < best["latency"]:
                        result.best[tid] = {"latency": lat, "trace": trace_to_json(cand.sch.trace),
                                            "trial": result.trials}
                result.trial_latencies.append((tid, lat))
                total = None
                if len(result.best) == len(weights):
                    total = sum(weights[k] * v["latency"] for k, v in result.best.items())
                result.curve.append(total)
            bar.update(len(measure_candidates))
            best = result.best.get(tid)
            if best:
                gflops = flops[tid] / best["latency"] / 1e9
                bar.set_postfix_str(f"best {best['latency'] * 1e3:.4f} ms, {gflops:.1f} GFLOP/s")

    return [
        ms.measure_callback.AddToDatabase(),
        ms.measure_callback.RemoveBuildArtifact(),
        ms.measure_callback.UpdateCostModel(),
        Progress(),
    ]


MAX_SEARCH_ROUNDS = 4


def tune(
    tasks,
    *,
    trials: int,
    work_dir: str | Path,
    cost_model: str = "cwm",
    model_path=None,
    target=None,
    rpc=None,
    seed: int = 0,
    num_trials_per_iter: int = 32,
    settings: EvaluatorSettings | None = None,
    progress: bool = True,
    report: bool = True,
    strategy: str = "evolutionary",
    finetune_transition: bool = False,
    min_trials_per_task: int = MIN_TRIALS_PER_TASK,
    transfer=False,
    population_size: int | None = None,
) -> TuneResult:
    """Tune ``tasks`` (a Task, a workload name, or a list of them) for ``trials`` measurements in total.

    The budget is split over the tasks before the search starts (``plan_trials``: at least
    ``min_trials_per_task`` each, the rest by estimated share of the time) and the tasks are tuned
    one after another, heaviest first, each in batches of at most ``num_trials_per_iter``; one cost
    model learns across all of them. A budget too small for every task is reported before tuning.

    ``transfer``: True (the world model in use, else the shipped one) or a world model directory whose
    best schedules of its training tasks are replayed on each task without records and measured first,
    up to ``TRANSFER_CANDIDATES`` from the task's budget (``cwm.schedule.transfer``); each tuned task's
    best schedule is lent, first, to the similar tasks tuned after it in the run.

    ``population_size``: the evolutionary search's population (None: MetaSchedule's default, 512).

    Resumable: a run on a ``work_dir`` that already holds records measures only the rest of each task's
    budget, and never a candidate whose trace is already in the database. Failed candidates are
    recorded in the database (as MetaSchedule does) and with their error kind in ``failures.jsonl``.
    """
    from tqdm import tqdm

    if not isinstance(tasks, (list, tuple)):
        tasks = [tasks]
    if not tasks:
        raise CwmError("no tasks to tune")
    check_positive_int(trials, "the trial budget")
    check_positive_int(num_trials_per_iter, "num_trials_per_iter")
    if population_size is not None:
        check_positive_int(population_size, "the population size")
        if strategy != "evolutionary":
            raise CwmError(f"a population size needs the evolutionary search, not {strategy!r}")
    check_cost_model(cost_model)
    target = target or make_target()
    tasks = [resolve_task(t, target) if isinstance(t, str) else t for t in tasks]
    for t in tasks:
        if not isinstance(t, Task):
            raise CwmError(f"tune takes Task objects or workload names, got {type(t).__name__}")
    plan = plan_trials(tasks, trials, min_trials_per_task)
    if rpc is not None:
        rpc.check_reachable()  # fail fast, before anything is written
    # a bad model fails before anything is written
    model = create_cost_model(cost_model, model_path, seed, finetune_transition)
    work_dir = Path(work_dir)
    db = open_database(work_dir)

    write_task_index(work_dir, tasks)
    done = existing_counts(work_dir)
    remaining = plan.remaining(done)
    if len(tasks) > 1:
        if progress:
            print(f"cwm: {plan.describe(tasks, done)}", file=sys.stderr)
        elif plan.budget < plan.budget_for_every_task:
            log.warning("%s", " ".join(plan.describe(tasks, done).splitlines()[1:]))
    result = TuneResult(work_dir=work_dir, tasks=list(tasks))
    start = time.time()
    if sum(remaining.values()) and any(done.get(t.id) for t in tasks):
        result.resumed_records = warm_start(model, work_dir, tasks, target)
    source = _transfer_source(transfer, cost_model, model_path) if sum(remaining.values()) else None
    machine = hardware_for_target(target).mcpu if source is not None else None
    if sum(remaining.values()):
        measured = measured_trace_keys(work_dir)
        index = {t.id: i for i, t in enumerate(tasks)}  # the seeds stay those of the given order
        builder, runner = make_builder(), make_runner(settings, rpc)
        with tqdm(total=sum(remaining.values()), unit="trial", disable=not progress, dynamic_ncols=True,
                  desc=f"tune[{cost_model}]") as bar:
            for tid in plan.trials:  # heaviest first
                task = tasks[index[tid]]
                # A resumed search re-proposes what was measured before; those are dropped, and a search
                # that ends early that way is followed by one with a new seed for the rest of the budget.
                seeds = []
                if source is not None and not done.get(tid) and remaining[tid]:
                    seeds = source.schedules(task, machine, min(TRANSFER_CANDIDATES, remaining[tid]))
                    result.transferred[tid] = len(seeds)
                for round_ in range(MAX_SEARCH_ROUNDS):
                    left = remaining[tid]
                    if left == 0:
                        break
                    before = len(result.trial_latencies)
                    context = tune_context(task, target, strategy, seed + index[tid] + 7919 * round_,
                                           measured=measured.setdefault(tid, set()), seeds=seeds,
                                           population_size=population_size)
                    seeds = []  # measured in the first round
                    search_one_task(context, trials=left, per_iter=num_trials_per_iter, work_dir=work_dir,
                                    builder=builder, runner=runner, database=db, cost_model=model,
                                    callbacks=_callbacks(result, [task], bar, work_dir / FAILURE_FILE))
                    # every measured candidate, failed ones too, is one record (AddToDatabase)
                    remaining[tid] = max(0, left - (len(result.trial_latencies) - before))
                    if remaining[tid] == left:
                        break  # the design space has nothing new left
                bar.update(remaining[tid])  # what a task could not use is not waited for
                if source is not None and tid in result.best:  # lent to the similar tasks tuned after it
                    best = result.best[tid]
                    source.add_tuned(task, machine, best["latency"], best["trace"])
    result.seconds = time.time() - start
    result.cost_model_seconds = model.seconds_spent
    _fill_best_from_database(result, work_dir)
    if report:
        write_report(result, work_dir)
    return result


def _transfer_source(transfer, cost_model: str, model_path):
    """The ``TransferSource`` that ``tune``'s ``transfer`` names, or None."""
    from ..model.world_model import default_model_dir

    if transfer is False or transfer is None:
        return None
    if transfer is True:
        uses_world_model = cost_model.startswith("cwm") and model_path is not None and Path(model_path).is_dir()
        transfer = model_path if uses_world_model else default_model_dir()
    # a model without training schedules still lets the run's tasks lend to each other
    return TransferSource.for_model(transfer) or TransferSource([])


def add_invocation_time(path: Path, seconds: float, cost_model_seconds: float = 0.0) -> dict:
    """Add one (possibly crashed) invocation's seconds to the totals in ``path``, which are kept across
    the resumed invocations of one run; returns the new totals."""
    prev = {}
    if path.exists():
        try:
            prev = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError):
            pass
    total = {"seconds": float(prev.get("seconds", 0.0)) + seconds,
             "cost_model_seconds": float(prev.get("cost_model_seconds", 0.0)) + cost_model_seconds,
             "invocations": int(prev.get("invocations", 0)) + 1}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(total) + "\n")
    return total


def warm_start(model, work_dir, tasks, target) -> int:
    """Feed a cost model the valid records already in ``work_dir``, so that a resumed search
    continues with what the stopped one had learned; returns how many it learned."""
    from .cost_model import learn_trajectories

    by_task = load_dataset(work_dir).valid().by_task
    learned = 0
    for task in tasks:
        trajectories = by_task.get(task.id, [])
        if trajectories:
            learn_trajectories(model, task.mod, trajectories, target, task.name)
            learned += len(trajectories)
    return learned


def tune_layout_tasks(tasks, *, work_dir, target=None, rpc=None, seed: int = 0,
                      progress: bool = True) -> TuneResult | None:
    """Tune the layout tasks among ``tasks`` (see ``cwm.workloads.tunable``) with
    ``LAYOUT_TRIALS_PER_TASK`` trials each, into the same (resumable) work directory.

    Untuned, MetaSchedule leaves them as serial scalar loops: in BERT they were a fifth of the
    network's time. None when there are no layout tasks.
    """
    layout = [t for t in tasks if not tunable(t)]
    if not layout:
        return None
    # Random samples of their small design spaces: evolutionary search spends seconds a trial
    # failing to fill its population with distinct schedules of such a space. Replaying traces
    # never consults a cost model, so none is loaded or updated (the same records for every one).
    return tune(layout, trials=LAYOUT_TRIALS_PER_TASK * len(layout), work_dir=work_dir, cost_model="random",
                target=target, rpc=rpc, seed=seed, strategy="replay-trace",
                num_trials_per_iter=LAYOUT_TRIALS_PER_TASK, min_trials_per_task=LAYOUT_TRIALS_PER_TASK,
                progress=progress, report=False)


def tune_network(tasks, *, trials: int, work_dir, progress: bool = True, **kwargs) -> tuple[TuneResult, TuneResult | None]:
    """Tune a network's tasks into one (resumable) work directory: the compute tasks share ``trials``,
    weighted (``tune``), then each layout task gets ``LAYOUT_TRIALS_PER_TASK`` (``tune_layout_tasks``).

    ``kwargs`` go to ``tune`` (cost model, target, seed, ...); the layout tasks take its target, rpc
    and seed. Returns both results; the second is None when the network has no layout task.
    """
    from ..workloads.networks import tunable

    result = tune([t for t in tasks if tunable(t)], trials=trials, work_dir=work_dir, progress=progress, **kwargs)
    layout = tune_layout_tasks(tasks, work_dir=work_dir, target=kwargs.get("target"), rpc=kwargs.get("rpc"),
                               seed=kwargs.get("seed", 0), progress=progress)
    return result, layout


def _fill_best_from_database(result: TuneResult, work_dir: Path) -> None:
    """Best records of earlier (resumed) runs count too."""
    ds = load_dataset(work_dir)
    for t in result.tasks:
        for traj in ds.by_task.get(t.id, []):
            if traj.valid and (t.id not in result.best or traj.latency < result.best[t.id]["latency"]):
                result.best[t.id] = {"latency": traj.latency, "trace": trace_json_from_actions(traj.actions),
                                     "trial": None}
    for t in result.tasks:
        if t.id in result.best:
            result.best[t.id]["name"] = t.name
            result.best[t.id]["gflops"] = t.flops / result.best[t.id]["latency"] / 1e9


def schedule_text(task, trace_json) -> str:
    """The best schedule as the Python of its trace."""

    sch = replay(task.mod, actions_from_trace_json(trace_json))
    return "\n".join(str(line) for line in sch.trace.as_python())


def write_report(result: TuneResult, work_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    atomic_write_text(work_dir / "report.json", json.dumps(result.as_json(), indent=1) + "\n")
    points = [(i + 1, v) for i, v in enumerate(result.curve) if v is not None]
    if points:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p[0] for p in points], [p[1] * 1e3 for p in points])
        ax.set_xlabel("trial")
        ax.set_ylabel("best weighted latency (ms)")
        ax.set_title(", ".join(t.name for t in result.tasks)[:60])
        fig.tight_layout()
        save_figure(fig, work_dir / "best_so_far.png")
    for t in result.tasks:
        if t.id in result.best:
            atomic_write_text(work_dir / f"best_schedule_{t.id}.py",
                              schedule_text(t, result.best[t.id]["trace"]) + "\n")


def measure_median(task, trace_json, target=None, runs: int = 30, min_ms: int = 10) -> float:
    """Re-measure one schedule carefully in this process: median of ``runs`` timed repeats."""
    import numpy as np
    import tvm

    target = target or make_target()
    lib, args = compile_schedule(task, trace_json, target)
    f = lib.time_evaluator("main", tvm.device("cuda" if target.kind.name == "cuda" else "cpu", 0), number=1, repeat=runs, min_repeat_ms=int(min_ms))
    return float(np.median(f(*args).results))
