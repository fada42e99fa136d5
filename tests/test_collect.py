import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cwm.tuning.collect import collect, existing_counts
from cwm.data.database import RECORD_FILE, WORKLOAD_FILE, load_raw, open_database
from cwm.data.dataset import load_dataset

from .conftest import TINY


def test_collect_tiny_task(tiny_db, tiny_task):
    raw = load_raw(tiny_db)
    assert len(raw.records) == 16
    assert sum(r.valid for r in raw.records) >= 12
    assert existing_counts(tiny_db) == {tiny_task.id: 16}
    manifest = json.loads((tiny_db / "manifest.json").read_text())
    assert manifest["target"]["kind"] == "llvm" and manifest["hardware"]["cores"] >= 1
    stats = load_dataset(tiny_db).stats()
    assert stats["records"] == 16 and stats["tasks"] == 1
    assert stats["per_task"][tiny_task.id]["spread"] >= 1.0


def test_collect_resumes_and_never_exceeds_the_goal(tmp_path, tiny_task):
    collect([tiny_task], tmp_path, n_random=8, n_evolutionary=0, batch=8, progress=False)
    assert existing_counts(tmp_path)[tiny_task.id] == 8
    report = collect([tiny_task], tmp_path, n_random=8, n_evolutionary=8, batch=8, progress=False)
    assert report.measured == 8
    assert existing_counts(tmp_path)[tiny_task.id] == 16
    report = collect([tiny_task], tmp_path, n_random=8, n_evolutionary=8, batch=8, progress=False)
    assert report.measured == 0


def test_killed_collect_loses_nothing_and_resumes(tmp_path):
    cmd = [sys.executable, "-m", "cwm", "collect", TINY, "--db", str(tmp_path), "--random", "24",
           "--evolutionary", "0", "--batch", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rec = tmp_path / RECORD_FILE
    deadline = time.time() + 240
    while time.time() < deadline:
        if rec.exists() and rec.read_text().count("\n") >= 8:
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = load_raw(tmp_path)
    assert 8 <= len(before.records) < 24
    # Simulate a torn last line from a kill in the middle of a write.
    with open(rec, "a") as f:
        f.write('[0, [[["GetSBlock"')
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    after = load_raw(tmp_path)
    assert after.skipped_lines == 0
    assert len(after.records) == 24
    traces = [json.dumps(r.trace_json) for r in before.records]
    assert [json.dumps(r.trace_json) for r in after.records[: len(traces)]] == traces


def test_corrupt_lines_are_skipped_with_a_count(tiny_db, tmp_path, caplog):
    import shutil

    db = tmp_path / "db"
    shutil.copytree(tiny_db, db)
    lines = (db / RECORD_FILE).read_text().splitlines()
    lines.insert(3, "this is not json")
    lines.insert(7, "[99, [[], null]]")
    lines.append(lines[0][: len(lines[0]) // 2])
    (db / RECORD_FILE).write_text("\n".join(lines) + "\n")
    raw = load_raw(db)
    assert raw.skipped_lines == 3
    assert len(raw.records) == 16
    assert "skipped 3 corrupt line(s)" in caplog.text
    ds = load_dataset(db)
    assert ds.stats()["skipped_lines"] == 3
    open_database(db)  # repairs so MetaSchedule's own loader accepts it
    assert load_raw(db).skipped_lines == 0


def test_missing_database_is_a_clear_error(tmp_path):
    from cwm.errors import CwmError

    with pytest.raises(CwmError, match="does not exist"):
        load_dataset(tmp_path / "nope")
    with pytest.raises(CwmError, match=WORKLOAD_FILE):
        load_dataset(tmp_path)


def _gather_task():
    """An embedding lookup, as BERT's first kernel: a random index would read outside the table."""
    import tvm
    from tvm import te

    from cwm.workloads import Task

    table = te.placeholder((1000, 64), name="table")
    ids = te.placeholder((128,), dtype="int64", name="ids")
    out = te.compute((128, 64), lambda i, j: table[ids[i], j], name="gather")
    return Task(name="gather", mod=tvm.IRModule({"main": te.create_prim_func([table, ids, out])}))


def test_runner_arguments_keep_indices_in_range():
    import numpy as np
    import tvm

    from cwm.tuning.measure import alloc_arguments

    (ints, floats), = alloc_arguments(tvm.cpu(), [["TENSOR", "int64", [4096]], ["TENSOR", "float32", [4096]]], 1)
    assert not np.any(ints.numpy()) and np.ptp(floats.numpy()) > 0


def test_a_gather_is_measured(tmp_path):
    from cwm.tuning.tuner import tune

    task = _gather_task()
    result = tune(task, trials=2, work_dir=tmp_path, cost_model="random", num_trials_per_iter=2,
                  progress=False, report=False)
    assert task.id in result.best and result.best[task.id]["latency"] < 1e-2
    assert not (tmp_path / "failures.jsonl").exists() or not (tmp_path / "failures.jsonl").read_text().strip()
