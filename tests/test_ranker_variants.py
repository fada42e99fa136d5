"""The world model's fast experiment loop: cached features, ranker variants, the merged experiment table."""

import json

import numpy as np
import pytest

from cwm.benchmarks.ranker_variants import (
    BASELINE_VARIANT,
    COLUMN_GROUPS,
    VARIANTS,
    column_group,
    constant_columns,
    final_state_columns,
    run_variants,
    split_features,
)
from cwm.data.split import load_split
from cwm.errors import CwmError


def test_column_groups_name_every_cached_column():
    assert [column_group(n) for n in ("z0", "z63", "perf", "oof:z7", "oof:perf", "final5", "act:tile_0", "sched:x",
                                      "hw:cores")] \
        == ["z", "z", "perf", "oof:z", "oof:perf", "final", "act", "sched", "hw"]
    for v in VARIANTS.values():  # every variant names columns that exist
        assert set(v.columns) <= set(COLUMN_GROUPS)


def test_constant_columns_are_those_constant_within_every_group():
    X = np.array([[1, 5, 0], [1, 6, 0], [2, 7, 3], [2, 7, 4]], dtype=np.float32)
    groups = np.array(["a", "a", "b", "b"])
    # column 0 differs between groups only; column 1 varies in a; column 2 varies in b
    assert constant_columns(X, groups).tolist() == [True, False, False]


def test_variants_are_scored_against_action_features_and_rows_merge(tiny_model, multi_db, multi_split, tmp_path):
    split = load_split(multi_split)
    cache = tmp_path / "cache"
    out = tmp_path / "results"
    report = run_variants(tiny_model, multi_db, split, ["cwm", "oof-perf-only", "action-features-top"], out,
                          folds=2, cache_dir=cache, resamples=200, progress=False, command="test")
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {BASELINE_VARIANT, "cwm", "oof-perf-only", "action-features-top"}
    base = rows[BASELINE_VARIANT]["metrics"]
    for name, row in rows.items():
        for metric in ("top1", "top5", "pairwise_accuracy"):
            m = row["metrics"][metric]
            assert 0.0 <= m["lo"] <= m["mean"] <= m["hi"] <= 1.0
            assert m["vs_baseline"] == pytest.approx(m["mean"] - base[metric]["mean"], abs=1e-9)
        assert row["columns"] > 0 and row["trees"] >= 1
    assert all(v == 0.0 for k, v in base["top1"].items() if k.startswith("vs"))
    # the oof variant has one latent column (the out-of-fold score head) on top of the static ones
    assert rows["oof-perf-only"]["columns"] == rows[BASELINE_VARIANT]["columns"] + 1
    assert rows["oof-perf-only"]["folds"] == 2 and rows["cwm"]["folds"] is None
    assert (out / "world_model_experiments.md").read_text().count("| oof-perf-only |") == 1
    assert report["test_groups"] == 1 and report["test_records"] > 0

    # the features are cached: a second run reads them, and its rows replace only its own
    assert len(list(cache.glob("ranker_features_*.npz"))) == 1
    again = run_variants(tiny_model, multi_db, split, ["perf-only"], out, folds=2, cache_dir=cache, resamples=200,
                         progress=False)
    names = [r["variant"] for r in again["rows"]]
    assert sorted(names) == sorted({BASELINE_VARIANT, "cwm", "oof-perf-only", "action-features-top", "perf-only"})
    assert len(names) == len(set(names))
    saved = json.loads((out / "world_model_experiments.json").read_text())
    assert len(saved["rows"]) == 5


def test_oof_training_rows_come_from_an_f_that_did_not_see_their_task(tiny_model, multi_db, multi_split, tmp_path):
    split = load_split(multi_split)
    feats = split_features(tiny_model, multi_db, split, folds=2, cache_dir=None, progress=False)
    train, test = feats["train"], feats["test"]
    z = [i for i, n in enumerate(train.names) if column_group(n) == "z"]
    oof_z = [i for i, n in enumerate(train.names) if column_group(n) == "oof:z"]
    assert len(z) == len(oof_z) > 0
    # training rows: another F's rollout; test rows: the model's own F (which never saw them)
    assert not np.allclose(train.X[:, z], train.X[:, oof_z])
    np.testing.assert_array_equal(test.X[:, z], test.X[:, oof_z])


def test_a_split_whose_test_tasks_the_model_saw_is_refused(tiny_model, multi_db, multi_split, tmp_path):
    split = load_split(multi_split)
    leaky = {**split, "test": split["train"][:1]}
    with pytest.raises(CwmError, match="test task"):
        split_features(tiny_model, multi_db, leaky, folds=1, progress=False)


