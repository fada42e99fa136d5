"""Numeric features of scheduling actions (MetaSchedule trace instructions).

Two views of one trajectory (a list of action dicts, see :mod:`cwm.actions`):

* :func:`encode_actions` - one row per action: the instruction kind as an integer id into
  :data:`KNOWN_KINDS` and a fixed-width float vector of its arguments (:data:`ARG_NAMES`).
  This is what the latent transition model (:mod:`cwm.transition`) consumes step by step.
* :func:`structured_features` - one fixed-length vector per trajectory
  (:data:`STRUCT_NAMES`): kind counts, tile-size statistics, parallel / vectorize / unroll
  extents and the like, for tree models.

Both are pure Python + numpy, deterministic, and never raise on odd values: any input that is
not understood (unknown kinds, ``None``, nested lists, strings where numbers were expected)
contributes zeros. Magnitudes are compressed with ``log2(1 + x)`` (sign-preserving for
negative numbers) so that all columns stay within a few units.
"""

from __future__ import annotations

import hashlib
import io
import math
import pickle
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from .actions import NON_IR_KINDS

# --------------------------------------------------------------------------------------------
# Vocabularies
# --------------------------------------------------------------------------------------------

PAD_ID = 0
UNK_ID = 1

#: Instruction kinds, index = kind id. 0 is padding, 1 is "unknown kind".
KNOWN_KINDS: tuple[str, ...] = (
    "<pad>",
    "<unk>",
    # queries
    "GetSBlock",
    "GetLoops",
    "GetChildBlocks",
    "GetProducers",
    "GetConsumers",
    "GetOutputBlocks",
    # sampling
    "SamplePerfectTile",
    "SamplePartitionedTile",
    "SampleCategorical",
    "SampleComputeLocation",
    # loop transformations
    "Split",
    "LoopPartition",
    "Fuse",
    "Merge",
    "Reorder",
    "ReorderBlockIterVar",
    "AddUnitLoop",
    "Parallel",
    "Vectorize",
    "Bind",
    "Unroll",
    # caching / buffers
    "CacheRead",
    "CacheWrite",
    "CacheInplace",
    "CacheIndex",
    "ReindexCacheRead",
    "ReindexCacheWrite",
    "ReIndex",
    # compute location
    "ComputeAt",
    "ReverseComputeAt",
    "ComputeInline",
    "ReverseComputeInline",
    # reduction
    "DecomposeReduction",
    "RFactor",
    "FuseReductionEpilogue",
    # storage / layout
    "StorageAlign",
    "SetScope",
    "TransformLayout",
    "TransformBlockLayout",
    "DecomposePadding",
    "PadEinsum",
    "RollingBuffer",
    "UnsafeSetDType",
    "UnsafeHideBufferAccess",
    "AnnotateBufferAccess",
    # tensorization
    "Blockize",
    "Tensorize",
    # annotations
    "Annotate",
    "Unannotate",
    # phase marker
    "EnterPostproc",
)
KIND_TO_ID: dict[str, int] = {k: i for i, k in enumerate(KNOWN_KINDS)}

#: Annotation keys with their own one-hot column (others share ``ann_key_other``).
ANNOTATION_KEYS: tuple[str, ...] = (
    "meta_schedule.parallel",
    "meta_schedule.vectorize",
    "meta_schedule.unroll_explicit",
    "meta_schedule.unroll_implicit",
    "pragma_auto_unroll_max_step",
    "pragma_unroll_explicit",
    "meta_schedule.tiling_structure",
    "meta_schedule.cooperative_fetch",
    "meta_schedule.thread_extent_low_inclusive",
    "meta_schedule.thread_extent_high_inclusive",
    "meta_schedule.auto_tensorize",
    "meta_schedule.auto_tensorize_init",
    "meta_schedule.layout_rewrite_preproc",
    "meta_schedule.random_compute_producer",
    "meta_schedule.inline_rule",
    "software_pipeline_stage",
    "software_pipeline_order",
    "software_pipeline_async_stages",
)
ANN_KEY_TO_INDEX: dict[str, int] = {k: i for i, k in enumerate(ANNOTATION_KEYS)}

MAX_TILE_FACTORS = 8
NUM_REFS = 2
NUM_ATTR_INTS = 3
_SCOPES = ("global", "shared", "local")
_BIND_PREFIXES = ("blockIdx", "threadIdx", "vthread")

_CACHE_READ_KINDS = frozenset({"CacheRead", "ReindexCacheRead"})
_CACHE_WRITE_KINDS = frozenset({"CacheWrite", "ReindexCacheWrite"})
_TILE_KINDS = frozenset({"SamplePerfectTile", "SamplePartitionedTile"})
_UNROLL_KEYS = frozenset(
    {
        "meta_schedule.unroll_explicit",
        "meta_schedule.unroll_implicit",
        "pragma_auto_unroll_max_step",
    }
)

# --------------------------------------------------------------------------------------------
# Argument columns
# --------------------------------------------------------------------------------------------


