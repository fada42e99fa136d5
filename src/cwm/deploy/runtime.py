"""Running a built network on the Relax VM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import CwmError, first_line

# --------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------


def _device(device):
    import tvm

    if isinstance(device, str):
        kind = device.split(":")[0]
        index = int(device.split(":")[1]) if ":" in device else 0
        dev = tvm.device(kind, index)
    else:
        dev = device
    if not dev.exist:
        raise CwmError(f"device {device} is not available here")
    return dev


def load_vm(lib_path, device="cpu"):
    """A Relax VM on an exported library (``tvm.runtime.load_module``)."""
    import tvm
    from tvm import relax

    lib_path = Path(lib_path)
    if not lib_path.exists():
        raise CwmError(f"library {lib_path} does not exist")
    try:
        lib = tvm.runtime.load_module(str(lib_path))
    except Exception as err:
        raise CwmError(f"cannot load {lib_path}: {first_line(err)}") from err
    return relax.VirtualMachine(lib, _device(device))


def _fmt_shapes(items) -> str:
    return ", ".join(f"{tuple(i['shape']) if i['shape'] is not None else '?'} {i['dtype']}" for i in items)


def check_inputs(signature: dict, inputs: Sequence[np.ndarray]) -> None:
    """CwmError unless ``inputs`` match the signature's count, shapes (static dims) and dtypes."""
    expected = signature.get("inputs", [])
    actual = [{"shape": list(np.shape(x)), "dtype": str(np.asarray(x).dtype)} for x in inputs]
    bad = len(expected) != len(actual)
    if not bad:
        for e, a in zip(expected, actual):
            if e["dtype"] is not None and e["dtype"] != a["dtype"]:
                bad = True
            elif e["shape"] is not None:
                if len(e["shape"]) != len(a["shape"]) or any(
                    isinstance(d, int) and d != s for d, s in zip(e["shape"], a["shape"])
                ):
                    bad = True
    if bad:
        raise CwmError(f"the network expects {len(expected)} input(s) [{_fmt_shapes(expected)}], "
                       f"got {len(actual)} [{_fmt_shapes(actual)}]")


def _to_numpy(value) -> list[np.ndarray]:
    if hasattr(value, "numpy"):  # a tvm Tensor
        return [value.numpy()]
    try:  # a tuple of outputs (tvm_ffi Array)
        items = list(value)
    except TypeError:
        return [np.asarray(value)]
    return [a for v in items for a in _to_numpy(v)]


def load_and_run(lib_path, inputs: list[np.ndarray], device="cpu") -> list[np.ndarray]:
    """Run ``main`` of an exported library on the Relax VM; the outputs as numpy arrays (flattened
    tuples). Inputs are checked against the signature stored beside the library before the call."""
    return LoadedNetwork(lib_path, device).run(inputs)


class LoadedNetwork:
    """An exported library on the Relax VM, loaded once: ``run`` checks inputs against the sidecar's
    signature (when there is one) and the VM's arity, and returns the outputs as numpy arrays."""

    def __init__(self, lib_path, device="cpu"):
        self.lib_path = Path(lib_path)
        meta = read_sidecar(lib_path)
        self.signature = meta.get("signature", {}) if meta is not None else None
        self.vm = load_vm(lib_path, device)
        self.device = _device(device)
        self.arity = int(self.vm._get_function_arity("main"))
        self.main = self.vm["main"]

    def run(self, inputs) -> list[np.ndarray]:
        import tvm

        inputs = [np.asarray(x) for x in inputs]
        if self.signature is not None:
            check_inputs(self.signature, inputs)
        if self.arity != len(inputs):
            raise CwmError(f"the network expects {self.arity} input(s), got {len(inputs)} "
                           f"[{_fmt_shapes([{'shape': list(x.shape), 'dtype': str(x.dtype)} for x in inputs])}]")
        args = [tvm.runtime.tensor(np.ascontiguousarray(x), device=self.device) for x in inputs]
        try:
            out = self.main(*args)
        except Exception as err:
            raise CwmError(f"running {self.lib_path} failed: {first_line(err)}") from err
        return _to_numpy(out)


def sidecar_path(lib_path) -> Path:
    lib_path = Path(lib_path)
    return lib_path.with_name(lib_path.name + ".json")


def read_sidecar(lib_path) -> dict | None:
    """The build record beside a library (``BuildResult.as_json``), None if there is none."""
    side = sidecar_path(lib_path)
    if not side.exists():
        return None
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError) as err:  # ValueError: bad JSON or not text
        raise CwmError(f"the sidecar {side} of {Path(lib_path).name} is corrupt: {err}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("signature", {}), dict):
        raise CwmError(f"the sidecar {side} of {Path(lib_path).name} is corrupt: no signature object")
    return meta
