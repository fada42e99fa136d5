"""Within-task ranking metrics for candidate schedules (numpy only).

Every metric takes three aligned 1-D sequences:

* ``scores``: predicted scores, HIGHER = predicted FASTER (NaN scores rank last);
* ``latencies``: measured latencies; ``None``/NaN/inf/``<= 0`` mark invalid
  (failed) candidates;
* ``groups``: the task each candidate belongs to, any hashable labels
  (ints, strings, tuples, ...).

Only orderings *within* a group are compared.  Invalid candidates never form
pairs in :func:`pairwise_accuracy`; in :func:`ndcg_at_k` and
:func:`topk_score` they still occupy the slots the scores put them in but
count as the worst possible outcome (gain 0).  Groups without any valid
candidate are skipped.  When no group contributes, a metric returns NaN.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import numpy as np


def geomean(values: Iterable[Any]) -> float:
    """Geometric mean of the positive finite values (None, NaN, inf and <= 0 are skipped); NaN if none."""
    vals = [float(v) for v in values if v is not None and np.isfinite(v) and v > 0]
    if not vals:
        return float("nan")
    if min(vals) == max(vals):
        return vals[0]  # exact: exp(log(x)) may miss x by an ulp, and a ratio to x then is not 1.0
    return float(np.exp(np.mean(np.log(vals))))


__all__ = [
    "geomean",
    "as_latencies",
    "group_codes",
    "pairwise_accuracy",
    "ndcg_at_k",
    "topk_score",
    "spearman_within_groups",
    "evaluate_ranking",
    "RANKING_METRICS",
    "per_group_ranking",
    "weighted_mean",
    "bootstrap_indices",
    "bootstrap_ci",
    "bootstrap_difference",
]

# Rows per block when comparing all pairs of a large group (bounds memory).
_PAIR_BLOCK = 1024


# --------------------------------------------------------------------------- helpers


def as_latencies(latencies: Any) -> np.ndarray:
    """Return latencies as float64 with every invalid entry (None/NaN/inf/<=0) set to NaN."""
    if isinstance(latencies, np.ndarray) and latencies.dtype != object:
        lat = latencies.astype(np.float64, copy=True)
    else:
        lat = np.array(
            [np.nan if v is None else v for v in np.asarray(latencies, dtype=object).ravel()],
            dtype=np.float64,
        )
    lat = lat.reshape(-1)
    lat[~np.isfinite(lat) | (lat <= 0)] = np.nan
    return lat


def _sort_key(label: Hashable) -> tuple:
    return (type(label).__name__, label)


def group_codes(groups: Any) -> tuple[np.ndarray, list]:
    """Factorize group labels into int64 codes ``0..G-1`` plus the list of labels.

    Codes follow the *sorted* labels (not first appearance), so they do not
    depend on the order of the rows.  Labels that cannot be compared fall back
    to being ordered by ``repr``.
    """
    if isinstance(groups, np.ndarray) and groups.ndim == 1 and groups.dtype.kind in "biufUS":
        uniq, inv = np.unique(groups, return_inverse=True)
        return inv.reshape(-1).astype(np.int64), uniq.tolist()
    items = list(groups.tolist() if isinstance(groups, np.ndarray) else groups)
    uniq_set = {}
    for g in items:
        if not isinstance(g, Hashable):
            raise ValueError(f"group labels must be hashable, got {type(g).__name__}")
        uniq_set.setdefault(g, None)
    labels = list(uniq_set)
    try:
        labels.sort(key=_sort_key)
    except TypeError:
        labels.sort(key=lambda g: (type(g).__name__, repr(g)))
    index = {g: i for i, g in enumerate(labels)}
    codes = np.fromiter((index[g] for g in items), dtype=np.int64, count=len(items))
    return codes, labels


def _prepare(scores: Any, latencies: Any, groups: Any):
    s = np.asarray(scores, dtype=np.float64).reshape(-1).copy()
    s[np.isnan(s)] = -np.inf  # unusable predictions rank last
    lat = as_latencies(latencies)
    codes, labels = group_codes(groups)
    if not (len(s) == len(lat) == len(codes)):
        raise ValueError(
            f"scores, latencies and groups must have the same length, "
            f"got {len(s)}, {len(lat)} and {len(codes)}"
        )
    return s, lat, codes, labels


def _iter_groups(codes: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
    """Yield ``(code, row indices)`` for every group, rows in input order."""
    if len(codes) == 0:
        return
    order = np.argsort(codes, kind="stable")
    sorted_codes = codes[order]
    bounds = np.flatnonzero(np.diff(sorted_codes)) + 1
    for idx in np.split(order, bounds):
        yield int(codes[idx[0]]), idx


def _rank_by_score(s: np.ndarray) -> np.ndarray:
    """Indices sorted by score descending; ties keep input order."""
    return np.argsort(-s, kind="stable")


# --------------------------------------------------------------------------- metrics


def _pair_counts(s: np.ndarray, lat: np.ndarray) -> tuple[float, int]:
    """(correct pairs, comparable pairs) for one group of valid candidates.

    A pair counts when the latencies differ; a tie in score counts as half right.
    """
    n = len(s)
    correct = 0.0
    total = 0
    for start in range(0, n, _PAIR_BLOCK):
        stop = min(n, start + _PAIR_BLOCK)
        ds = s[start:stop, None] - s[None, :]
        # Positive when row i is faster than column j.
        dl = lat[None, :] - lat[start:stop, None]
        mask = dl != 0
        # Each unordered pair appears twice (i,j) and (j,i): count both, halve later.
        agree = np.sign(ds) * np.sign(dl)
        total += int(mask.sum())
        correct += float(((agree > 0) & mask).sum()) + 0.5 * float(((agree == 0) & mask).sum())
    return correct / 2.0, total // 2


def pairwise_accuracy(scores: Any, latencies: Any, groups: Any) -> float:
    """Fraction of within-group pairs of valid candidates ordered correctly.

    Only pairs with different latencies count; higher score must go with lower
    latency.  Equal scores count as half correct (so a constant predictor
    scores 0.5).  Groups are weighted by their number of pairs, i.e. this is
    total correct pairs over total pairs.  NaN if there is no pair.
    """
    s, lat, codes, _ = _prepare(scores, latencies, groups)
    correct = 0.0
    total = 0
    for _, idx in _iter_groups(codes):
        valid = idx[~np.isnan(lat[idx])]
        if len(valid) < 2:
            continue
        c, t = _pair_counts(s[valid], lat[valid])
        correct += c
        total += t
    return correct / total if total else float("nan")


def _gains(lat: np.ndarray) -> np.ndarray:
    """Throughput relative to the best in the group (min_lat / lat); 0 for invalid."""
    best = np.nanmin(lat)
    g = best / lat
    g[np.isnan(g)] = 0.0
    return g


def ndcg_at_k(scores: Any, latencies: Any, groups: Any, k: int = 10) -> float:
    """Mean over groups of NDCG@k.

    Gains are the continuous relative throughput ``min_lat / lat`` in (0, 1]
    (0 for invalid candidates), discounted by ``1 / log2(rank + 1)``; candidates
    are ranked by score.  Groups with no valid candidate are skipped.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    s, lat, codes, _ = _prepare(scores, latencies, groups)
    vals = []
    for _, idx in _iter_groups(codes):
        gl = lat[idx]
        if np.all(np.isnan(gl)):
            continue
        gains = _gains(gl)
        kk = min(k, len(idx))
        disc = 1.0 / np.log2(np.arange(2, kk + 2))
        order = _rank_by_score(s[idx])[:kk]
        dcg = float(np.sum(gains[order] * disc))
        idcg = float(np.sum(np.sort(gains)[::-1][:kk] * disc))
        vals.append(dcg / idcg)
    return float(np.mean(vals)) if vals else float("nan")


