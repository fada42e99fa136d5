"""The end-to-end benchmark's yardstick: what the learned cost models saw of each network,
xgb-pretrained as a contender, and leave-network-out."""

import json

import pytest
import torch

from cwm.errors import CwmError


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).eval()
    return model, (torch.randn(1, 32),)


@pytest.fixture(scope="module")
def target():
    from cwm.hardware import make_target

    return make_target()


def _fake_model_dir(path, train, val):
    from cwm.model.world_model import CONFIG_FILE, TRAIN_SPLIT_FILE

    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text(json.dumps({"trained_on": {"database": "db", "train_tasks": len(train)},
                                                "hardware": {"mcpu": "znver3"}}))
    (path / TRAIN_SPLIT_FILE).write_text(json.dumps({"train": train, "val": val}))
    return path


def test_world_model_overlap_counts_the_networks_tasks_it_was_trained_on(tmp_path):
    from cwm.benchmarks.e2e import (
        training_line,
        world_model_overlap,
        xgb_pretrained_overlap,
    )

    net = ["t1", "t2", "t3"]
    seen = world_model_overlap(_fake_model_dir(tmp_path / "seen", ["x", "t2"], ["y"]), net)
    assert seen["tasks_in_training"] == 1 and seen["tasks"] == 3 and seen["held_out"] is False
    assert seen["trained_on"] == {"database": "db", "train_tasks": 2} and seen["mcpu"] == "znver3"
    assert seen["path"].endswith("seen")
    in_val = world_model_overlap(_fake_model_dir(tmp_path / "val", ["x"], ["t3", "t1"]), net)
    assert in_val["tasks_in_training"] == 2 and in_val["held_out"] is False  # validation counts as seen
    held = world_model_overlap(_fake_model_dir(tmp_path / "held", ["x"], ["y"]), net)
    assert held["tasks_in_training"] == 0 and held["held_out"] is True
    unknown = tmp_path / "unknown"
    _fake_model_dir(unknown, [], [])
    (unknown / "train_split.json").unlink()
    assert world_model_overlap(unknown, net)["held_out"] is None

    # xgb-pretrained was fitted on the split's train records only
    xgb = xgb_pretrained_overlap(tmp_path / "x.tar", "db", {"train": ["t1", "x"], "val": ["t2"], "test": []}, net)
    assert xgb["tasks_in_training"] == 1 and xgb["held_out"] is False and xgb["trained_on"]["database"] == "db"

    line = training_line("mlp", {"world_model": seen, "xgb_pretrained": dict(held, path="x.tar")})
    assert "cwm `" in line and "saw 1 of 3 tasks of this network" in line
    assert "xgb-pretrained `x.tar`: held out (none of its 3 tasks)" in line
    assert "does not say" in training_line("mlp", {"world_model": world_model_overlap(unknown, net)})
    assert training_line("mlp", {}) is None


def test_the_markdown_has_a_line_per_network_on_what_the_models_saw(tmp_path):
    from cwm.benchmarks.e2e import markdown, world_model_overlap

    def net(overlap):
        return {"latency_ms": {"torch_eager": 2.0}, "speedup_vs_eager": {"torch_eager": 1.0}, "errors": {},
                "total_tasks": 3, "tunable_tasks": 3, "tuning": {}, "builds": {}, "checks": {}, "roofline": [],
                "trials_per_cost_model": 1, "peak_matmul_gflops": 1.0, "peak_matmul_gflops_best": 1.0,
                "world_model": overlap}

    summary = {"contenders": ["torch_eager"], "config": {"runs": 30, "seeds": [0], "trials_per_task": 1,
                                                         "cost_models": ["cwm"]},
               "host": {"threads": 2, "cpu": "test"}, "peak_matmul_gflops": 1.0, "peak_matmul_gflops_best": 1.0,
               "networks": {"a": net(world_model_overlap(_fake_model_dir(tmp_path / "m", ["t1"], []), ["t1", "t2"])),
                            "b": net(world_model_overlap(tmp_path / "m", ["t3"]))}}
    text = markdown(summary)
    assert "- a: cwm `" in text and "saw 1 of 2 tasks of this network" in text
    assert "- b: cwm `" in text and "held out (none of its 1 tasks)" in text


