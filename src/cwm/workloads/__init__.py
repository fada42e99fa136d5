"""Workloads: the operator registry and real networks, as MetaSchedule tasks."""

from __future__ import annotations

from .networks import NETWORKS, get_network, network_tasks, tunable
from .operators import OPERATORS, get_task, parse_workload, registry_tasks
from .resolve import load_tir_file, resolve_task
from .task import Task, task_id_of

__all__ = [
    "NETWORKS",
    "OPERATORS",
    "Task",
    "get_network",
    "get_task",
    "load_tir_file",
    "network_tasks",
    "parse_workload",
    "registry_tasks",
    "resolve_task",
    "task_id_of",
    "tunable",
]
