"""Scheduling actions: MetaSchedule trace instructions as plain JSON, and their replay.

An action is ``{"kind", "inputs", "attrs", "outputs", "decision"}``. Inputs and outputs refer
to random variables by the stable symbolic names the trace serializer assigns (``b0`` a block,
``l3`` a loop, ``v5`` an integer); literal inputs stay literal. The list of actions converts back
to MetaSchedule's trace JSON, so a record's trajectory can be replayed on its initial module.
"""

from __future__ import annotations

import json
from typing import Any

QUERY_KINDS = ("GetSBlock", "GetLoops", "GetChildBlocks", "GetProducers", "GetConsumers", "GetOutputBlocks")
SAMPLING_KINDS = ("SamplePerfectTile", "SamplePartitionedTile", "SampleCategorical", "SampleComputeLocation")
# Instructions that only query or sample: they leave the IR text unchanged.
NON_IR_KINDS = frozenset(QUERY_KINDS + SAMPLING_KINDS + ("EnterPostproc",))


def to_plain(obj: Any) -> Any:
    """Convert TVM containers and immediates to plain Python JSON values.

    Booleans become 0/1, as in MetaSchedule's database files, so a live trace and the same
    trace read back from a database give identical actions.
    """
    import tvm

    if obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, bool):
        return int(obj)
    if isinstance(obj, tvm.tirx.IntImm):
        return int(obj.value)
    if isinstance(obj, tvm.tirx.FloatImm):
        return float(obj.value)
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, dict) or hasattr(obj, "items"):
        return {str(to_plain(k)): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) or hasattr(obj, "__len__"):
        return [to_plain(x) for x in obj]
    import tvm_ffi

    if isinstance(obj, tvm_ffi.Object):
        return object_json_string(obj)
    return str(obj)


def object_json_string(obj) -> str:
    """A trace value with no plain JSON form (``RewriteLayout``'s IndexMap inputs) as MetaSchedule's JSON
    database stores it: its JSON object graph, indented by 2. A live trace and the same trace read back
    from a database then give identical actions and dedup keys."""
    import tvm_ffi

    graph = tvm_ffi.get_global_func("ffi.ToJSONGraph")(obj, _graph_metadata())
    return str(tvm_ffi.get_global_func("ffi.json.Stringify")(graph, 2))


def _graph_metadata() -> dict:
    import tvm

    return {"tvm_version": tvm.__version__}  # what tvm.ir.save_json adds


class _NotPlain(Exception):
    pass


def _from_json_graph(text: str) -> Any:
    """Decode TVM FFI's JSON object graph of a trace into plain values (0/1 for booleans).

    Nodes are stored children first, so one pass in order decodes each shared node once.
    A node kind that has no plain value (e.g. an IndexMap) raises only if the root reaches it;
    IntImm's dtype node, for instance, is never reached.
    """
    graph = json.loads(text)
    values: list[Any] = []
    put = values.append
    opaque = set()
    for i, node in enumerate(graph["nodes"]):
        kind = node["type"]
        if kind == "ffi.Array":
            children = node["data"]
            put([values[j] for j in children])
            if opaque and not opaque.isdisjoint(children):
                opaque.add(i)
        elif kind in ("ffi.String", "int", "float"):
            put(node["data"])
        elif kind == "bool":
            put(int(node["data"]))
        elif kind == "None":
            put(None)
        elif kind in ("ir.IntImm", "ir.FloatImm"):
            # Integer fields are references to "int" nodes; floats are inline.
            value = node["data"]["value"]
            value = values[value] if isinstance(value, int) else value
            put(int(value) if kind == "ir.IntImm" else float(value))
        else:
            put(None)
            opaque.add(i)
    root = graph["root_index"]
    if root in opaque:
        raise _NotPlain(graph["nodes"][root]["type"])
    return values[root]


def trace_graph_string(trace, remove_postproc: bool = False) -> str:
    """The trace's JSON as TVM FFI's object-graph string (done in C++, but ~1 ms per trace)."""
    from tvm.s_tir.schedule import _ffi_api as schedule_api

    global _TO_JSON_GRAPH
    if _TO_JSON_GRAPH is None:
        import tvm_ffi

        _TO_JSON_GRAPH = tvm_ffi.get_global_func("ffi.ToJSONGraphString")
    return _TO_JSON_GRAPH(schedule_api.TraceAsJSON(trace, remove_postproc), None)


_TO_JSON_GRAPH = None
_NATIVE: Any = None  # the compiled serializer, False once it could not be built


def native_trace_json():
    """The C++ trace serializer (``native/trace_json.cc``), compiled on first use; None without a compiler.

    Built with ``tvm_ffi.cpp.load_inline`` and cached under ``~/.cache/tvm-ffi`` (a few seconds once).
    """
    global _NATIVE
    if _NATIVE is None:
        import logging
        from pathlib import Path

        try:
            import tvm_ffi.cpp

            source = (Path(__file__).parent / "native" / "trace_json.cc").read_text()
            module = tvm_ffi.cpp.load_inline("cwm_trace_json", cpp_sources=source, functions=["trace_plain_json"])
            _NATIVE = module.trace_plain_json
        except Exception as err:  # no compiler, or headers that do not match: the object graph still works
            logging.getLogger("cwm").warning("native trace serializer unavailable (%s); using TVM's object graph",
                                             str(err).splitlines()[0] if str(err) else type(err).__name__)
            _NATIVE = False
    return _NATIVE or None


