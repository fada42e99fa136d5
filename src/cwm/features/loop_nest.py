"""Loop-nest features derived from the action sequence alone (no IR is materialized).

The actions of a MetaSchedule trace determine the tiled loop nest: SamplePerfectTile decisions
give tile factors, Split outputs are loops with those extents, Reorder fixes their order, and
the post-processing actions (Fuse, Parallel, Vectorize, unroll pragmas) act on loops whose
extents follow from the above. Tracking extents through the sequence gives the quantities a
CPU schedule's speed depends on: how much parallel work, the vector width, the register and
cache tiles, unrolling, and where the output is written back.
"""

from __future__ import annotations

import math
import re

import numpy as np

MAX_LEVELS = 5  # spatial tile levels (CPU uses 4, GPU 5)
MAX_REDUCE_LEVELS = 3

SCHEDULE_FEATURE_NAMES = (
    [f"spatial_level{k}_log2" for k in range(MAX_LEVELS)]
    + [f"reduce_level{k}_log2" for k in range(MAX_REDUCE_LEVELS)]
    + [
        "spatial_total_log2",
        "reduce_total_log2",
        "n_spatial_loops",
        "n_reduce_loops",
        "n_tiled_blocks",
        "innermost_spatial_log2",
        "register_tile_log2",
        "inner_reduce_log2",
        "parallel_extent_log2",
        "parallel_per_core",
        "n_parallel",
        "vector_extent_log2",
        "vector_lanes_fraction",
        "n_vectorize",
        "unroll_max_step_log2",
        "unroll_explicit",
        "write_back_level",
        "compute_location_mean",
        "outer_tile_log2",
    ]
)

_QUOTED = re.compile(r'^"(.*)"$')


def _log2(x) -> float:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return 0.0
    return math.log2(x) if x > 0 and math.isfinite(x) else 0.0


def _as_int(x):
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        return x
    if isinstance(x, float) and math.isfinite(x):
        return int(x)
    return None


def schedule_features(actions: list[dict], cores: int = 1, simd_lanes: int = 16) -> np.ndarray:
    """Fixed-length float32 vector, names in ``SCHEDULE_FEATURE_NAMES``; robust to any input."""
    values: dict[str, int] = {}  # sampled integer variables v*
    extents: dict[str, float] = {}  # loop variable -> extent, where known
    structure: dict[str, str] = {}  # block -> tiling structure, e.g. "SSRSRS"
    block_loops: dict[str, list[str]] = {}  # block -> loops from its first GetLoops
    loop_block: dict[str, str] = {}
    tiles: dict[str, list[int]] = {}  # original loop -> tile factors
    order: list[str] = []  # last Reorder, the main nest's loop order
    parallel, vector, locations = [], [], []
    unroll_step = unroll_explicit = 0.0
    write_back = -1.0
    split_outputs: dict[str, tuple[int, int]] = {}  # loop -> (level, number of levels)
    for a in actions:
        if not isinstance(a, dict):
            continue
        kind = a.get("kind")
        ins = a.get("inputs") or []
        attrs = a.get("attrs") or []
        outs = a.get("outputs") or []
        dec = a.get("decision")
        if not isinstance(ins, list) or not isinstance(outs, list) or not isinstance(attrs, list):
            continue
        if kind == "Annotate" and len(ins) >= 2 and attrs:
            key = attrs[0]
            if key == "meta_schedule.tiling_structure" and isinstance(ins[1], str):
                m = _QUOTED.match(ins[1])
                structure[str(ins[0])] = m.group(1) if m else ins[1]
            elif key == "pragma_auto_unroll_max_step":
                v = ins[1] if not isinstance(ins[1], str) else values.get(ins[1])
                unroll_step = max(unroll_step, _log2((_as_int(v) or 0) + 1))
            elif key == "pragma_unroll_explicit":
                unroll_explicit = float(_as_int(ins[1]) or 0)
        elif kind == "GetLoops" and ins:
            block = str(ins[0])
            if len(order) == len(outs) and order:
                for new, old in zip(outs, order):
                    if old in extents:
                        extents[str(new)] = extents[old]
            if block not in block_loops:
                block_loops[block] = [str(x) for x in outs]
                for x in outs:
                    loop_block[str(x)] = block
        elif kind == "SamplePerfectTile" and ins and isinstance(dec, list):
            factors = [_as_int(x) or 1 for x in dec]
            tiles[str(ins[0])] = factors
            for name, f in zip(outs, factors):
                values[str(name)] = f
        elif kind == "SampleCategorical" and outs and isinstance(attrs, list) and attrs:
            cands = attrs[0] if isinstance(attrs[0], list) else []
            idx = _as_int(dec)
            if idx is not None and 0 <= idx < len(cands):
                values[str(outs[0])] = _as_int(cands[idx]) or 0
        elif kind == "SampleComputeLocation":
            idx = _as_int(dec)
            if idx is not None:
                locations.append(idx)
        elif kind == "Split" and ins:
            for level, (out, factor) in enumerate(zip(outs, ins[1:])):
                v = values.get(factor) if isinstance(factor, str) else _as_int(factor)
                if v:
                    extents[str(out)] = float(v)
                split_outputs[str(out)] = (level, len(outs))
        elif kind == "Reorder":
            order = [str(x) for x in ins]
        elif kind == "Fuse":
            known = [extents.get(str(x)) for x in ins]
            if outs and known and all(k is not None for k in known):
                extents[str(outs[0])] = float(math.prod(known))
        elif kind == "Parallel" and ins:
            parallel.append(extents.get(str(ins[0]), 0.0))
        elif kind == "Vectorize" and ins:
            vector.append(extents.get(str(ins[0]), 0.0))
        elif kind == "ReverseComputeAt" and len(ins) >= 2:
            lvl = split_outputs.get(str(ins[1]))
            if lvl:
                write_back = float(lvl[0])

    # The main tiled block: the first block with a tiling structure whose loops were tiled.
    spatial = [0.0] * MAX_LEVELS
    reduce = [0.0] * MAX_REDUCE_LEVELS
    n_sp = n_rd = 0
    innermost = 0.0
    n_tiled = 0
    for block, struct in structure.items():
        loops = [l for l in block_loops.get(block, []) if l in tiles]
        if not loops:
            continue
        n_tiled += 1
        if n_tiled > 1:
            continue
        n_s, n_r = struct.count("S"), struct.count("R")
        for loop in loops:
            f = tiles[loop]
            if len(f) == n_s and n_s:
                n_sp += 1
                for k, x in enumerate(f[:MAX_LEVELS]):
                    spatial[k] += _log2(x)
                innermost = _log2(f[-1])
            elif len(f) == n_r and n_r:
                n_rd += 1
                for k, x in enumerate(f[:MAX_REDUCE_LEVELS]):
                    reduce[k] += _log2(x)
    par = max(parallel) if parallel else 0.0
    vec = max(vector) if vector else 0.0
    feats = spatial + reduce + [
        math.fsum(spatial),
        math.fsum(reduce),
        float(n_sp),
        float(n_rd),
        float(n_tiled),
        innermost,
        math.fsum(spatial[2:]),  # register tile: the innermost spatial levels
        math.fsum(reduce[1:]),
        _log2(par),
        par / max(1, cores),
        float(len(parallel)),
        _log2(vec),
        (vec / simd_lanes) if vec else 0.0,
        float(len(vector)),
        unroll_step,
        unroll_explicit,
        write_back,
        sum(locations) / len(locations) if locations else -1.0,
        spatial[0],
    ]
    out = np.asarray(feats, dtype=np.float32)
    out[~np.isfinite(out)] = 0.0
    return out
