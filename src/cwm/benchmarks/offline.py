"""Offline evaluation on held-out tasks: ranking quality, evaluator throughput, noise probe.

Protocol (``evaluate``): every contender is trained in the same run, from scratch, on the same
records of the training tasks, and scored on the same records of the test tasks:
  cwm              the world model (rolled-out latent + action features + hardware): E, F and R
                   retrained with ``cwm.model.training.train`` on split["train"] (split["val"] is
                   the ranker's validation set); no pretrained model is used
  xgb-static       MetaSchedule's XGBModel on PerStoreFeature (static snapshot of the final code)
  final-state      E(final state) + action features, no transition (the paper's static ablation)
  initial-state    E(initial state) + action features
  action-features  action + schedule + hardware features only, no latent at all
  state-matching   the rolled-out latent of an F trained by state matching alone, the paper's F
                   (only when cwm's F is performance-aware, ``transition_perf_weight > 0``)
  random           uniform scores: the expectation over ``random_draws`` (>= 100) seeded draws
The ablations reuse the retrained E (and F, for nothing but the record) and refit only their
ranker with the cwm ranker's settings. Each metric gets a percentile-bootstrap interval over
test tasks, and each contender the paired difference ``cwm - contender`` on the same resamples.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import asdict, replace

import numpy as np

from ..data.dataset import load_dataset
from ..errors import CwmError
from ..hardware import make_target
from ..io import atomic_write_text, ensure_directory
from ..model.metrics import geomean
from ..schedule.actions import (
    actions_from_trace_json,
    trace_json_from_text,
    trace_json_text,
)
from ..workloads import get_task

log = logging.getLogger(__name__)

CONTENDERS = ("cwm", "xgb-static", "final-state", "initial-state", "action-features", "state-matching", "random")
MIN_RANDOM_DRAWS = 100
MIN_BOOTSTRAP_RESAMPLES = 1000


def ablation_model(base, latent: str, train_ds, val_ds, settings, final_latents=None):
    """``base`` with another latent (``initial``: E(s0), ``final``: E(s_T), ``none``: no latent,
    ``rollout``: the world model itself), its ranker refit on the same records."""
    from ..model.training import fit_ranker
    from ..model.world_model import WorldModel, WorldModelConfig

    model = WorldModel(base.encoder, base.transition, base.ranker,
                       WorldModelConfig(latent=latent, hardware=base.config.hardware))
    model.ranker = fit_ranker(model, train_ds, val_ds, settings, final_latents)
    return model


def _encode_finals(model, ds, max_per_task: int | None, rng, progress: bool):
    """E(final state) of (a sample of) each task's valid records, keyed by record index."""
    from tqdm import tqdm

    chosen = []
    for tid, trajs in sorted(ds.by_task.items()):
        trajs = [t for t in trajs if t.valid]
        if max_per_task and len(trajs) > max_per_task:
            trajs = [trajs[i] for i in sorted(rng.choice(len(trajs), max_per_task, replace=False))]
        chosen.extend(trajs)
    texts = [ds.final_state(t) for t in tqdm(chosen, desc="final states", disable=not progress)]
    vectors = model.encoder.encode(texts)
    kept = {t.record_index for t in chosen}
    return {t.record_index: v for t, v in zip(chosen, vectors)}, kept


def _restrict(ds, record_indices: set):
    sub = ds.subset(ds.tasks)
    sub.trajectories = [t for t in ds.trajectories if t.record_index in record_indices]
    return sub


def cap_records(ds, max_per_task: int | None, rng):
    """``ds`` with at most ``max_per_task`` valid records per task (a seeded sample, in record order)."""
    if not max_per_task:
        return ds
    kept = set()
    for _, trajs in sorted(ds.by_task.items()):
        trajs = [t for t in trajs if t.valid]
        if len(trajs) > max_per_task:
            trajs = [trajs[i] for i in sorted(rng.choice(len(trajs), max_per_task, replace=False))]
        kept.update(t.record_index for t in trajs)
    return _restrict(ds, kept)


