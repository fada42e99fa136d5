import json
import shutil

import numpy as np
import pytest
import torch

from cwm.errors import CwmError


def test_train_and_eval_cli_end_to_end(multi_db, multi_split, tmp_path):
    from typer.testing import CliRunner

    from cwm.cli import app

    model_dir = tmp_path / "model"
    result = CliRunner().invoke(app, ["train", "--db", str(multi_db), "--split", str(multi_split),
                                      "--out", str(model_dir), "--tiny"])
    assert result.exit_code == 0, result.output
    for name in ("world_model.json", "encoder/encoder.safetensors", "encoder/tokenizer.json",
                 "transition/transition.safetensors", "ranker/ranker.json", "train_report.json"):
        assert (model_dir / name).exists(), name
    report = json.loads((model_dir / "train_report.json").read_text())
    assert report["transition_loss"][-1] < report["transition_loss"][0]
    out = tmp_path / "eval"
    result = CliRunner().invoke(app, ["eval", "--db", str(multi_db), "--split", str(multi_split),
                                      "--out", str(out), "--tiny"])
    assert result.exit_code == 0, result.output
    ev = json.loads((out / "eval.json").read_text())
    # the tiny model's F has the score head, so the state-matching ablation (the paper's F) is scored too
    assert set(ev["metrics"]) == {"cwm", "state-matching", "xgb-static", "final-state", "initial-state",
                                  "action-features", "random"}
    for m in ev["metrics"].values():
        assert 0.0 <= m["pairwise_accuracy"] <= 1.0 and 0.0 < m["top1"] <= 1.0
    t = ev["throughput"]
    assert t["cwm_candidates_per_second"] > 0 and t["per_task"]
    for task in t["per_task"].values():
        us = task["us_per_candidate"]
        assert us["materialize"] > 0 and task["speedup_from_trace"] > task["speedup"] > 0
        # Each stage is timed on its own, so under load one stage can out-time the total: no ordering here.
        assert all(us[k] > 0 for k in ("serialize_trace", "decode_actions", "features_and_rollout", "rank", "cwm_total"))
    assert abs(sum(t["cwm_stage_share"].values()) - 1.0) < 1e-6
    assert (out / "eval.png").stat().st_size > 1000
    curve = ev["learning_curve"]
    assert set(curve["by_model"]) == {"cwm", "initial-state"}
    for per_size in curve["by_model"].values():
        assert sorted(int(n) for n in per_size) == curve["sizes"] and curve["sizes"][-1] == curve["train_tasks"]
        for v in per_size.values():
            assert 0.0 < v["top1"]["mean"] <= 1.0 and v["top1"]["runs"] >= 1
    assert (out / "learning_curve.png").stat().st_size > 1000


def test_save_load_gives_identical_predictions(tiny_model, multi_db, tmp_path):
    from cwm.data.dataset import load_dataset
    from cwm.model.world_model import WorldModel

    ds = load_dataset(multi_db).valid()
    model = WorldModel.load(tiny_model)
    tid = sorted(ds.by_task)[0]
    actions = [t.actions for t in ds.by_task[tid]]
    a = model.predict(ds.initial_states[tid], actions)
    model.save(tmp_path / "copy")
    b = WorldModel.load(tmp_path / "copy").predict(ds.initial_states[tid], actions)
    assert a.shape == (len(actions),) and np.array_equal(a, b)
    assert np.std(a) > 0  # it discriminates between candidates


def test_broken_model_directories(tiny_model, tmp_path):
    from cwm.model.world_model import WorldModel

    broken = tmp_path / "m"
    shutil.copytree(tiny_model, broken)
    (broken / "ranker" / "ranker.json").unlink()
    with pytest.raises(CwmError, match="ranker.json"):
        WorldModel.load(broken)
    other = tmp_path / "layout"
    shutil.copytree(tiny_model, other)
    meta = json.loads((other / "world_model.json").read_text())
    meta["feature_layout"] = "0123456789ab"
    (other / "world_model.json").write_text(json.dumps(meta))
    with pytest.raises(CwmError, match="feature layout"):
        WorldModel.load(other)
    with pytest.raises(CwmError, match="does not exist"):
        WorldModel.load(tmp_path / "nothing")


