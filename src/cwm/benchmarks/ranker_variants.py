"""The world model's fast experiment loop: ranker (R) variants on cached features.

Every ranker column of every valid record of a split (the rolled-out latent ``z``, F's score head
``perf``, the action, loop-nest and hardware features) is computed once per world model and split,
and cached (``.npz``). A variant then picks columns and ranker settings, fits on the training tasks
(the validation tasks are its early-stopping set) and is scored on the test tasks in seconds to
minutes, with bootstrap intervals over test groups and the paired difference against
``action-features`` (no latent at all) on the same resamples.

An F variant (``TRANSITION_VARIANTS``) replaces the model's F by one refit on the training tasks with the
model's E and training settings, some of them changed; ``refit`` changes none and is the control that
separates a variant's effect from the refit's own noise.

``oof`` columns are the latent and score head of an F that never saw the record's task: the
training tasks are split into K folds and each fold's rows come from an F trained on the other
folds (with the model's E and its training settings); validation and test rows come from the
model's own F, which never saw them either. They answer whether R trusts latent values that are
optimistic only on F's own training tasks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..errors import CwmError
from ..io import atomic_write_text, ensure_directory, portable_path

log = logging.getLogger(__name__)

# The settings of the shipped ranker (cwm.model.training.fit_ranker); every variant starts from them.
BASE_RANKER = {"objective": "rank:pairwise", "n_estimators": 200, "max_depth": 6, "learning_rate": 0.1,
               "lambdarank_num_pair_per_sample": 32, "labels": "throughput", "label_levels": 16}
# What a top-weighted variant changes (issue: R for the top of the list).
TOP_RANKER = {"objective": "rank:ndcg", "labels": "rank", "label_levels": 32, "n_estimators": 1000,
              "early_stopping_rounds": 50, "lambdarank_num_pair_per_sample": 8}
# The znver5 *-top rows kept one tree: validation rows were stored fastest first and XGBoost's NDCG keeps
# that order among tied scores, so round 0 scored highest. Validation rows are now hash-ordered (ranker.py).
RANK_GRADES = {"labels": "rank", "label_levels": 32}
FINAL = "final"  # the column group of E(true final state): final0, final1, ...
COLUMN_GROUPS = ("z", "perf", "oof:z", "oof:perf", FINAL, "act", "sched", "hw")
BASELINE_VARIANT = "action-features"
SHIPPED_TRANSITION = "shipped"
# TrainSettings fields over the model's own for an F refit on the split's training tasks.
TRANSITION_VARIANTS = {
    SHIPPED_TRANSITION: None,
    "refit": {},
    "relative-tiles": {"transition_relative_tiles": True},
    "residual": {"transition_residual": True},
    "relative-tiles-residual": {"transition_relative_tiles": True, "transition_residual": True},
    "perf-main": {"transition_perf_weight": 4.0},  # the score head's loss as the main term
    "all-records": {"transition_perf_trajectories_per_task": 1_000_000},  # every measured record trains the head
}
# E variants for the ``final`` columns (E of each record's true final state): TrainSettings fields over the
# model's own for an E refit on the split's training tasks; ``refit`` changes none (the control).
SHIPPED_ENCODER = "shipped"
ENCODER_VARIANTS = {
    SHIPPED_ENCODER: None,
    "refit": {},
    "latency-head": {"encoder_latency_weight": 1.0},  # within-task ranking loss on measured final states
}
DEFAULT_FOLDS = 4
RESULTS_NAME = "world_model_experiments"


@dataclass(frozen=True)
class RankerVariant:
    """Columns (``COLUMN_GROUPS``) and ranker settings over ``BASE_RANKER``; ``drop_constant``: leave out
    the columns that are constant within every training group (they cannot rank anything)."""

    name: str
    columns: tuple[str, ...]
    ranker: dict = field(default_factory=dict)
    drop_constant: bool = False
    description: str = ""


_STATIC = ("act", "sched", "hw")
VARIANTS: dict[str, RankerVariant] = {v.name: v for v in [
    RankerVariant(BASELINE_VARIANT, _STATIC, description="no latent: action, loop-nest and hardware features"),
    RankerVariant("cwm", ("z", "perf") + _STATIC, description="the shipped ranker's columns and settings"),
    RankerVariant("perf-only", ("perf",) + _STATIC,
                  description="F's score head as the only latent column, no raw z"),
    RankerVariant("oof-cwm", ("oof:z", "oof:perf") + _STATIC,
                  description="z and perf from an F that did not see the row's task (K folds)"),
    RankerVariant("oof-perf-only", ("oof:perf",) + _STATIC, description="out-of-fold score head, no raw z"),
    RankerVariant("action-features-rank-grades", _STATIC, RANK_GRADES,
                  description="grades spread over each group's ranks instead of floor(thr^2 * 15)"),
    RankerVariant("perf-only-rank-grades", ("perf",) + _STATIC, RANK_GRADES,
                  description="score head only, rank grades"),
    RankerVariant("perf-only-rank-grades-no-constant", ("perf",) + _STATIC, RANK_GRADES, drop_constant=True,
                  description="score head only, rank grades, no column that is constant within every group"),
    RankerVariant("action-features-top", _STATIC, TOP_RANKER, drop_constant=True,
                  description="rank grades, rank:ndcg, early stopping on the val tasks, no constant columns"),
    RankerVariant("cwm-top", ("z", "perf") + _STATIC, TOP_RANKER, drop_constant=True,
                  description="the shipped columns with the top-weighted ranker"),
    RankerVariant("perf-only-top", ("perf",) + _STATIC, TOP_RANKER, drop_constant=True,
                  description="score head only, top-weighted ranker"),
    RankerVariant("oof-perf-only-top", ("oof:perf",) + _STATIC, TOP_RANKER, drop_constant=True,
                  description="out-of-fold score head only, top-weighted ranker"),
    RankerVariant("final-state", (FINAL,) + _STATIC,
                  description="E of the true final state and the static features, no F: the gate for state "
                              "matching (F can only predict what E of the final state carries)"),
]}


def get_variant(name: str) -> RankerVariant:
    if name not in VARIANTS:
        raise CwmError(f"unknown ranker variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name]


def column_group(name: str) -> str:
    """The ``COLUMN_GROUPS`` entry of a cached column name (``z12`` -> ``z``, ``act:tile`` -> ``act``)."""
    prefix = "oof:" if name.startswith("oof:") else ""
    base = name[len(prefix):]
    if base == "perf":
        return prefix + "perf"
    if base.startswith("z") and base[1:].isdigit():
        return prefix + "z"
    if base.startswith(FINAL) and base[len(FINAL):].isdigit():
        return FINAL
    return base.split(":")[0]


@dataclass
class SplitFeatures:
    """Ranker columns, latencies and ranking groups of one split's valid records (ranker_arrays order)."""

    X: np.ndarray
    latencies: np.ndarray
    groups: np.ndarray
    names: list[str]

    def columns(self, groups_wanted) -> np.ndarray:
        wanted = set(groups_wanted)
        return np.array([i for i, n in enumerate(self.names) if column_group(n) in wanted], dtype=np.int64)