def _arg_names() -> list[str]:
    names = [f"tile_{i}" for i in range(MAX_TILE_FACTORS)]
    names += ["tile_count", "tile_log2_prod"]
    names += ["cat_index", "cat_value", "cat_num_candidates", "cat_prob"]
    names += ["loc_decision"]
    names += ["ann_value", "ann_value_known", "ann_value_is_str"]
    names += [f"ann_key={k}" for k in ANNOTATION_KEYS] + ["ann_key_other"]
    names += ["n_inputs", "n_outputs"]
    for r in range(NUM_REFS):
        names += [
            f"ref{r}_is_block",
            f"ref{r}_is_loop",
            f"ref{r}_age",
            f"ref{r}_pos",
            f"ref{r}_producer_outputs",
            f"ref{r}_unresolved",
        ]
    names += [f"attr_int_{i}" for i in range(NUM_ATTR_INTS)]
    names += [f"scope_{s}" for s in _SCOPES] + ["scope_other"]
    names += [f"bind_{p}" for p in _BIND_PREFIXES]
    names += ["ir_changing", "in_postproc", "step_frac"]
    return names


#: Documentation of every column of ``encode_actions(...)["args"]``.
#:
#: * ``tile_i``: ``log2(1+f_i)`` of the i-th tile factor: the decision of a
#:   SamplePerfectTile / SamplePartitionedTile, or the factors a Split uses (resolved through
#:   the sampled variables; unknown or ``None`` factors give 0). Zero padded to 8.
#: * ``tile_count``: ``log2(1+number of factors)``; ``tile_log2_prod``: ``log2`` of their product.
#: * ``cat_index``: decision index of a SampleCategorical; ``cat_value``: ``log2(1+value)`` of the
#:   chosen candidate; ``cat_num_candidates``: ``log2(1+#candidates)``; ``cat_prob``: its
#:   probability.
#: * ``loc_decision``: signed ``log2(1+|x|)`` of a SampleComputeLocation decision (loop index,
#:   -1 = root, -2 = inline).
#: * ``ann_value``: ``log2(1+v)`` of an Annotate value that is a literal number or a variable
#:   sampled earlier; ``ann_value_known`` marks that it was resolved; ``ann_value_is_str`` marks a
#:   string literal. ``ann_key=...``: one-hot of the annotation key (Annotate / Unannotate).
#: * ``n_inputs`` / ``n_outputs``: ``log2(1+count)``.
#: * ``ref{r}_*`` for the first two block/loop inputs: kind of variable, age
#:   ``(t - producer index) / T``, position among the producer's outputs ``pos / (n-1)``
#:   (1 = last, e.g. innermost loop), ``log2(1+producer output count)``, and 1 when the producer is
#:   not in the trajectory.
#: * ``attr_int_i``: signed ``log2(1+|x|)`` of the first three scalar numeric attributes
#:   (Split/Fuse preserve flags, ComputeAt index, SamplePerfectTile n / max innermost, ...).
#: * ``scope_*``: storage scope string attribute (CacheRead/CacheWrite/SetScope);
#:   ``bind_*``: thread axis of a Bind.
#: * ``ir_changing``: the action changes the IR; ``in_postproc``: after EnterPostproc;
#:   ``step_frac``: ``t / T``.
ARG_NAMES: list[str] = _arg_names()
NUM_ARGS: int = len(ARG_NAMES)
_COL: dict[str, int] = {n: i for i, n in enumerate(ARG_NAMES)}

_C_TILE0 = _COL["tile_0"]
_C_TILE_COUNT = _COL["tile_count"]
_C_TILE_PROD = _COL["tile_log2_prod"]
_C_CAT_INDEX = _COL["cat_index"]
_C_CAT_VALUE = _COL["cat_value"]
_C_CAT_N = _COL["cat_num_candidates"]
_C_CAT_PROB = _COL["cat_prob"]
_C_LOC = _COL["loc_decision"]
_C_ANN_VALUE = _COL["ann_value"]
_C_ANN_KNOWN = _COL["ann_value_known"]
_C_ANN_STR = _COL["ann_value_is_str"]
_C_ANN_KEY0 = _COL[f"ann_key={ANNOTATION_KEYS[0]}"]
_C_ANN_OTHER = _COL["ann_key_other"]
_C_NIN = _COL["n_inputs"]
_C_NOUT = _COL["n_outputs"]
_C_REF0 = _COL["ref0_is_block"]
_REF_WIDTH = 6
_C_ATTR0 = _COL["attr_int_0"]
_C_SCOPE0 = _COL["scope_global"]
_C_SCOPE_OTHER = _COL["scope_other"]
_C_BIND0 = _COL[f"bind_{_BIND_PREFIXES[0]}"]
_C_IR = _COL["ir_changing"]
_C_POST = _COL["in_postproc"]
_C_STEP = _COL["step_frac"]

# --------------------------------------------------------------------------------------------
# Robust value helpers
# --------------------------------------------------------------------------------------------

_RV_RE = re.compile(r"^([blv])(\d+)$")
_BIG = 1e30


def _num(x: Any) -> float | None:
    """A finite float for numbers and plain numeric strings, else None."""
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float, np.integer, np.floating)):
        try:
            v = float(x)
        except (OverflowError, ValueError, TypeError):
            return None
        return v if math.isfinite(v) else None
    if isinstance(x, str) and x and (x[0].isdigit() or x[0] in "+-."):
        try:
            v = float(x)
        except ValueError:
            return None
        return v if math.isfinite(v) else None
    return None


_LOG_TABLE = [math.log2(1.0 + i) for i in range(1025)]


def _slog(x: float) -> float:
    """Sign-preserving ``log2(1 + |x|)``."""
    if type(x) is int and 0 <= x <= 1024:
        return _LOG_TABLE[x]
    a = min(abs(x), _BIG)
    v = math.log2(1.0 + a)
    return -v if x < 0 else v


def _as_list(x: Any) -> list:
    if isinstance(x, list):
        return x
    if isinstance(x, tuple):
        return list(x)
    return []


