import json

import tvm

from cwm.schedule.actions import actions_from_trace_json, trace_to_json, changes_ir, replay, replay_states, trace_json_from_actions
from cwm.data.dataset import load_dataset


def _structurally_equal(a, b) -> bool:
    from tvm_ffi import structural_equal

    return structural_equal(a, b)


def test_json_round_trip_and_replay_equality(tiny_db, tiny_task):
    ds = load_dataset(tiny_db)
    assert len(ds) == 16
    for traj in ds.trajectories:
        text = json.dumps(traj.actions)  # plain JSON
        actions = json.loads(text)
        trace_json = trace_json_from_actions(actions)
        assert actions_from_trace_json(trace_json) == actions
        a = replay(tiny_task.mod, actions).mod
        b = replay(tiny_task.mod, traj.actions).mod
        assert _structurally_equal(a, b)


def test_replay_matches_the_database_schedule(tiny_db, tiny_task):
    import tvm.s_tir.meta_schedule as ms

    db = ms.database.JSONDatabase(work_dir=str(tiny_db), allow_missing=False)
    records = db.get_all_tuning_records()
    ds = load_dataset(tiny_db)
    by_actions = {json.dumps(t.actions): t for t in ds.trajectories}
    assert len(records) == len(ds)
    for rec in records:  # the database returns records sorted by latency
        traj = by_actions[json.dumps(actions_from_trace_json(trace_to_json(rec.trace)))]
        sch = tvm.s_tir.Schedule(tiny_task.mod)
        rec.trace.apply_to_schedule(sch, remove_postproc=False)
        assert _structurally_equal(sch.mod, replay(tiny_task.mod, traj.actions).mod)


def test_intermediate_states(tiny_db, tmp_path):
    ds = load_dataset(tiny_db, cache_dir=tmp_path / "cache")
    traj = ds.trajectories[0]
    steps = traj.ir_steps
    assert steps and all(changes_ir(traj.actions[s - 1]) for s in steps)
    states = [ds.state(traj, s) for s in steps]
    assert ds.state(traj, 0) == ds.initial_states[traj.task_id]
    assert states[-1] == ds.final_state(traj) or steps[-1] != len(traj.actions)
    # Every IR-changing step changes the text of at least one step later on, and splits do.
    assert len(set(states)) > len(states) // 2
    assert "T.parallel" in ds.final_state(traj) or "T.vectorized" in ds.final_state(traj)
    # Cached on disk and served again.
    assert any((tmp_path / "cache").rglob("*.tir"))
    again = load_dataset(tiny_db, cache_dir=tmp_path / "cache")
    assert again.state(again.trajectories[0], steps[0]) == states[0]
    assert replay_states(ds.modules[traj.task_id], traj.actions, [steps[0]])[steps[0]] == states[0]


def test_fast_trace_decoding_equals_the_ffi_container_walk(tiny_db):
    import tvm.s_tir.meta_schedule as ms

    from cwm.schedule.actions import to_plain

    db = ms.database.JSONDatabase(work_dir=str(tiny_db), allow_missing=False)
    for rec in db.get_all_tuning_records():
        for remove_postproc in (False, True):
            assert trace_to_json(rec.trace, remove_postproc) == to_plain(rec.trace.as_json(remove_postproc))


def test_graph_decoding_rejects_only_reachable_opaque_nodes():
    import pytest

    from cwm.schedule.actions import _from_json_graph, _NotPlain

    nodes = [{"type": "ffi.String", "data": "x"}, {"type": "ir.PrimType", "data": {}},
             {"type": "int", "data": 3}, {"type": "ir.IntImm", "data": {"dtype": 1, "value": 2}},
             {"type": "bool", "data": True}, {"type": "ffi.Array", "data": [0, 3, 4, 0]}]
    assert _from_json_graph(json.dumps({"root_index": 5, "nodes": nodes})) == ["x", 3, 1, "x"]
    nodes.append({"type": "ffi.Array", "data": [0, 1]})
    nodes.append({"type": "ffi.Array", "data": [6]})
    with pytest.raises(_NotPlain):
        _from_json_graph(json.dumps({"root_index": 7, "nodes": nodes}))