def model_id(model_dir: Path) -> str:
    """A digest of a world model directory's files: the same model wherever it is checked out."""
    h = hashlib.sha1()
    for f in sorted(Path(model_dir).rglob("*")):
        if f.is_file() and f.suffix in (".json", ".safetensors", ".ubj", ".bin"):
            h.update(str(f.relative_to(model_dir)).encode())
            h.update(hashlib.sha1(f.read_bytes()).digest())
    return h.hexdigest()[:12]


def _cache_key(model_dir: Path, db_dir: Path, split: dict, folds: int, transition: str = SHIPPED_TRANSITION,
               encoder: str | None = None) -> str:
    h = hashlib.sha1()
    h.update(model_id(model_dir).encode())
    if transition != SHIPPED_TRANSITION:
        h.update(json.dumps([transition, TRANSITION_VARIANTS[transition]], sort_keys=True).encode())
    if encoder is not None:
        h.update(json.dumps(["encoder", encoder, ENCODER_VARIANTS[encoder]], sort_keys=True).encode())
    h.update(str(Path(db_dir).resolve()).encode())
    h.update(json.dumps({k: sorted(split.get(k, [])) for k in ("train", "val", "test")}).encode())
    h.update(str(folds).encode())
    return h.hexdigest()[:16]


def _oof_columns(model, train_ds, train_latencies, folds: int, settings, progress: bool):
    """(z, perf) of the training rows, each fold's from an F trained on the other folds."""
    from ..model.training import fit_transition, ranked_trajectories, ranker_arrays
    from ..model.world_model import WorldModel

    tasks = sorted(train_ds.by_task)
    order = np.random.default_rng(settings.seed).permutation(len(tasks))
    fold_of = {tasks[i]: k % folds for k, i in enumerate(order)}
    latent = model.latent_dim
    rows = {tid: len(trajs) for tid, trajs in ranked_trajectories(train_ds)}
    starts, at = {}, 0
    for tid in sorted(rows):
        starts[tid] = at
        at += rows[tid]
    z = np.zeros((at, latent), np.float32)
    perf = np.zeros((at, 1), np.float32)
    for k in range(folds):
        t = time.time()
        inner = train_ds.subset([tid for tid in tasks if fold_of[tid] != k])
        held = train_ds.subset([tid for tid in tasks if fold_of[tid] == k])
        transition, _ = fit_transition(inner, model.encoder, settings, np.random.default_rng(settings.seed + k),
                                       progress)
        fold_model = WorldModel(model.encoder, transition, model.ranker, model.config)
        X, lat, _ = ranker_arrays(fold_model, held)
        at = 0
        for tid, trajs in ranked_trajectories(held):
            n = len(trajs)
            if not np.array_equal(lat[at:at + n], train_latencies[starts[tid]:starts[tid] + n]):
                raise CwmError(f"out-of-fold rows of task {tid} are not in the order of the training rows")
            z[starts[tid]:starts[tid] + n] = X[at:at + n, :latent]
            perf[starts[tid]:starts[tid] + n] = X[at:at + n, latent:latent + 1]
            at += n
        log.info("out-of-fold F %d/%d: %d held-out tasks in %.0f s", k + 1, folds, len(held.by_task),
                 time.time() - t)
    return z, perf


