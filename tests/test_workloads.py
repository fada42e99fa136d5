import pytest

from cwm.errors import CwmError
from cwm.workloads import OPERATORS, get_task, network_tasks, parse_workload, registry_tasks, resolve_task


def test_registry_covers_the_operator_kinds():
    kinds = {t.kind for t in registry_tasks()}
    assert {"matmul", "dense", "batch_matmul", "conv2d", "depthwise_conv2d", "pool", "softmax", "layernorm"} <= kinds


def test_task_ids_are_stable_and_distinct():
    a, b = get_task("matmul:M=64,N=64,K=64"), get_task("matmul:M=64,N=64,K=64")
    c = get_task("matmul:M=64,N=64,K=63")
    assert a.id == b.id and a.id != c.id
    assert len(a.id) == 16


def test_flops_and_overrides():
    t = get_task("matmul:M=64,N=32,K=16")
    assert t.flops == 2 * 64 * 32 * 16
    assert t.params == {"M": 64, "N": 32, "K": 16}
    assert t.name == "matmul:M=64,N=32,K=16"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nosuchop", "unknown workload"),
        ("matmul:M=abc", "not an integer"),
        ("matmul:M", "malformed shape"),
        ("matmul:Q=3", "no parameter"),
        ("matmul:M=-4", "must be >= 1"),
        ("matmul:M=0", "must be >= 1"),
        ("matmul:M=99999999999", "too large"),
    ],
)
def test_bad_workload_specs(spec, message):
    with pytest.raises(CwmError, match=message):
        get_task(spec)


def test_every_registry_default_builds():
    for name, op in OPERATORS.items():
        task = op.task()
        assert "main" in [gv.name_hint for gv in task.mod.get_global_vars()], name


def test_network_tasks_resnet18():
    tasks = network_tasks("resnet18")
    assert len(tasks) >= 10
    convs = [t for t in tasks if t.kind == "conv2d"]
    assert len(convs) >= 8
    assert any(t.weight > 1 for t in tasks)  # repeated blocks are weighted
    assert all(t.network == "resnet18" for t in tasks)
    again = resolve_task(tasks[3].name)
    assert again.id == tasks[3].id


def test_unknown_network():
    with pytest.raises(CwmError, match="unknown network"):
        network_tasks("vgg1000")


def test_parse_workload():
    assert parse_workload("dense_relu:M=1, N=8") == ("dense_relu", {"M": 1, "N": 8})


NEW_OPERATOR_KINDS = {
    "conv1d": "conv1d", "conv3d": "conv3d", "group_conv2d": "group_conv2d", "dilated_conv2d": "conv2d",
    "conv2d_transpose": "conv2d_transpose", "reduce_sum": "reduction", "reduce_max": "reduction",
    "argmax": "reduction", "global_avg_pool2d": "pool", "dense_silu": "dense",
}


@pytest.mark.parametrize("name", sorted(NEW_OPERATOR_KINDS))
def test_the_wider_operators_build_with_their_kind_and_presets(name):
    from cwm.workloads.operators import OPERATORS, SHAPE_PRESETS

    tasks = [OPERATORS[name].task()] + [OPERATORS[name].task(**p) for p in SHAPE_PRESETS[name]]
    assert {t.kind for t in tasks} == {NEW_OPERATOR_KINDS[name]}
    assert len({t.id for t in tasks}) == len(tasks)  # each preset is its own task
    assert all(t.flops > 0 for t in tasks if name not in ("argmax",))


def test_a_group_count_that_does_not_divide_the_channels_is_a_clear_error():
    from cwm.errors import CwmError

    with pytest.raises(CwmError, match="groups=3 must divide"):
        get_task("group_conv2d:C=256,K=256,groups=3")


def test_kind_names_of_network_tasks_tell_convolution_variants_apart():
    from cwm.workloads.task import kind_of

    assert kind_of("fused_conv2d_transpose_add") == "conv2d_transpose"
    assert kind_of("fused_conv1d_add") == "conv1d"
    assert kind_of("fused_conv3d_relu") == "conv3d"
    assert kind_of("fused_conv2d3_add_relu") == "conv2d"


def test_the_data_networks_are_registered_with_their_inputs():
    from cwm.workloads import NETWORKS

    for name in ["densenet121", "inception_v3", "squeezenet1_1", "shufflenet_v2_x1_0", "mnasnet1_0",
                 "resnext50_32x4d", "wide_resnet50_2", "vgg11", "distilbert", "opt-125m", "t5-small-encoder",
                 "resnet18-b4", "squeezenet1_1-b4", "distilbert-s256"]:
        assert name in NETWORKS, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["squeezenet1_1-b4", "distilbert", "t5-small-encoder"])
def test_a_data_network_splits_into_tasks(name):
    from cwm.workloads import tunable

    tasks = network_tasks(name)
    assert any(tunable(t) for t in tasks) and all(t.network == name for t in tasks)


def _info(tid, name, kind, network=None):
    from cwm.data.database import TaskInfo

    return TaskInfo(id=tid, name=name, kind=kind, network=network)


