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

import math
import re
from typing import Any

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
# Per-action encoding
# --------------------------------------------------------------------------------------------


def encode_actions(actions: list[dict]) -> dict[str, np.ndarray]:
    """Encode one trajectory of length T.

    Returns ``{"kind": int64 [T], "args": float32 [T, NUM_ARGS]}``; the columns of ``args``
    are described by :data:`ARG_NAMES`.
    """
    acts = list(actions) if isinstance(actions, (list, tuple)) else []
    T = len(acts)
    kinds = np.zeros(T, dtype=np.int64)
    rows: list[list[float]] = []
    # name -> (producer index, position in its outputs, number of outputs)
    producers: dict[str, tuple[int, int, int]] = {}
    # v-name -> integer value (tile factors, categorical candidate values)
    values: dict[str, float] = {}
    in_postproc = 0.0
    inv_T = 1.0 / T if T else 0.0

    for t, act in enumerate(acts):
        kind = _kind_name(act)
        kinds[t] = kind_id(kind)
        inputs = _field(act, "inputs")
        attrs = _field(act, "attrs")
        outputs = _field(act, "outputs")
        row = [0.0] * NUM_ARGS

        # -- sampling decisions and tile factors
        if kind in _TILE_KINDS:
            factors = _tile_decision(act)
            _put_tiles(row, factors)
            for name, f in zip(outputs, factors):
                if f is not None and _rv(name) == "v":
                    values[name] = f
        elif kind == "Split":
            factors = []
            for x in inputs[1:]:
                if _rv(x) == "v":
                    factors.append(values.get(x))
                else:
                    factors.append(_num(x))
            _put_tiles(row, factors)
        elif kind == "SampleCategorical":
            idx, value, n_cand, prob = _categorical_choice(act)
            if idx is not None:
                row[_C_CAT_INDEX] = float(min(idx, 1e6))
            if value is not None:
                row[_C_CAT_VALUE] = _slog(value)
                if outputs and _rv(outputs[0]) == "v":
                    values[outputs[0]] = value
            row[_C_CAT_N] = _slog(n_cand)
            if prob is not None:
                row[_C_CAT_PROB] = max(-_BIG, min(prob, _BIG))
        elif kind == "SampleComputeLocation":
            d = _num(_decision(act))
            if d is not None:
                row[_C_LOC] = _slog(d)

        # -- annotations
        if kind in ("Annotate", "Unannotate"):
            key = _first_str_attr(attrs)
            ki = ANN_KEY_TO_INDEX.get(key) if key is not None else None
            row[_C_ANN_KEY0 + ki if ki is not None else _C_ANN_OTHER] = 1.0
            if kind == "Annotate" and len(inputs) > 1:
                val = inputs[1]
                if _rv(val) == "v":
                    v = values.get(val)
                elif _is_quoted_str(val):
                    v = None
                    row[_C_ANN_STR] = 1.0
                else:
                    v = _num(val)
                if v is not None:
                    row[_C_ANN_VALUE] = _slog(v)
                    row[_C_ANN_KNOWN] = 1.0

        # -- arity
        row[_C_NIN] = _slog(len(inputs))
        row[_C_NOUT] = _slog(len(outputs))

        # -- references to blocks / loops
        r = 0
        for x in inputs:
            if r >= NUM_REFS:
                break
            cls = _rv(x)
            if cls is None or cls == "v":
                continue
            base = _C_REF0 + r * _REF_WIDTH
            row[base + (0 if cls == "b" else 1)] = 1.0
            prod = producers.get(x)
            if prod is None:
                row[base + 5] = 1.0
            else:
                p_idx, pos, n_out = prod
                row[base + 2] = (t - p_idx) * inv_T
                row[base + 3] = pos / (n_out - 1) if n_out > 1 else 0.0
                row[base + 4] = _slog(n_out)
            r += 1

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

        # -- storage scope / thread binding
        if kind in _CACHE_READ_KINDS or kind in _CACHE_WRITE_KINDS or kind == "SetScope":
            scope = _first_str_attr(attrs)
            if scope is not None:
                hit = False
                for si, s in enumerate(_SCOPES):
                    if scope == s or scope.startswith(s + "."):
                        row[_C_SCOPE0 + si] = 1.0
                        hit = True
                        break
                if not hit:
                    row[_C_SCOPE_OTHER] = 1.0
        elif kind == "Bind":
            axis = _first_str_attr(attrs)
            if axis is not None:
                for bi, p in enumerate(_BIND_PREFIXES):
                    if axis.startswith(p):
                        row[_C_BIND0 + bi] = 1.0
                        break

        # -- phase / position
        row[_C_IR] = 0.0 if kind in NON_IR_KINDS else 1.0
        if kind == "EnterPostproc":
            in_postproc = 1.0
        row[_C_POST] = in_postproc
        row[_C_STEP] = t * inv_T

        # -- register outputs
        n_out = len(outputs)
        for pos, name in enumerate(outputs):
            if isinstance(name, str):
                producers[name] = (t, pos, n_out)

        rows.append(row)

    args = np.asarray(rows, dtype=np.float32).reshape(T, NUM_ARGS)
    return {"kind": kinds, "args": args}


