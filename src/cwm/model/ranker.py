"""Learning-to-rank cost model: ranks candidate schedules *within* a task.

Only the order of candidates inside one task (group) matters for
MetaSchedule's search, so the model is trained with XGBoost's LambdaMART
objectives on per-group relevance grades derived from measured throughput,
never on absolute latency.  Scores returned by :meth:`LambdaRanker.predict`
are only comparable within one task; HIGHER = predicted FASTER.

Typical use::

    ranker = LambdaRanker(RankerConfig(n_estimators=300)).fit(X, lat, groups)
    scores = ranker.predict(X_candidates)
    ranker.update(X_measured, lat_measured, task_ids)   # online adaptation
    ranker.save("out/ranker"); LambdaRanker.load("out/ranker")
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import CwmError
from ..io import read_config, write_config
from .metrics import as_latencies, group_codes

__all__ = [
    "MODEL_FILE",
    "CONFIG_FILE",
    "relevance_labels",
    "rank_labels",
    "RankerConfig",
    "LambdaRanker",
    "TaskAdapter",
    "PessimisticEnsemble",
]

MODEL_FILE = "ranker.json"
CONFIG_FILE = "ranker_config.json"
_FORMAT = "cwm.ranker"
_OBJECTIVES = ("rank:ndcg", "rank:pairwise")
_PAIR_METHODS = ("topk", "mean")
_LABELS = ("throughput", "rank")
# XGBoost's NDCG with exponential gain requires labels < 32.
_MAX_LEVELS = 32


# --------------------------------------------------------------------------- labels


def _graded_groups(latencies: Any, groups: Any, levels: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The checked inputs of a grading: ``(levels, latencies, group codes)``."""
    levels = int(levels)
    if levels < 2:
        raise CwmError(f"levels must be >= 2, got {levels}")
    lat = as_latencies(latencies)
    codes, _ = group_codes(groups)
    if len(lat) != len(codes):
        raise CwmError(f"latencies and groups must have the same length, got {len(lat)} and {len(codes)}")
    return levels, lat, codes


def relevance_labels(latencies: Any, groups: Any, levels: int = 16) -> np.ndarray:
    """Integer relevance grades ``0..levels-1`` from within-group throughput.

    ``throughput = min_latency_in_group / latency`` lies in (0, 1]; the grade is
    ``floor(throughput**2 * (levels - 1))``, so the fastest candidate of each
    group gets ``levels - 1`` and grades are monotone (non-increasing) in
    latency.  Invalid candidates (None/NaN/inf/<=0 latency) get 0.
    """
    levels, lat, codes = _graded_groups(latencies, groups, levels)
    labels = np.zeros(len(lat), dtype=np.int32)
    if len(lat) == 0:
        return labels
    valid = ~np.isnan(lat)
    best = np.full(int(codes.max()) + 1, np.inf)
    np.minimum.at(best, codes[valid], lat[valid])
    thr = best[codes[valid]] / lat[valid]
    grades = np.floor(thr * thr * (levels - 1) + 1e-9).astype(np.int32)
    labels[valid] = np.clip(grades, 0, levels - 1)
    return labels


def rank_labels(latencies: Any, groups: Any, levels: int = 32) -> np.ndarray:
    """Integer grades ``0..levels-1`` from each candidate's rank within its group: the fastest gets
    ``levels - 1`` and the grades are spread evenly over the group's ranks, so a pairwise objective
    sees an order among the slow candidates too (``relevance_labels`` puts everything slower than
    ~0.26x the best into grade 0). Ties share a grade; invalid candidates get 0."""
    from scipy.stats import rankdata

    levels, lat, codes = _graded_groups(latencies, groups, levels)
    labels = np.zeros(len(lat), dtype=np.int32)
    valid = ~np.isnan(lat)
    for g in np.unique(codes[valid]):
        rows = np.flatnonzero(valid & (codes == g))
        if len(rows) < 2:
            labels[rows] = levels - 1
            continue
        # rank 1 = fastest; fraction of the group at least as slow, in (0, 1]
        frac = 1.0 - (rankdata(lat[rows], method="min") - 1) / len(rows)
        labels[rows] = np.clip(np.ceil(frac * levels) - 1, 0, levels - 1).astype(np.int32)
    return labels