def test_leave_network_out_split_has_none_of_the_networks_tasks():
    from cwm.benchmarks.e2e import leave_network_out_split

    split = {"train": ["a", "n1", "b"], "val": ["n2", "c"], "test": ["n3", "d"], "names": {"train": ["A"]}}
    reduced = leave_network_out_split(split, ["n1", "n2", "n3"])
    assert reduced == {"train": ["a", "b"], "val": ["c"], "test": ["n3", "d"]}
    assert not {"n1", "n2", "n3"} & (set(reduced["train"]) | set(reduced["val"]))
    assert split["train"] == ["a", "n1", "b"]  # the caller's split is left alone


def test_a_contender_names_its_cost_model_budget_and_transfer():
    from cwm.benchmarks.e2e import Contender, parse_contender

    assert parse_contender("cwm", 8) == Contender("cwm", 8, False)
    assert parse_contender("xgb-pretrained:32", 8) == Contender("xgb-pretrained", 32, False)
    assert parse_contender("cwm+transfer:1", 8) == Contender("cwm", 1, True)


@pytest.mark.parametrize("kwargs, message", [
    ({"cost_models": ("xgb", "xgb-pretrained")}, "xgb-pretrained cost model needs the training records"),
    ({"cost_models": ("xgb", "xgb-pretrained:32")}, "xgb-pretrained cost model needs the training records"),
    ({"cost_models": ("xgb", "xgb:0")}, "the trials per task, a positive integer"),
    ({"cost_models": ("xgb:eight",)}, "the trials per task, a positive integer"),
    ({"cost_models": ("xgb", "xgb")}, "listed twice"),
    ({"cost_models": ("xgboost:8",)}, "unknown cost model 'xgboost'"),
    ({"cost_models": ("xgb-pretrained",), "train_db": "db"}, "needs the training records"),
    ({"cost_models": ("cwm",), "leave_network_out": True}, "leave_network_out needs the training records"),
    ({"cost_models": ("xgb",), "leave_network_out": True, "train_db": "db", "split": {"train": []}},
     "neither is in cost_models"),
])
def test_training_data_is_required_before_anything_runs(tmp_path, kwargs, message):
    from cwm.benchmarks.e2e import run_e2e_benchmark

    model, inputs = _mlp()
    with pytest.raises(CwmError, match=message):
        run_e2e_benchmark([("mlp", model, inputs)], tmp_path / "out", work_root=tmp_path / "work",
                          progress=False, peak_n=64, torch_compile=False, **kwargs)
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_e2e_with_pretrained_xgb_reports_what_it_saw(tmp_path, target, multi_db, multi_split):
    from cwm.benchmarks.e2e import run_e2e_benchmark
    from cwm.data.split import load_split

    model, inputs = _mlp()
    out, work = tmp_path / "out", tmp_path / "work"
    summary = run_e2e_benchmark([("mlp", model, inputs)], out, trials_per_task=4, seeds=(0,),
                                cost_models=("xgb-pretrained", "xgb-pretrained:2"), work_root=work, progress=False,
                                runs=3,
                                warmup=1, target=target, peak_n=64, torch_compile=False, num_trials_per_iter=4,
                                train_db=multi_db, split=multi_split)
    split = load_split(multi_split)
    xgb_files = list(work.glob("xgb_pretrained_*.tar"))
    assert len(xgb_files) == 1 and not list(work.glob("*.partial"))
    data = json.loads((out / "e2e.json").read_text())
    e = data["networks"]["mlp"]
    assert e["status"] == "done" and "tvm_xgb-pretrained" in data["contenders"]
    o = e["xgb_pretrained"]
    assert o["tasks"] == e["tunable_tasks"] == 2
    assert o["tasks_in_training"] == 0 and o["held_out"] is True  # the MLP's dense layers are not in multi_db
    assert o["trained_on"]["train_tasks"] == len(split["train"]) and o["path"].endswith(xgb_files[0].name)
    assert "world_model" not in e  # cwm did not run
    assert e["tuning"]["xgb-pretrained"]["0"]["tasks_with_records"] == 2
    assert e["checks"]["tvm_xgb-pretrained@s0"]["ok"]
    # Time to quality: the same cost model at 2 trials per task, beside it in the same rotation.
    from cwm.tuning.collect import existing_counts

    assert e["trials_per_contender"] == {"xgb-pretrained": 8, "xgb-pretrained:2": 4}
    assert sum(existing_counts(work / "mlp" / "xgb-pretrained:2" / "seed0").values()) == 4
    assert e["checks"]["tvm_xgb-pretrained:2@s0"]["ok"] and e["latency_ms"]["tvm_xgb-pretrained:2"] > 0
    assert "| mlp | xgb-pretrained:2 | 0 | 4 |" in (out / "e2e.md").read_text()
    assert "training_split_sha1" in data["config"] and "leave_network_out" not in data["config"]
    assert "- mlp: xgb-pretrained `" in (out / "e2e.md").read_text()
    assert summary["networks"]["mlp"]["xgb_pretrained"] == o


