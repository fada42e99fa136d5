"""Fixed-budget search and sample-efficiency benchmark against MetaSchedule's XGBoost model.

Every contender tunes every subgraph with the same budget and seeds, interleaved per subgraph
and seed, on the same machine. Each run's best schedule is then re-measured in one process
(median of ``remeasure_runs`` interleaved timings), and results are reported per subgraph and
as geometric means with their spread. Runs are resumable: a finished run keeps its report,
an interrupted one resumes from its database.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from ..data.dataset import load_dataset
from ..errors import CwmError
from ..hardware import make_target
from ..io import atomic_write_text, ensure_directory
from ..model.metrics import geomean
from ..tuning.measure import compile_schedule
from ..tuning.registry import cost_model_names, create_cost_model
from ..tuning.tuner import add_invocation_time, tune
from ..workloads import resolve_task
from ..workloads.reference import HELD_OUT_SUBGRAPHS

log = logging.getLogger(__name__)

# The world model with the per-call score transform, or the online update, of earlier releases:
# registered cost models, but only opt-in contenders (``--contenders cwm,cwm-zscore,...``), on cwm's
# model and its training tasks.
SCORE_AB = "cwm-zscore"
ADAPTATION_AB = "cwm-boost-copy"
CONTENDERS = tuple(c for c in cost_model_names() if c not in (SCORE_AB, ADAPTATION_AB))  # every other one
# World-model variants, opt-in with --contenders: the paper's search ablation without the transition
# (``cwm-initial``: E(s0) + action features, the ranker refit on the same training records), and
# the shipped model with the transition fine-tuned online on each task (``cwm-finetune``).
VARIANTS = ("cwm-initial", "cwm-finetune")
SHIPPED_MODEL_CONTENDERS = ("cwm", "cwm-finetune", SCORE_AB, ADAPTATION_AB)  # run on model_path, trained on its tasks
# Trained once per work root and reused by later runs and by ``diagnose-search``.
XGB_PRETRAINED_FILE = "xgb_pretrained.tar"
# The like-for-like baseline of a pretrained world model: each subgraph's speed-up over it is reported too.
PRETRAINED_BASELINE = "xgb-pretrained"
PRETRAINED_KEY = "speedup_vs_xgb_pretrained"
# Sample efficiency: cwm at a tenth of the large budget against this contender at all of it (cold
# xgb can be named instead).
SAMPLE_EFFICIENCY_BASELINE = PRETRAINED_BASELINE
INITIAL_MODEL_DIR = "cwm_initial_model"
TUNING_TIME_FILE = "search_tuning_time.json"  # wall and cost-model seconds summed over resumed invocations

# The held-out set (cwm.workloads.reference.HELD_OUT_SUBGRAPHS): in no committed training split.
DEFAULT_SUBGRAPHS = HELD_OUT_SUBGRAPHS

POPULATION_MARK = "@"  # ``cwm@128``: a contender whose evolutionary search evolves 128 candidates, not 512


def split_contender(contender: str) -> tuple[str, int | None]:
    """``(cost model or variant, population size or None)`` of a contender such as ``cwm@128``."""
    name, mark, population = contender.partition(POPULATION_MARK)
    if not mark:
        return name, None
    if not population.isdigit() or int(population) < 1:
        raise CwmError(f"contender {contender!r}: the population after {POPULATION_MARK!r} must be a positive integer")
    return name, int(population)


def _run_dir(root: Path, task, budget: int, contender: str, seed: int) -> Path:
    return root / task.id / f"b{budget}" / contender / f"seed{seed}"


def _load_or_tune(task, budget, contender, seed, root, model_path, xgb_path, initial_path, per_iter, progress):
    run_dir = _run_dir(root, task, budget, contender, seed)
    done = run_dir / "run.json"
    if done.exists():
        return json.loads(done.read_text())
    name, population = split_contender(contender)
    path = {**dict.fromkeys(SHIPPED_MODEL_CONTENDERS, model_path), "cwm-initial": initial_path,
            "xgb-pretrained": xgb_path}.get(name)
    start, result = time.time(), None
    try:
        result = tune(task, trials=budget, work_dir=run_dir, cost_model="cwm" if name in VARIANTS else name,
                      model_path=path, seed=seed, num_trials_per_iter=per_iter, progress=progress,
                      finetune_transition=name == "cwm-finetune", population_size=population)
    finally:  # a stopped run's time counts when it is resumed: its records stay in the database
        total = add_invocation_time(run_dir / TUNING_TIME_FILE, time.time() - start,
                                    result.cost_model_seconds if result else 0.0)
    record = {
        "task": task.name, "contender": contender, "seed": seed, "budget": budget,
        "db_best_seconds": result.best[task.id]["latency"] if task.id in result.best else None,
        "best_trace": result.best.get(task.id, {}).get("trace"),
        "curve": result.curve,
        "wall_seconds": total["seconds"],
        "cost_model_seconds": total["cost_model_seconds"],
        "invocations": total["invocations"],
        "trials": result.trials,
        "num_trials_per_iter": per_iter,
        "population_size": population,
    }
    atomic_write_text(done, json.dumps(record) + "\n")
    return record


def remeasure_interleaved(items, target, runs: int = 30) -> list[float]:
    """Median latency of each (task, trace) pair, timing them round-robin in this process."""
    import tvm

    dev = tvm.device("cuda" if target.kind.name == "cuda" else "cpu", 0)
    prepared = []
    for task, trace in items:
        if trace is None:
            prepared.append(None)
            continue
        lib, args = compile_schedule(task, trace, target)
        f = lib.time_evaluator("main", dev, number=1, repeat=1, min_repeat_ms=10)
        f(*args)  # warm-up
        prepared.append((f, args))
    samples = [[] for _ in items]
    for _ in range(runs):
        for i, p in enumerate(prepared):
            if p is not None:
                samples[i].append(p[0](*p[1]).mean)
    return [float(np.median(s)) if s else None for s in samples]


def pretrain_xgb_file(db_dir, split: dict, out_path: Path, target, seed: int = 0) -> Path:
    """MetaSchedule's XGBModel warm-started on the training records the world model saw."""
    from ..tuning.cost_model import pretrain_xgb

    if out_path.exists():
        return out_path
    ds = load_dataset(db_dir).valid().subset(split["train"])
    model = pretrain_xgb(ds, target, seed=seed)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model.save(str(out_path))
    return out_path