def get_transition_variant(name: str) -> dict | None:
    if name not in TRANSITION_VARIANTS:
        raise CwmError(f"unknown F variant {name!r}; known: {', '.join(TRANSITION_VARIANTS)}")
    return TRANSITION_VARIANTS[name]


def get_encoder_variant(name: str) -> dict | None:
    if name not in ENCODER_VARIANTS:
        raise CwmError(f"unknown E variant {name!r}; known: {', '.join(ENCODER_VARIANTS)}")
    return ENCODER_VARIANTS[name]


def _held_out_model(model_dir: Path, split: dict):
    """The world model of ``model_dir``, refused if it saw any of the split's test tasks."""
    from ..model.world_model import WorldModel, training_tasks

    model = WorldModel.load(model_dir)
    seen = training_tasks(model_dir)
    test = set(split.get("test", []))
    if not test:
        raise CwmError("the split has no test tasks")
    if seen is not None and seen & test:
        raise CwmError(f"{len(seen & test)} test task(s) were in {model_dir}'s training data")
    return model


def _split_parts(db_dir, split: dict, cache_dir):
    from ..data.dataset import load_dataset

    ds = load_dataset(db_dir, cache_dir=cache_dir).valid()
    parts = {part: ds.subset(split.get(part, [])) for part in ("train", "val", "test")}
    for part in ("train", "test"):
        if not parts[part].trajectories:
            raise CwmError(f"the {part} split has no valid records")
    return parts


