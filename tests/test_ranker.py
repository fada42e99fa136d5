"""Tests for cwm.model.ranker (LambdaRanker, relevance labels) and cwm.model.metrics."""

from __future__ import annotations


import numpy as np
import pytest

from cwm.errors import CwmError
from cwm.model.metrics import evaluate_ranking, ndcg_at_k, pairwise_accuracy, spearman_within_groups, topk_score
from cwm.model.ranker import CONFIG_FILE, MODEL_FILE, LambdaRanker, RankerConfig, relevance_labels

SMALL = dict(n_estimators=30, max_depth=4, n_jobs=2)


def make_data(n_groups=20, n_per=30, n_feat=6, seed=0, weights=None, offsets=True):
    """latency = group offset (huge spread) * exp(w . x) * noise."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n_groups * n_per, n_feat)).astype(np.float32)
    groups = np.repeat(np.arange(n_groups), n_per)
    w = np.zeros(n_feat)
    w[:3] = [1.0, -0.7, 0.5] if weights is None else weights
    off = 10.0 ** rng.uniform(-3, 6, n_groups) if offsets else np.ones(n_groups)
    lat = off[groups] * np.exp(X @ w) * np.exp(rng.normal(0, 0.05, len(groups)))
    return X, lat, groups


# --------------------------------------------------------------------------- labels


def test_relevance_labels_monotone_best_top_invalid_zero():
    lat = np.array([1.0, 2.0, 4.0, 1.5, np.nan, 100.0, 200.0, np.inf, -1.0, 0.0])
    grp = np.array(["a", "a", "a", "a", "a", "b", "b", "b", "b", "b"])
    lab = relevance_labels(lat, grp, levels=16)
    assert lab.dtype.kind == "i"
    assert lab.min() >= 0 and lab.max() <= 15
    assert lab[0] == 15 and lab[5] == 15  # best of each group
    assert lab[4] == 0 and lab[7] == 0 and lab[8] == 0 and lab[9] == 0
    # monotone within group a: sorted by latency -> non-increasing label
    a = [0, 3, 1, 2]
    assert list(lab[a]) == sorted(lab[a], reverse=True)
    assert lab[3] > lab[1] > lab[2]
    # None works, offsets do not matter
    lab2 = relevance_labels([1.0, None, 3.0], [1, 1, 1], levels=4)
    assert list(lab2) == [3, 0, 0]  # (1/3)^2 * 3 = 0.33 -> 0
    assert list(relevance_labels(np.array([5.0, 10.0]) * 1e6, [0, 0])) == list(
        relevance_labels([5.0, 10.0], [0, 0])
    )


# --------------------------------------------------------------------------- metrics


def test_metrics_perfect_and_reversed():
    lat = np.array([1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 30.0])
    grp = ["x", "x", "x", "x", "y", "y", "y"]
    perfect = -lat
    assert pairwise_accuracy(perfect, lat, grp) == 1.0
    assert topk_score(perfect, lat, grp, k=1) == 1.0
    assert ndcg_at_k(perfect, lat, grp, k=10) == pytest.approx(1.0)
    assert spearman_within_groups(perfect, lat, grp) == pytest.approx(1.0)
    rep = evaluate_ranking(perfect, lat, grp)
    assert set(rep) == {"pairwise_accuracy", "ndcg@10", "top1", "top5"}
    assert rep["top1"] == rep["top5"] == 1.0
    assert pairwise_accuracy(lat, lat, grp) == 0.0
    assert spearman_within_groups(lat, lat, grp) == pytest.approx(-1.0)
    assert ndcg_at_k(lat, lat, grp) < 1.0
    # constant scores: ties count half
    assert pairwise_accuracy(np.zeros(7), lat, grp) == 0.5


def test_topk_hand_computed():
    # group a: best 1.0; top-1 pick has latency 2.0 -> 0.5; top-2 includes 1.0 -> 1.0
    # group b: best 10; top-1 pick 40 -> 0.25; top-2 picks {40, 20} -> 0.5
    lat = np.array([2.0, 1.0, 4.0, 40.0, 20.0, 10.0])
    sc = np.array([3.0, 2.0, 1.0, 9.0, 8.0, 7.0])
    grp = np.array(["a", "a", "a", "b", "b", "b"])
    assert topk_score(sc, lat, grp, k=1) == pytest.approx((0.5 + 0.25) / 2)
    assert topk_score(sc, lat, grp, k=2) == pytest.approx((1.0 + 0.5) / 2)
    assert topk_score(sc, lat, grp, k=1, weights={"a": 3, "b": 1}) == pytest.approx(
        (3 * 0.5 + 0.25) / 4
    )
    assert topk_score(sc, lat, grp, k=10) == 1.0
    # pick that failed counts as worst (0); all-invalid group is skipped
    lat2 = [None, 1.0, np.nan, np.nan]
    assert topk_score([5.0, 1.0, 0.0, 0.0], lat2, ["p", "p", "q", "q"], k=1) == 0.0
    with pytest.raises(ValueError):
        topk_score(sc, lat, grp, weights={"a": 1.0})
    # ndcg by hand on group a: gains 0.5, 1, 0.25 ranked by score
    dcg = 0.5 + 1.0 / np.log2(3) + 0.25 / 2
    idcg = 1.0 + 0.5 / np.log2(3) + 0.25 / 2
    assert ndcg_at_k(sc[:3], lat[:3], grp[:3]) == pytest.approx(dcg / idcg)


def test_pairwise_ignores_invalid_and_ties_in_latency():
    lat = [1.0, 2.0, None, np.inf, -3.0, 2.0]
    sc = [2.0, 1.0, 100.0, 100.0, 100.0, 1.5]
    # valid: (1.0, s2), (2.0, s1), (2.0, s1.5); pairs with different latency: 2, both right
    assert pairwise_accuracy(sc, lat, [0] * 6) == 1.0
    assert np.isnan(pairwise_accuracy([1.0], [1.0], [0]))


def test_random_scores_pairwise_half():
    rng = np.random.default_rng(1)
    n = 20000
    grp = rng.integers(0, 50, n).astype(str)
    lat = rng.lognormal(size=n)
    acc = pairwise_accuracy(rng.normal(size=n), lat, grp)
    assert abs(acc - 0.5) < 0.02


# --------------------------------------------------------------------------- ranker


def test_config_roundtrip_and_validation():
    cfg = RankerConfig(objective="rank:pairwise", n_estimators=7)
    assert RankerConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(CwmError):
        RankerConfig(objective="reg:squarederror")
    with pytest.raises(CwmError):
        RankerConfig.from_dict({"bogus": 1})


def test_ranker_order_invariant():
    X, lat, grp = make_data(n_groups=8, n_per=20)
    rng = np.random.default_rng(3)
    perm = rng.permutation(len(grp))
    cfg = RankerConfig(**SMALL)
    a = LambdaRanker(cfg).fit(X, lat, grp)
    b = LambdaRanker(cfg).fit(X[perm], lat[perm], grp[perm])
    # interleaved by group, within-group order kept
    inter = np.argsort(np.tile(np.arange(20), 8), kind="stable")
    c = LambdaRanker(cfg).fit(X[inter], lat[inter], grp[inter])
    Xt = make_data(n_groups=2, seed=9)[0]
    pa = a.predict(Xt)
    assert np.array_equal(pa, b.predict(Xt))
    assert np.array_equal(pa, c.predict(Xt))
    # any hashable labels: strings, tuples (same group structure -> same model up to row order)
    labels = [("conv2d", int(g)) for g in grp[perm]]
    d = LambdaRanker(cfg).fit(X[perm], lat[perm], labels)
    e = LambdaRanker(cfg).fit(X, lat, [("conv2d", int(g)) for g in grp])
    assert np.array_equal(d.predict(Xt), e.predict(Xt))
    f = LambdaRanker(cfg).fit(X, lat, np.char.add("task", grp.astype(str)))
    assert np.isfinite(f.predict(Xt)).all()


def test_an_uninformative_model_does_not_score_a_perfect_validation_ndcg():
    """XGBoost's NDCG keeps the row order among tied scores: rows stored fastest first made a model that
    cannot tell the validation rows apart score 1.0, and early stopping kept one tree."""
    X, lat, grp = make_data(n_groups=8, n_per=20)
    X_val, lat_val, grp_val = make_data(n_groups=6, n_per=20, seed=5)
    X_val[:] = 1.0  # nothing to tell the candidates of a group apart: every score ties
    ranker = LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, grp, eval_set=(X_val, lat_val, grp_val))
    val = ranker.history_["val"]["ndcg@10"]
    assert len(val) == SMALL["n_estimators"] and max(val) < 0.95


def test_ranker_learns_within_group_order_despite_offsets():
    X, lat, grp = make_data(n_groups=24, n_per=30, seed=0)
    Xv, latv, grpv = make_data(n_groups=8, n_per=30, seed=1)
    r = LambdaRanker(RankerConfig(n_estimators=60, max_depth=4, n_jobs=2)).fit(
        X, lat, grp, eval_set=(Xv, latv, grpv), feature_names=[f"f{i}" for i in range(6)]
    )
    assert r.n_features_ == 6
    assert len(r.history_["val"]["ndcg@10"]) == 60
    sv = r.predict(Xv)
    assert pairwise_accuracy(sv, latv, grpv) > 0.8
    assert topk_score(sv, latv, grpv, k=5) > 0.7
    # pairwise objective also works
    rp = LambdaRanker(RankerConfig(objective="rank:pairwise", **SMALL)).fit(X, lat, grp)
    assert pairwise_accuracy(rp.predict(Xv), latv, grpv) > 0.75


def test_fit_skips_small_groups_and_rejects_empty():
    X, lat, grp = make_data(n_groups=4, n_per=10)
    lat = lat.copy()
    lat[grp == 0] = np.nan
    lat[np.flatnonzero(grp == 1)[1:]] = np.inf  # one valid candidate
    LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, grp)
    with pytest.raises(CwmError, match="2 valid"):
        LambdaRanker(RankerConfig(**SMALL)).fit(X[:5], [1.0, None, None, None, None], [0] * 5)


def test_update_adapts_to_new_task_and_fits_when_unfit():
    X, lat, grp = make_data(n_groups=12, n_per=25, seed=0)
    r = LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, grp)
    # new task depends on a feature the old tasks ignore
    Xn, _, grpn = make_data(n_groups=1, n_per=80, seed=5, weights=[0, 0, 0])
    rng = np.random.default_rng(2)
    latn = np.exp(0.5 * Xn[:, 4]) * np.exp(rng.normal(0, 0.05, len(Xn)))
    before = r.predict(Xn)
    n0 = r.num_boosted_rounds
    old_booster = r.booster_
    rep0 = evaluate_ranking(before, latn, grpn)
    r.update(Xn, latn, grpn, num_boost_round=25)
    assert r.num_boosted_rounds == n0 + 25
    after = r.predict(Xn)
    assert not np.array_equal(before, after)
    rep1 = evaluate_ranking(after, latn, grpn)
    # rank:ndcg with top-k pairs mostly learns the head of the ranking
    assert rep1["ndcg@10"] > rep0["ndcg@10"] + 0.2
    assert rep1["top1"] >= rep0["top1"]  # one group: top-1 alone is too coarse to require a gain
    assert rep1["pairwise_accuracy"] > rep0["pairwise_accuracy"]
    assert old_booster.num_boosted_rounds() == n0  # old model untouched
    assert len(r.update_history_) == 1

    fresh = LambdaRanker(RankerConfig(**SMALL)).update(Xn, latn, grpn, num_boost_round=10)
    assert fresh.num_boosted_rounds == 10 and fresh.n_features_ == 6
    assert fresh.config == RankerConfig(**SMALL)
    assert ndcg_at_k(fresh.predict(Xn), latn, grpn) > 0.8
    with pytest.raises(CwmError, match="feature"):
        r.update(Xn[:, :3], latn, grpn)


def test_update_is_deterministic_across_calls():
    # continued boosting must not depend on how many updates ran before in this process
    import copy

    X, lat, grp = make_data(n_groups=10, n_per=20, seed=3)
    base = LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, grp)
    scores = []
    for _ in range(3):
        r = copy.deepcopy(base)
        r.update(X[:40], lat[:40], np.zeros(40), num_boost_round=10)
        scores.append(r.predict(X))
    assert not np.array_equal(scores[0], base.predict(X))
    for s in scores[1:]:
        assert np.array_equal(s, scores[0])


def test_save_load_roundtrip(tmp_path):
    X, lat, grp = make_data(n_groups=6, n_per=20)
    names = [f"feat_{i}" for i in range(6)]
    r = LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, grp, feature_names=names)
    r.save(tmp_path / "m")
    assert (tmp_path / "m" / MODEL_FILE).is_file()
    assert (tmp_path / "m" / CONFIG_FILE).is_file()
    r2 = LambdaRanker.load(tmp_path / "m")
    assert np.array_equal(r.predict(X), r2.predict(X))
    assert r2.n_features_ == 6 and r2.feature_names_ == names
    assert r2.config == r.config
    # loaded model can keep adapting
    r2.update(X[:20], lat[:20], grp[:20], num_boost_round=3)
    assert r2.num_boosted_rounds == r.num_boosted_rounds + 3


def test_load_missing_file_and_feature_mismatch(tmp_path):
    with pytest.raises(CwmError, match=CONFIG_FILE):
        LambdaRanker.load(tmp_path / "nowhere")
    X, lat, grp = make_data(n_groups=4, n_per=10)
    r = LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, grp)
    r.save(tmp_path / "m")
    (tmp_path / "m" / MODEL_FILE).unlink()
    with pytest.raises(CwmError, match=MODEL_FILE):
        LambdaRanker.load(tmp_path / "m")
    with pytest.raises(CwmError, match=r"expects 6 features, got 5"):
        r.predict(X[:, :5])
    with pytest.raises(CwmError, match="not fitted"):
        LambdaRanker().predict(X)


def test_geomean_skips_unusable_values():
    import math

    from cwm.model.metrics import geomean

    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([0.1]) == 0.1 and geomean([3.7, 3.7, None]) == 3.7  # exact, unlike exp(log(x))
    assert geomean([2.0, None, float("nan"), 0.0, -1.0, float("inf"), 8.0]) == pytest.approx(4.0)
    assert math.isnan(geomean([None, 0.0]))


# --------------------------------------------------------------------------- online adaptation


def test_task_adapter_learns_what_the_prior_misses_on_its_own_columns():
    from cwm.model.ranker import TaskAdapter

    # The prior learned speed from columns 0-2; in the new task column 4 decides it and column 5 is constant.
    X, lat, groups = make_data(seed=1)
    prior = LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, groups)
    rng = np.random.default_rng(2)
    Xt = rng.normal(size=(96, 6)).astype(np.float32)
    Xt[:, 5] = 3.0
    lat_t = np.exp(1.5 * Xt[:, 4]) * np.exp(rng.normal(0, 0.05, 96))
    train, test = slice(0, 48), slice(48, 96)
    adapter = TaskAdapter(prior, columns=[3, 4, 5]).fit(Xt[train], lat_t[train])
    assert set(adapter.columns_) == {3, 4}  # column 5 does not vary within the task
    one = np.zeros(48)
    before = pairwise_accuracy(prior.predict(Xt[test]), lat_t[test], one)
    after = pairwise_accuracy(adapter.predict(Xt[test]), lat_t[test], one)
    assert before < 0.65 and after > before + 0.08


def test_task_adapter_without_anything_to_learn_keeps_the_prior_scores():
    from cwm.model.ranker import TaskAdapter

    X, lat, groups = make_data(seed=3)
    prior = LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, groups)
    one_valid = TaskAdapter(prior, columns=[0, 1]).fit(X[:4], [1.0, np.nan, np.inf, -1.0])
    constant = TaskAdapter(prior, columns=[0]).fit(np.repeat(X[:1], 8, axis=0), np.arange(1.0, 9.0))
    for adapter in (one_valid, constant):
        assert adapter.booster_ is None
        assert np.array_equal(adapter.predict(X[:20]), prior.predict(X[:20]))
    with pytest.raises(CwmError, match="num_boost_round"):
        TaskAdapter(prior, columns=[0], num_boost_round=0)


def test_pessimistic_ensemble_penalizes_disagreement_and_is_seeded():
    from cwm.model.ranker import PessimisticEnsemble, TaskAdapter

    X, lat, groups = make_data(seed=4)
    prior = LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, groups)
    rng = np.random.default_rng(5)
    Xt = rng.normal(size=(40, 6)).astype(np.float32)
    lat_t = np.exp(Xt[:, 4]) * np.exp(rng.normal(0, 0.3, 40))
    ens = PessimisticEnsemble.fit_bootstrap(prior, [3, 4], Xt, lat_t, size=4, kappa=0.5, seed=1)
    members = np.stack([m.predict(Xt) for m in ens.members])
    assert len(ens.members) == 4 and members.std(axis=0).max() > 0  # the resamples disagree somewhere
    assert np.allclose(ens.predict(Xt), members.mean(axis=0) - 0.5 * members.std(axis=0), atol=1e-5)
    again = PessimisticEnsemble.fit_bootstrap(prior, [3, 4], Xt, lat_t, size=4, kappa=0.5, seed=1)
    assert np.array_equal(again.predict(Xt), ens.predict(Xt))
    single = PessimisticEnsemble([TaskAdapter(prior, [3, 4]).fit(Xt, lat_t)], kappa=2.0)
    assert np.allclose(single.predict(Xt), single.members[0].predict(Xt))  # one member: no spread, no penalty
    with pytest.raises(CwmError, match="at least one member"):
        PessimisticEnsemble([])


def test_pessimistic_ensemble_scores_with_the_prior_once(monkeypatch):
    from cwm.model.ranker import PessimisticEnsemble, TaskAdapter

    X, lat, groups = make_data(seed=6)
    prior = LambdaRanker(RankerConfig(**SMALL)).fit(X, lat, groups)
    Xt, lat_t = X[:40], lat[:40]
    adapter = TaskAdapter(prior, [3, 4]).fit(Xt, lat_t)
    # Scores handed in are the ones the adapter would compute itself; a wrong count is a clear error.
    assert np.array_equal(adapter.predict(Xt, prior.predict(Xt)), adapter.predict(Xt))
    with pytest.raises(CwmError, match="prior_scores has 3 scores for 40 rows"):
        adapter.predict(Xt, np.zeros(3))
    calls = []
    real = LambdaRanker.predict
    monkeypatch.setattr(LambdaRanker, "predict", lambda self, X: calls.append(len(X)) or real(self, X))
    ens = PessimisticEnsemble.fit_bootstrap(prior, [3, 4], Xt, lat_t, size=5, seed=2)
    ens.predict(Xt)
    assert calls == [40, 40]  # once to fit all five members, once to score
