"""Model files by suffix: ``.pt2`` (``torch.export.save``) and ``.onnx``; one registry for the CLI and
the benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..errors import CwmError

# suffix -> (loader(path, example_inputs, target) -> ImportedModel, description)
MODEL_FILES: dict[str, tuple[str, str]] = {
    ".pt2": ("cwm.frontend.pytorch:load_pt2", "a torch.export.save archive (its saved example inputs)"),
    ".onnx": ("cwm.frontend.onnx_model:load_onnx", "an ONNX model (random example inputs of its input shapes)"),
}


def is_model_file(name) -> bool:
    return Path(str(name)).suffix.lower() in MODEL_FILES


def _loader(suffix: str) -> Callable:
    import importlib

    module, attr = MODEL_FILES[suffix][0].split(":")
    return getattr(importlib.import_module(module), attr)


def load_model_file(path, example_inputs=None, target=None, **kwargs):
    """An ``ImportedModel`` from a model file, by its suffix (``MODEL_FILES``)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in MODEL_FILES:
        raise CwmError(f"{path}: unknown model file type {suffix or '(no suffix)'}; cwm reads "
                       + ", ".join(f"{s} ({d})" for s, (_, d) in MODEL_FILES.items()))
    if not path.is_file():
        raise CwmError(f"model file {path} does not exist")
    return _loader(suffix)(path, example_inputs, target, **kwargs)
