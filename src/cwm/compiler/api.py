"""``cwm.compile``: tune and build a user's model with the network pipeline, cached, checked against eager.

The pipeline is the one of ``cwm tune --network`` and ``cwm build``: the model is imported into Relax
(``cwm.frontend``), its fused subgraphs become MetaSchedule tasks (``extract_tasks``: fast math, NHWC
convolutions, layout-free weights), the compute tasks share the budget and each layout task gets
``LAYOUT_TRIALS_PER_TASK`` trials (``tune_network``), and ``build_network`` applies the best schedules,
prepacks the weights and exports a library into the cache entry (``cwm.compiler.cache``).
"""

from __future__ import annotations

import logging
import sys
import time

from ..deploy.build import build_network
from ..deploy.check import check_outputs
from ..errors import CwmError
from ..frontend.imported import ImportedModel
from ..hardware import as_target
from ..tuning.collect import existing_counts
from ..tuning.registry import check_cost_model
from ..workloads.networks import LAYOUT_TRIALS_PER_TASK, tunable
from ..workloads.pipeline import extract_tasks
from .cache import CacheEntry, cache_key
from .compiled import CompiledModel

log = logging.getLogger(__name__)

# Default budget: this many trials per compute task (the layout tasks get theirs on top).
DEFAULT_TRIALS_PER_TASK = 32
TIMING_RUNS = 10


def check_trials(trials) -> None:
    if trials is None:
        return
    if isinstance(trials, bool) or not isinstance(trials, int) or trials <= 0:
        raise CwmError(f"trials must be a positive integer (or None for the default), got {trials!r}")


def compile(model, example_inputs=None, *, trials: int | None = None, cost_model: str = "cwm", target=None,
            work_dir=None, model_path=None, seed: int = 0, progress: bool = True,
            timing_runs: int = TIMING_RUNS, transfer: bool = False) -> CompiledModel:
    """Tune and build ``model`` for ``target`` (default: this host's CPU) and return it as a callable.

    ``model``: a ``torch.nn.Module`` or a ``torch.export.ExportedProgram``; ``example_inputs``: a tuple
    of tensors (the shapes are static: an exported program with dynamic dimensions is specialized to
    them, with a warning). ``trials``: the measurement budget over the model's compute tasks, default
    ``DEFAULT_TRIALS_PER_TASK`` (32) per compute task; each layout task gets 8 more. ``cost_model``:
    ``cwm`` (the shipped world model for this host, or ``model_path``), ``xgb``, ``random``, ...
    ``transfer``: each task first measures schedules transferred from the most similar tasks tuned
    before it in the run or seen by the world model (``cwm.schedule.transfer``), from its own budget.
    Off by default: on held-out electra it did not make the network faster (docs/deployment.md).

    The tuned model is cached (``$CWM_CACHE`` or ``~/.cache/cwm``; ``work_dir`` to choose the entry's
    directory), keyed by the graph's structural hash, the target and the budget: a second compile
    builds from the cache without tuning, and a killed one resumes. The result is checked against
    eager on the example inputs (a mismatch raises ``CwmError``); with ``progress`` a table of the tasks
    and the end-to-end latency against eager (``timing_runs`` calls each, 0: not timed) are printed.
    """
    from ..frontend.pytorch import from_torch

    check_trials(trials)
    check_cost_model(cost_model)
    target = as_target(target)
    imported = from_torch(model, example_inputs, target)
    return compile_imported(imported, trials=trials, cost_model=cost_model, target=target, work_dir=work_dir,
                            model_path=model_path, seed=seed, progress=progress, timing_runs=timing_runs,
                            transfer=transfer)


def tune_imported(imported: ImportedModel, *, trials: int | None = None, cost_model: str = "cwm", target=None,
                  work_dir=None, model_path=None, seed: int = 0, progress: bool = True, transfer: bool = False):
    """Tune an imported model into its cache entry (or ``work_dir``) and build its library there,
    unless the entry is complete. Returns (entry, its record: tasks, rows, build summary, cached)."""
    check_trials(trials)
    check_cost_model(cost_model)
    target = as_target(target)
    tasks = extract_tasks(imported.mod, target, network=imported.name)
    compute = [t for t in tasks if tunable(t)]
    budget = trials if trials is not None else DEFAULT_TRIALS_PER_TASK * max(1, len(compute))
    entry = CacheEntry.for_key(cache_key(imported.mod, target, budget, cost_model, seed, transfer), work_dir)
    with entry.lock():
        record = entry.complete()
        if record is not None:
            log.info("%s: built from the cache entry %s", imported.name, entry.directory)
            return entry, {**record, "cached": True}
        entry.check_database()
        start = time.time()
        if progress and tasks:
            print(f"cwm: tuning {imported.name}: {len(compute)} compute task(s) share {budget} trials, "
                  f"{len(tasks) - len(compute)} layout task(s) get {LAYOUT_TRIALS_PER_TASK} each "
                  f"(cache: {entry.directory})", file=sys.stderr)
        _tune(tasks, compute, budget, entry, cost_model=cost_model, model_path=model_path, target=target,
              seed=seed, progress=progress, transfer=transfer)
        tuning_s = time.time() - start
        build = build_network(imported.mod, entry.db if tasks else None, target, entry.library)
        record = {"name": imported.name, "tasks": task_rows(tasks, entry.db), "tuning_seconds": round(tuning_s, 1),
                  "build": {k: build.as_json()[k] for k in ("total_tasks", "tuned_tasks", "missing", "prepacked",
                                                             "conv_layout", "fast_math")}}
        entry.finish(record)
    return entry, {**record, "key": entry.key, "cached": False}


