import json

import numpy as np
import pytest

HELD_OUT = "matmul:M=16,N=16,K=16"  # not among the tiny model's tasks


def test_online_adaptation_replay_of_search_runs(tmp_path, tiny_model):
    from cwm.benchmarks.online import ADAPTERS, replay_online_adaptation
    from cwm.benchmarks.search import finished_runs, run_search_benchmark
    from cwm.errors import CwmError
    from cwm.model.metrics import pairwise_accuracy
    from cwm.model.world_model import WorldModel

    run_search_benchmark([HELD_OUT], tmp_path / "search", budget=12, seeds=(0,), contenders=("xgb",),
                         work_root=tmp_path / "runs", num_trials_per_iter=4, remeasure_runs=3, progress=False)
    summary = replay_online_adaptation([tmp_path / "runs"], tmp_path / "out", model_path=tiny_model, ks=(6,),
                                       next_n=4, resamples=50, progress=False)
    assert {(e["proposer"], e["k"], e["adapter"]) for e in summary["results"]} == {("other", 6, a) for a in ADAPTERS}
    for e in summary["results"]:
        assert 0.0 <= e["pairwise"]["mean"] <= 1.0 and 0.0 < e["top2"]["mean"] <= 1.0
    base = next(e for e in summary["results"] if e["adapter"] == "boost-copy")
    assert base["pairwise"]["vs_boost-copy"] == {"mean": 0.0, "lo": 0.0, "hi": 0.0}
    # The frozen row is the model's own pairwise accuracy on the candidates measured after the first 6.
    (info, ds), = finished_runs(tmp_path / "runs", 12)
    (tid, trajs), = ds.by_task.items()
    trajs = sorted(trajs, key=lambda t: t.record_index)[6:10]
    model = WorldModel.load(tiny_model)
    lat = np.array([t.latency for t in trajs])
    frozen = pairwise_accuracy(model.predict(ds.initial_states[tid], [t.actions for t in trajs], ds.hardware),
                               lat, np.zeros(len(lat)))
    row = next(r for r in summary["rows"] if r["adapter"] == "frozen")
    assert row["pairwise"] == pytest.approx(frozen)
    for name in ("online_adaptation.json", "online_adaptation.md", "online_adaptation.png"):
        assert (tmp_path / "out" / name).exists()
    assert "boost-copy" in (tmp_path / "out" / "online_adaptation.md").read_text()
    # A model that does not name its training tasks cannot tell held-out tasks apart.
    import shutil

    anonymous = tmp_path / "anonymous"
    shutil.copytree(tiny_model, anonymous)
    (anonymous / "train_split.json").unlink()
    with pytest.raises(CwmError, match="names no training tasks"):
        replay_online_adaptation([tmp_path / "runs"], tmp_path / "out2", model_path=anonymous, progress=False)


def test_online_adaptation_cli_rejects_a_missing_directory(tmp_path):
    from typer.testing import CliRunner

    from cwm.cli import app

    res = CliRunner().invoke(app, ["bench", "online-adaptation", str(tmp_path / "nowhere")])
    assert res.exit_code != 0 and "no such directory" in res.output
