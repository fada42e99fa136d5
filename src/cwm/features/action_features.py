"""Numeric features of scheduling actions (MetaSchedule trace instructions).

Two views of one trajectory (a list of action dicts, see :mod:`cwm.schedule.actions`):

* :func:`encode_actions` - one row per action: the instruction kind as an integer id into
  :data:`KNOWN_KINDS` and a fixed-width float vector of its arguments (:data:`ARG_NAMES`).
  This is what the latent transition model (:mod:`cwm.model.transition`) consumes step by step.
* :func:`structured_features` - one fixed-length vector per trajectory
  (:data:`STRUCT_NAMES`): kind counts, tile-size statistics, parallel / vectorize / unroll
  extents and the like, for tree models.

Both are pure Python + numpy, deterministic, and never raise on odd values: any input that is
not understood (unknown kinds, ``None``, nested lists, strings where numbers were expected)
contributes zeros. Magnitudes are compressed with ``log2(1 + x)`` (sign-preserving for
negative numbers) so that all columns stay within a few units.

:func:`encode_actions_batch` / :func:`structured_features_batch` featurize many trajectories at
once (padded / stacked). All four compute both views in one pass and keep them in an LRU cache
keyed by the exact content of the trajectory (see "Result cache" below), since a search loop
featurizes the same trajectories again and again; :func:`clear_feature_cache` empties it.
"""

from __future__ import annotations

import io
import math
import pickle
import re
import threading
from array import array
from collections import OrderedDict
from itertools import chain
from typing import Any, Sequence

import numpy as np

from ..schedule.actions import NON_IR_KINDS, QUERY_KINDS, SAMPLING_KINDS

# --------------------------------------------------------------------------------------------
# Vocabularies
# --------------------------------------------------------------------------------------------

PAD_ID = 0
UNK_ID = 1

