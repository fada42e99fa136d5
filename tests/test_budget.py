"""The tuning budget is split over the tasks before the search: every task gets its floor, the heaviest
get the rest, and a budget too small for every task is said before tuning."""

from dataclasses import dataclass

import pytest

from cwm.errors import CwmError
from cwm.tuning.budget import (
    MIN_TRIALS_PER_TASK,
    SEARCH_SECONDS_PER_TASK,
    SECONDS_PER_TRIAL,
    estimated_seconds,
    plan_trials,
)


@dataclass
class FakeTask:
    id: str
    flops: float
    nbytes: int = 0
    weight: float = 1.0

    @property
    def name(self):
        return f"net/{self.id}"


def test_every_task_gets_the_floor_and_the_rest_follows_the_estimated_time():
    tasks = [FakeTask("small", 1e6), FakeTask("big", 9e9), FakeTask("mid", 3e9, weight=1.0)]
    plan = plan_trials(tasks, 100)
    assert sum(plan.trials.values()) == 100
    assert min(plan.trials.values()) >= MIN_TRIALS_PER_TASK
    assert list(plan.trials) == ["big", "mid", "small"]  # tuned heaviest first
    assert plan.trials["big"] > plan.trials["mid"] > plan.trials["small"] == MIN_TRIALS_PER_TASK
    assert plan.covers_every_task


def test_weight_and_memory_traffic_count_in_the_estimate():
    # A memory-bound reduction that runs 12 times outweighs a compute-bound kernel that runs once.
    pool = FakeTask("pool", flops=1e6, nbytes=50_000_000, weight=12)
    conv = FakeTask("conv", flops=1e9)
    assert estimated_seconds(pool) > estimated_seconds(conv)
    assert list(plan_trials([conv, pool], 40).trials) == ["pool", "conv"]


def test_a_budget_below_the_floor_is_spread_heaviest_first_and_says_what_would_cover_all():
    tasks = [FakeTask(f"t{i}", flops=(i + 1) * 1e8) for i in range(10)]
    plan = plan_trials(tasks, 13)
    assert plan.covers_every_task and sum(plan.trials.values()) == 13
    assert [plan.trials[f"t{i}"] for i in (9, 8, 7, 6)] == [2, 2, 2, 1]
    text = plan.describe(tasks)
    assert f"{MIN_TRIALS_PER_TASK * 10} trials would give every task {MIN_TRIALS_PER_TASK}" in text
    assert "no trial" not in text

    plan = plan_trials(tasks, 3)  # fewer trials than tasks: the three heaviest get one each
    assert [tid for tid, n in plan.trials.items() if n] == ["t9", "t8", "t7"]
    assert "7 task(s) get no trial" in plan.describe(tasks)


def test_the_expected_time_counts_only_what_is_not_yet_measured():
    tasks = [FakeTask("a", 1e9), FakeTask("b", 1e8)]
    plan = plan_trials(tasks, 600)
    assert f"about {(600 * SECONDS_PER_TRIAL + 2 * SEARCH_SECONDS_PER_TASK) / 60:.0f} min" in plan.describe(tasks)
    done = {"a": plan.trials["a"], "b": 1}
    assert plan.remaining(done) == {"a": 0, "b": plan.trials["b"] - 1}
    text = plan.describe(tasks, done)
    assert f"{plan.trials['a'] + 1} already measured" in text
    # only b is left to search
    assert f"about {((plan.trials['b'] - 1) * SECONDS_PER_TRIAL + SEARCH_SECONDS_PER_TASK) / 60:.0f} min" in text


def test_the_expected_time_counts_each_task_search():
    # 50 tasks at 8 trials: the searches take longer than the trials (mobilenet_v3_small on Zen 3).
    tasks = [FakeTask(f"t{i}", 1e8) for i in range(50)]
    text = plan_trials(tasks, 400).describe(tasks)
    assert f"about {(400 + 50 * 15) / 60:.0f} min" in text and "15 s of search a task" in text


@pytest.mark.parametrize("budget", [0, -1, 2.5, True])
def test_a_bad_budget_is_one_line(budget):
    with pytest.raises(CwmError, match="positive integer"):
        plan_trials([FakeTask("a", 1.0)], budget)


