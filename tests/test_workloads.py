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