def initial_state_model_dir(db_dir, split: dict, out_path: Path, model_path=None, seed: int = 0) -> Path:
    """The ``cwm-initial`` ablation as a model directory (kept in the work root and reused)."""
    from ..model.training import TrainSettings
    from ..model.world_model import CONFIG_FILE, WorldModel
    from .offline import ablation_model

    if (out_path / CONFIG_FILE).exists():
        return out_path
    ds = load_dataset(db_dir).valid()
    model = ablation_model(WorldModel.load(model_path), "initial", ds.subset(split["train"]),
                           ds.subset(split["val"]), TrainSettings(seed=seed))
    model.save(out_path)
    return out_path


def training_marks(tasks, contenders, model_path=None, split: dict | None = None) -> dict[str, list[str]]:
    """Subgraph name -> the contenders whose prior was trained (or validated) on it: the world model's
    variants by the model's own ``train_split.json``, ``xgb-pretrained`` and ``cwm-initial`` by ``split``.
    A marked subgraph measures memory, not generalization. A model that names no training tasks is
    marked ``unknown`` on every subgraph."""
    from ..model.world_model import training_tasks

    seen = {}
    if any(c in SHIPPED_MODEL_CONTENDERS for c in contenders):
        model_seen = training_tasks(model_path) if model_path is not None else None
        for c in SHIPPED_MODEL_CONTENDERS:
            if c in contenders:
                seen[c] = model_seen
    if split is not None:
        split_seen = set(split.get("train", [])) | set(split.get("val", []))
        for c in ("xgb-pretrained", "cwm-initial"):
            if c in contenders:
                seen[c] = split_seen
    marks = {}
    for task in tasks:
        names = [c if ids is not None else f"{c} (unknown)" for c, ids in seen.items()
                 if ids is None or task.id in ids]
        if names:
            marks[task.name] = names
    return marks