def test_empty_split_is_a_clear_error(multi_db, tmp_path):
    from cwm.model.training import TrainSettings, train

    with pytest.raises(CwmError, match="no valid records"):
        train(multi_db, {"train": [], "val": [], "test": []}, tmp_path, TrainSettings.tiny(), progress=False)


def _first_task_candidates(multi_db):
    """(task id, its valid trajectories, their MeasureCandidates, a TuneContext) of multi_db's first task."""
    import tvm.s_tir.meta_schedule as ms

    from cwm.tuning.cost_model import measure_candidates
    from cwm.data.dataset import load_dataset
    from cwm.hardware import make_target

    ds = load_dataset(multi_db).valid()
    tid = sorted(ds.by_task)[0]
    trajs = ds.by_task[tid]
    cands = measure_candidates(ds.modules[tid], [t.actions for t in trajs])
    return tid, trajs, cands, ms.TuneContext(mod=ds.modules[tid], target=make_target(), task_name="t")


def test_cost_model_predict_update_save_load(tiny_model, multi_db, tmp_path):
    from cwm.tuning.cost_model import WorldModelCostModel, runner_results
    from cwm.model.world_model import WorldModel

    tid, trajs, cands, ctx = _first_task_candidates(multi_db)
    cm = WorldModelCostModel(WorldModel.load(tiny_model), min_update=4)
    before = cm.predict(ctx, cands)
    assert before.shape == (len(cands),) and (before > 0).all() and (before <= 1).all()
    cm.update(ctx, cands, runner_results([t.latency for t in trajs]))
    assert tid in cm.adapted
    after = cm.predict(ctx, cands)
    path = tmp_path / "cm.npz"
    cm.save(str(path))
    cm2 = WorldModelCostModel(WorldModel.load(tiny_model), min_update=4)
    cm2.load(str(path))
    assert np.array_equal(after, cm2.predict(ctx, cands))


def test_cost_model_adaptation_is_chosen_by_name(tiny_model, multi_db):
    from cwm.errors import CwmError
    from cwm.model.ranker import LambdaRanker, PessimisticEnsemble, TaskAdapter
    from cwm.model.world_model import WorldModel
    from cwm.tuning.cost_model import WorldModelCostModel, runner_results
    from cwm.tuning.registry import create_cost_model

    tid, trajs, cands, ctx = _first_task_candidates(multi_db)
    kinds = {"task-adapter": TaskAdapter, "task-ensemble": PessimisticEnsemble, "boost-copy": LambdaRanker}
    for adaptation, kind in kinds.items():
        cm = WorldModelCostModel(WorldModel.load(tiny_model), min_update=4, adaptation=adaptation)
        cm.update(ctx, cands, runner_results([t.latency for t in trajs]))
        assert type(cm.adapted[tid]) is kind
        assert cm.adapted[tid] is not cm.model.ranker
    assert create_cost_model("cwm-boost-copy", tiny_model).inner.adaptation == "boost-copy"
    assert create_cost_model("cwm", tiny_model).inner.adaptation == "task-adapter"
    with pytest.raises(CwmError, match="unknown adaptation 'boost'"):
        WorldModelCostModel(WorldModel.load(tiny_model), adaptation="boost")


