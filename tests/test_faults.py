"""Faults: processes killed mid-run, builds and runs that crash or hang, corrupted caches and files,
and determinism under a fixed seed.

The kill -9 resume test of ``collect`` is in test_collect.py. Training data here is a synthetic
database (real candidates of three tiny tasks, made-up latencies) so that nothing but the tune
tests has to measure.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cwm.errors import CwmError

from .conftest import TINY

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = [TINY, "dense_relu:M=16,N=32,K=32", "softmax:M=32,N=64"]


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TVM_NUM_THREADS": "2"}


def _popen(args, log: Path):
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "cwm", *map(str, args)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=_env())


def _kill(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _run(args, log: Path, timeout=600):
    with open(log, "a") as out:
        proc = subprocess.run([sys.executable, "-m", "cwm", *map(str, args)], stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, env=_env())
    assert proc.returncode == 0, log.read_text()[-3000:]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _leftovers(directory: Path) -> list[Path]:
    """Temporary files and directories of the atomic writers (``.<name>.tmp<pid>``, ``.<name>.old<pid>``)."""
    return [p for p in directory.rglob(".*") if ".tmp" in p.name or ".old" in p.name]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """A database of 10 sampled candidates for each of three tiny tasks with made-up latencies,
    and a split (two tasks train, one val/test). Written without building or running anything."""
    import tvm.s_tir.meta_schedule as ms

    from cwm.tuning.context import tune_context
    from cwm.data.database import open_database
    from cwm.data.database import write_task_index
    from cwm.hardware import make_target
    from cwm.workloads import get_task

    root = tmp_path_factory.mktemp("synthetic")
    target = make_target()
    db = open_database(root / "db")
    tasks = [get_task(s) for s in SYNTHETIC]
    rng = random.Random(0)
    for i, task in enumerate(tasks):
        ctx = tune_context(task, target, "replay-trace", i, num_threads=1)
        ctx.pre_tuning(max_trials=10, num_trials_per_iter=10, design_spaces=ctx.generate_design_space())
        workload = db.commit_workload(task.mod)
        for cand in ctx.generate_measure_candidates():
            base = rng.uniform(1e-5, 1e-4)
            db.commit_tuning_record(ms.database.TuningRecord(cand.sch.trace, workload, [base, base * 1.01, base * 0.99],
                                                             target, cand.args_info))
        ctx.post_tuning()
    write_task_index(root / "db", tasks)
    split = {"train": [tasks[0].id, tasks[1].id], "val": [tasks[2].id], "test": [tasks[2].id]}
    (root / "split.json").write_text(json.dumps(split))
    return root / "db", root / "split.json", tasks


def _record_keys(db_dir):
    from cwm.schedule.actions import trace_key
    from cwm.data.database import load_raw, task_ids

    raw = load_raw(db_dir)
    ids = task_ids(raw)
    return [(ids[r.workload_index], trace_key(r.trace_json)) for r in raw.records], raw


# -- tune killed mid-run ----------------------------------------------------------------------


def test_killed_tune_resumes_without_duplicates_or_temp_files(tmp_path):
    from cwm.data.database import RECORD_FILE

    work = tmp_path / "tune"
    args = ["tune", TINY, "--trials", "8", "--per-iter", "4", "--cost-model", "xgb", "--work-dir", work]
    seed = random.randrange(1 << 30)
    delay = random.Random(seed).uniform(0.0, 3.0)
    proc = _popen(args, tmp_path / "first.log")
    rec = work / RECORD_FILE
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if rec.exists() and rec.read_text().count("\n") >= 4:  # the first batch is committed
            break
        time.sleep(0.2)
    time.sleep(delay)  # then a random point in the rest of the run (kill seed {seed})
    _kill(proc)
    before, raw = _record_keys(work)
    assert len(before) >= 4, (tmp_path / "first.log").read_text()[-3000:]
    # A kill that lands after the last record (the process still writing its report) leaves a finished
    # run: the resume below must then measure nothing new. Otherwise it completes the run.
    # What a kill in the middle of a write leaves: a torn last record line and a temporary file.
    with open(rec, "a") as f:
        f.write('[0, [[["GetSBlock"')
    stale = work / f".tasks.json.tmp{_dead_pid()}"
    stale.write_text('{"half": ')

    _run(args, tmp_path / "second.log")
    after, raw = _record_keys(work)
    assert raw.skipped_lines == 0  # the torn line was repaired away
    assert len(after) == 8, f"kill seed {seed}: {len(before)} records before the kill, {len(after)} after"
    assert len(set(after)) == len(after), f"kill seed {seed}: a candidate was measured twice"
    assert after[: len(before)] == before  # everything measured before the kill is kept, in order
    assert _leftovers(work) == []
    report = json.loads((work / "report.json").read_text())
    assert report["best"] and len(report["tasks"]) == 1


def test_resumed_search_never_proposes_a_measured_candidate():
    """What makes the resume above duplicate-free, without measuring: MetaSchedule's searches do not
    consult the database, so the same seed proposes the same first batch again; with the measured
    traces given to ``tune_context`` none of them comes back."""
    import tvm.s_tir.meta_schedule as ms

    from cwm.schedule.actions import trace_to_json
    from cwm.schedule.actions import trace_key
    from cwm.tuning.context import tune_context
    from cwm.hardware import make_target
    from cwm.workloads import get_task

    task, target = get_task(TINY), make_target()

    def first_batch(measured=None):
        ctx = tune_context(task, target, "replay-trace", 7, num_threads=1, measured=measured)
        ctx.pre_tuning(max_trials=64, num_trials_per_iter=8, design_spaces=ctx.generate_design_space(),
                       database=ms.database.MemoryDatabase(), cost_model=ms.cost_model.RandomModel(seed=7))
        keys = [trace_key(trace_to_json(c.sch.trace)) for c in ctx.generate_measure_candidates()]
        ctx.post_tuning()
        return keys

    first = first_batch()
    assert first_batch() == first  # without the measured set: the very same candidates again
    again = first_batch(measured=set(first))
    assert len(again) == 8 and not set(again) & set(first)


# -- train killed mid-run, and a save killed half-way --------------------------------------------


def _old_model(path: Path) -> str:
    from cwm.model.world_model import CONFIG_FILE, default_model_dir

    shutil.copytree(default_model_dir(), path)
    cfg = json.loads((path / CONFIG_FILE).read_text())
    cfg["metrics"] = {"marker": "old"}
    (path / CONFIG_FILE).write_text(json.dumps(cfg))
    return (path / CONFIG_FILE).read_text()


def _state_of(path: Path, old_config: str, db) -> str:
    from cwm.model.world_model import CONFIG_FILE, WorldModel

    if not path.exists():
        return "absent"
    WorldModel.load(path)  # complete: every file is there and matches
    if (path / CONFIG_FILE).read_text() == old_config:
        return "old"
    assert json.loads((path / CONFIG_FILE).read_text())["trained_on"]["database"] == str(db)
    assert (path / "train_report.json").exists()
    return "new"


def test_killed_train_leaves_the_old_or_the_new_model_never_a_mix(synthetic, tmp_path):
    db, split, _ = synthetic
    out = tmp_path / "model"
    old_config = _old_model(out)
    args = ["train", "--db", db, "--split", split, "--out", out, "--tiny"]
    seed = random.randrange(1 << 30)
    proc = _popen(args, tmp_path / "train.log")
    time.sleep(random.Random(seed).uniform(0.5, 6.0))  # a run takes ~5 s here
    _kill(proc)
    assert _state_of(out, old_config, db) in ("absent", "old", "new"), f"kill seed {seed}"
    _run(args, tmp_path / "train.log")
    assert _state_of(out, old_config, db) == "new"
    assert _leftovers(tmp_path) == []


def test_save_killed_half_way_keeps_the_old_model(tmp_path):
    """Deterministic version of the window the random kill above rarely hits: SIGKILL after the
    encoder, transition and ranker files are written, before the config."""
    from cwm.model.world_model import WorldModel

    out = tmp_path / "model"
    old_config = _old_model(out)
    script = (
        "import os, signal\n"
        "from cwm.model.ranker import LambdaRanker\n"
        "from cwm.model.world_model import WorldModel\n"
        "real = LambdaRanker.save\n"
        "def dying_save(self, path):\n"
        "    real(self, path)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "LambdaRanker.save = dying_save\n"
        f"WorldModel.load().save({str(out)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert _state_of(out, old_config, None) == "old"
    half = _leftovers(tmp_path)
    assert len(half) == 1 and (half[0] / "ranker").is_dir() and not (half[0] / "world_model.json").exists()
    WorldModel.load().save(out)  # the next save replaces the model and clears the killed one's leftovers
    assert (out / "world_model.json").read_text() != old_config
    WorldModel.load(out)
    assert _leftovers(tmp_path) == []


# -- builds and runs that crash, hang or segfault ---------------------------------------------------


def test_crashing_builds_and_hanging_runs_are_recorded_and_tuning_goes_on(tmp_path, monkeypatch):
    """A builder whose f_build raises or hangs past its timeout and a runner whose evaluator
    segfaults or hangs past its timeout, for a deterministic share of the candidates."""
    import tvm.s_tir.meta_schedule as ms

    import cwm.tuning.tuner
    from cwm.data.dataset import load_dataset
    from cwm.tuning.measure import EvaluatorSettings
    from cwm.tuning.tuner import tune

    counters = tmp_path / "counters"
    counters.mkdir()

    def claim(kind: str) -> int:
        """The index of this call among all processes (a file per call, created exclusively)."""
        i = 0
        while True:
            try:
                os.close(os.open(os.path.join(str(counters), f"{kind}{i}"), os.O_CREAT | os.O_EXCL))
                return i
            except FileExistsError:
                i += 1

    def flaky_build(mod, target, params):
        import time

        from cwm.tuning.measure import build_without_tensor_intrin

        i = claim("build")
        if i % 4 == 0:
            raise RuntimeError("injected build crash")
        if i % 4 == 1:
            time.sleep(120)  # killed by the builder's timeout
        return build_without_tensor_intrin(mod, target, params)

    def flaky_run(rt_mod, device, evaluator_config, repeated_args):
        import os
        import signal
        import time

        from tvm.s_tir.meta_schedule.runner.local_runner import default_run_evaluator

        i = claim("run")
        if i % 4 == 0:
            os.kill(os.getpid(), signal.SIGSEGV)
        if i % 4 == 1:
            time.sleep(120)  # killed by the runner's timeout
        return default_run_evaluator(rt_mod, device, evaluator_config, repeated_args)

    monkeypatch.setattr(cwm.tuning.tuner, "make_builder",
                        lambda: ms.builder.LocalBuilder(max_workers=2, timeout_sec=12.0, f_build=flaky_build))
    monkeypatch.setattr(cwm.tuning.tuner, "make_runner",
                        lambda settings, rpc: ms.runner.LocalRunner(timeout_sec=12.0, f_run_evaluator=flaky_run,
                                                                    evaluator_config=EvaluatorSettings().config()))
    work = tmp_path / "tune"
    result = tune(TINY, trials=8, work_dir=work, cost_model="random", num_trials_per_iter=4, progress=False)
    assert result.trials == 8  # both batches ran: the failures of the first did not stop the search
    failures = [json.loads(line) for line in (work / "failures.jsonl").read_text().splitlines()]
    kinds = [row["error_kind"] for row in failures]
    assert sorted(kinds) == sorted(["build_error"] * 2 + ["build_timeout"] * 2 + ["run_error", "run_timeout"]), failures
    assert all(row["message"] and row["trace"] for row in failures)
    assert any("injected build crash" in row["message"] for row in failures if row["error_kind"] == "build_error")
    assert any("Timeout" in row["message"] for row in failures if row["error_kind"].endswith("timeout"))
    stats = load_dataset(work).stats()  # the database holds every candidate, failed ones with their kind
    assert stats["records"] == 8 and stats["valid"] == 2
    assert stats["failure_kinds"] == {"build_error": 2, "build_timeout": 2, "run_error": 1, "run_timeout": 1}
    assert result.best  # the two good candidates were measured


# -- corrupted caches and files ------------------------------------------------------------------------


def test_corrupt_encoder_cache_entries_are_rebuilt(tmp_path):
    from cwm.model.encoder import StateEncoder
    from cwm.workloads import get_task
    from cwm.model.world_model import default_model_dir

    texts = [get_task(s).script() for s in SYNTHETIC]
    enc = StateEncoder.load(default_model_dir() / "encoder", cache_dir=tmp_path / "cache")
    first = enc.encode(texts)
    path = enc._cache_path(enc._prepare(texts[0]))
    size = path.stat().st_size
    rng = np.random.default_rng(0)
    for damage in (b"", path.read_bytes()[: size // 2], rng.standard_normal(size // 4).astype(np.float32).tobytes(),
                   np.full(size // 4, np.nan, np.float32).tobytes()):
        path.write_bytes(damage)  # empty, truncated, garbage of the right size, NaN
        assert np.array_equal(enc.encode(texts), first)
        assert path.read_bytes() == first[0].tobytes()  # rewritten
    path.unlink()
    path.mkdir()  # not even a file: encoding still works (the entry cannot be rewritten)
    assert np.array_equal(enc.encode(texts), first)


def test_corrupt_state_cache_entry_is_replayed(synthetic, tmp_path):
    from cwm.data.dataset import load_dataset

    db, _, _ = synthetic
    ds = load_dataset(db, cache_dir=tmp_path / "states")
    traj = next(t for t in ds.trajectories if len(t.ir_steps) >= 1)
    text = ds.final_state(traj)
    (entry,) = list((tmp_path / "states").rglob("*.tir"))
    entry.write_bytes(b"\xff\xfe\x00garbage")  # not text
    fresh = load_dataset(db, cache_dir=tmp_path / "states")
    traj = fresh.trajectories[traj.record_index]
    assert fresh.final_state(traj) == text
    assert entry.read_text() == text


def test_truncated_database_lines(synthetic, tmp_path, caplog):
    from cwm.data.database import RECORD_FILE, WORKLOAD_FILE, load_raw, open_database
    from cwm.data.dataset import load_dataset

    db = tmp_path / "db"
    shutil.copytree(synthetic[0], db)
    # A workload line cut in half: its records are skipped, each named by file and line.
    lines = (db / WORKLOAD_FILE).read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]
    (db / WORKLOAD_FILE).write_text("\n".join(lines) + "\n")
    raw = load_raw(db)
    assert raw.skipped_lines == 1 + 10
    assert raw.skipped_detail[0].startswith(f"{WORKLOAD_FILE}:2:")
    assert any(d.startswith(f"{RECORD_FILE}:") and "corrupt workload" in d for d in raw.skipped_detail)
    assert len(load_dataset(db).trajectories) == 20
    open_database(db)  # repaired so that MetaSchedule's loader accepts it
    assert load_raw(db).skipped_lines == 0 and len(load_raw(db).records) == 20
    # Every workload line torn: a clear error naming the file, not an empty database.
    (db / WORKLOAD_FILE).write_text("\n".join(line[:20] for line in lines) + "\n")
    with pytest.raises(CwmError, match=f"{WORKLOAD_FILE} is not a MetaSchedule workload file"):
        load_dataset(db)


def test_truncated_weights_name_the_file(tmp_path):
    from cwm.model.world_model import WorldModel, default_model_dir

    for rel in ("encoder/encoder.safetensors", "transition/transition.safetensors", "ranker/ranker.json",
                "encoder/tokenizer.json"):
        model = tmp_path / rel.replace("/", "_")
        shutil.copytree(default_model_dir(), model)
        data = (model / rel).read_bytes()
        (model / rel).write_bytes(data[: len(data) // 2])
        with pytest.raises(CwmError) as info:
            WorldModel.load(model)
        assert str(model / rel) in str(info.value)


# -- determinism --------------------------------------------------------------------------------------


def test_fixed_seed_same_world_model_predictions(synthetic, tmp_path):
    from cwm.data.dataset import load_dataset
    from cwm.data.split import load_split
    from cwm.model.training import TrainSettings, train
    from cwm.model.world_model import WorldModel

    db, split, tasks = synthetic
    a, _ = train(db, load_split(split), tmp_path / "a", TrainSettings.tiny(), progress=False)
    b, _ = train(db, load_split(split), tmp_path / "b", TrainSettings.tiny(), progress=False)
    ds = load_dataset(db)
    tid = tasks[2].id  # the held-out task
    actions = [t.actions for t in ds.by_task[tid]]
    pa = a.predict(ds.initial_states[tid], actions, ds.hardware)
    assert np.array_equal(pa, b.predict(ds.initial_states[tid], actions, ds.hardware))
    loaded = WorldModel.load(tmp_path / "a")  # and through a save and a load
    assert np.array_equal(pa, loaded.predict(ds.initial_states[tid], actions, ds.hardware))
    assert np.array_equal(pa, WorldModel.load(tmp_path / "a").predict(ds.initial_states[tid], actions, ds.hardware))


@pytest.mark.parametrize("strategy", ["replay-trace", "evolutionary"])
def test_fixed_seed_same_first_batch_of_candidates(strategy):
    """A seed gives the same first batch from the design-space sampler (replay-trace) and from
    evolutionary search (random cost model) with one search thread. With several threads neither
    is deterministic in TVM 0.27: each thread has its own random stream and takes work items
    dynamically, so which thread samples which candidate, and the batch, vary from run to run
    (seen with 2 threads for both strategies); the tuning commands use all physical cores, so a
    rerun of ``cwm tune`` with the same seed is not expected to repeat its candidates."""
    threads = 1
    import tvm.s_tir.meta_schedule as ms

    from cwm.schedule.actions import trace_to_json
    from cwm.schedule.actions import trace_key
    from cwm.tuning.context import tune_context
    from cwm.hardware import make_target
    from cwm.workloads import get_task

    task, target = get_task(TINY), make_target()

    def first_batch(seed):
        ctx = tune_context(task, target, strategy, seed, num_threads=threads)
        ctx.pre_tuning(max_trials=64, num_trials_per_iter=8, design_spaces=ctx.generate_design_space(),
                       database=ms.database.MemoryDatabase(), cost_model=ms.cost_model.RandomModel(seed=seed))
        keys = [trace_key(trace_to_json(c.sch.trace)) for c in ctx.generate_measure_candidates()]
        ctx.post_tuning()
        return keys

    first = first_batch(3)
    assert len(first) == 8
    assert first_batch(3) == first
    assert first_batch(4) != first
