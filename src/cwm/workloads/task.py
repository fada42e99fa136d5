"""A tuning task: one TensorIR subgraph with a stable id, a name, a weight and its FLOPs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

# Operator kinds, in the order the heuristic below tests them on a task name.
_KIND_PATTERNS = (
    ("depthwise_conv2d", r"depthwise|group_conv"),
    ("conv2d_transpose", r"conv2d_transpose"),
    ("conv1d", r"conv1d"),
    ("conv3d", r"conv3d"),
    ("conv2d", r"conv2d"),
    ("batch_matmul", r"batch_matmul"),
    ("dense", r"dense|matmul\d*_add"),
    ("matmul", r"matmul"),
    ("softmax", r"softmax"),
    ("layernorm", r"layer_?norm"),
    ("pool", r"pool"),
    ("reduction", r"mean|sum|max\b"),
)


def task_id_of(mod) -> str:
    """Stable id: the structural hash of the module, as 16 hex digits."""
    from tvm_ffi import structural_hash

    return f"{structural_hash(mod) & 0xFFFFFFFFFFFFFFFF:016x}"


def kind_of(name: str) -> str:
    for kind, pattern in _KIND_PATTERNS:
        if re.search(pattern, name):
            return kind
    return "elementwise"


@dataclass
class Task:
    name: str
    mod: object  # tvm.IRModule with a single PrimFunc "main"
    weight: float = 1.0
    network: str | None = None
    kind: str = ""
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.kind:
            self.kind = kind_of(self.name)

    @cached_property
    def id(self) -> str:
        return task_id_of(self.mod)

    @cached_property
    def flops(self) -> float:
        from tvm.s_tir.analysis import estimate_tir_flops

        return float(estimate_tir_flops(self.mod))

    @cached_property
    def nbytes(self) -> int:
        """Bytes of the PrimFunc's buffers (its inputs and outputs)."""
        import math

        import tvm

        total = 0
        for p in self.mod["main"].params:
            shape = getattr(p, "shape", None)
            if shape is not None:
                dtype = tvm.DataType(str(p.dtype))
                total += math.prod(int(d) for d in shape) * ((dtype.bits * dtype.lanes + 7) // 8)
        return total

    def script(self) -> str:
        return self.mod.script()

    def summary(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "kind": self.kind,
            "network": self.network,
            "weight": self.weight,
            "flops": self.flops,
        }
