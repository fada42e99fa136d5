"""The compile cache: one directory per (graph, target, budget, cost model), guarded by a file lock.

An entry is ``<root>/<key>/`` with ``db/`` (the MetaSchedule JSON database, written as tuning goes, so
a killed compile resumes from it), ``model.so`` with its sidecar, and ``entry.json``, written last,
which marks the entry complete. The root is ``$CWM_CACHE``, else ``~/.cache/cwm``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import CwmError
from ..io import atomic_write_text

log = logging.getLogger(__name__)

ENTRY_FILE = "entry.json"
LIBRARY = "model.so"
CACHE_FORMAT = 1


def cache_root() -> Path:
    """``$CWM_CACHE``, else ``~/.cache/cwm``."""
    root = os.environ.get("CWM_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "cwm"


def cache_key(mod, target, trials: int, cost_model: str, seed: int = 0, transfer: bool = False) -> dict:
    """What a tuned model depends on: the imported Relax module's structural hash (its graph and its
    bound weights), the target, the budget, the cost model, the seed, whether schedules were
    transferred, and the pipeline version."""
    from tvm_ffi import structural_hash

    from ..workloads.pipeline import PIPELINE_VERSION

    return {"format": CACHE_FORMAT, "graph": f"{structural_hash(mod) & 0xFFFFFFFFFFFFFFFF:016x}",
            "target": str(target), "trials": int(trials), "cost_model": cost_model, "seed": int(seed),
            "transfer": bool(transfer), "pipeline": PIPELINE_VERSION}


@dataclass
class CacheEntry:
    directory: Path
    key: dict

    @classmethod
    def for_key(cls, key: dict, work_dir=None) -> "CacheEntry":
        """The entry of ``key`` under ``cache_root()``, or ``work_dir`` itself when given."""
        if work_dir is not None:
            return cls(Path(work_dir), key)
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return cls(cache_root() / f"{key['graph']}-{digest}", key)

    @property
    def db(self) -> Path:
        return self.directory / "db"

    @property
    def library(self) -> Path:
        return self.directory / LIBRARY

    @contextmanager
    def lock(self, timeout: float = -1):
        """Hold the entry's file lock (``<entry>.lock`` beside it): a second compile of the same model
        waits, then finds the entry complete."""
        from filelock import FileLock

        self.directory.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.directory.parent / f"{self.directory.name}.lock"), timeout=timeout):
            yield self

    def complete(self) -> dict | None:
        """The finished entry's record, or None when it is not finished (tuning resumes) or is for
        another key. A corrupt finished entry loses its record and library, with a warning (they are rebuilt from
        its database), and None is returned."""
        path = self.directory / ENTRY_FILE
        if not path.exists():
            return None
        try:
            meta = json.loads(path.read_text())
            if not isinstance(meta, dict) or not isinstance(meta.get("key"), dict):
                raise ValueError("not an entry record")
        except (OSError, ValueError) as err:
            self.discard(f"{path.name} is unreadable ({err})")
            return None
        if meta["key"] != self.key:  # a work directory reused with another budget: keep its records
            path.unlink(missing_ok=True)
            return None
        digest = file_digest(self.library)
        if digest != meta.get("library_sha1"):
            self.discard(f"{self.library.name} is missing" if digest is None else
                         f"{self.library.name} is not the library that was built")
            return None
        try:
            from ..deploy.runtime import LoadedNetwork

            LoadedNetwork(self.library)
        except CwmError as err:
            self.discard(str(err))
            return None
        return meta

    def check_database(self) -> None:
        """Remove a database that cannot be read (tuning then starts over), with a warning."""
        from ..data.database import load_raw

        try:
            load_raw(self.db, missing_ok=True)
        except CwmError as err:
            self.discard_database(str(err))

    def discard(self, why: str) -> None:
        """Drop the entry's record and library (rebuilt from its database, which is kept)."""
        log.warning("cache entry %s is corrupt (%s); rebuilding it", self.directory, why)
        (self.directory / ENTRY_FILE).unlink(missing_ok=True)
        for path in self.directory.glob(LIBRARY + "*"):
            path.unlink(missing_ok=True)

    def discard_database(self, why: str) -> None:
        log.warning("cache entry %s has a corrupt database (%s); tuning it again", self.directory, why)
        shutil.rmtree(self.db, ignore_errors=True)

    def finish(self, record: dict) -> None:
        """Mark the entry complete: its record, with the key and the library's digest, written last."""
        record = {"key": self.key, "library_sha1": file_digest(self.library), **record}
        atomic_write_text(self.directory / ENTRY_FILE, json.dumps(record, indent=1) + "\n")


def file_digest(path: Path) -> str | None:
    """The SHA-1 of a file, None if it does not exist."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha1").hexdigest()
    except FileNotFoundError:
        return None

