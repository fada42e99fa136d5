"""Offline evaluation on held-out tasks: ranking quality, evaluator throughput, noise probe.

Contenders, all trained on the same training records:
  cwm            the world model (rolled-out latent + action features + hardware)
  xgb-static     MetaSchedule's XGBModel on PerStoreFeature (static snapshot of the final code)
  final-state    E(final state) + action features, no transition (the paper's static ablation)
  initial-state  E(initial state) + action features
  random         uniform scores
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

import numpy as np

from ..errors import CwmError
from ..model.metrics import geomean

log = logging.getLogger(__name__)

CONTENDERS = ("cwm", "xgb-static", "final-state", "initial-state", "random")


def ablation_model(base, latent: str, train_ds, val_ds, settings, final_latents=None):
    """``base`` with another latent (``initial``: E(s0), ``final``: E(s_T)), its ranker refit on the same records."""
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


def evaluate(model_dir, db_dir, split: dict, out_dir, *, settings=None, final_per_task: int = 64,
             throughput_batch: int = 512, seed: int = 0, progress: bool = True, cache_dir=None,
             curve_repeats: int = 5) -> dict:
    from ..data.dataset import load_dataset
    from ..hardware import make_target
    from ..model.metrics import evaluate_ranking
    from ..model.training import TrainSettings, ranker_arrays
    from ..model.world_model import WorldModel
    from ..tuning.cost_model import pretrain_xgb, xgb_scores

    settings = settings or TrainSettings()
    rng = np.random.default_rng(seed)
    from ..io import ensure_directory

    model = WorldModel.load(model_dir)
    out_dir = ensure_directory(out_dir, "output directory")
    ds = load_dataset(db_dir, cache_dir=cache_dir).valid()
    train_ds, val_ds, test_ds = (ds.subset(split[k]) for k in ("train", "val", "test"))
    if not test_ds.trajectories:
        raise CwmError("the test split has no valid records")
    weights = {tid: ds.tasks[tid].weight for tid in test_ds.by_task}
    target = make_target(json.dumps({"kind": "llvm", "mcpu": ds.hardware.get("mcpu") or "generic",
                                     "num-cores": int(ds.hardware.get("cores", 1))}))
    scores: dict[str, np.ndarray] = {}
    timings: dict[str, float] = {}

    X, lat, groups = ranker_arrays(model, test_ds)
    t = time.time()
    scores["cwm"] = model.ranker.predict(X)
    timings["cwm"] = time.time() - t

    t = time.time()
    xgb = pretrain_xgb(train_ds, target, seed=seed, progress=progress)
    timings["xgb-static-train"] = time.time() - t
    scores["xgb-static"] = np.concatenate([xgb_scores(xgb, ds.modules[tid], [t.actions for t in trajs], target, tid)
                                           for tid, trajs in sorted(test_ds.by_task.items())])

    t = time.time()
    initial = ablation_model(model, "initial", train_ds, val_ds, settings)
    scores["initial-state"] = initial.ranker.predict(ranker_arrays(initial, test_ds)[0])
    timings["initial-state-train"] = time.time() - t

    t = time.time()
    finals_train, kept_train = _encode_finals(model, train_ds, final_per_task, rng, progress)
    finals_val, kept_val = _encode_finals(model, val_ds, final_per_task, rng, progress)
    finals_test, _ = _encode_finals(model, test_ds, None, rng, progress)
    finals = {**finals_train, **finals_val, **finals_test}
    final = ablation_model(model, "final", _restrict(train_ds, kept_train), _restrict(val_ds, kept_val),
                            settings, finals)
    scores["final-state"] = final.ranker.predict(ranker_arrays(final, test_ds, finals)[0])
    timings["final-state-train"] = time.time() - t

    scores["random"] = rng.random(len(lat))
    results = {name: evaluate_ranking(scores[name], lat, groups, weights) for name in CONTENDERS}
    per_task = {}
    for tid in sorted(test_ds.by_task):
        m = groups == tid
        per_task[ds.tasks[tid].name] = {name: evaluate_ranking(scores[name][m], lat[m], groups[m])["top1"]
                                        for name in CONTENDERS}

    throughput = evaluator_throughput(model, xgb, test_ds, target, throughput_batch)
    probe = noise_probe(model, ds)
    curve = learning_curve(model, initial, train_ds, ds.subset(sorted(set(split["val"]) | set(split["test"]))),
                           settings, repeats=curve_repeats, seed=seed, progress=progress)
    report = {
        "test_tasks": [ds.tasks[t].name for t in sorted(test_ds.by_task)],
        "test_records": int(len(lat)),
        "metrics": results,
        "top1_per_task": per_task,
        "throughput": throughput,
        "noise_probe": probe,
        "learning_curve": curve,
        "seconds": timings,
    }
    (out_dir / "eval.json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    plot_eval(report, out_dir / "eval.png")
    plot_learning_curve(curve, out_dir / "learning_curve.png")
    return report


def compare_models(model_dirs: dict, db_dir, *, cache_dir=None) -> dict:
    """Ranking quality of world models on every task of a database, e.g. measurements from a
    machine or a network none of them was trained on: {name: metrics} plus the counts."""
    from ..data.dataset import load_dataset
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
    from ..model.training import ranker_arrays

    rng = np.random.default_rng(seed)
    tids = sorted(train_ds.by_task)
    weights = {tid: heldout_ds.tasks[tid].weight for tid in heldout_ds.by_task}
    arrays = {}
    for name, m in (("cwm", model), ("initial-state", initial_model)):
        X, lat, groups = ranker_arrays(m, train_ds)
        arrays[name] = (X, lat, groups, ranker_arrays(m, heldout_ds), m.feature_names)
    sizes = sorted({max(2, int(round(f * len(tids)))) for f in fractions})
    out = {"heldout_tasks": len(heldout_ds.by_task), "train_tasks": len(tids), "repeats": repeats,
           "sizes": sizes, "by_model": {name: {} for name in arrays}}
    jobs = [(n, r) for n in sizes for r in range(1 if n == len(tids) else repeats)]
    for n, r in tqdm(jobs, desc="learning curve", disable=not progress):
        chosen = set(rng.choice(tids, n, replace=False).tolist())
        for name, (X, lat, groups, (Xh, lath, gh), names) in arrays.items():
            m = np.isin(groups, list(chosen))
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

    from ..schedule.actions import (
        actions_from_trace_json,
        trace_json_from_text,
        trace_json_text,
    )
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

    from ..workloads import get_task

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("pairwise_accuracy", "ndcg@10", "top1", "top5")
    names = list(report["metrics"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [report["metrics"][name][m] for m in metrics]
        ax.bar(np.arange(len(metrics)) + i * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(metrics)) + 0.4 - width / 2)
    ax.set_xticklabels(metrics)
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title(f"held-out tasks ({len(report['test_tasks'])}), {report['test_records']} records")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
