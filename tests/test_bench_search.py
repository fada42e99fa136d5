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
    assert summary["num_trials_per_iter"] == 4
    assert summary["overall"]["random"]["wall_seconds_per_trial"] > 0
    assert "4 candidates per iteration" in (tmp_path / "out" / "search.md").read_text()
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
    pooled = diag["pooled"]
    assert pooled["tasks"] == ["matmul:M=32,N=32,K=32"] and pooled["candidates"] >= 4
    assert set(pooled["by_scorer"]) == {"cwm", "random"}  # no pretrained XGBModel in this work root
    assert "Ranking the pooled candidates" in (tmp_path / "diag" / "search_diagnosis.md").read_text()
    assert 0.0 < pooled["by_scorer"]["cwm"]["top16_distinct_tiles"] <= 1.0
    xgb_headroom = diag["headroom"]["by_contender"]["xgb"]
    assert xgb_headroom["lead_vs_xgb_at"] == {"4": pytest.approx(1.0)} and xgb_headroom["gap_to_pool_best"] >= 1.0
    assert "Headroom" in (tmp_path / "diag" / "search_diagnosis.md").read_text()
    # With a pretrained XGBModel, it scores the pool too (here pretrained on the pool itself).
    from cwm.benchmarks.search import finished_runs, pooled_ranking
    from cwm.tuning.cost_model import pretrain_xgb
    from cwm.data.dataset import load_dataset
    from cwm.hardware import make_target
    from cwm.model.world_model import WorldModel

    run_dir = next((tmp_path / "runs").glob("*/b4/xgb/seed0"))
    pretrain_xgb(load_dataset(run_dir).valid(), make_target(), progress=False).save(str(tmp_path / "xgb.tar"))
    with_xgb = pooled_ranking(finished_runs(tmp_path / "runs", 4), WorldModel.load(tiny_model),
                              xgb_path=tmp_path / "xgb.tar")
    assert set(with_xgb["by_scorer"]) == {"cwm", "xgb-pretrained", "random"}
    for v in with_xgb["by_scorer"].values():
        assert 0.0 <= v["pairwise_accuracy"] <= 1.0 and 0.0 < v["best_of_16"] <= 1.0
    assert with_xgb["by_scorer"]["cwm"] == pooled["by_scorer"]["cwm"]
    empty = CliRunner().invoke(app, ["bench", "diagnose-search", "--work-root", str(tmp_path / "runs"),
                                     "--budget", "999", "--model", str(tiny_model), "--out", str(tmp_path / "d2")])
    assert empty.exit_code != 0


