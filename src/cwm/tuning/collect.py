"""Data collection: measure random and evolutionary-search candidates into a JSON database.

Resumable by construction: every measured batch is committed to the database before the
next one starts, and a re-run counts what each task already has and measures only the rest.
The first ``n_random`` records of a task are random samples of its design space; the rest come
from evolutionary search (XGBoost cost model), so the data also covers good programs.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..data.database import (
    FAILURE_FILE,
    load_raw,
    merge_database,
    open_database,
    task_ids,
    write_task_index,
)
from ..errors import CwmError
from ..hardware import hardware_for_target, make_target
from ..io import atomic_write_text
from ..schedule.actions import trace_key, trace_to_json
from ..workloads import resolve_task
from .context import search_one_task, tune_context
from .measure import EvaluatorSettings, error_kind, make_builder, make_runner

log = logging.getLogger(__name__)


@dataclass
class CollectReport:
    measured: int = 0
    failed: int = 0
    seconds: float = 0.0
    per_task: dict = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.measured / self.seconds if self.seconds > 0 else 0.0

    def throughput_since(self, start: float) -> float:
        elapsed = time.time() - start
        return self.measured / elapsed if elapsed > 0 else 0.0

    def as_json(self) -> dict:
        return {
            "measured": self.measured,
            "failed": self.failed,
            "seconds": round(self.seconds, 2),
            "candidates_per_second": round(self.throughput, 4),
            "per_task": self.per_task,
        }


def existing_counts(db_dir: Path) -> dict[str, int]:
    """Records already in the database per task id (valid and failed)."""
    raw = load_raw(db_dir, missing_ok=True)
    ids = task_ids(raw)
    counts: dict[str, int] = {}
    for rec in raw.records:
        tid = ids[rec.workload_index]
        counts[tid] = counts.get(tid, 0) + 1
    return counts


def collected_task_ids(db_dirs) -> set[str]:
    """Ids of the tasks that have records in any of these database directories (missing ones are empty)."""
    ids: set[str] = set()
    for db_dir in db_dirs:
        ids.update(existing_counts(Path(db_dir)))
    return ids


def log_failures(failure_path: Path, task_id: str, measure_candidates, builder_results, runner_results) -> int:
    """Append a line (task, error kind, last lines of the message, trace) per failed candidate."""
    lines = []
    for cand, b, r in zip(measure_candidates, builder_results, runner_results):
        kind = error_kind(b.error_msg, r.error_msg)
        if kind is None:
            continue
        message = (b.error_msg or r.error_msg or "").strip().splitlines()
        lines.append(json.dumps({
            "task_id": task_id,
            "error_kind": kind,
            "message": " | ".join(message[-3:])[:500],
            "trace": trace_to_json(cand.sch.trace),
        }))
    if lines:
        with open(failure_path, "a") as f:
            f.write("".join(line + "\n" for line in lines))
    return len(lines)


def measured_trace_keys(db_dir: Path) -> dict[str, set[str]]:
    """Task id -> keys (see ``trace_key``) of the records already in a database directory."""
    raw = load_raw(db_dir, missing_ok=True)
    ids = task_ids(raw)
    keys: dict[str, set[str]] = {}
    for rec in raw.records:
        keys.setdefault(ids[rec.workload_index], set()).add(trace_key(rec.trace_json))
    return keys


def _measure_callbacks(db_dir: Path, task_id: str, report: CollectReport, on_batch):
    """MetaSchedule's default callbacks, plus a failure log and progress reporting."""
    import tvm.s_tir.meta_schedule as ms
    from tvm.ir.utils import derived_object

    failure_path = db_dir / FAILURE_FILE

    @derived_object
    class RecordFailures(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_index, measure_candidates, builder_results, runner_results):
            n_failed = log_failures(failure_path, task_id, measure_candidates, builder_results, runner_results)
            n_valid = len(measure_candidates) - n_failed
            best = None
            for b, r in zip(builder_results, runner_results):
                if error_kind(b.error_msg, r.error_msg) is None:
                    secs = sorted(float(s) for s in r.run_secs)
                    best = secs[len(secs) // 2] if best is None else min(best, secs[len(secs) // 2])
            report.measured += len(measure_candidates)
            report.failed += len(measure_candidates) - n_valid
            on_batch(len(measure_candidates), n_valid, best)

    return [
        ms.measure_callback.AddToDatabase(),
        ms.measure_callback.RemoveBuildArtifact(),
        ms.measure_callback.UpdateCostModel(),
        RecordFailures(),
    ]


MAX_PHASE_ROUNDS = 8


def _run_phase(task, target, db, db_dir, *, strategy, cost_model, trials, batch, seed, builder, runner, callbacks,
               measured: set[str]):
    ctx = tune_context(task, target, strategy, seed, measured=measured)
    search_one_task(ctx, trials=trials, per_iter=batch, work_dir=db_dir, builder=builder, runner=runner,
                    database=db, cost_model=cost_model, callbacks=callbacks)


def collect(
    tasks,
    db_dir: str | Path,
    *,
    n_random: int = 100,
    n_evolutionary: int = 100,
    target=None,
    batch: int = 32,
    seed: int = 0,
    settings: EvaluatorSettings | None = None,
    rpc=None,
    progress: bool = True,
    jobs: int = 1,
    _base: Path | None = None,
) -> CollectReport:
    """Measure up to ``n_random + n_evolutionary`` candidates per task into ``db_dir``.

    ``jobs > 1`` collects that many tasks at once, each process into its own shard database
    under ``db_dir/shards`` that is merged into ``db_dir`` when it ends (or by the next run,
    after a kill). It needs ``rpc``: on the host, parallel measurements would disturb each other.
    """
    from tqdm import tqdm

    if n_random < 0 or n_evolutionary < 0 or n_random + n_evolutionary == 0:
        raise CwmError("collect needs a positive number of candidates per task")
    if batch <= 0:
        raise CwmError(f"batch must be positive, got {batch}")
    if jobs < 1:
        raise CwmError(f"jobs must be positive, got {jobs}")
    if jobs > 1 and rpc is None:
        raise CwmError("parallel collection (jobs > 1) measures through RPC; pass rpc (--rpc HOST:PORT:KEY)")
    if rpc is not None:
        rpc.check_reachable()  # fail fast, before anything is written
    target = target or make_target()
    db_dir = Path(db_dir)
    if jobs > 1:
        return _collect_parallel(tasks, db_dir, jobs=jobs, n_random=n_random, n_evolutionary=n_evolutionary,
                                 target=target, batch=batch, seed=seed, settings=settings, rpc=rpc,
                                 progress=progress)
    db = open_database(db_dir)
    _write_manifest(db_dir, target, hardware_for_target(target))
    write_task_index(db_dir, tasks)
    # A shard (``_base`` given): the main database's records count and are never re-proposed.
    base_counts = existing_counts(_base) if _base is not None else {}
    counts = existing_counts(db_dir)
    for tid, n in base_counts.items():
        counts[tid] = counts.get(tid, 0) + n
    measured = measured_trace_keys(db_dir)  # task id -> traces; the phases below add what they propose
    if _base is not None:
        for tid, keys in measured_trace_keys(_base).items():
            measured.setdefault(tid, set()).update(keys)
    per_task_goal = n_random + n_evolutionary
    todo = [(t, counts.get(t.id, 0)) for t in tasks]
    total = sum(max(0, per_task_goal - have) for _, have in todo)
    report = CollectReport()
    builder = make_builder()
    runner = make_runner(settings, rpc)
    start = time.time()
    bar = tqdm(total=total, unit="cand", disable=not progress, dynamic_ncols=True, desc="collect")
    try:
        for i, (task, have) in enumerate(todo):
            best = [None]

            def on_batch(n, n_valid, batch_best, task=task, best=best):
                if batch_best is not None:
                    best[0] = batch_best if best[0] is None else min(best[0], batch_best)
                bar.update(n)
                shown = f"{best[0] * 1e3:.3f}ms" if best[0] is not None else "-"
                bar.set_postfix_str(f"{task.name[:40]} best={shown} {report.throughput_since(start):.2f}/s")

            callbacks = _measure_callbacks(db_dir, task.id, report, on_batch)
            base = base_counts.get(task.id, 0)
            # A search whose proposals were measured before (a resumed run) spends budget on
            # dropped duplicates and ends early; later rounds with new seeds measure the rest.
            for round_ in range(MAX_PHASE_ROUNDS):
                if have < n_random:
                    _run_phase(task, target, db, db_dir, strategy="replay-trace", cost_model="random",
                               trials=n_random - have, batch=batch, seed=seed + i + 7919 * round_, builder=builder,
                               runner=runner, callbacks=callbacks, measured=measured.setdefault(task.id, set()))
                elif have < per_task_goal:
                    _run_phase(task, target, db, db_dir, strategy="evolutionary", cost_model="xgb",
                               trials=per_task_goal - have, batch=batch, seed=seed + 1000 + i + 7919 * round_,
                               builder=builder, runner=runner, callbacks=callbacks,
                               measured=measured.setdefault(task.id, set()))
                else:
                    break
                now = base + existing_counts(db_dir).get(task.id, 0)
                if now == have and have >= n_random:
                    break  # the design space has nothing new left
                have = now
            report.per_task[task.id] = {"name": task.name, "best_seconds": best[0]}
    finally:
        bar.close()
        report.seconds = time.time() - start
    return report


SHARD_DIR = "shards"


def _merge_shards(db_dir: Path) -> int:
    """Fold every shard database into ``db_dir`` (failures too), then remove the shards."""
    import shutil

    added = 0
    root = db_dir / SHARD_DIR
    for shard in sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []:
        added += merge_database(shard, db_dir)
        failures = shard / FAILURE_FILE
        if failures.exists():
            lines = [ln for ln in failures.read_text().splitlines(keepends=True) if ln.endswith("\n")]
            with open(db_dir / FAILURE_FILE, "a") as f:
                f.write("".join(lines))
        shutil.rmtree(shard)
    return added


def _collect_shard(tasks, shard_dir: str, base_dir: str, kwargs: dict) -> dict:
    """One worker process of a parallel collection."""
    target = kwargs.pop("target")

    tgt = make_target(json.loads(target))
    chosen = [resolve_task(name, tgt) for name in tasks]
    report = collect(chosen, shard_dir, target=tgt, progress=False, _base=Path(base_dir), **kwargs)
    return report.as_json()


def _collect_parallel(tasks, db_dir: Path, *, jobs: int, n_random, n_evolutionary, target, batch, seed, settings,
                      rpc, progress) -> CollectReport:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, wait

    from tqdm import tqdm

    open_database(db_dir)
    _write_manifest(db_dir, target, hardware_for_target(target))
    write_task_index(db_dir, tasks)
    _merge_shards(db_dir)  # what a killed run left behind
    goal = n_random + n_evolutionary
    counts = existing_counts(db_dir)
    todo = [t for t in tasks if counts.get(t.id, 0) < goal]
    total = sum(goal - counts.get(t.id, 0) for t in todo)
    report = CollectReport()
    start = time.time()
    target_json = str(target)  # the target as JSON
    kwargs = {"n_random": n_random, "n_evolutionary": n_evolutionary, "batch": batch, "settings": settings,
              "rpc": rpc, "target": target_json}
    groups = [todo[i::jobs] for i in range(jobs) if todo[i::jobs]]
    shards = [db_dir / SHARD_DIR / f"{i}" for i in range(len(groups))]
    bar = tqdm(total=total, unit="cand", disable=not progress, dynamic_ncols=True, desc=f"collect x{len(groups)}")
    try:
        with ProcessPoolExecutor(max_workers=max(1, len(groups)), mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_collect_shard, [t.name for t in g], str(shard), str(db_dir),
                                   dict(kwargs, seed=seed + 7919 * i))
                       for i, (g, shard) in enumerate(zip(groups, shards))]
            pending = set(futures)
            while pending:
                _, pending = wait(pending, timeout=2.0)
                done = sum(sum(existing_counts(s).values()) for s in shards if s.exists())
                bar.update(done - bar.n)
            for fut in futures:
                part = fut.result()  # a worker's error surfaces here, after the others finished
                report.measured += part["measured"]
                report.failed += part["failed"]
                report.per_task.update(part["per_task"])
    finally:
        bar.close()
        _merge_shards(db_dir)
        report.seconds = time.time() - start
    return report


def _write_manifest(db_dir: Path, target, hw) -> None:
    """Record where the measurements were taken; refuse to mix machines in one database."""
    import tvm

    path = db_dir / "manifest.json"
    info = {
        "target": json.loads(str(target)),
        "hardware": hw.as_json(),
        "tvm_version": tvm.__version__,
    }
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("hardware", {}).get("model") not in (None, hw.model) or old.get("target", {}).get(
            "mcpu"
        ) != info["target"].get("mcpu"):
            raise CwmError(
                f"{path} was measured on {old.get('hardware', {}).get('model')} "
                f"({old.get('target', {}).get('mcpu')}); use another directory for this machine"
            )
        info = {**old, **info}
    info.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    atomic_write_text(path, json.dumps(info, indent=2) + "\n")
