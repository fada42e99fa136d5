"""Scores that compare across predict calls (MetaSchedule keeps one heap over all the generations of
its evolutionary search), and the per-call z-score transform of earlier releases kept for the A/B.

Nothing here is measured: the candidates are random samples of the tiny task's design space, scored by
the shipped model."""

import numpy as np
import pytest


@pytest.fixture(scope="module")
def scored(tiny_task):
    """(the shipped default model, a TuneContext of the tiny task, 24 distinct candidates of it)."""
    import tvm.s_tir.meta_schedule as ms
    from tvm import s_tir

    from cwm.hardware import make_target
    from cwm.model.world_model import WorldModel

    target = make_target()
    spaces = ms.TuneContext(mod=tiny_task.mod, target=target, space_generator="post-order-apply",
                            task_name="t").generate_design_space()
    args = ms.arg_info.ArgInfo.from_prim_func(tiny_task.mod["main"])
    cands = []
    for seed in range(24):  # fresh decisions for every instruction of a design space, as SampleInitPopulation does
        sch = s_tir.Schedule(tiny_task.mod, seed=seed + 1)
        s_tir.Trace(spaces[seed % len(spaces)].trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
        cands.append(ms.MeasureCandidate(sch, args))
    assert len({str(c.sch.trace) for c in cands}) == len(cands)
    return WorldModel.from_pretrained("default"), ms.TuneContext(mod=tiny_task.mod, target=target, task_name="t"), cands


def _raw(cm, ctx, cands):
    tid, X = cm._features(ctx, cands)
    return cm.adapted.get(tid, cm.model.ranker).predict(X)


def test_a_candidates_score_does_not_depend_on_the_other_candidates_of_its_call(scored):
    from cwm.tuning.cost_model import WorldModelCostModel

    model, ctx, cands = scored
    for transform in ("sigmoid", "zscore"):
        cm = WorldModelCostModel(model, score_transform=transform)
        first = dict(zip(range(12), cm.predict(ctx, cands[:12])))  # the first call: the initial population
        # a later generation: a subset of the first call, in another order, among candidates it did not have
        order = [12, 13, 7, 14, 2, 15, 16, 9, 17, 5, 18, 19, 20, 0, 21, 22, 23]
        later = dict(zip(order, cm.predict(ctx, [cands[i] for i in order])))
        superset = dict(zip(range(23, -1, -1), cm.predict(ctx, cands[::-1])))
        again = [(first[i], later[i], superset[i]) for i in (7, 2, 9, 5, 0)]
        same = all(np.allclose(a, b, rtol=1e-9, atol=1e-12) and np.allclose(a, c, rtol=1e-9, atol=1e-12)
                   for a, b, c in again)
        # the new transform keeps every score; the old one maps each call's best to 1.0 and rescales the rest
        assert same == (transform == "sigmoid"), transform
        if transform == "sigmoid":
            assert all(np.isclose(superset[i], later[i], rtol=1e-9) for i in order)


def test_scores_are_in_the_unit_interval_and_increase_with_the_raw_score(scored):
    from cwm.tuning.cost_model import WorldModelCostModel, sigmoid_scores

    model, ctx, cands = scored
    cm = WorldModelCostModel(model)
    scores, raw = cm.predict(ctx, cands), _raw(cm, ctx, cands)
    assert scores.dtype == np.float64 and ((scores > 0) & (scores <= 1)).all()
    assert scores[np.argmax(raw)] == pytest.approx(0.5)  # the first call's best sits at the center
    order = np.argsort(raw, kind="stable")
    assert (np.diff(scores[order]) >= 0).all() and len(np.unique(scores)) == len(np.unique(raw))
    # far outside any population: still in (0, 1] and never decreasing
    wide = np.concatenate([[-1e9, -1e3], np.linspace(-20, 20, 401), [1e3, 1e9]])
    s = sigmoid_scores(wide, center=0.5, spread=2.0)
    assert ((s > 0) & (s <= 1)).all() and (np.diff(s) >= 0).all() and (np.diff(s[1:-1]) > 0).all()


def test_the_transform_is_frozen_anew_for_the_online_updated_ranker(scored):
    from cwm.tuning.cost_model import WorldModelCostModel, runner_results

    model, ctx, cands = scored
    cm = WorldModelCostModel(model, min_update=8)
    cm.predict(ctx, cands[:12])
    (ranker, transition), center, spread = next(iter(cm._score_scales.values()))
    assert ranker is model.ranker and transition is None
    # an update with made-up latencies (nothing is run) refits a copy of the ranker for the task
    cm.update(ctx, cands[:12], runner_results(np.linspace(1e-4, 1e-3, 12)))
    tid = next(iter(cm.adapted))
    later = cm.predict(ctx, cands[12:])
    frozen = cm._score_scales[tid]
    assert frozen[0][0] is cm.adapted[tid] and frozen[1:] != (center, spread)
    assert later[np.argmax(_raw(cm, ctx, cands[12:]))] == pytest.approx(0.5)
    assert np.array_equal(cm.predict(ctx, cands[12:]), later)


def test_sampling_weight_stats():
    from cwm.tuning.cost_model import sampling_weight_stats

    assert sampling_weight_stats(np.full(50, 0.3)) == pytest.approx((1.0, 0.1))
    assert sampling_weight_stats(np.eye(1, 50)[0] + 1e-300) == pytest.approx((1 / 50, 1.0))


def test_cwm_zscore_is_a_registered_cost_model_for_the_ab():
    from cwm.errors import CwmError
    from cwm.tuning.cost_model import WorldModelCostModel
    from cwm.tuning.registry import cost_model_help, cost_model_names, create_cost_model

    assert "cwm-zscore" in cost_model_names() and "cwm-zscore: cwm with the per-call z-score" in cost_model_help()
    old, new = create_cost_model("cwm-zscore", "default"), create_cost_model("cwm", "default")
    assert isinstance(old.inner, WorldModelCostModel) and old.inner.score_transform == "zscore"
    assert new.inner.score_transform == "sigmoid"
    with pytest.raises(CwmError, match="only the cwm cost model has a transition"):
        create_cost_model("cwm-zscore", "default", finetune_transition=True)
    with pytest.raises(CwmError, match="unknown score transform"):
        WorldModelCostModel(old.inner.model, score_transform="softmax")
