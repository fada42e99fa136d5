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
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .errors import CwmError

log = logging.getLogger(__name__)

SCHEDULED_ATTR = "tirx.is_scheduled"  # set by MetaScheduleApplyDatabase on every function it replaced
LAYOUT_FREE_ATTR = "layout_free_buffers"  # set by AttachAttrLayoutFreeBuffers (weight prepacking)
FAILED_LATENCY = 1e9  # run_secs at or above this are failed candidates (MetaSchedule writes 1e10)

# Comparison tolerances against PyTorch, per model family: keyword arguments of
# ``check_against_torch``. The check is ``|tvm - torch| <= atol * scale + rtol * |torch|``
# elementwise, where ``scale`` is the largest |value| of that PyTorch output when
# ``relative_atol`` is set (1 otherwise): random-init networks produce outputs of very different
# magnitudes (ResNet-18 logits ~3, MobileNetV2's ~2e-9 because its activations shrink layer after
# layer), and a fixed atol of 1e-3 would pass any output of MobileNetV2, even all zeros.
# The differences come from fp32 sums evaluated in another order (tiling, vectorized and split
# reductions), batch norm applied as a precomputed scale and shift, and other exp/erf/tanh code;
# they grow with the reduction length and the depth. Measured max |diff| / max |output| with
# TVM's default lowering (tuned schedules only reorder the same sums): ResNet-18 1e-6,
# MobileNetV2 1.4e-6, BERT-base 1.8e-6, GPT-2 1.8e-6; the MLP and small CNN of the tests ~1e-7.
#  * "mlp": a few dense layers, reductions of at most a few hundred terms: 1e-4, 100x margin.
#  * "cnn": convolutions reducing over up to 3*3*512 = 4608 terms, 18-50 layers deep: 1e-3.
#  * "transformer": 12 layers of 768/3072-wide matmuls, softmax, layer norm, GELU: 1e-3.
# A wrong schedule (a dropped or doubled tile, a race) gives errors of the order of the output
# itself, 1000x above these.
TOLERANCES: dict[str, dict] = {
    "mlp": {"rtol": 1e-4, "atol": 1e-4, "relative_atol": True},
    "cnn": {"rtol": 1e-3, "atol": 1e-3, "relative_atol": True},
    "transformer": {"rtol": 1e-3, "atol": 1e-3, "relative_atol": True},
}


# --------------------------------------------------------------------------------------------
# Import: any torch model -> Relax
# --------------------------------------------------------------------------------------------


def relax_from_torch(model, example_inputs, target=None, *, bind_params: bool = True):
    """Export any PyTorch model to Relax for this target (see ``networks.relax_from_torch``)."""
    from .workloads.networks import relax_from_torch as export

    return export(model, example_inputs, _as_target(target), bind_params=bind_params)


def relax_op_counts(mod) -> dict[str, int]:
    """How many times each Relax operator is called in ``main`` (e.g. to see batch norm is gone)."""
    import tvm

    counts: dict[str, int] = {}
    for call in _calls_in(mod["main"]):
        if isinstance(call.op, tvm.ir.Op):
            counts[str(call.op.name)] = counts.get(str(call.op.name), 0) + 1
    return counts


def _calls_in(func) -> list:
    """Every Relax call in ``func``'s body."""
    from tvm import relax

    calls = []
    relax.analysis.post_order_visit(func.body, lambda e: calls.append(e) if isinstance(e, relax.Call) else None)
    return calls


_COMPARE_OPS = ("relax.equal", "relax.not_equal", "relax.less", "relax.less_equal", "relax.greater",
                "relax.greater_equal")


def _dtype_of(expr) -> str | None:
    t = getattr(expr, "ty", None) or getattr(expr, "struct_info", None)
    dtype = getattr(t, "dtype", None)
    return None if dtype is None else str(dtype)


