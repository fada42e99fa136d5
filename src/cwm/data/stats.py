"""Text tables and plots shared by the CLI and the benchmarks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..io import save_figure


def format_dataset_stats(stats: dict) -> str:
    lines = [
        f"tasks {stats['tasks']}  records {stats['records']}  valid {stats['valid']}  failed {stats['failed']}"
        + (f"  skipped corrupt lines {stats['skipped_lines']}" if stats["skipped_lines"] else ""),
    ]
    if stats["failure_kinds"]:
        lines.append("failures: " + ", ".join(f"{k}={v}" for k, v in stats["failure_kinds"].items()))
    lines.append("")
    lines.append(f"{'task':<60} {'kind':<16} {'valid':>5} {'fail':>4} {'best ms':>9} {'median ms':>9} {'spread':>7}")
    for row in stats["per_task"].values():
        best = f"{row['best_ms']:.4f}" if row["best_ms"] is not None else "-"
        med = f"{row['median_ms']:.4f}" if row["median_ms"] is not None else "-"
        spread = f"{row['spread']:.1f}x" if row["spread"] is not None else "-"
        lines.append(f"{row['name'][:60]:<60} {row['kind']:<16} {row['valid']:>5} {row['failed']:>4} "
                     f"{best:>9} {med:>9} {spread:>7}")
    lines.extend(format_machine_table(stats.get("per_machine") or {}))
    lines.append("")
    lines.append("action kinds:")
    total = sum(stats["action_kinds"].values()) or 1
    for kind, count in stats["action_kinds"].items():
        bar = "#" * max(1, round(40 * count / total))
        lines.append(f"  {kind:<24} {count:>8}  {bar}")
    for key, title in (("length", "trajectory length"), ("ir_changing_length", "IR-changing actions")):
        d = stats[key]
        lines.append(f"{title}: min {d['min']}  p25 {d['p25']:g}  median {d['median']:g}  "
                     f"p75 {d['p75']:g}  max {d['max']}  mean {d['mean']:.1f}")
    return "\n".join(lines)


def format_machine_table(per_machine: dict) -> list[str]:
    """Lines of the per-machine block: records, valid records and tasks of each machine."""
    if not per_machine:
        return []
    header = (f"{'machine':<20} {'records':>8} {'valid':>7} {'fail':>6} {'tasks':>6} {'valid tasks':>11} "
              f"{'cores':>5} {'simd':>5} {'l2 KB':>6} {'l3 KB':>7}")
    lines = ["", header]
    for machine, row in per_machine.items():
        hw = row.get("hardware") or {}
        lines.append(f"{machine[:20]:<20} {row['records']:>8} {row['valid']:>7} {row['failed']:>6} {row['tasks']:>6} "
                     f"{row.get('valid_tasks', '-'):>11} {hw.get('cores', '-'):>5} {hw.get('simd_bits', '-'):>5} "
                     f"{hw.get('l2_kb', '-'):>6} {hw.get('l3_kb', '-'):>7}")
    return lines


def plot_dataset_stats(ds, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = ds.stats()
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    kinds = list(stats["action_kinds"].items())[:20]
    axes[0].barh([k for k, _ in kinds][::-1], [v for _, v in kinds][::-1])
    axes[0].set_title("action kinds (top 20)")
    axes[1].hist([len(t.actions) for t in ds.trajectories], bins=30)
    axes[1].set_title("trajectory length (actions)")
    spreads = [r["spread"] for r in stats["per_task"].values() if r["spread"]]
    axes[2].hist(spreads, bins=20)
    axes[2].set_title("latency spread per task (worst/best)")
    machines = list((stats.get("per_machine") or {}).items())
    names = [m for m, _ in machines]
    where = np.arange(len(names))
    axes[3].barh(where + 0.2, [r["records"] for _, r in machines], height=0.4, label="records")
    axes[3].barh(where - 0.2, [r["valid"] for _, r in machines], height=0.4, label="valid")
    axes[3].set_yticks(where, [f"{m} ({r['tasks']} tasks)" for m, r in machines])
    axes[3].invert_yaxis()
    axes[3].legend()
    axes[3].set_title("records per machine")
    fig.tight_layout()
    save_figure(fig, path)