def split_features(model_dir, db_dir, split: dict, *, folds: int = DEFAULT_FOLDS, cache_dir=None,
                   progress: bool = True, transition: str = SHIPPED_TRANSITION) -> dict[str, SplitFeatures]:
    """Every ranker column of the train, val and test records under ``model_dir``'s world model (which
    must not have seen the test tasks), with ``oof`` columns for ``folds`` > 1; cached in ``cache_dir``.
    ``transition`` other than ``shipped`` first refits F on the training tasks (``TRANSITION_VARIANTS``)."""
    from ..model.training import fit_transition, ranker_arrays, trained_settings
    from ..model.world_model import WorldModel

    overrides = get_transition_variant(transition)
    model_dir = Path(model_dir)
    model = _held_out_model(model_dir, split)
    if not model.perf_score or model.config.latent != "rollout":
        raise CwmError(f"{model_dir}: the experiment loop needs a rollout world model with F's score head")
    cache = None
    if cache_dir is not None:
        key = _cache_key(model_dir, Path(db_dir), split, folds, transition)
        cache = Path(cache_dir) / f"ranker_features_{key}.npz"
        if cache.exists():
            data = np.load(cache, allow_pickle=False)
            names = [str(n) for n in data["names"]]
            return {part: SplitFeatures(data[f"{part}_X"], data[f"{part}_lat"], data[f"{part}_groups"].astype(str),
                                        names) for part in ("train", "val", "test")}
    parts = _split_parts(db_dir, split, cache_dir)
    settings = replace(trained_settings(model.config.trained_on), **(overrides or {}))
    if overrides is not None:
        t = time.time()
        refit, _ = fit_transition(parts["train"], model.encoder, settings, np.random.default_rng(settings.seed),
                                  progress)
        model = WorldModel(model.encoder, refit, model.ranker, model.config)
        log.info("F %s refit on %d training tasks in %.0f s", transition, len(parts["train"].by_task),
                 time.time() - t)
    out = {}
    for part, sub in parts.items():
        t = time.time()
        X, lat, groups = ranker_arrays(model, sub) if sub.trajectories else (
            np.zeros((0, len(model.feature_names)), np.float32), np.zeros(0), np.zeros(0, dtype=str))
        out[part] = SplitFeatures(X.astype(np.float32), lat, np.asarray(groups).astype(str), list(model.feature_names))
        log.info("%s: %d rows in %.0f s", part, len(X), time.time() - t)
    if folds > 1:
        z_oof, perf_oof = _oof_columns(model, parts["train"], out["train"].latencies, folds, settings, progress)
        latent = model.latent_dim
        for part, f in out.items():
            if part == "train":
                extra = np.concatenate([z_oof, perf_oof], axis=1)
            else:  # the model's own F never saw these tasks
                extra = f.X[:, :latent + 1]
            f.X = np.concatenate([f.X, extra], axis=1)
            f.names = f.names + [f"oof:z{i}" for i in range(latent)] + ["oof:perf"]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, names=np.array(out["train"].names),
                            **{f"{p}_{k}": v for p, f in out.items()
                               for k, v in (("X", f.X), ("lat", f.latencies), ("groups", f.groups))})
        tmp.replace(cache)
    return out


def final_state_columns(model_dir, db_dir, split: dict, *, encoder: str = SHIPPED_ENCODER, cache_dir=None,
                        progress: bool = True, chunk: int = 512) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(E of the true final state, latency) of every valid train, val and test record, in the rows'
    order (``ranker_parts``), under the model's E or the E variant ``encoder`` refit on the training tasks
    (``ENCODER_VARIANTS``); cached in ``cache_dir``, where the replayed states are cached too."""
    from tqdm.auto import tqdm

    from ..model.training import fit_encoder, ranker_parts, trained_settings

    overrides = get_encoder_variant(encoder)
    model_dir = Path(model_dir)
    model = _held_out_model(model_dir, split)
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"final_states_{_cache_key(model_dir, Path(db_dir), split, 0, encoder=encoder)}.npz"
        if cache.exists():
            data = np.load(cache, allow_pickle=False)
            return {part: (data[f"{part}_E"], data[f"{part}_lat"]) for part in ("train", "val", "test")}
    parts = _split_parts(db_dir, split, cache_dir)
    states = model.encoder
    if overrides is not None:
        t = time.time()
        settings = replace(trained_settings(model.config.trained_on), **overrides)
        states, _ = fit_encoder(parts["train"], settings, np.random.default_rng(settings.seed), progress)
        log.info("E %s refit on %d training tasks in %.0f s", encoder, len(parts["train"].by_task), time.time() - t)
    out = {}
    for part, sub in parts.items():
        rows = [t for _, _, records in ranker_parts(sub) for t in records]
        vectors = np.zeros((len(rows), states.dim), np.float32)
        bar = tqdm(total=len(rows), desc=f"final states ({part})", unit="state", disable=not progress)
        for start in range(0, len(rows), chunk):
            part_rows = rows[start:start + chunk]
            vectors[start:start + len(part_rows)] = states.encode([sub.final_state(t) for t in part_rows])
            bar.update(len(part_rows))
        bar.close()
        out[part] = (vectors, np.asarray([t.latency for t in rows], dtype=float))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, **{f"{p}_{k}": v for p, (E, lat) in out.items() for k, v in (("E", E), ("lat", lat))})
        tmp.replace(cache)
    return out


def with_final_columns(features: dict[str, SplitFeatures], finals: dict) -> dict[str, SplitFeatures]:
    """``features`` with the ``final`` columns appended, after checking that the rows line up."""
    out = {}
    for part, f in features.items():
        E, lat = finals[part]
        if len(lat) != len(f.latencies) or not np.array_equal(lat, f.latencies):
            raise CwmError(f"the final-state rows of the {part} split do not line up with its feature rows")
        out[part] = SplitFeatures(np.concatenate([f.X, E.astype(f.X.dtype)], axis=1), f.latencies, f.groups,
                                  f.names + [f"{FINAL}{i}" for i in range(E.shape[1])])
    return out


def constant_columns(X: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Mask of the columns that take one value within every group (they order no pair)."""
    const = np.ones(X.shape[1], dtype=bool)
    for g in np.unique(groups):
        rows = X[groups == g]
        if len(rows) > 1:
            const &= (rows.max(axis=0) == rows.min(axis=0))
    return const


