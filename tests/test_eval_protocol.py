"""The offline evaluation protocol: bootstrap intervals, the random baseline, every contender retrained."""

import json
from dataclasses import replace

import numpy as np
import pytest

from cwm.model.metrics import (
    RANKING_METRICS,
    bootstrap_ci,
    bootstrap_difference,
    bootstrap_indices,
    evaluate_ranking,
    per_group_ranking,
    weighted_mean,
)


def _toy(n_groups=6, per_group=9, seed=0):
    rng = np.random.default_rng(seed)
    groups = np.repeat([f"t{i}" for i in range(n_groups)], per_group)
    lat = rng.uniform(1, 5, len(groups))
    lat[::7] = np.nan  # failed candidates
    scores = -lat + rng.normal(0, 1.5, len(groups))
    scores[3] = np.nan
    weights = {f"t{i}": float(i + 1) for i in range(n_groups)}
    return scores, lat, groups, weights


def test_per_group_values_aggregate_to_evaluate_ranking():
    scores, lat, groups, weights = _toy()
    labels, values, agg = per_group_ranking(scores, lat, groups, weights)
    assert labels == sorted(set(groups.tolist()))
    overall = evaluate_ranking(scores, lat, groups, weights)
    for m in RANKING_METRICS:
        assert weighted_mean(values[m], agg[m]) == pytest.approx(overall[m], abs=1e-12), m
    # per group, the plain metric of that group alone
    m0 = groups == labels[0]
    assert values["top1"][0] == pytest.approx(evaluate_ranking(scores[m0], lat[m0], groups[m0])["top1"])
    assert agg["top1"].tolist() == [weights[g] for g in labels]


def test_bootstrap_interval_contains_mean_and_shrinks_with_more_tasks():
    rng = np.random.default_rng(1)
    widths = {}
    for n in (8, 800):
        values = rng.uniform(0.2, 0.9, n)
        mean, lo, hi = bootstrap_ci(values, resamples=2000, seed=3)
        assert mean == pytest.approx(values.mean())
        assert lo < mean < hi
        widths[n] = hi - lo
    # the width of a mean's interval goes like 1/sqrt(n): 10x narrower for 100x more tasks
    assert widths[800] < widths[8] / 4
    # weights count, non-finite values do not
    mean, lo, hi = bootstrap_ci([0.0, 1.0, np.nan], [1.0, 3.0, 5.0], resamples=1000, seed=0)
    assert mean == pytest.approx(0.75) and 0.0 <= lo <= mean <= hi <= 1.0
    # seeded: the same interval twice
    assert bootstrap_ci(values, seed=5) == bootstrap_ci(values, seed=5)
    assert bootstrap_indices(10, 1000, seed=0).shape == (1000, 10)


def test_paired_difference_with_itself_is_exactly_zero():
    rng = np.random.default_rng(2)
    a = rng.uniform(0, 1, 12)
    w = rng.integers(1, 50, 12).astype(float)
    assert bootstrap_difference(a, a, w, resamples=1000, seed=0) == (0.0, 0.0, 0.0)
    # a better scorer: the paired interval excludes 0, and is narrower than the unpaired one
    b = a - 0.05 + rng.normal(0, 0.01, 12)
    idx = bootstrap_indices(12, 2000, seed=1)
    diff, lo, hi = bootstrap_difference(a, b, w, indices=idx)
    assert diff == pytest.approx(weighted_mean(a, w) - weighted_mean(b, w))
    assert 0 < lo < diff < hi
    _, alo, ahi = bootstrap_ci(a, w, indices=idx)
    assert hi - lo < (ahi - alo) / 3


def test_random_contender_is_the_expectation_over_draws():
    from cwm.benchmarks.offline import random_contender

    # One task, 4 candidates, one twice as fast as the three others: a uniform pick finds it with
    # probability 1/4, else it gets 1/2 of the best speed: E[top1] = 1/4 + 3/4 * 1/2 = 0.625.
    # A single draw scores 1.0 or 0.5, never within 0.04 of the expectation.
    lat = np.array([1.0, 2.0, 2.0, 2.0])
    groups = np.array(["a"] * 4)
    _, values, agg = random_contender(lat, groups, draws=100, seed=0)
    top1 = weighted_mean(values["top1"], agg["top1"])
    assert top1 == pytest.approx(0.625, abs=0.04)
    assert weighted_mean(values["top5"], agg["top5"]) == 1.0  # 4 candidates: top-5 holds them all
    # pairwise: 3 comparable pairs, each right with probability 1/2
    assert weighted_mean(values["pairwise_accuracy"], agg["pairwise_accuracy"]) == pytest.approx(0.5, abs=0.1)
    # more draws: closer still
    _, many, _ = random_contender(lat, groups, draws=4000, seed=1)
    assert many["top1"][0] == pytest.approx(0.625, abs=0.015)


