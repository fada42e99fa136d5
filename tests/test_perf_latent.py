"""The performance-aware latent (F's score head and within-task loss), rank labels and early stopping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cwm.errors import CwmError
from cwm.model.ranker import LambdaRanker, RankerConfig, rank_labels
from cwm.model.transition import Transition, TransitionConfig, TransitionModel, encode_batch, within_task_rank_loss
from tests.test_transition import TINY, kind_rule_targets, synthetic_trajectories


@pytest.fixture(autouse=True)
def _few_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tile_latency(trajs):
    """A latency that depends on the first tile decision: something F can only learn from the actions."""
    out = []
    for acts in trajs:
        tile = next(a["decision"] for a in acts if a["kind"] == "SamplePerfectTile")
        out.append(1.0 + tile[-1] + 0.1 * tile[0])
    return out


def test_within_task_loss_counts_only_pairs_of_one_group_beyond_the_gap():
    lat = torch.log(torch.tensor([1.0, 2.0, 1.01, 3.0, float("nan")]))
    group = torch.tensor([0, 0, 0, 1, 0])
    right = torch.tensor([3.0, 1.0, 2.9, 0.0, 5.0])  # faster scores higher
    wrong = -right
    loss_right = within_task_rank_loss(right, lat, group, min_gap=0.03)
    loss_wrong = within_task_rank_loss(wrong, lat, group, min_gap=0.03)
    assert loss_right.shape == () and loss_right < loss_wrong
    # pairs: (0 faster than 1) and (2 faster than 1); 0 vs 2 is inside the gap, 3 is alone, 4 invalid
    expected = torch.nn.functional.softplus(torch.tensor([1.0 - 3.0, 1.0 - 2.9])).mean()
    assert loss_right.item() == pytest.approx(expected.item(), rel=1e-6)
    # no pair at all: zero, and still differentiable
    s = torch.zeros(2, requires_grad=True)
    zero = within_task_rank_loss(s, torch.log(torch.tensor([1.0, 1.0])), torch.tensor([0, 0]))
    zero.backward()
    assert zero.item() == 0.0 and s.grad is not None


def test_score_head_shapes_and_batched_rollout_equals_stepping():
    torch.manual_seed(0)
    model = TransitionModel(TransitionConfig(perf_weight=1.0, **TINY)).eval()
    trajs = synthetic_trajectories(4, seed=5)
    z0 = torch.randn(4, 8)
    with torch.no_grad():
        _, z_T = model.rollout(z0, *encode_batch(trajs))
        scores = model.score(z0, z_T)
        assert scores.shape == (4,)
        for i in range(4):
            _, zi = model.rollout(z0[i : i + 1], *encode_batch(trajs[i : i + 1]))
            assert torch.allclose(model.score(z0[i : i + 1], zi), scores[i : i + 1], atol=1e-6)
    with pytest.raises(CwmError, match="no score head"):
        TransitionModel(TransitionConfig(**TINY)).score(z0, z0)


def test_perf_loss_teaches_the_head_the_within_task_order(tmp_path):
    trajs = synthetic_trajectories(96, seed=7)
    z0 = np.repeat(np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32), 24, axis=0)
    targets = kind_rule_targets(z0, trajs)
    targets = [t if i % 2 == 0 else {} for i, t in enumerate(targets)]  # half trains the head only
    lat = _tile_latency(trajs)
    groups = [f"task{i // 24}" for i in range(96)]
    est = Transition(TransitionConfig(epochs=25, perf_weight=1.0, perf_group_size=8, **TINY))
    est.fit(z0, trajs, targets, progress=False, latencies=lat, groups=groups)
    assert est.has_score_head and {"perf"} <= set(est.history_[0])
    assert est.history_[-1]["perf"] < est.history_[0]["perf"]
    scores = est.scores(z0, est.predict(z0, trajs))
    from scipy.stats import spearmanr

    rho = np.mean([spearmanr(scores[g * 24 : (g + 1) * 24], -np.array(lat[g * 24 : (g + 1) * 24]))[0]
                   for g in range(4)])
    assert rho > 0.5
    # save/load keeps the head and its scores
    est.save(tmp_path / "f")
    back = Transition.load(tmp_path / "f")
    assert back.has_score_head
    assert np.allclose(back.scores(z0, back.predict(z0, trajs)), scores, atol=1e-6)
    # the head needs one latency and group per trajectory
    with pytest.raises(CwmError, match="one latency and one group"):
        Transition(TransitionConfig(epochs=1, perf_weight=1.0, **TINY)).fit(
            z0, trajs, targets, progress=False, latencies=lat[:3], groups=groups)


def test_without_latencies_a_perf_config_trains_as_before():
    trajs = synthetic_trajectories(16, seed=2)
    z0 = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)
    targets = kind_rule_targets(z0, trajs)
    est = Transition(TransitionConfig(epochs=2, perf_weight=1.0, **TINY)).fit(z0, trajs, targets, progress=False)
    assert est.history_[-1]["perf"] == 0.0


def test_rank_labels_spread_grades_over_ranks():
    lat = [1.0, 2.0, 3.0, 4.0, 100.0, 200.0, np.nan, 5.0, 5.0]
    groups = [0, 0, 0, 0, 0, 0, 0, 1, 1]
    labels = rank_labels(lat, groups, levels=6)
    assert labels[:6].tolist() == [5, 4, 3, 2, 1, 0]  # slow candidates still ordered
    assert labels[6] == 0 and labels[7] == labels[8] == 5  # invalid; ties share the top grade
    with pytest.raises(CwmError):
        rank_labels(lat, groups, levels=1)


def _ranking_data(seed, groups=20, per=30, noise_cols=20):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(groups * per, 1 + noise_cols)).astype(np.float32)
    lat = np.exp(-X[:, 0] + 0.5 * rng.normal(size=len(X)))
    return X, lat, np.repeat(np.arange(groups), per)


def test_early_stopping_keeps_the_trees_up_to_the_best_validation_round():
    X, lat, g = _ranking_data(0)
    Xv, latv, gv = _ranking_data(1)
    cfg = RankerConfig(objective="rank:pairwise", n_estimators=300, labels="rank", label_levels=32,
                       early_stopping_rounds=10, n_jobs=1)
    ranker = LambdaRanker(cfg).fit(X, lat, g, eval_set=(Xv, latv, gv))
    assert ranker.num_boosted_rounds < 300
    val = ranker.history_["val"]["ndcg@10"]
    assert ranker.num_boosted_rounds == int(np.argmax(val)) + 1
    with pytest.raises(CwmError, match="labels"):
        RankerConfig(labels="latency")