def test_a_resumed_search_run_counts_the_time_of_every_invocation(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import cwm.benchmarks.search
    from cwm.benchmarks.search import TUNING_TIME_FILE, _load_or_tune, _run_dir
    from cwm.workloads import get_task

    task = get_task("matmul:M=32,N=32,K=32")

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-tune")

    def finish(*args, **kwargs):
        return SimpleNamespace(best={}, curve=[1.0], cost_model_seconds=2.0, trials=4)

    monkeypatch.setattr(cwm.benchmarks.search, "tune", crash)
    with pytest.raises(RuntimeError):
        _load_or_tune(task, 4, "xgb", 0, tmp_path, None, None, None, 4, False)
    run_dir = _run_dir(tmp_path, task, 4, "xgb", 0)
    saved = json.loads((run_dir / TUNING_TIME_FILE).read_text())
    assert saved["invocations"] == 1 and saved["cost_model_seconds"] == 0.0
    saved["seconds"] = 100.0  # as if the killed invocation had run for 100 s
    (run_dir / TUNING_TIME_FILE).write_text(json.dumps(saved))
    monkeypatch.setattr(cwm.benchmarks.search, "tune", finish)
    record = _load_or_tune(task, 4, "xgb", 0, tmp_path, None, None, None, 4, False)
    assert record["invocations"] == 2 and record["wall_seconds"] >= 100.0 and record["cost_model_seconds"] == 2.0


def test_bad_budget():
    from cwm.benchmarks.search import run_search_benchmark
    from cwm.errors import CwmError

    with pytest.raises(CwmError):
        run_search_benchmark(["matmul"], budget=0)


def test_markdown_reports_sample_efficiency():
    from cwm.benchmarks.search import _markdown

    entry = {"cwm": {"geomean_seconds": 1e-3, "speedup_vs_xgb": 1.2, "cost_model_seconds_per_trial": 0.01},
             "xgb": {"geomean_seconds": 1.2e-3, "speedup_vs_xgb": 1.0, "cost_model_seconds_per_trial": 0.01}}
    per = {"a": {**entry, "sample_efficiency": {"large": 1e-3, "cwm_tenth": 0.9e-3, "ratio": 0.9}},
           "b": {**entry, "sample_efficiency": {"large": 1e-3, "cwm_tenth": 1.6e-3, "ratio": 1.6}}}
    text = _markdown({"budget": 32, "large_budget": 320, "large_contender": "xgb-pretrained",
                      "latency_source": "remeasured_seconds", "per_subgraph": per, "overall": {}})
    assert "cwm at 32 trials against xgb-pretrained at 320" in text
    assert "| a | 1.0000 | 0.9000 | 0.900 |" in text
    assert "geometric mean of cwm / xgb-pretrained latency: 1.200" in text  # sqrt(0.9 * 1.6)
    plain = _markdown({"budget": 32, "large_budget": None, "latency_source": "db_best_seconds",
                       "per_subgraph": {"a": entry}, "overall": {}})
    assert "Sample efficiency" not in plain


def test_sample_efficiency_summary_and_plot(tmp_path):
    from types import SimpleNamespace

    from cwm.benchmarks.search import _markdown, _plot, _summarize

    def run(contender, budget, seed, curve, remeasured):
        return {"task": "a", "contender": contender, "budget": budget, "seed": seed, "curve": curve,
                "db_best_seconds": min(curve), "remeasured_seconds": remeasured, "wall_seconds": 1.0,
                "cost_model_seconds": 0.1, "trials": budget}

    pre = "xgb-pretrained"
    runs = [run("cwm", 2, 0, [3.0, 2.0], 2.2), run("xgb", 2, 0, [4.0, 4.0], 4.0), run(pre, 2, 0, [3.0, 3.0], 3.0),
            run(pre, 20, 0, [5.0] * 9 + [2.0] * 11, 2.0), run("xgb", 20, 0, [1.0] * 20, 1.0),
            run("cwm", 2, 1, [2.5, 2.0], 2.0), run("xgb", 2, 1, [4.0, 3.0], 3.0), run(pre, 2, 1, [2.0, 2.0], 2.0),
            run(pre, 20, 1, [5.0] * 20, 5.0)]
    summary = _summarize([SimpleNamespace(name="a")], runs, ["cwm", "xgb", pre], 2, 20, 30)
    eff = summary["per_subgraph"]["a"]["sample_efficiency"]
    # The baseline is the pretrained XGBoost at the large budget; cold xgb's large run is not it.
    assert summary["large_contender"] == pre and eff["large_contender"] == pre
    assert eff["cwm_tenth_per_seed"] == [2.2, 2.0] and eff["large_per_seed"] == [2.0, 5.0]
    assert eff["ratio"] == pytest.approx((2.2 * 2.0) ** 0.5 / (2.0 * 5.0) ** 0.5)
    # cwm's median database best is 2.0: the first large run reaches it at trial 10, the second never.
    assert eff["large_trials_to_reach_cwm_tenth"] == [10, None]
    # Each contender's speed-up over xgb-pretrained at the fixed budget, per subgraph and overall.
    against = (3.0 * 2.0) ** 0.5 / (2.2 * 2.0) ** 0.5
    assert summary["per_subgraph"]["a"]["cwm"]["speedup_vs_xgb_pretrained"] == pytest.approx(against)
    assert summary["vs_xgb_pretrained"]["cwm"]["geomean"] == pytest.approx(against)
    assert pre not in summary["vs_xgb_pretrained"]
    # Without cold xgb among the contenders the ratios to xgb-pretrained are still reported.
    no_cold = _summarize([SimpleNamespace(name="a")], runs, ["cwm", pre], 2, None, 30)
    assert no_cold["overall"] == {} and no_cold["vs_xgb_pretrained"]["cwm"]["geomean"] == pytest.approx(against)
    text = _markdown(summary)
    assert "| a | 3162.2777 (2000.0000 / 5000.0000) | 2097.6177 (2200.0000 / 2000.0000) |" in text
    assert "- a: 10 / >20" in text
    assert f"- cwm: {against:.3f}x" in text and "- xgb-pretrained: 1.000x" not in text
    cold = _summarize([SimpleNamespace(name="a")], runs, ["cwm", "xgb"], 2, 20, 30, large_contender="xgb")
    assert cold["per_subgraph"]["a"]["sample_efficiency"]["large_per_seed"] == [1.0]
    assert cold["vs_xgb_pretrained"] == {}
    _plot(summary, tmp_path / "search.png")
    assert (tmp_path / "search.png").stat().st_size > 0


def test_run_plan_runs_a_shared_budget_once():
    from cwm.benchmarks.search import run_plan

    assert run_plan(32, ["cwm", "xgb"], 320, "xgb") == [(32, "cwm"), (32, "xgb"), (320, "xgb")]
    assert run_plan(64, ["cwm", "xgb"], 1000) == [(64, "cwm"), (64, "xgb"), (1000, "xgb-pretrained"), (100, "cwm")]
    assert run_plan(64, ["random"]) == [(64, "random")]


def test_search_world_model_variants(tmp_path, tiny_model, multi_db, multi_split):
    from cwm.benchmarks.search import run_search_benchmark
    from cwm.data.split import load_split
    from cwm.model.world_model import WorldModel

    summary = run_search_benchmark(["matmul:M=32,N=32,K=32"], tmp_path / "out", budget=4, seeds=(0,),
                                   contenders=("cwm-initial", "cwm-finetune"), model_path=tiny_model, train_db=multi_db,
                                   split=load_split(multi_split), work_root=tmp_path / "runs",
                                   num_trials_per_iter=4, remeasure_runs=3, progress=False)
    for contender in ("cwm-initial", "cwm-finetune"):
        entry = summary["per_subgraph"]["matmul:M=32,N=32,K=32"][contender]
        assert entry["geomean_seconds"] > 0 and entry["cost_model_seconds"] > 0
    ablation = WorldModel.load(tmp_path / "runs" / "cwm_initial_model")
    assert ablation.config.latent == "initial"
    assert WorldModel.load(tiny_model).config.latent == "rollout"


def test_search_ablation_needs_training_data(tmp_path, tiny_model):
    from cwm.benchmarks.search import run_search_benchmark
    from cwm.errors import CwmError

    with pytest.raises(CwmError, match="cwm-initial needs the training database"):
        run_search_benchmark(["matmul:M=32,N=32,K=32"], tmp_path / "out", budget=4, contenders=("cwm-initial",),
                             model_path=tiny_model, work_root=tmp_path / "runs", progress=False)


def test_headroom_against_the_pool_best():
    from cwm.benchmarks.search import headroom, tile_decisions

    def run(contender, task, seed, curve):
        return {"contender": contender, "task": task, "seed": seed, "budget": 4, "num_trials_per_iter": 2,
                "curve": curve, "db_best_seconds": min(v for v in curve if v is not None)}

    infos = [run("xgb", "a", 0, [None, 4.0, 4.0, 2.0]), run("cwm", "a", 0, [2.0, 2.0, 1.0, 1.0]),
             run("xgb", "b", 0, [3.0, 3.0, 3.0, 3.0]), run("cwm", "b", 0, [None, None, 6.0, 3.0])]
    h = headroom(infos)
    assert h["checkpoints"] == [2, 4] and h["subgraphs"] == 2
    cwm, xgb = h["by_contender"]["cwm"], h["by_contender"]["xgb"]
    # pool bests: a 1.0 (cwm), b 3.0 (both)
    assert xgb["gap_to_pool_best"] == pytest.approx(2.0 ** 0.5)
    assert cwm["gap_to_pool_best"] == pytest.approx(1.0)
    # after 2 trials only subgraph a has both curves (4/2); after 4: a 2/1, b 3/3
    assert cwm["lead_vs_xgb_at"] == {"2": pytest.approx(2.0), "4": pytest.approx(2.0 ** 0.5)}
    assert headroom([]) == {}
    actions = [{"kind": "SamplePerfectTile", "decision": [4, 8]}, {"kind": "Split", "decision": None},
               {"kind": "SampleCategorical", "decision": 2}]
    assert tile_decisions(actions) == ((4, 8),)


def test_a_training_split_subgraph_is_marked_and_the_default_set_is_held_out(tmp_path):
    from cwm.benchmarks.search import DEFAULT_SUBGRAPHS, training_marks
    from cwm.model.world_model import shipped_models, training_tasks
    from cwm.workloads import resolve_task

    seen_task = resolve_task("dense_relu:M=128,N=512,K=256")  # in the default model's training split
    held_out = resolve_task(DEFAULT_SUBGRAPHS[0])
    split = {"train": [seen_task.id], "val": [], "test": [held_out.id]}
    marks = training_marks([seen_task, held_out], ["cwm", "xgb", "xgb-pretrained"], shipped_models()["default"],
                           split)
    assert marks == {seen_task.name: ["cwm", "xgb-pretrained"]}
    # a model that does not name its training tasks: every subgraph is marked, as unknown
    assert training_marks([held_out], ["cwm"], tmp_path, None) == {held_out.name: ["cwm (unknown)"]}
    assert len(DEFAULT_SUBGRAPHS) >= 12
    ids = {resolve_task(name).id for name in DEFAULT_SUBGRAPHS}
    for path in shipped_models().values():
        assert not ids & training_tasks(path), path


def test_the_search_report_names_marked_subgraphs():
    from cwm.benchmarks.search import _markdown

    summary = {"budget": 8, "latency_source": "re-measured", "per_subgraph": {"a": {}, "b": {}}, "overall": {},
               "in_training": {"a": ["cwm"]}}
    text = _markdown(summary)
    assert "| a (in training: cwm) |" in text and "| b |" in text


def test_the_score_transform_ab_contender_runs_on_cwms_model(tmp_path, monkeypatch):
    """``--contenders cwm,cwm-zscore``: both tune with the shipped model path and are marked by its
    training tasks (tuning and re-measuring are stubbed: nothing is run)."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import cwm.benchmarks.search
    from cwm.benchmarks.search import CONTENDERS, training_marks
    from cwm.cli import app
    from cwm.model.world_model import default_model_dir
    from cwm.workloads import resolve_task

    calls = []

    def fake_tune(task, **kwargs):
        calls.append((kwargs["cost_model"], kwargs["model_path"], kwargs["finetune_transition"]))
        return SimpleNamespace(best={task.id: {"latency": 1e-3, "trace": None}}, curve=[1e-3] * 4,
                               cost_model_seconds=0.1, trials=4)

    monkeypatch.setattr(cwm.benchmarks.search, "tune", fake_tune)
    monkeypatch.setattr(cwm.benchmarks.search, "remeasure_interleaved", lambda items, *a, **k: [1e-3] * len(items))
    res = CliRunner().invoke(app, ["bench", "search", "matmul:M=32,N=32,K=32", "--contenders", "cwm,cwm-zscore,xgb",
                                   "--seeds", "1", "--budget", "4", "--per-iter", "4", "--out", str(tmp_path / "out"),
                                   "--work-root", str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    model = default_model_dir()
    assert calls == [("cwm", model, False), ("cwm-zscore", model, False), ("xgb", None, False)]
    summary = json.loads((tmp_path / "out" / "search.json").read_text())
    assert set(summary["per_subgraph"]["matmul:M=32,N=32,K=32"]) == {"cwm", "cwm-zscore", "xgb"}
    assert "cwm-zscore" not in CONTENDERS  # opt-in, like the world-model variants
    seen = resolve_task("dense_relu:M=128,N=512,K=256")  # in the default model's training split
    marks = training_marks([seen], ["cwm", "cwm-zscore"], model)
    assert marks == {seen.name: ["cwm", "cwm-zscore"]}


def test_a_contender_can_name_its_evolutionary_population(tmp_path):
    from cwm.benchmarks.search import run_search_benchmark, split_contender
    from cwm.errors import CwmError

    assert split_contender("cwm@128") == ("cwm", 128) and split_contender("xgb") == ("xgb", None)
    for bad in ("cwm@", "cwm@0", "cwm@x"):
        with pytest.raises(CwmError, match="positive integer"):
            split_contender(bad)
    with pytest.raises(CwmError, match="unknown contender 'xgboost@64'"):
        run_search_benchmark(["matmul:M=32,N=32,K=32"], tmp_path / "bad", contenders=("xgboost@64",))
    summary = run_search_benchmark(["matmul:M=32,N=32,K=32"], tmp_path / "out", budget=4, seeds=(0,),
                                   contenders=("xgb", "xgb@64"), work_root=tmp_path / "runs",
                                   num_trials_per_iter=4, remeasure_runs=3, progress=False)
    runs = {r["contender"]: r for r in summary["runs"]}
    assert runs["xgb@64"]["population_size"] == 64 and runs["xgb"]["population_size"] is None
    assert runs["xgb@64"]["trials"] == 4
    assert summary["per_subgraph"]["matmul:M=32,N=32,K=32"]["xgb@64"]["speedup_vs_xgb"] > 0