def _group_weight(weights: Mapping | None, label: Hashable) -> float:
    if weights is None:
        return 1.0
    try:
        w = weights[label]
    except KeyError:
        raise ValueError(f"no weight given for group {label!r}") from None
    w = float(w)
    if not np.isfinite(w) or w < 0:
        raise ValueError(f"weight for group {label!r} must be finite and >= 0, got {w}")
    return w


def topk_score(
    scores: Any,
    latencies: Any,
    groups: Any,
    k: int = 1,
    weights: Mapping[Hashable, float] | None = None,
) -> float:
    """TenSet's top-k score.

    For each group: best true latency divided by the best true latency among
    the ``k`` candidates with the highest predicted scores (1.0 = the best
    schedule was among the picks; 0.0 if all picks failed).  Averaged over
    groups with ``weights`` (mapping group label -> weight; ``None`` = equal).
    Groups without any valid candidate are skipped.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    s, lat, codes, labels = _prepare(scores, latencies, groups)
    num = 0.0
    den = 0.0
    for code, idx in _iter_groups(codes):
        gl = lat[idx]
        if np.all(np.isnan(gl)):
            continue
        w = _group_weight(weights, labels[code])
        picks = gl[_rank_by_score(s[idx])[:k]]
        best_pick = float(np.nanmin(picks)) if not np.all(np.isnan(picks)) else np.inf
        num += w * (float(np.nanmin(gl)) / best_pick)
        den += w
    return float(num / den) if den > 0 else float("nan")


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties given their average rank."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    bounds = np.concatenate(([0], np.flatnonzero(np.diff(xs)) + 1, [len(x)]))
    for a, b in zip(bounds[:-1], bounds[1:]):
        ranks[order[a:b]] = 0.5 * (a + b - 1)
    return ranks


def spearman_within_groups(scores: Any, latencies: Any, groups: Any) -> float:
    """Mean over groups (>= 3 valid candidates) of Spearman's rho between score and speed.

    Speed is ``-latency``, so +1 means a perfect ranking.  Groups where either
    side is constant are skipped.  Invalid candidates are ignored.
    """
    s, lat, codes, _ = _prepare(scores, latencies, groups)
    vals = []
    for _, idx in _iter_groups(codes):
        valid = idx[~np.isnan(lat[idx])]
        if len(valid) < 3:
            continue
        rs = _average_ranks(s[valid])
        rl = _average_ranks(-lat[valid])
        rs -= rs.mean()
        rl -= rl.mean()
        denom = np.sqrt(np.sum(rs * rs) * np.sum(rl * rl))
        if denom == 0:
            continue
        vals.append(float(np.sum(rs * rl) / denom))
    return float(np.mean(vals)) if vals else float("nan")


def evaluate_ranking(
    scores: Any,
    latencies: Any,
    groups: Any,
    weights: Mapping[Hashable, float] | None = None,
) -> dict[str, float]:
    """The standard report: ``pairwise_accuracy``, ``ndcg@10``, ``top1``, ``top5``.

    ``weights`` (group -> weight) applies to the top-k scores.
    """
    return {
        "pairwise_accuracy": pairwise_accuracy(scores, latencies, groups),
        "ndcg@10": ndcg_at_k(scores, latencies, groups, k=10),
        "top1": topk_score(scores, latencies, groups, k=1, weights=weights),
        "top5": topk_score(scores, latencies, groups, k=5, weights=weights),
    }


# --------------------------------------------------------------------------- per-group values and bootstrap

RANKING_METRICS = ("pairwise_accuracy", "ndcg@10", "top1", "top5")


def per_group_ranking(
    scores: Any,
    latencies: Any,
    groups: Any,
    weights: Mapping[Hashable, float] | None = None,
) -> tuple[list, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """:func:`evaluate_ranking`'s metrics group by group, with each group's weight in the aggregate.

    Returns ``(labels, values, agg_weights)``: ``labels`` are the sorted group labels,
    ``values[metric][i]`` the metric on group ``labels[i]`` alone (NaN where the group does not
    count) and ``agg_weights[metric][i]`` that group's weight in :func:`evaluate_ranking`'s
    aggregate: its number of comparable pairs for ``pairwise_accuracy`` (which pools pairs), 1 for
    ``ndcg@10``, ``weights[label]`` (1 without ``weights``) for the top-k scores. So
    ``weighted_mean(values[m], agg_weights[m])`` equals ``evaluate_ranking(...)[m]`` up to rounding,
    and a bootstrap over groups can resample these arrays.
    """
    s, lat, codes, labels = _prepare(scores, latencies, groups)
    n = len(labels)
    values = {m: np.full(n, np.nan) for m in RANKING_METRICS}
    agg = {m: np.zeros(n) for m in RANKING_METRICS}
    for code, idx in _iter_groups(codes):
        gs, gl = s[idx], lat[idx]
        if np.all(np.isnan(gl)):
            continue
        valid = ~np.isnan(gl)
        if valid.sum() >= 2:
            c, t = _pair_counts(gs[valid], gl[valid])
            if t:
                values["pairwise_accuracy"][code] = c / t
                agg["pairwise_accuracy"][code] = t
        one = np.zeros(len(idx), dtype=np.int64)
        values["ndcg@10"][code] = ndcg_at_k(gs, gl, one, k=10)
        agg["ndcg@10"][code] = 1.0
        w = _group_weight(weights, labels[code])
        for k in (1, 5):
            values[f"top{k}"][code] = topk_score(gs, gl, one, k=k)
            agg[f"top{k}"][code] = w
    return labels, values, agg


def weighted_mean(values: Any, weights: Any = None) -> float:
    """Mean of the finite ``values`` with ``weights`` (default equal); NaN if no weight is left."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if len(w) != len(v):
        raise ValueError(f"values and weights must have the same length, got {len(v)} and {len(w)}")
    keep = np.isfinite(v) & (w > 0)
    den = float(w[keep].sum())
    return float((w[keep] * v[keep]).sum() / den) if den > 0 else float("nan")


