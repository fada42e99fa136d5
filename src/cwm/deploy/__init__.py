"""Deployment: build a network from a tuned database, run it on the Relax VM, check it against PyTorch,
profile where its time goes."""

from __future__ import annotations

from .build import BuildResult, build_network
from .check import check_against_torch
from .profile import NetworkProfile, profile_network
from .runtime import load_and_run, load_vm

__all__ = [
    "BuildResult",
    "build_network",
    "check_against_torch",
    "load_and_run",
    "load_vm",
    "NetworkProfile",
    "profile_network",
]