#: Instruction kinds, index = kind id. 0 is padding, 1 is "unknown kind".
KNOWN_KINDS: tuple[str, ...] = (
    "<pad>",
    "<unk>",
    *QUERY_KINDS,
    *SAMPLING_KINDS,
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
# Fast featurization
# --------------------------------------------------------------------------------------------
#
# Both views come out of one pass over the trajectory. Most of the work depends on one action
# alone (kind, arity, attributes, sampled decision, ...) and search sees the same actions over
# and over, so each distinct action is analysed once into a *record* (``_action_record``),
# memoized under the action's own pickle, which comes for free from the pickle of the whole
# trajectory made for the result cache key (``_records``). The pass (``_run``) then copies
# each record's static row into a float32 buffer and only resolves what depends on earlier
# actions: references to producers, Split factors and Annotate values through sampled
# variables, fused loop counts; position / phase columns and kind counts are filled with numpy
# afterwards. Every float is computed by the same operations, in the same order, as the
# straightforward per-action definition (the column docs above), and rounded to float32 once
# (``array('f')`` stores round like ``np.asarray(rows, dtype=np.float32)``), so the results
# are bitwise identical to it.

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


_IR_BY_KID = [0] * _NK
for _k, (_kid, _code, _ir) in _KINFO.items():
    _IR_BY_KID[_kid] = _ir
_IR_BY_KID[UNK_ID] = _KINFO_UNK[2]
_IR_ARR = np.array(_IR_BY_KID, dtype=np.int64)
_ZERO_ROW = array("f", bytes(4 * NUM_ARGS))
_ZERO_BUF = array("f", bytes(4 * NUM_ARGS * 256))

# Dynamic part of an action record: what depends on earlier actions of the trajectory.
_D_ANN_LIT = 1  # Annotate literal value feeding a parallel / vectorize / unroll extent
_D_ANN_VAR = 2  # Annotate value is a sampled variable
_D_SPLIT = 3  # Split factors resolved through earlier samples
_D_TILE = 4  # register sampled tile factors (and SamplePerfectTile statistics)
_D_FUSE = 5
_D_PAR = 6
_D_VEC = 7
_D_CAT = 8  # register the chosen categorical value
_D_LOC = 9  # compute-location statistics
_D_EP = 10
_D_BIND_THREAD = 11

#: Annotation key -> the structured extent its value feeds (0: none).
_ANN_KEY_CLASS = {
    "meta_schedule.parallel": 1,
    "meta_schedule.vectorize": 2,
    **{k: 3 for k in _UNROLL_KEYS},
    "meta_schedule.unroll_explicit": 4,
}

_DICT_ONLY = {dict}
#: Per-action memo: the pickle of one action (see ``_records``) -> its record.
_REC_MEMO: dict[bytes, tuple] = {}
_REC_MEMO_LIMIT = 100_000
#: Resolved Split factors (floats / None) -> its tile columns. Equal factor tuples give equal
#: columns (a -0.0 factor writes exactly what 0.0 does), so they can share them.
_SPLIT_MEMO: dict[tuple, tuple] = {}
_SPLIT_MEMO_LIMIT = 1 << 16


def _tile_writes(factors: Sequence[float | None]) -> tuple[tuple[tuple[int, float], ...], tuple]:
    """Tile columns of ``factors`` (decision of a tile sample, or the factors of a Split) as
    ``((column, value), ...)``, and the ``log2`` of each positive factor in order."""
    writes = []
    logs = []
    prod = 0.0
    for i, f in enumerate(factors):
        if f is None:
            continue
        if i < MAX_TILE_FACTORS:
            writes.append((_C_TILE0 + i, _slog(f)))
        if f > 0:
            lg = math.log2(min(f, _BIG))
            prod += lg
            logs.append(lg)
    writes.append((_C_TILE_COUNT, _slog(len(factors))))
    writes.append((_C_TILE_PROD, prod))
    return tuple(writes), tuple(logs)


# tile_0 .. tile_7, tile_count, tile_log2_prod are the first columns
_N_TILE_COLS = _C_TILE_PROD + 1
assert _C_TILE0 == 0 and _C_TILE_COUNT == MAX_TILE_FACTORS and _C_TILE_PROD == _C_TILE_COUNT + 1


def _split_tiles(factors: Sequence[float | None]) -> array:
    """The tile columns (``[:_N_TILE_COLS]``) of a Split with resolved ``factors``."""
    cols = array("f", bytes(4 * _N_TILE_COLS))
    for c, v in _tile_writes(factors)[0]:
        cols[c] = v
    return cols


def _action_record(act: Any) -> tuple:
    """Everything about one action that does not depend on the rest of the trajectory.

    ``(kind id, static row, refs, output names, outputs, dynamic part)``:

    * static row: ``array('f')`` with every column that depends on the action alone;
    * refs: ``((name, column offset), ...)`` of the first two block / loop inputs, resolved
      against earlier outputs by :func:`_run` (their is_block / is_loop flag is static);
    * output names, outputs: the str outputs, and ``{name: (pos / (n - 1), log2(1 + n))}``;
    * dynamic part: None, or a tuple starting with a ``_D_*`` code.
    """
    row = array("f", _ZERO_ROW)
    if isinstance(act, dict):
        k = act.get("kind")
        kid, code, ir = _KINFO.get(k, _KINFO_UNK) if isinstance(k, str) else _KINFO_UNK
        inputs = _as_list(act.get("inputs"))
        attrs = _as_list(act.get("attrs"))
        outputs = _as_list(act.get("outputs"))
    else:
        kid, code, ir = _KINFO_UNK
        inputs, attrs, outputs = [], [], []
    if ir:
        row[_C_IR] = 1.0
    dyn: tuple | None = None

    if code == _K_PTILE or code == _K_QTILE:
        factors = _tile_decision(act)
        writes, logs = _tile_writes(factors)
        for c, v in writes:
            row[c] = v
        pairs = tuple(
            (name, f) for name, f in zip(outputs, factors) if f is not None and _rv(name) == "v"
        )
        inner = None
        if code == _K_PTILE and logs:
            last = factors[-1]
            if last is not None and last > 0:
                inner = math.log2(min(last, _BIG))
        else:
            logs = ()
        if pairs or logs:
            dyn = (_D_TILE, pairs, logs, inner)
    elif code == _K_SPLIT:
        src = tuple((x, None) if _rv(x) == "v" else (None, _num(x)) for x in inputs[1:])
        # all factors are sampled variables (the usual case): resolved with one map()
        names = tuple(x for x, _ in src) if all(x is not None for x, _ in src) else None
        dyn = (_D_SPLIT, src, names)
    elif code == _K_CAT:
        idx, value, n_cand, prob = _categorical_choice(act)
        if idx is not None:
            row[_C_CAT_INDEX] = float(min(idx, 1e6))
        if value is not None:
            row[_C_CAT_VALUE] = _slog(value)
            if outputs and _rv(outputs[0]) == "v":
                dyn = (_D_CAT, ((outputs[0], value),))
        row[_C_CAT_N] = _slog(n_cand)
        if prob is not None:
            row[_C_CAT_PROB] = max(-_BIG, min(prob, _BIG))
    elif code == _K_LOC:
        d = _num(_decision(act))
        if d is not None:
            row[_C_LOC] = _slog(d)
            dyn = (_D_LOC, max(-_BIG, min(d, _BIG)))
    elif code == _K_ANN or code == _K_UNANN:
        key = _first_str_attr(attrs)
        ki = ANN_KEY_TO_INDEX.get(key) if key is not None else None
        row[_C_ANN_KEY0 + ki if ki is not None else _C_ANN_OTHER] = 1.0
        if code == _K_ANN and len(inputs) > 1:
            kc = _ANN_KEY_CLASS.get(key, 0) if key is not None else 0
            val = inputs[1]
            if _rv(val) == "v":
                dyn = (_D_ANN_VAR, val, kc)
            elif _is_quoted_str(val):
                row[_C_ANN_STR] = 1.0
            else:
                v = _num(val)
                if v is not None:
                    lv = _slog(v)
                    row[_C_ANN_VALUE] = lv
                    row[_C_ANN_KNOWN] = 1.0
                    if kc:
                        dyn = (_D_ANN_LIT, lv, kc)
    elif code == _K_EP:
        dyn = (_D_EP,)
    elif code == _K_FUSE:
        lnames = tuple(x for x in inputs if _rv(x) == "l")
        out = outputs[0] if outputs and isinstance(outputs[0], str) else None
        dyn = (_D_FUSE, lnames, out)
    elif code == _K_PAR or code == _K_VEC:
        name = inputs[0] if inputs and isinstance(inputs[0], str) else None
        dyn = (_D_PAR if code == _K_PAR else _D_VEC, name)
    elif code == _K_SCOPE:
        scope = _first_str_attr(attrs)
        if scope is not None:
            for si, s in enumerate(_SCOPES):
                if scope == s or scope.startswith(s + "."):
                    row[_C_SCOPE0 + si] = 1.0
                    break
            else:
                row[_C_SCOPE_OTHER] = 1.0
    elif code == _K_BIND:
        axis = _first_str_attr(attrs)
        if axis is not None:
            for bi, p in enumerate(_BIND_PREFIXES):
                if axis.startswith(p):
                    row[_C_BIND0 + bi] = 1.0
                    break
            if axis.startswith("threadIdx"):
                dyn = (_D_BIND_THREAD,)

    # -- arity
    row[_C_NIN] = _slog(len(inputs))
    row[_C_NOUT] = _slog(len(outputs))

    # -- references to blocks / loops
    refs = []
    for x in inputs:
        if len(refs) >= NUM_REFS:
            break
        cls = _rv(x)
        if cls is None or cls == "v":
            continue
        off = _C_REF0 + len(refs) * _REF_WIDTH
        row[off + (0 if cls == "b" else 1)] = 1.0
        refs.append((x, off))

    # -- scalar integer attributes
    a = 0
    for x in attrs:
        if a >= NUM_ATTR_INTS:
            break
        if isinstance(x, (list, tuple, dict, str)) or x is None:
            continue
        v = _num(x)
        if v is not None:
            row[_C_ATTR0 + a] = _slog(v)
            a += 1

    # -- outputs: what a reference to each of them reads
    n_out = len(outputs)
    reg: dict[str, tuple[float, float]] = {}
    if n_out:
        ln = _slog(n_out)
        for pos, name in enumerate(outputs):
            if isinstance(name, str):
                reg[name] = (pos / (n_out - 1) if n_out > 1 else 0.0, ln)
    return (kid, row, tuple(refs), tuple(reg), reg, dyn)


def _records(acts: list, data: bytes | None) -> list[tuple]:
    """Records of all actions, through the per-action memo.

    ``data`` is the pickle of ``acts`` made for the trajectory cache key (protocol 3, no
    memo). Each action dict with at least two items pickles to ``}(`` (EMPTY_DICT, MARK)
    followed by its items and SETITEMS, so when there are exactly as many ``}(`` as actions,
    splitting there yields each action's own pickle (the items; the last one also carries
    the list's closing opcodes, which are cut off): an exact key per action without pickling
    again. Anything else (other action types, ``}(`` inside values) is featurized without
    the memo.
    """
    T = len(acts)
    keys = None
    if data is not None and 0 < T <= 1000:
        segs = data.split(b"}(")
        if len(segs) == T + 1 and set(map(type, acts)) == _DICT_ONLY and min(map(len, acts)) >= 2:
            last = segs[T]
            if last[-3:] in (b"ue.", b"ua."):
                segs[T] = last[:-2]
                keys = segs
    if keys is None:
        return [_action_record(a) for a in acts]
    memo = _REC_MEMO
    recs = list(map(memo.get, keys))
    recs[0] = True  # keys[0] is the list's header
    if None in recs:
        if len(memo) + T > _REC_MEMO_LIMIT:
            memo.clear()
        for i, r in enumerate(recs):
            if r is None:
                r = recs[i] = _action_record(acts[i - 1])
                memo[keys[i]] = r
    del recs[0]
    return recs


def _run(recs: list[tuple]) -> tuple[list[int], array, list]:
    """Both views of a trajectory from its action records, in one pass: (kind ids, float32
    args ``[T * NUM_ARGS]``, struct row).

    The struct row holds Python numbers in :data:`STRUCT_NAMES` order; the kind-count columns
    (and what derives from them) are left at 0 and filled for a whole batch by
    :func:`_struct_array`, which also does the final float64 ``nan_to_num`` and float32 cast.
    """
    T = len(recs)
    A = NUM_ARGS
    inv_T = 1.0 / T if T else 0.0
    n = T * A
    buf = _ZERO_BUF[:n] if n <= len(_ZERO_BUF) else array("f", bytes(4 * n))
    # name -> index of the action that output it last (whose record has what a reference reads)
    ptime: dict[str, int] = {}
    # v-name -> value (tile factors, categorical candidate values)
    values: dict[str, float] = {}
    # l-name -> number of original loops fused into it
    fused: dict[str, int] = {}
    tile_logs: list[float] = []
    inner_logs: list[float] = []
    locs: list[float] = []
    n_tile_samples = 0
    first_post = -1
    par_ext = vec_ext = unroll = 0.0
    unroll_explicit = 0.0
    max_fused_par = max_fused_vec = 0
    n_par = n_vec = n_bind_thread = 0
    split_memo = _SPLIT_MEMO
    vget = values.get

    rb = 0
    for t, (_, row, refs, reg_names, _, dyn) in enumerate(recs):
        buf[rb : rb + A] = row
        if dyn is not None:
            d0 = dyn[0]
            if d0 <= _D_ANN_VAR:  # Annotate
                if d0 == _D_ANN_LIT:
                    lv = dyn[1]
                else:
                    v = vget(dyn[1])
                    if v is None:
                        lv = None
                    else:
                        lv = _slog(v)
                        buf[rb + _C_ANN_VALUE] = lv
                        buf[rb + _C_ANN_KNOWN] = 1.0
                kc = dyn[2]
                if kc and lv is not None:
                    if kc == 1:
                        par_ext = max(par_ext, lv)
                    elif kc == 2:
                        vec_ext = max(vec_ext, lv)
                    else:
                        unroll = max(unroll, lv)
                        if kc == 4:
                            unroll_explicit = 1.0
            elif d0 == _D_SPLIT:
                if dyn[2] is not None:
                    fs = tuple(map(vget, dyn[2]))
                else:
                    fs = tuple([vget(x) if x is not None else v for x, v in dyn[1]])
                w = split_memo.get(fs)
                if w is None:
                    w = _split_tiles(fs)
                    if len(split_memo) >= _SPLIT_MEMO_LIMIT:
                        split_memo.clear()
                    split_memo[fs] = w
                buf[rb : rb + _N_TILE_COLS] = w
            elif d0 == _D_TILE:
                values.update(dyn[1])
                if dyn[2]:
                    n_tile_samples += 1
                    tile_logs.extend(dyn[2])
                    if dyn[3] is not None:
                        inner_logs.append(dyn[3])
            elif d0 == _D_FUSE:
                k = 0
                for x in dyn[1]:
                    k += fused.get(x, 1)
                if dyn[2] is not None:
                    fused[dyn[2]] = max(k, 1)
            elif d0 == _D_PAR:
                n_par += 1
                if dyn[1] is not None:
                    max_fused_par = max(max_fused_par, fused.get(dyn[1], 1))
            elif d0 == _D_VEC:
                n_vec += 1
                if dyn[1] is not None:
                    max_fused_vec = max(max_fused_vec, fused.get(dyn[1], 1))
            elif d0 == _D_CAT:
                values.update(dyn[1])
            elif d0 == _D_LOC:
                locs.append(dyn[1])
            elif d0 == _D_EP:
                if first_post < 0:
                    first_post = t
            elif d0 == _D_BIND_THREAD:
                n_bind_thread += 1
        for name, off in refs:
            p = ptime.get(name)
            o = rb + off
            if p is None:
                buf[o + 5] = 1.0
            else:
                buf[o + 2] = (t - p) * inv_T
                pf, ln = recs[p][4][name]
                if pf:
                    buf[o + 3] = pf
                buf[o + 4] = ln
        for name in reg_names:
            ptime[name] = t
        rb += A

    # -- phase / position
    if T:
        rows = np.frombuffer(buf, dtype=np.float32).reshape(T, A)
        # step_frac = t / T: the same float64 product as ``t * inv_T``, then float32
        rows[1:, _C_STEP] = np.arange(1, T) * inv_T
        if first_post >= 0:
            rows[first_post:, _C_POST] = 1.0

    srow: list = [0.0] * NUM_STRUCT
    srow[_SC_TRAJ_LEN] = T
    srow[_SC_N_POST] = T - 1 - first_post if first_post >= 0 else 0
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
    srow[_SC_FUSED_PAR] = max_fused_par
    srow[_SC_FUSED_VEC] = max_fused_vec
    srow[_SC_N_PAR] = n_par
    srow[_SC_N_VEC] = n_vec
    srow[_SC_N_BIND] = n_bind_thread
    if locs:
        srow[_SC_LOC_MEAN] = sum(locs) / len(locs)
    return [r[0] for r in recs], buf, srow


def _struct_array(srows: list[list], kinds: list[list[int]]) -> np.ndarray:
    """float32 ``[n, NUM_STRUCT]`` from :func:`_run` struct rows and kind ids: adds the
    kind-count columns, then float64 ``nan_to_num`` and the float32 cast."""
    n = len(srows)
    out = np.array(srows, dtype=np.float64).reshape(n, NUM_STRUCT)
    lengths = [len(k) for k in kinds]
    flat = np.fromiter(chain.from_iterable(kinds), dtype=np.int64, count=sum(lengths))
    which = np.repeat(np.arange(n, dtype=np.int64), lengths)
    counts = np.bincount(which * _NK + flat, minlength=n * _NK).reshape(n, _NK)
    out[:, _SC_COUNT0 : _SC_COUNT0 + _NK - 1] = counts[:, 1:]
    out[:, _SC_N_IR] = counts @ _IR_ARR
    out[:, _SC_CACHE_READ] = counts[:, _CACHE_READ_IDS].sum(axis=1)
    out[:, _SC_CACHE_WRITE] = counts[:, _CACHE_WRITE_IDS].sum(axis=1)
    out[:, _SC_COMPUTE_AT] = counts[:, _ID_COMPUTE_AT]
    out[:, _SC_REV_COMPUTE_AT] = counts[:, _ID_REV_COMPUTE_AT]
    out[:, _SC_INLINE] = counts[:, _ID_INLINE] + counts[:, _ID_REV_INLINE]
    return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Result cache
# --------------------------------------------------------------------------------------------
#
# Search featurizes the same trajectories again and again, so results are memoized per
# trajectory, keyed by the content of the action list: its pickle (fast mode, no memo: the
# bytes depend only on the values and their exact types, so 1, 1.0, True, -0.0 and 0.0,
# lists and tuples, numpy scalars and str subclasses all get distinct keys, and equal keys
# mean equal inputs). Trajectories that cannot be pickled (cycles, exotic objects) are simply
# not cached. The key is a snapshot taken before featurizing, so mutating an input afterwards
# cannot affect later results. Cached arrays are read-only and never handed out: every call
# returns fresh arrays, so callers may modify what they get back. Least recently used entries
# are dropped beyond CACHE_MAX_ENTRIES trajectories or CACHE_MAX_BYTES bytes (keys and arrays;
# about 18 kB for a trajectory of 46 actions).

#: Maximum number of cached trajectories (0 disables the cache) and byte budget (keys + arrays).
CACHE_MAX_ENTRIES = 50_000
CACHE_MAX_BYTES = 512 << 20


class _Entry:
    """Both views of one trajectory (read-only arrays)."""

    __slots__ = ("kinds", "args", "struct", "nbytes")

    def __init__(self, kinds: np.ndarray, args: np.ndarray, struct: np.ndarray):
        for a in (kinds, args, struct):
            a.flags.writeable = False
        self.kinds = kinds  # int64 [T]
        self.args = args  # float32 [T, NUM_ARGS]
        self.struct = struct  # float32 [NUM_STRUCT]
        self.nbytes = kinds.nbytes + args.nbytes + struct.nbytes + 400


_CACHE: OrderedDict[bytes, _Entry] = OrderedDict()
_CACHE_BYTES = 0
_CACHE_LOCK = threading.Lock()
_CACHE_STATS = {"hits": 0, "misses": 0}


def clear_feature_cache() -> None:
    """Drop all memoized results (the trajectory cache and the per-action memo tables)."""
    global _CACHE_BYTES
    with _CACHE_LOCK:
        _CACHE.clear()
        _CACHE_BYTES = 0
        _CACHE_STATS.update(hits=0, misses=0)
    _REC_MEMO.clear()
    _SPLIT_MEMO.clear()


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
    if type(actions) is list:
        return actions
    return list(actions) if isinstance(actions, (list, tuple)) else []


def _pickles(acts_list: list[list]) -> list[bytes | None]:
    """Pickle of each action list (None when empty or not picklable): the cache key.

    Fast mode (no memo), so the bytes depend only on the values and their exact types;
    protocol 3, so there is no framing (``_records`` splits these bytes per action)."""
    keys: list[bytes | None] = [None] * len(acts_list)
    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=3)
    p.fast = True
    for i, acts in enumerate(acts_list):
        if not acts:
            continue  # empty: cheaper to compute than to look up
        try:
            f.seek(0)
            f.truncate()
            p.dump(acts)
            keys[i] = f.getvalue()
        except Exception:  # unpicklable, cyclic or too deep: not cached
            f = io.BytesIO()
            p = pickle.Pickler(f, protocol=3)
            p.fast = True
    return keys