def bootstrap_indices(n: int, resamples: int = 1000, seed: int = 0) -> np.ndarray:
    """``[resamples, n]`` indices drawn with replacement from ``range(n)`` (seeded): pass the same
    array to several :func:`bootstrap_ci` / :func:`bootstrap_difference` calls to resample the same
    groups for each."""
    if n < 1:
        raise ValueError(f"need at least one value to resample, got {n}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    return np.random.default_rng(seed).integers(0, n, size=(int(resamples), int(n)))


def _resampled_means(v: np.ndarray, w: np.ndarray, keep: np.ndarray, idx: np.ndarray) -> np.ndarray:
    ww = np.where(keep, w, 0.0)[idx]
    vv = np.where(keep, v, 0.0)[idx]
    den = ww.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ww * vv).sum(axis=1) / den, np.nan)


def _interval(point: float, stats: np.ndarray, confidence: float) -> tuple[float, float, float]:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    stats = stats[np.isfinite(stats)]
    if not np.isfinite(point) or not len(stats):
        return float(point), float("nan"), float("nan")
    alpha = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(stats, [alpha, 100 - alpha])
    return float(point), float(lo), float(hi)


def _as_arrays(values: Any, weights: Any) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    w = np.ones_like(v) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    if len(w) != len(v):
        raise ValueError(f"values and weights must have the same length, got {len(v)} and {len(w)}")
    if np.any(~np.isfinite(w) | (w < 0)):
        raise ValueError("weights must be finite and >= 0")
    return v, w


