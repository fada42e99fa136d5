"""TensorIR helpers: the workload module of a database line, a module's block names and buffer shapes."""

from __future__ import annotations


def buffer_shapes(mod) -> tuple[tuple[int, ...], ...]:
    """The shapes of a PrimFunc's buffers (its parameters, the buffers themselves in this TVM), in order."""
    return tuple(tuple(int(d) for d in p.shape) for p in mod["main"].params if getattr(p, "shape", None) is not None)


def workload_module(entry: list):
    """The IRModule of one workload line."""
    import tvm.s_tir.meta_schedule as ms

    return ms.database.Workload.from_json(entry).mod


def block_names(mod) -> tuple[str, ...]:
    """Names of the schedulable blocks of a workload, in program order.

    Structural equality ignores them, but traces address blocks by name: two workloads that are
    structurally equal with other block names (the same subgraph in two networks) cannot share
    records.
    """
    from tvm.s_tir import Schedule

    sch = Schedule(mod)
    found = []

    def walk(block) -> None:
        for child in sch.get_child_blocks(block):
            found.append(sch.get(child).name_hint)
            walk(child)

    walk(sch.get_sblock("root", func_name="main"))
    return tuple(found)