def _rewrite_calls(mod, rewrite, what: str):
    """Apply ``rewrite(builder, call)`` bottom-up to every call in the module's Relax functions.

    ``rewrite`` returns the replacement expression, or None to keep the call. Returns ``mod``
    itself (the same object) when nothing was replaced.
    """
    from tvm import relax
    from tvm.relax import PyExprMutator, expr_functor

    changed = []

    @expr_functor.mutator
    class Rewriter(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            new = rewrite(self.builder_, call)
            if new is None:
                return call
            changed.append(call.op.name)
            return new

    rewriter = Rewriter(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
    if not changed:
        return mod
    log.debug("%s: rewrote %d op(s): %s", what, len(changed), sorted(set(changed)))
    return rewriter.builder_.get()


def rewrite_bool_ops(mod):
    """Work around two bool-tensor gaps of TVM 0.27 that stop GPT-2 from compiling on CPU.

    * ``R.cumsum`` of a bool tensor with no dtype: the torch frontend types the result bool, and
      the LLVM codegen then aborts on a bool add. PyTorch defines the sum of bools as an int64
      count, so it becomes ``R.cumsum(x, dtype="int64")``; the ops that use it are re-typed.
    * Comparisons of two bool tensors (``R.equal`` ...): the LLVM codegen emits a float compare
      (``fcmp oeq i1``) and aborts. Both operands are cast to int8 first (exact).

    transformers' attention-mask code (``find_packed_sequence_indices``: a cumsum over a bool mask,
    then ``==``) has both. Only the small elementwise mask subgraphs change, never a tuned task;
    other models come back unchanged.
    """
    from tvm import relax

    text = mod.script()
    if "R.cumsum" not in text and not any(op in text for op in ("R.equal", "R.not_equal", "R.less", "R.greater")):
        return mod

    def rewrite(builder, call):
        op = getattr(call.op, "name", None)
        if op == "relax.cumsum" and _dtype_of(call.args[0]) == "bool" and _dtype_of(call) in (None, "bool"):
            attrs = call.attrs
            return relax.op.cumsum(call.args[0], axis=attrs.axis, dtype="int64", exclusive=bool(attrs.exclusive))
        if op in _COMPARE_OPS and all(_dtype_of(a) == "bool" for a in call.args):
            return relax.Call(call.op, [relax.op.astype(a, "int8") for a in call.args], call.attrs)
        return None

    return _rewrite_calls(mod, rewrite, "bool ops")


FAST_MATH_UNARY_OPS = ("relax.nn.gelu", "relax.nn.gelu_tanh", "relax.erf", "relax.tanh")
# Bump when fused_module changes which subgraphs a network has: cached builds keyed on it are stale.
PIPELINE_VERSION = 4  # 2: rewrite_fast_math; 3: weight prepacking on CPU; 4: NHWC convolutions on CPU


def fast_math_counts(mod) -> dict[str, int]:
    """How many calls of each op ``rewrite_fast_math`` replaces in ``mod``'s ``main``."""
    counts: dict[str, int] = {}
    for call in _calls_in(mod["main"]):
        if _fast_math_rewrites(call):
            counts[call.op.name] = counts.get(call.op.name, 0) + 1
    return counts


def _fast_math_rewrites(call) -> bool:
    """Whether ``rewrite_fast_math`` replaces this call."""
    op = getattr(call.op, "name", None)
    if op in FAST_MATH_UNARY_OPS:
        return _dtype_of(call.args[0]) == "float32"
    return op == "relax.power" and _small_power(call) is not None


def _small_power(call) -> int | None:
    """The exponent of ``R.power(x, c)`` when ``c`` is the scalar constant 2 or 3, else None."""
    from tvm.ir.expr import GenericConst

    base, exponent = call.args
    if not isinstance(exponent, GenericConst) or _dtype_of(base) != "float32":
        return None
    value = exponent.value.numpy()
    if value.size != 1 or float(value.reshape(-1)[0]) not in (2.0, 3.0):
        return None
    return int(value.reshape(-1)[0])


def rewrite_fast_math(mod):
    """Give float32 GELU, erf, tanh and ``x ** 2``, ``x ** 3`` code that vectorizes.

    Legalized as they are, these call libm (``erff``, ``tanhf``'s ``expf``, ``powf``) once per
    element, which LLVM cannot vectorize: BERT's GELU subgraph took 3.5 ms a call on Zen 3 however
    it was scheduled (12 calls, 17% of the network) and GPT-2's ``gelu_new`` (``pow`` and ``tanh``)
    43% of the network on a Xeon. ``erf`` and ``tanh`` become TOPI's rational approximations
    (``topi.fast_erf``, ``topi.fast_tanh``, Eigen's float kernels, a few ulp); powers become
    multiplications. Other dtypes and ops are left alone. Returns the module unchanged (the same
    object) when there is nothing to rewrite.
    """
    import math as _math

    from tvm import relax, te, tirx, topi

    def gelu(x: te.Tensor):
        half = tirx.const(0.5, x.dtype)
        return x * (half + topi.fast_erf(x * tirx.const(0.5 ** 0.5, x.dtype)) * half)

    def gelu_tanh(x: te.Tensor):
        c = tirx.const(_math.sqrt(2.0 / _math.pi), x.dtype)
        inner = c * x * (tirx.const(1.0, x.dtype) + tirx.const(0.044715, x.dtype) * x * x)
        return tirx.const(0.5, x.dtype) * x * (tirx.const(1.0, x.dtype) + topi.fast_tanh(inner))

    unary = {"relax.nn.gelu": (gelu, "gelu"), "relax.nn.gelu_tanh": (gelu_tanh, "gelu_tanh"),
             "relax.erf": (topi.fast_erf, "erf"), "relax.tanh": (topi.fast_tanh, "tanh")}

    def rewrite(builder, call):
        if not _fast_math_rewrites(call):
            return None
        if call.op.name in unary:
            fn, hint = unary[call.op.name]
            return builder.call_te(fn, call.args[0], primfunc_name_hint=hint)
        x = call.args[0]
        square = relax.op.multiply(x, x)
        return square if _small_power(call) == 2 else relax.op.multiply(square, x)

    return _rewrite_calls(mod, rewrite, "fast math")


def _scalar_value(expr) -> float | None:
    """The number of a scalar immediate (``FloatImm``/``IntImm``, possibly wrapped), else None."""
    value = getattr(expr, "value", None)
    value = getattr(value, "value", value)
    return float(value) if isinstance(value, (int, float)) else None


def rewrite_clip(mod):
    """``clip(x, lo, hi)`` as ``minimum(maximum(x, lo), hi)``: ``ConvertLayout`` has no layout rule
    for ``relax.clip``, so MobileNet's ReLU6 would otherwise be wrapped in two transposes per call."""
    from tvm import relax

    def rewrite(builder, call):
        if getattr(call.op, "name", None) != "relax.clip":
            return None
        x, lo, hi = call.args
        bounds = [_scalar_value(v) for v in (lo, hi)]
        dtype = _dtype_of(x)
        if dtype is None or None in bounds:
            return None
        low, high = (relax.const(v, dtype) for v in bounds)
        return relax.op.minimum(relax.op.maximum(x, low), high)

    return _rewrite_calls(mod, rewrite, "clip")


def default_weight_prepack(target) -> bool:
    """Weight prepacking is on for CPU targets: MetaSchedule's ``RewriteLayout`` postprocessor is
    part of the LLVM defaults and lays constant weights out in the order the tuned loops read them."""
    return _as_target(target).kind.name == "llvm"


CONV_LAYOUTS = ("NCHW", "NHWC")
_CONV_BLOCK = re.compile(r"(?:group_)?conv2d_(nchw|nhwc)")


def default_conv_layout(target) -> str:
    """NHWC on CPU targets: the output channels are contiguous, so MetaSchedule's tiles vectorize
    along them. In NCHW the innermost output axis is the image width (7-56 in ResNet-50): on Zen 3,
    two of ResNet-50's heaviest 3x3 convolutions tuned 1.8-2.6x faster at the same 32 trials in NHWC."""
    return "NHWC" if _as_target(target).kind.name == "llvm" else "NCHW"


def conv_layout_of(prim_mod) -> str | None:
    """The data layout of a task's 2-D convolution ("NCHW" or "NHWC"), None if it has none."""
    from .database import block_names

    for name in block_names(prim_mod):
        found = _CONV_BLOCK.fullmatch(name)
        if found:
            return found.group(1).upper()
    return None


def fused_module(mod, target, weight_prepack: bool | None = None, conv_layout: str | None = None):
    """The zero pipeline without the database: LegalizeOps, AnnotateTIROpPattern, FoldConstant,
    FuseOps, FuseTIR (after ``rewrite_bool_ops`` and ``rewrite_fast_math``). Its PrimFuncs are the
    tasks MetaSchedule extracts and tunes.

    With ``weight_prepack`` (default: ``default_weight_prepack(target)``), the PrimFuncs name their
    constant (weight) arguments in a ``layout_free_buffers`` attribute, so the tuned schedules may
    change those buffers' layout; ``build_network`` then folds the layout change into the constants.
    ``conv_layout`` (default: ``default_conv_layout(target)``) is the data layout of 2-D
    convolutions; for NHWC, ``ConvertLayout`` changes them and the ops between them, and inserts
    transposes where the layout has to change back (the network's inputs and outputs stay as they are).
    """
    import tvm
    from tvm import relax

    target = _as_target(target)
    if weight_prepack is None:
        weight_prepack = default_weight_prepack(target)
    if conv_layout is None:
        conv_layout = default_conv_layout(target)
    if conv_layout not in CONV_LAYOUTS:
        raise CwmError(f"unknown convolution layout {conv_layout!r}; choose one of {', '.join(CONV_LAYOUTS)}")
    mod = rewrite_fast_math(rewrite_bool_ops(mod))
    passes = []
    if conv_layout == "NHWC":
        mod = rewrite_clip(mod)
        passes.append(relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]}))
    passes.append(relax.get_pipeline("zero"))
    if weight_prepack:
        passes.append(relax.transform.AttachAttrLayoutFreeBuffers())
    with target, tvm.transform.PassContext(opt_level=3):
        return tvm.transform.Sequential(passes)(mod)


