"""Workloads: the operator registry and real networks, as MetaSchedule tasks."""

from __future__ import annotations

from ..errors import CwmError
from .networks import NETWORKS, get_network, network_tasks, tunable
from .operators import OPERATORS, get_task, parse_workload, registry_tasks
from .task import Task, task_id_of


def resolve_task(name: str, target=None) -> Task:
    """A task from a registry spec (``op`` or ``op:K=V,...``) or a network task name (``net/task``)."""
    if "/" in name:
        network, _, short = name.partition("/")
        for task in network_tasks(network, target):
            if task.name == name:
                return task
        raise CwmError(f"network {network} has no task {short!r}; see `cwm workloads list --network {network}`")
    return get_task(name)


__all__ = [
    "NETWORKS",
    "OPERATORS",
    "Task",
    "get_network",
    "get_task",
    "network_tasks",
    "parse_workload",
    "registry_tasks",
    "resolve_task",
    "task_id_of",
    "tunable",
]