def _rv(x: Any) -> str | None:
    """The variable class ('b', 'l' or 'v') of a symbolic name, else None."""
    if isinstance(x, str) and len(x) >= 2 and x[0] in "blv" and _RV_RE.match(x):
        return x[0]
    return None


def _is_quoted_str(x: Any) -> bool:
    return isinstance(x, str) and len(x) >= 2 and x[0] == '"' and x[-1] == '"'


def _kind_name(action: Any) -> str:
    if isinstance(action, dict):
        k = action.get("kind")
        if isinstance(k, str):
            return k
    return "<unk>"


def _field(action: Any, name: str) -> list:
    if isinstance(action, dict):
        return _as_list(action.get(name))
    return []


def _decision(action: Any) -> Any:
    return action.get("decision") if isinstance(action, dict) else None


def kind_id(kind: Any) -> int:
    """Id of an instruction kind in :data:`KNOWN_KINDS`; unknown kinds map to ``UNK_ID``."""
    if isinstance(kind, str):
        i = KIND_TO_ID.get(kind, UNK_ID)
        return UNK_ID if i == PAD_ID else i
    return UNK_ID


def _first_str_attr(attrs: list) -> str | None:
    for a in attrs:
        if isinstance(a, str):
            return a[1:-1] if _is_quoted_str(a) else a
    return None


def _categorical_choice(action: Any) -> tuple[int | None, float | None, int, float | None]:
    """(decision index, chosen value, #candidates, probability) of a SampleCategorical."""
    attrs = _field(action, "attrs")
    cands = _as_list(attrs[0]) if len(attrs) > 0 else []
    probs = _as_list(attrs[1]) if len(attrs) > 1 else []
    d = _num(_decision(action))
    if d is None or d != int(d):
        return None, None, len(cands), None
    idx = int(d)
    value = _num(cands[idx]) if 0 <= idx < len(cands) else None
    prob = _num(probs[idx]) if 0 <= idx < len(probs) else None
    return idx, value, len(cands), prob


def _tile_decision(action: Any) -> list[float | None]:
    dec = _decision(action)
    return [_num(x) for x in _as_list(dec)]


# --------------------------------------------------------------------------------------------
# Trajectory-level structured features
# --------------------------------------------------------------------------------------------


def _struct_names() -> list[str]:
    names = ["traj_len"]
    names += [f"count={k}" for k in KNOWN_KINDS[1:]]
    names += ["n_ir_changing", "n_postproc_actions"]
    names += [
        "tile_log2_mean",
        "tile_log2_max",
        "tile_log2_min",
        "tile_n_samples",
        "tile_inner_log2_mean",
        "tile_inner_log2_max",
        "tile_inner_prod_log2",
    ]
    names += [
        "parallel_extent_log2",
        "vectorize_extent_log2",
        "unroll_max_step_log2",
        "unroll_explicit",
        "n_cache_read",
        "n_cache_write",
        "n_compute_at",
        "n_reverse_compute_at",
        "n_inline",
        "max_fused_parallel",
        "max_fused_vectorize",
        "n_parallel_loops",
        "n_vectorize_loops",
        "n_thread_binds",
        "compute_location_mean",
    ]
    return names


#: Names of the columns of :func:`structured_features`.
#:
#: ``count=K`` counts kind K (``count=<unk>`` counts unknown kinds). Tile statistics are over
#: ``log2`` of SamplePerfectTile decisions; "inner" means the last (innermost) factor of each.
#: Parallel / vectorize extents are the largest ``meta_schedule.parallel`` /
#: ``meta_schedule.vectorize`` annotation values, ``log2(1+v)``; the unroll max step is the
#: largest unroll annotation value (resolved through SampleCategorical), ``log2(1+v)``.
#: ``max_fused_*`` is the largest number of original loops fused into a loop that is then
#: parallelized / vectorized (1 for an unfused loop).
STRUCT_NAMES: list[str] = _struct_names()
NUM_STRUCT: int = len(STRUCT_NAMES)
_SCOL: dict[str, int] = {n: i for i, n in enumerate(STRUCT_NAMES)}


# --------------------------------------------------------------------------------------------
# Fast single-pass featurization
# --------------------------------------------------------------------------------------------
#
# One pass over a trajectory produces both views (the per-action rows of ``encode_actions``
# and the trajectory vector of ``structured_features``); they share the kind lookup, the field
# extraction and the sampled-value table. Rows are written straight into a float32 buffer
# (``array('f')``: the same double -> float32 rounding as ``np.asarray(..., float32)``).
# Every float is produced by exactly the same Python operations, in the same order, as the
# straightforward per-action definition (see the column docs above), so results are bitwise
# identical to it; the memo tables below only cache pure functions of one number or one name.

_K_GENERIC = 0
_K_PTILE = 1  # SamplePerfectTile
_K_QTILE = 2  # SamplePartitionedTile
_K_SPLIT = 3
_K_CAT = 4
_K_LOC = 5
_K_ANN = 6
_K_UNANN = 7
_K_SCOPE = 8  # CacheRead / CacheWrite / Reindex* / SetScope
_K_BIND = 9
_K_EP = 10
_K_FUSE = 11
_K_PAR = 12
_K_VEC = 13