def trace_json_text(trace, remove_postproc: bool = False) -> str:
    """The trace's JSON as a string: compact plain JSON from the native serializer, else the object graph.

    Both are deterministic for a given trace, so either can key a cache; decode with
    :func:`trace_json_from_text`.
    """
    native = native_trace_json()
    if native is not None:
        try:
            return native(trace, remove_postproc, _graph_metadata())
        except Exception:  # an object with no JSON object graph
            pass
    return trace_graph_string(trace, remove_postproc)


def trace_json_from_text(text: str, trace, remove_postproc: bool = False) -> list:
    """Plain trace JSON from :func:`trace_json_text`'s output (``trace`` is the fallback)."""
    if text.startswith("["):
        return json.loads(text)
    try:
        return _from_json_graph(text)
    except _NotPlain:
        from tvm.s_tir.schedule import _ffi_api as schedule_api

        # The FFI value, not Trace.as_json, which turns an IndexMap into unindented JSON
        return to_plain(schedule_api.TraceAsJSON(trace, remove_postproc))


def trace_to_json(trace, remove_postproc: bool = False) -> list:
    """MetaSchedule's trace JSON ``[instructions, decisions]`` as plain Python values.

    Serialized in C++ and decoded here, many times faster than walking the FFI containers from
    Python; anything the serializers do not know falls back to the container walk.
    """
    return trace_json_from_text(trace_json_text(trace, remove_postproc), trace, remove_postproc)


def actions_from_trace_json(trace_json: list) -> list[dict]:
    insts, decisions = trace_json
    by_index = {int(i): d for i, d in decisions}
    actions = []
    for i, (kind, inputs, attrs, outputs) in enumerate(insts):
        actions.append(
            {
                "kind": kind,
                "inputs": list(inputs),
                "attrs": list(attrs),
                "outputs": list(outputs),
                "decision": by_index.get(i),
            }
        )
    return actions


LAYOUT_REWRITE_ANNOTATION = "meta_schedule.layout_rewrite_preproc"


def without_layout_rewrites(actions: list[dict]) -> list[dict]:
    """The actions without the weight-layout rewrites of MetaSchedule's ``RewriteLayout`` postprocessor.

    Per layout-free weight it appends CacheRead, an Annotate marking that copy as layout-rewrite
    preprocessing, and TransformLayout. They follow from the schedule before them and decide nothing;
    the world model scores what decides, and was trained on traces that have none.
    """
    def marks_rewrite(a: dict) -> bool:
        return a["kind"] == "Annotate" and a["attrs"][:1] == [LAYOUT_REWRITE_ANNOTATION]

    start = next((i for i, a in enumerate(actions) if a["kind"] == "EnterPostproc"), len(actions))
    marked = {a["inputs"][0] for a in actions[start:] if marks_rewrite(a) and a["inputs"]}
    if not marked:
        return actions

    def derived(a: dict) -> bool:
        return (a["kind"] == "TransformLayout" or marks_rewrite(a)
                or (a["kind"] == "CacheRead" and bool(set(a["outputs"]) & marked)))

    return actions[:start] + [a for a in actions[start:] if not derived(a)]


def model_actions(trace_json: list) -> list[dict]:
    """The actions the world model sees for a trace (see ``without_layout_rewrites``)."""
    return without_layout_rewrites(actions_from_trace_json(trace_json))


def trace_json_from_actions(actions: list[dict]) -> list:
    insts, decisions = [], []
    for i, a in enumerate(actions):
        insts.append([a["kind"], list(a["inputs"]), list(a["attrs"]), list(a["outputs"])])
        if a.get("decision") is not None:
            decisions.append([i, a["decision"]])
    return [insts, decisions]


def changes_ir(action: dict) -> bool:
    return action["kind"] not in NON_IR_KINDS


def replay(mod, actions: list[dict], upto: int | None = None):
    """Apply the first ``upto`` actions (all by default) to ``mod``; returns the Schedule."""
    from tvm import s_tir

    prefix = actions if upto is None else actions[:upto]
    sch = s_tir.Schedule(mod, debug_mask="none", error_render_level="none", enable_check=False)
    s_tir.Trace.apply_json_to_schedule(trace_json_from_actions(prefix), sch)
    return sch


def replay_states(mod, actions: list[dict], steps: list[int] | None = None) -> dict[int, str]:
    """TensorIR text after each IR-changing action (or the given steps).

    Step t means "after the first t actions"; step 0 is the initial state. Replaying the
    whole trace once and reading states on the way would need schedule copies, so each state
    is replayed from the start; callers cache what they need.
    """
    if steps is None:
        steps = [i + 1 for i, a in enumerate(actions) if changes_ir(a)]
    return {t: replay(mod, actions, t).mod.script() for t in steps}


def trace_key(trace_json) -> str:
    return json.dumps(trace_json, sort_keys=True, separators=(",", ":"))
