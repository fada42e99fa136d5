"""Host detection: the TVM target for this machine and its hardware feature vector."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from .errors import CwmError

# Order of the numeric hardware features fed to the ranker.
HARDWARE_FEATURE_NAMES = (
    "cores",
    "simd_bits",
    "l1d_kb",
    "l2_kb",
    "l3_kb",
    "is_gpu",
    "sm_count",
    "shared_mem_kb",
)


@dataclass(frozen=True)
class HardwareInfo:
    kind: str  # "cpu" or "cuda"
    model: str
    cores: int
    simd_bits: int
    l1d_kb: int
    l2_kb: int
    l3_kb: int
    mcpu: str = ""
    flags: tuple[str, ...] = field(default=(), repr=False)
    sm_count: int = 0
    shared_mem_kb: int = 0

    def features(self) -> list[float]:
        d = asdict(self)
        d["is_gpu"] = 1 if self.kind == "cuda" else 0
        return [float(d[name]) for name in HARDWARE_FEATURE_NAMES]

    def as_json(self) -> dict:
        d = asdict(self)
        d.pop("flags")
        return d


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> tuple[str, ...]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return tuple(line.split(":", 1)[1].split())
    except OSError:
        pass
    return ()


def _cache_kb(level: str) -> int:
    """Size of one cache instance in KiB from sysfs (cpu0)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    want_level, want_type = {"l1d": ("1", "Data"), "l2": ("2", "Unified"), "l3": ("3", "Unified")}[level]
    if not base.exists():
        return 0
    for index in base.glob("index*"):
        try:
            if (index / "level").read_text().strip() != want_level:
                continue
            if (index / "type").read_text().strip() != want_type:
                continue
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if size.endswith("K"):
            return int(size[:-1])
        if size.endswith("M"):
            return int(size[:-1]) * 1024
        return int(size) // 1024
    return 0


def physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@lru_cache(maxsize=1)
def host_cpu() -> HardwareInfo:
    from tvm.target import codegen

    flags = _cpu_flags()
    simd = 512 if "avx512f" in flags else 256 if "avx2" in flags else 128
    return HardwareInfo(
        kind="cpu",
        model=_cpu_model(),
        cores=physical_cores(),
        simd_bits=simd,
        l1d_kb=_cache_kb("l1d"),
        l2_kb=_cache_kb("l2"),
        l3_kb=_cache_kb("l3"),
        mcpu=str(codegen.llvm_get_system_cpu()),
        flags=flags,
    )


def cpu_target_json(hw: HardwareInfo | None = None) -> dict:
    hw = hw or host_cpu()
    return {"kind": "llvm", "mcpu": hw.mcpu, "num-cores": hw.cores}


def cuda_target_json(arch: str = "sm_90", max_threads_per_block: int = 1024,
                     max_shared_memory_per_block: int = 49152) -> dict:
    return {
        "kind": "cuda",
        "arch": arch,
        "max_threads_per_block": max_threads_per_block,
        "max_shared_memory_per_block": max_shared_memory_per_block,
        "thread_warp_size": 32,
        "host": {"kind": "llvm"},
    }


def cuda_hardware() -> HardwareInfo | None:
    """The first visible CUDA device, or None where there is none."""
    import tvm

    dev = tvm.cuda(0)
    if not dev.exist:
        return None
    return HardwareInfo(
        kind="cuda",
        model=str(dev.device_name),
        cores=int(dev.multi_processor_count),
        simd_bits=32 * 32,  # warp of 32 lanes x 32-bit
        l1d_kb=0,
        l2_kb=int(getattr(dev, "l2_cache_size_bytes", 0) or 0) // 1024,
        l3_kb=0,
        mcpu="sm_" + str(dev.compute_version).replace(".", ""),
        sm_count=int(dev.multi_processor_count),
        shared_mem_kb=int(dev.max_shared_memory_per_block) // 1024,
    )


def make_target(spec: str | dict | None = None):
    """A tvm Target from None (this host), "cpu", "cuda", a JSON string or a dict."""
    from tvm.target import Target

    if spec is None or spec in ("cpu", "llvm", "host"):
        spec = cpu_target_json()
    elif spec == "cuda":
        hw = cuda_hardware()
        spec = cuda_target_json(arch=hw.mcpu) if hw else cuda_target_json()
    elif isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as err:
            raise CwmError(f"target must be 'cpu', 'cuda' or a JSON object, got {spec!r}") from err
    if not isinstance(spec, dict) or "kind" not in spec:
        raise CwmError(f"target JSON needs a 'kind' field, got {spec!r}")
    try:
        return Target(spec)
    except Exception as err:  # TVM raises its own error types for unknown fields
        first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CwmError(f"invalid target {json.dumps(spec)}: {first}") from err


def machine_difference(trained: dict | None, here: dict | None) -> str | None:
    """How the machine a model was trained on differs from this one (kind, LLVM CPU, SIMD
    width), as text; None when they agree or either is unknown."""
    if not trained or not here:
        return None
    diffs = [f"{key} {trained.get(key)} -> {here.get(key)}" for key in ("kind", "mcpu", "simd_bits")
             if trained.get(key) not in (None, "") and here.get(key) not in (None, "")
             and trained.get(key) != here.get(key)]
    return ", ".join(diffs) or None


def hardware_for_target(target) -> HardwareInfo:
    if target.kind.name == "cuda":
        hw = cuda_hardware()
        if hw is not None:
            return hw
        return HardwareInfo(kind="cuda", model="unknown-cuda", cores=0, simd_bits=1024, l1d_kb=0,
                            l2_kb=0, l3_kb=0, mcpu=str(target.attrs.get("arch", "")),
                            shared_mem_kb=int(target.attrs.get("max_shared_memory_per_block", 0)) // 1024)
    return host_cpu()


def as_target(target):
    """A TVM Target from None (this host), a name, a JSON dict/string or a Target."""
    from tvm.target import Target

    if target is None:
        return make_target()
    if isinstance(target, Target):
        return target
    return make_target(target)