_KIND_CODE = {
    "SamplePerfectTile": _K_PTILE,
    "SamplePartitionedTile": _K_QTILE,
    "Split": _K_SPLIT,
    "SampleCategorical": _K_CAT,
    "SampleComputeLocation": _K_LOC,
    "Annotate": _K_ANN,
    "Unannotate": _K_UNANN,
    "Bind": _K_BIND,
    "EnterPostproc": _K_EP,
    "Fuse": _K_FUSE,
    "Parallel": _K_PAR,
    "Vectorize": _K_VEC,
}
for _k in sorted(_CACHE_READ_KINDS | _CACHE_WRITE_KINDS | {"SetScope"}):
    _KIND_CODE[_k] = _K_SCOPE

#: kind name -> (kind id, dispatch code, IR-changing flag); unknown names use ``_KINFO_UNK``.
_KINFO: dict[str, tuple[int, int, int]] = {
    k: (kind_id(k), _KIND_CODE.get(k, _K_GENERIC), 0 if k in NON_IR_KINDS else 1)
    for k in KNOWN_KINDS
}
_KINFO_UNK: tuple[int, int, int] = (UNK_ID, _K_GENERIC, 0 if "<unk>" in NON_IR_KINDS else 1)
_NK = len(KNOWN_KINDS)
_EMPTY: list = []  # shared, never mutated

#: Memo of ``_rv`` (pure function of a hashable value); cleared when it grows too large.
_RV_MEMO: dict[Any, str | None] = {}
#: Memo of ``_slog`` for finite numbers (equal numbers give equal results, -0.0 included).
_SLOG_MEMO: dict[Any, float] = {i: v for i, v in enumerate(_LOG_TABLE)}
#: Memo of ``math.log2(min(f, _BIG))`` for floats ``f > 0``.
_LOG2_MEMO: dict[float, float] = {}
_MEMO_LIMIT = 1 << 17

_SC_TRAJ_LEN = _SCOL["traj_len"]
_SC_COUNT0 = _SCOL[f"count={KNOWN_KINDS[1]}"]
_SC_N_IR = _SCOL["n_ir_changing"]
_SC_N_POST = _SCOL["n_postproc_actions"]
_SC_TILE_MEAN = _SCOL["tile_log2_mean"]
_SC_TILE_MAX = _SCOL["tile_log2_max"]
_SC_TILE_MIN = _SCOL["tile_log2_min"]
_SC_TILE_N = _SCOL["tile_n_samples"]
_SC_INNER_MEAN = _SCOL["tile_inner_log2_mean"]
_SC_INNER_MAX = _SCOL["tile_inner_log2_max"]
_SC_INNER_PROD = _SCOL["tile_inner_prod_log2"]
_SC_PAR_EXT = _SCOL["parallel_extent_log2"]
_SC_VEC_EXT = _SCOL["vectorize_extent_log2"]
_SC_UNROLL = _SCOL["unroll_max_step_log2"]
_SC_UNROLL_EXPLICIT = _SCOL["unroll_explicit"]
_SC_CACHE_READ = _SCOL["n_cache_read"]
_SC_CACHE_WRITE = _SCOL["n_cache_write"]
_SC_COMPUTE_AT = _SCOL["n_compute_at"]
_SC_REV_COMPUTE_AT = _SCOL["n_reverse_compute_at"]
_SC_INLINE = _SCOL["n_inline"]
_SC_FUSED_PAR = _SCOL["max_fused_parallel"]
_SC_FUSED_VEC = _SCOL["max_fused_vectorize"]
_SC_N_PAR = _SCOL["n_parallel_loops"]
_SC_N_VEC = _SCOL["n_vectorize_loops"]
_SC_N_BIND = _SCOL["n_thread_binds"]
_SC_LOC_MEAN = _SCOL["compute_location_mean"]
assert all(_SCOL[f"count={k}"] == _SC_COUNT0 + i for i, k in enumerate(KNOWN_KINDS[1:]))
_CACHE_READ_IDS = [KIND_TO_ID[k] for k in sorted(_CACHE_READ_KINDS)]
_CACHE_WRITE_IDS = [KIND_TO_ID[k] for k in sorted(_CACHE_WRITE_KINDS)]
_ID_COMPUTE_AT = KIND_TO_ID["ComputeAt"]
_ID_REV_COMPUTE_AT = KIND_TO_ID["ReverseComputeAt"]
_ID_INLINE = KIND_TO_ID["ComputeInline"]
_ID_REV_INLINE = KIND_TO_ID["ReverseComputeInline"]


def _rv_memo(x: Any) -> str | None:
    """``_rv(x)`` through ``_RV_MEMO`` (unhashable values are never variable names)."""
    try:
        return _RV_MEMO[x]
    except KeyError:
        c = _rv(x)
        if len(_RV_MEMO) >= _MEMO_LIMIT:
            _RV_MEMO.clear()
        _RV_MEMO[x] = c
        return c
    except TypeError:
        return None


def _slog_memo(x: float) -> float:
    v = _SLOG_MEMO.get(x)
    if v is None:
        v = _slog(x)
        if len(_SLOG_MEMO) >= _MEMO_LIMIT:
            _SLOG_MEMO.clear()
            _SLOG_MEMO.update(enumerate(_LOG_TABLE))
        _SLOG_MEMO[x] = v
    return v


def _log2_memo(f: float) -> float:
    v = _LOG2_MEMO.get(f)
    if v is None:
        v = math.log2(min(f, _BIG))
        if len(_LOG2_MEMO) >= _MEMO_LIMIT:
            _LOG2_MEMO.clear()
        _LOG2_MEMO[f] = v
    return v


