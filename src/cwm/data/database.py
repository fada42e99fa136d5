"""Robust access to MetaSchedule JSON databases (the standard format of tuning logs).

A database directory holds ``database_workload.json`` and ``database_tuning_record.json``,
one JSON value per line. MetaSchedule's own loader aborts on a corrupt line; here a corrupt or
truncated line is skipped with a warning and counted, and ``repair`` rewrites the files
atomically without such lines so MetaSchedule can open them.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CwmError
from ..io import atomic_write_text, ensure_directory, remove_stale_temp_files
from ..schedule.actions import trace_key
from ..schedule.tir import block_names, workload_module
from ..workloads.task import task_id_of

log = logging.getLogger(__name__)

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
FAILURE_FILE = "failures.jsonl"
FAILED_LATENCY = 1e10  # run_secs MetaSchedule stores for a candidate that failed


def valid_run_secs(run_secs) -> bool:
    """Measured times of a candidate that ran: all finite, positive and below ``FAILED_LATENCY``."""
    return bool(run_secs) and all(
        isinstance(s, (int, float)) and math.isfinite(s) and 0 < s < FAILED_LATENCY for s in run_secs
    )


@dataclass
class RawRecord:
    """One tuning record as plain JSON, plus where it came from."""

    workload_index: int
    trace_json: list
    run_secs: list[float] | None
    target_json: object
    args_info: list
    line_no: int

    @property
    def valid(self) -> bool:
        return valid_run_secs(self.run_secs)

    @property
    def latency(self) -> float | None:
        if not self.valid:
            return None
        s = sorted(self.run_secs)
        return float(s[len(s) // 2])


@dataclass
class RawDatabase:
    path: Path
    workloads: list[list]  # [structural hash string, serialized module]
    records: list[RawRecord]
    skipped_lines: int = 0
    skipped_detail: list[str] = field(default_factory=list)


def _read_lines(path: Path):
    try:
        with open(path, "rb") as f:
            yield from enumerate(f, 1)
    except OSError as err:
        raise CwmError(f"cannot read {path}: {err.strerror or err}") from None


def _parse_record(value, no: int, n_workloads: int) -> RawRecord:
    index, body = value
    if not isinstance(index, int) or not 0 <= index < n_workloads:
        raise ValueError(f"workload index {index!r} out of range")
    trace_json, run_secs, target_json, args_info = body[:4]
    if not isinstance(trace_json, list) or len(trace_json) != 2:
        raise ValueError("trace is not [instructions, decisions]")
    if run_secs is not None:
        run_secs = [float(s) for s in run_secs]
    return RawRecord(index, trace_json, run_secs, target_json, args_info, no)


def load_raw(db_dir: str | os.PathLike, *, missing_ok: bool = False) -> RawDatabase:
    """Read a JSON database directory, skipping corrupt lines with a warning and a count."""
    db_dir = Path(db_dir)
    wl_path, rec_path = db_dir / WORKLOAD_FILE, db_dir / RECORD_FILE
    try:
        if db_dir.exists() and not db_dir.is_dir():
            raise CwmError(f"database path {db_dir} is a file, not a database directory")
        wl_exists = wl_path.exists()
    except OSError as err:
        raise CwmError(f"cannot read database directory {db_dir}: {err.strerror or err}") from None
    if not wl_exists:
        if missing_ok:
            return RawDatabase(db_dir, [], [])
        if not db_dir.exists():
            raise CwmError(f"database directory {db_dir} does not exist")
        raise CwmError(f"{db_dir} is not a MetaSchedule database: {WORKLOAD_FILE} is missing")
    db = RawDatabase(db_dir, [], [])
    for no, raw in _read_lines(wl_path):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
            if not (isinstance(value, list) and len(value) == 2):
                raise ValueError("expected [hash, module]")
            db.workloads.append(value)
        except (ValueError, UnicodeDecodeError) as err:
            # Records refer to workloads by line index, so a bad workload line keeps its slot.
            db.workloads.append(None)
            db.skipped_lines += 1
            db.skipped_detail.append(f"{wl_path.name}:{no}: {err}")
    if rec_path.exists():
        for no, raw in _read_lines(rec_path):
            if not raw.strip():
                continue
            try:
                rec = _parse_record(json.loads(raw), no, len(db.workloads))
                if db.workloads[rec.workload_index] is None:
                    raise ValueError("refers to a corrupt workload line")
                db.records.append(rec)
            except (ValueError, TypeError, UnicodeDecodeError, IndexError) as err:
                db.skipped_lines += 1
                db.skipped_detail.append(f"{rec_path.name}:{no}: {err}")
    if db.workloads and all(w is None for w in db.workloads):
        raise CwmError(f"{wl_path} is not a MetaSchedule workload file: none of its {len(db.workloads)} line(s) "
                       f"parses (first: {db.skipped_detail[0].split(': ', 1)[-1]})")
    if db.skipped_lines:
        log.warning("%s: skipped %d corrupt line(s), first: %s", db_dir, db.skipped_lines, db.skipped_detail[0])
    return db


def repair(db_dir: str | os.PathLike) -> int:
    """Drop corrupt lines (e.g. a torn last line after a kill) so MetaSchedule can load the files.

    Workload lines keep their positions (records index them), so a corrupt workload line is
    only tolerated if no record refers to it; it is replaced by a copy of a valid line.
    Returns the number of lines dropped.
    """
    db_dir = Path(db_dir)
    rec_path = db_dir / RECORD_FILE
    wl_path = db_dir / WORKLOAD_FILE
    if not wl_path.exists():
        return 0
    db = load_raw(db_dir)
    if not db.skipped_lines:
        return 0
    good = [w for w in db.workloads if w is not None]
    if len(good) != len(db.workloads):
        if not good:
            raise CwmError(f"{wl_path}: no readable workload line; the database cannot be repaired")
        lines = [json.dumps(w if w is not None else good[0]) for w in db.workloads]
        atomic_write_text(wl_path, "\n".join(lines) + "\n")
    if rec_path.exists():
        valid_lines = {r.line_no for r in db.records}
        kept = [raw.decode().rstrip("\n") for no, raw in _read_lines(rec_path) if no in valid_lines]
        atomic_write_text(rec_path, "".join(line + "\n" for line in kept))
    log.warning("%s: repaired, dropped %d corrupt line(s)", db_dir, db.skipped_lines)
    return db.skipped_lines


def open_database(db_dir: str | os.PathLike, *, create: bool = True):
    """A MetaSchedule JSONDatabase on a repaired directory."""
    import tvm.s_tir.meta_schedule as ms

    db_dir = Path(db_dir)
    if not create and not (db_dir / WORKLOAD_FILE).exists():
        load_raw(db_dir)  # raises the clear error
    ensure_directory(db_dir, "database directory")
    remove_stale_temp_files(db_dir)
    repair(db_dir)
    return ms.database.JSONDatabase(work_dir=str(db_dir), allow_missing=create)


def task_ids(db: RawDatabase) -> list[str | None]:
    """Task id (see cwm.workloads.task_id_of) of every workload line."""
    return [None if w is None else task_id_of(workload_module(w)) for w in db.workloads]


def merge_database(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> int:
    """Append the records of ``src_dir`` that ``dst_dir`` lacks (same workload and trace); returns the
    records added. See ``merge_databases``."""
    return merge_databases([src_dir], dst_dir)[0]


def merge_databases(src_dirs, dst_dir: str | os.PathLike, on_source=None) -> list[int]:
    """Append the records of each of ``src_dirs`` that ``dst_dir`` lacks (same workload and trace).

    Works on the JSON lines directly, so records keep their exact form (their own target too, so
    records of several machines can share a database). Workloads are matched by MetaSchedule's
    structural hash string and their block names; new ones are appended, and so are their entries in
    the task index. The destination is read once for all sources. Each source's records are on disk
    before the next source is read; ``on_source(src_dir, added)`` is called after each. Returns the
    records added per source.
    """
    dst_dir = Path(dst_dir)
    open_database(dst_dir)  # creates and repairs the destination files
    dst = load_raw(dst_dir, missing_ok=True)
    workloads = list(dst.workloads)
    # (hash, block names) -> line: a structurally equal workload with other block names is kept
    # apart, or MetaSchedule could not replay the records' traces on it (see block_names).
    # Parsing a workload is slow, so an identical line is matched by its text and the structural
    # index is built only when some source workload has no identical line.
    names_of: dict[str, tuple] = {}

    def identity(entry) -> tuple:
        if entry[1] not in names_of:
            names_of[entry[1]] = block_names(workload_module(entry))
        return entry[0], names_of[entry[1]]

    same_text = {json.dumps(w): i for i, w in enumerate(workloads) if w is not None}
    index_of: dict[tuple, int] | None = None
    seen = {(r.workload_index, trace_key(r.trace_json)) for r in dst.records}
    added = []
    for src_dir in src_dirs:
        src_dir = Path(src_dir)
        src = load_raw(src_dir, missing_ok=True)
        dst_index_of_src: dict[int, int] = {}
        new_workloads, new_records = [], []
        for rec in src.records:
            if rec.workload_index not in dst_index_of_src:
                entry = src.workloads[rec.workload_index]
                text = json.dumps(entry)
                idx = same_text.get(text)
                if idx is None:
                    if index_of is None:
                        index_of = {identity(w): i for i, w in enumerate(workloads) if w is not None}
                    workload = identity(entry)
                    if workload not in index_of:
                        index_of[workload] = len(workloads)
                        workloads.append(entry)
                        new_workloads.append(entry)
                    idx = same_text[text] = index_of[workload]
                dst_index_of_src[rec.workload_index] = idx
            idx = dst_index_of_src[rec.workload_index]
            key = (idx, trace_key(rec.trace_json))
            if key in seen:
                continue
            seen.add(key)
            body = [rec.trace_json, rec.run_secs, rec.target_json, rec.args_info]
            new_records.append(json.dumps([idx, body]))
        # Workloads first: a record line must never point past the workload file.
        if new_workloads:
            with open(dst_dir / WORKLOAD_FILE, "a") as f:
                f.write("".join(json.dumps(w) + "\n" for w in new_workloads))
                f.flush()
                os.fsync(f.fileno())
        if new_records:
            with open(dst_dir / RECORD_FILE, "a") as f:
                f.write("".join(line + "\n" for line in new_records))
                f.flush()
                os.fsync(f.fileno())
        if src.records:
            _merge_task_index(src_dir, dst_dir)
        added.append(len(new_records))
        if on_source is not None:
            on_source(src_dir, len(new_records))
    return added


def _merge_task_index(src_dir: Path, dst_dir: Path) -> None:
    """Keep the readable names, kinds and weights of the merged tasks (see write_task_index)."""
    index = read_task_index(dst_dir)
    new = {k: v for k, v in read_task_index(src_dir).items() if k not in index}
    if new:
        atomic_write_text(dst_dir / TASK_INDEX_FILE, json.dumps(index | new, indent=1, sort_keys=True) + "\n")


TASK_INDEX_FILE = "tasks.json"


def write_task_index(db_dir: str | os.PathLike, tasks) -> None:
    """Remember readable names, kinds and weights of the tasks in a database directory."""
    path = Path(db_dir) / TASK_INDEX_FILE
    index = read_task_index(db_dir)
    for t in tasks:
        index[t.id] = TaskInfo(t.id, t.name, t.kind, t.network, t.weight, t.flops).__dict__
    atomic_write_text(path, json.dumps(index, indent=1, sort_keys=True) + "\n")


def read_task_index(db_dir: str | os.PathLike) -> dict:
    path = Path(db_dir) / TASK_INDEX_FILE
    if not path.exists():
        return {}
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError: bad JSON or not UTF-8
        raise CwmError(f"{path} is corrupt: {err}") from None
    if not isinstance(index, dict):
        raise CwmError(f"{path} is corrupt: expected a JSON object of tasks")
    return index


@dataclass
class TaskInfo:
    id: str
    name: str
    kind: str
    network: str | None = None
    weight: float = 1.0
    flops: float = 0.0


MANIFEST_FILE = "manifest.json"
