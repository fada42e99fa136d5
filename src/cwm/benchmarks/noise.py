"""Label noise: re-measure recorded candidates in a second pass and compare the two passes.

Each chosen record's trace is replayed on its task, built and run again with the same builder,
runner and evaluator settings as collection. Reported:
- Spearman's rho between the passes, within each task (averaged) and pooled over log latencies;
- the top-1 and top-5 *ceilings*: the score a perfect ranker (one that knows the second pass) gets
  against the first pass's labels. A ranker cannot be expected to beat them on such labels.
Only records measured on this machine (the same LLVM CPU) are chosen: another machine's
latencies are not noise.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from ..data.database import valid_run_secs
from ..data.dataset import load_dataset
from ..errors import CwmError
from ..hardware import as_target, host_cpu
from ..io import atomic_write_text, ensure_directory, save_figure
from ..model.metrics import spearman_within_groups, topk_score
from ..schedule.actions import replay
from ..tuning.measure import EvaluatorSettings, make_builder, make_runner

NOISE_FILE = "noise.json"


def choose_records(ds, machine: str, n_records: int, min_per_task: int, seed: int) -> dict[str, list]:
    """About ``n_records`` valid records of ``machine``, spread evenly over the tasks that have at least
    ``min_per_task`` of them: task id -> trajectories."""
    rng = np.random.default_rng(seed)
    by_task = {tid: [t for t in trajs if t.valid and t.machine == machine] for tid, trajs in ds.by_task.items()}
    by_task = {tid: trajs for tid, trajs in sorted(by_task.items()) if len(trajs) >= min_per_task}
    if not by_task:
        raise CwmError(f"no task has {min_per_task} valid records measured on {machine}; "
                       "re-measurement needs records of this machine")
    per_task = max(min_per_task, -(-n_records // len(by_task)))
    tasks = list(by_task)
    if per_task * len(tasks) > n_records:  # fewer tasks, each with enough records to rank
        tasks = sorted(rng.choice(tasks, size=max(1, n_records // per_task), replace=False))
    return {tid: [by_task[tid][i] for i in sorted(rng.choice(len(by_task[tid]), min(per_task, len(by_task[tid])),
                                                             replace=False))] for tid in tasks}


def _measure(mod, actions_list, target, builder, runner) -> list[float | None]:
    """Median run time of each action sequence replayed on ``mod`` (None where it failed)."""
    import tvm.s_tir.meta_schedule as ms

    args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    device = "cuda" if target.kind.name == "cuda" else "cpu"
    schedules = [replay(mod, actions) for actions in actions_list]
    built = builder.build([ms.builder.BuilderInput(sch.mod, target) for sch in schedules])
    inputs, where = [], []
    out: list[float | None] = [None] * len(schedules)
    for i, b in enumerate(built):
        if b.error_msg is None:
            inputs.append(ms.runner.RunnerInput(b.artifact_path, device, args_info))
            where.append(i)
    try:
        for i, future in zip(where, runner.run(inputs)):
            result = future.result()
            secs = [float(s) for s in (result.run_secs or [])]
            if result.error_msg is None and valid_run_secs(secs):
                out[i] = float(np.median(secs))
    finally:
        for b in built:
            if b.artifact_path:
                shutil.rmtree(os.path.dirname(b.artifact_path), ignore_errors=True)
    return out


def noise_metrics(first: np.ndarray, second: np.ndarray, groups: np.ndarray) -> dict:
    """Agreement of two passes over the same candidates (latencies in seconds, grouped by task)."""
    ok = np.isfinite(first) & np.isfinite(second)
    first, second, groups = first[ok], second[ok], groups[ok]
    if len(first) < 2:
        raise CwmError(f"only {len(first)} record(s) measured in both passes: too few to compare")
    log1, log2 = np.log(first), np.log(second)
    ranks = [np.argsort(np.argsort(v)).astype(float) for v in (log1, log2)]
    pooled = float(np.corrcoef(*ranks)[0, 1]) if len(first) > 2 else float("nan")
    ratio = second / first
    return {
        "records": int(len(first)),
        "tasks": int(len(set(groups.tolist()))),
        "spearman_within_tasks": spearman_within_groups(-second, first, groups),
        "spearman_pooled": pooled,
        "top1_ceiling": topk_score(-second, first, groups, k=1),
        "top5_ceiling": topk_score(-second, first, groups, k=5),
        "median_abs_relative_change": float(np.median(np.abs(ratio - 1))),
        "p90_abs_relative_change": float(np.quantile(np.abs(ratio - 1), 0.9)),
    }


def remeasure(db_dir, out_dir, *, n_records: int = 512, min_per_task: int = 16, seed: int = 0, batch: int = 32,
              settings: EvaluatorSettings | None = None, target=None, progress: bool = True) -> dict:
    """Re-measure about ``n_records`` records of this machine from ``db_dir``; write noise.json/md/png
    into ``out_dir`` and return the summary. Run nothing else that measures meanwhile."""
    from tqdm import tqdm

    target = as_target(target)
    machine = target.attrs.get("mcpu") if target.kind.name == "llvm" else target.kind.name
    machine = str(machine or host_cpu().mcpu)
    if n_records < 2 or min_per_task < 2 or batch < 1:
        raise CwmError("n_records and min_per_task must be at least 2, batch at least 1")
    out_dir = ensure_directory(out_dir, "output directory")
    ds = load_dataset(db_dir)
    chosen = choose_records(ds, machine, n_records, min_per_task, seed)
    builder, runner = make_builder(), make_runner(settings)
    first, second, groups = [], [], []
    start = time.time()
    total = sum(map(len, chosen.values()))
    with tqdm(total=total, unit="cand", disable=not progress, dynamic_ncols=True, desc="re-measure") as bar:
        for tid, trajs in chosen.items():
            for lo in range(0, len(trajs), batch):
                part = trajs[lo:lo + batch]
                second += _measure(ds.modules[tid], [t.actions for t in part], target, builder, runner)
                first += [t.latency for t in part]
                groups += [tid] * len(part)
                bar.update(len(part))
    seconds = time.time() - start
    f = np.array(first, dtype=float)
    s = np.array([np.nan if v is None else v for v in second], dtype=float)
    summary = {
        "database": str(db_dir),
        "machine": machine,
        "target": json.loads(str(target)),
        "seconds": round(seconds, 1),
        "failed_second_pass": int(np.isnan(s).sum()),
        **noise_metrics(f, s, np.array(groups)),
        "per_task": {tid: {"name": ds.tasks[tid].name, "records": len(trajs)} for tid, trajs in chosen.items()},
        "pairs": [[tid, a, b] for tid, a, b in zip(groups, first, [None if np.isnan(v) else v for v in s])],
    }
    atomic_write_text(Path(out_dir) / NOISE_FILE, json.dumps(summary, indent=1) + "\n")
    atomic_write_text(Path(out_dir) / "noise.md", _markdown(summary))
    _plot(f, s, Path(out_dir) / "noise.png", summary)
    return summary


def _markdown(s: dict) -> str:
    rows = [
        ("records re-measured (tasks)", f"{s['records']} ({s['tasks']})"),
        ("failed in the second pass", str(s["failed_second_pass"])),
        ("Spearman within tasks (mean)", f"{s['spearman_within_tasks']:.3f}"),
        ("Spearman pooled (log latency)", f"{s['spearman_pooled']:.3f}"),
        ("top-1 ceiling", f"{s['top1_ceiling']:.3f}"),
        ("top-5 ceiling", f"{s['top5_ceiling']:.3f}"),
        ("median / p90 relative change", f"{s['median_abs_relative_change']:.1%} / {s['p90_abs_relative_change']:.1%}"),
    ]
    return (f"# Label noise on {s['machine']}\n\nSecond pass over {s['records']} recorded candidates of "
            f"`{s['database']}`, measured with collection's settings ({s['seconds']:.0f} s).\n\n"
            "| figure | value |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows) +
            "\nThe ceilings are the top-k scores of a ranker that knows the second pass, scored against the first: "
            "what a perfect ranker gets against labels this noisy.\n")


def _plot(first, second, path: Path, s: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = np.isfinite(first) & np.isfinite(second)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.loglog(first[ok] * 1e3, second[ok] * 1e3, ".", alpha=0.5, ms=4)
    lo, hi = np.nanmin(first[ok]) * 1e3, np.nanmax(first[ok]) * 1e3
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xlabel("first pass (ms)")
    ax.set_ylabel("second pass (ms)")
    ax.set_title(f"{s['machine']}: rho within tasks {s['spearman_within_tasks']:.2f}, "
                 f"top-1 ceiling {s['top1_ceiling']:.2f}", fontsize=9)
    save_figure(fig, path)
