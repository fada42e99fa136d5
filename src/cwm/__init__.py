"""cwm: compiler world models for tensor program search on TVM MetaSchedule."""

from .errors import CwmError

__version__ = "0.1.0"
__all__ = ["CwmError", "__version__"]