def test_cost_model_finetunes_the_transition_per_task(tiny_model, multi_db, tmp_path):
    from cwm.tuning.cost_model import WorldModelCostModel, runner_results
    from cwm.model.world_model import WorldModel

    tid, trajs, cands, ctx = _first_task_candidates(multi_db)
    frozen = WorldModelCostModel(WorldModel.load(tiny_model), min_update=4)
    tuned = WorldModelCostModel(WorldModel.load(tiny_model), min_update=4, finetune_transition=True)
    base_weights = {k: v.clone() for k, v in tuned.model.transition.model_.state_dict().items()}
    for cm in (frozen, tuned):
        cm.update(ctx, cands, runner_results([t.latency for t in trajs]))
    assert tid in tuned.task_models and tid not in frozen.task_models
    store = tuned.measured[tid]
    assert len(store["actions"]) == len(store["targets"]) == len(store["X"]) == len(trajs)
    assert all(1 <= len(t) <= tuned.finetune_states for t in store["targets"])
    # the pretrained F is untouched; the task's copy moved, and so did its features
    for k, v in tuned.model.transition.model_.state_dict().items():
        assert torch.equal(v, base_weights[k])
    _, x_frozen = frozen._features(ctx, cands)
    _, x_tuned = tuned._features(ctx, cands)
    assert not np.allclose(x_frozen, x_tuned)
    assert np.allclose(np.stack(store["X"]), x_tuned, atol=1e-6)
    path = tmp_path / "tuned.npz"
    tuned.save(str(path))
    again = WorldModelCostModel(WorldModel.load(tiny_model), min_update=4, finetune_transition=True)
    again.load(str(path))
    # The fine-tuned weights, the task's features and the adapted scores round-trip exactly.
    saved = tuned.task_models[tid].transition.model_.state_dict()
    for k, v in again.task_models[tid].transition.model_.state_dict().items():
        assert torch.equal(v, saved[k])
    _, x_again = again._features(ctx, cands)
    assert np.array_equal(x_again, x_tuned)
    assert np.array_equal(np.stack(again.measured[tid]["X"]), np.stack(store["X"]))
    assert tid in again.adapted
    assert np.array_equal(again.predict(ctx, cands), tuned.predict(ctx, cands))
    assert len(again.measured[tid]["targets"]) == len(trajs)


def test_finetuning_needs_a_rollout_model(tiny_model):
    from cwm.tuning.cost_model import WorldModelCostModel
    from cwm.errors import CwmError
    from cwm.model.world_model import WorldModel, WorldModelConfig

    base = WorldModel.load(tiny_model)
    initial = WorldModel(base.encoder, base.transition, base.ranker, WorldModelConfig(latent="initial"))
    with pytest.raises(CwmError, match="rolls out"):
        WorldModelCostModel(initial, finetune_transition=True)


