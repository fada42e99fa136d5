"""Schedules transferred from measured tasks: the first candidates of a task no one has tuned.

A world model directory carries the best measured schedules of the tasks it was trained on
(``TRANSFER_FILE``, written by ``write_transfer_schedules``). For a new task, the most similar of
those tasks (the same kind, the closest buffer shapes) lend their best traces. Each is replayed on
the new task with its tile sizes refitted to the new loop extents (the nearest perfect tiling), and
those that replay are measured first, from the task's own budget: the evolutionary search then
starts from the database that holds them. TenSet showed that transfer from measured tasks makes
small budgets go far; this is its cheapest form.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
from pathlib import Path

from ..errors import CwmError
from ..io import atomic_write_bytes
from .actions import trace_json_from_actions, trace_key, trace_to_json
from .tir import buffer_shapes

log = logging.getLogger(__name__)

TRANSFER_FILE = "transfer_schedules.json.gz"
# Transferred candidates measured per task before its search (from its budget).
TRANSFER_CANDIDATES = 2
# Best traces kept per training task and machine.
TRACES_PER_TASK = 3
# Similar tasks tried per new task, most similar first.
SOURCE_TASKS = 4


def shape_distance(a: tuple, b: tuple) -> float | None:
    """Sum of |log(x/y)| over the dimensions of two tasks' buffers; None when their buffers differ in
    number or rank (a trace of one cannot fit the other's loops)."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return None
    return sum(abs(math.log(max(x, 1) / max(y, 1))) for sx, sy in zip(a, b) for x, y in zip(sx, sy))


def transfer_schedules_bytes(ds, task_ids) -> bytes:
    """The ``TRANSFER_FILE`` of ``task_ids``: the ``TRACES_PER_TASK`` fastest valid traces of each task per
    machine, with the task's kind, shapes and TensorIR (gzipped JSON)."""
    entries = []
    for tid in sorted(set(task_ids) & set(ds.by_task)):
        by_machine: dict[str, list] = {}
        for traj in sorted((t for t in ds.by_task[tid] if t.valid), key=lambda t: t.latency):
            kept = by_machine.setdefault(traj.machine, [])
            if len(kept) < TRACES_PER_TASK:
                kept.append({"latency": traj.latency, "trace": trace_json_from_actions(traj.actions)})
        if by_machine:
            info, mod = ds.tasks[tid], ds.modules[tid]
            entries.append({"id": tid, "name": info.name, "kind": info.kind,
                            "shapes": [list(s) for s in buffer_shapes(mod)], "script": mod.script(),
                            "bests": by_machine})
    payload = {"format_version": 1, "tasks": entries}
    return gzip.compress(json.dumps(payload).encode("utf-8"), mtime=0)


def write_transfer_schedules(ds, task_ids, model_dir) -> Path:
    """Add the ``TRANSFER_FILE`` of ``task_ids`` to a world model directory (``cwm train`` writes it
    with the model)."""
    path = Path(model_dir) / TRANSFER_FILE
    atomic_write_bytes(path, transfer_schedules_bytes(ds, task_ids))
    return path


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def refit_tiling(extent: int, factors: list[int]) -> list[int]:
    """A perfect tiling of ``extent`` (the factors multiply to it) close to ``factors`` in log scale:
    the inner factors are kept nearest first, the outermost takes what is left."""
    new, rest = [1] * len(factors), extent
    for i in range(len(factors) - 1, 0, -1):
        want = max(1, int(factors[i]))
        new[i] = min(_divisors(rest), key=lambda d: (abs(math.log(d / want)), d))
        rest //= new[i]
    new[0] = rest
    return new


def _refitted_decisions(sch):
    """A decision provider for ``Trace.apply_to_schedule``: tile sizes refitted to ``sch``'s loops."""

    def provide(inst, inputs, attrs, decision):
        if inst.kind.name == "SamplePerfectTile" and decision is not None:
            extent = int(sch.get(inputs[0]).extent)
            factors = [int(x) for x in decision]
            if math.prod(factors) != extent:
                return refit_tiling(extent, factors)
        return decision

    return provide


def block_names(sch) -> list[str]:
    """The names of the blocks under the root block of ``sch``'s ``main``, in program order."""
    return [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]


def renamed_blocks(trace, rename: dict[str, str]):
    """``trace`` with the block names of its ``GetSBlock`` instructions mapped through ``rename``.

    Relax names a fused task's blocks after its variables (``lv227_red`` in one network, ``lv200_red``
    in the next), so a trace of the same computation does not find its blocks by name elsewhere."""
    from tvm.s_tir.schedule import Instruction, Trace

    insts, decisions = [], {}
    for inst in trace.insts:
        attrs = list(inst.attrs)
        if inst.kind.name == "GetSBlock" and attrs and str(attrs[0]) in rename:
            attrs[0] = rename[str(attrs[0])]
        new = Instruction(inst.kind, list(inst.inputs), attrs, list(inst.outputs))
        insts.append(new)
        decision = trace.get_decision(inst)
        if decision is not None:
            decisions[new] = decision
    return Trace(insts, decisions)


class TransferSource:
    """The best schedules of a world model's training tasks, to seed the search of new tasks."""

    def __init__(self, entries: list[dict]):
        self.entries = entries
        self._mods: dict[str, object] = {}

    @classmethod
    def load(cls, path) -> "TransferSource":
        path = Path(path)
        try:
            payload = json.loads(gzip.decompress(path.read_bytes()))
        except FileNotFoundError:
            raise CwmError(f"{path} does not exist: this world model carries no transferable schedules "
                           f"(see cwm.schedule.transfer.write_transfer_schedules)") from None
        except (OSError, ValueError, EOFError) as err:
            raise CwmError(f"{path} is not a transfer-schedule file: {err}") from None
        if not isinstance(payload, dict) or payload.get("format_version") != 1:
            raise CwmError(f"{path} is not a transfer-schedule file of format version 1")
        return cls(payload["tasks"])

    @classmethod
    def for_model(cls, model_dir) -> "TransferSource | None":
        """The model directory's file, or None (with a log line) when it has none."""
        path = Path(model_dir) / TRANSFER_FILE
        if not path.is_file():
            log.info("%s has no %s: no schedules to transfer", model_dir, TRANSFER_FILE)
            return None
        return cls.load(path)

    def add_tuned(self, task, machine: str | None, latency: float, trace) -> None:
        """Lend ``task``'s best schedule of this run to the tasks tuned after it: those of the same
        network share its layouts and fused epilogues, which the training tasks may not (they come
        first in ``similar``)."""
        self.entries = [e for e in self.entries if e["id"] != task.id]
        self.entries.append({"id": task.id, "name": task.name, "kind": task.kind, "this_run": True,
                             "shapes": [list(x) for x in buffer_shapes(task.mod)], "script": None,
                             "bests": {machine or "": [{"latency": latency, "trace": trace}]}})
        self._mods[task.id] = task.mod

    def _module(self, entry: dict):
        if entry["id"] not in self._mods:
            import tvm

            self._mods[entry["id"]] = tvm.script.from_source(entry["script"])
        return self._mods[entry["id"]]

    def similar(self, task) -> list[tuple[float, dict]]:
        """(distance, entry) of the tasks of ``task``'s kind whose buffers fit: those tuned earlier in this
        run first (``add_tuned``), then the training tasks, nearest first within each; the task itself is
        never its own source."""
        shapes = buffer_shapes(task.mod)
        found = []
        for e in self.entries:
            if e["kind"] != task.kind or e["id"] == task.id:
                continue
            d = shape_distance(shapes, tuple(tuple(s) for s in e["shapes"]))
            if d is not None:
                found.append((d, e))
        found.sort(key=lambda x: (not x[1].get("this_run"), x[0], x[1]["id"]))
        return found[:SOURCE_TASKS]

    def schedules(self, task, machine: str | None, limit: int = TRANSFER_CANDIDATES) -> list:
        """Up to ``limit`` schedules of ``task`` (``s_tir.Schedule``, without postprocessing) replayed
        from the best traces of its most similar training tasks, this machine's records first."""
        from tvm import s_tir

        out, seen = [], set()
        for _, entry in self.similar(task):
            if len(out) >= limit:
                break
            traces = [b["trace"] for m in sorted(entry["bests"], key=lambda m: (m != machine, m))
                      for b in entry["bests"][m]]
            for trace in traces:  # the first that replays: each similar task lends one schedule
                try:
                    src = s_tir.Schedule(self._module(entry), debug_mask="none")
                    source_blocks = block_names(src)
                    s_tir.Trace.apply_json_to_schedule(trace, src)
                    sch = s_tir.Schedule(task.mod, debug_mask="none")
                    # the same computation's blocks, in the same order, under other names
                    target_blocks = block_names(sch)
                    rename = dict(zip(source_blocks, target_blocks)) if len(source_blocks) == len(target_blocks) else {}
                    renamed_blocks(src.trace, rename).apply_to_schedule(
                        sch, remove_postproc=True, decision_provider=_refitted_decisions(sch))
                except Exception as err:  # TVM raises its own errors when a trace does not fit
                    log.debug("%s: a trace of %s does not replay: %s", task.name, entry["name"], err)
                    continue
                key = trace_key(trace_to_json(sch.trace))
                if key not in seen:
                    seen.add(key)
                    out.append(sch)
                    break
        return out