def _num_fast(x: Any) -> float | None:
    """``_num`` with fast paths for exact ``int`` / ``float``."""
    tx = type(x)
    if tx is float:
        return x if x - x == 0.0 else None
    if tx is int:
        try:
            return float(x)
        except OverflowError:
            return None
    return _num(x)


def _featurize(acts: list) -> tuple[list[int], array, list]:
    """One pass over a trajectory: (kind ids, float32 args buffer ``[T*NUM_ARGS]``, struct row).

    The struct row is a list of Python numbers in :data:`STRUCT_NAMES` order, before the final
    float64 ``nan_to_num`` and float32 cast.
    """
    T = len(acts)
    A = NUM_ARGS
    inv_T = 1.0 / T if T else 0.0
    buf = array("f", bytes(4 * T * A))
    kinds = [UNK_ID] * T
    counts = [0] * _NK
    producers: dict[str, tuple[int, int, int]] = {}
    values: dict[str, float] = {}
    fused: dict[str, int] = {}
    tile_logs: list[float] = []
    inner_logs: list[float] = []
    locs: list[float] = []
    n_tile_samples = n_ir = n_post = 0
    in_post = False
    par_ext = vec_ext = unroll = 0.0
    unroll_explicit = 0.0
    max_fused_par = max_fused_vec = 0
    n_par = n_vec = n_bind_thread = 0

    kinfo = _KINFO
    unk = _KINFO_UNK
    rvm = _RV_MEMO
    slm = _SLOG_MEMO
    lt = _LOG_TABLE
    empty = _EMPTY
    c_ir, c_post, c_step = _C_IR, _C_POST, _C_STEP
    c_nin, c_nout, c_ref0, c_attr0 = _C_NIN, _C_NOUT, _C_REF0, _C_ATTR0

    rb = -A
    for t in range(T):
        act = acts[t]
        rb += A
        if type(act) is dict or isinstance(act, dict):
            k = act.get("kind")
            if type(k) is str or isinstance(k, str):
                kid, code, ir = kinfo.get(k, unk)
            else:
                kid, code, ir = unk
            inputs = act.get("inputs")
            if type(inputs) is not list:
                inputs = _as_list(inputs)
            attrs = act.get("attrs")
            if type(attrs) is not list:
                attrs = _as_list(attrs)
            outputs = act.get("outputs")
            if type(outputs) is not list:
                outputs = _as_list(outputs)
        else:
            act = None
            kid, code, ir = unk
            inputs = attrs = outputs = empty

        kinds[t] = kid
        counts[kid] += 1
        if ir:
            n_ir += 1
            buf[rb + c_ir] = 1.0
        if in_post:
            n_post += 1

        # -- kind-specific columns and state
        if code:
            if code == _K_SPLIT:
                factors = []
                for x in inputs[1:]:
                    try:
                        cls = rvm[x]
                    except (KeyError, TypeError):
                        cls = _rv_memo(x)
                    factors.append(values.get(x) if cls == "v" else _num_fast(x))
                n = len(factors)
                prod = 0.0
                for i in range(n):
                    f = factors[i]
                    if f is None:
                        continue
                    if i < MAX_TILE_FACTORS:
                        s = slm.get(f)
                        buf[rb + _C_TILE0 + i] = s if s is not None else _slog_memo(f)
                    if f > 0:
                        lg = _LOG2_MEMO.get(f)
                        prod += lg if lg is not None else _log2_memo(f)
                buf[rb + _C_TILE_COUNT] = lt[n] if n <= 1024 else _slog(n)
                buf[rb + _C_TILE_PROD] = prod
            elif code == _K_PTILE or code == _K_QTILE:
                dec = act.get("decision")
                factors = [_num_fast(x) for x in (dec if type(dec) is list else _as_list(dec))]
                n = len(factors)
                prod = 0.0
                logs = []
                for i in range(n):
                    f = factors[i]
                    if f is None:
                        continue
                    if i < MAX_TILE_FACTORS:
                        s = slm.get(f)
                        buf[rb + _C_TILE0 + i] = s if s is not None else _slog_memo(f)
                    if f > 0:
                        lg = _LOG2_MEMO.get(f)
                        if lg is None:
                            lg = _log2_memo(f)
                        prod += lg
                        logs.append(lg)
                buf[rb + _C_TILE_COUNT] = lt[n] if n <= 1024 else _slog(n)
                buf[rb + _C_TILE_PROD] = prod
                for name, f in zip(outputs, factors):
                    if f is not None and _rv_memo(name) == "v":
                        values[name] = f
                if code == _K_PTILE and logs:
                    n_tile_samples += 1
                    tile_logs.extend(logs)
                    last = factors[-1]
                    if last is not None and last > 0:
                        inner_logs.append(_log2_memo(last))
            elif code == _K_ANN or code == _K_UNANN:
                key = _first_str_attr(attrs)
                ki = ANN_KEY_TO_INDEX.get(key) if key is not None else None
                buf[rb + (_C_ANN_KEY0 + ki if ki is not None else _C_ANN_OTHER)] = 1.0
                if code == _K_ANN and len(inputs) > 1:
                    val = inputs[1]
                    cls = _rv_memo(val)
                    if cls == "v":
                        v = values.get(val)
                    elif _is_quoted_str(val):
                        v = None
                        buf[rb + _C_ANN_STR] = 1.0
                    else:
                        v = _num_fast(val)
                    if v is not None:
                        lv = _slog_memo(v)
                        buf[rb + _C_ANN_VALUE] = lv
                        buf[rb + _C_ANN_KNOWN] = 1.0
                        if key is not None:
                            if key == "meta_schedule.parallel":
                                par_ext = max(par_ext, lv)
                            elif key == "meta_schedule.vectorize":
                                vec_ext = max(vec_ext, lv)
                            elif key in _UNROLL_KEYS:
                                unroll = max(unroll, lv)
                                if key == "meta_schedule.unroll_explicit":
                                    unroll_explicit = 1.0
            elif code == _K_FUSE:
                n = 0
                for x in inputs:
                    if _rv_memo(x) == "l":
                        n += fused.get(x, 1)
                if outputs and isinstance(outputs[0], str):
                    fused[outputs[0]] = max(n, 1)
            elif code == _K_PAR:
                n_par += 1
                if inputs and isinstance(inputs[0], str):
                    max_fused_par = max(max_fused_par, fused.get(inputs[0], 1))
            elif code == _K_VEC:
                n_vec += 1
                if inputs and isinstance(inputs[0], str):
                    max_fused_vec = max(max_fused_vec, fused.get(inputs[0], 1))
            elif code == _K_CAT:
                idx, value, n_cand, prob = _categorical_choice(act)
                if idx is not None:
                    buf[rb + _C_CAT_INDEX] = float(min(idx, 1e6))
                if value is not None:
                    buf[rb + _C_CAT_VALUE] = _slog_memo(value)
                    if outputs and _rv_memo(outputs[0]) == "v":
                        values[outputs[0]] = value
                buf[rb + _C_CAT_N] = _slog(n_cand)
                if prob is not None:
                    buf[rb + _C_CAT_PROB] = max(-_BIG, min(prob, _BIG))
            elif code == _K_LOC:
                d = _num_fast(act.get("decision"))
                if d is not None:
                    buf[rb + _C_LOC] = _slog_memo(d)
                    locs.append(max(-_BIG, min(d, _BIG)))
            elif code == _K_EP:
                in_post = True
            elif code == _K_SCOPE:
                scope = _first_str_attr(attrs)
                if scope is not None:
                    hit = False
                    for si, s in enumerate(_SCOPES):
                        if scope == s or scope.startswith(s + "."):
                            buf[rb + _C_SCOPE0 + si] = 1.0
                            hit = True
                            break
                    if not hit:
                        buf[rb + _C_SCOPE_OTHER] = 1.0
            elif code == _K_BIND:
                axis = _first_str_attr(attrs)
                if axis is not None:
                    for bi, p in enumerate(_BIND_PREFIXES):
                        if axis.startswith(p):
                            buf[rb + _C_BIND0 + bi] = 1.0
                            break
                    if axis.startswith("threadIdx"):
                        n_bind_thread += 1

        # -- phase / position
        if in_post:
            buf[rb + c_post] = 1.0
        if t:
            buf[rb + c_step] = t * inv_T

        # -- arity and references to blocks / loops
        nin = len(inputs)
        if nin:
            buf[rb + c_nin] = lt[nin] if nin <= 1024 else _slog(nin)
            r = 0
            for x in inputs:
                try:
                    cls = rvm[x]
                except (KeyError, TypeError):
                    cls = _rv_memo(x)
                if cls is None or cls == "v":
                    continue
                base = rb + c_ref0 + r * _REF_WIDTH
                buf[base if cls == "b" else base + 1] = 1.0
                prod_ = producers.get(x)
                if prod_ is None:
                    buf[base + 5] = 1.0
                else:
                    p_idx, pos, n_out = prod_
                    buf[base + 2] = (t - p_idx) * inv_T
                    buf[base + 3] = pos / (n_out - 1) if n_out > 1 else 0.0
                    buf[base + 4] = lt[n_out] if n_out <= 1024 else _slog(n_out)
                r += 1
                if r >= NUM_REFS:
                    break

        # -- scalar integer attributes
        if attrs:
            a = 0
            for x in attrs:
                tx = type(x)
                if tx is int:
                    try:
                        v = float(x)
                    except OverflowError:
                        continue
                elif tx is float:
                    if x - x != 0.0:
                        continue
                    v = x
                elif tx is str or tx is list or x is None or isinstance(x, (list, tuple, dict, str)):
                    continue
                else:
                    v = _num(x)
                    if v is None:
                        continue
                s = slm.get(v)
                buf[rb + c_attr0 + a] = s if s is not None else _slog_memo(v)
                a += 1
                if a >= NUM_ATTR_INTS:
                    break

        # -- register outputs
        if outputs:
            n_out = len(outputs)
            buf[rb + c_nout] = lt[n_out] if n_out <= 1024 else _slog(n_out)
            pos = 0
            for name in outputs:
                if type(name) is str or isinstance(name, str):
                    producers[name] = (t, pos, n_out)
                pos += 1

    srow: list = [0.0] * NUM_STRUCT
    srow[_SC_TRAJ_LEN] = T
    srow[_SC_COUNT0 : _SC_COUNT0 + _NK - 1] = counts[1:]
    srow[_SC_N_IR] = n_ir
    srow[_SC_N_POST] = n_post
    if tile_logs:
        srow[_SC_TILE_MEAN] = sum(tile_logs) / len(tile_logs)
        srow[_SC_TILE_MAX] = max(tile_logs)
        srow[_SC_TILE_MIN] = min(tile_logs)
    srow[_SC_TILE_N] = n_tile_samples
    if inner_logs:
        srow[_SC_INNER_MEAN] = sum(inner_logs) / len(inner_logs)
        srow[_SC_INNER_MAX] = max(inner_logs)
        srow[_SC_INNER_PROD] = sum(inner_logs)
    srow[_SC_PAR_EXT] = par_ext
    srow[_SC_VEC_EXT] = vec_ext
    srow[_SC_UNROLL] = unroll
    srow[_SC_UNROLL_EXPLICIT] = unroll_explicit
    srow[_SC_CACHE_READ] = sum(counts[i] for i in _CACHE_READ_IDS)
    srow[_SC_CACHE_WRITE] = sum(counts[i] for i in _CACHE_WRITE_IDS)
    srow[_SC_COMPUTE_AT] = counts[_ID_COMPUTE_AT]
    srow[_SC_REV_COMPUTE_AT] = counts[_ID_REV_COMPUTE_AT]
    srow[_SC_INLINE] = counts[_ID_INLINE] + counts[_ID_REV_INLINE]
    srow[_SC_FUSED_PAR] = max_fused_par
    srow[_SC_FUSED_VEC] = max_fused_vec
    srow[_SC_N_PAR] = n_par
    srow[_SC_N_VEC] = n_vec
    srow[_SC_N_BIND] = n_bind_thread
    if locs:
        srow[_SC_LOC_MEAN] = sum(locs) / len(locs)
    return kinds, buf, srow