def test_four_trials_per_task_reach_every_task(tmp_path, capsys):
    """The failure this fixes: one search batch of 32 spent the whole budget on the first tasks."""
    from cwm.tuning import tune
    from cwm.tuning.collect import existing_counts
    from cwm.workloads import get_task

    tasks = [get_task(n) for n in ("matmul:M=32,N=32,K=32", "dense_relu:M=16,N=32,K=32", "softmax:M=32,N=64")]
    budget = MIN_TRIALS_PER_TASK * len(tasks)
    result = tune(tasks, trials=budget, work_dir=tmp_path, cost_model="random", num_trials_per_iter=32)
    counts = existing_counts(tmp_path)
    assert all(counts.get(t.id, 0) >= 1 for t in tasks), counts
    assert all(t.id in result.best for t in tasks)
    assert sum(counts.values()) <= budget
    assert "3 task(s) share 12 trials" in capsys.readouterr().err
    # Resumed with a larger budget: only each task's new share is measured, and the plan says so.
    tune(tasks, trials=2 * budget, work_dir=tmp_path, cost_model="random")
    assert f"{sum(counts.values())} already measured" in capsys.readouterr().err
    assert sum(existing_counts(tmp_path).values()) <= 2 * budget
    assert min(existing_counts(tmp_path).values()) >= MIN_TRIALS_PER_TASK


def test_transferred_schedules_are_measured_first_from_the_tasks_budget(tmp_path):
    """A task no one tuned starts from the best schedules of the most similar training tasks of the
    world model, refitted to its loops and measured before the search's own candidates."""
    from cwm.data.database import RECORD_FILE
    from cwm.model.world_model import default_model_dir
    from cwm.schedule.transfer import TRANSFER_CANDIDATES, TransferSource, refit_tiling
    from cwm.tuning import tune
    from cwm.tuning.collect import existing_counts
    from cwm.workloads import get_task

    assert refit_tiling(24, [1, 4, 8]) == [1, 3, 8] and refit_tiling(7, [2, 2]) == [7, 1]
    task = get_task("dense_relu:M=16,N=32,K=32")  # not in the shipped model's training tasks
    source = TransferSource.for_model(default_model_dir())
    assert task.id not in {e["id"] for e in source.entries}
    assert len(source.schedules(task, "znver5")) == TRANSFER_CANDIDATES
    result = tune(task, trials=TRANSFER_CANDIDATES + 1, work_dir=tmp_path, cost_model="random", progress=False,
                  transfer=True)
    assert result.transferred == {task.id: TRANSFER_CANDIDATES}
    assert existing_counts(tmp_path) == {task.id: TRANSFER_CANDIDATES + 1}
    records = (tmp_path / RECORD_FILE).read_text().splitlines()
    assert len(records) == TRANSFER_CANDIDATES + 1
    # Each stored trace marks where postprocessing began, as MetaSchedule's own candidates do: the
    # evolutionary search replays stored traces without the postprocessors' instructions, and a seed's
    # RewriteLayout replayed onto its mutants failed a TransformLayout check in TVM.
    assert all('"EnterPostproc"' in line for line in records)