def bootstrap_ci(
    values: Any,
    weights: Any = None,
    *,
    resamples: int = 1000,
    confidence: float = 0.9,
    seed: int = 0,
    indices: np.ndarray | None = None,
) -> tuple[float, float, float]:
    """Percentile-bootstrap interval of the weighted mean of per-group metric values.

    ``values[i]`` is a metric on group (task) ``i``, ``weights[i]`` its weight in the aggregate
    (see :func:`per_group_ranking`); groups are resampled with replacement ``resamples`` times
    (or along the rows of ``indices``, from :func:`bootstrap_indices`). Non-finite values do not
    count. Returns ``(mean, lo, hi)``: the weighted mean of the given groups and the
    ``confidence`` interval of the resampled means (NaN bounds if nothing counts).
    """
    v, w = _as_arrays(values, weights)
    keep = np.isfinite(v) & (w > 0)
    point = weighted_mean(v, w)
    if indices is None:
        indices = bootstrap_indices(len(v), resamples, seed)
    return _interval(point, _resampled_means(v, w, keep, indices), confidence)


def bootstrap_difference(
    a: Any,
    b: Any,
    weights: Any = None,
    *,
    resamples: int = 1000,
    confidence: float = 0.9,
    seed: int = 0,
    indices: np.ndarray | None = None,
) -> tuple[float, float, float]:
    """Paired bootstrap of ``mean(a) - mean(b)``: two scorers' per-group values on the same groups.

    Each resample draws one set of groups and takes both weighted means on it, so what the two
    scorers share (easy and hard tasks) cancels. Groups where either value is non-finite do not
    count. Returns ``(difference, lo, hi)``; a scorer against itself gives exactly ``(0, 0, 0)``.
    """
    va, w = _as_arrays(a, weights)
    vb, _ = _as_arrays(b, weights)
    if len(va) != len(vb):
        raise ValueError(f"a and b must have the same length, got {len(va)} and {len(vb)}")
    keep = np.isfinite(va) & np.isfinite(vb) & (w > 0)
    point = weighted_mean(np.where(keep, va, np.nan), w) - weighted_mean(np.where(keep, vb, np.nan), w)
    if indices is None:
        indices = bootstrap_indices(len(va), resamples, seed)
    stats = _resampled_means(va, w, keep, indices) - _resampled_means(vb, w, keep, indices)
    return _interval(point, stats, confidence)
