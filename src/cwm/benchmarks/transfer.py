"""How far schedule transfer reaches: the tasks of a network that get a transferred schedule.

No measurement: for each compute task, ``TransferSource.schedules`` is asked for one schedule from the
world model's training tasks alone, and, when a tuned database of the same network is given, also
from the best records of the network's other tasks (in-run transfer, heaviest first, as ``tune``
does it). A task counts when a trace replays on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..io import atomic_write_text, ensure_directory


def transfer_coverage(network: str, model_dir, db_dir=None, machine: str | None = None) -> dict:
    """Per compute task of ``network``: whether the model's training tasks lend it a schedule
    (``from_model``), and whether the tasks tuned before it in ``db_dir`` do (``in_run``)."""
    from ..data.dataset import load_dataset
    from ..hardware import host_cpu
    from ..schedule.actions import trace_json_from_actions
    from ..schedule.transfer import TransferSource
    from ..tuning.budget import estimated_seconds
    from ..workloads import network_tasks, tunable

    machine = machine or host_cpu().mcpu
    tasks = sorted((t for t in network_tasks(network) if tunable(t)), key=lambda t: -estimated_seconds(t))
    model_source = TransferSource.for_model(model_dir)
    bests = {}
    if db_dir is not None:
        ds = load_dataset(db_dir).valid()
        for tid, trajs in ds.by_task.items():
            best = min(trajs, key=lambda t: t.latency)
            bests[tid] = (best.latency, trace_json_from_actions(best.actions))
    run_source = TransferSource([])
    rows = []
    for task in tasks:
        row = {"task": task.name, "kind": task.kind,
               "from_model": bool(model_source and model_source.schedules(task, machine, 1))}
        if db_dir is not None:
            row["in_run"] = bool(run_source.schedules(task, machine, 1))
            if task.id in bests:
                run_source.add_tuned(task, machine, *bests[task.id])
        rows.append(row)
    summary = {"network": network, "model": str(model_dir), "db": str(db_dir) if db_dir else None,
               "machine": machine, "tasks": len(rows), "from_model": sum(r["from_model"] for r in rows)}
    if db_dir is not None:
        summary["in_run"] = sum(r["in_run"] for r in rows)
        summary["either"] = sum(r["in_run"] or r["from_model"] for r in rows)
    return {**summary, "rows": rows}


def write_coverage(reports: list[dict], out_dir) -> Path:
    out_dir = ensure_directory(out_dir, "output directory")
    atomic_write_text(out_dir / "transfer_coverage.json", json.dumps(reports, indent=1) + "\n")
    lines = ["# Transfer coverage: compute tasks that get a transferred schedule", "",
             "| network | machine | compute tasks | from the model's training tasks | from the run's earlier tasks | "
             "either |", "|---|---|---|---|---|---|"]
    for r in reports:
        lines.append(f"| {r['network']} | `{r['machine']}` | {r['tasks']} | {r['from_model']} | "
                     f"{r.get('in_run', '-')} | {r.get('either', '-')} |")
    atomic_write_text(out_dir / "transfer_coverage.md", "\n".join(lines) + "\n")
    return out_dir / "transfer_coverage.md"