def fit_variant(variant: RankerVariant, features: dict[str, SplitFeatures], seed: int = 0):
    """(ranker, column indices) of ``variant`` fitted on the train rows, early-stopped on the val rows."""
    from ..model.ranker import LambdaRanker, RankerConfig

    train, val = features["train"], features["val"]
    cols = train.columns(variant.columns)
    if len(cols) == 0:
        raise CwmError(f"variant {variant.name}: none of its columns {variant.columns} are in the features "
                       "(oof columns need --folds > 1)")
    if variant.drop_constant:
        cols = cols[~constant_columns(train.X[:, cols], train.groups)]
    config = RankerConfig(**{**BASE_RANKER, **variant.ranker, "seed": seed})
    eval_set = (val.X[:, cols], val.latencies, val.groups) if len(val.X) else None
    if eval_set is None and config.early_stopping_rounds:
        config = replace(config, early_stopping_rounds=0)
    ranker = LambdaRanker(config).fit(train.X[:, cols], train.latencies, train.groups, eval_set=eval_set,
                                      feature_names=[train.names[i] for i in cols])
    return ranker, cols


def run_variants(model_dir, db_dir, split: dict, variants, out_dir, *, folds: int = DEFAULT_FOLDS,
                 cache_dir=None, seed: int = 0, resamples: int = 1000, confidence: float = 0.9,
                 command: str = "", progress: bool = True, transition: str = SHIPPED_TRANSITION,
                 encoder: str = SHIPPED_ENCODER) -> dict:
    """Fit and score ``variants`` (names of ``VARIANTS``) on the columns of the model's F or of the F
    variant ``transition`` (and, for the ``final`` columns, of its E or the E variant ``encoder``), and merge
    their rows into ``out_dir/world_model_experiments.{json,md}`` (one row per variant, model, F, E and
    machine; a rerun replaces its own rows, the others stay)."""
    from ..hardware import host_cpu
    from ..model.metrics import (
        RANKING_METRICS,
        bootstrap_ci,
        bootstrap_difference,
        bootstrap_indices,
        per_group_ranking,
    )

    get_transition_variant(transition)
    get_encoder_variant(encoder)
    chosen = [get_variant(v) for v in dict.fromkeys(variants)]
    names = [v.name for v in chosen]
    if BASELINE_VARIANT not in names:
        chosen.insert(0, get_variant(BASELINE_VARIANT))
    out_dir = ensure_directory(out_dir, "output directory")
    t0 = time.time()
    features = split_features(model_dir, db_dir, split, folds=folds, cache_dir=cache_dir, progress=progress,
                              transition=transition)
    if any(FINAL in v.columns for v in chosen):
        features = with_final_columns(features, final_state_columns(model_dir, db_dir, split, encoder=encoder,
                                                                    cache_dir=cache_dir, progress=progress))
    feature_seconds = time.time() - t0
    test = features["test"]
    scores, info = {}, {}
    for variant in chosen:
        t = time.time()
        ranker, cols = fit_variant(variant, features, seed)
        scores[variant.name] = ranker.predict(test.X[:, cols])
        info[variant.name] = {"columns": len(cols), "trees": ranker.num_boosted_rounds,
                              "fit_seconds": round(time.time() - t, 1)}
    per = {}
    for name, s in scores.items():
        labels, values, agg = per_group_ranking(s, test.latencies, test.groups)
        per[name] = values
    idx = bootstrap_indices(len(labels), resamples, seed)
    machine = host_cpu().mcpu or "unknown"
    rows = []
    for variant in chosen:
        name = variant.name
        row = {"variant": name, "description": variant.description, "model": portable_path(model_dir),
               "model_id": model_id(Path(model_dir)), "transition": transition, "encoder": encoder,
               "machine": machine,
               "folds": folds if any(c.startswith("oof:") for c in variant.columns) else None,
               "command": command, "date": time.strftime("%Y-%m-%d"), **info[name], "metrics": {}}
        for m in RANKING_METRICS:
            mean, lo, hi = bootstrap_ci(per[name][m], agg[m], indices=idx, confidence=confidence)
            d, dlo, dhi = bootstrap_difference(per[name][m], per[BASELINE_VARIANT][m], agg[m], indices=idx,
                                               confidence=confidence)
            row["metrics"][m] = {"mean": mean, "lo": lo, "hi": hi, "vs_baseline": d, "vs_lo": dlo, "vs_hi": dhi}
        # pooled pairwise is dominated by the largest groups; the plain mean over groups beside it
        row["metrics"]["pairwise_per_group"] = dict(zip(("mean", "lo", "hi"), bootstrap_ci(
            per[name]["pairwise_accuracy"], np.ones(len(labels)), indices=idx, confidence=confidence)))
        rows.append(row)
    report = _merge_rows(out_dir / f"{RESULTS_NAME}.json", rows, {
        "test_groups": len(labels), "test_records": int(len(test.latencies)),
        "train_records": int(len(features["train"].latencies)), "val_records": int(len(features["val"].latencies)),
        "bootstrap": {"unit": "test group (task@machine)", "resamples": resamples, "confidence": confidence,
                      "paired_against": BASELINE_VARIANT},
        "feature_seconds": round(feature_seconds, 1)})
    atomic_write_text(out_dir / f"{RESULTS_NAME}.md", experiments_markdown(report))
    return report


