"""Held-out comparison of world models on dataset v2 (issue 40, item 5).

Usage (from the repository root, in the venv):

    python benchmarks/results/shipped_v2/compare_heldout.py \
        --model default=src/cwm/pretrained/default --model znver3=src/cwm/pretrained/znver3 \
        --model v2=benchmarks/results/eval_v2/model \
        --db-out runs/shipped_v2/heldout_db --out benchmarks/results/shipped_v2/heldout.json

1. Held-out tasks: the test tasks of data/v2/split_v2.json that no compared model trained or validated
   on (each model directory's train_split.json, train + val).
2. Writes a small MetaSchedule JSON database of those tasks' records (``--db-out``; records keep their
   own target, so their machine), which ``cwm compare-models MODEL... --db DIR`` also reads.
3. Scores every record with every model (``ranker_arrays``: each record gets its machine's hardware
   features; a ranking group is one task on one machine), and reports pairwise accuracy, ndcg@10,
   top-1 and top-5 per model, overall and per machine, with 90% percentile-bootstrap intervals over
   groups and paired differences between models on the same resampled groups.

Offline only: nothing is measured or timed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def heldout_tasks(split_path: Path, model_dirs: dict[str, Path]) -> tuple[list[str], dict]:
    from cwm.model.world_model import training_tasks

    test = set(json.loads(split_path.read_text())["test"])
    seen = {}
    for name, path in model_dirs.items():
        tasks = training_tasks(path)
        if tasks is None:
            raise SystemExit(f"{path} has no train_split.json: cannot tell which tasks it saw")
        seen[name] = sorted(test & tasks)
    held = sorted(test - set().union(*(set(v) for v in seen.values())))
    return held, seen


def write_subset_db(src: Path, dst: Path, keep: set[str]) -> dict:
    """The records of the ``keep`` tasks of database ``src`` as a new database ``dst`` (JSON lines
    copied as they are, workload indices renumbered; the task index subset)."""
    from cwm.data.database import RECORD_FILE, TASK_INDEX_FILE, WORKLOAD_FILE, load_raw, read_task_index, task_ids

    raw = load_raw(src)
    ids = task_ids(raw)
    new_index = {}
    workloads = []
    for i, (w, tid) in enumerate(zip(raw.workloads, ids)):
        if tid in keep:
            new_index[i] = len(workloads)
            workloads.append(w)
    records = [json.dumps([new_index[r.workload_index], [r.trace_json, r.run_secs, r.target_json, r.args_info]])
               for r in raw.records if r.workload_index in new_index]
    dst.mkdir(parents=True, exist_ok=True)
    (dst / WORKLOAD_FILE).write_text("".join(json.dumps(w) + "\n" for w in workloads))
    (dst / RECORD_FILE).write_text("".join(line + "\n" for line in records))
    index = read_task_index(src)
    (dst / TASK_INDEX_FILE).write_text(json.dumps({k: v for k, v in index.items() if k in keep}, indent=1,
                                                  sort_keys=True) + "\n")
    return {"workloads": len(workloads), "records": len(records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="NAME=DIR, repeatable")
    ap.add_argument("--db", default="v2", help="source database (a cwm db name or directory)")
    ap.add_argument("--split", type=Path, default=Path("data/v2/split_v2.json"))
    ap.add_argument("--db-out", type=Path, default=Path("runs/shipped_v2/heldout_db"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--confidence", type=float, default=0.9)
    args = ap.parse_args()

    from cwm.data.dataset import load_dataset
    from cwm.data.reference import resolve_db
    from cwm.model.metrics import (RANKING_METRICS, bootstrap_ci, bootstrap_difference, bootstrap_indices,
                                   per_group_ranking)
    from cwm.model.training import group_weights, ranker_arrays
    from cwm.model.world_model import WorldModel

    t0 = time.time()
    model_dirs = {}
    for spec in args.model:
        name, _, path = spec.partition("=")
        model_dirs[name] = Path(path)
    held, seen = heldout_tasks(args.split, model_dirs)
    src = resolve_db(args.db)
    if not (args.db_out / "database_tuning_record.json").exists():
        counts = write_subset_db(src, args.db_out, set(held))
        print(f"wrote {args.db_out}: {counts}")
    ds = load_dataset(args.db_out).valid()
    missing = sorted(set(held) - set(ds.by_task))
    print(f"{len(held)} held-out tasks ({len(missing)} without valid records), {len(ds.trajectories)} valid records")

    scores, lat, groups = {}, None, None
    for name, path in model_dirs.items():
        model = WorldModel.load(path)
        X, lat_m, groups_m = ranker_arrays(model, ds)
        if groups is None:
            lat, groups = lat_m, groups_m
        elif not (np.array_equal(groups, groups_m) and np.allclose(lat, lat_m)):
            raise SystemExit("ranker_arrays gave another record order for " + name)
        scores[name] = model.ranker.predict(X)
        print(f"scored with {name} ({time.time() - t0:.0f} s)")

    task_weights = group_weights(ds, groups)
    report = {"db": str(src), "split": str(args.split), "db_out": str(args.db_out),
              "models": {k: str(v) for k, v in model_dirs.items()},
              "test_tasks": len(json.loads(args.split.read_text())["test"]),
              "excluded_test_tasks_seen_by": seen, "heldout_tasks": held,
              "tasks_with_valid_records": len(ds.by_task), "valid_records": int(len(lat)),
              "bootstrap": {"resamples": args.resamples, "confidence": args.confidence, "over": "task@machine groups"},
              "top_k_weights": {}}
    machines = sorted({str(g).split("@", 1)[1] if "@" in str(g) else "?" for g in groups})
    for weighting, weights in (("equal", None), ("task", task_weights)):
        per = {}
        labels = agg = None
        for name, s in scores.items():
            labels, values, agg = per_group_ranking(s, lat, groups, weights)
            per[name] = values
        labels = np.array([str(g) for g in labels])
        sections = {"all": np.ones(len(labels), bool)}
        for mach in machines:
            sections[mach] = np.array([g.endswith("@" + mach) for g in labels])
        out = {}
        for section, mask in sections.items():
            n_groups = int(mask.sum())
            sel = {name: {m: v[m][mask] for m in RANKING_METRICS} for name, v in per.items()}
            w = {m: agg[m][mask] for m in RANKING_METRICS}
            idx = bootstrap_indices(n_groups, args.resamples, seed=0)
            recs = int(np.isin(np.asarray(groups).astype(str), labels[mask]).sum())
            entry = {"groups": n_groups, "records": recs, "models": {}, "differences": {}}
            for name in per:
                entry["models"][name] = {m: dict(zip(("mean", "lo", "hi"), bootstrap_ci(
                    sel[name][m], w[m], indices=idx, confidence=args.confidence))) for m in RANKING_METRICS}
            names = list(per)
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    entry["differences"][f"{b} - {a}"] = {m: dict(zip(("mean", "lo", "hi"), bootstrap_difference(
                        sel[b][m], sel[a][m], w[m], indices=idx, confidence=args.confidence)))
                        for m in RANKING_METRICS}
            out[section] = entry
        report["top_k_weights"][weighting] = out
    report["seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=float) + "\n")

    def fmt(iv, sign=""):
        return f"{iv['mean']:{sign}.3f} [{iv['lo']:{sign}.3f}, {iv['hi']:{sign}.3f}]"

    for section, entry in report["top_k_weights"]["equal"].items():
        print(f"\n{section}: {entry['groups']} groups, {entry['records']} records")
        for name, ms in entry["models"].items():
            print(f"  {name:<8} " + "  ".join(f"{m} {fmt(ms[m])}" for m in RANKING_METRICS))
        for name, ms in entry["differences"].items():
            print(f"  {name:<18} " + "  ".join(f"{m} {fmt(ms[m], '+')}" for m in RANKING_METRICS))
    print(f"\nreport: {args.out} ({report['seconds']} s)")


if __name__ == "__main__":
    main()