def test_evaluate_retrains_every_contender(multi_db, multi_split, tmp_path):
    from cwm.benchmarks.offline import CONTENDERS, evaluate
    from cwm.data.split import load_split
    from cwm.errors import CwmError
    from cwm.model.training import TrainSettings
    from cwm.model.world_model import WorldModel

    split = load_split(multi_split)
    out = tmp_path / "eval"
    with pytest.raises(CwmError, match="random_draws"):
        evaluate(multi_db, split, out, settings=TrainSettings.tiny(), random_draws=10, progress=False)
    settings = replace(TrainSettings.tiny(), transition_perf_weight=1.0)  # a performance-aware F
    report = evaluate(multi_db, split, out, settings=settings,
                      records_per_task_cap=8, throughput_batch=16, curve_repeats=1, progress=False)
    assert set(CONTENDERS) == {"cwm", "xgb-static", "final-state", "initial-state", "action-features",
                               "state-matching", "random"}
    assert set(report["metrics"]) == set(CONTENDERS)
    assert set(report["intervals"]) == set(CONTENDERS)
    assert set(report["difference_vs_cwm"]) == set(CONTENDERS) - {"cwm"}

    p = report["protocol"]
    from cwm.data.dataset import load_dataset

    ds = load_dataset(multi_db)
    assert p["train_tasks"] == sorted(ds.tasks[t].name for t in split["train"])
    assert report["test_tasks"] == [ds.tasks[t].name for t in sorted(split["test"])]
    assert p["cwm"]["trained_with"] == "cwm.model.training.train" and p["cwm"]["retrained"] == ["encoder", "transition", "ranker"]
    assert p["cwm"]["retrained"] == ["encoder", "transition", "ranker"]
    assert p["settings"]["encoder_hidden"] == TrainSettings.tiny().encoder_hidden
    # the retrained model is saved, trained on the train split only
    saved = WorldModel.load(p["cwm"]["model_dir"])
    assert saved.config.trained_on["train_tasks"] == len(split["train"])
    assert saved.config.trained_on["settings"]["encoder_hidden"] == TrainSettings.tiny().encoder_hidden
    # the cap (12 records per task in multi_db) applies to every ranker: 8 per training task
    assert report["records_per_task_cap"] == 8 and report["records_per_task_cap_applies_to"]
    assert p["ranker_train_records"] == 8 * len(split["train"])
    assert p["cwm"]["ranker"] == "ranker refit on the capped records"
    assert report["random"]["draws"] >= 100 and report["bootstrap"]["resamples"] >= 1000

    for name in CONTENDERS:
        for m in RANKING_METRICS:
            iv = report["intervals"][name][m]
            assert iv["lo"] <= iv["mean"] <= iv["hi"], (name, m)
            assert report["metrics"][name][m] == iv["mean"]
    for name, per in report["difference_vs_cwm"].items():
        for m in RANKING_METRICS:
            d = per[m]
            assert d["lo"] <= d["mean"] <= d["hi"]
            assert d["mean"] == pytest.approx(report["metrics"]["cwm"][m] - report["metrics"][name][m])
    # the action-features ablation has no latent at all: cwm's features less the latent
    c = p["contenders"]
    assert c["action-features"]["latent"] == "none" and c["cwm"]["latent"] == "rollout"
    # cwm's F is performance-aware: its score head is one more column; the paper's F has none
    assert saved.perf_score and "perf" in saved.feature_names
    assert c["cwm"]["features"] - c["action-features"]["features"] == saved.latent_dim + 1
    assert c["initial-state"]["features"] == c["final-state"]["features"] == c["cwm"]["features"] - 1
    assert c["state-matching"]["features"] == c["cwm"]["features"] - 1

    ev = json.loads((out / "eval.json").read_text())
    assert ev["intervals"] == json.loads(json.dumps(report["intervals"], default=float))
    md = (out / "eval.md").read_text()
    for name in CONTENDERS:
        assert f"`{name}`" in md
    assert "[" in md and "bootstrap" in md
    assert (out / "eval.png").stat().st_size > 1000
    assert (out / "learning_curve.png").stat().st_size > 1000
