"""Timing: interleaved medians of contenders, thread settings and the matmul peak."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..deploy.runtime import _device, check_inputs, load_vm, read_sidecar
from ..errors import CwmError, first_line
from ..hardware import RUNTIME_THREADS_ENV

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def set_threads(n: int = 2) -> None:
    """Use ``n`` threads in PyTorch (intra-op) and in the TVM runtime thread pool."""
    import torch
    import tvm

    torch.set_num_threads(n)
    os.environ[RUNTIME_THREADS_ENV] = str(n)
    try:
        if tvm.runtime.num_threads() != n:
            tvm.get_global_func("runtime.config_threadpool")(1, n)  # 1: the default ("big cores") mode
    except Exception as err:  # an older runtime without the hook: the env var applies on first use
        log.debug("cannot reconfigure the TVM thread pool: %s", err)


def tvm_runner(lib_path, inputs, device="cpu") -> Callable[[], object]:
    """A zero-argument callable that runs the library's ``main`` once on prepared inputs."""
    import tvm

    vm = load_vm(lib_path, device)
    dev = _device(device)
    meta = read_sidecar(lib_path)
    if meta is not None:
        check_inputs(meta.get("signature", {}), [np.asarray(x) for x in inputs])
    args = [tvm.runtime.tensor(np.ascontiguousarray(np.asarray(x)), device=dev) for x in inputs]
    f = vm["main"]
    on_cpu = str(dev).startswith("cpu")

    def run():
        out = f(*args)
        if not on_cpu:  # wait for the device
            dev.sync()
        return out

    return run


def torch_runner(model, example_inputs, compile: bool = False) -> Callable[[], object]:
    """A zero-argument callable that runs the model once (no grad); ``compile`` uses
    ``torch.compile`` (inductor), which compiles lazily on the first call."""
    import torch

    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    model = model.eval()
    fn = torch.compile(model) if compile else model

    def run():
        with torch.no_grad():
            return fn(*example_inputs)

    return run


def ort_runner(session, inputs) -> Callable[[], object]:
    """A zero-argument callable that runs an ONNX Runtime session once on prepared inputs."""
    feed = {i.name: np.ascontiguousarray(np.asarray(x)) for i, x in zip(session.get_inputs(), inputs)}

    def run():
        return session.run(None, feed)

    return run


@dataclass
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    runs: int
    samples: list = field(default_factory=list, repr=False)

    def as_json(self) -> dict:
        return {"median_ms": self.median_s * 1e3, "p10_ms": self.p10_s * 1e3, "p90_ms": self.p90_s * 1e3,
                "runs": self.runs}


TIMING_BLOCK = 5
SETTLE_S = 0.05


