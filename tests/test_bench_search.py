import json

import pytest


def test_tiny_search_benchmark(tmp_path, tiny_model):
    from cwm.benchmarks.search import run_search_benchmark

    summary = run_search_benchmark(["matmul:M=32,N=32,K=32"], tmp_path / "out", budget=4, seeds=(0,),
                                   contenders=("xgb", "random"), work_root=tmp_path / "runs",
                                   num_trials_per_iter=4, remeasure_runs=3, progress=False)
    entry = summary["per_subgraph"]["matmul:M=32,N=32,K=32"]
    assert entry["xgb"]["speedup_vs_xgb"] == pytest.approx(1.0)
    assert entry["random"]["geomean_seconds"] > 0
    assert summary["latency_source"] == "remeasured_seconds"
    for name in ("search.json", "search.md", "search.png"):
        assert (tmp_path / "out" / name).exists()
    # A second call resumes: every run is already done.
    again = run_search_benchmark(["matmul:M=32,N=32,K=32"], tmp_path / "out", budget=4, seeds=(0,),
                                 contenders=("xgb", "random"), work_root=tmp_path / "runs",
                                 num_trials_per_iter=4, remeasure_runs=3, progress=False)
    assert [r["wall_seconds"] for r in again["runs"]] == [r["wall_seconds"] for r in summary["runs"]]
    # Diagnosis of the measured candidates, through the CLI entry point.
    from typer.testing import CliRunner

    from cwm.cli import app

    res = CliRunner().invoke(app, ["bench", "diagnose-search", "--work-root", str(tmp_path / "runs"), "--budget", "4",
                                   "--model", str(tiny_model), "--out", str(tmp_path / "diag")])
    assert res.exit_code == 0, res.output
    diag = json.loads((tmp_path / "diag" / "search_diagnosis.json").read_text())
    assert set(diag["by_contender"]) == {"xgb", "random"}
    for row in diag["runs"]:
        assert 0.0 <= row["pairwise"] <= 1.0 and 0.0 < row["near_best"] <= 1.0 and row["median_over_best"] >= 1.0
    empty = CliRunner().invoke(app, ["bench", "diagnose-search", "--work-root", str(tmp_path / "runs"),
                                     "--budget", "999", "--model", str(tiny_model), "--out", str(tmp_path / "d2")])
    assert empty.exit_code != 0


def test_bad_budget():
    from cwm.benchmarks.search import run_search_benchmark
    from cwm.errors import CwmError

    with pytest.raises(CwmError):
        run_search_benchmark(["matmul"], budget=0)
