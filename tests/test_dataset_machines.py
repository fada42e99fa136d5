"""Records merged from several machines keep their machine and its hardware features.

The databases here are written by hand (no tuning, nothing measured): two tasks, records whose
targets name Zen 3 and Zen 5 CPUs, a manifest describing the Zen 3 machine.
"""

import json

import pytest

from cwm.data.database import MANIFEST_FILE, RECORD_FILE, WORKLOAD_FILE
from cwm.data.dataset import (
    load_dataset,
    machine_hardware,
    machine_of,
    target_dict,
)
from cwm.data.stats import format_dataset_stats, plot_dataset_stats
from cwm.hardware import HARDWARE_FEATURE_NAMES, KNOWN_CPU_HARDWARE, HardwareInfo

ZEN3 = {"kind": "llvm", "tag": "", "keys": ["cpu"], "mcpu": "znver3", "num-cores": 2}
ZEN5 = {"kind": "llvm", "tag": "", "keys": ["cpu"], "mcpu": "znver5", "num-cores": 16}
ZEN3_HW = HardwareInfo(kind="cpu", model="AMD EPYC 7B13", cores=2, simd_bits=256, l1d_kb=32, l2_kb=512,
                       l3_kb=32768, mcpu="znver3").as_json()
HW_KEYS = set(ZEN3_HW)
ARGS = [["TENSOR", "float32", [32, 32]]] * 3


def _trace(factors):
    """GetSBlock, GetLoops, a sampled 2-way tile of the first loop and its split."""
    insts = [
        ["GetSBlock", [], ["C", "main"], ["b0"]],
        ["GetLoops", ["b0"], [], ["l1", "l2", "l3"]],
        ["SamplePerfectTile", ["l1"], [2, 64], ["v4", "v5"]],
        ["Split", ["l1", "v4", "v5"], [1, 0], ["l6", "l7"]],
    ]
    return [insts, [[2, list(factors)]]]


def _workload(name: str):
    import tvm.s_tir.meta_schedule as ms

    from cwm.workloads import get_task

    value = ms.database.Workload(get_task(name).mod).as_json()
    return [str(value[0]), str(value[1])]


# (workload line, tile factors, run_secs or None for a failed candidate, target)
RECORDS = [
    (0, (4, 8), [1e-5, 1.1e-5], ZEN3),
    (0, (8, 4), [2e-5], ZEN3),
    (0, (2, 16), None, ZEN3),
    (1, (4, 8), [3e-5], ZEN3),
    (0, (4, 8), [5e-6], ZEN5),
    (0, (16, 2), [6e-6], ZEN5),
    (0, (1, 32), None, ZEN5),
]


@pytest.fixture(scope="module")
def merged_db(tmp_path_factory):
    db = tmp_path_factory.mktemp("merged")
    workloads = [_workload("matmul:M=32,N=32,K=32"), _workload("matmul:M=32,N=32,K=64")]
    (db / WORKLOAD_FILE).write_text("".join(json.dumps(w) + "\n" for w in workloads))
    lines = [json.dumps([wl, [_trace(f), secs, target, ARGS]]) for wl, f, secs, target in RECORDS]
    (db / RECORD_FILE).write_text("".join(line + "\n" for line in lines))
    (db / MANIFEST_FILE).write_text(json.dumps({"target": ZEN3, "hardware": ZEN3_HW}))
    return db


def test_each_record_keeps_its_machine(merged_db):
    ds = load_dataset(merged_db)
    assert len(ds) == len(RECORDS)
    assert [t.machine for t in ds.trajectories] == [r[3]["mcpu"] for r in RECORDS]
    assert [t.to_json()["machine"] for t in ds.trajectories] == [r[3]["mcpu"] for r in RECORDS]
    assert set(ds.machines) == {"znver3", "znver5"}
    # The database's own hardware (one dict per database) is still the manifest's.
    assert ds.hardware == ZEN3_HW


def test_per_record_hardware(merged_db):
    ds = load_dataset(merged_db)
    zen3 = [t for t in ds.trajectories if t.machine == "znver3"]
    zen5 = [t for t in ds.trajectories if t.machine == "znver5"]
    for t in zen3:  # the manifest describes the Zen 3 machine: its hardware, as measured
        assert ds.hardware_of(t) == ZEN3_HW
    for t in zen5:  # not in the manifest: the known-machine table and the target's num-cores
        hw = ds.hardware_of(t)
        assert set(hw) == HW_KEYS
        assert hw["simd_bits"] == 512 and hw["cores"] == 16 and hw["mcpu"] == "znver5"
        assert hw["l1d_kb"] == KNOWN_CPU_HARDWARE["znver5"]["l1d_kb"] == 48
        assert ds.record(t)["hardware"] == hw
    assert {ds.hardware_of(t)["simd_bits"] for t in zen3} == {256}
    # Subsets (train/val splits, valid records) keep each record's machine.
    valid = ds.valid()
    assert {t.machine: valid.hardware_of(t)["simd_bits"] for t in valid.trajectories} == {"znver3": 256, "znver5": 512}
    # One part per machine, e.g. for the ranker's features (WorldModel.features takes one hardware).
    tid = next(t for t, trajs in valid.by_task.items() if len(trajs) == 4)
    trajs = valid.by_task[tid]
    parts = valid.by_hardware(trajs)
    assert [(hw["simd_bits"], rows) for hw, rows in parts] == [(256, [0, 1]), (512, [2, 3])]
    assert all(trajs[i].machine == hw["mcpu"] for hw, rows in parts for i in rows)