def random_contender(latencies, groups, weights=None, *, draws: int = MIN_RANDOM_DRAWS, seed: int = 0):
    """The uniform-random scorer's expected per-group metrics: the mean over ``draws`` seeded draws.

    Returns ``per_group_ranking``'s ``(labels, values, agg_weights)`` with ``values`` averaged over
    the draws (the aggregate weights do not depend on the scores).
    """
    from ..model.metrics import per_group_ranking

    if draws < 1:
        raise CwmError(f"random draws must be >= 1, got {draws}")
    rng = np.random.default_rng(seed)
    lat = np.asarray(latencies, dtype=float)
    total = None
    for _ in range(draws):
        labels, values, agg = per_group_ranking(rng.random(len(lat)), lat, groups, weights)
        if total is None:
            total = {m: np.zeros_like(v) for m, v in values.items()}
        for m, v in values.items():
            total[m] += v  # NaN stays NaN: those groups never count
    return labels, {m: v / draws for m, v in total.items()}, agg


def _interval_json(triple) -> dict:
    mean, lo, hi = triple
    return {"mean": mean, "lo": lo, "hi": hi}


def evaluate(db_dir, split: dict, out_dir, *, settings=None, records_per_task_cap: int | None = None,
             throughput_batch: int = 512, seed: int = 0, progress: bool = True,
             cache_dir=None, curve_repeats: int = 5, random_draws: int = MIN_RANDOM_DRAWS,
             bootstrap_resamples: int = MIN_BOOTSTRAP_RESAMPLES, confidence: float = 0.9) -> dict:
    """Train every contender on split["train"] in this run and score them on split["test"].

    ``cwm`` is retrained from scratch, E and F and R, with ``cwm.model.training.train`` and
    ``settings`` (default ``TrainSettings()``; ``TrainSettings.tiny()`` in tests), and written to
    ``out_dir/model``. Retraining E too is the simple honest choice: E is capped by
    ``settings.encoder_max_seconds`` (8 min by default), small next to the rest of the run, and a
    loaded E could have seen the test tasks (a model directory does not record its task ids).

    ``records_per_task_cap``: at most this many records of
    each training and validation task (one seeded sample) train every contender's ranker, cwm's
    and xgb-static's included, so no contender sees records another does not; it bounds the cost of
    encoding final states for the final-state ablation. ``None``: no cap, and cwm's ranker is the
    one ``train`` fitted. Test records are never capped: every contender scores every valid
    record of every test task.

    ``random`` is the expectation over ``random_draws`` seeded draws. Every metric gets a
    ``confidence`` percentile-bootstrap interval over test tasks (``bootstrap_resamples``
    resamples with replacement, seeded), and every contender the paired difference
    ``cwm - contender`` on the same resamples.

    Writes ``eval.json``, ``eval.md``, ``eval.png`` and ``learning_curve.png`` to ``out_dir``.
    """
    from ..model.metrics import (
        RANKING_METRICS,
        bootstrap_ci,
        bootstrap_difference,
        bootstrap_indices,
        per_group_ranking,
    )
    from ..model.training import (
        TrainSettings,
        fit_transition,
        group_task,
        group_weights,
        ranked_trajectories,
        ranker_arrays,
        train,
    )
    from ..tuning.cost_model import pretrain_xgb, xgb_scores

    settings = settings or TrainSettings()
    if random_draws < MIN_RANDOM_DRAWS:
        raise CwmError(f"random_draws must be at least {MIN_RANDOM_DRAWS}, got {random_draws}")
    if bootstrap_resamples < MIN_BOOTSTRAP_RESAMPLES:
        raise CwmError(f"bootstrap_resamples must be at least {MIN_BOOTSTRAP_RESAMPLES}, got {bootstrap_resamples}")
    if records_per_task_cap is not None and records_per_task_cap < 0:
        raise CwmError(f"records_per_task_cap must be 0 (no cap) or positive, got {records_per_task_cap}")
    cap = records_per_task_cap or None  # 0: no cap
    if cap is not None and cap < 2:
        raise CwmError(f"records_per_task_cap must be at least 2 (a ranker learns from pairs), got {cap}")
    rng = np.random.default_rng(seed)

    out_dir = ensure_directory(out_dir, "output directory")
    ds = load_dataset(db_dir, cache_dir=cache_dir).valid()
    train_ds, val_ds, test_ds = (ds.subset(split.get(k, [])) for k in ("train", "val", "test"))
    if not test_ds.trajectories:
        raise CwmError("the test split has no valid records")
    if not train_ds.trajectories:
        raise CwmError("the train split has no valid records")
    overlap = (set(train_ds.by_task) | set(val_ds.by_task)) & set(test_ds.by_task)
    if overlap:
        raise CwmError(f"{len(overlap)} test task(s) are also in the train or val split, e.g. "
                       f"{ds.tasks[min(overlap)].name}")
    target = make_target(json.dumps({"kind": "llvm", "mcpu": ds.hardware.get("mcpu") or "generic",
                                     "num-cores": int(ds.hardware.get("cores", 1))}))
    timings: dict[str, float] = {}

    # cwm: E, F and R from scratch on the training split.
    t = time.time()
    model_out = out_dir / "model"
    base, train_report = train(db_dir, split, model_out, settings, progress=progress, cache_dir=cache_dir)
    timings["cwm-train"] = time.time() - t

    # The records every ranker learns from: the same (possibly capped) sample for all.
    train_fit, val_fit = cap_records(train_ds, cap, rng), cap_records(val_ds, cap, rng)
    capped = len(train_fit) < len(train_ds) or len(val_fit) < len(val_ds)
    models = {}
    if capped:
        t = time.time()
        models["cwm"] = ablation_model(base, "rollout", train_fit, val_fit, settings)
        timings["cwm-ranker-refit"] = time.time() - t
    else:
        models["cwm"] = base
    for name, latent in (("initial-state", "initial"), ("action-features", "none")):
        t = time.time()
        models[name] = ablation_model(base, latent, train_fit, val_fit, settings)
        timings[f"{name}-train"] = time.time() - t
    contenders = CONTENDERS
    if base.perf_score:
        # F without the within-task loss: what the performance-aware latent adds to the paper's F
        t = time.time()
        plain, _ = fit_transition(train_ds, base.encoder, replace(settings, transition_perf_weight=0.0),
                                  np.random.default_rng(settings.seed), progress)
        models["state-matching"] = ablation_model(base.with_transition(plain), "rollout", train_fit, val_fit,
                                                  settings)
        timings["state-matching-train"] = time.time() - t
    else:
        contenders = tuple(c for c in CONTENDERS if c != "state-matching")

    t = time.time()
    finals = {}
    for part in (train_fit, val_fit, test_ds):
        if part.trajectories:
            finals.update(_encode_finals(base, part, None, rng, progress)[0])
    models["final-state"] = ablation_model(base, "final", train_fit, val_fit, settings, finals)
    timings["final-state-train"] = time.time() - t

    t = time.time()
    xgb = pretrain_xgb(train_fit, target, seed=seed, progress=progress)
    timings["xgb-static-train"] = time.time() - t

    # Scores on every valid test record, in ranker_arrays' order (task by task).
    scores: dict[str, np.ndarray] = {}
    _, lat, groups = ranker_arrays(models["cwm"], test_ds)
    weights = group_weights(test_ds, groups)
    for name in [c for c in contenders if c in models]:
        t = time.time()
        X = ranker_arrays(models[name], test_ds, finals if name == "final-state" else None)[0]
        scores[name] = models[name].ranker.predict(X)
        timings[name] = time.time() - t
    scores["xgb-static"] = np.concatenate([xgb_scores(xgb, ds.modules[tid], [t.actions for t in trajs], target, tid)
                                           for tid, trajs in ranked_trajectories(test_ds)])

    per_task_values, agg_weights = {}, None
    for name in contenders:
        if name == "random":
            labels, values, agg = random_contender(lat, groups, weights, draws=random_draws, seed=seed)
        else:
            labels, values, agg = per_group_ranking(scores[name], lat, groups, weights)
        per_task_values[name] = values
        agg_weights = agg  # the same for every contender: pair counts and task weights only
    idx = bootstrap_indices(len(labels), bootstrap_resamples, seed)
    intervals = {name: {m: _interval_json(bootstrap_ci(per_task_values[name][m], agg_weights[m], indices=idx,
                                                       confidence=confidence))
                        for m in RANKING_METRICS} for name in contenders}
    results = {name: {m: iv["mean"] for m, iv in per.items()} for name, per in intervals.items()}
    differences = {name: {m: _interval_json(bootstrap_difference(per_task_values["cwm"][m], per_task_values[name][m],
                                                                 agg_weights[m], indices=idx, confidence=confidence))
                          for m in RANKING_METRICS} for name in contenders if name != "cwm"}
    def group_name(group):  # a ranking group is a task, or a task on one machine (see ranking_group)
        task = group_task(group)
        return ds.tasks[task].name + str(group)[len(task):]

    per_task = {group_name(g): {name: float(per_task_values[name]["top1"][i]) for name in contenders}
                for i, g in enumerate(labels)}

    cwm = models["cwm"]
    throughput = evaluator_throughput(cwm, xgb, test_ds, target, throughput_batch)
    probe = noise_probe(cwm, ds)
    curve = learning_curve(cwm, models["initial-state"], train_fit,
                           ds.subset(sorted(set(split.get("val", [])) | set(split["test"]))),
                           settings, repeats=curve_repeats, seed=seed, progress=progress)
    def names(part):
        return [ds.tasks[t].name for t in sorted(part.by_task)]

    ranker_fit = "the ranker train() fitted" if not capped else "ranker refit on the capped records"
    report = {
        "protocol": {
            "trained_in_this_run": [c for c in contenders if c != "random"],
            "train_split": "train",
            "validation_split": "val",
            "train_tasks": names(train_ds),
            "val_tasks": names(val_ds),
            "ranker_train_records": len(train_fit),
            "ranker_val_records": len(val_fit),
            "cwm": {
                "trained_with": "cwm.model.training.train",
                "retrained": ["encoder", "transition", "ranker"],
                "pretrained_components": [],
                "ranker": ranker_fit,
                "model_dir": str(model_out),
                "train_counts": train_report.counts,
                "validation": train_report.validation,
            },
            "ablations": "the retrained E; only the ranker refit, with cwm's ranker settings, on the same records",
            "contenders": {
                **{name: {"latent": m.config.latent, "features": len(m.feature_names)} for name, m in models.items()},
                "xgb-static": {"latent": None, "features": "PerStoreFeature of the materialized final code"},
                "random": {"latent": None, "features": None},
            },
            "settings": asdict(settings),
            "seed": seed,
        },
        "records_per_task_cap": cap,
        "records_per_task_cap_applies_to": ("train and val records of every contender's ranker (the same "
                                            "seeded sample); test records are not capped" if cap else None),
        "test_tasks": list(dict.fromkeys(ds.tasks[group_task(g)].name for g in labels)),
        "test_groups": len(labels),
        "test_records": int(len(lat)),
        "metrics": results,
        "intervals": intervals,
        "difference_vs_cwm": differences,
        "bootstrap": {"unit": "test task", "tasks": len(labels), "resamples": bootstrap_resamples,
                      "confidence": confidence, "method": "percentile", "seed": seed,
                      "paired": "cwm and each contender on the same resamples"},
        "random": {"draws": random_draws, "seed": seed},
        "top1_per_task": per_task,
        "throughput": throughput,
        "noise_probe": probe,
        "learning_curve": curve,
        "seconds": timings,
    }
    atomic_write_text(out_dir / "eval.json", json.dumps(report, indent=1, default=float) + "\n")
    atomic_write_text(out_dir / "eval.md", eval_markdown(report))
    plot_eval(report, out_dir / "eval.png")
    plot_learning_curve(curve, out_dir / "learning_curve.png")
    return report


