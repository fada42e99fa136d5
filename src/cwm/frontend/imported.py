"""A user's model imported into Relax: the module to tune and build, its example inputs and its reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..deploy.check import TOLERANCES


@dataclass
class ImportedModel:
    """What every frontend (``nn.Module``, ``ExportedProgram``, ``.pt2``, ``.onnx``) gives the compiler.

    ``mod`` is the Relax module with its weights bound as constants, not yet fused (the input of
    ``cwm.workloads.pipeline.extract_tasks`` and ``cwm.deploy.build.build_network``). ``reference``
    runs the source model (PyTorch eager, or ONNX Runtime for an ONNX file) on numpy inputs and
    returns its outputs flattened; the compiled model is checked against it with ``tolerance``.
    """

    name: str
    mod: object
    example_inputs: list  # numpy arrays, in the order of the module's inputs
    reference: Callable[[list], list]
    family: str = "mlp"  # the key of cwm.deploy.check.TOLERANCES
    reference_name: str = "PyTorch"
    torch_model: object = None  # the eager torch callable, when the source is PyTorch
    output_spec: object = None  # torch pytree spec of the eager output, to rebuild its structure
    notes: list = field(default_factory=list)  # what was changed to import it (dynamic dims specialized)

    @property
    def tolerance(self) -> dict:
        return dict(TOLERANCES[self.family])

    def expected_outputs(self) -> list[np.ndarray]:
        return self.reference(self.example_inputs)


def family_of_ops(names) -> str:
    """'cnn', 'transformer' or 'mlp' (``TOLERANCES``) from operator names (aten or ONNX)."""
    text = " ".join(str(n).lower() for n in names)
    if "conv" in text:
        return "cnn"
    if any(k in text for k in ("softmax", "layer_norm", "layernormalization", "embedding", "gather")):
        return "transformer"
    return "mlp"


def describe(arrays) -> str:
    return ", ".join(f"{tuple(np.shape(a))} {np.asarray(a).dtype}" for a in arrays)
