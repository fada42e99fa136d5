"""Deployment: turn a tuned MetaSchedule database into a network executable, run it, time it.

The path from a tuned database to a shared library is::

    Relax module (params bound)  --zero pipeline-->  fused TIR subgraphs (the tasks)
        [CPU: weights marked layout-free, so schedules may choose their layout]
        --MetaScheduleApplyDatabase-->  tuned subgraphs marked ``tirx.is_scheduled``
        [CPU: the weight layout rewrites folded into the constants at build time]
        --tvm.compile (default Relax/TIR lowering)-->  VM executable  --export-->  .so

``MetaScheduleApplyDatabase`` replaces every PrimFunc it finds in the database by the best
schedule's module and sets the ``tirx.is_scheduled`` attribute on it (see the C++ pass
``relax.transform.MetaScheduleApplyDatabase``; the attribute name is in libtvm_compiler.so and the
Python tooling, e.g. ``tvm.s_tir.dlight`` and ``relax_integration``, reads the same key).
``build_network`` counts that attribute per task, so a build that silently ran untuned
(a database for another network, target or a pipeline bug) shows ``tuned_tasks == 0``.
PrimFuncs without a record keep their unscheduled (naive loop nest) form; TVM's CPU TIR
lowering compiles them as they are, so the module still runs, only slower. On GPU targets
they get DLight's default schedules (they need thread bindings to compile).

The database is read through a filter: MetaSchedule's ``QueryTuningRecord`` ignores a record's
target (verified: a record for target kind "c" is applied to an llvm build), so only records for
the build's target kind are offered to the pass, the best valid one per workload; records for
another CPU of the same kind are used when nothing else is there, and named in the result.
Before fusion, ``rewrite_bool_ops`` works around two bool codegen gaps of TVM 0.27 (GPT-2's mask)
and ``rewrite_fast_math`` replaces per-element libm calls (GELU's erf, tanh, pow) by vectorizable code.

Each exported library gets a sidecar ``<lib>.json`` with the input/output signature of
``main`` (the VM executable stores parameter names but not shapes), so ``load_and_run`` can
reject a wrong input before the VM sees it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data.database import RECORD_FILE, load_raw, open_database, valid_run_secs
from ..errors import CwmError, first_line
from ..hardware import as_target
from ..io import atomic_write_text
from ..workloads.networks import get_network, relax_module
from ..workloads.pipeline import (
    _calls_in,
    conv_layout_of,
    default_conv_layout,
    default_weight_prepack,
    fast_math_counts,
    fused_module,
    relax_op_counts,
)
from .runtime import read_sidecar, sidecar_path

log = logging.getLogger(__name__)

SCHEDULED_ATTR = "tirx.is_scheduled"  # set by MetaScheduleApplyDatabase on every function it replaced
LAYOUT_FREE_ATTR = "layout_free_buffers"  # set by AttachAttrLayoutFreeBuffers (weight prepacking)


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


@dataclass
class BuildResult:
    """What ``build_network`` produced and how much of it is tuned."""

    lib_path: Path | None
    target: str
    db_dir: Path | None
    total_tasks: int  # distinct fused TIR subgraphs (MetaSchedule tasks) in the network
    tuned_tasks: int  # of those, how many got a schedule from the database (tirx.is_scheduled)
    missing: list[str] = field(default_factory=list)  # task names without a usable record
    tuned: list[str] = field(default_factory=list)
    other_target: list[str] = field(default_factory=list)  # tuned from records of another CPU/model of the same kind
    skipped_records: int = 0  # valid records ignored: for another target kind
    seconds: float = 0.0
    signature: dict = field(default_factory=dict)  # {"inputs": [...], "outputs": [...]}
    relax_ops: dict = field(default_factory=dict)  # Relax operator counts before fusion
    fast_math: dict = field(default_factory=dict)  # calls replaced by rewrite_fast_math, per op
    weight_prepack: bool = False  # tasks extracted with layout-free weights (see fused_module)
    conv_layout: str | None = None  # data layout of the 2-D convolutions (see fused_module); None: none
    prepacked: list[str] = field(default_factory=list)  # kernels whose weights were laid out at build time
    executable: object = field(default=None, repr=False)

    @property
    def fully_tuned(self) -> bool:
        return self.total_tasks > 0 and self.tuned_tasks == self.total_tasks

    def as_json(self) -> dict:
        return {
            "lib_path": str(self.lib_path) if self.lib_path else None,
            "target": self.target,
            "db_dir": str(self.db_dir) if self.db_dir else None,
            "total_tasks": self.total_tasks,
            "tuned_tasks": self.tuned_tasks,
            "missing": list(self.missing),
            "tuned": list(self.tuned),
            "other_target": list(self.other_target),
            "skipped_records": self.skipped_records,
            "seconds": round(self.seconds, 2),
            "signature": self.signature,
            "relax_ops": self.relax_ops,
            "fast_math": self.fast_math,
            "weight_prepack": self.weight_prepack,
            "conv_layout": self.conv_layout,
            "prepacked": list(self.prepacked),
        }


def _same_target(a, b) -> bool:
    return str(a) == str(b)


@dataclass
class _UsableRecords:
    """The records of a database that a build for one target can use (see ``_filtered_database``)."""

    database: object  # MemoryDatabase with the best usable record per workload
    other_target: set = field(default_factory=set)  # hashes of workloads tuned for another target of the kind
    dropped: int = 0  # valid records for another target kind
    prepacked: bool | None = None  # tuned with weight prepacking (None: no records)
    conv_layout: str | None = None  # convolution layout the tasks were tuned in (None: no convolutions)


def _filtered_database(db_dir: Path, target) -> _UsableRecords:
    """The best valid record per workload that suits ``target``, and how its tasks were extracted.

    MetaSchedule's ``QueryTuningRecord`` ignores the record's target, so a CUDA database would
    be applied to a CPU build (and fail there). Records of another target kind are dropped (their
    tasks count as missing); records of the same kind but another target (another CPU model or
    core count) are used when no exact-target record exists, and reported.
    """
    import tvm.s_tir.meta_schedule as ms
    from tvm_ffi import structural_hash

    if not (db_dir / RECORD_FILE).exists():
        load_raw(db_dir)  # a clear CwmError if the workload file is missing too
        log.warning("%s has no %s: no tuning records", db_dir, RECORD_FILE)
        return _UsableRecords(ms.database.MemoryDatabase())
    json_db = open_database(db_dir, create=False)
    best: dict[int, tuple[int, float, object]] = {}  # workload hash -> (rank, latency, record)
    dropped = 0
    for rec in json_db.get_all_tuning_records():
        secs = [float(s) for s in (rec.run_secs or [])]
        if not valid_run_secs(secs):
            continue
        rec_target = rec.target
        if rec_target is None or rec_target.kind.name != target.kind.name:
            dropped += 1
            continue
        rank = 0 if _same_target(rec_target, target) else 1
        lat = sum(secs) / len(secs)
        key = structural_hash(rec.workload.mod)
        if key not in best or (rank, lat) < best[key][:2]:
            best[key] = (rank, lat, rec)
    mem = ms.database.MemoryDatabase()
    other = []
    for rank, _, rec in best.values():
        workload = mem.commit_workload(rec.workload.mod)
        mem.commit_tuning_record(
            ms.database.TuningRecord(rec.trace, workload, rec.run_secs, rec.target, rec.args_info)
        )
        if rank:
            other.append(structural_hash(rec.workload.mod))
    prepacked = any(_marks_layout_free(rec.workload.mod) for _, _, rec in best.values()) if best else None
    layouts = {conv_layout_of(rec.workload.mod) for _, _, rec in best.values()} - {None}
    if len(layouts) > 1:
        log.warning("%s mixes convolution layouts (%s); using %s", db_dir, ", ".join(sorted(layouts)),
                    default_conv_layout(target))
    conv_layout = layouts.pop() if len(layouts) == 1 else None
    return _UsableRecords(mem, set(other), dropped, prepacked, conv_layout)


def _marks_layout_free(mod) -> bool:
    attrs = mod["main"].attrs
    return bool(attrs and LAYOUT_FREE_ATTR in attrs)


def _signature(mod) -> dict:
    """Input and output shapes/dtypes of ``main`` (symbolic dims as strings)."""

    def ty(node):  # the Relax type of a Var/Function (``ty`` in TVM 0.27, ``struct_info`` before)
        return getattr(node, "ty", None) or getattr(node, "struct_info", None)

    def describe(t, name=None):
        fields = getattr(t, "fields", None)
        if fields is not None:
            return [d for f in fields for d in describe(f)]
        shape = getattr(t, "shape", None)
        values = getattr(shape, "values", None)
        dims = None if values is None else [int(v.value) if hasattr(v, "value") else str(v) for v in values]
        d = {"shape": dims, "dtype": str(t.dtype) if getattr(t, "dtype", None) is not None else None}
        if name is not None:
            d["name"] = name
        return [d]

    main = mod["main"]
    inputs = [describe(ty(p), str(getattr(p, "name", None) or getattr(p, "name_hint", "")))[0]
              for p in main.params]
    ret = getattr(main, "ret_ty", None) or getattr(main, "ret_struct_info", None)
    return {"inputs": inputs, "outputs": describe(ret)}


def _task_gvars(fused_mod, target):
    """(task name, [PrimFunc names]) per extracted task: structurally equal PrimFuncs share one task."""
    import tvm
    import tvm.s_tir.meta_schedule as ms
    from tvm_ffi import structural_hash

    extracted = ms.relax_integration.extract_tasks(fused_mod, target)
    by_hash: dict[int, str] = {}
    for ext in extracted:
        by_hash[structural_hash(ext.dispatched[0])] = str(ext.task_name)
    groups: dict[str, list[str]] = {str(ext.task_name): [] for ext in extracted}
    for gv, func in fused_mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        norm = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        name = by_hash.get(structural_hash(norm), gv.name_hint)
        if name in groups:
            groups[name].append(gv.name_hint)
        elif gv.name_hint in groups:
            groups[gv.name_hint].append(gv.name_hint)
    for name, gvs in groups.items():
        if not gvs and name in {gv.name_hint for gv in fused_mod.get_global_vars()}:
            gvs.append(name)
    return groups


PREPACKED_SUFFIX = "_prepacked"  # SplitLayoutRewritePreproc's name for a kernel on prepacked weights


def _prepack_weights(mod, target):
    """Split the weight-layout rewrites off the tuned kernels and fold them into the constant weights.

    ``SplitLayoutRewritePreproc`` turns each kernel with a layout-rewrite block into
    ``<kernel>_weight_prepack`` (the rewrite) and ``<kernel>_prepacked`` (the kernel on rewritten
    weights); ``FoldConstant`` then runs the rewrites on the bound weights once, at build time.
    Returns (module, names of the prepacked kernels). A rewrite left in ``main`` (weights passed as
    inputs instead of bound) runs at every call, which is correct but slow, and is logged.
    """
    import tvm
    from tvm import relax

    with target, tvm.transform.PassContext(opt_level=3):
        mod = tvm.transform.Sequential(
            [relax.transform.SplitLayoutRewritePreproc(), relax.transform.FoldConstant()])(mod)
    names = sorted(gv.name_hint for gv in mod.get_global_vars() if gv.name_hint.endswith(PREPACKED_SUFFIX))
    left = sorted({call.args[0].name_hint for call in _calls_in(mod["main"])
                   if call.args and getattr(call.args[0], "name_hint", "").endswith("_weight_prepack")})
    if left:
        log.warning("%d weight layout rewrite(s) run at every call, since their weights are not constants: %s",
                    len(left), ", ".join(left))
    return mod, names


def build_network(module_or_name, db_dir=None, target=None, out_path=None,
                  weight_prepack: bool | None = None, conv_layout: str | None = None) -> BuildResult:
    """Compile a network with the schedules of a tuned MetaSchedule database.

    ``module_or_name`` is a Relax IRModule (as from ``relax_from_torch``) or a network name
    (``cwm.workloads.NETWORKS``). ``db_dir`` is the JSON database directory; ``None`` builds
    the untuned baseline on purpose (no warning). A directory that does not exist, or that holds
    files but no ``database_workload.json``, is a ``CwmError``; an existing empty directory is
    an empty database (everything falls back, with a warning). Tasks without a usable record
    are listed in ``missing`` and logged as a warning; they compile with TVM's default lowering.
    ``out_path`` (a ``.so``) gets the exported library and a ``<out_path>.json`` sidecar.

    ``weight_prepack`` and ``conv_layout`` (see ``fused_module``) must match how the database was
    tuned, since they change the tasks; by default they follow the database's records (a database
    tuned before prepacking or NHWC existed builds without them) and, without records, the
    target's defaults.
    Prepacked weights are transformed once, at build time: the layout-rewrite blocks of the tuned
    schedules are split off (``SplitLayoutRewritePreproc``) and folded into the constants.
    """
    import tvm
    from tvm import relax

    start = time.time()
    target = as_target(target)
    if not isinstance(module_or_name, (str, tvm.IRModule)):
        raise CwmError(f"build_network needs a Relax IRModule or a network name, got {type(module_or_name).__name__}")
    if isinstance(module_or_name, str):
        get_network(module_or_name)  # an unknown name is a CwmError before any work
    records = _UsableRecords(None)
    if db_dir is not None:
        db_dir = Path(db_dir)
        if not db_dir.exists():
            raise CwmError(f"database directory {db_dir} does not exist")
        if not db_dir.is_dir():
            raise CwmError(f"database path {db_dir} is not a directory")
        if not any(db_dir.iterdir()):
            log.warning("database directory %s is empty: building untuned", db_dir)
        else:
            records = _filtered_database(db_dir, target)
    database, other_hashes, dropped = records.database, records.other_target, records.dropped
    if weight_prepack is None:
        weight_prepack = default_weight_prepack(target) if records.prepacked is None else records.prepacked
    if conv_layout is None:
        conv_layout = records.conv_layout or default_conv_layout(target)

    if isinstance(module_or_name, str):
        mod = relax_module(module_or_name, target)
    else:
        mod = module_or_name
    if "main" not in {gv.name_hint for gv in mod.get_global_vars()}:
        raise CwmError("the Relax module has no 'main' function")

    relax_ops = relax_op_counts(mod)
    fused = fused_module(mod, target, weight_prepack, conv_layout)
    groups = _task_gvars(fused, target)
    pre_scheduled = {gv.name_hint for gv, f in fused.functions.items()
                     if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and f.attrs.get(SCHEDULED_ATTR, False)}
    groups = {name: gvs for name, gvs in groups.items() if not set(gvs) & pre_scheduled}

    if database is not None:
        with target, database, tvm.transform.PassContext(opt_level=3):
            applied = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(fused)
    else:
        applied = fused

    scheduled = {gv.name_hint for gv, f in applied.functions.items()
                 if isinstance(f, tvm.tirx.PrimFunc) and f.attrs and bool(f.attrs.get(SCHEDULED_ATTR, False))}
    tuned = sorted(name for name, gvs in groups.items() if gvs and all(g in scheduled for g in gvs))
    missing = sorted(name for name in groups if name not in tuned)
    other = []
    if other_hashes:
        from tvm_ffi import structural_hash

        for gv, f in fused.functions.items():
            if isinstance(f, tvm.tirx.PrimFunc) and gv.name_hint in scheduled:
                norm = tvm.IRModule({"main": f.with_attr("global_symbol", "main")})
                if structural_hash(norm) in other_hashes:
                    other.append(gv.name_hint)
    if db_dir is not None and missing:
        log.warning("%d of %d tasks have no tuning record for %s in %s and use the default "
                    "(untuned) schedule: %s", len(missing), len(groups), target.kind.name, db_dir,
                    ", ".join(missing))
    if dropped:
        log.warning("%s: ignored %d record(s) tuned for another kind of target than %s",
                    db_dir, dropped, target.kind.name)
    if other:
        log.warning("%d task(s) use records tuned for another %s target than %s: %s",
                    len(other), target.kind.name, target, ", ".join(sorted(other)))

    prepacked = []
    if weight_prepack and database is not None:
        applied, prepacked = _prepack_weights(applied, target)

    if "gpu" in target.keys:
        from tvm.s_tir import dlight as dl

        with target:
            applied = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                              dl.gpu.GeneralReduction(), dl.gpu.Fallback())(applied)
    try:
        with target, tvm.transform.PassContext(opt_level=3):
            # The default pipeline here only legalizes leftovers and lowers; it does not re-fuse,
            # so the scheduled PrimFuncs reach codegen as they are.
            executable = tvm.compile(applied, target=target)
    except Exception as err:
        raise CwmError(f"compiling the network for {target.kind.name} failed: {first_line(err)}") from err

    signature = _signature(mod)
    result = BuildResult(
        lib_path=None, target=str(target), db_dir=db_dir, total_tasks=len(groups), tuned_tasks=len(tuned),
        missing=missing, tuned=tuned, other_target=sorted(other), skipped_records=dropped,
        signature=signature, relax_ops=relax_ops, fast_math=fast_math_counts(mod), weight_prepack=weight_prepack,
        conv_layout=conv_layout if relax_ops.get("relax.nn.conv2d") else None, prepacked=prepacked,
        executable=executable,
    )
    if out_path is not None:
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_path.with_name(f".{out_path.name}.tmp{os.getpid()}.so")
        try:
            executable.export_library(str(tmp))
            os.replace(tmp, out_path)
        except Exception as err:
            tmp.unlink(missing_ok=True)
            raise CwmError(f"exporting the library to {out_path} failed: {first_line(err)}") from err
        result.lib_path = out_path
    result.seconds = time.time() - start
    if out_path is not None:
        atomic_write_text(sidecar_path(out_path), json.dumps(result.as_json(), indent=1) + "\n")
    return result


def random_inputs(lib_path, seed: int = 0) -> list[np.ndarray]:
    """Random inputs matching the input signature recorded beside a library by ``build_network``."""
    lib_path = Path(lib_path)
    if not lib_path.exists():
        raise CwmError(f"library {lib_path} does not exist")
    meta = read_sidecar(lib_path)
    if meta is None:
        raise CwmError(f"{lib_path} has no shape sidecar {sidecar_path(lib_path).name}; "
                       "its input shapes are unknown (`cwm run --network NAME` uses the network's inputs)")
    rng = np.random.default_rng(seed)
    inputs = []
    for i, spec in enumerate(meta.get("signature", {}).get("inputs", [])):
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if shape is None or not all(isinstance(d, int) for d in shape) or not dtype:
            raise CwmError(f"input {i} ({spec.get('name', '?')}) of {lib_path.name} has no static shape "
                           f"({shape} {dtype}); random inputs cannot be made for it")
        inputs.append(rng.standard_normal(shape).astype(dtype))
    return inputs