def _tune(tasks, compute, budget, entry, *, cost_model, model_path, target, seed, progress, transfer) -> None:
    from ..tuning.tuner import tune_layout_tasks, tune_network

    if compute:
        tune_network(tasks, trials=budget, work_dir=entry.db, cost_model=cost_model, model_path=model_path,
                     target=target, seed=seed, progress=progress, report=False, transfer=transfer)
    elif tasks:
        tune_layout_tasks(tasks, work_dir=entry.db, target=target, seed=seed, progress=progress)


def task_rows(tasks, db) -> list[dict]:
    """One row per task: its best measured latency, GFLOP/s and trials in the database."""
    from ..data.dataset import load_dataset

    counts = existing_counts(db)
    by_task = load_dataset(db).valid().by_task if counts else {}
    rows = []
    for t in tasks:
        lats = [traj.latency for traj in by_task.get(t.id, [])]
        best = min(lats) if lats else None
        rows.append({"task": t.name.split("/", 1)[-1], "kind": t.kind, "weight": t.weight, "flops": t.flops,
                     "latency_ms": best * 1e3 if best else None,
                     "gflops": t.flops / best / 1e9 if best else None, "trials": counts.get(t.id, 0)})
    total = sum(r["weight"] * r["latency_ms"] for r in rows if r["latency_ms"])
    for r in rows:  # each task's share of the measured network time (its calls times its best latency)
        r["time_share"] = r["weight"] * r["latency_ms"] / total if r["latency_ms"] else None
    return rows


def format_table(rows: list[dict]) -> str:
    """The task table, largest share of the network time first."""
    lines = [f"{'task':<40} {'kind':<17} {'weight':>6} {'latency ms':>11} {'GFLOP/s':>9} {'share':>6} {'trials':>6}"]
    for r in sorted(rows, key=lambda r: -(r.get("time_share") or 0.0)):
        lat = f"{r['latency_ms']:.4f}" if r["latency_ms"] else "-"
        gf = f"{r['gflops']:.1f}" if r["gflops"] else "-"
        share = f"{100 * r['time_share']:.1f}%" if r.get("time_share") is not None else "-"
        lines.append(f"{r['task'][:40]:<40} {r['kind']:<17} {r['weight']:>6g} {lat:>11} {gf:>9} {share:>6} "
                     f"{r['trials']:>6}")
    return "\n".join(lines)


def compile_imported(imported: ImportedModel, *, trials=None, cost_model="cwm", target=None, work_dir=None,
                     model_path=None, seed=0, progress=True, timing_runs: int = TIMING_RUNS,
                     transfer: bool = False) -> CompiledModel:
    """``compile`` on a model already imported (``cwm.frontend``)."""
    entry, record = tune_imported(imported, trials=trials, cost_model=cost_model, target=target, work_dir=work_dir,
                                  model_path=model_path, seed=seed, progress=progress, transfer=transfer)
    compiled = CompiledModel(entry.library, imported.output_spec, report=record)
    outputs = compiled.run_numpy(imported.example_inputs)
    try:
        record["check"] = check_outputs(imported.expected_outputs(), outputs, **imported.tolerance,
                                        reference=imported.reference_name)
    except CwmError as err:
        raise CwmError(f"the compiled {imported.name} does not match {imported.reference_name}: {err}") from None
    if timing_runs:
        record["latency_ms"] = measure_latency(imported, compiled, timing_runs)
    if progress:
        print(summary_text(imported, record), file=sys.stderr)
    return compiled


def measure_latency(imported: ImportedModel, compiled: CompiledModel, runs: int) -> dict:
    """Median latency (ms) of the compiled model and of the reference (eager), timed interleaved."""
    from ..benchmarks.timing import time_interleaved, torch_runner, tvm_runner

    if imported.torch_model is not None:
        import torch

        eager = torch_runner(imported.torch_model, tuple(torch.from_numpy(x) for x in imported.example_inputs))
    else:
        def eager():
            return imported.reference(imported.example_inputs)
    contenders = {"eager": eager, "cwm": tvm_runner(compiled.lib_path, imported.example_inputs)}
    timings, errors = time_interleaved(contenders, runs=runs, warmup=1, threads=None)
    if errors:
        raise CwmError(f"timing {imported.name} failed: {errors}")
    return {k: v.median_s * 1e3 for k, v in timings.items()}


def summary_text(imported: ImportedModel, record: dict) -> str:
    build = record.get("build", {})
    head = (f"cwm: {imported.name}: {build.get('tuned_tasks')}/{build.get('total_tasks')} tasks tuned"
            + (" (from the cache)" if record.get("cached") else f", tuning {record.get('tuning_seconds', 0):.0f} s"))
    lines = [head, format_table(record.get("tasks", []))]
    chk = record.get("check")
    if chk:
        lines.append(f"outputs match {imported.reference_name} (max abs diff {chk['max_abs_diff']:.2g})")
    lat = record.get("latency_ms")
    if lat:
        who = "eager" if imported.torch_model is not None else imported.reference_name
        lines.append(f"end to end: cwm {lat['cwm']:.3f} ms, {who} {lat['eager']:.3f} ms "
                     f"({lat['eager'] / lat['cwm']:.2f}x)")
    return "\n".join(lines)