def test_a_schedule_transfers_to_the_same_computation_under_other_block_names():
    """Relax names a fused task's blocks after its variables, so the same computation in another network
    has other block names: the trace is replayed with its blocks mapped by position."""
    import tvm
    from tvm import s_tir

    from cwm.schedule.actions import trace_to_json
    from cwm.schedule.tir import buffer_shapes
    from cwm.schedule.transfer import TransferSource, block_names
    from cwm.workloads import Task, get_task

    source = get_task("dense_relu:M=16,N=32,K=64")
    sch = s_tir.Schedule(source.mod)
    names = block_names(sch)
    assert len(names) >= 2
    block = sch.get_sblock(names[0])
    i, j, k = sch.get_loops(block)
    sch.split(j, factors=[None, 8])
    sch.parallel(i)
    entry = {"id": source.id, "name": source.name, "kind": source.kind,
             "shapes": [list(s) for s in buffer_shapes(source.mod)], "script": source.mod.script(),
             "bests": {"znver5": [{"latency": 1e-6, "trace": trace_to_json(sch.trace)}]}}

    text = get_task("dense_relu:M=32,N=32,K=64").mod.script()  # another shape: another task
    for n in names:
        text = text.replace(f'"{n}"', f'"{n}_elsewhere"')
    target = Task("net/dense_relu_elsewhere", tvm.script.from_source(text), kind=source.kind)
    assert block_names(s_tir.Schedule(target.mod)) == [f"{n}_elsewhere" for n in names]
    got = TransferSource([entry]).schedules(target, "znver5", 1)
    assert len(got) == 1
    loops = [int(got[0].get(x).extent) for x in got[0].get_loops(got[0].get_sblock(f"{names[0]}_elsewhere"))]
    assert 8 in loops  # the split of the source schedule, on the renamed block


def test_a_task_tuned_earlier_in_the_run_lends_its_best_schedule_first(tmp_path):
    """The tasks of one network share layouts and fused epilogues that the training tasks may lack: a
    tuned task's best schedule comes first for the similar tasks after it (what transfer-coverage counts)."""
    from cwm.model.world_model import default_model_dir
    from cwm.schedule.transfer import TransferSource
    from cwm.tuning import tune
    from cwm.workloads import get_task

    heavy, light = get_task("dense_relu:M=64,N=64,K=64"), get_task("dense_relu:M=32,N=64,K=64")
    result = tune(heavy, trials=2, work_dir=tmp_path / "a", cost_model="random", progress=False)
    best = result.best[heavy.id]

    source = TransferSource.for_model(default_model_dir())
    assert not any(e.get("this_run") for _, e in source.similar(light))
    source.add_tuned(heavy, "znver5", best["latency"], best["trace"])
    nearest = source.similar(light)
    assert nearest[0][1]["id"] == heavy.id  # before every training task
    assert len(source.schedules(light, "znver5", 1)) == 1


def test_with_transfer_a_tuned_task_seeds_the_similar_tasks_tuned_after_it(tmp_path):
    """In-run transfer: with a model that carries no schedules, only the run's own tasks can lend."""
    from cwm.tuning import tune
    from cwm.workloads import get_task

    heavy, light = get_task("dense_relu:M=64,N=64,K=64"), get_task("dense_relu:M=32,N=64,K=64")
    no_schedules = tmp_path / "model"
    no_schedules.mkdir()
    result = tune([heavy, light], trials=8, work_dir=tmp_path / "db", cost_model="random", progress=False,
                  report=False, transfer=no_schedules)
    assert result.transferred == {heavy.id: 0, light.id: 1}  # the heavier one is tuned first and lends
    assert set(result.best) == {heavy.id, light.id}


def test_transfer_coverage_counts_the_tasks_a_trace_reaches(tmp_path, monkeypatch):
    import cwm.workloads
    from cwm.benchmarks.transfer import transfer_coverage, write_coverage
    from cwm.model.world_model import default_model_dir
    from cwm.tuning import tune
    from cwm.workloads import get_task

    tasks = [get_task("dense_relu:M=64,N=64,K=64"), get_task("dense_relu:M=32,N=64,K=64"),
             get_task("softmax:M=32,N=64")]
    monkeypatch.setattr(cwm.workloads, "network_tasks", lambda name: tasks)
    tune(tasks[:1], trials=2, work_dir=tmp_path / "db", cost_model="random", progress=False)
    report = transfer_coverage("toy", default_model_dir(), tmp_path / "db", machine="znver5")
    rows = {r["task"]: r for r in report["rows"]}
    assert [r["task"] for r in report["rows"]][0] == tasks[0].name  # heaviest first
    assert rows[tasks[1].name]["in_run"] and not rows[tasks[0].name]["in_run"]  # lent by the tuned heavier one
    assert not rows[tasks[2].name]["in_run"]  # another kind
    assert report["in_run"] == 1 and report["either"] >= report["from_model"]
    assert "| toy |" in write_coverage([report], tmp_path / "out").read_text()
