"""Resolving a workload name or a TVMScript file to a task."""

from __future__ import annotations

from ..errors import CwmError
from .networks import network_tasks
from .operators import get_task
from .task import Task


def resolve_task(name: str, target=None) -> Task:
    """A task from a registry spec (``op`` or ``op:K=V,...``) or a network task name (``net/task``)."""
    if not isinstance(name, str):
        raise CwmError(f"a workload is written as a string like 'matmul:M=128,N=128,K=128', got {name!r}")
    if "/" in name:
        network, _, short = name.partition("/")
        for task in network_tasks(network, target):
            if task.name == name:
                return task
        raise CwmError(f"network {network} has no task {short!r}; see `cwm workloads list --network {network}`")
    return get_task(name)


def load_tir_file(path) -> Task:
    """A user's kernel from a TVMScript file: an IRModule with one PrimFunc, or a bare PrimFunc."""
    from pathlib import Path

    import tvm
    from tvm.script import from_source

    path = Path(path)
    if not path.exists():
        raise CwmError(f"TVMScript file {path} does not exist")
    if path.is_dir():
        raise CwmError(f"TVMScript path {path} is a directory, not a file")
    try:
        source = path.read_text()
    except OSError as err:
        raise CwmError(f"cannot read TVMScript file {path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise CwmError(f"{path} is not a text file, so not TVMScript") from None
    try:
        parsed = from_source(source)
    except Exception as err:  # the parser raises its own diagnostics
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise CwmError(f"{path} does not parse as TVMScript: {first}") from None
    if isinstance(parsed, tvm.tirx.PrimFunc):
        parsed = tvm.IRModule({"main": parsed})
    if not isinstance(parsed, tvm.IRModule):
        raise CwmError(f"{path} holds a {type(parsed).__name__}, not a TIR module or PrimFunc")
    funcs = [gv for gv, f in parsed.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    if len(funcs) != 1:
        raise CwmError(f"{path} must hold exactly one PrimFunc, found {len(funcs)}")
    mod = tvm.IRModule({"main": parsed[funcs[0]].with_attr("global_symbol", "main")})
    return Task(name=f"file:{path.name}", mod=mod)