def eval_markdown(report: dict) -> str:
    """The ranking tables of an ``evaluate`` report: each metric with its interval, and ``cwm -
    contender`` with its interval (an interval that excludes 0 marks a difference the test tasks
    support)."""
    from ..model.metrics import RANKING_METRICS

    b = report["bootstrap"]
    pct = f"{100 * b['confidence']:g}%"
    cap = report.get("records_per_task_cap")
    lines = [
        f"# Offline ranking on {len(report['test_tasks'])} held-out tasks ({report['test_records']} records)",
        "",
        f"Every contender trained in this run on the `train` split ({len(report['protocol']['train_tasks'])} tasks, "
        f"{report['protocol']['ranker_train_records']} ranker records; `cwm` retrained from scratch, "
        f"{report['protocol']['cwm']['ranker']}). "
        + (f"At most {cap} records per training/validation task for every ranker. " if cap else "")
        + f"`random`: mean of {report['random']['draws']} draws. "
        f"Intervals: {pct} percentile bootstrap over test tasks, {b['resamples']} resamples."
        + (" With fewer than 2 test tasks the intervals have no width: they say nothing." if b["tasks"] < 2 else ""),
        "",
        "| scorer | " + " | ".join(RANKING_METRICS) + " |",
        "|---|" + "---|" * len(RANKING_METRICS),
    ]
    def fmt(iv, sign=""):
        return f"{iv['mean']:{sign}.3f} [{iv['lo']:{sign}.3f}, {iv['hi']:{sign}.3f}]"

    for name, per in report["intervals"].items():
        lines.append(f"| `{name}` | " + " | ".join(fmt(per[m]) for m in RANKING_METRICS) + " |")
    lines += ["", f"Paired difference `cwm - contender` ({pct} interval):", "",
              "| contender | " + " | ".join(RANKING_METRICS) + " |", "|---|" + "---|" * len(RANKING_METRICS)]
    for name, per in report["difference_vs_cwm"].items():
        lines.append(f"| `{name}` | " + " | ".join(fmt(per[m], "+") for m in RANKING_METRICS) + " |")
    return "\n".join(lines) + "\n"