def _struct_array(srows: list[list]) -> np.ndarray:
    """float32 ``[n, NUM_STRUCT]`` from struct rows (float64, non-finite -> 0, then float32)."""
    out = np.array(srows, dtype=np.float64).reshape(len(srows), NUM_STRUCT)
    return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Result cache
# --------------------------------------------------------------------------------------------
#
# Search featurizes the same trajectories again and again, so results are memoized per
# trajectory, keyed by the content of the action list: a 128-bit BLAKE2b digest of its pickle
# (fast mode, no memo: the bytes depend only on the values and their exact types, so 1, 1.0,
# True, -0.0 and 0.0, lists and tuples, numpy scalars and str subclasses all get distinct
# keys). Trajectories that cannot be pickled (cycles, exotic objects) are simply not cached.
# The key is a snapshot, so mutating an input list after a call cannot affect later results;
# entries are stored compactly (nonzero bit patterns of the rows) and every call returns fresh
# arrays, so callers may modify what they get back.

#: Maximum number of cached trajectories (0 disables the cache) and approximate byte budget.
CACHE_MAX_ENTRIES = 50_000
CACHE_MAX_BYTES = 256 << 20


class _Entry:
    __slots__ = ("T", "kinds", "idx", "bits", "struct", "nbytes")

    def __init__(self, T: int, kinds: np.ndarray, idx: np.ndarray, bits: np.ndarray,
                 struct: np.ndarray):
        self.T = T
        self.kinds = kinds  # uint8 [T]
        self.idx = idx  # flat indices into [T, NUM_ARGS] of the nonzero bit patterns
        self.bits = bits  # uint32 bit patterns of the float32 values at idx
        self.struct = struct  # float32 [NUM_STRUCT]
        self.nbytes = kinds.nbytes + idx.nbytes + bits.nbytes + struct.nbytes + 600

    def args(self) -> np.ndarray:
        out = np.zeros((self.T, NUM_ARGS), dtype=np.float32)
        out.view(np.uint32).reshape(-1)[self.idx] = self.bits
        return out