def test_cost_model_feature_cache_matches_fresh_features(tiny_model, multi_db):
    import tvm.s_tir.meta_schedule as ms

    from cwm.schedule.actions import actions_from_trace_json, trace_to_json
    from cwm.tuning.cost_model import WorldModelCostModel, measure_candidates
    from cwm.data.dataset import load_dataset
    from cwm.hardware import make_target
    from cwm.model.world_model import WorldModel

    ds = load_dataset(multi_db).valid()
    tid = sorted(ds.by_task)[0]
    cands = measure_candidates(ds.modules[tid], [t.actions for t in ds.by_task[tid]])
    ctx = ms.TuneContext(mod=ds.modules[tid], target=make_target(), task_name="t")
    cm = WorldModelCostModel(WorldModel.load(tiny_model))
    _, first = cm._features(ctx, cands)
    # repeated and reordered candidates hit the cache, one row per distinct trace
    _, again = cm._features(ctx, cands[::-1] + cands[:2])
    assert np.array_equal(again[: len(cands)], first[::-1]) and np.array_equal(again[-2:], first[:2])
    assert len(cm._rows) == len({str(c.sch.trace) for c in cands})
    fresh = cm.model.features(ds.modules[tid].script(), [actions_from_trace_json(trace_to_json(c.sch.trace))
                                                         for c in cands], cm._hardware(ctx))
    assert np.allclose(first, fresh, atol=1e-6)

    # A full cache is dropped, but a batch of cached and new rows is still scored whole.
    cm._rows.clear()
    cm.max_cached_rows = len(cands) // 2 + 1
    cm._features(ctx, cands[: len(cands) // 2])
    _, bounded = cm._features(ctx, cands)
    # allclose: the score head's matmuls round differently with another batch size
    assert np.allclose(bounded, first, atol=1e-5) and len(cm._rows) <= len(cands)


def test_scoring_pauses_the_garbage_collector_and_restores_it(tiny_model, multi_db, monkeypatch):
    import gc

    from cwm.tuning.cost_model import WorldModelCostModel, gc_paused
    from cwm.model.world_model import WorldModel

    _, _, cands, ctx = _first_task_candidates(multi_db)
    cm = WorldModelCostModel(WorldModel.load(tiny_model))
    seen = []
    features = cm.model.features
    monkeypatch.setattr(cm.model, "features", lambda *a, **k: seen.append(gc.isenabled()) or features(*a, **k))
    assert gc.isenabled()
    cm.predict(ctx, cands)
    assert seen == [False] and gc.isenabled()
    # a failure inside still re-enables it, and a collector the caller had disabled stays disabled
    with pytest.raises(ZeroDivisionError), gc_paused():
        1 / 0
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_cost_model_warns_once_when_the_model_was_trained_on_another_machine(tiny_model, multi_db, caplog):
    import dataclasses

    from cwm.tuning.cost_model import WorldModelCostModel
    from cwm.model.world_model import WorldModel

    _, _, cands, ctx = _first_task_candidates(multi_db)
    here = WorldModelCostModel(WorldModel.load(tiny_model))  # the tiny model was trained on this machine
    with caplog.at_level("WARNING", logger="cwm"):
        here.predict(ctx, cands)
    assert "another machine" not in caplog.text
    model = WorldModel.load(tiny_model)
    model.config = dataclasses.replace(model.config, hardware=dict(model.config.hardware, mcpu="other-cpu"),
                                       trained_on=dict(model.config.trained_on, machines=["other-cpu"]))
    elsewhere = WorldModelCostModel(model)
    with caplog.at_level("WARNING", logger="cwm"):
        elsewhere.predict(ctx, cands)
        elsewhere.predict(ctx, cands)
    assert caplog.text.count("another machine") == 1 and "-> " in caplog.text
    # A model trained elsewhere on records of several machines, this one among them: no warning.
    caplog.clear()
    host = WorldModel.load(tiny_model).config.hardware["mcpu"]
    model = WorldModel.load(tiny_model)
    model.config = dataclasses.replace(model.config, hardware=dict(model.config.hardware, mcpu="other-cpu"),
                                       trained_on=dict(model.config.trained_on, machines=["other-cpu", host]))
    with caplog.at_level("WARNING", logger="cwm"):
        WorldModelCostModel(model).predict(ctx, cands)
    assert "another machine" not in caplog.text


@pytest.mark.parametrize("cost_model", ["cwm", "xgb", "random"])
def test_eight_trial_tune_gives_a_valid_database(cost_model, tiny_model, tmp_path):
    from cwm.data.database import load_raw
    from cwm.tuning.tuner import tune
    from cwm.workloads import get_task

    task = get_task("matmul:M=32,N=32,K=32")
    result = tune(task, trials=8, work_dir=tmp_path, cost_model=cost_model, model_path=tiny_model,
                  num_trials_per_iter=8, progress=False)
    raw = load_raw(tmp_path)
    assert len(raw.records) == 8 and sum(r.valid for r in raw.records) >= 6
    assert result.best[task.id]["latency"] > 0 and result.resumed_records == 0  # a fresh run learns nothing first
    assert (tmp_path / "report.json").exists() and (tmp_path / "best_so_far.png").exists()


def test_resumed_tune_warm_starts_its_cost_model(tiny_model, tmp_path):
    from cwm.data.database import load_raw
    from cwm.hardware import make_target
    from cwm.tuning.registry import create_cost_model
    from cwm.tuning.tuner import tune, warm_start
    from cwm.workloads import get_task

    task, target = get_task("matmul:M=32,N=32,K=32"), make_target()
    tune(task, trials=4, work_dir=tmp_path, cost_model="random", num_trials_per_iter=4, progress=False)
    valid = sum(r.valid for r in load_raw(tmp_path).records)
    assert valid >= 1
    xgb = create_cost_model("xgb")
    assert warm_start(xgb, tmp_path, [task], target) == valid
    assert xgb.inner.data_size == valid
    cwm = create_cost_model("cwm", tiny_model)
    warm_start(cwm, tmp_path, [task], target)
    assert len(cwm.inner.measured[task.id]["latency"]) == valid
    resumed = tune(task, trials=8, work_dir=tmp_path, cost_model="xgb", num_trials_per_iter=4, progress=False)
    assert resumed.resumed_records == valid and len(load_raw(tmp_path).records) == 8


def test_tune_a_tvmscript_file(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from cwm.cli import app
    from cwm.workloads import get_task

    path = tmp_path / "kernel.py"
    path.write_text(get_task("matmul:M=16,N=16,K=16").mod.script())
    result = CliRunner().invoke(app, ["tune", "--tir", str(path), "--trials", "4", "--per-iter", "4",
                                      "--cost-model", "cwm", "--model", str(tiny_model),
                                      "--work-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "file:kernel.py: best" in result.output


def test_one_shipped_model_serves_every_machine():
    from cwm.model.world_model import CONFIG_FILE, default_model_dir, shipped_models

    models = shipped_models()
    assert set(models) == {"default"}
    assert default_model_dir() == models["default"]
    cfg = json.loads((models["default"] / CONFIG_FILE).read_text())
    # trained on records of several machines, each with its own hardware features
    assert {"znver3", "znver5"} <= set(cfg["trained_on"]["machines"])


def test_the_shipped_model_names_its_training_tasks_and_machines():
    from pathlib import Path

    from cwm.model.world_model import CONFIG_FILE, TRAIN_SPLIT_FILE, WorldModel, shipped_models, training_tasks

    path = shipped_models()["default"]
    split = json.loads((path / TRAIN_SPLIT_FILE).read_text())
    assert split["train"] and split["val"]
    seen = training_tasks(path)
    assert seen == set(split["train"]) | set(split["val"])
    cfg = json.loads((path / CONFIG_FILE).read_text())
    assert cfg["trained_on"]["train_tasks"] <= len(split["train"])
    assert len(cfg["trained_on"]["machines"]) >= 2 and cfg["hardware"]["mcpu"]
    assert WorldModel.load(path).config.trained_on["machines"] == cfg["trained_on"]["machines"]
    # the v2 test split (held-out networks, operator kinds and search subgraphs) stays out of training
    v2 = json.loads((Path(__file__).resolve().parents[1] / "data" / "v2" / "split_v2.json").read_text())
    assert v2["test"] and not seen & set(v2["test"])


def test_compare_models_cli(tiny_model, multi_db, tmp_path):
    from typer.testing import CliRunner

    from cwm.cli import app

    out = tmp_path / "compare.json"
    result = CliRunner().invoke(app, ["compare-models", str(tiny_model), "--db", str(multi_db), "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["tasks"] == 4 and report["records"] > 0
    metrics = report["metrics"][str(tiny_model)]
    assert set(metrics) == {"pairwise_accuracy", "ndcg@10", "top1", "top5"}
    assert all(0.0 <= v <= 1.0 for v in metrics.values())
    result = CliRunner().invoke(app, ["compare-models", str(tiny_model), str(tiny_model), "--db", str(multi_db)])
    assert result.exit_code == 2 and "once" in result.output


def test_from_pretrained_takes_a_shipped_name_or_a_directory(tiny_model):
    from cwm.errors import CwmError
    from cwm.model.world_model import WorldModel, default_model_dir, shipped_models

    assert set(shipped_models()) == {"default"}
    by_name = WorldModel.from_pretrained("default")
    assert "znver5" in by_name.config.trained_on["machines"]
    assert WorldModel.from_pretrained().config == WorldModel.load(default_model_dir()).config
    by_path = WorldModel.from_pretrained(tiny_model)
    assert by_path.latent_dim == WorldModel.load(tiny_model).latent_dim
    with pytest.raises(CwmError, match="no world model named 'znver3'.*shipped models: default"):
        WorldModel.from_pretrained("znver3")  # shipped until the multi-machine model replaced it


def test_world_model_config_round_trips_and_rejects_unknown_keys():
    from cwm.errors import CwmError
    from cwm.model.world_model import WorldModelConfig

    cfg = WorldModelConfig(latent="initial", hardware={"mcpu": "znver3"}, trained_on={"tasks": 3})
    assert WorldModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(CwmError, match="unknown world model config key 'latnet'"):
        WorldModelConfig.from_dict({"latnet": "rollout"})


def test_a_model_with_another_transition_shares_the_encoder_cache(tiny_model, multi_db):
    import copy

    from cwm.data.dataset import load_dataset
    from cwm.model.world_model import WorldModel

    model = WorldModel.load(tiny_model)
    ds = load_dataset(multi_db)
    task_id = next(iter(ds.by_task))
    text = ds.initial_states[task_id]
    z0 = model.initial_latent(text)
    other = model.with_transition(copy.deepcopy(model.transition))
    assert other.encoder is model.encoder and other.ranker is model.ranker and other.transition is not model.transition
    assert other.initial_latent(text) is z0  # not encoded again


def test_encoder_transition_and_ranker_share_one_config_format(tiny_model):
    import json

    from cwm.io import CONFIG_VERSION

    for part, name in [("encoder", "encoder_config.json"), ("transition", "transition_config.json"),
                       ("ranker", "ranker_config.json")]:
        meta = json.loads((tiny_model / part / name).read_text())
        assert meta["format"] == f"cwm.{part}" and meta["version"] == CONFIG_VERSION and "config" in meta


def test_configs_written_before_the_shared_format_still_load(tiny_model, tmp_path):
    import json
    import shutil

    from cwm.errors import CwmError
    from cwm.model.world_model import WorldModel

    old = tmp_path / "old"
    shutil.copytree(tiny_model, old)
    for part, name, legacy in [("encoder", "encoder_config.json", "cwm-state-encoder"),
                               ("transition", "transition_config.json", "cwm.transition/1"),
                               ("ranker", "ranker_config.json", "cwm-lambda-ranker")]:
        path = old / part / name
        meta = json.loads(path.read_text())
        meta["format"] = legacy
        if part == "transition":
            del meta["version"]  # the old transition config had its version in the format name
        path.write_text(json.dumps(meta))
    assert WorldModel.load(old).latent_dim == WorldModel.load(tiny_model).latent_dim
    path = old / "ranker" / "ranker_config.json"
    meta = json.loads(path.read_text())
    meta["version"] = 7
    path.write_text(json.dumps(meta))
    with pytest.raises(CwmError, match="has format version 7, this cwm reads version 1"):
        WorldModel.load(old)


def test_a_trained_model_names_the_tasks_it_was_trained_on(tiny_model, multi_split):
    from cwm.data.split import load_split
    from cwm.model.world_model import training_tasks

    split = load_split(multi_split)
    assert training_tasks(tiny_model) == set(split["train"]) | set(split["val"])
    assert not training_tasks(tiny_model) & set(split["test"])


def test_trained_settings_fill_fields_added_since_with_their_defaults():
    from dataclasses import asdict

    from cwm.model.training import TrainSettings, trained_settings

    saved = asdict(TrainSettings(seed=3))
    del saved["transition_relative_tiles"]  # a model trained before the field existed
    assert trained_settings({"settings": saved}) == TrainSettings(seed=3)
    assert trained_settings({"settings": {**saved, "from_a_newer_version": 1}}) == TrainSettings(seed=3)
    assert trained_settings(None) == TrainSettings()