def compare_models(model_dirs: dict, db_dir, *, cache_dir=None) -> dict:
    """Ranking quality of world models on every task of a database, e.g. measurements from a
    machine or a network none of them was trained on: {name: metrics} plus the counts."""
    from ..model.metrics import evaluate_ranking
    from ..model.training import ranker_arrays
    from ..model.world_model import WorldModel

    if not model_dirs:
        raise CwmError("no world models to compare")
    ds = load_dataset(db_dir, cache_dir=cache_dir).valid()
    if not ds.trajectories:
        raise CwmError(f"{db_dir} has no valid records to rank")
    report = {"db": str(db_dir), "tasks": len(ds.by_task), "records": len(ds.trajectories), "metrics": {}}
    for name, path in model_dirs.items():
        model = WorldModel.load(path)
        X, lat, groups = ranker_arrays(model, ds)
        report["metrics"][name] = evaluate_ranking(model.ranker.predict(X), lat, groups)
    return report


def learning_curve(model, initial_model, train_ds, heldout_ds, settings, *, repeats: int = 5,
                   fractions=(0.25, 0.5, 0.75, 1.0), seed: int = 0, progress: bool = True) -> dict:
    """Held-out ranking quality against the number of training tasks the ranker sees.

    E and F stay fixed; the ranker (cwm, and the initial-state ablation) is refit on random
    subsets of the training tasks, ``repeats`` times per size, and scored on ``heldout_ds``
    (the validation and test tasks, for a steadier estimate than the test tasks alone). A
    curve still rising at the full training set says more tasks would help.
    """
    from tqdm import tqdm

    from ..model.metrics import evaluate_ranking
    from ..model.ranker import LambdaRanker, RankerConfig
    from ..model.training import group_task, group_weights, ranker_arrays

    rng = np.random.default_rng(seed)
    tids = sorted(train_ds.by_task)
    arrays = {}
    for name, m in (("cwm", model), ("initial-state", initial_model)):
        X, lat, groups = ranker_arrays(m, train_ds)
        arrays[name] = (X, lat, groups, np.array([group_task(g) for g in groups]), ranker_arrays(m, heldout_ds),
                        m.feature_names)
    weights = group_weights(heldout_ds, arrays["cwm"][4][2])
    sizes = sorted({max(2, int(round(f * len(tids)))) for f in fractions})
    out = {"heldout_tasks": len(heldout_ds.by_task), "train_tasks": len(tids), "repeats": repeats,
           "sizes": sizes, "by_model": {name: {} for name in arrays}}
    jobs = [(n, r) for n in sizes for r in range(1 if n == len(tids) else repeats)]
    for n, r in tqdm(jobs, desc="learning curve", disable=not progress):
        chosen = set(rng.choice(tids, n, replace=False).tolist())
        for name, (X, lat, groups, tasks_of_rows, (Xh, lath, gh), names) in arrays.items():
            m = np.isin(tasks_of_rows, list(chosen))
            ranker = LambdaRanker(RankerConfig(objective="rank:pairwise", n_estimators=settings.ranker_estimators,
                                               max_depth=6, learning_rate=0.1, lambdarank_num_pair_per_sample=32,
                                               seed=settings.seed + r))
            ranker.fit(X[m], lat[m], groups[m], feature_names=names)
            res = evaluate_ranking(ranker.predict(Xh), lath, gh, weights)
            out["by_model"][name].setdefault(str(n), []).append(res)
    for name, per_size in out["by_model"].items():
        for n, runs in per_size.items():
            per_size[n] = {k: {"mean": float(np.mean([r[k] for r in runs])), "std": float(np.std([r[k] for r in runs])),
                               "runs": len(runs)} for k in runs[0]}
    return out


