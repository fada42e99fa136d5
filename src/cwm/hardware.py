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


RUNTIME_THREADS_ENV = "TVM_NUM_THREADS"


def use_physical_cores() -> int:
    """Give the TVM runtime one thread per physical core, in this process and the workers it starts.

    Without ``TVM_NUM_THREADS``, TVM takes half the logical CPUs on x86 (it assumes two hyper-threads
    a core). On a 2-vCPU machine without SMT that is one thread, and the main thread gets pinned to
    CPU 0: tuning measured every kernel on one core and the built network ran 1.9x slower than on
    two. TVM reads the variable once, when its thread pool starts, so this runs on ``import cwm``.
    A value the user set is kept. Returns the thread count in effect.
    """
    value = os.environ.get(RUNTIME_THREADS_ENV, "")
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    cores = physical_cores()
    os.environ[RUNTIME_THREADS_ENV] = str(cores)
    return cores


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


_COMPARED = ("kind", "mcpu", "simd_bits")


def _known(value) -> bool:
    return value not in (None, "")


def _differences(trained: dict, here: dict) -> list[str]:
    return [f"{key} {trained.get(key)} -> {here.get(key)}" for key in _COMPARED
            if _known(trained.get(key)) and _known(here.get(key)) and trained.get(key) != here.get(key)]


def _named_machine(name: str, trained: dict | None) -> dict:
    """What is known of a machine by the name records give it (``cwm.data.dataset.machine_of``: an LLVM
    CPU, a target kind, or ``unknown``): ``trained`` where it names that machine (or the name is
    unknown: such records took the database's hardware), else its ``KNOWN_CPU_HARDWARE`` row."""
    trained = trained or {}
    if name == UNKNOWN_MACHINE or (trained.get("mcpu") == name and trained.get("kind", "cpu") == "cpu"):
        return trained
    if name == "cuda":
        return {"kind": "cuda"}
    row = KNOWN_CPU_HARDWARE.get(name, {})
    return {"kind": "cpu", "mcpu": name, "simd_bits": row.get("simd_bits")}


def machine_difference(trained: dict | None, here: dict | None, machines: list[str] | None = None) -> str | None:
    """How the machines a model was trained on differ from this one (kind, LLVM CPU, SIMD width), as
    text; None when one of them agrees with it or nothing is known to compare.

    ``trained`` is the model's ``config.hardware`` (the machine ``cwm train`` ran on, which describes
    the records of a single-machine database); ``machines`` are the names of the machines its records
    came from (``config.trained_on["machines"]``), each described by ``KNOWN_CPU_HARDWARE`` where it is
    not ``trained``'s. A model trained on several machines matches a host like any one of them."""
    if not here:
        return None
    candidates = [_named_machine(str(m), trained) for m in machines] if machines else [trained or {}]
    diffs = [_differences(c, here) for c in candidates]
    if any(not d for d in diffs):
        return None
    if len(candidates) == 1:
        return ", ".join(diffs[0])
    out = []
    for key in _COMPARED:
        values = sorted({str(c.get(key)) for c in candidates if _known(c.get(key))})
        if values and _known(here.get(key)) and str(here.get(key)) not in values:
            out.append(f"{key} {'/'.join(values)} -> {here.get(key)}")
    return ", ".join(out) or f"none of {', '.join(str(m) for m in machines)}"


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


UNKNOWN_MACHINE = "unknown"

# Hardware features (cwm.hardware.HARDWARE_FEATURE_NAMES) of CPUs named by their LLVM ``mcpu``, for
# records measured on a machine other than the one the database's manifest.json describes. Cache
# sizes follow cwm.hardware._cache_kb, i.e. what Linux sysfs reports as the size of ONE cache
# instance: L1d and L2 per core; L3 per CCD/CCX on AMD (the L3 a core shares), the whole socket's
# LLC on Intel. Values are from the vendors' public specifications; where the L3 depends on the
# SKU, the named top SKU of the generation is used. ``simd_bits`` is the widest vector ISA
# (AVX2 256, AVX-512 512; Zen 4 executes AVX-512 on 256-bit units but has the 512-bit ISA, and
# cwm.hardware.host_cpu reports 512 for any CPU with avx512f). ``cores`` is not in the table: it
# comes from the record target's ``num-cores``.
KNOWN_CPU_HARDWARE: dict[str, dict] = {
    # AMD EPYC
    "znver2": {"model": "AMD Zen 2 (EPYC 7002 Rome)", "simd_bits": 256,
               "l1d_kb": 32, "l2_kb": 512, "l3_kb": 16 * 1024},  # 16 MB per 4-core CCX
    "znver3": {"model": "AMD Zen 3 (EPYC 7003 Milan)", "simd_bits": 256,
               "l1d_kb": 32, "l2_kb": 512, "l3_kb": 32 * 1024},  # 32 MB per 8-core CCD
    "znver4": {"model": "AMD Zen 4 (EPYC 9004 Genoa)", "simd_bits": 512,
               "l1d_kb": 32, "l2_kb": 1024, "l3_kb": 32 * 1024},  # 32 MB per 8-core CCD
    "znver5": {"model": "AMD Zen 5 (EPYC 9005 Turin)", "simd_bits": 512,
               "l1d_kb": 48, "l2_kb": 1024, "l3_kb": 32 * 1024},  # 32 MB per 8-core CCD
    # Intel Xeon
    "rocketlake": {"model": "Intel Xeon E-2300 (Rocket Lake)", "simd_bits": 512,
                   "l1d_kb": 48, "l2_kb": 512, "l3_kb": 16 * 1024},  # LLVM's name for the Xeon VM of earlier runs
    # Intel Xeon Scalable
    "skylake-avx512": {"model": "Intel Xeon Skylake-SP (Platinum 8180)", "simd_bits": 512,
                       "l1d_kb": 32, "l2_kb": 1024, "l3_kb": 39424},  # 38.5 MB
    "cascadelake": {"model": "Intel Xeon Cascade Lake-SP (Platinum 8280)", "simd_bits": 512,
                    "l1d_kb": 32, "l2_kb": 1024, "l3_kb": 39424},  # 38.5 MB
    "icelake-server": {"model": "Intel Xeon Ice Lake-SP (Platinum 8380)", "simd_bits": 512,
                       "l1d_kb": 48, "l2_kb": 1280, "l3_kb": 60 * 1024},  # 60 MB
    "sapphirerapids": {"model": "Intel Xeon Sapphire Rapids (Platinum 8480+)", "simd_bits": 512,
                       "l1d_kb": 48, "l2_kb": 2048, "l3_kb": 105 * 1024},  # 105 MB
    "emeraldrapids": {"model": "Intel Xeon Emerald Rapids (Platinum 8592+)", "simd_bits": 512,
                      "l1d_kb": 48, "l2_kb": 2048, "l3_kb": 320 * 1024},  # 320 MB
    "graniterapids": {"model": "Intel Xeon 6 Granite Rapids (6980P)", "simd_bits": 512,
                      "l1d_kb": 48, "l2_kb": 2048, "l3_kb": 504 * 1024},  # 504 MB
}

