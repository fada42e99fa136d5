"""Measurement through TVM's RPC tracker, on loopback only."""

import time

import pytest

from cwm.errors import CwmError
from cwm.measure import RPCAddress


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
    from cwm.collect import collect
    from cwm.database import load_raw

    report = collect([tiny_task], tmp_path, n_random=4, n_evolutionary=0, batch=4, rpc=rpc_farm, progress=False)
    assert report.measured == 4
    raw = load_raw(tmp_path)
    assert sum(r.valid for r in raw.records) == 4


def test_tune_through_rpc_with_two_servers(tmp_path, tiny_task, rpc_farm):
    from cwm.tuning import tune

    result = tune(tiny_task, trials=8, work_dir=tmp_path, cost_model="random", rpc=rpc_farm,
                  num_trials_per_iter=8, progress=False)
    assert result.trials == 8
    assert tiny_task.id in result.best


def test_parallel_collect_through_rpc_merges_shards(tmp_path, rpc_farm):
    from cwm.collect import SHARD_DIR, collect, existing_counts, measured_trace_keys
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
    from cwm.collect import collect
    from cwm.workloads import get_task

    with pytest.raises(CwmError, match="RPC"):
        collect([get_task("matmul:M=32,N=32,K=32")], tmp_path, n_random=2, n_evolutionary=0, jobs=2)


def test_merge_database_adds_only_missing_records(tmp_path, tiny_db):
    import shutil

    from cwm.database import load_raw, merge_database

    dst = tmp_path / "dst"
    shutil.copytree(tiny_db, dst)
    n = len(load_raw(dst).records)
    assert merge_database(tiny_db, dst) == 0
    assert merge_database(tiny_db, tmp_path / "fresh") == n
    assert len(load_raw(tmp_path / "fresh").records) == n


def test_rpc_runner_measures_on_every_server(rpc_farm):
    from cwm.measure import make_runner

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