def plot_learning_curve(curve: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, metric in zip(axes, ("top1", "pairwise_accuracy")):
        for name, per_size in curve["by_model"].items():
            sizes = sorted(int(n) for n in per_size)
            mean = np.array([per_size[str(n)][metric]["mean"] for n in sizes])
            std = np.array([per_size[str(n)][metric]["std"] for n in sizes])
            ax.errorbar(sizes, mean, yerr=std, marker="o", capsize=3, label=name)
        ax.set_xlabel("training tasks seen by the ranker")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"learning curve on {curve['heldout_tasks']} held-out tasks (validation + test)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def evaluator_throughput(model, xgb, ds, target, batch: int, reps: int = 3) -> dict:
    """Candidates scored per second on each test task, with a per-stage breakdown.

    Two views of the same candidates:
    - in MetaSchedule's loop: the search has already replayed each trace into a schedule, so
      ``cwm`` (trace -> actions -> rollout -> rank) is timed against PerStoreFeature + XGB on the
      materialized schedule (``speedup``);
    - from a trace: a static model must first materialize the code (replay the trace), which the
      world model skips (``speedup_from_trace``), as the paper's premise has it.
    Stages are microseconds per candidate, the fastest of ``reps`` cold runs (no cached rows).
    """
    import tvm.s_tir.meta_schedule as ms

    from ..tuning.cost_model import WorldModelCostModel, gc_paused, measure_candidates

    def best_us(fn, n, paused=False):
        """``paused``: a stage of cwm's predict, timed as predict runs it (collector paused)."""
        runs = []
        for _ in range(reps):
            cwm_model._rows.clear()  # time the cold path: no candidate's features are cached
            t = time.perf_counter()
            with gc_paused() if paused else contextlib.nullcontext():
                result = fn()
            runs.append(time.perf_counter() - t)
        return result, min(runs) / n * 1e6

    cwm_model = WorldModelCostModel(model, online=False)
    per_task = {}
    for tid, trajs in sorted(ds.by_task.items()):
        # Distinct candidates only: the cwm cost model scores a repeated trace once.
        trajs = trajs[:batch]
        n = len(trajs)
        if n < 2:
            continue
        actions = [t.actions for t in trajs]
        ctx = ms.TuneContext(mod=ds.modules[tid], target=target, task_name=tid)
        cands, materialize = best_us(lambda: measure_candidates(ds.modules[tid], actions), n)
        cwm_model.predict(ctx, cands[:2])  # E(s0) is computed once per task; count only per-candidate work
        xgb.predict(ctx, cands[:2])
        traces = [c.sch.trace for c in cands]
        texts, serialize = best_us(lambda: [trace_json_text(tr) for tr in traces], n, paused=True)
        decoded, decode = best_us(lambda: [actions_from_trace_json(trace_json_from_text(g, tr))
                                           for g, tr in zip(texts, traces)], n, paused=True)
        X, features = best_us(lambda: model.features(ds.initial_states[tid], decoded, ds.hardware), n, paused=True)
        _, rank = best_us(lambda: model.ranker.predict(X), n, paused=True)
        _, cwm_total = best_us(lambda: cwm_model.predict(ctx, cands), n)
        _, xgb_total = best_us(lambda: xgb.predict(ctx, cands), n)
        per_task[ds.tasks[tid].name] = {
            "candidates": n,
            "us_per_candidate": {"materialize": materialize, "serialize_trace": serialize, "decode_actions": decode,
                                 "features_and_rollout": features, "rank": rank, "cwm_total": cwm_total,
                                 "xgb-static_total": xgb_total},
            "cwm_candidates_per_second": 1e6 / cwm_total,
            "xgb-static_candidates_per_second": 1e6 / xgb_total,
            "speedup": xgb_total / cwm_total,
            "speedup_from_trace": (materialize + xgb_total) / cwm_total,
        }
    if not per_task:
        raise CwmError("no test task has at least 2 candidates to time")
    out = {"batch": batch, "per_task": per_task}
    for key in ("cwm_candidates_per_second", "xgb-static_candidates_per_second", "speedup", "speedup_from_trace"):
        out[key] = geomean(v[key] for v in per_task.values())
    # Where cwm's time goes, summed over tasks: what a faster evaluator would have to cut.
    stages = ("serialize_trace", "decode_actions", "features_and_rollout", "rank")
    totals = {k: sum(v["us_per_candidate"][k] for v in per_task.values()) for k in stages}
    out["cwm_stage_share"] = {k: t / sum(totals.values()) for k, t in totals.items()}
    # The 2,048-candidate prediction time from actions (featurize + rollout + rank), no trace.
    tid, trajs = max(ds.by_task.items(), key=lambda kv: len(kv[1]))
    big = [trajs[i % len(trajs)].actions for i in range(2048)]
    t = time.perf_counter()
    model.predict(ds.initial_states[tid], big, ds.hardware)
    out["predict_2048_seconds"] = time.perf_counter() - t
    return out


NOISE_PAIRS = (
    ("matmul:M=1024,N=1024,K=1024", "matmul:M=1024,N=1023,K=1024"),
    ("conv2d:N=1,C=64,H=56,W=56,K=64,R=3,stride=1,pad=0", "conv2d:N=1,C=64,H=56,W=56,K=64,R=3,stride=1,pad=1"),
)


def noise_probe(model, ds) -> dict:
    """Syntactic-noise probe on structurally equivalent workload pairs.

    distance: ||E(a0) - E(b0)|| relative to the median distance between unrelated tasks (well
    below 1: the encoder sees through the syntactic difference). agreement: Kendall tau between
    the world model's scores of a's measured candidates rolled out from a's initial state and
    from b's (1: the ranking does not care about the syntactic difference).
    """
    from scipy.stats import kendalltau

    by_name = {info.name: tid for tid, info in ds.tasks.items()}
    tids = sorted(ds.initial_states)
    Z = model.encoder.encode([ds.initial_states[t] for t in tids])
    d = np.linalg.norm(Z[:, None] - Z[None], axis=-1)
    baseline = float(np.median(d[np.triu_indices(len(tids), 1)])) if len(tids) > 1 else float("nan")
    out = {"median_inter_task_distance": baseline, "pairs": []}
    for a, b in NOISE_PAIRS:
        text_a, text_b = get_task(a).script(), get_task(b).script()
        za, zb = model.encoder.encode([text_a, text_b])
        row = {"a": a, "b": b, "distance": float(np.linalg.norm(za - zb))}
        row["relative"] = row["distance"] / baseline if baseline else None
        if a in by_name:
            trajs = ds.by_task[by_name[a]][:200]
            actions = [t.actions for t in trajs]
            tau = kendalltau(model.predict(text_a, actions, ds.hardware), model.predict(text_b, actions, ds.hardware))
            row["kendall_tau_cwm"] = float(tau.statistic)
        out["pairs"].append(row)
    return out


def plot_eval(report: dict, path) -> None:
    """Each metric per contender with its bootstrap interval (left), and ``cwm - contender`` with its
    interval (right; above 0: cwm ranks better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("pairwise_accuracy", "ndcg@10", "top1", "top5")
    names = list(report["metrics"])
    intervals = report.get("intervals", {})
    fig, (ax, dax) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(names)

    def bars(axis, table, i, name):
        vals = np.array([table[name][m]["mean"] if isinstance(table[name][m], dict) else table[name][m]
                         for m in metrics], dtype=float)
        err = None
        if all(isinstance(table[name][m], dict) for m in metrics):
            lo = np.array([table[name][m]["lo"] for m in metrics], dtype=float)
            hi = np.array([table[name][m]["hi"] for m in metrics], dtype=float)
            err = np.nan_to_num(np.stack([vals - lo, hi - vals]).clip(min=0))
        axis.bar(np.arange(len(metrics)) + i * width, vals, width, yerr=err, capsize=2, label=name)

    for i, name in enumerate(names):
        bars(ax, intervals if name in intervals else report["metrics"], i, name)
    ax.set_xticks(np.arange(len(metrics)) + 0.4 - width / 2)
    ax.set_xticklabels(metrics)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=2)
    conf = report.get("bootstrap", {}).get("confidence")
    ax.set_title(f"held-out tasks ({len(report['test_tasks'])}), {report['test_records']} records"
                 + (f"; {100 * conf:g}% bootstrap intervals over tasks" if conf else ""), fontsize=9)
    diffs = report.get("difference_vs_cwm", {})
    if diffs:
        dwidth = 0.8 / len(diffs)
        for i, name in enumerate(diffs):
            vals = np.array([diffs[name][m]["mean"] for m in metrics], dtype=float)
            lo = np.array([diffs[name][m]["lo"] for m in metrics], dtype=float)
            hi = np.array([diffs[name][m]["hi"] for m in metrics], dtype=float)
            err = np.nan_to_num(np.stack([vals - lo, hi - vals]).clip(min=0))
            dax.bar(np.arange(len(metrics)) + i * dwidth, vals, dwidth, yerr=err, capsize=2, label=name,
                    color=f"C{names.index(name) if name in names else i}")
        dax.axhline(0, color="black", lw=0.8)
        dax.set_xticks(np.arange(len(metrics)) + 0.4 - dwidth / 2)
        dax.set_xticklabels(metrics)
        dax.set_title("cwm - contender (paired, same resamples); > 0: cwm better", fontsize=9)
        dax.grid(axis="y", alpha=0.3)
    else:
        dax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