_CACHE: OrderedDict[bytes, _Entry] = OrderedDict()
_CACHE_BYTES = 0
_CACHE_LOCK = threading.Lock()
_CACHE_STATS = {"hits": 0, "misses": 0}
assert len(KNOWN_KINDS) <= 256  # kind ids stored as uint8


def _cache_key(acts: list) -> bytes | None:
    try:
        buf = io.BytesIO()
        p = pickle.Pickler(buf, protocol=5)
        p.fast = True
        p.dump(acts)
        return hashlib.blake2b(buf.getbuffer(), digest_size=16).digest()
    except Exception:  # unpicklable / cyclic / too deep: not cached
        return None


def _cache_get(key: bytes) -> _Entry | None:
    with _CACHE_LOCK:
        e = _CACHE.get(key)
        if e is not None:
            _CACHE.move_to_end(key)
            _CACHE_STATS["hits"] += 1
        else:
            _CACHE_STATS["misses"] += 1
        return e


def _cache_put(key: bytes, e: _Entry) -> None:
    global _CACHE_BYTES
    max_entries, max_bytes = int(CACHE_MAX_ENTRIES), int(CACHE_MAX_BYTES)
    if max_entries <= 0 or e.nbytes > max_bytes:
        return
    with _CACHE_LOCK:
        old = _CACHE.pop(key, None)
        if old is not None:
            _CACHE_BYTES -= old.nbytes
        _CACHE[key] = e
        _CACHE_BYTES += e.nbytes
        while _CACHE and (len(_CACHE) > max_entries or _CACHE_BYTES > max_bytes):
            _, old = _CACHE.popitem(last=False)
            _CACHE_BYTES -= old.nbytes


def clear_feature_cache() -> None:
    """Drop all memoized featurization results (and the small per-value memo tables)."""
    global _CACHE_BYTES
    with _CACHE_LOCK:
        _CACHE.clear()
        _CACHE_BYTES = 0
        _CACHE_STATS.update(hits=0, misses=0)
    _RV_MEMO.clear()
    _LOG2_MEMO.clear()
    _SLOG_MEMO.clear()
    _SLOG_MEMO.update(enumerate(_LOG_TABLE))


