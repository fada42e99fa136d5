"""Measurement through TVM's RPC tracker, on loopback only."""

import time

import pytest

from cwm.errors import CwmError
from cwm.tuning.measure import RPCAddress


@pytest.fixture(scope="module")
def rpc_farm():
    from tvm import rpc
    from tvm.rpc.tracker import Tracker

    tracker = Tracker(host="127.0.0.1", port=9190, port_end=9290, silent=True)
    servers = [
        rpc.Server(host="127.0.0.1", port=9300, port_end=9400, key="cwm-test",
                          tracker_addr=("127.0.0.1", tracker.port), silent=True)
        for _ in range(2)
    ]
    address = RPCAddress("127.0.0.1", tracker.port, "cwm-test")
    deadline = time.time() + 30
    while address.server_count() < 2 and time.time() < deadline:  # servers register asynchronously
        time.sleep(0.2)
    yield address
    for s in servers:
        s.terminate()
    tracker.terminate()


def test_collect_through_rpc(tmp_path, tiny_task, rpc_farm):
    from cwm.tuning.collect import collect
    from cwm.data.database import load_raw

    report = collect([tiny_task], tmp_path, n_random=4, n_evolutionary=0, batch=4, rpc=rpc_farm, progress=False)
    assert report.measured == 4
    raw = load_raw(tmp_path)
    assert sum(r.valid for r in raw.records) == 4


def test_tune_through_rpc_with_two_servers(tmp_path, tiny_task, rpc_farm):
    from cwm.tuning.tuner import tune

    result = tune(tiny_task, trials=8, work_dir=tmp_path, cost_model="random", rpc=rpc_farm,
                  num_trials_per_iter=8, progress=False)
    assert result.trials == 8
    assert tiny_task.id in result.best


def test_a_gather_is_measured_through_rpc(tmp_path, rpc_farm):
    from cwm.tuning.tuner import tune

    from .test_collect import _gather_task

    task = _gather_task()
    result = tune(task, trials=2, work_dir=tmp_path, cost_model="random", rpc=rpc_farm, num_trials_per_iter=2,
                  progress=False, report=False)
    assert task.id in result.best and result.best[task.id]["latency"] < 1e-2


def test_parallel_collect_through_rpc_merges_shards(tmp_path, rpc_farm):
    from cwm.tuning.collect import SHARD_DIR, collect, existing_counts, measured_trace_keys
    from cwm.workloads import get_task

    tasks = [get_task("matmul:M=32,N=32,K=32"), get_task("matmul:M=16,N=32,K=64")]
    report = collect(tasks, tmp_path, n_random=4, n_evolutionary=0, batch=4, rpc=rpc_farm, jobs=2, progress=False)
    assert report.measured == 8
    assert existing_counts(tmp_path) == {t.id: 4 for t in tasks}
    assert not (tmp_path / SHARD_DIR).exists() or not any((tmp_path / SHARD_DIR).iterdir())
    keys = measured_trace_keys(tmp_path)
    assert all(len(keys[t.id]) == 4 for t in tasks)  # no duplicates
    # A finished collection is a no-op when re-run in parallel.
    again = collect(tasks, tmp_path, n_random=4, n_evolutionary=0, batch=4, rpc=rpc_farm, jobs=2, progress=False)
    assert again.measured == 0 and existing_counts(tmp_path) == {t.id: 4 for t in tasks}


def test_parallel_collect_needs_rpc(tmp_path):
    from cwm.tuning.collect import collect
    from cwm.workloads import get_task

    with pytest.raises(CwmError, match="RPC"):
        collect([get_task("matmul:M=32,N=32,K=32")], tmp_path, n_random=2, n_evolutionary=0, jobs=2)


def test_merge_database_adds_only_missing_records(tmp_path, tiny_db):
    import shutil

    from cwm.data.database import load_raw, merge_database
    from cwm.data.database import read_task_index

    dst = tmp_path / "dst"
    shutil.copytree(tiny_db, dst)
    n = len(load_raw(dst).records)
    assert merge_database(tiny_db, dst) == 0
    assert merge_database(tiny_db, tmp_path / "fresh") == n
    assert len(load_raw(tmp_path / "fresh").records) == n
    assert read_task_index(tmp_path / "fresh") == read_task_index(tiny_db)  # names and kinds kept


def test_rpc_runner_measures_on_every_server(rpc_farm):
    from cwm.tuning.measure import make_runner

    assert rpc_farm.server_count() == 2
    assert make_runner(rpc=rpc_farm).pool._threadpool._max_workers == 2
    with pytest.raises(CwmError, match="no RPC server"):
        make_runner(rpc=RPCAddress(rpc_farm.host, rpc_farm.port, "no-such-key"))


def test_unreachable_tracker():
    with pytest.raises(CwmError, match="unreachable"):
        RPCAddress("127.0.0.1", 1, "x").check_reachable(timeout=1)


@pytest.mark.parametrize("spec", ["nohost", "host:port:key", ":9190:key", "h:9190:"])
def test_bad_rpc_spec(spec):
    with pytest.raises(CwmError):
        RPCAddress.parse(spec)


def _named_matmul_db(db_dir, prefix: str, tiles):
    """A database of one 16x16 matmul whose block is named ``<prefix>_matmul``, one record per tile."""
    import tvm
    import tvm.s_tir.meta_schedule as ms
    from tvm import te
    from tvm.s_tir import Schedule

    from cwm.data.database import open_database

    a = te.placeholder((16, 16), name="a")
    b = te.placeholder((16, 16), name="b")
    k = te.reduce_axis((0, 16), name="k")
    c = te.compute((16, 16), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name=f"{prefix}_matmul")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b, c]).with_attr("global_symbol", "main")})
    db = open_database(db_dir)
    workload = db.commit_workload(mod)
    target = tvm.target.Target({"kind": "llvm"})
    for tile in tiles:
        sch = Schedule(mod)
        i, _, _ = sch.get_loops(sch.get_sblock(f"{prefix}_matmul"))
        sch.split(i, [None, tile])
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [1e-3 * tile], target,
                                                         ms.arg_info.ArgInfo.from_prim_func(mod["main"])))
    return mod


def test_merge_keeps_equal_workloads_with_other_block_names_apart(tmp_path):
    """Structural equality ignores block names, but traces address blocks by name: merging the
    records of one onto the other would leave a database MetaSchedule cannot open."""
    import tvm.s_tir.meta_schedule as ms
    from tvm_ffi import structural_equal

    from cwm.data.database import load_raw, merge_database
    from cwm.data.dataset import load_dataset

    first = _named_matmul_db(tmp_path / "a", "first", [2, 4])
    second = _named_matmul_db(tmp_path / "b", "second", [2, 8])
    assert structural_equal(first, second)
    merged = tmp_path / "merged"
    assert merge_database(tmp_path / "a", merged) == 2
    assert merge_database(tmp_path / "b", merged) == 2  # same traces textually, other blocks
    assert merge_database(tmp_path / "b", merged) == 0
    assert len(load_raw(merged).workloads) == 2
    records = ms.database.JSONDatabase(work_dir=str(merged)).get_all_tuning_records()
    assert len(records) == 4  # every trace replays on its own workload
    ds = load_dataset(merged)
    assert len(ds.tasks) == 2 and len(ds.trajectories) == 4
    assert sorted(len(v) for v in ds.by_task.values()) == [2, 2]
