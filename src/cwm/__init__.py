"""cwm: compiler world models for tensor program search on TVM MetaSchedule.

The main nouns are imported on first use (``import cwm`` stays cheap and loads neither torch nor TVM):
``cwm.compile`` (tune and build a PyTorch model), ``cwm.tune`` (tune tasks), ``cwm.WorldModel`` and
``cwm.WorldModelCostModel()`` (the MetaSchedule cost model on the shipped world model for this host).
"""

from .errors import CwmError
from .hardware import use_physical_cores

use_physical_cores()  # before TVM's thread pool starts; see its docstring

__version__ = "0.1.0"
__all__ = ["CwmError", "WorldModel", "WorldModelCostModel", "__version__", "compile", "tune"]

# name -> (module, attribute), imported by __getattr__ on first use
_LAZY = {
    "compile": ("cwm.compiler.api", "compile"),
    "tune": ("cwm.tuning.tuner", "tune"),
    "WorldModel": ("cwm.model.world_model", "WorldModel"),
    "WorldModelCostModel": ("cwm.tuning.registry", "world_model_cost_model"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'cwm' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