def feature_cache_info() -> dict[str, int]:
    """``{"entries", "bytes", "hits", "misses", "max_entries", "max_bytes"}`` of the cache."""
    with _CACHE_LOCK:
        return {
            "entries": len(_CACHE),
            "bytes": _CACHE_BYTES,
            "hits": _CACHE_STATS["hits"],
            "misses": _CACHE_STATS["misses"],
            "max_entries": int(CACHE_MAX_ENTRIES),
            "max_bytes": int(CACHE_MAX_BYTES),
        }


def _as_actions(actions: Any) -> list:
    return list(actions) if isinstance(actions, (list, tuple)) else []


def _make_entry(kinds: list[int], buf: array, srow_f32: np.ndarray) -> _Entry:
    T = len(kinds)
    bits_all = np.frombuffer(buf, dtype=np.uint32) if T else np.zeros(0, np.uint32)
    nz = np.flatnonzero(bits_all)  # -0.0 has a nonzero bit pattern and is kept
    idx = nz.astype(np.uint16 if T * NUM_ARGS <= 65536 else np.int64)
    return _Entry(T, np.array(kinds, dtype=np.uint8), idx, bits_all[nz], srow_f32)


def _entries(actions_list: Sequence[Any]) -> list[_Entry]:
    """Featurize (or fetch) every trajectory of a batch."""
    use_cache = int(CACHE_MAX_ENTRIES) > 0
    out: list[_Entry | None] = []
    todo: list[tuple[int, bytes | None, list[int], array, list]] = []
    pending: dict[bytes, int] = {}  # key -> index in todo (duplicates within the batch)
    dup: list[tuple[int, int]] = []
    for i, actions in enumerate(actions_list):
        acts = _as_actions(actions)
        key = _cache_key(acts) if use_cache and acts else None
        if key is not None:
            e = _cache_get(key)
            if e is not None:
                out.append(e)
                continue
            j = pending.get(key)
            if j is not None:
                out.append(None)
                dup.append((i, j))
                continue
            pending[key] = len(todo)
        out.append(None)
        kinds, buf, srow = _featurize(acts)
        todo.append((i, key, kinds, buf, srow))
    if todo:
        structs = _struct_array([t[4] for t in todo])
        for (i, key, kinds, buf, _), s in zip(todo, structs):
            e = _make_entry(kinds, buf, s.copy())
            out[i] = e
            if key is not None:
                _cache_put(key, e)
        for i, j in dup:
            out[i] = out[todo[j][0]]
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def encode_actions(actions: list[dict]) -> dict[str, np.ndarray]:
    """Encode one trajectory of length T.

    Returns ``{"kind": int64 [T], "args": float32 [T, NUM_ARGS]}``; the columns of ``args``
    are described by :data:`ARG_NAMES`.
    """
    e = _entries([actions])[0]
    return {"kind": e.kinds.astype(np.int64), "args": e.args()}


def structured_features(actions: list[dict]) -> np.ndarray:
    """Trajectory-level features, float32 ``[NUM_STRUCT]`` (see :data:`STRUCT_NAMES`)."""
    return _entries([actions])[0].struct.copy()


def encode_actions_batch(actions_list: Sequence[Sequence[dict]]) -> dict[str, np.ndarray]:
    """:func:`encode_actions` of many trajectories, zero padded to the longest one ``T``.

    Returns ``{"kind": int64 [B, T], "args": float32 [B, T, NUM_ARGS], "mask": bool [B, T],
    "lengths": int64 [B]}``; row ``i`` up to ``lengths[i]`` equals ``encode_actions(
    actions_list[i])`` and padding is 0 (kind id 0 is padding).
    """
    entries = _entries(list(actions_list))
    B = len(entries)
    lengths = np.array([e.T for e in entries], dtype=np.int64)
    T = int(lengths.max()) if B else 0
    kind = np.zeros((B, T), dtype=np.int64)
    args = np.zeros((B, T, NUM_ARGS), dtype=np.float32)
    mask = np.arange(T) < lengths[:, None] if B else np.zeros((0, 0), dtype=bool)
    if B and T:
        kind[mask] = np.concatenate([e.kinds for e in entries])
        counts = [len(e.idx) for e in entries]
        if sum(counts):
            idx = np.concatenate([e.idx for e in entries]).astype(np.int64)
            idx += np.repeat(np.arange(B, dtype=np.int64) * (T * NUM_ARGS), counts)
            args.view(np.uint32).reshape(-1)[idx] = np.concatenate([e.bits for e in entries])
    return {"kind": kind, "args": args, "mask": mask, "lengths": lengths}


def structured_features_batch(actions_list: Sequence[Sequence[dict]]) -> np.ndarray:
    """:func:`structured_features` of many trajectories stacked: float32 ``[B, NUM_STRUCT]``."""
    entries = _entries(list(actions_list))
    if not entries:
        return np.zeros((0, NUM_STRUCT), dtype=np.float32)
    return np.stack([e.struct for e in entries])


__all__ = [
    "ANNOTATION_KEYS",
    "ARG_NAMES",
    "CACHE_MAX_BYTES",
    "CACHE_MAX_ENTRIES",
    "KNOWN_KINDS",
    "KIND_TO_ID",
    "NUM_ARGS",
    "NUM_STRUCT",
    "PAD_ID",
    "STRUCT_NAMES",
    "UNK_ID",
    "clear_feature_cache",
    "encode_actions",
    "encode_actions_batch",
    "feature_cache_info",
    "kind_id",
    "structured_features",
    "structured_features_batch",
]