def run_search_benchmark(
    subgraphs=DEFAULT_SUBGRAPHS,
    out_dir="benchmarks/results/search",
    *,
    budget: int = 64,
    large_budget: int | None = None,
    large_contender: str = SAMPLE_EFFICIENCY_BASELINE,
    seeds=(0, 1, 2),
    contenders=CONTENDERS,
    model_path=None,
    train_db=None,
    split: dict | None = None,
    work_root="runs/bench_search",
    num_trials_per_iter: int = 32,
    remeasure_runs: int = 30,
    progress: bool = True,
) -> dict:
    if budget <= 0 or (large_budget is not None and large_budget <= 0):
        raise CwmError("budgets must be positive")
    if len(seeds) < 1:
        raise CwmError("at least one seed is needed")
    known = cost_model_names() + VARIANTS
    if large_budget and large_contender not in known:
        raise CwmError(f"unknown large-budget contender {large_contender!r}; choose from {', '.join(known)}")
    bases = {split_contender(c)[0] for c in contenders} | ({large_contender} if large_budget else set())
    unknown = [c for c in contenders if split_contender(c)[0] not in known]
    if unknown or not contenders:
        raise CwmError(f"unknown contender {unknown[0]!r}; choose from {', '.join(known)} (NAME@POPULATION "
                       "for another evolutionary population)" if unknown else "no contenders given")
    if any(c in SHIPPED_MODEL_CONTENDERS or c in VARIANTS for c in bases):
        from ..model.world_model import WorldModel

        WorldModel.load(model_path)  # a missing or corrupt model fails now, not after the other runs

    out_dir, root = ensure_directory(out_dir, "output directory"), Path(work_root)
    target = make_target()
    tasks = [resolve_task(name, target) for name in subgraphs]
    marks = training_marks(tasks, bases, model_path, split)
    for name, who in marks.items():
        log.warning("%s is in the training data of %s: its result is not a held-out one", name, ", ".join(who))
    xgb_path = None
    if "xgb-pretrained" in bases:
        if train_db is None or split is None:
            raise CwmError("xgb-pretrained needs the training database and split")
        xgb_path = pretrain_xgb_file(train_db, split, root / XGB_PRETRAINED_FILE, target)
    initial_path = None
    if "cwm-initial" in bases:
        if train_db is None or split is None:
            raise CwmError("cwm-initial needs the training database and split")
        initial_path = initial_state_model_dir(train_db, split, root / INITIAL_MODEL_DIR, model_path)
    runs = []
    plan = run_plan(budget, contenders, large_budget, large_contender)
    for task in tasks:
        for seed in seeds:
            for b, contender in plan:  # interleaved: every contender once per (subgraph, seed)
                runs.append(_load_or_tune(task, b, contender, seed, root, model_path, xgb_path, initial_path,
                                          num_trials_per_iter, progress))
                _write(out_dir, _summarize(tasks, runs, contenders, budget, large_budget, None, num_trials_per_iter,
                                           large_contender) | {"in_training": marks})
    latencies = remeasure_interleaved([(resolve_task(r["task"], target), r["best_trace"]) for r in runs], target,
                                      remeasure_runs)
    for r, lat in zip(runs, latencies):
        r["remeasured_seconds"] = lat
    summary = _summarize(tasks, runs, contenders, budget, large_budget, remeasure_runs, num_trials_per_iter,
                         large_contender)
    summary["in_training"] = marks
    _write(out_dir, summary)
    return summary