def _entries(actions_list: Any) -> list[_Entry]:
    """Both views of every trajectory of a batch, from the cache or freshly computed."""
    global _CACHE_BYTES
    items = actions_list if type(actions_list) is list else list(actions_list)
    n = len(items)
    acts_list = [_as_actions(a) for a in items]
    max_entries, max_bytes = int(CACHE_MAX_ENTRIES), int(CACHE_MAX_BYTES)
    use_cache = max_entries > 0 and max_bytes > 0
    keys = _pickles(acts_list)
    out: list[_Entry | None] = [None] * n
    if use_cache:
        with _CACHE_LOCK:
            get, to_end = _CACHE.get, _CACHE.move_to_end
            hits = 0
            for i, k in enumerate(keys):
                if k is not None:
                    e = get(k)
                    if e is not None:
                        to_end(k)
                        out[i] = e
                        hits += 1
            _CACHE_STATS["hits"] += hits
            _CACHE_STATS["misses"] += n - hits
    # featurize the rest, once per distinct key
    todo: list[int] = []
    first: dict[bytes, int] = {}
    dups: list[tuple[int, int]] = []
    for i in range(n):
        if out[i] is None:
            k = keys[i]
            if k is not None and use_cache:
                j = first.get(k)
                if j is not None:
                    dups.append((i, j))
                    continue
                first[k] = i
            todo.append(i)
    if not todo:
        return out  # type: ignore[return-value]
    results = [_run(_records(acts_list[i], keys[i])) for i in todo]
    structs = _struct_array([r[2] for r in results], [r[0] for r in results])
    new = []
    for (kinds, buf, _), s in zip(results, structs):
        args = np.frombuffer(buf, dtype=np.float32).reshape(len(kinds), NUM_ARGS)
        new.append(_Entry(np.array(kinds, dtype=np.int64), args, s))
    for i, e in zip(todo, new):
        out[i] = e
    for i, j in dups:
        out[i] = out[j]
    if use_cache:
        with _CACHE_LOCK:
            for i, e in zip(todo, new):
                k = keys[i]
                if k is None or e.nbytes + len(k) > max_bytes:
                    continue
                old = _CACHE.pop(k, None)
                if old is not None:
                    _CACHE_BYTES -= old.nbytes + len(k)
                _CACHE[k] = e
                _CACHE_BYTES += e.nbytes + len(k)
            while _CACHE and (len(_CACHE) > max_entries or _CACHE_BYTES > max_bytes):
                k, old = _CACHE.popitem(last=False)
                _CACHE_BYTES -= old.nbytes + len(k)
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
    return {"kind": e.kinds.copy(), "args": e.args.copy()}