def test_native_serializer_equals_the_object_graph(tiny_db):
    import tvm.s_tir.meta_schedule as ms

    from cwm.schedule.actions import _from_json_graph, native_trace_json, trace_graph_string, trace_json_text

    assert native_trace_json() is not None, "the C++ serializer did not build (is a C++ compiler installed?)"
    db = ms.database.JSONDatabase(work_dir=str(tiny_db), allow_missing=False)
    for rec in db.get_all_tuning_records():
        for remove_postproc in (False, True):
            text = trace_json_text(rec.trace, remove_postproc)
            assert text.startswith("[")
            assert json.loads(text) == _from_json_graph(trace_graph_string(rec.trace, remove_postproc))


def test_trace_json_falls_back_when_the_native_serializer_fails(tiny_db, monkeypatch):
    import tvm.s_tir.meta_schedule as ms

    import cwm.schedule.actions as actions

    rec = ms.database.JSONDatabase(work_dir=str(tiny_db), allow_missing=False).get_all_tuning_records()[0]
    expected = actions.trace_to_json(rec.trace)

    def fails(trace, remove_postproc, metadata):
        raise TypeError("no plain JSON value")

    monkeypatch.setattr(actions, "_NATIVE", fails)
    text = actions.trace_json_text(rec.trace)
    assert text.startswith("{")  # the object graph
    assert actions.trace_json_from_text(text, rec.trace) == expected
    monkeypatch.setattr(actions, "_NATIVE", False)  # never built
    assert actions.trace_to_json(rec.trace) == expected


def _layout_rewritten_schedule(target):
    """A dense task with a layout-free weight, scheduled and post-processed: its trace ends with
    RewriteLayout's TransformLayout, whose IndexMap input has no plain JSON value."""
    import tvm.s_tir.meta_schedule as ms
    from tvm import te

    a = te.placeholder((16, 32), name="A")
    w = te.placeholder((32, 64), name="W")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((16, 64), lambda i, j: te.sum(a[i, k] * w[k, j], axis=k), name="C")
    func = te.create_prim_func([a, w, c]).with_attr("layout_free_buffers", [1])
    mod = tvm.IRModule({"main": func})
    ctx = ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply",
                         search_strategy="replay-trace", task_name="dense", rand_state=0, num_threads=1)
    sch = ctx.generate_design_space()[0]
    for postproc in ctx.space_generator.postprocs:
        assert postproc.apply(sch)
    assert any(inst.kind.name == "TransformLayout" for inst in sch.trace.insts)
    return mod, sch


def test_layout_rewrites_serialize_as_the_database_stores_them(tmp_path, monkeypatch):
    """The fast (native) and fallback serializers both give a live trace's IndexMap inputs the form the
    JSON database stores, so cost-model cache keys and resumed-search dedup keys agree with the records."""
    import tvm.s_tir.meta_schedule as ms

    import cwm.schedule.actions as actions
    from cwm.data.database import load_raw
    from cwm.hardware import make_target

    target = make_target()
    mod, sch = _layout_rewritten_schedule(target)
    db = ms.database.JSONDatabase(work_dir=str(tmp_path))
    workload = db.commit_workload(mod)
    db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, [1e-3], target,
                                                     ms.arg_info.ArgInfo.from_prim_func(mod["main"])))
    stored = load_raw(tmp_path).records[0].trace_json
    assert any(inst[0] == "TransformLayout" for inst in stored[0])

    text = actions.trace_json_text(sch.trace)
    assert text.startswith("[")  # the native serializer, not the slow object-graph fallback
    assert actions.trace_json_from_text(text, sch.trace) == stored
    monkeypatch.setattr(actions, "_NATIVE", False)
    assert actions.trace_to_json(sch.trace) == stored
