"""Measured records and the trajectory dataset: database, dataset, split, reference archive, stats."""

from __future__ import annotations

from .database import load_raw, merge_database, open_database
from .dataset import TrajectoryDataset, load_dataset
from .reference import pack_database, resolve_db
from .split import load_split, make_split
from .stats import format_dataset_stats, plot_dataset_stats

__all__ = [
    "TrajectoryDataset",
    "format_dataset_stats",
    "load_dataset",
    "load_raw",
    "load_split",
    "make_split",
    "merge_database",
    "open_database",
    "pack_database",
    "plot_dataset_stats",
    "resolve_db",
]
