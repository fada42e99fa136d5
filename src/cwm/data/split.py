"""Train/validation/test split of a database, by task."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ..errors import CwmError
from ..schedule.tir import buffer_shapes
from ..workloads.reference import HELD_OUT_SUBGRAPHS
from .database import TaskInfo

# Held-out kinds/shapes for the test split: a kind never seen in training (pooling), shapes that
# differ from training ones only syntactically (N=1023 vs 1024), and the search benchmark's subgraphs.
_FORCED_TEST = ("max_pool2d:", "avg_pool2d:", "matmul:M=1024,N=1023,K=1024", "depthwise_conv2d:N=1,C=96,",
                *HELD_OUT_SUBGRAPHS)
# Two shapes are near-duplicates when they differ in one dimension by at most this fraction.
NEAR_DUPLICATE_TOLERANCE = 0.02


def task_shapes(modules: dict[str, object]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Task id -> the shapes of its PrimFunc's buffers (parameters), from the tasks' IRModules."""
    return {tid: buffer_shapes(mod) for tid, mod in modules.items()}


def near_duplicates(a: tuple, b: tuple, tolerance: float = NEAR_DUPLICATE_TOLERANCE) -> bool:
    """Same buffers and ranks, every dimension equal but one, which is off by at most ``tolerance``."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return False
    diffs = [(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb) if x != y]
    if not diffs:
        return True
    # one logical dimension appears in several buffers (N in B and C): every differing pair must be the same
    return len(set(diffs)) == 1 and abs(diffs[0][0] - diffs[0][1]) <= tolerance * max(diffs[0])


def near_duplicate_groups(tasks: dict[str, TaskInfo], shapes: dict[str, tuple]) -> list[list[str]]:
    """Tasks grouped so that near-duplicates (same kind, ``near_duplicates`` shapes) share a group."""
    parent = {t: t for t in tasks}

    def root(t):
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    ids = sorted(t for t in tasks if t in shapes)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            if tasks[a].kind == tasks[b].kind and near_duplicates(shapes[a], shapes[b]):
                parent[root(a)] = root(b)
    groups: dict[str, list[str]] = {}
    for t in sorted(tasks):
        groups.setdefault(root(t), []).append(t)
    return sorted(groups.values())


def tasks_to_leave_out(task_ids, tasks: dict[str, TaskInfo], shapes: dict[str, tuple], *,
                       network: str | None = None) -> set[str]:
    """What holding out ``task_ids`` (a network's tasks, with ``tasks`` and ``shapes`` entries for them)
    rules out of training: those ids, every task recorded under ``network`` (another pipeline version
    gives the same layer another id), and every near-duplicate of these (the same layer shape in a sibling
    network)."""
    seeds = set(task_ids) | ({t for t, info in tasks.items() if info.network == network} if network else set())
    related = {t for group in near_duplicate_groups(tasks, shapes) if seeds & set(group) for t in group}
    return seeds | related


def make_split(tasks: dict[str, TaskInfo], seed: int = 0, fractions=(0.70, 0.15, 0.15), *,
               shapes: dict[str, tuple] | None = None, test_networks=(), test_kinds=()) -> dict[str, list[str]]:
    """Split task ids into train/val/test, by task, never by record.

    Test holds: the forced tasks (an operator kind and unseen shapes), every task of
    ``test_networks`` (leave-network-out: those networks contribute no training task) and of
    ``test_kinds`` (operator kinds absent from training). The rest is assigned by a seeded shuffle,
    round-robin over operator kinds so every split sees most kinds. With ``shapes`` (see
    ``task_shapes``) near-duplicate tasks move as one group, so they never straddle the splits.
    """
    unknown = sorted(set(test_networks) - {t.network for t in tasks.values()})
    if unknown:
        raise CwmError(f"no task of network {unknown[0]!r} in the database; "
                       f"networks: {', '.join(sorted({str(t.network) for t in tasks.values() if t.network}))}")
    unknown = sorted(set(test_kinds) - {t.kind for t in tasks.values()})
    if unknown:
        raise CwmError(f"no task of kind {unknown[0]!r} in the database; "
                       f"kinds: {', '.join(sorted({t.kind for t in tasks.values()}))}")
    rng = np.random.default_rng(seed)
    groups = near_duplicate_groups(tasks, shapes or {})

    def held_out(t: str) -> bool:
        info = tasks[t]
        return (info.name.startswith(_FORCED_TEST) or info.network in test_networks or info.kind in test_kinds)

    forced = [g for g in groups if any(held_out(t) for t in g)]
    rest = [g for g in groups if not any(held_out(t) for t in g)]
    n = len(tasks)
    n_test = max(sum(map(len, forced)), round(fractions[2] * n))
    n_val = max(1, round(fractions[1] * n)) if n >= 3 else 0
    by_kind: dict[str, list[list[str]]] = {}
    for g in sorted(rest, key=lambda g: (tasks[g[0]].kind, tasks[g[0]].name)):
        by_kind.setdefault(tasks[g[0]].kind, []).append(g)
    # Round-robin over kinds so val/test draw from different kinds.
    order: list[list[str]] = []
    pools = [[v[i] for i in rng.permutation(len(v))] for _, v in sorted(by_kind.items())]
    while any(pools):
        for pool in pools:
            if pool:
                order.append(pool.pop())
    test = [t for g in forced for t in g]
    while order and len(test) < n_test:
        test += order.pop(0)
    val = []
    while order and len(val) < n_val:
        val += order.pop(0)
    train = [t for g in order for t in g]
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