def _put_tiles(row: list[float], factors: list[float | None]) -> None:
    prod = 0.0
    for i, f in enumerate(factors):
        if f is None:
            continue
        if i < MAX_TILE_FACTORS:
            row[_C_TILE0 + i] = _slog(f)
        if f > 0:
            prod += math.log2(min(f, _BIG))
    row[_C_TILE_COUNT] = _slog(len(factors))
    row[_C_TILE_PROD] = prod


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


def structured_features(actions: list[dict]) -> np.ndarray:
    """Trajectory-level features, float32 ``[NUM_STRUCT]`` (see :data:`STRUCT_NAMES`)."""
    acts = list(actions) if isinstance(actions, (list, tuple)) else []
    out = np.zeros(NUM_STRUCT, dtype=np.float64)
    out[_SCOL["traj_len"]] = len(acts)
    counts = [0] * len(KNOWN_KINDS)
    values: dict[str, float] = {}
    fused: dict[str, int] = {}
    tile_logs: list[float] = []
    inner_logs: list[float] = []
    n_tile_samples = 0
    n_ir = 0
    n_post = 0
    in_post = False
    par_ext = vec_ext = unroll = 0.0
    unroll_explicit = 0.0
    max_fused_par = max_fused_vec = 0
    n_par = n_vec = n_bind_thread = 0
    locs: list[float] = []

    for act in acts:
        kind = _kind_name(act)
        counts[kind_id(kind)] += 1
        if kind not in NON_IR_KINDS:
            n_ir += 1
        if in_post:
            n_post += 1
        if kind == "EnterPostproc":
            in_post = True
        inputs = _field(act, "inputs")
        attrs = _field(act, "attrs")
        outputs = _field(act, "outputs")

        if kind in _TILE_KINDS:
            factors = _tile_decision(act)
            for name, f in zip(outputs, factors):
                if f is not None and _rv(name) == "v":
                    values[name] = f
            if kind == "SamplePerfectTile":
                logs = [math.log2(min(f, _BIG)) for f in factors if f is not None and f > 0]
                if logs:
                    n_tile_samples += 1
                    tile_logs.extend(logs)
                    last = factors[-1]
                    if last is not None and last > 0:
                        inner_logs.append(math.log2(min(last, _BIG)))
        elif kind == "SampleCategorical":
            _, value, _, _ = _categorical_choice(act)
            if value is not None and outputs and _rv(outputs[0]) == "v":
                values[outputs[0]] = value
        elif kind == "SampleComputeLocation":
            d = _num(_decision(act))
            if d is not None:
                locs.append(max(-_BIG, min(d, _BIG)))
        elif kind == "Fuse":
            n = 0
            for x in inputs:
                if _rv(x) == "l":
                    n += fused.get(x, 1)
            if outputs and isinstance(outputs[0], str):
                fused[outputs[0]] = max(n, 1)
        elif kind == "Parallel":
            n_par += 1
            if inputs and isinstance(inputs[0], str):
                max_fused_par = max(max_fused_par, fused.get(inputs[0], 1))
        elif kind == "Vectorize":
            n_vec += 1
            if inputs and isinstance(inputs[0], str):
                max_fused_vec = max(max_fused_vec, fused.get(inputs[0], 1))
        elif kind == "Bind":
            axis = _first_str_attr(attrs)
            if axis is not None and axis.startswith("threadIdx"):
                n_bind_thread += 1
        elif kind == "Annotate" and len(inputs) > 1:
            key = _first_str_attr(attrs)
            val = inputs[1]
            v = values.get(val) if _rv(val) == "v" else _num(val)
            if key is not None and v is not None:
                lv = _slog(v)
                if key == "meta_schedule.parallel":
                    par_ext = max(par_ext, lv)
                elif key == "meta_schedule.vectorize":
                    vec_ext = max(vec_ext, lv)
                elif key in _UNROLL_KEYS:
                    unroll = max(unroll, lv)
                    if key == "meta_schedule.unroll_explicit":
                        unroll_explicit = 1.0

    for i, k in enumerate(KNOWN_KINDS[1:], start=1):
        out[_SCOL[f"count={k}"]] = counts[i]
    out[_SCOL["n_ir_changing"]] = n_ir
    out[_SCOL["n_postproc_actions"]] = n_post
    if tile_logs:
        out[_SCOL["tile_log2_mean"]] = sum(tile_logs) / len(tile_logs)
        out[_SCOL["tile_log2_max"]] = max(tile_logs)
        out[_SCOL["tile_log2_min"]] = min(tile_logs)
    out[_SCOL["tile_n_samples"]] = n_tile_samples
    if inner_logs:
        out[_SCOL["tile_inner_log2_mean"]] = sum(inner_logs) / len(inner_logs)
        out[_SCOL["tile_inner_log2_max"]] = max(inner_logs)
        out[_SCOL["tile_inner_prod_log2"]] = sum(inner_logs)
    out[_SCOL["parallel_extent_log2"]] = par_ext
    out[_SCOL["vectorize_extent_log2"]] = vec_ext
    out[_SCOL["unroll_max_step_log2"]] = unroll
    out[_SCOL["unroll_explicit"]] = unroll_explicit
    out[_SCOL["n_cache_read"]] = sum(counts[KIND_TO_ID[k]] for k in sorted(_CACHE_READ_KINDS))
    out[_SCOL["n_cache_write"]] = sum(counts[KIND_TO_ID[k]] for k in sorted(_CACHE_WRITE_KINDS))
    out[_SCOL["n_compute_at"]] = counts[KIND_TO_ID["ComputeAt"]]
    out[_SCOL["n_reverse_compute_at"]] = counts[KIND_TO_ID["ReverseComputeAt"]]
    out[_SCOL["n_inline"]] = (
        counts[KIND_TO_ID["ComputeInline"]] + counts[KIND_TO_ID["ReverseComputeInline"]]
    )
    out[_SCOL["max_fused_parallel"]] = max_fused_par
    out[_SCOL["max_fused_vectorize"]] = max_fused_vec
    out[_SCOL["n_parallel_loops"]] = n_par
    out[_SCOL["n_vectorize_loops"]] = n_vec
    out[_SCOL["n_thread_binds"]] = n_bind_thread
    if locs:
        out[_SCOL["compute_location_mean"]] = sum(locs) / len(locs)
    return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0).astype(np.float32)


__all__ = [
    "ANNOTATION_KEYS",
    "ARG_NAMES",
    "KNOWN_KINDS",
    "KIND_TO_ID",
    "NUM_ARGS",
    "NUM_STRUCT",
    "PAD_ID",
    "STRUCT_NAMES",
    "UNK_ID",
    "encode_actions",
    "kind_id",
    "structured_features",
]