# --------------------------------------------------------------------------- config


@dataclass
class RankerConfig:
    """Hyper-parameters of :class:`LambdaRanker` (``n_jobs=0`` = all CPUs)."""

    objective: str = "rank:ndcg"
    n_estimators: int = 300
    max_depth: int = 6
    learning_rate: float = 0.1
    subsample: float = 0.9
    colsample_bytree: float = 0.9
    min_child_weight: float = 1.0
    lambdarank_pair_method: str = "topk"
    lambdarank_num_pair_per_sample: int = 8
    seed: int = 0
    n_jobs: int = 0
    label_levels: int = 16
    # "throughput": floor(thr^2 * (levels-1)) grades; "rank": grades spread over within-group ranks
    labels: str = "throughput"
    # stop adding trees when the validation NDCG@10 has not improved for this many rounds (0: never)
    early_stopping_rounds: int = 0
    # XGBoost's rank:ndcg hessians sum to only ~2 per group, so with
    # min_child_weight=1 an update() on one task's few dozen candidates can
    # not split at all (the root leaf of a single group is exactly 0).
    update_min_child_weight: float = 0.1

    def __post_init__(self) -> None:
        if self.objective not in _OBJECTIVES:
            raise CwmError(f"objective must be one of {_OBJECTIVES}, got {self.objective!r}")
        if self.lambdarank_pair_method not in _PAIR_METHODS:
            raise CwmError(
                f"lambdarank_pair_method must be one of {_PAIR_METHODS}, "
                f"got {self.lambdarank_pair_method!r}"
            )
        if self.n_estimators < 1:
            raise CwmError(f"n_estimators must be >= 1, got {self.n_estimators}")
        if self.max_depth < 1:
            raise CwmError(f"max_depth must be >= 1, got {self.max_depth}")
        if not self.learning_rate > 0:
            raise CwmError(f"learning_rate must be > 0, got {self.learning_rate}")
        for name in ("subsample", "colsample_bytree"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise CwmError(f"{name} must be in (0, 1], got {v}")
        for name in ("min_child_weight", "update_min_child_weight"):
            v = getattr(self, name)
            if not v >= 0:
                raise CwmError(f"{name} must be >= 0, got {v}")
        if self.lambdarank_num_pair_per_sample < 1:
            raise CwmError(
                "lambdarank_num_pair_per_sample must be >= 1, "
                f"got {self.lambdarank_num_pair_per_sample}"
            )
        if self.n_jobs < 0:
            raise CwmError(f"n_jobs must be >= 0 (0 = all CPUs), got {self.n_jobs}")
        if self.labels not in _LABELS:
            raise CwmError(f"labels must be one of {_LABELS}, got {self.labels!r}")
        if self.early_stopping_rounds < 0:
            raise CwmError(f"early_stopping_rounds must be >= 0, got {self.early_stopping_rounds}")
        if not 2 <= self.label_levels <= _MAX_LEVELS:
            raise CwmError(f"label_levels must be in [2, {_MAX_LEVELS}], got {self.label_levels}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RankerConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CwmError(f"unknown RankerConfig keys: {', '.join(unknown)}")
        return cls(**d)

    def threads(self) -> int:
        return self.n_jobs if self.n_jobs > 0 else (os.cpu_count() or 1)

    def xgb_params(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "eval_metric": "ndcg@10",
            "tree_method": "hist",
            "max_depth": self.max_depth,
            "eta": self.learning_rate,
            "subsample": self.subsample,
            "colsample_bytree": self.colsample_bytree,
            "min_child_weight": self.min_child_weight,
            "lambdarank_pair_method": self.lambdarank_pair_method,
            "lambdarank_num_pair_per_sample": self.lambdarank_num_pair_per_sample,
            "seed": self.seed,
            # re-seed every round: continued boosting (update) must not depend on earlier calls
            "seed_per_iteration": True,
            "nthread": self.threads(),
            "verbosity": 0,
        }


# --------------------------------------------------------------------------- ranker


def _row_hash(X: np.ndarray) -> np.ndarray:
    """A deterministic per-row hash of the float32 bit patterns (uint64, wraps)."""
    if X.shape[1] == 0:
        return np.zeros(X.shape[0], dtype=np.uint64)
    bits = np.ascontiguousarray(X).view(np.uint32).astype(np.uint64)
    rng = np.random.default_rng(0x5EED)
    mult = rng.integers(1, 2**63, size=X.shape[1], dtype=np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):
        return (bits * mult).sum(axis=1, dtype=np.uint64)


class LambdaRanker:
    """Within-task ranker (XGBoost LambdaMART) with scikit-learn habits.

    Learned state: ``booster_``, ``n_features_``, ``feature_names_``,
    ``history_`` (evals of the last :meth:`fit`), ``update_history_`` (one
    entry per :meth:`update`).  All randomness comes from ``config.seed``.
    """

    def __init__(self, config: RankerConfig | None = None) -> None:
        self.config = config if config is not None else RankerConfig()
        self.booster_ = None
        self.n_features_: int | None = None
        self.feature_names_: list[str] | None = None
        self.history_: dict[str, dict[str, list[float]]] = {}
        self.update_history_: list[dict[str, Any]] = []

    # ----------------------------------------------------------------- helpers

    @property
    def is_fitted(self) -> bool:
        return self.booster_ is not None

    def _check_X(self, X: Any, what: str = "X") -> np.ndarray:
        try:
            arr = np.asarray(X, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise CwmError(f"{what} must be a numeric 2-D array: {e}") from None
        if arr.ndim != 2:
            raise CwmError(f"{what} must be 2-D (rows x features), got shape {arr.shape}")
        if self.n_features_ is not None and arr.shape[1] != self.n_features_:
            raise CwmError(
                f"feature count mismatch in {what}: the ranker expects {self.n_features_} "
                f"features, got {arr.shape[1]}"
            )
        return np.ascontiguousarray(arr)

    def _dmatrix(self, X: Any, latencies: Any, groups: Any, what: str, fastest_first: bool = True):
        """Build a group-sorted DMatrix; None if no group has >= 2 valid candidates.

        Rows are put into a canonical order so the model does not depend on the order the caller
        passed rows in: by group, then fastest first (training rows: at tied scores, i.e. the
        first round, LambdaMART's top-k pairs start from the fastest candidates; on the v2 split
        a hash order instead cost ``action-features`` 0.04 of top-1), or with ``fastest_first``
        False by row content and a hash of the latency (validation rows: XGBoost's NDCG keeps the
        row order among tied scores, so rows sorted fastest first made an uninformative model
        score a perfect validation NDCG, and early stopping kept a single tree).
        """
        import xgboost as xgb

        Xa = self._check_X(X, what)
        lat = as_latencies(latencies)
        try:
            codes, _ = group_codes(groups)
        except ValueError as e:
            raise CwmError(str(e)) from None
        if not (len(Xa) == len(lat) == len(codes)):
            raise CwmError(
                f"{what}: X, latencies and groups must have the same number of rows, "
                f"got {len(Xa)}, {len(lat)} and {len(codes)}"
            )
        if len(codes) == 0:
            return None
        grade = rank_labels if self.config.labels == "rank" else relevance_labels
        labels = grade(lat, codes, self.config.label_levels)
        valid = ~np.isnan(lat)
        n_valid = np.bincount(codes[valid], minlength=int(codes.max()) + 1)
        keep = n_valid[codes] >= 2
        if not keep.any():
            return None
        lat_key = np.where(valid, lat, np.inf)
        if fastest_first:
            order = np.lexsort((_row_hash(Xa), lat_key, codes))
        else:
            lat_bits = lat_key.astype(np.float64)[:, None].view(np.float32)
            order = np.lexsort((_row_hash(lat_bits), _row_hash(Xa), codes))
        order = order[keep[order]]
        sizes = np.unique(codes[order], return_counts=True)[1]
        dm = xgb.DMatrix(
            Xa[order], label=labels[order].astype(np.float32), nthread=self.config.threads()
        )
        dm.set_group(sizes)
        return dm

    def _train(self, dtrain, num_boost_round: int, eval_set, xgb_model=None, params=None):
        import xgboost as xgb

        evals = [(dtrain, "train")]
        if eval_set is not None:
            if len(eval_set) != 3:
                raise CwmError("eval_set must be a tuple (X_val, latencies_val, groups_val)")
            dval = self._dmatrix(*eval_set, what="eval_set", fastest_first=False)
            if dval is None:
                raise CwmError("eval_set has no group with at least 2 valid candidates")
            evals.append((dval, "val"))
        result: dict[str, dict[str, list[float]]] = {}
        stopping = self.config.early_stopping_rounds if len(evals) > 1 and xgb_model is None else 0
        booster = xgb.train(
            {**self.config.xgb_params(), **(params or {})},
            dtrain,
            num_boost_round=int(num_boost_round),
            evals=evals,
            evals_result=result,
            verbose_eval=False,
            xgb_model=xgb_model,
            early_stopping_rounds=stopping or None,
        )
        if stopping and booster.best_iteration + 1 < booster.num_boosted_rounds():
            booster = booster[: booster.best_iteration + 1]  # the trees up to the best validation round
        booster.set_param({"nthread": self.config.threads()})
        hist = {k: {m: [float(v) for v in vs] for m, vs in d.items()} for k, d in result.items()}
        return booster, hist

    # ----------------------------------------------------------------- API

    def fit(
        self,
        X: Any,
        latencies: Any,
        groups: Any,
        *,
        eval_set: tuple[Any, Any, Any] | None = None,
        feature_names: Sequence[str] | None = None,
    ) -> "LambdaRanker":
        """Train from scratch on ``(X, latencies, groups)``; returns ``self``.

        Rows may come in any order (they are sorted by group internally);
        groups with fewer than 2 valid candidates are skipped.  ``eval_set`` =
        ``(X_val, latencies_val, groups_val)`` adds a ``"val"`` entry to
        ``history_`` (NDCG@10 per round).
        """
        Xa = np.asarray(X, dtype=np.float32)
        if Xa.ndim != 2:
            raise CwmError(f"X must be 2-D (rows x features), got shape {Xa.shape}")
        if feature_names is not None:
            feature_names = [str(n) for n in feature_names]
            if len(feature_names) != Xa.shape[1]:
                raise CwmError(
                    f"got {len(feature_names)} feature names for {Xa.shape[1]} features"
                )
        self.booster_ = None
        self.n_features_ = None
        dtrain = self._dmatrix(Xa, latencies, groups, what="X")
        if dtrain is None:
            raise CwmError("no training group has at least 2 valid candidates")
        self.n_features_ = int(Xa.shape[1])
        try:
            booster, hist = self._train(dtrain, self.config.n_estimators, eval_set)
        except Exception:
            self.n_features_ = None
            raise
        self.booster_ = booster
        self.feature_names_ = feature_names
        self.history_ = hist
        self.update_history_ = []
        return self

    def update(
        self, X: Any, latencies: Any, groups: Any, *, num_boost_round: int = 20
    ) -> "LambdaRanker":
        """Continue boosting ``num_boost_round`` more trees on new data.

        Used to adapt online to a task during search.  On an unfitted ranker
        this fits from scratch with ``num_boost_round`` trees.  Update rounds
        use ``config.update_min_child_weight`` so that one task's data can
        split.  If the new data has no group with >= 2 valid candidates, a
        fitted ranker is left as is.
        """
        if num_boost_round < 1:
            raise CwmError(f"num_boost_round must be >= 1, got {num_boost_round}")
        if not self.is_fitted:
            cfg = dataclasses.replace(
                self.config,
                n_estimators=int(num_boost_round),
                min_child_weight=self.config.update_min_child_weight,
            )
            fresh = LambdaRanker(cfg).fit(X, latencies, groups)
            # keep self.config (the caller's hyper-parameters) unchanged
            self.booster_ = fresh.booster_
            self.n_features_ = fresh.n_features_
            self.feature_names_ = None
            self.history_ = fresh.history_
            self.update_history_ = []
            return self
        dtrain = self._dmatrix(X, latencies, groups, what="X")
        if dtrain is None:
            self.update_history_.append({"num_boost_round": 0, "rows": len(np.asarray(X))})
            return self
        booster, hist = self._train(
            dtrain,
            num_boost_round,
            None,
            xgb_model=self.booster_,
            params={"min_child_weight": self.config.update_min_child_weight},
        )
        self.booster_ = booster
        self.update_history_.append(
            {"num_boost_round": int(num_boost_round), "rows": int(dtrain.num_row()), "evals": hist}
        )
        return self

    def predict(self, X: Any) -> np.ndarray:
        """Scores for each row of ``X``, HIGHER = predicted FASTER (within a task)."""
        if not self.is_fitted:
            raise CwmError("the ranker is not fitted; call fit() or load() first")
        Xa = self._check_X(X)
        if Xa.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        out = self.booster_.inplace_predict(Xa, validate_features=False)
        return np.asarray(out, dtype=np.float32).reshape(-1)

    @property
    def num_boosted_rounds(self) -> int:
        return 0 if self.booster_ is None else int(self.booster_.num_boosted_rounds())

    # ----------------------------------------------------------------- persistence

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``ranker.json`` (booster) and ``ranker_config.json`` into directory ``path``."""
        if not self.is_fitted:
            raise CwmError("cannot save an unfitted ranker")
        d = Path(path)
        try:
            d.mkdir(parents=True, exist_ok=True)
            self.booster_.save_model(str(d / MODEL_FILE))
            write_config(d / CONFIG_FILE, _FORMAT, self.config.to_dict(), n_features=self.n_features_,
                         feature_names=self.feature_names_, num_boosted_rounds=self.num_boosted_rounds,
                         history=self.history_)
        except (OSError, CwmError) as e:
            raise CwmError(f"cannot write ranker to {d}: {e}") from None
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "LambdaRanker":
        """Restore a ranker written by :meth:`save`."""
        import xgboost as xgb

        d = Path(directory)
        cfg_path = d / CONFIG_FILE
        model_path = d / MODEL_FILE
        meta = read_config(d, CONFIG_FILE, (MODEL_FILE,), _FORMAT, "ranker")
        try:
            config = RankerConfig.from_dict(meta["config"])
            n_features = int(meta["n_features"])
        except (KeyError, TypeError, ValueError) as e:
            raise CwmError(f"{cfg_path} is malformed: {e}") from None
        booster = xgb.Booster()
        try:
            booster.load_model(str(model_path))
        except xgb.core.XGBoostError as e:
            raise CwmError(f"cannot load {model_path}: {str(e).splitlines()[0]}") from None
        if booster.num_features() not in (0, n_features):
            raise CwmError(
                f"{model_path} has {booster.num_features()} features but {cfg_path} "
                f"says {n_features}"
            )
        booster.set_param({"nthread": config.threads()})
        r = cls(config)
        r.booster_ = booster
        r.n_features_ = n_features
        names = meta.get("feature_names")
        r.feature_names_ = list(names) if names is not None else None
        r.history_ = meta.get("history") or {}
        return r


# --------------------------------------------------------------------------- online adaptation


class TaskAdapter:
    """A pretrained ranker corrected online for one task: a small LambdaRank booster that starts
    from the pretrained score (as XGBoost's base margin) and splits only on ``columns`` that vary
    among the task's measured candidates.

    Continuing to boost a copy of the pretrained ranker on all its columns (``LambdaRanker.update``)
    lets one task's few dozen rows split on columns that are constant within the task or on the
    latent; replayed on held-out search runs the frozen prior is near chance on the search's own
    proposals, and this correction ranks them better (benchmarks/results/online_adaptation).
    Scores are the prior's plus the correction, so they stay on the prior's scale.
    """

    def __init__(self, prior: LambdaRanker, columns: Sequence[int], *, num_boost_round: int = 20,
                 max_depth: int = 2, learning_rate: float = 0.3, min_child_weight: float = 0.1) -> None:
        if num_boost_round < 1:
            raise CwmError(f"num_boost_round must be >= 1, got {num_boost_round}")
        self.prior = prior
        self.columns = np.asarray(columns, dtype=np.int64)
        self.num_boost_round = num_boost_round
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.min_child_weight = min_child_weight
        self.booster_ = None
        self.columns_: np.ndarray | None = None  # the columns the correction splits on

    def fit(self, X: Any, latencies: Any, prior_scores: Any = None) -> "TaskAdapter":
        """Fit the correction on one task's measured rows; with fewer than two valid ones, or no
        column that varies, there is nothing to correct and the scores stay the prior's.
        ``prior_scores``: the prior's scores of ``X`` when the caller already has them."""
        import xgboost as xgb

        Xa = self.prior._check_X(X)
        lat = as_latencies(latencies)
        valid = ~np.isnan(lat)
        self.booster_, self.columns_ = None, None
        if valid.sum() < 2:
            return self
        base = self._prior_scores(Xa, prior_scores)
        Xv, lv, bv = Xa[valid], lat[valid], base[valid]
        cols = self.columns[np.ptp(Xv[:, self.columns], axis=0) > 0] if len(self.columns) else self.columns
        if len(cols) == 0:
            return self
        order = np.lexsort((_row_hash(Xv), lv))  # fastest first, as the prior was trained
        grade = rank_labels if self.prior.config.labels == "rank" else relevance_labels
        labels = grade(lv[order], np.zeros(len(lv)), self.prior.config.label_levels)
        dm = xgb.DMatrix(Xv[order][:, cols], label=labels.astype(np.float32), nthread=1)
        dm.set_group([len(lv)])
        dm.set_base_margin(bv[order])
        params = {"objective": "rank:pairwise", "max_depth": self.max_depth, "eta": self.learning_rate,
                  "min_child_weight": self.min_child_weight, "seed": self.prior.config.seed, "nthread": 1,
                  "verbosity": 0}
        self.booster_ = xgb.train(params, dm, self.num_boost_round)
        self.columns_ = cols
        return self

    def predict(self, X: Any, prior_scores: Any = None) -> np.ndarray:
        """The prior's scores plus the task's correction, HIGHER = predicted FASTER.
        ``prior_scores``: the prior's scores of ``X`` when the caller already has them."""
        import xgboost as xgb

        Xa = self.prior._check_X(X)
        base = self._prior_scores(Xa, prior_scores)
        if self.booster_ is None or len(base) == 0:
            return base
        dm = xgb.DMatrix(Xa[:, self.columns_], nthread=1)
        dm.set_base_margin(base)
        return np.asarray(self.booster_.predict(dm), dtype=np.float32).reshape(-1)

    def _prior_scores(self, Xa: np.ndarray, prior_scores: Any) -> np.ndarray:
        if prior_scores is None:
            return self.prior.predict(Xa)
        base = np.asarray(prior_scores, dtype=np.float32).reshape(-1)
        if len(base) != len(Xa):
            raise CwmError(f"prior_scores has {len(base)} scores for {len(Xa)} rows")
        return base


class PessimisticEnsemble:
    """Task adapters fitted on bootstrap resamples of one task's measured rows, scored pessimistically:
    the members' mean minus ``kappa`` times their standard deviation.

    The search drives its population toward candidates the model overrates; where the members
    disagree, a candidate is far from what was measured, and the penalty keeps the search from
    trusting the model there (the ensemble answer to model exploitation in model-based RL).
    """

    def __init__(self, members: Sequence[TaskAdapter], kappa: float = 1.0) -> None:
        if not members:
            raise CwmError("an ensemble needs at least one member")
        self.members = list(members)
        self.kappa = kappa

    @classmethod
    def fit_bootstrap(cls, prior: LambdaRanker, columns: Sequence[int], X: Any, latencies: Any, *,
                      size: int = 5, kappa: float = 1.0, seed: int = 0, **adapter_args) -> "PessimisticEnsemble":
        Xa, lat = prior._check_X(X), as_latencies(latencies)
        base = prior.predict(Xa)  # once: every member starts from the same prior scores
        rng = np.random.default_rng(seed)
        members = []
        for _ in range(size):
            rows = rng.integers(0, len(lat), len(lat))
            members.append(TaskAdapter(prior, columns, **adapter_args).fit(Xa[rows], lat[rows], base[rows]))
        return cls(members, kappa)

    def predict(self, X: Any) -> np.ndarray:
        Xa = self.members[0].prior._check_X(X)
        bases: dict[int, np.ndarray] = {}  # each distinct prior scores the rows once
        for m in self.members:
            if id(m.prior) not in bases:
                bases[id(m.prior)] = m.prior.predict(Xa)
        scores = np.stack([m.predict(Xa, bases[id(m.prior)]) for m in self.members])
        return (scores.mean(axis=0) - self.kappa * scores.std(axis=0)).astype(np.float32)