def time_interleaved(contenders: dict[str, Callable[[], object]], *, runs: int = 30, warmup: int = 3,
                     threads: int | None = 2, max_seconds: float | None = None,
                     min_runs: int = 5, block: int = TIMING_BLOCK,
                     settle_s: float = SETTLE_S) -> tuple[dict[str, Timing], dict[str, str]]:
    """Time several callables in rotating blocks: each round gives every contender (the order
    rotates each round) a pause of ``settle_s``, one untimed call, then ``block`` timed calls
    back to back. Load changes on a shared machine still hit all contenders alike.

    Blocks, not single calls: after a call, a runtime's worker threads spin on for a while, and a
    call of another runtime (TVM's thread pool against PyTorch's OpenMP) that starts then shares
    the cores with them. On a 2-core Zen 3, resnet50 in PyTorch eager took 67 ms alone and a
    median of 128 ms when each call came right after a TVM call.

    A contender whose warm-up raises is dropped and its error recorded. Returns
    ``({name: Timing}, {name: error})``; each Timing is the median of ``runs`` calls, except with
    ``max_seconds``, for contenders that take seconds a call (an untuned network): one stops once
    its timed calls add up to more than ``max_seconds`` and it has ``min_runs`` of them; one whose
    first warm-up call alone takes over a tenth of ``max_seconds`` skips the other warm-ups (and
    the untimed call of each block), and that call counts as a timed one. Each Timing says how
    many calls it has. A single contender (``time_module``, ``time_torch``) has nothing to settle
    and is timed without the pauses and untimed calls.
    """
    if block < 1:
        raise CwmError(f"block must be a positive integer, got {block!r}")
    if threads:
        set_threads(threads)
    errors: dict[str, str] = {}
    live = {}
    slow: set[str] = set()
    samples: dict[str, list[float]] = {}
    for name, fn in contenders.items():
        try:
            samples[name] = []
            for _ in range(max(1, warmup)):
                t0 = time.perf_counter()
                fn()
                took = time.perf_counter() - t0
                if max_seconds is not None and took > max_seconds / 10:
                    samples[name].append(took)
                    slow.add(name)
                    break
            live[name] = fn
        except Exception as err:  # e.g. torch.compile without a working toolchain
            errors[name] = f"{type(err).__name__}: {first_line(err)}"[:500]
            log.warning("%s failed in warm-up and is not timed: %s", name, errors[name])
    samples = {name: samples[name] for name in live}
    names = list(live)

    def finished(name: str) -> bool:
        done = samples[name]
        return len(done) >= runs or (max_seconds is not None and len(done) >= min_runs and sum(done) > max_seconds)

    alone = len(names) == 1  # no other runtime to settle: no pause and no untimed call
    r = 0
    while names and not all(finished(n) for n in names):
        order = names[r % len(names):] + names[:r % len(names)]
        r += 1
        for name in order:
            if finished(name):
                continue
            if not alone:
                time.sleep(settle_s)
            if name not in slow and not alone:
                live[name]()  # untimed: the other runtime's threads settle during it
            for _ in range(block):
                if finished(name):
                    break
                t0 = time.perf_counter()
                live[name]()
                samples[name].append(time.perf_counter() - t0)
    timings = {}
    for name, s in samples.items():
        a = np.asarray(s)
        timings[name] = Timing(float(np.median(a)), float(np.percentile(a, 10)), float(np.percentile(a, 90)),
                               len(s), list(s))
    return timings, errors


def time_module(lib_path, inputs, *, runs: int = 30, warmup: int = 3, threads: int = 2, device="cpu") -> Timing:
    """Median latency of one exported library (``runs`` >= 30 for a report)."""
    timings, errors = time_interleaved({"tvm": tvm_runner(lib_path, inputs, device)}, runs=runs,
                                       warmup=warmup, threads=threads)
    if errors:
        raise CwmError(f"running {lib_path} failed: {errors['tvm']}")
    return timings["tvm"]


def time_torch(model, example_inputs, *, compile: bool = False, runs: int = 30, warmup: int = 3,
               threads: int = 2) -> Timing:
    """Median latency of a PyTorch model, eager or ``torch.compile`` (inductor)."""
    timings, errors = time_interleaved({"torch": torch_runner(model, example_inputs, compile)}, runs=runs,
                                       warmup=warmup, threads=threads)
    if errors:
        raise CwmError(f"PyTorch ({'compiled' if compile else 'eager'}) failed: {errors['torch']}")
    return timings["torch"]


def peak_matmul_stats(n: int = 1024, runs: int = 30, threads: int = 2) -> dict:
    """GFLOP/s of an n x n x n fp32 torch matmul: ``{"median": ..., "best": ...}`` over ``runs`` calls
    after warm-up (the best call is less sensitive to other load on a shared machine)."""
    import torch

    set_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen)
    b = torch.randn(n, n, generator=gen)
    c = torch.empty(n, n)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=c)
        times.append(time.perf_counter() - t0)
    flop = 2.0 * n ** 3
    return {"median": flop / float(np.median(times)) / 1e9, "best": flop / float(np.min(times)) / 1e9}


def peak_matmul_gflops(n: int = 1024, runs: int = 30, threads: int = 2) -> float:
    """Measured fp32 peak for roofline fractions: GFLOP/s of an n x n x n torch matmul, median of
    ``runs`` calls after warm-up."""
    return peak_matmul_stats(n, runs, threads)["median"]