def test_near_duplicate_shapes_are_told_apart_from_other_shapes():
    from cwm.data.split import near_duplicates

    a = ((1024, 1024), (1024, 1024), (1024, 1024))
    b = ((1024, 1024), (1024, 1023), (1024, 1023))  # N=1023: one logical dimension, in two buffers
    c = ((1024, 1024), (1024, 512), (1024, 512))
    d = ((1000, 1024), (1024, 1023), (1000, 1023))  # two dimensions differ
    assert near_duplicates(a, b) and not near_duplicates(a, c) and not near_duplicates(b, d)
    assert not near_duplicates(a, ((1024, 1024, 1),) * 3)


def test_split_v2_holds_out_networks_and_kinds_and_never_splits_near_duplicates():
    from cwm.data.split import make_split

    tasks, shapes = {}, {}
    for i in range(30):
        kind = ["dense", "conv2d", "softmax"][i % 3]
        tasks[f"t{i}"] = _info(f"t{i}", f"op{i}", kind, network=["netA", "netB", "netC"][i % 3] if i < 12 else None)
        shapes[f"t{i}"] = ((64 + 10 * i, 256),)
    tasks["near"] = _info("near", "op-near", "dense")
    shapes["near"] = ((64 + 10 * 15 + 1, 256),)  # t15's shape, one off: a near-duplicate of t15
    tasks["pool"] = _info("pool", "pool0", "pool")
    split = make_split(tasks, seed=1, shapes=shapes, test_networks=("netA",), test_kinds=("pool",))
    assert sorted(split["train"] + split["val"] + split["test"]) == sorted(tasks)
    assert {t for t in tasks if tasks[t].network == "netA"} <= set(split["test"])
    assert "pool" in split["test"]
    side = {t: k for k, v in split.items() for t in v}
    assert side["near"] == side["t15"]
    for seed in range(10):  # whichever way the shuffle goes
        split = make_split(tasks, seed=seed, shapes=shapes)
        side = {t: k for k, v in split.items() for t in v}
        assert side["near"] == side["t15"]


def test_split_v2_names_an_unknown_held_out_network_or_kind():
    from cwm.data.split import make_split

    tasks = {"a": _info("a", "x", "dense", "netA")}
    with pytest.raises(CwmError, match="no task of network 'gpt9'"):
        make_split(tasks, test_networks=("gpt9",))
    with pytest.raises(CwmError, match="no task of kind 'conv9d'"):
        make_split(tasks, test_kinds=("conv9d",))


def test_leaving_a_network_out_also_leaves_out_its_older_ids_and_its_layers_in_sibling_networks():
    from cwm.data.split import tasks_to_leave_out

    dense = ((128, 768), (768, 3072), (128, 3072))
    tasks = {"new": _info("new", "net/dense", "dense", "net"),  # the network's task as extracted now
             "old": _info("old", "net/dense_v1", "dense", "net"),  # the same layer, an earlier pipeline's id
             "sib": _info("sib", "sibling/dense", "dense", "sibling"),  # the old layer's shape, another network
             "sib-near": _info("sib-near", "sibling/dense2", "dense", "sibling"),
             "other-kind": _info("other-kind", "sibling/gelu", "elementwise", "sibling"),
             "far": _info("far", "sibling/dense3", "dense", "sibling")}
    shapes = {"new": ((128, 768), (96, 768, 32), (128, 3072)),  # prepacked weights: no near-duplicate by shape
              "old": dense, "sib": dense, "sib-near": ((127, 768), (768, 3072), (127, 3072)),
              "other-kind": dense, "far": ((128, 768), (768, 768), (128, 768))}
    assert tasks_to_leave_out(["new"], tasks, shapes, network="net") == {"new", "old", "sib", "sib-near"}
    # by id only (a model file has no network name in the database): the prepacked layer matches nothing
    assert tasks_to_leave_out(["new"], tasks, shapes) == {"new"}
    assert tasks_to_leave_out(["old"], tasks, shapes) == {"old", "sib", "sib-near"}


def test_a_network_left_out_of_a_database_takes_its_recorded_tasks_and_their_near_duplicates(tmp_path):
    from cwm.benchmarks.e2e import network_leave_out_ids
    from cwm.data.database import open_database, write_task_index

    recorded = get_task("matmul:M=256,N=256,K=256")  # in the database under the network's name
    sibling = get_task("matmul:M=256,N=255,K=256")  # its near-duplicate in another network
    unrelated = get_task("matmul:M=64,N=512,K=128")
    recorded.network, sibling.network, unrelated.network = "net", "sibling", "sibling"
    db = open_database(tmp_path / "db")
    for t in (recorded, sibling, unrelated):
        db.commit_workload(t.mod)
    write_task_index(tmp_path / "db", [recorded, sibling, unrelated])
    extracted = get_task("dense_relu:M=32,N=64,K=32")  # the network's task as the pipeline extracts it now
    drop = network_leave_out_ids("net", [extracted], tmp_path / "db")
    assert drop == {extracted.id, recorded.id, sibling.id}
    assert network_leave_out_ids("net", [extracted], tmp_path / "none") == {extracted.id}  # no database yet


def test_task_shapes_read_the_buffers_of_a_task_and_find_its_near_duplicate():
    from cwm.data.split import near_duplicates, task_shapes

    a, b = get_task("matmul:M=1024,N=1024,K=1024"), get_task("matmul:M=1024,N=1023,K=1024")
    shapes = task_shapes({"a": a.mod, "b": b.mod})
    assert shapes["b"] == ((1024, 1024), (1024, 1023), (1024, 1023))
    assert near_duplicates(shapes["a"], shapes["b"])
