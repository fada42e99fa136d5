"""PyTorch models into Relax: an ``nn.Module`` or a ``torch.export.ExportedProgram`` with example inputs."""

from __future__ import annotations

import logging

import numpy as np

from ..errors import CwmError, first_line
from ..workloads.pipeline import relax_from_exported
from .imported import ImportedModel, describe, family_of_ops

log = logging.getLogger(__name__)


def _as_tensors(example_inputs) -> tuple:
    import torch

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise CwmError(f"example_inputs must be a tuple of torch tensors, got {type(example_inputs).__name__}"
                       + ("" if not isinstance(example_inputs, (tuple, list)) else
                          f" of {', '.join(type(x).__name__ for x in example_inputs)}"))
    return tuple(x.detach().cpu().contiguous() for x in example_inputs)


def _flatten(out) -> tuple[list, object]:
    """The output's tensors in order and its pytree spec (None when it is not a pytree of tensors)."""
    import torch
    from torch.utils import _pytree as pytree

    if hasattr(out, "to_tuple") and not isinstance(out, (tuple, list, dict)):  # transformers ModelOutput
        out = out.to_tuple()
    leaves, spec = pytree.tree_flatten(out)
    if not all(isinstance(x, torch.Tensor) for x in leaves):
        kinds = sorted({type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)})
        raise CwmError(f"the model returns {', '.join(kinds)} besides tensors; cwm compiles models that return tensors")
    return leaves, spec


def run_eager(fn, inputs: tuple):
    """Run ``fn`` (a module or an exported program's module) without grad; a failure is a ``CwmError``."""
    import torch

    try:
        with torch.no_grad():
            return fn(*inputs)
    except CwmError:
        raise
    except Exception as err:  # whatever the model raises
        raise CwmError(f"the model raises in eager on the example inputs [{describe(inputs)}]: "
                       f"{type(err).__name__}: {first_line(err)}") from None


def _user_input_specs(exported) -> list:
    """(name, shape with ints or symbols, dtype) of an exported program's user inputs."""
    from torch.export.graph_signature import InputKind

    vals = {n.name: n.meta.get("val") for n in exported.graph.nodes if n.op == "placeholder"}
    specs = []
    for spec in exported.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            val = vals.get(spec.arg.name)
            specs.append((spec.arg.name, tuple(val.shape) if val is not None else None,
                          val.dtype if val is not None else None))
    return specs


def check_exported_inputs(exported, inputs: tuple) -> list[str]:
    """CwmError unless ``inputs`` fit the exported program's user inputs (count, static dims, dtypes);
    returns the names of the inputs with dynamic dimensions."""
    specs = _user_input_specs(exported)
    if len(specs) != len(inputs):
        raise CwmError(f"the exported program takes {len(specs)} input(s), got {len(inputs)} [{describe(inputs)}]")
    dynamic = []
    for i, ((name, shape, dtype), x) in enumerate(zip(specs, inputs)):
        if shape is None:
            continue
        want = [d if isinstance(d, int) else None for d in shape]
        if dtype is not None and dtype != x.dtype or len(want) != x.dim() or any(
                w is not None and w != s for w, s in zip(want, x.shape)):
            shown = tuple(w if w is not None else "?" for w in want)
            raise CwmError(f"example input {i} ({name}) has shape {tuple(x.shape)} {x.dtype}; the exported "
                           f"program expects {shown} {dtype}")
        if None in want:
            dynamic.append(name)
    return dynamic


def _export(fn, inputs: tuple):
    import torch

    try:
        with torch.no_grad():
            return torch.export.export(fn, inputs)
    except Exception as err:  # export raises many error types
        raise CwmError(f"cannot export {type(fn).__name__} with torch.export: {first_line(err)}") from None


def from_torch(model, example_inputs, target=None, name: str | None = None) -> ImportedModel:
    """Import an ``nn.Module`` or an ``ExportedProgram`` with ``example_inputs`` (a tuple of tensors).

    The model runs in eager on the inputs first (a model that raises there is a ``CwmError``). An
    exported program's inputs are checked against its signature; one exported with dynamic
    dimensions is specialized to the example inputs' shapes, and ``notes`` says so.
    """
    import torch

    inputs = _as_tensors(example_inputs)
    notes = []
    if isinstance(model, torch.export.ExportedProgram):
        dynamic = check_exported_inputs(model, inputs)
        eager = model.module()
        name = name or "exported program"
        if dynamic:
            notes.append(f"{name}: input(s) {', '.join(dynamic)} have dynamic dimensions; specialized to the "
                         f"example inputs [{describe(inputs)}], so the compiled model takes only these shapes")
            log.warning("%s", notes[-1])
        out = run_eager(eager, inputs)
        exported = _export(eager, inputs) if dynamic else model
    elif isinstance(model, torch.nn.Module):
        model = model.eval()
        eager = model
        name = name or type(model).__name__
        out = run_eager(model, inputs)
        exported = _export(model, inputs)
    else:
        raise CwmError(f"cwm compiles a torch.nn.Module or a torch.export.ExportedProgram, got {type(model).__name__}")
    leaves, spec = _flatten(out)
    mod = relax_from_exported(exported, target, name=name)
    ops = [getattr(n.target, "__name__", str(n.target)) for n in exported.graph.nodes if n.op == "call_function"]

    def reference(np_inputs):
        got = run_eager(eager, tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in np_inputs))
        return [t.detach().cpu().numpy() for t in _flatten(got)[0]]

    return ImportedModel(name=name, mod=mod, example_inputs=[x.numpy() for x in inputs], reference=reference,
                         family=family_of_ops(ops), torch_model=eager, output_spec=spec, notes=notes)


def load_pt2(path, example_inputs=None, target=None) -> ImportedModel:
    """A ``torch.export.save`` file; its saved example inputs unless ``example_inputs`` is given."""
    import zipfile

    import torch

    if not zipfile.is_zipfile(path):
        raise CwmError(f"{path} is not a model: a .pt2 file is a zip archive written by torch.export.save")
    try:
        exported = torch.export.load(str(path))
    except Exception as err:  # a zip that is not an exported program
        raise CwmError(f"{path} is not an exported program (torch.export.save): {first_line(err)}") from None
    if example_inputs is None:
        saved = getattr(exported, "example_inputs", None)
        if not saved or saved[1]:
            raise CwmError(f"{path} has no saved example inputs (or has keyword inputs); pass example inputs")
        example_inputs = saved[0]
    return from_torch(exported, example_inputs, target, name=path.name if hasattr(path, "name") else str(path))
