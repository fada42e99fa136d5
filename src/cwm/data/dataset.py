"""The action-state trajectory dataset, built from any MetaSchedule JSON database.

Each measured record becomes a trajectory: the task's initial TensorIR, the action sequence
(every trace instruction with its symbolic inputs, attrs and decision), the intermediate
states after IR-changing actions (replayed on demand, cached on disk), the final state, the
measured latency and the hardware features.

Records merged from several machines keep their machine: each trajectory carries the ``mcpu``
of its own record's target (``Trajectory.machine``) and that machine's hardware features
(``TrajectoryDataset.hardware_of``), taken from the database's manifest when the manifest
describes that machine and from ``cwm.hardware.KNOWN_CPU_HARDWARE`` otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import CwmError
from ..hardware import KNOWN_CPU_HARDWARE, UNKNOWN_MACHINE, host_cpu
from ..io import atomic_file, atomic_write_text
from ..schedule.actions import changes_ir, model_actions, replay
from ..schedule.tir import block_names, workload_module
from ..workloads.task import kind_of, task_id_of
from .database import FAILURE_FILE, MANIFEST_FILE, TaskInfo, load_raw, read_task_index

log = logging.getLogger(__name__)


def target_dict(target_json) -> dict:
    """A record's target as a dict: MetaSchedule stores a JSON object; a JSON string or an old
    ``"llvm -mcpu=znver3 -num-cores=4"`` string is read too. ``{}`` when unreadable."""
    if isinstance(target_json, dict):
        return target_json
    if isinstance(target_json, str):
        text = target_json.strip()
        try:
            value = json.loads(text)
            return value if isinstance(value, dict) else {}
        except ValueError:
            pass
        parts = text.split()
        if not parts or not re.fullmatch(r"[A-Za-z_][\w-]*", parts[0]):
            return {}
        out: dict = {"kind": parts[0]}
        for key, value in re.findall(r"-{1,2}([\w-]+)=(\S+)", text):
            out[key] = int(value) if value.isdigit() else value
        return out
    return {}


def machine_of(target_json) -> str:
    """The machine of a record: its llvm target's ``mcpu``, the target kind for other kinds
    (e.g. "cuda"), or "unknown"."""
    target = target_dict(target_json)
    kind = target.get("kind")
    if kind == "llvm" or (not kind and target.get("mcpu")):
        mcpu = target.get("mcpu")
        return str(mcpu) if mcpu else UNKNOWN_MACHINE
    return str(kind) if kind else UNKNOWN_MACHINE


def machine_hardware(target_json, default: dict | None = None) -> dict:
    """Hardware features (keys of ``HardwareInfo.as_json()``) of the machine a record was measured on.

    ``default`` is the database's own hardware (manifest.json, else this host). It is used when
    it describes the record's machine (same kind and ``mcpu``/cuda ``arch``) and for records whose
    machine is unknown or not a CPU/GPU by name (e.g. kind "c"). Other llvm records get their
    ``mcpu``'s row of ``cwm.hardware.KNOWN_CPU_HARDWARE`` with the target's ``num-cores`` (0 if absent); an
    ``mcpu`` not in the table gets zero SIMD width and caches. cuda records get the target's
    arch and shared memory.
    """
    default = default or {}
    target = target_dict(target_json)
    machine = machine_of(target)
    if machine == UNKNOWN_MACHINE:
        return default
    kind = target.get("kind") or "llvm"
    cores = target.get("num-cores")
    cores = int(cores) if isinstance(cores, (int, float)) or (isinstance(cores, str) and cores.isdigit()) else 0
    if kind == "llvm":
        if default.get("kind", "cpu") == "cpu" and default.get("mcpu") == machine:
            return default
        row = KNOWN_CPU_HARDWARE.get(machine)
        if row is None:
            return {"kind": "cpu", "model": machine, "cores": cores, "simd_bits": 0, "l1d_kb": 0, "l2_kb": 0,
                    "l3_kb": 0, "mcpu": machine, "sm_count": 0, "shared_mem_kb": 0}
        return {"kind": "cpu", "model": row["model"], "cores": cores, "simd_bits": row["simd_bits"],
                "l1d_kb": row["l1d_kb"], "l2_kb": row["l2_kb"], "l3_kb": row["l3_kb"], "mcpu": machine,
                "sm_count": 0, "shared_mem_kb": 0}
    if kind == "cuda":
        arch = str(target.get("arch", ""))
        if default.get("kind") == "cuda" and (not arch or default.get("mcpu") == arch):
            return default
        shared = target.get("max_shared_memory_per_block", 0)
        shared = int(shared) // 1024 if isinstance(shared, (int, float)) else 0
        return {"kind": "cuda", "model": f"cuda {arch}".strip(), "cores": 0, "simd_bits": 32 * 32,
                "l1d_kb": 0, "l2_kb": 0, "l3_kb": 0, "mcpu": arch, "sm_count": 0, "shared_mem_kb": shared}
    return default


@dataclass
class Trajectory:
    task_id: str
    actions: list[dict]
    latency: float | None
    error: str | None = None
    record_index: int = -1
    machine: str = UNKNOWN_MACHINE  # the record target's mcpu (see machine_of)
    # The machine's hardware features (see machine_hardware); None: the dataset's hardware.
    hardware: dict | None = field(default=None, repr=False, compare=False)

    @property
    def valid(self) -> bool:
        return self.latency is not None

    @property
    def ir_steps(self) -> list[int]:
        """Steps (number of actions applied) after which the IR text changes."""
        return [i + 1 for i, a in enumerate(self.actions) if changes_ir(a)]

    def to_json(self) -> dict:
        return {
            "task_id": self.task_id,
            "actions": self.actions,
            "latency": self.latency,
            "error": self.error,
            "record_index": self.record_index,
            "machine": self.machine,
        }


class StateCache:
    """Replayed TensorIR texts on disk, keyed by a hash of the initial state and action prefix."""

    def __init__(self, directory: str | os.PathLike | None):
        self.directory = Path(directory) if directory else None
        self._memory: dict[str, str] = {}

    @staticmethod
    def key(initial: str, actions: list[dict], step: int) -> str:
        h = hashlib.sha1(initial.encode())
        h.update(json.dumps(actions[:step], sort_keys=True, default=str).encode())
        return h.hexdigest()

    def get(self, key: str) -> str | None:
        if key in self._memory:
            return self._memory[key]
        if self.directory is not None:
            path = self.directory / key[:2] / f"{key}.tir"
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError):  # missing or corrupt: replayed and rewritten
                return None
            self._memory[key] = text
            return text
        return None

    def put(self, key: str, text: str) -> None:
        self._memory[key] = text
        if self.directory is not None:
            path = self.directory / key[:2] / f"{key}.tir"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, text)


@dataclass
class TrajectoryDataset:
    tasks: dict[str, TaskInfo]
    initial_states: dict[str, str]  # task id -> TensorIR text
    modules: dict[str, object]  # task id -> IRModule
    trajectories: list[Trajectory]
    hardware: dict = field(default_factory=dict)  # the database's machine (manifest.json, else this host)
    skipped_lines: int = 0
    cache: StateCache = field(default_factory=lambda: StateCache(None))

    def __len__(self) -> int:
        return len(self.trajectories)

    @cached_property
    def by_task(self) -> dict[str, list[Trajectory]]:
        out: dict[str, list[Trajectory]] = {}
        for t in self.trajectories:
            out.setdefault(t.task_id, []).append(t)
        return out

    def hardware_of(self, traj: Trajectory) -> dict:
        """Hardware features of the machine ``traj`` was measured on (see machine_hardware)."""
        return traj.hardware if traj.hardware is not None else self.hardware

    @property
    def machines(self) -> dict[str, dict]:
        """Hardware of each machine with records, by machine name (first record's, in record order)."""
        out: dict[str, dict] = {}
        for t in self.trajectories:
            out.setdefault(t.machine, self.hardware_of(t))
        return out

    def by_hardware(self, trajs: list[Trajectory]) -> list[tuple[dict, list[int]]]:
        """``trajs`` split by the hardware they were measured on: (hardware dict, positions in
        ``trajs``) in first-seen order; one part for a single-machine database. Positions let a
        caller put per-part results (e.g. ranker features) back in the order of ``trajs``."""
        parts: dict[str, tuple[dict, list[int]]] = {}
        for i, t in enumerate(trajs):
            hw = self.hardware_of(t)
            key = json.dumps(hw, sort_keys=True, default=str)
            parts.setdefault(key, (hw, []))[1].append(i)
        return list(parts.values())

    def subset(self, task_ids) -> "TrajectoryDataset":
        keep = set(task_ids)
        return TrajectoryDataset(
            tasks={k: v for k, v in self.tasks.items() if k in keep},
            initial_states={k: v for k, v in self.initial_states.items() if k in keep},
            modules={k: v for k, v in self.modules.items() if k in keep},
            trajectories=[t for t in self.trajectories if t.task_id in keep],
            hardware=self.hardware,
            cache=self.cache,
        )

    def valid(self) -> "TrajectoryDataset":
        ds = self.subset(self.tasks)
        ds.trajectories = [t for t in ds.trajectories if t.valid]
        return ds

    def state(self, traj: Trajectory, step: int) -> str:
        """TensorIR text after the first ``step`` actions of ``traj`` (replayed, cached)."""
        initial = self.initial_states[traj.task_id]
        if step == 0:
            return initial
        key = self.cache.key(initial, traj.actions, step)
        text = self.cache.get(key)
        if text is None:
            text = replay(self.modules[traj.task_id], traj.actions, step).mod.script()
            self.cache.put(key, text)
        return text

    def final_state(self, traj: Trajectory) -> str:
        return self.state(traj, len(traj.actions))

    def record(self, traj: Trajectory, with_states: bool = False) -> dict:
        """One trajectory as a self-contained JSON record."""
        out = {
            **traj.to_json(),
            "task_name": self.tasks[traj.task_id].name,
            "initial_state": self.initial_states[traj.task_id],
            "hardware": self.hardware_of(traj),
        }
        if with_states:
            out["states"] = {str(s): self.state(traj, s) for s in traj.ir_steps}
            out["final_state"] = self.final_state(traj)
        return out

    def export_jsonl(self, path: str | os.PathLike, with_states: bool = False) -> int:
        try:
            with atomic_file(path) as tmp, open(tmp, "w") as f:
                for traj in self.trajectories:
                    f.write(json.dumps(self.record(traj, with_states)) + "\n")
        except OSError as err:
            raise CwmError(f"cannot write {path}: {err.strerror or err}") from None
        return len(self.trajectories)

    def stats(self) -> dict:
        per_task = {}
        for tid, trajs in sorted(self.by_task.items(), key=lambda kv: self.tasks[kv[0]].name):
            lats = np.array([t.latency for t in trajs if t.valid], dtype=float)
            per_task[tid] = {
                "name": self.tasks[tid].name,
                "kind": self.tasks[tid].kind,
                "records": len(trajs),
                "valid": int(len(lats)),
                "failed": len(trajs) - int(len(lats)),
                "best_ms": float(lats.min() * 1e3) if len(lats) else None,
                "median_ms": float(np.median(lats) * 1e3) if len(lats) else None,
                "worst_ms": float(lats.max() * 1e3) if len(lats) else None,
                "spread": float(lats.max() / lats.min()) if len(lats) else None,
            }
        kinds = Counter(a["kind"] for t in self.trajectories for a in t.actions)
        lengths = np.array([len(t.actions) for t in self.trajectories]) if self.trajectories else np.zeros(1)
        ir_lengths = np.array([len(t.ir_steps) for t in self.trajectories]) if self.trajectories else np.zeros(1)
        errors = Counter(t.error for t in self.trajectories if not t.valid)
        per_machine = {}
        for t in self.trajectories:
            row = per_machine.setdefault(t.machine, {"records": 0, "valid": 0, "failed": 0, "tasks": set(),
                                                     "valid_tasks": set(), "hardware": self.hardware_of(t)})
            row["records"] += 1
            row["valid" if t.valid else "failed"] += 1
            row["tasks"].add(t.task_id)
            if t.valid:
                row["valid_tasks"].add(t.task_id)
        for row in per_machine.values():
            row["tasks"], row["valid_tasks"] = len(row["tasks"]), len(row["valid_tasks"])
        return {
            "tasks": len(self.by_task),
            "records": len(self.trajectories),
            "valid": sum(t.valid for t in self.trajectories),
            "failed": sum(not t.valid for t in self.trajectories),
            "failure_kinds": dict(errors),
            "skipped_lines": self.skipped_lines,
            "per_task": per_task,
            "per_machine": dict(sorted(per_machine.items(), key=lambda kv: (-kv[1]["records"], kv[0]))),
            "action_kinds": dict(kinds.most_common()),
            "length": _distribution(lengths),
            "ir_changing_length": _distribution(ir_lengths),
        }


def _distribution(values: np.ndarray) -> dict:
    return {
        "min": int(values.min()),
        "p25": float(np.percentile(values, 25)),
        "median": float(np.median(values)),
        "p75": float(np.percentile(values, 75)),
        "max": int(values.max()),
        "mean": float(values.mean()),
    }


def _failure_index(db_dir: Path) -> dict[str, str]:
    """Error kind of failed candidates, keyed by their trace JSON."""
    path = db_dir / FAILURE_FILE
    out = {}
    if not path.exists():
        return out
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                out[json.dumps(row["trace"], sort_keys=True)] = row["error_kind"]
            except (ValueError, KeyError, TypeError):
                continue  # torn last line after a kill
    return out


def _workload_tasks(raw, index: dict) -> tuple[list[str | None], dict[str, TaskInfo], dict[str, object]]:
    """The task id of each workload line (None for an unreadable one), and each task's info and module."""
    tasks, modules, ids = {}, {}, []
    task_of: dict[tuple, str] = {}  # (structural id, block names) -> task id
    for entry in raw.workloads:
        if entry is None:
            ids.append(None)
            continue
        mod = workload_module(entry)
        key = (task_id_of(mod), block_names(mod))
        if key in task_of:
            ids.append(task_of[key])
            continue
        # Structurally equal with other block names: traces of one do not replay on the other.
        variants = sum(k[0] == key[0] for k in task_of)
        tid = task_of[key] = key[0] if not variants else f"{key[0]}-{variants}"
        ids.append(tid)
        info = index.get(tid)
        tasks[tid] = TaskInfo(**info) if info else TaskInfo(tid, f"task-{tid}", kind_of(" ".join(key[1])))
        modules[tid] = mod
    return ids, tasks, modules


def load_tasks(db_dir: str | os.PathLike) -> tuple[dict[str, TaskInfo], dict[str, object]]:
    """The tasks of a database directory (info and IRModule by task id), without its trajectories; a
    directory with no database yet has none."""
    db_dir = Path(db_dir)
    _, tasks, modules = _workload_tasks(load_raw(db_dir, missing_ok=True), read_task_index(db_dir))
    return tasks, modules


def load_dataset(db_dir: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> TrajectoryDataset:
    """Trajectories of every record in a MetaSchedule JSON database directory."""
    db_dir = Path(db_dir)
    raw = load_raw(db_dir)
    index = read_task_index(db_dir)
    failures = _failure_index(db_dir)
    manifest_path = db_dir / MANIFEST_FILE
    hardware = {}
    if manifest_path.exists():
        try:
            hardware = json.loads(manifest_path.read_text()).get("hardware", {})
        except (OSError, ValueError, AttributeError):
            log.warning("%s is corrupt; hardware features unknown", manifest_path)
    if not hardware:
        hardware = host_cpu().as_json()
    ids, tasks, modules = _workload_tasks(raw, index)
    states = {tid: mod.script() for tid, mod in modules.items()}
    trajectories = []
    machine_of_target: dict[str, tuple[str, dict]] = {}  # target JSON -> (machine, hardware)
    for i, rec in enumerate(raw.records):
        tid = ids[rec.workload_index]
        error = None
        if not rec.valid:
            error = failures.get(json.dumps(rec.trace_json, sort_keys=True), "failed")
        key = json.dumps(rec.target_json, sort_keys=True, default=str)
        if key not in machine_of_target:
            machine = machine_of(rec.target_json)
            hw = machine_hardware(rec.target_json, hardware)
            if hw is not hardware and hw.get("kind") == "cpu" and not hw.get("simd_bits"):
                log.warning("%s: records of unknown CPU %r (not in the manifest nor KNOWN_CPU_HARDWARE); "
                            "its SIMD width and caches are unknown", db_dir, machine)
            machine_of_target[key] = (machine, hw)
        machine, hw = machine_of_target[key]
        trajectories.append(
            Trajectory(tid, model_actions(rec.trace_json), rec.latency, error, record_index=i,
                       machine=machine, hardware=hw)
        )
    return TrajectoryDataset(tasks, states, modules, trajectories, hardware, raw.skipped_lines,
                             StateCache(cache_dir))
