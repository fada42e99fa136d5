"""Frontends: a user's model (``nn.Module``, ``ExportedProgram``, ``.pt2``, ``.onnx``) into Relax."""

from __future__ import annotations

from .files import MODEL_FILES, is_model_file, load_model_file
from .imported import ImportedModel

__all__ = ["ImportedModel", "MODEL_FILES", "is_model_file", "load_model_file"]