def test_leave_network_out_trains_without_the_network_and_tunes_with_that_model(tmp_path, target, monkeypatch):
    """No real training or tuning: the split given to train and to the XGBoost fit, the model paths
    given to tuning, and reuse of the trained model on a second run."""
    import types
    from dataclasses import asdict

    from cwm.benchmarks import e2e, search
    from cwm.model import training
    from cwm.workloads.pipeline import extract_tasks, relax_from_torch

    model, inputs = _mlp()
    ids = [t.id for t in extract_tasks(relax_from_torch(model, inputs, target), target, network="mlp")]
    assert len(ids) >= 2
    split = {"train": [ids[0], "other1"], "val": [ids[1], "other2"], "test": ["other3"]}
    trained, fitted, tuned = [], [], []

    def fake_train(db_dir, split, out_dir, settings=None, **kwargs):
        trained.append(split)
        _fake_model_dir(out_dir, split["train"], split["val"])
        cfg = out_dir / "world_model.json"
        meta = json.loads(cfg.read_text())
        meta["trained_on"]["settings"] = asdict(settings)
        cfg.write_text(json.dumps(meta))

    def fake_pretrain(db_dir, split, out_path, target, seed=0):
        fitted.append(split)
        out_path.write_text("xgb")
        return out_path

    class Stop(Exception):
        pass

    def tune_timed(tasks, budget, work_dir, cost_model, model_path, target, seed, per_iter, progress,
                   transfer=False):
        tuned.append((cost_model, model_path, work_dir))
        if len(tuned) == 2:
            raise Stop
        return types.SimpleNamespace(weighted_latency=None, best={}), 0.0, 0.0

    monkeypatch.setattr(training, "train", fake_train)
    monkeypatch.setattr(search, "pretrain_xgb_file", fake_pretrain)
    monkeypatch.setattr(e2e, "_tune_timed", tune_timed)
    work, db = tmp_path / "work", tmp_path / "db"  # the fakes read no record
    db.mkdir()
    kwargs = {"trials_per_task": 4, "seeds": (0,), "cost_models": ("cwm", "xgb-pretrained"), "work_root": work,
              "progress": False, "target": target, "peak_n": 64, "torch_compile": False, "train_db": db,
              "split": split, "leave_network_out": True, "train_settings": training.TrainSettings.tiny()}
    with pytest.raises(Stop):
        e2e.run_e2e_benchmark([("mlp", model, inputs)], tmp_path / "out", **kwargs)
    reduced = {"train": ["other1"], "val": ["other2"], "test": ["other3"]}
    assert trained == [reduced] and fitted == [reduced]
    assert not set(ids) & set(trained[0]["train"] + trained[0]["val"])
    model_dir = work / "mlp" / e2e.LEAVE_OUT_MODEL_DIR
    (cm1, path1, wd1), (cm2, path2, wd2) = tuned
    assert (cm1, path1, wd1) == ("cwm", model_dir, work / "mlp" / "cwm-leave-out" / "seed0")
    assert cm2 == "xgb-pretrained" and path2.parent == work / "mlp" and path2.read_text() == "xgb"
    assert wd2 == work / "mlp" / "xgb-pretrained-leave-out" / "seed0"
    assert split["train"] == [ids[0], "other1"]  # the caller's split is untouched

    # A second run reuses the trained model; one trained with other settings is refused, not reused.
    tuned.clear()
    with pytest.raises(Stop):
        e2e.run_e2e_benchmark([("mlp", model, inputs)], tmp_path / "out", **kwargs)
    assert len(trained) == 1 and len(fitted) == 1 and tuned[0][1] == model_dir
    other = {**kwargs, "train_settings": training.TrainSettings(seed=5)}
    with pytest.raises(CwmError, match="other settings"):
        e2e.run_e2e_benchmark([("mlp", model, inputs)], tmp_path / "out", **other)

    # The entry's accounting: the leave-out models saw none of the network's tasks.
    overlap = e2e.world_model_overlap(model_dir, ids)
    assert overlap["held_out"] is True and overlap["tasks_in_training"] == 0
