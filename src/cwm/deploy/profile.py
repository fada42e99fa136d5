"""Where a built network's time goes when it runs: each kernel's time inside the network call.

The tuning database says how fast each kernel was alone (hot caches, its own inputs, repeated back
to back); this measures the kernels in the network's own order and the time outside them (the VM's
allocations and builtins, thread-pool hand-offs), timed through the Relax VM's instrument hook.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CwmError, check_positive_int, first_line
from .runtime import LoadedNetwork

BUILTIN_PREFIX = "vm.builtin."  # the VM's own functions (allocation, tuples, shape checks)


@dataclass
class KernelTime:
    name: str
    calls: int  # per network call
    ms: float  # per network call, all calls together

    def as_json(self) -> dict:
        return {"name": self.name, "calls": self.calls, "ms": self.ms}


@dataclass
class NetworkProfile:
    """``call_ms``: median of plain (uninstrumented) calls; ``kernels``: the compiled functions'
    time a call, slowest first; ``builtin_ms``: the VM builtins' time a call. Each instrumented
    call adds a Python hook of a few microseconds, so ``kernel_ms`` slightly overstates."""

    lib: str
    call_ms: float
    runs: int
    kernels: list[KernelTime] = field(default_factory=list)
    builtin_ms: float = 0.0

    @property
    def kernel_ms(self) -> float:
        return sum(k.ms for k in self.kernels)

    @property
    def outside_ms(self) -> float:
        """Call time not spent in a compiled kernel (may be negative by the hooks' overhead)."""
        return self.call_ms - self.kernel_ms

    def as_json(self) -> dict:
        return {"lib": self.lib, "call_ms": self.call_ms, "runs": self.runs, "kernel_ms": self.kernel_ms,
                "builtin_ms": self.builtin_ms, "outside_ms": self.outside_ms,
                "kernels": [k.as_json() for k in self.kernels]}

    def markdown(self, top: int = 15) -> str:
        lines = [f"Network call {self.call_ms:.3f} ms (median of {self.runs}): kernels {self.kernel_ms:.3f} ms, "
                 f"outside them {self.outside_ms:.3f} ms (VM builtins {self.builtin_ms:.3f} ms).", "",
                 "| kernel | calls | ms a call | share of the call |", "|---|---|---|---|"]
        for k in self.kernels[:top]:
            lines.append(f"| {k.name} | {k.calls} | {k.ms / k.calls:.4f} | {k.ms / self.call_ms:.1%} |")
        if len(self.kernels) > top:
            rest = self.kernels[top:]
            lines.append(f"| {len(rest)} others | {sum(k.calls for k in rest)} | | "
                         f"{sum(k.ms for k in rest) / self.call_ms:.1%} |")
        return "\n".join(lines) + "\n"


def profile_network(lib_path, inputs: list[np.ndarray], *, runs: int = 20, warmup: int = 5,
                    device: str = "cpu") -> NetworkProfile:
    """Profile ``main`` of a library built by ``cwm build``: ``runs`` plain calls for the call time,
    then ``runs`` instrumented calls for each kernel's share."""
    import tvm

    check_positive_int(runs, "runs")
    net = LoadedNetwork(lib_path, device)
    net.run(inputs)  # checks the inputs once, with a clear error
    args = [tvm.runtime.tensor(np.ascontiguousarray(np.asarray(x)), device=net.device) for x in inputs]
    for _ in range(warmup):
        net.main(*args)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        net.main(*args)
        samples.append(time.perf_counter() - start)

    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    started: dict[str, float] = {}

    def hook(func, symbol, before_run, ret_value, *call_args):
        now = time.perf_counter()
        if before_run:
            started[symbol] = now
        else:
            totals[symbol] += now - started.pop(symbol, now)
            counts[symbol] += 1
        return 0  # VMInstrumentReturnKind.NO_OP

    net.vm.set_instrument(hook)  # this VM is ours alone: the hook stays on it
    try:
        for _ in range(runs):
            net.main(*args)
    except Exception as err:
        raise CwmError(f"profiling {lib_path} failed: {first_line(err)}") from err
    kernels = sorted((KernelTime(name, counts[name] // runs, totals[name] / runs * 1e3)
                      for name in totals if not name.startswith(BUILTIN_PREFIX)), key=lambda k: -k.ms)
    builtin_ms = sum(v for k, v in totals.items() if k.startswith(BUILTIN_PREFIX)) / runs * 1e3
    return NetworkProfile(lib=str(Path(lib_path)), call_ms=float(np.median(samples)) * 1e3, runs=runs,
                          kernels=kernels, builtin_ms=builtin_ms)