def extract_tasks(mod, target, network: str | None = None, weight_prepack: bool | None = None,
                  conv_layout: str | None = None) -> list:
    """The MetaSchedule tasks of a (not yet fused) Relax module, as ``cwm.workloads.Task``."""
    import tvm.s_tir.meta_schedule as ms

    from .workloads import Task

    target = _as_target(target)
    fused = fused_module(mod, target, weight_prepack, conv_layout)
    tasks = []
    for ext in ms.relax_integration.extract_tasks(fused, target):
        name = f"{network}/{ext.task_name}" if network else str(ext.task_name)
        tasks.append(Task(name=name, mod=ext.dispatched[0], weight=float(ext.weight), network=network))
    try:  # the network helper knows depthwise convs and dense layers; fall back to the name heuristic
        from .workloads.networks import _kind_for

        for t in tasks:
            if "/" in t.name:
                t.kind = _kind_for(t)
    except ImportError:
        pass
    return tasks


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


def _as_target(target):
    from tvm.target import Target

    from .hardware import make_target

    if target is None:
        return make_target()
    if isinstance(target, Target):
        return target
    return make_target(target)


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    # TVM errors end with the informative line; Python errors start with it.
    msg = lines[-1] if lines and type(err).__module__.startswith("tvm") else (lines[0] if lines else "")
    return msg or type(err).__name__


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

    from .database import RECORD_FILE, load_raw, open_database

    if not (db_dir / RECORD_FILE).exists():
        load_raw(db_dir)  # a clear CwmError if the workload file is missing too
        log.warning("%s has no %s: no tuning records", db_dir, RECORD_FILE)
        return _UsableRecords(ms.database.MemoryDatabase())
    json_db = open_database(db_dir, create=False)
    best: dict[int, tuple[int, float, object]] = {}  # workload hash -> (rank, latency, record)
    dropped = 0
    for rec in json_db.get_all_tuning_records():
        secs = [float(s) for s in (rec.run_secs or [])]
        if not secs or not all(math.isfinite(s) and 0 < s < FAILED_LATENCY for s in secs):
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
    names = sorted(gv.name_hint for gv in mod.get_global_vars() if gv.name_hint.endswith("_prepacked"))
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
    import tvm.s_tir.meta_schedule as ms
    from tvm import relax

    start = time.time()
    target = _as_target(target)
    if not isinstance(module_or_name, (str, tvm.IRModule)):
        raise CwmError(f"build_network needs a Relax IRModule or a network name, got {type(module_or_name).__name__}")
    if isinstance(module_or_name, str):
        from .workloads.networks import get_network

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
        from .workloads.networks import relax_module

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
        raise CwmError(f"compiling the network for {target.kind.name} failed: {_first_line(err)}") from err

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
            raise CwmError(f"exporting the library to {out_path} failed: {_first_line(err)}") from err
        result.lib_path = out_path
    result.seconds = time.time() - start
    if out_path is not None:
        from .database import atomic_write_text

        atomic_write_text(sidecar_path(out_path), json.dumps(result.as_json(), indent=1) + "\n")
    return result


