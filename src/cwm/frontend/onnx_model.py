"""ONNX files into Relax (``onnx`` + ``tvm.relax.frontend.onnx``), checked against ONNX Runtime."""

from __future__ import annotations

import logging

import numpy as np

from ..errors import CwmError, first_line
from ..workloads.pipeline import simplify_relax
from .imported import ImportedModel, family_of_ops

log = logging.getLogger(__name__)

# ONNX TensorProto element types -> numpy dtypes (the common ones).
_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
           11: "float64"}


def ort_session(model_or_path, threads: int = 2):
    """An ONNX Runtime session on the CPU execution provider, all graph optimizations, ``threads``
    intra-op threads (the settings of the ``onnxruntime`` contender of ``cwm bench e2e``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    source = model_or_path.SerializeToString() if hasattr(model_or_path, "SerializeToString") else str(model_or_path)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _input_specs(model, input_shapes: dict | None, notes: list) -> list[tuple[str, list[int], str]]:
    """(name, static shape, dtype) of the graph inputs that are not initializers; symbolic dims come
    from ``input_shapes`` or are specialized to 1, with a note."""
    initializers = {i.name for i in model.graph.initializer}
    input_shapes = dict(input_shapes or {})
    specs = []
    for inp in model.graph.input:
        if inp.name in initializers:
            continue
        tt = inp.type.tensor_type
        dtype = _DTYPES.get(tt.elem_type)
        if dtype is None:
            raise CwmError(f"ONNX input {inp.name!r} has element type {tt.elem_type}, which cwm does not handle")
        if inp.name in input_shapes:
            shape = [int(d) for d in input_shapes.pop(inp.name)]
        else:
            shape, symbolic = [], []
            for d in tt.shape.dim:
                if d.HasField("dim_value") and d.dim_value > 0:
                    shape.append(int(d.dim_value))
                else:
                    shape.append(1)
                    symbolic.append(d.dim_param or "?")
            if symbolic:
                notes.append(f"ONNX input {inp.name!r} has dynamic dimension(s) {', '.join(symbolic)}; specialized "
                             f"to {tuple(shape)} (give the shape to choose another)")
                log.warning("%s", notes[-1])
        specs.append((inp.name, shape, dtype))
    if input_shapes:
        raise CwmError(f"the ONNX model has no input named {', '.join(map(repr, input_shapes))}; "
                       f"its inputs: {', '.join(s[0] for s in specs)}")
    return specs


def random_inputs_for(specs, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _, shape, dtype in specs:
        if np.issubdtype(np.dtype(dtype), np.floating):
            out.append(rng.standard_normal(shape).astype(dtype))
        elif dtype == "bool":
            out.append(np.zeros(shape, dtype=bool))
        else:  # integer inputs are usually indices: zeros are always in range
            out.append(np.zeros(shape, dtype=dtype))
    return out


def load_onnx(path, example_inputs=None, target=None, input_shapes: dict | None = None, seed: int = 0) -> ImportedModel:
    """An ONNX file in Relax. Example inputs: ``example_inputs`` (numpy arrays or tensors), else random
    ones of the inputs' shapes (integer inputs zeros). The reference is ONNX Runtime."""
    import onnx

    try:
        model = onnx.load(str(path))
    except Exception as err:  # protobuf DecodeError and friends
        raise CwmError(f"{path} is not a model: ONNX cannot read it ({type(err).__name__}: {first_line(err)})") from None
    if not model.graph.node:
        raise CwmError(f"{path} is not a model: its ONNX graph has no nodes")
    notes: list[str] = []
    if example_inputs is not None:
        arrays = [np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x) for x in
                  (example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))]
        names = [s[0] for s in _input_specs(model, None, [])]
        specs = _input_specs(model, dict(zip(names, [a.shape for a in arrays])), notes)
        for (name, _, dtype), a in zip(specs, arrays):
            if str(a.dtype) != dtype:
                raise CwmError(f"example input {name!r} is {a.dtype}; the ONNX model expects {dtype}")
        if len(arrays) != len(specs):
            raise CwmError(f"the ONNX model takes {len(specs)} input(s), got {len(arrays)}")
    else:
        specs = _input_specs(model, input_shapes, notes)
        arrays = random_inputs_for(specs, seed)
    from tvm.relax.frontend.onnx import from_onnx

    try:
        mod = from_onnx(model, shape_dict={n: s for n, s, _ in specs}, dtype_dict={n: d for n, _, d in specs},
                        keep_params_in_input=False)
    except Exception as err:  # OpNotImplemented names the operators; others are conversion errors
        raise CwmError(f"TVM's ONNX frontend cannot convert {path}: {first_line(err)}") from None
    mod = simplify_relax(mod, target)
    session = None

    def reference(np_inputs):
        nonlocal session
        session = session or ort_session(model)
        try:
            return list(session.run(None, {n: np.ascontiguousarray(x) for (n, _, _), x in zip(specs, np_inputs)}))
        except Exception as err:  # onnxruntime's own errors
            raise CwmError(f"ONNX Runtime fails on {path}: {first_line(err)}") from None

    return ImportedModel(name=path.name if hasattr(path, "name") else str(path), mod=mod, example_inputs=arrays,
                         reference=reference, family=family_of_ops(n.op_type for n in model.graph.node),
                         reference_name="ONNX Runtime", notes=notes)


def export_onnx(model, example_inputs, path) -> None:
    """``torch.onnx.export`` (the dynamo exporter, onnxscript) of a PyTorch model to ``path``."""
    import contextlib
    import io

    import torch

    try:
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
            torch.onnx.export(model.eval(), tuple(example_inputs), str(path), dynamo=True, verbose=False)
    except Exception as err:  # the exporter raises many error types
        raise CwmError(f"torch.onnx.export of {type(model).__name__} failed: {first_line(err)}") from None