def structured_features(actions: list[dict]) -> np.ndarray:
    """Trajectory-level features, float32 ``[NUM_STRUCT]`` (see :data:`STRUCT_NAMES`)."""
    return _entries([actions])[0].struct.copy()


def encode_actions_batch(actions_list: Sequence[Sequence[dict]]) -> dict[str, np.ndarray]:
    """:func:`encode_actions` of many trajectories, zero padded to the longest one ``T``.

    Returns ``{"kind": int64 [B, T], "args": float32 [B, T, NUM_ARGS], "mask": bool [B, T],
    "lengths": int64 [B]}``: ``kind[i, :lengths[i]]`` and ``args[i, :lengths[i]]`` equal
    ``encode_actions(actions_list[i])``; padding is 0 (kind id 0 is padding).
    """
    entries = _entries(actions_list)
    B = len(entries)
    lengths = np.array([len(e.kinds) for e in entries], dtype=np.int64)
    T = int(lengths.max()) if B else 0
    kind = np.zeros((B, T), dtype=np.int64)
    args = np.zeros((B, T, NUM_ARGS), dtype=np.float32)
    mask = np.arange(T) < lengths[:, None]
    for b, e in enumerate(entries):
        n = len(e.kinds)
        if n:
            kind[b, :n] = e.kinds
            args[b, :n] = e.args
    return {"kind": kind, "args": args, "mask": mask, "lengths": lengths}


def structured_features_batch(actions_list: Sequence[Sequence[dict]]) -> np.ndarray:
    """:func:`structured_features` of many trajectories, stacked: float32 ``[B, NUM_STRUCT]``."""
    entries = _entries(actions_list)
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
    "MAX_TILE_FACTORS",
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