def tenth_budget(large_budget: int) -> int:
    """cwm's budget in the sample-efficiency comparison: a tenth of the baseline's, at least one trial."""
    return max(1, large_budget // 10)


def run_plan(budget: int, contenders, large_budget: int | None = None,
             large_contender: str = SAMPLE_EFFICIENCY_BASELINE) -> list[tuple[int, str]]:
    """(budget, contender) of each run per subgraph and seed; a run two purposes share is done once
    (e.g. cwm at the fixed budget and at a tenth of the large one)."""
    plan = [(budget, c) for c in contenders]
    if large_budget:
        plan += [(large_budget, large_contender), (tenth_budget(large_budget), "cwm")]
    return list(dict.fromkeys(plan))


def _trials_to_reach(curve, goal) -> int | None:
    for i, v in enumerate(curve):
        if v is not None and v <= goal:
            return i + 1
    return None


def _sample_efficiency(rows, key, large_budget, large_contender=SAMPLE_EFFICIENCY_BASELINE) -> dict:
    """cwm at a tenth of the large budget against ``large_contender`` at all of it, on one subgraph.
    Also: how many trials each large run needed to reach cwm's best (database timings, as the curves are)."""
    big = [r for r in rows if r["contender"] == large_contender and r["budget"] == large_budget]
    small = [r for r in rows if r["contender"] == "cwm" and r["budget"] == tenth_budget(large_budget)]
    big_lat, small_lat = [r.get(key) for r in big], [r.get(key) for r in small]
    entry = {"large_contender": large_contender, "large": geomean(big_lat), "cwm_tenth": geomean(small_lat),
             "ratio": geomean(small_lat) / geomean(big_lat) if big and small else None,
             "large_per_seed": big_lat, "cwm_tenth_per_seed": small_lat}
    small_db = [r["db_best_seconds"] for r in small if r["db_best_seconds"]]
    if big and small_db:
        goal = float(np.median(small_db))
        entry["large_trials_to_reach_cwm_tenth"] = [_trials_to_reach(r["curve"], goal) for r in big]
        entry["cwm_tenth_db_median"] = goal
        entry["large_curves"] = [r["curve"] for r in big]
        entry["cwm_tenth_curves"] = [r["curve"] for r in small]
    return entry


def _ratio_spread(ratios) -> dict:
    """Per-subgraph speed-ups summarized: their geometric mean, log standard deviation, min and max."""
    logs = np.log(ratios)
    return {"geomean": float(np.exp(logs.mean())), "spread_log_std": float(logs.std()),
            "min": float(min(ratios)), "max": float(max(ratios))}


def _summarize(tasks, runs, contenders, budget, large_budget, remeasure_runs, num_trials_per_iter=None,
               large_contender=SAMPLE_EFFICIENCY_BASELINE) -> dict:
    key = "remeasured_seconds" if remeasure_runs else "db_best_seconds"
    per_task = {}
    for task in tasks:
        rows = [r for r in runs if r["task"] == task.name]
        entry = {}
        for c in contenders:
            mine = [r for r in rows if r["contender"] == c and r["budget"] == budget]
            if not mine:
                continue
            lats = [r.get(key) for r in mine]
            entry[c] = {
                "seconds_per_seed": lats,
                "geomean_seconds": geomean(lats),
                "wall_seconds": float(np.mean([r["wall_seconds"] for r in mine])),
                "cost_model_seconds": float(np.mean([r["cost_model_seconds"] for r in mine])),
                "cost_model_seconds_per_trial": float(np.mean([r["cost_model_seconds"] / max(1, r["trials"])
                                                               for r in mine])),
                "wall_seconds_per_trial": float(np.mean([r["wall_seconds"] / max(1, r["trials"]) for r in mine])),
                "curves": [r["curve"] for r in mine],
            }
        if "xgb" in entry:
            goal = float(np.median([r["db_best_seconds"] for r in rows if r["contender"] == "xgb"
                                    and r["budget"] == budget and r["db_best_seconds"]]))
            for c, e in entry.items():
                e["speedup_vs_xgb"] = entry["xgb"]["geomean_seconds"] / e["geomean_seconds"]
                e["trials_to_reach_xgb"] = [_trials_to_reach(curve, goal) for curve in e["curves"]]
        if PRETRAINED_BASELINE in entry:
            for e in entry.values():
                e[PRETRAINED_KEY] = entry[PRETRAINED_BASELINE]["geomean_seconds"] / e["geomean_seconds"]
        if large_budget:
            entry["sample_efficiency"] = _sample_efficiency(rows, key, large_budget, large_contender)
        per_task[task.name] = entry
    overall = {}
    for c in contenders:
        ratios = [e[c]["speedup_vs_xgb"] for e in per_task.values() if c in e and "speedup_vs_xgb" in e[c]]
        if ratios:
            spread = _ratio_spread(ratios)
            overall[c] = {"geomean_speedup_vs_xgb": spread.pop("geomean"), **spread,
                          "cost_model_seconds_per_trial": float(np.mean(
                              [e[c]["cost_model_seconds_per_trial"] for e in per_task.values() if c in e])),
                          "wall_seconds_per_trial": float(np.mean(
                              [e[c]["wall_seconds_per_trial"] for e in per_task.values() if c in e]))}
    vs_pretrained = {}  # with or without cold xgb among the contenders
    for c in contenders:
        against = [e[c][PRETRAINED_KEY] for e in per_task.values() if c in e and PRETRAINED_KEY in e[c]]
        if against and c != PRETRAINED_BASELINE:
            vs_pretrained[c] = _ratio_spread(against)
    return {"budget": budget, "large_budget": large_budget, "remeasure_runs": remeasure_runs,
            "large_contender": large_contender if large_budget else None, "vs_xgb_pretrained": vs_pretrained,
            "num_trials_per_iter": num_trials_per_iter,
            "latency_source": key, "per_subgraph": per_task, "overall": overall,
            "runs": [{k: v for k, v in r.items() if k not in ("best_trace", "curve")} for r in runs]}


def _write(out_dir: Path, summary: dict) -> None:
    atomic_write_text(out_dir / "search.json", json.dumps(summary, indent=1, default=float) + "\n")
    atomic_write_text(out_dir / "search.md", _markdown(summary))
    _plot(summary, out_dir / "search.png")


def _markdown(summary: dict) -> str:
    per = summary["per_subgraph"]
    contenders = sorted({c for e in per.values() for c in e if c != "sample_efficiency"})
    per_iter = summary.get("num_trials_per_iter")
    lines = [f"# Search benchmark: {summary['budget']} trials, latency = {summary['latency_source']}", "",
             *([f"Evolutionary search measures {per_iter} candidates per iteration (every contender).", ""]
               if per_iter else []),
             "| subgraph | " + " | ".join(f"{c} ms (x vs xgb)" for c in contenders) + " |",
             "|---|" + "---|" * len(contenders)]
    for name, e in per.items():
        cells = []
        for c in contenders:
            if c in e:
                cells.append(f"{e[c]['geomean_seconds'] * 1e3:.4f} ({e[c].get('speedup_vs_xgb', float('nan')):.2f}x)")
            else:
                cells.append("-")
        mark = " (in training: " + ", ".join(summary["in_training"][name]) + ")" if name in summary.get(
            "in_training", {}) else ""
        lines.append(f"| {name}{mark} | " + " | ".join(cells) + " |")
    lines.append("")
    for c, o in summary["overall"].items():
        lines.append(f"- {c}: geometric-mean speed-up vs xgb {o['geomean_speedup_vs_xgb']:.3f}x "
                     f"(min {o['min']:.2f}, max {o['max']:.2f}, log-std {o['spread_log_std']:.2f}); "
                     f"cost model {o['cost_model_seconds_per_trial'] * 1e3:.1f} ms/trial"
                     + (f", tuning wall time {o['wall_seconds_per_trial']:.2f} s/trial" if "wall_seconds_per_trial" in o
                        else ""))
    against = summary.get("vs_xgb_pretrained") or {}
    if against:
        lines += ["", f"Against `{PRETRAINED_BASELINE}` (MetaSchedule's XGBoost pretrained on the same records), "
                  "geometric mean over subgraphs of each subgraph's speed-up:", ""]
        for c, v in against.items():
            lines.append(f"- {c}: {v['geomean']:.3f}x (min {v['min']:.2f}, max {v['max']:.2f}, "
                         f"log-std {v['spread_log_std']:.2f})")
    efficiency = {n: e["sample_efficiency"] for n, e in per.items() if (e.get("sample_efficiency") or {}).get("ratio")}
    if efficiency:
        big, small = summary["large_budget"], tenth_budget(summary["large_budget"])
        base = summary.get("large_contender") or SAMPLE_EFFICIENCY_BASELINE
        lines += ["", f"## Sample efficiency: cwm at {small} trials against {base} at {big}", "",
                  f"| subgraph | {base}, {big} trials, ms | cwm, {small} trials, ms | cwm / {base} latency |",
                  "|---|---|---|---|"]
        for name, e in efficiency.items():
            lines.append(f"| {name} | {_ms_per_seed(e['large'], e.get('large_per_seed'))} "
                         f"| {_ms_per_seed(e['cwm_tenth'], e.get('cwm_tenth_per_seed'))} | {e['ratio']:.3f} |")
        ratio = geomean([e["ratio"] for e in efficiency.values()])
        lines += ["", f"- geometric mean of cwm / {base} latency: {ratio:.3f} (goal: at most 1.022)"]
        reach = {n: e["large_trials_to_reach_cwm_tenth"] for n, e in efficiency.items()
                 if "large_trials_to_reach_cwm_tenth" in e}
        if reach:
            lines += ["", f"Trials each `{base}` run needed to reach the median database best of cwm's {small}-trial "
                      f"runs (`>{big}`: never):", ""]
            for name, trials in reach.items():
                lines.append(f"- {name}: " + " / ".join(str(t) if t else f">{big}" for t in trials))
    return "\n".join(lines) + "\n"


def _ms_per_seed(value, per_seed) -> str:
    """'1.2345 (1.20 / 1.25 / 1.26)': the geometric mean in ms, and each seed's value when known."""
    text = f"{value * 1e3:.4f}"
    if per_seed:
        text += " (" + " / ".join(f"{v * 1e3:.4f}" if v else "-" for v in per_seed) + ")"
    return text


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = summary["per_subgraph"]
    names = list(per)
    contenders = sorted({c for e in per.values() for c in e if c != "sample_efficiency"})
    efficiency = [e["sample_efficiency"] for e in per.values() if "large_curves" in e.get("sample_efficiency", {})]
    fig, axes = plt.subplots(1, 3 if efficiency else 2, figsize=(22 if efficiency else 15, 5))
    width = 0.8 / max(1, len(contenders))
    for i, c in enumerate(contenders):
        vals = [per[n][c].get("speedup_vs_xgb", np.nan) if c in per[n] else np.nan for n in names]
        axes[0].bar(np.arange(len(names)) + i * width, vals, width, label=c)
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_xticks(np.arange(len(names)) + 0.4)
    axes[0].set_xticklabels([n.split(":")[0].split("/")[-1][:18] for n in names], rotation=60, ha="right", fontsize=7)
    axes[0].set_ylabel("speed-up vs xgb (geomean over seeds)")
    axes[0].legend(fontsize=8)
    # Best-so-far curves normalized by each subgraph's final xgb best, geomean over subgraphs.
    for c in contenders:
        norm = []
        for n in names:
            if c not in per[n] or "xgb" not in per[n]:
                continue
            ref = per[n]["xgb"]["geomean_seconds"]
            for curve in per[n][c]["curves"]:
                vals = [v / ref if v else np.nan for v in curve]
                norm.append(vals)
        if norm:
            length = min(len(v) for v in norm)
            arr = np.array([v[:length] for v in norm], dtype=float)
            axes[1].plot(np.arange(1, length + 1), np.exp(np.nanmean(np.log(arr), axis=0)), label=c)
    axes[1].set_xlabel("trial")
    axes[1].set_ylabel("best latency / xgb final (geomean)")
    axes[1].set_yscale("log")
    if axes[1].lines:
        axes[1].legend(fontsize=8)
    if efficiency:
        _plot_sample_efficiency(axes[2], efficiency, summary["large_budget"],
                                summary.get("large_contender") or SAMPLE_EFFICIENCY_BASELINE)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _plot_sample_efficiency(ax, efficiency: list[dict], large_budget: int, large_contender: str) -> None:
    """Best-so-far of the baseline's large-budget runs and cwm's tenth-budget runs, each normalized by
    the subgraph's median cwm best (database timings), geometric mean over subgraphs and seeds."""
    for label, curves_key in ((f"{large_contender}, {large_budget} trials", "large_curves"),
                              (f"cwm, {tenth_budget(large_budget)} trials", "cwm_tenth_curves")):
        norm = [[v / e["cwm_tenth_db_median"] if v else np.nan for v in curve]
                for e in efficiency for curve in e[curves_key]]
        length = min(len(v) for v in norm)
        arr = np.array([v[:length] for v in norm], dtype=float)
        ax.plot(np.arange(1, length + 1), np.exp(np.nanmean(np.log(arr), axis=0)), label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axvline(tenth_budget(large_budget), color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("trial")
    ax.set_ylabel("best latency / cwm's final (geomean)")
    ax.set_title("sample efficiency", fontsize=9)
    ax.legend(fontsize=8)


def diagnose_search_runs(work_root, out_dir, *, budget: int = 64, model_path=None) -> dict:
    """Why a contender wins or loses: per finished run of ``work_root``, the world model's ranking
    quality on the candidates the run measured, and how diverse and how good those were.

    - ``pairwise``: the shipped model's (no online update) pairwise accuracy on the run's
      measured candidates;
    - ``distinct``: distinct sampled decisions / measured candidates;
    - ``near_best``: share of candidates within 1.5x of the run's best;
    - ``median_over_best``: median latency / best latency of the run.
    """
    import json as _json

    from ..model.metrics import pairwise_accuracy
    from ..model.world_model import WorldModel

    model = WorldModel.load(model_path)
    root = Path(work_root)
    runs = finished_runs(root, budget)
    rows = []
    for info, ds in runs:
        for tid, trajs in ds.by_task.items():
            if len(trajs) < 2:
                continue
            lat = np.array([t.latency for t in trajs])
            scores = model.predict(ds.initial_states[tid], [t.actions for t in trajs], ds.hardware)
            decisions = {_json.dumps([a.get("decision") for a in t.actions]) for t in trajs}
            rows.append({"task": info["task"], "contender": info["contender"], "seed": info["seed"],
                         "pairwise": pairwise_accuracy(scores, lat, np.zeros(len(lat))),
                         "distinct": len(decisions) / len(trajs),
                         "near_best": float(np.mean(lat <= 1.5 * lat.min())),
                         "median_over_best": float(np.median(lat) / lat.min())})
    summary = {"budget": budget, "runs": rows, "by_contender": {}, "pooled": pooled_ranking(
        runs, model, xgb_path=root / XGB_PRETRAINED_FILE, initial_path=root / INITIAL_MODEL_DIR),
        "headroom": headroom([info for info, _ in runs])}
    for c in sorted({r["contender"] for r in rows}):
        mine = [r for r in rows if r["contender"] == c]
        summary["by_contender"][c] = {k: float(np.mean([r[k] for r in mine]))
                                      for k in ("pairwise", "distinct", "near_best", "median_over_best")}
        summary["by_contender"][c]["runs"] = len(mine)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "search_diagnosis.json", _json.dumps(summary, indent=1) + "\n")
    lines = [f"# Candidates measured by each contender ({budget} trials)", "",
             "| contender | runs | cwm pairwise acc. on them | distinct | within 1.5x of run best | median / best |",
             "|---|---|---|---|---|---|"]
    for c, v in summary["by_contender"].items():
        lines.append(f"| {c} | {v['runs']} | {v['pairwise']:.3f} | {v['distinct']:.2f} | {v['near_best']:.2f} | "
                     f"{v['median_over_best']:.2f} |")
    pooled = summary["pooled"]
    if pooled["tasks"]:
        lines += ["", f"# Ranking the pooled candidates of all runs ({len(pooled['tasks'])} subgraphs, "
                  f"{pooled['candidates']} distinct measured candidates)", "",
                  "Each subgraph's candidates measured by any contender, scored by each frozen model (no online "
                  "update). best-of-16: the pool's best latency / the best latency among the model's top 16, "
                  "what one search round of 16 measurements would find (1.0 = the pool's best). distinct tiles: "
                  "distinct tile-size decisions (all SamplePerfectTile decisions together) among the top 16, "
                  "over 16.", "",
                  "| scorer | pairwise acc. | top-1 | best-of-16 | distinct tiles in top 16 |",
                  "|---|---|---|---|---|"]
        for name, v in pooled["by_scorer"].items():
            lines.append(f"| {name} | {v['pairwise_accuracy']:.3f} | {v['top1']:.3f} | {v['best_of_16']:.3f} | "
                         f"{v['top16_distinct_tiles']:.2f} |")
    lines += _headroom_markdown(summary["headroom"])
    atomic_write_text(out / "search_diagnosis.md", "\n".join(lines) + "\n")
    return summary


def finished_runs(root: Path, budget: int) -> list[tuple[dict, object]]:
    """``(run.json record, valid dataset of its database)`` of each finished run at ``budget``."""
    return [(json.loads(run_json.read_text()), load_dataset(run_json.parent).valid())
            for run_json in sorted(Path(root).glob(f"*/b{budget}/*/seed*/run.json"))]


def pooled_ranking(runs, model, xgb_path=None, initial_path=None) -> dict:
    """Frozen ranking quality on the union of the runs' measured candidates, per subgraph.

    ``runs``: :func:`finished_runs`. Scorers: the world model (``cwm``); with ``xgb_path`` (if the
    file is there), MetaSchedule's pretrained XGBoost on the candidates' final code
    (``xgb-pretrained``); with ``initial_path`` (if the model is there), the no-transition
    ablation. ``random`` is the floor.
    """
    from ..model.metrics import evaluate_ranking, topk_score

    pools: dict[str, dict] = {}
    for info, ds in runs:
        for tid, trajs in ds.by_task.items():
            pool = pools.setdefault(tid, {"ds": ds, "seen": {}, "name": info["task"]})
            for t in trajs:
                pool["seen"].setdefault(json.dumps(t.actions, sort_keys=True), t)
    scorers = {"cwm": model}
    from ..model.world_model import CONFIG_FILE, WorldModel

    if initial_path is not None and (Path(initial_path) / CONFIG_FILE).exists():
        scorers["cwm-initial"] = WorldModel.load(initial_path)
    xgb = None
    if xgb_path is not None and Path(xgb_path).is_file():
        from ..tuning.cost_model import xgb_scores

        xgb, target = create_cost_model("xgb-pretrained", xgb_path).inner, make_target()
    rng = np.random.default_rng(0)
    scores: dict[str, list] = {}
    lat_all, groups, pool_actions = [], [], []
    for tid, pool in sorted(pools.items()):
        trajs = list(pool["seen"].values())
        if len(trajs) < 2:
            continue
        ds, actions = pool["ds"], [t.actions for t in trajs]
        for name, m in scorers.items():
            scores.setdefault(name, []).append(m.predict(ds.initial_states[tid], actions, ds.hardware))
        if xgb is not None:
            scores.setdefault("xgb-pretrained", []).append(xgb_scores(xgb, ds.modules[tid], actions, target, tid))
        scores.setdefault("random", []).append(rng.random(len(trajs)))
        pool_actions.append(actions)
        lat_all.append(np.array([t.latency for t in trajs]))
        groups.append(np.array([pool["name"]] * len(trajs)))
    out = {"tasks": [g[0] for g in groups], "candidates": int(sum(len(x) for x in lat_all)), "by_scorer": {}}
    if not groups:
        return out
    lat, grp = np.concatenate(lat_all), np.concatenate(groups)
    for name, parts in scores.items():
        s = np.concatenate(parts)
        report = evaluate_ranking(s, lat, grp)
        report["best_of_16"] = topk_score(s, lat, grp, k=16)
        report["top16_distinct_tiles"] = float(np.mean([
            len({tile_decisions(tiles[j]) for j in np.argsort(-part, kind="stable")[:16]}) / min(16, len(part))
            for part, tiles in zip(parts, pool_actions)]))
        out["by_scorer"][name] = report
    return out


def tile_decisions(actions) -> tuple:
    """The tile sizes a trajectory chose: its SamplePerfectTile decisions, in order."""
    return tuple(tuple(a["decision"]) if isinstance(a.get("decision"), list) else a.get("decision")
                 for a in actions if a.get("kind") == "SamplePerfectTile")


def _best_at(curve, k: int) -> float | None:
    vals = [v for v in curve[:k] if v is not None]
    return min(vals) if vals else None


def headroom(infos) -> dict:
    """How far the runs' final bests are from the best any run found, and how ``xgb``'s lead evolves.

    ``infos``: run.json records of one budget. Per subgraph, the pool best is the fastest database
    latency over every run of every contender: an optimistic bound (the minimum of many noisy
    timings) on what a cost model could pick at this budget from candidates the search really
    proposes. ``gap_to_pool_best``: geometric mean over subgraphs of a contender's geomean best
    over seeds / the pool best. ``lead_vs_xgb_at``: after k trials (each search round's end),
    geometric mean over (subgraph, seed) of xgb's best so far / the contender's.
    """
    infos = [i for i in infos if i.get("db_best_seconds")]
    if not infos:
        return {}
    pool_best = {}
    for i in infos:
        pool_best[i["task"]] = min(pool_best.get(i["task"], np.inf), i["db_best_seconds"])
    budget = max(i["budget"] for i in infos)
    per_iter = min(int(i.get("num_trials_per_iter") or budget) for i in infos)
    checkpoints = sorted({min(budget, k) for k in range(per_iter, budget + per_iter, per_iter)})
    xgb = {(i["task"], i["seed"]): i["curve"] for i in infos if i["contender"] == "xgb"}
    out = {"subgraphs": len(pool_best), "checkpoints": checkpoints, "by_contender": {}}
    for c in sorted({i["contender"] for i in infos}):
        mine = [i for i in infos if i["contender"] == c]
        gaps = [geomean([i["db_best_seconds"] for i in mine if i["task"] == t]) / best
                for t, best in pool_best.items() if any(i["task"] == t for i in mine)]
        entry = {"gap_to_pool_best": geomean(gaps), "lead_vs_xgb_at": {}}
        for k in checkpoints:
            leads = []
            for i in mine:
                ref = xgb.get((i["task"], i["seed"]))
                a, b = _best_at(i["curve"], k), _best_at(ref, k) if ref else None
                if a and b:
                    leads.append(b / a)
            if leads:
                entry["lead_vs_xgb_at"][str(k)] = geomean(leads)
        out["by_contender"][c] = entry
    return out


def _headroom_markdown(h: dict) -> list[str]:
    if not h:
        return []
    ks = h["checkpoints"]
    lines = ["", f"# Headroom: the final bests against the best any run found ({h['subgraphs']} subgraphs)", "",
             "gap: geometric mean of each contender's best (database timing, geomean over seeds) / the fastest "
             "candidate any run of any contender measured for that subgraph. The lead columns: xgb's best so far / "
             "the contender's after k trials, geomean over subgraphs and seeds.", "",
             "| contender | gap to the pool best | " + " | ".join(f"lead vs xgb at {k}" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    for c, e in h["by_contender"].items():
        leads = [f"{e['lead_vs_xgb_at'][str(k)]:.3f}" if str(k) in e["lead_vs_xgb_at"] else "-" for k in ks]
        lines.append(f"| {c} | {e['gap_to_pool_best']:.3f} | " + " | ".join(leads) + " |")
    return lines
