"""Correctness of a built network against PyTorch."""

from __future__ import annotations

import numpy as np

from ..errors import CwmError

# Comparison tolerances against PyTorch, per model family: keyword arguments of
# ``check_against_torch``. The check is ``|tvm - torch| <= atol * scale + rtol * |torch|``
# elementwise, where ``scale`` is the largest |value| of that PyTorch output when
# ``relative_atol`` is set (1 otherwise): random-init networks produce outputs of very different
# magnitudes (ResNet-18 logits ~3, MobileNetV2's ~2e-9 because its activations shrink layer after
# layer), and a fixed atol of 1e-3 would pass any output of MobileNetV2, even all zeros.
# The differences come from fp32 sums evaluated in another order (tiling, vectorized and split
# reductions), batch norm applied as a precomputed scale and shift, and other exp/erf/tanh code;
# they grow with the reduction length and the depth. Measured max |diff| / max |output| with
# TVM's default lowering (tuned schedules only reorder the same sums): ResNet-18 1e-6,
# MobileNetV2 1.4e-6, BERT-base 1.8e-6, GPT-2 1.8e-6; the MLP and small CNN of the tests ~1e-7.
#  * "mlp": a few dense layers, reductions of at most a few hundred terms: 1e-4, 100x margin.
#  * "cnn": convolutions reducing over up to 3*3*512 = 4608 terms, 18-50 layers deep: 1e-3.
#  * "transformer": 12 layers of 768/3072-wide matmuls, softmax, layer norm, GELU: 1e-3.
# A wrong schedule (a dropped or doubled tile, a race) gives errors of the order of the output
# itself, 1000x above these.
TOLERANCES: dict[str, dict] = {
    "mlp": {"rtol": 1e-4, "atol": 1e-4, "relative_atol": True},
    "cnn": {"rtol": 1e-3, "atol": 1e-3, "relative_atol": True},
    "transformer": {"rtol": 1e-3, "atol": 1e-3, "relative_atol": True},
}


# --------------------------------------------------------------------------------------------
# Correctness against PyTorch
# --------------------------------------------------------------------------------------------


def model_family(model) -> str:
    """'cnn', 'transformer' or 'mlp' (for ``TOLERANCES``), from the modules a model contains."""
    import torch

    kinds = {type(m).__name__ for m in model.modules()}
    if any(isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) for m in model.modules()):
        return "cnn"
    if any("Attention" in k or k in ("LayerNorm", "Embedding", "Conv1D") for k in kinds):
        return "transformer"
    return "mlp"


def tolerance_for(model) -> dict:
    """Keyword arguments (rtol, atol, relative_atol) of ``check_against_torch`` for ``model``'s
    family; see ``TOLERANCES`` for the values and why."""
    family = getattr(model, "cwm_family", None)  # set where the modules do not show it (an exported program)
    return dict(TOLERANCES[family if family in TOLERANCES else model_family(model)])


def torch_outputs(torch_model, example_inputs) -> list[np.ndarray]:
    import torch

    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    with torch.no_grad():
        out = torch_model.eval()(*example_inputs)
    return _flatten_torch(out)


def _flatten_torch(out) -> list[np.ndarray]:
    import torch

    if isinstance(out, torch.Tensor):
        return [out.detach().cpu().numpy()]
    if isinstance(out, dict):
        return [a for v in out.values() for a in _flatten_torch(v)]
    if isinstance(out, (list, tuple)):
        return [a for v in out for a in _flatten_torch(v)]
    if hasattr(out, "to_tuple"):
        return _flatten_torch(out.to_tuple())
    return [np.asarray(out)]


def check_against_torch(torch_model, example_inputs, outputs, rtol: float = 1e-4, atol: float = 1e-4, *,
                        relative_atol: bool = False) -> dict:
    """Run ``torch_model`` on ``example_inputs`` and compare with ``outputs`` (np.allclose).

    Tolerance: ``|tvm - torch| <= atol * scale + rtol * |torch|`` elementwise, with ``scale = 1``
    (plain ``np.allclose``) or, with ``relative_atol``, the largest |value| of that PyTorch output.
    The defaults (1e-4, 1e-4, absolute) suit shallow dense models with outputs of magnitude ~1.
    Deep fp32 models need more, because reordered fp32 sums differ: use ``**tolerance_for(model)``
    (1e-3 relative to the output range for conv nets and transformers, 1e-4 for MLPs; the
    reasoning and measured differences are at ``TOLERANCES``). A mismatch raises ``CwmError`` with
    the max abs diff: it is an error, not a warning.
    Returns ``{"max_abs_diff", "max_rel_diff" (max abs diff / output range), "rtol", "atol", ...}``.
    """
    return check_outputs(torch_outputs(torch_model, example_inputs), outputs, rtol, atol,
                         relative_atol=relative_atol)


def check_outputs(expected, outputs, rtol: float = 1e-4, atol: float = 1e-4, *, relative_atol: bool = False,
                  reference: str = "PyTorch") -> dict:
    """Compare ``outputs`` with the ``expected`` arrays of a reference (PyTorch, ONNX Runtime), with the
    tolerance of ``check_against_torch``; a mismatch raises ``CwmError`` naming ``reference``."""
    expected = [np.asarray(e) for e in expected]
    outputs = [np.asarray(o) for o in outputs]
    if len(expected) != len(outputs):
        raise CwmError(f"{reference} gives {len(expected)} output(s), the TVM module {len(outputs)}")
    max_diff, max_rel = 0.0, 0.0
    for i, (e, o) in enumerate(zip(expected, outputs)):
        if e.shape != o.shape:
            raise CwmError(f"output {i}: {reference} shape {e.shape}, TVM shape {o.shape}")
        if not e.size:
            continue
        magnitude = float(np.max(np.abs(e)))
        diff = float(np.max(np.abs(o.astype(np.float64) - e.astype(np.float64))))
        if not np.isfinite(diff):
            diff = float("inf")
        max_diff = max(max_diff, diff)
        max_rel = max(max_rel, diff / magnitude if magnitude > 0 else (0.0 if diff == 0 else float("inf")))
        scale = magnitude if relative_atol else 1.0
        if not np.allclose(o, e, rtol=rtol, atol=atol * scale):
            raise CwmError(f"output {i} differs from {reference}: max abs diff {diff:.3g} on outputs up to "
                           f"{magnitude:.3g} (rtol {rtol:g}, atol {atol:g}"
                           f"{' x output range' if relative_atol else ''})")
    return {"max_abs_diff": max_diff, "max_rel_diff": max_rel, "rtol": rtol, "atol": atol,
            "relative_atol": relative_atol, "outputs": len(outputs)}