def _merge_rows(path: Path, rows: list[dict], meta: dict) -> dict:
    report = {"rows": []}
    if path.exists():
        try:
            report = json.loads(path.read_text())
        except json.JSONDecodeError:
            raise CwmError(f"{path} is not valid JSON; move it away to start a new table") from None
    key = lambda r: (r["variant"], r.get("model_id", r["model"]), r.get("transition", SHIPPED_TRANSITION),  # noqa: E731
                     r.get("encoder", SHIPPED_ENCODER), r["machine"])
    new = {key(r) for r in rows}
    report["rows"] = [r for r in report.get("rows", []) if key(r) not in new] + rows
    report.update(meta)
    atomic_write_text(path, json.dumps(report, indent=1, default=float) + "\n")
    return report


def experiments_markdown(report: dict) -> str:
    def iv(m):
        return f"{m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]"

    def diff(m):
        return f"{m['vs_baseline']:+.3f} [{m['vs_lo']:+.3f}, {m['vs_hi']:+.3f}]"

    b = report.get("bootstrap", {})
    lines = [
        "# World-model experiments: ranker variants on held-out tasks",
        "",
        f"Test: {report.get('test_records')} records in {report.get('test_groups')} groups (task@machine); "
        f"rankers fit on {report.get('train_records')} training records, early stopping (where set) on "
        f"{report.get('val_records')} validation records. Intervals: {b.get('confidence', 0.9):.0%} percentile "
        f"bootstrap over test groups; differences are paired against `{b.get('paired_against', BASELINE_VARIANT)}` "
        "on the same resamples. Pooled pairwise weighs groups by their pairs; `pairwise/group` is the plain mean "
        "over groups. Every row stays, negative ones included.",
        "",
        "| variant | machine | model | F | columns | trees | top-1 | top-5 | pairwise | pairwise/group | "
        "top-1 vs baseline | top-5 vs baseline | pairwise vs baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        m = r["metrics"]
        encoder = r.get("encoder", SHIPPED_ENCODER)
        f = r.get("transition", SHIPPED_TRANSITION) + ("" if encoder == SHIPPED_ENCODER else f", E {encoder}")
        lines.append(f"| {r['variant']} | `{r['machine']}` | {r['model']} | {f} | "
                     f"{r['columns']} | {r['trees']} | "
                     f"{iv(m['top1'])} | {iv(m['top5'])} | {iv(m['pairwise_accuracy'])} | "
                     f"{iv(m['pairwise_per_group'])} | {diff(m['top1'])} | {diff(m['top5'])} | "
                     f"{diff(m['pairwise_accuracy'])} |")
    lines += ["", "Variants:", ""]
    seen = set()
    for r in report["rows"]:
        if r["variant"] not in seen:
            seen.add(r["variant"])
            folds = f" ({r['folds']} folds)" if r.get("folds") else ""
            lines.append(f"- `{r['variant']}`: {r['description']}{folds}. Command: `{r['command']}`")
    return "\n".join(lines) + "\n"
