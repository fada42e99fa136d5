"""The committed datasets: packing a database with its manifest, and resolving ``--db NAME``.

``reference`` is the first dataset (one machine, 41 tasks); ``v2`` the larger one, merged from the
committed tuning logs of several machines and a collection of more networks and operators.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import CwmError
from ..io import atomic_file, atomic_write_text, ensure_directory
from .database import FAILURE_FILE, MANIFEST_FILE, TASK_INDEX_FILE
from .dataset import load_dataset

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
REFERENCE_DIR = DATA_DIR / "reference"
REFERENCE_ARCHIVE = "reference_db.tar.gz"
# Committed datasets by name: what ``--db NAME`` unpacks.
DATASETS = {"reference": REFERENCE_DIR / REFERENCE_ARCHIVE, "v2": DATA_DIR / "v2" / "dataset_v2.tar.gz"}
# The shipped world model's training data: the baselines trained on the same records (xgb-pretrained)
# and the benchmarks' held-out checks default to these.
SHIPPED_TRAINING_DB = "v2"
SHIPPED_TRAINING_SPLIT = DATA_DIR / "v2" / "split_v2.json"


def pack_database(db_dir: str | os.PathLike, out_dir: str | os.PathLike, split: dict | None = None,
                  archive: str = REFERENCE_ARCHIVE) -> dict:
    """Compress a database directory into ``out_dir/archive`` with a manifest (MANIFEST.json: machines,
    targets, TVM version, date, counts per task and per machine)."""
    import tarfile
    import time

    import tvm

    db_dir, out_dir = Path(db_dir), Path(out_dir)
    ds = load_dataset(db_dir)
    ensure_directory(out_dir, "output directory")
    stats = ds.stats()
    with atomic_file(out_dir / archive) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for name in ("database_workload.json", "database_tuning_record.json", TASK_INDEX_FILE, MANIFEST_FILE,
                     FAILURE_FILE):
            if (db_dir / name).exists():
                tar.add(db_dir / name, arcname=f"db/{name}")
    manifest = json.loads((db_dir / MANIFEST_FILE).read_text()) if (db_dir / MANIFEST_FILE).exists() else {}
    valid_per_task = [row["valid"] for row in stats["per_task"].values()]
    summary = {
        "archive": archive,
        "machine": manifest.get("hardware", {}),
        "cpu": manifest.get("hardware", {}).get("model"),
        "target": manifest.get("target"),
        "tvm_version": tvm.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "tasks": stats["tasks"],
        "records": stats["records"],
        "valid": stats["valid"],
        "failed": stats["failed"],
        "tasks_with_200_valid": sum(v >= 200 for v in valid_per_task),
        "min_valid_per_task": min(valid_per_task) if valid_per_task else 0,
        "machines": {name: {k: row[k] for k in ("records", "valid", "failed", "tasks", "hardware")}
                     for name, row in stats["per_machine"].items()},
        "split": {k: len(v) for k, v in (split or {}).items() if k not in ("names", "held_out")},
        "per_task": {row["name"]: {"valid": row["valid"], "failed": row["failed"], "best_ms": row["best_ms"],
                                   **({"per_machine": row["per_machine"]} if "per_machine" in row else {})}
                     for row in stats["per_task"].values()},
    }
    atomic_write_text(out_dir / "MANIFEST.json", json.dumps(summary, indent=1) + "\n")
    return summary


def resolve_db(path: str | os.PathLike) -> Path:
    """A database directory; a name of ``DATASETS`` (``reference``, ``v2``) means that committed dataset,
    unpacked once into the cache (``CWM_CACHE``, else ``~/.cache/cwm``)."""
    import tarfile

    name = str(path)
    if name not in DATASETS:
        return Path(path)
    archive = DATASETS[name]
    if not archive.exists():
        raise CwmError(f"the {name} dataset {archive} is missing from this checkout")
    digest = hashlib.sha1(archive.read_bytes()).hexdigest()[:12]
    target = Path(os.environ.get("CWM_CACHE", Path.home() / ".cache" / "cwm")) / f"{name}-{digest}"
    if not (target / "db" / "database_workload.json").exists():
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            import shutil

            shutil.rmtree(target)
        os.replace(tmp, target)
    return target / "db"