def test_single_machine_database_unchanged(tmp_path, merged_db):
    """A database of one machine: every record gets the manifest's hardware, as before."""
    (tmp_path / WORKLOAD_FILE).write_text((merged_db / WORKLOAD_FILE).read_text())
    lines = [json.dumps([wl, [_trace(f), secs, ZEN3, ARGS]]) for wl, f, secs, _ in RECORDS]
    (tmp_path / RECORD_FILE).write_text("".join(line + "\n" for line in lines))
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"target": ZEN3, "hardware": ZEN3_HW}))
    ds = load_dataset(tmp_path)
    assert all(ds.hardware_of(t) is ds.hardware for t in ds.trajectories)
    assert list(ds.machines) == ["znver3"]
    assert len(ds.by_hardware(ds.trajectories)) == 1


def test_stats_per_machine(merged_db, tmp_path):
    ds = load_dataset(merged_db)
    stats = ds.stats()
    assert stats["per_machine"]["znver3"] | {"hardware": None} == {
        "records": 4, "valid": 3, "failed": 1, "tasks": 2, "valid_tasks": 2, "hardware": None}
    assert stats["per_machine"]["znver5"] | {"hardware": None} == {
        "records": 3, "valid": 2, "failed": 1, "tasks": 1, "valid_tasks": 1, "hardware": None}
    json.dumps(stats)  # `cwm dataset stats --json`
    text = format_dataset_stats(stats)
    header = next(line for line in text.splitlines() if line.startswith("machine"))
    assert header.split()[:6] == ["machine", "records", "valid", "fail", "tasks", "valid"]
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("znver")}
    assert rows["znver3"][1:5] == ["4", "3", "1", "2"] and rows["znver3"][7] == "256"
    assert rows["znver5"][1:5] == ["3", "2", "1", "1"] and rows["znver5"][7] == "512"
    plot_dataset_stats(ds, tmp_path / "stats.png")
    assert (tmp_path / "stats.png").stat().st_size > 0


@pytest.mark.parametrize("target, machine", [
    (ZEN5, "znver5"),
    (json.dumps(ZEN5), "znver5"),
    ("llvm -keys=cpu -mcpu=icelake-server -num-cores=8", "icelake-server"),
    ({"kind": "llvm", "keys": ["cpu"]}, "unknown"),
    ({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152}, "cuda"),
    ({"kind": "c", "keys": ["cpu"]}, "c"),
    (None, "unknown"),
    ("{not json", "unknown"),
])
def test_machine_of_targets(target, machine):
    assert machine_of(target) == machine
    hw = machine_hardware(target, ZEN3_HW)
    assert set(hw) == HW_KEYS
    if machine in ("unknown", "c"):
        assert hw is ZEN3_HW  # nothing names another machine: the database's own hardware


def test_known_machines_table():
    assert target_dict("llvm -mcpu=znver4 -num-cores=4") == {"kind": "llvm", "mcpu": "znver4", "num-cores": 4}
    simd = {m: machine_hardware({"kind": "llvm", "mcpu": m, "num-cores": 4})["simd_bits"]
            for m in ("znver3", "znver4", "znver5", "sapphirerapids", "icelake-server", "cascadelake")}
    assert simd == {"znver3": 256, "znver4": 512, "znver5": 512, "sapphirerapids": 512, "icelake-server": 512,
                    "cascadelake": 512}
    for row in KNOWN_CPU_HARDWARE.values():
        assert all(row[k] > 0 for k in ("simd_bits", "l1d_kb", "l2_kb", "l3_kb"))
    hw = machine_hardware({"kind": "llvm", "mcpu": "sapphirerapids", "num-cores": 4})
    features = [float(hw.get(n, 0)) for n in HARDWARE_FEATURE_NAMES if n != "is_gpu"]
    assert features[:2] == [4.0, 512.0]
    unknown = machine_hardware({"kind": "llvm", "mcpu": "nosuchcpu", "num-cores": 4}, ZEN3_HW)
    assert unknown["mcpu"] == "nosuchcpu" and unknown["cores"] == 4 and unknown["simd_bits"] == 0
    cuda = machine_hardware({"kind": "cuda", "arch": "sm_90", "max_shared_memory_per_block": 49152})
    assert cuda["kind"] == "cuda" and cuda["mcpu"] == "sm_90" and cuda["shared_mem_kb"] == 48