def sidecar_path(lib_path) -> Path:
    lib_path = Path(lib_path)
    return lib_path.with_name(lib_path.name + ".json")


def read_sidecar(lib_path) -> dict | None:
    """The build record beside a library (``BuildResult.as_json``), None if there is none."""
    side = sidecar_path(lib_path)
    if not side.exists():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as err:  # ValueError: bad JSON or not text
        raise CwmError(f"the sidecar {side} of {Path(lib_path).name} is corrupt: {err}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("signature", {}), dict):
        raise CwmError(f"the sidecar {side} of {Path(lib_path).name} is corrupt: no signature object")
    return meta


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


# --------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------


def _device(device):
    import tvm

    if isinstance(device, str):
        kind = device.split(":")[0]
        index = int(device.split(":")[1]) if ":" in device else 0
        dev = tvm.device(kind, index)
    else:
        dev = device
    if not dev.exist:
        raise CwmError(f"device {device} is not available here")
    return dev


def load_vm(lib_path, device="cpu"):
    """A Relax VM on an exported library (``tvm.runtime.load_module``)."""
    import tvm
    from tvm import relax

    lib_path = Path(lib_path)
    if not lib_path.exists():
        raise CwmError(f"library {lib_path} does not exist")
    try:
        lib = tvm.runtime.load_module(str(lib_path))
    except Exception as err:
        raise CwmError(f"cannot load {lib_path}: {_first_line(err)}") from err
    return relax.VirtualMachine(lib, _device(device))


def _fmt_shapes(items) -> str:
    return ", ".join(f"{tuple(i['shape']) if i['shape'] is not None else '?'} {i['dtype']}" for i in items)


def check_inputs(signature: dict, inputs: Sequence[np.ndarray]) -> None:
    """CwmError unless ``inputs`` match the signature's count, shapes (static dims) and dtypes."""
    expected = signature.get("inputs", [])
    actual = [{"shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype)} for x in inputs]
    bad = len(expected) != len(actual)
    if not bad:
        for e, a in zip(expected, actual):
            if e["dtype"] is not None and e["dtype"] != a["dtype"]:
                bad = True
            elif e["shape"] is not None:
                if len(e["shape"]) != len(a["shape"]) or any(
                    isinstance(d, int) and d != s for d, s in zip(e["shape"], a["shape"])
                ):
                    bad = True
    if bad:
        raise CwmError(f"the network expects {len(expected)} input(s) [{_fmt_shapes(expected)}], "
                       f"got {len(actual)} [{_fmt_shapes(actual)}]")


def _to_numpy(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):  # a tvm Tensor
        return [value.numpy()]
    try:  # a tuple of outputs (tvm_ffi Array)
        items = list(value)
    except TypeError:
        return [np.asarray(value)]
    return [a for v in items for a in _to_numpy(v)]


def load_and_run(lib_path, inputs: list[np.ndarray], device="cpu") -> list[np.ndarray]:
    """Run ``main`` of an exported library on the Relax VM; the outputs as numpy arrays (flattened
    tuples). Inputs are checked against the signature stored beside the library before the call."""
    import tvm

    inputs = [np.asarray(x) for x in inputs]
    meta = read_sidecar(lib_path)
    if meta is not None:
        check_inputs(meta.get("signature", {}), inputs)
    vm = load_vm(lib_path, device)
    arity = int(vm._get_function_arity("main"))
    if arity != len(inputs):
        raise CwmError(f"the network expects {arity} input(s), got {len(inputs)} "
                       f"[{_fmt_shapes([{'shape': list(x.shape), 'dtype': str(x.dtype)} for x in inputs])}]")
    dev = _device(device)
    args = [tvm.runtime.tensor(np.ascontiguousarray(x), device=dev) for x in inputs]
    try:
        out = vm["main"](*args)
    except Exception as err:
        raise CwmError(f"running {lib_path} failed: {_first_line(err)}") from err
    return _to_numpy(out)


# --------------------------------------------------------------------------------------------
# Correctness against PyTorch
# --------------------------------------------------------------------------------------------


def model_family(model) -> str:
    """'cnn', 'transformer' or 'mlp' (for ``TOLERANCES``), from the modules a model contains."""
    import torch

    kinds = {type(m).__name__ for m in model.modules()}
    if any(isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) for m in model.modules()):
        return "cnn"
    if any("Attention" in k or k in ("LayerNorm", "Embedding", "Conv1D") for k in kinds):
        return "transformer"
    return "mlp"


def tolerance_for(model) -> dict:
    """Keyword arguments (rtol, atol, relative_atol) of ``check_against_torch`` for ``model``'s
    family; see ``TOLERANCES`` for the values and why."""
    return dict(TOLERANCES[model_family(model)])


def torch_outputs(torch_model, example_inputs) -> list[np.ndarray]:
    import torch

    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    with torch.no_grad():
        out = torch_model.eval()(*example_inputs)
    return _flatten_torch(out)


def _flatten_torch(out) -> list[np.ndarray]:
    import torch

    if isinstance(out, torch.Tensor):
        return [out.detach().cpu().numpy()]
    if isinstance(out, dict):
        return [a for v in out.values() for a in _flatten_torch(v)]
    if isinstance(out, (list, tuple)):
        return [a for v in out for a in _flatten_torch(v)]
    if hasattr(out, "to_tuple"):
        return _flatten_torch(out.to_tuple())
    return [np.asarray(out)]


def check_against_torch(torch_model, example_inputs, outputs, rtol: float = 1e-4, atol: float = 1e-4, *,
                        relative_atol: bool = False) -> dict:
    """Run ``torch_model`` on ``example_inputs`` and compare with ``outputs`` (np.allclose).

    Tolerance: ``|tvm - torch| <= atol * scale + rtol * |torch|`` elementwise, with ``scale = 1``
    (plain ``np.allclose``) or, with ``relative_atol``, the largest |value| of that PyTorch output.
    The defaults (1e-4, 1e-4, absolute) suit shallow dense models with outputs of magnitude ~1.
    Deep fp32 models need more, because reordered fp32 sums differ: use ``**tolerance_for(model)``
    (1e-3 relative to the output range for conv nets and transformers, 1e-4 for MLPs; the
    reasoning and measured differences are at ``TOLERANCES``). A mismatch raises ``CwmError`` with
    the max abs diff: it is an error, not a warning.
    Returns ``{"max_abs_diff", "max_rel_diff" (max abs diff / output range), "rtol", "atol", ...}``.
    """
    expected = torch_outputs(torch_model, example_inputs)
    outputs = [np.asarray(o) for o in outputs]
    if len(expected) != len(outputs):
        raise CwmError(f"PyTorch gives {len(expected)} output(s), the TVM module {len(outputs)}")
    max_diff, max_rel = 0.0, 0.0
    for i, (e, o) in enumerate(zip(expected, outputs)):
        if e.shape != o.shape:
            raise CwmError(f"output {i}: PyTorch shape {e.shape}, TVM shape {o.shape}")
        if not e.size:
            continue
        magnitude = float(np.max(np.abs(e)))
        diff = float(np.max(np.abs(o.astype(np.float64) - e.astype(np.float64))))
        if not np.isfinite(diff):
            diff = float("inf")
        max_diff = max(max_diff, diff)
        max_rel = max(max_rel, diff / magnitude if magnitude > 0 else (0.0 if diff == 0 else float("inf")))
        scale = magnitude if relative_atol else 1.0
        if not np.allclose(o, e, rtol=rtol, atol=atol * scale):
            raise CwmError(f"output {i} differs from PyTorch: max abs diff {diff:.3g} on outputs up to "
                           f"{magnitude:.3g} (rtol {rtol:g}, atol {atol:g}"
                           f"{' x output range' if relative_atol else ''})")
    return {"max_abs_diff": max_diff, "max_rel_diff": max_rel, "rtol": rtol, "atol": atol,
            "relative_atol": relative_atol, "outputs": len(outputs)}


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def set_threads(n: int = 2) -> None:
    """Use ``n`` threads in PyTorch (intra-op) and in the TVM runtime thread pool."""
    import torch
    import tvm

    torch.set_num_threads(n)
    os.environ["TVM_NUM_THREADS"] = str(n)
    try:
        if tvm.runtime.num_threads() != n:
            tvm.get_global_func("runtime.config_threadpool")(1, n)  # 1: the default ("big cores") mode
    except Exception as err:  # an older runtime without the hook: the env var applies on first use
        log.debug("cannot reconfigure the TVM thread pool: %s", err)


def tvm_runner(lib_path, inputs, device="cpu") -> Callable[[], object]:
    """A zero-argument callable that runs the library's ``main`` once on prepared inputs."""
    import tvm

    vm = load_vm(lib_path, device)
    dev = _device(device)
    meta = read_sidecar(lib_path)
    if meta is not None:
        check_inputs(meta.get("signature", {}), [np.asarray(x) for x in inputs])
    args = [tvm.runtime.tensor(np.ascontiguousarray(np.asarray(x)), device=dev) for x in inputs]
    f = vm["main"]
    on_cpu = str(dev).startswith("cpu")

    def run():
        out = f(*args)
        if not on_cpu:  # wait for the device
            dev.sync()
        return out

    return run


def torch_runner(model, example_inputs, compile: bool = False) -> Callable[[], object]:
    """A zero-argument callable that runs the model once (no grad); ``compile`` uses
    ``torch.compile`` (inductor), which compiles lazily on the first call."""
    import torch

    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    model = model.eval()
    fn = torch.compile(model) if compile else model

    def run():
        with torch.no_grad():
            return fn(*example_inputs)

    return run


@dataclass
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    runs: int
    samples: list = field(default_factory=list, repr=False)

    def as_json(self) -> dict:
        return {"median_ms": self.median_s * 1e3, "p10_ms": self.p10_s * 1e3, "p90_ms": self.p90_s * 1e3,
                "runs": self.runs}


TIMING_BLOCK = 5
SETTLE_S = 0.05


def time_interleaved(contenders: dict[str, Callable[[], object]], *, runs: int = 30, warmup: int = 3,
                     threads: int | None = 2, max_seconds: float | None = None,
                     min_runs: int = 5, block: int = TIMING_BLOCK,
                     settle_s: float = SETTLE_S) -> tuple[dict[str, Timing], dict[str, str]]:
    """Time several callables in rotating blocks: each round gives every contender (the order
    rotates each round) a pause of ``settle_s``, one untimed call, then ``block`` timed calls
    back to back. Load changes on a shared machine still hit all contenders alike.

    Blocks, not single calls: after a call, a runtime's worker threads spin on for a while, and a
    call of another runtime (TVM's thread pool against PyTorch's OpenMP) that starts then shares
    the cores with them. On a 2-core Zen 3, resnet50 in PyTorch eager took 67 ms alone and a
    median of 128 ms when each call came right after a TVM call.

    A contender whose warm-up raises is dropped and its error recorded. Returns
    ``({name: Timing}, {name: error})``; each Timing is the median of ``runs`` calls, except with
    ``max_seconds``, for contenders that take seconds a call (an untuned network): one stops once
    its timed calls add up to more than ``max_seconds`` and it has ``min_runs`` of them; one whose
    first warm-up call alone takes over a tenth of ``max_seconds`` skips the other warm-ups (and
    the untimed call of each block), and that call counts as a timed one. Each Timing says how
    many calls it has. A single contender (``time_module``, ``time_torch``) has nothing to settle
    and is timed without the pauses and untimed calls.
    """
    if block < 1:
        raise CwmError(f"block must be a positive integer, got {block!r}")
    if threads:
        set_threads(threads)
    errors: dict[str, str] = {}
    live = {}
    slow: set[str] = set()
    samples: dict[str, list[float]] = {}
    for name, fn in contenders.items():
        try:
            samples[name] = []
            for _ in range(max(1, warmup)):
                t0 = time.perf_counter()
                fn()
                took = time.perf_counter() - t0
                if max_seconds is not None and took > max_seconds / 10:
                    samples[name].append(took)
                    slow.add(name)
                    break
            live[name] = fn
        except Exception as err:  # e.g. torch.compile without a working toolchain
            errors[name] = f"{type(err).__name__}: {_first_line(err)}"[:500]
            log.warning("%s failed in warm-up and is not timed: %s", name, errors[name])
    samples = {name: samples[name] for name in live}
    names = list(live)

    def finished(name: str) -> bool:
        done = samples[name]
        return len(done) >= runs or (max_seconds is not None and len(done) >= min_runs and sum(done) > max_seconds)

    alone = len(names) == 1  # no other runtime to settle: no pause and no untimed call
    r = 0
    while names and not all(finished(n) for n in names):
        order = names[r % len(names):] + names[:r % len(names)]
        r += 1
        for name in order:
            if finished(name):
                continue
            if not alone:
                time.sleep(settle_s)
            if name not in slow and not alone:
                live[name]()  # untimed: the other runtime's threads settle during it
            for _ in range(block):
                if finished(name):
                    break
                t0 = time.perf_counter()
                live[name]()
                samples[name].append(time.perf_counter() - t0)
    timings = {}
    for name, s in samples.items():
        a = np.asarray(s)
        timings[name] = Timing(float(np.median(a)), float(np.percentile(a, 10)), float(np.percentile(a, 90)),
                               len(s), list(s))
    return timings, errors


def time_module(lib_path, inputs, *, runs: int = 30, warmup: int = 3, threads: int = 2, device="cpu") -> Timing:
    """Median latency of one exported library (``runs`` >= 30 for a report)."""
    timings, errors = time_interleaved({"tvm": tvm_runner(lib_path, inputs, device)}, runs=runs,
                                       warmup=warmup, threads=threads)
    if errors:
        raise CwmError(f"running {lib_path} failed: {errors['tvm']}")
    return timings["tvm"]


def time_torch(model, example_inputs, *, compile: bool = False, runs: int = 30, warmup: int = 3,
               threads: int = 2) -> Timing:
    """Median latency of a PyTorch model, eager or ``torch.compile`` (inductor)."""
    timings, errors = time_interleaved({"torch": torch_runner(model, example_inputs, compile)}, runs=runs,
                                       warmup=warmup, threads=threads)
    if errors:
        raise CwmError(f"PyTorch ({'compiled' if compile else 'eager'}) failed: {errors['torch']}")
    return timings["torch"]


def peak_matmul_stats(n: int = 1024, runs: int = 30, threads: int = 2) -> dict:
    """GFLOP/s of an n x n x n fp32 torch matmul: ``{"median": ..., "best": ...}`` over ``runs`` calls
    after warm-up (the best call is less sensitive to other load on a shared machine)."""
    import torch

    set_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    c = torch.empty(n, n)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=c)
        times.append(time.perf_counter() - t0)
    flop = 2.0 * n ** 3
    return {"median": flop / float(np.median(times)) / 1e9, "best": flop / float(np.min(times)) / 1e9}


def peak_matmul_gflops(n: int = 1024, runs: int = 30, threads: int = 2) -> float:
    """Measured fp32 peak for roofline fractions: GFLOP/s of an n x n x n torch matmul, median of
    ``runs`` calls after warm-up."""
    return peak_matmul_stats(n, runs, threads)["median"]
