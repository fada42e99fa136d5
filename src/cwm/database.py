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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CwmError

log = logging.getLogger(__name__)

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
FAILURE_FILE = "failures.jsonl"
FAILED_LATENCY = 1e10  # run_secs MetaSchedule stores for a candidate that failed


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
        return bool(self.run_secs) and all(
            isinstance(s, (int, float)) and math.isfinite(s) and 0 < s < FAILED_LATENCY for s in self.run_secs
        )

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


TEMP_MARK = ".tmp"  # temporary files and directories are named ``.<name>.tmp<pid>``


def _temp_path(path: Path, kind: str = TEMP_MARK) -> Path:
    return path.with_name(f".{path.name}{kind}{os.getpid()}")


@contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary sibling of ``path`` to write; it replaces ``path`` when the block ends and
    is deleted if the block fails: readers see the old or the new file, never a part."""
    path = Path(path)
    if path.is_dir():
        raise CwmError(f"cannot write {path}: it is a directory")
    tmp = _temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file and a rename: readers see the old or the new file."""
    try:
        with atomic_file(path) as tmp, open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise CwmError(f"cannot write {path}: {err.strerror or err}") from None


def ensure_directory(path: str | os.PathLike, what: str = "directory") -> Path:
    """Create ``path`` (and parents) or fail with a clear error if it is a file or not writable."""
    path = Path(path)
    try:
        if path.exists() and not path.is_dir():
            raise CwmError(f"{what} {path} is a file, not a directory")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # e.g. a parent that cannot be read or written
        raise CwmError(f"cannot create {what} {path}: {err.strerror or err}") from None
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(entry: Path, kind: str) -> bool:
    """``entry`` is a temporary ``.<name><kind><pid>`` of a process that no longer runs."""
    name = entry.name
    if not name.startswith(".") or kind not in name:
        return False
    pid = name.rsplit(kind, 1)[1]
    return pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))


def remove_stale_temp_files(directory: str | os.PathLike) -> int:
    """Delete temporary files left in ``directory`` by killed processes; returns how many."""
    import shutil

    removed = 0
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    for entry in directory.iterdir():
        if _stale(entry, TEMP_MARK):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
    return removed


@contextmanager
def atomic_directory(path: str | os.PathLike):
    """Build a directory in a temporary sibling, then swap it in: ``path`` is always absent, the
    complete old directory or the complete new one, even if the process is killed meanwhile.

    Yields the temporary directory to write into. A half-written temporary directory or a
    displaced old one left behind by a killed process is deleted the next time.
    """
    import shutil

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CwmError(f"{path} is a file, not a directory")
    ensure_directory(path.parent)
    for entry in path.parent.iterdir():
        if entry.name.startswith(f".{path.name}.") and (_stale(entry, TEMP_MARK) or _stale(entry, ".old")):
            shutil.rmtree(entry, ignore_errors=True)
    tmp = _temp_path(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = _temp_path(path, ".old")
    try:
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    except OSError as err:
        raise CwmError(f"cannot replace {path}: {err.strerror or err}") from None
    shutil.rmtree(old, ignore_errors=True)


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


def workload_module(entry: list):
    """The IRModule of one workload line."""
    import tvm.s_tir.meta_schedule as ms

    return ms.database.Workload.from_json(entry).mod


def block_names(mod) -> tuple[str, ...]:
    """Names of the schedulable blocks of a workload, in program order.

    Structural equality ignores them, but traces address blocks by name: two workloads that are
    structurally equal with other block names (the same subgraph in two networks) cannot share
    records.
    """
    from tvm.s_tir import Schedule

    sch = Schedule(mod)
    found = []

    def walk(block) -> None:
        for child in sch.get_child_blocks(block):
            found.append(sch.get(child).name_hint)
            walk(child)

    walk(sch.get_sblock("root", func_name="main"))
    return tuple(found)


def task_ids(db: RawDatabase) -> list[str | None]:
    """Task id (see cwm.workloads.task_id_of) of every workload line."""
    from .workloads.task import task_id_of

    return [None if w is None else task_id_of(workload_module(w)) for w in db.workloads]


def merge_database(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> int:
    """Append the records of ``src_dir`` that ``dst_dir`` lacks (same workload and trace).

    Works on the JSON lines directly, so records keep their exact form. Workloads are matched by
    MetaSchedule's structural hash string and their block names; new ones are appended, and so are
    their entries in the task index. Returns the records added.
    """
    from .collect import trace_key

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    src = load_raw(src_dir, missing_ok=True)
    if not src.records:
        return 0
    open_database(dst_dir)  # creates and repairs the destination files
    dst = load_raw(dst_dir, missing_ok=True)
    # (hash, block names) -> line: a structurally equal workload with other block names is kept
    # apart, or MetaSchedule could not replay the records' traces on it (see block_names).
    # Parsing a workload is slow, so an identical line is matched by its text and the structural
    # index is built only when some source workload has no identical line.
    names_of: dict[str, tuple] = {}

    def identity(entry) -> tuple:
        if entry[1] not in names_of:
            names_of[entry[1]] = block_names(workload_module(entry))
        return entry[0], names_of[entry[1]]

    same_text = {json.dumps(w): i for i, w in enumerate(dst.workloads) if w is not None}
    index_of: dict[tuple, int] | None = None
    dst_index_of_src: dict[int, int] = {}
    seen = {(r.workload_index, trace_key(r.trace_json)) for r in dst.records}
    new_workloads, new_records = [], []
    for rec in src.records:
        if rec.workload_index not in dst_index_of_src:
            entry = src.workloads[rec.workload_index]
            idx = same_text.get(json.dumps(entry))
            if idx is None:
                if index_of is None:
                    index_of = {identity(w): i for i, w in enumerate(dst.workloads) if w is not None}
                workload = identity(entry)
                if workload not in index_of:
                    index_of[workload] = len(dst.workloads) + len(new_workloads)
                    new_workloads.append(entry)
                idx = index_of[workload]
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
    _merge_task_index(src_dir, dst_dir)
    return len(new_records)


def _merge_task_index(src_dir: Path, dst_dir: Path) -> None:
    """Keep the readable names, kinds and weights of the merged tasks (see write_task_index)."""
    from .dataset import TASK_INDEX_FILE, read_task_index

    index = read_task_index(dst_dir)
    new = {k: v for k, v in read_task_index(src_dir).items() if k not in index}
    if new:
        atomic_write_text(dst_dir / TASK_INDEX_FILE, json.dumps(index | new, indent=1, sort_keys=True) + "\n")