def test_an_f_variant_refits_f_and_its_rows_stand_beside_the_shipped_ones(tiny_model, multi_db, multi_split,
                                                                           tmp_path):
    split = load_split(multi_split)
    cache, out = tmp_path / "cache", tmp_path / "results"
    run_variants(tiny_model, multi_db, split, ["perf-only"], out, folds=1, cache_dir=cache, resamples=100,
                 progress=False)
    report = run_variants(tiny_model, multi_db, split, ["perf-only"], out, folds=1, cache_dir=cache, resamples=100,
                          progress=False, transition="relative-tiles")
    rows = {(r["variant"], r["transition"]): r for r in report["rows"]}
    assert set(rows) == {(v, f) for v in (BASELINE_VARIANT, "perf-only") for f in ("shipped", "relative-tiles")}
    # the static baseline does not depend on F
    assert rows[(BASELINE_VARIANT, "shipped")]["metrics"]["top1"] == rows[(BASELINE_VARIANT, "relative-tiles")]["metrics"]["top1"]
    assert "| perf-only | " in (out / "world_model_experiments.md").read_text()
    assert "| relative-tiles |" in (out / "world_model_experiments.md").read_text()
    # each F's columns are cached under their own key; the refit F's score head differs from the shipped one's
    assert len(list(cache.glob("ranker_features_*.npz"))) == 2
    shipped = split_features(tiny_model, multi_db, split, folds=1, cache_dir=cache, progress=False)
    refit = split_features(tiny_model, multi_db, split, folds=1, cache_dir=cache, progress=False,
                           transition="relative-tiles")
    perf = shipped["test"].names.index("perf")
    assert not np.allclose(shipped["test"].X[:, perf], refit["test"].X[:, perf])
    static = shipped["test"].columns(("act", "sched", "hw"))
    np.testing.assert_array_equal(shipped["test"].X[:, static], refit["test"].X[:, static])
    with pytest.raises(CwmError, match="unknown F variant"):
        run_variants(tiny_model, multi_db, split, ["perf-only"], out, folds=1, cache_dir=cache, progress=False,
                     transition="nope")


def test_the_final_state_gate_reads_e_of_the_true_final_states_and_e_variants_stand_beside(
        tiny_model, multi_db, multi_split, tmp_path):
    from cwm.data.dataset import load_dataset
    from cwm.model.training import ranker_parts
    from cwm.model.world_model import WorldModel

    split = load_split(multi_split)
    cache, out = tmp_path / "cache", tmp_path / "results"
    model = WorldModel.load(tiny_model)
    report = run_variants(tiny_model, multi_db, split, ["final-state"], out, folds=1, cache_dir=cache, resamples=100,
                          progress=False)
    rows = {(r["variant"], r["encoder"]): r for r in report["rows"]}
    assert rows[("final-state", "shipped")]["columns"] == rows[(BASELINE_VARIANT, "shipped")]["columns"] + \
        model.encoder.dim
    # the columns are the model's E of each test record's replayed final state, in the rows' order
    shipped = final_state_columns(tiny_model, multi_db, split, cache_dir=cache, progress=False)
    test = load_dataset(multi_db).valid().subset(split["test"])
    records = [t for _, _, part in ranker_parts(test) for t in part]
    np.testing.assert_allclose(shipped["test"][0], model.encoder.encode([test.final_state(t) for t in records]),
                               atol=1e-5)
    np.testing.assert_array_equal(shipped["test"][1], [t.latency for t in records])

    report = run_variants(tiny_model, multi_db, split, ["final-state"], out, folds=1, cache_dir=cache, resamples=100,
                          progress=False, encoder="latency-head")
    rows = {(r["variant"], r["encoder"]) for r in report["rows"]}
    assert rows == {(v, e) for v in (BASELINE_VARIANT, "final-state") for e in ("shipped", "latency-head")}
    assert "| shipped, E latency-head |" in (out / "world_model_experiments.md").read_text()
    assert len(list(cache.glob("final_states_*.npz"))) == 2
    head = final_state_columns(tiny_model, multi_db, split, cache_dir=cache, progress=False, encoder="latency-head")
    assert not np.allclose(shipped["test"][0], head["test"][0])  # another E
    with pytest.raises(CwmError, match="unknown E variant"):
        run_variants(tiny_model, multi_db, split, ["final-state"], out, folds=1, cache_dir=cache, progress=False,
                     encoder="nope")
