"""The action-state trajectory dataset, built from any MetaSchedule JSON database.

Each measured record becomes a trajectory: the task's initial TensorIR, the action sequence
(every trace instruction with its symbolic inputs, attrs and decision), the intermediate
states after IR-changing actions (replayed on demand, cached on disk), the final state, the
measured latency and the hardware features.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import CwmError
from ..io import atomic_file, atomic_write_text
from ..schedule.actions import changes_ir, model_actions, replay
from ..schedule.tir import block_names, workload_module
from .database import FAILURE_FILE, MANIFEST_FILE, TaskInfo, load_raw, read_task_index

log = logging.getLogger(__name__)


@dataclass
class Trajectory:
    task_id: str
    actions: list[dict]
    latency: float | None
    error: str | None = None
    record_index: int = -1

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
    hardware: dict = field(default_factory=dict)
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
            "hardware": self.hardware,
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
        return {
            "tasks": len(self.by_task),
            "records": len(self.trajectories),
            "valid": sum(t.valid for t in self.trajectories),
            "failed": sum(not t.valid for t in self.trajectories),
            "failure_kinds": dict(errors),
            "skipped_lines": self.skipped_lines,
            "per_task": per_task,
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


def load_dataset(db_dir: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> TrajectoryDataset:
    """Trajectories of every record in a MetaSchedule JSON database directory."""
    from ..workloads.task import kind_of, task_id_of

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
        from ..hardware import host_cpu

        hardware = host_cpu().as_json()
    tasks, states, modules, ids = {}, {}, {}, []
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
        names = key[1]
        info = index.get(tid)
        if info:
            tasks[tid] = TaskInfo(**info)
        else:
            tasks[tid] = TaskInfo(tid, f"task-{tid}", kind_of(" ".join(names)))
        states[tid] = mod.script()
        modules[tid] = mod
    trajectories = []
    for i, rec in enumerate(raw.records):
        tid = ids[rec.workload_index]
        error = None
        if not rec.valid:
            error = failures.get(json.dumps(rec.trace_json, sort_keys=True), "failed")
        trajectories.append(
            Trajectory(tid, model_actions(rec.trace_json), rec.latency, error, record_index=i)
        )
    return TrajectoryDataset(tasks, states, modules, trajectories, hardware, raw.skipped_lines,
                             StateCache(cache_dir))
