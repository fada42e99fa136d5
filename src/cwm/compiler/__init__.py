"""The compiler: ``cwm.compile`` (tune, build, cache and check a user's model) and the Dynamo backend."""

from __future__ import annotations

from .api import DEFAULT_TRIALS_PER_TASK, compile, compile_imported, tune_imported
from .cache import CacheEntry, cache_root
from .compiled import CompiledModel

__all__ = ["CacheEntry", "CompiledModel", "DEFAULT_TRIALS_PER_TASK", "cache_root", "compile", "compile_imported",
           "tune_imported"]
