"""Train/validation/test split of a database, by task."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import CwmError
from .database import TaskInfo

# Held-out kinds/shapes for the test split: a kind never seen in training (pooling) and
# shapes that differ from training ones only syntactically (N=1023 vs 1024).
_FORCED_TEST = ("max_pool2d:", "avg_pool2d:", "matmul:M=1024,N=1023,K=1024", "depthwise_conv2d:N=1,C=96,")


def make_split(tasks: dict[str, TaskInfo], seed: int = 0, fractions=(0.70, 0.15, 0.15)) -> dict[str, list[str]]:
    """Split task ids into train/val/test, by task, never by record.

    Forced test tasks hold out an operator kind and unseen shapes; the rest is assigned by a
    seeded shuffle stratified by operator kind so every split sees most kinds.
    """
    rng = np.random.default_rng(seed)
    forced = sorted(t for t, info in tasks.items() if info.name.startswith(_FORCED_TEST))
    rest = sorted(set(tasks) - set(forced), key=lambda t: (tasks[t].kind, tasks[t].name))
    n = len(tasks)
    n_test = max(len(forced), round(fractions[2] * n))
    n_val = max(1, round(fractions[1] * n)) if n >= 3 else 0
    by_kind: dict[str, list[str]] = {}
    for t in rest:
        by_kind.setdefault(tasks[t].kind, []).append(t)
    # Round-robin over kinds so val/test draw from different kinds.
    order = []
    pools = [list(rng.permutation(v)) for _, v in sorted(by_kind.items())]
    while any(pools):
        for pool in pools:
            if pool:
                order.append(str(pool.pop()))
    test = forced + order[: max(0, n_test - len(forced))]
    order = order[max(0, n_test - len(forced)):]
    val, train = order[:n_val], order[n_val:]
    return {"train": sorted(train), "val": sorted(val), "test": sorted(test)}


def load_split(path: str | os.PathLike) -> dict[str, list[str]]:
    path = Path(path)
    if not path.exists():
        raise CwmError(f"split file {path} does not exist")
    try:
        split = json.loads(path.read_text())
    except OSError as err:
        raise CwmError(f"cannot read split file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise CwmError(f"split file {path} is not a text file (see `cwm dataset split`)") from None
    except ValueError as err:
        raise CwmError(f"split file {path} is not valid JSON: {err}") from None
    if not isinstance(split, dict):
        raise CwmError(f"split file {path} must hold a JSON object with train/val/test lists")
    for key in ("train", "val", "test"):
        if key not in split:
            raise CwmError(f"split file {path} has no {key!r} list")
        if not isinstance(split[key], list) or not all(isinstance(t, str) for t in split[key]):
            raise CwmError(f"split file {path}: {key!r} must be a list of task ids")
    return split
