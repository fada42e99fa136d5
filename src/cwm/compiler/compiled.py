"""A compiled model: the tuned library on the Relax VM, called with and returning torch tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..deploy.runtime import LoadedNetwork


class CompiledModel:
    """Call it like the model: torch tensors (or numpy arrays) in, torch tensors out, in the structure
    of the model's output (a tensor, a tuple, a dict, ...). ``lib_path`` is the exported library
    (in the cache), ``report`` what ``cwm.compile`` measured."""

    def __init__(self, lib_path, output_spec=None, device: str = "cpu", report: dict | None = None):
        self.lib_path = Path(lib_path)
        self.network = LoadedNetwork(self.lib_path, device)
        self.output_spec = output_spec
        self.report = report or {}

    def run_numpy(self, inputs) -> list[np.ndarray]:
        """The flattened outputs as numpy arrays."""
        return self.network.run(inputs)

    def __call__(self, *args):
        import torch

        arrays = [a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a) for a in args]
        outs = [torch.from_numpy(o) for o in self.run_numpy(arrays)]
        spec = self.output_spec
        if spec is not None and spec.num_leaves == len(outs):
            from torch.utils import _pytree as pytree

            return pytree.tree_unflatten(outs, spec)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __repr__(self) -> str:
        return f"CompiledModel({self.lib_path})"
