import json
import os

import pytest

from cwm.errors import CwmError
from cwm.hardware import HARDWARE_FEATURE_NAMES, cuda_target_json, host_cpu, make_target


def test_host_target_uses_the_cpu_name_and_physical_cores():
    hw = host_cpu()
    target = make_target()
    d = json.loads(str(target))
    assert d["kind"] == "llvm"
    assert d["mcpu"] == hw.mcpu and hw.mcpu not in ("", "generic")
    assert d["num-cores"] == hw.cores >= 1


def test_hardware_features():
    hw = host_cpu()
    feats = hw.features()
    assert len(feats) == len(HARDWARE_FEATURE_NAMES)
    assert hw.simd_bits in (128, 256, 512)
    assert hw.l2_kb > 0 and hw.l1d_kb > 0
    assert hw.model


def test_avx512_code_when_the_cpu_has_it():
    import tvm
    from tvm import te

    hw = host_cpu()
    if "avx512f" not in hw.flags:
        pytest.skip("this CPU has no AVX-512")
    n = 1024
    A = te.placeholder((n,), name="A")
    B = te.compute((n,), lambda i: A[i] * 2.0, name="B")
    sch = tvm.s_tir.Schedule(te.create_prim_func([A, B]))
    (i,) = sch.get_loops(sch.get_sblock("B"))
    _, inner = sch.split(i, [None, 16])
    sch.vectorize(inner)
    lib = tvm.compile(sch.mod, target=make_target())
    assert "zmm" in lib.mod.inspect_source("asm")


def test_cuda_target_description():
    target = make_target(json.dumps(cuda_target_json()))
    assert target.kind.name == "cuda"
    assert make_target("cuda").kind.name == "cuda"


@pytest.mark.parametrize("spec", ['{"kind": "nosuchkind"}', "{not json", '{"mcpu": "x"}', '{"kind": "llvm", "bogus": 1}'])
def test_bad_target(spec):
    with pytest.raises(CwmError):
        make_target(spec)


def test_machine_difference_names_what_differs():
    from cwm.hardware import machine_difference

    zen5 = {"kind": "cpu", "mcpu": "znver5", "simd_bits": 512, "l2_kb": 1024}
    assert machine_difference(zen5, dict(zen5, l2_kb=512)) is None  # cache sizes alone do not count
    assert machine_difference(zen5, dict(zen5, mcpu="znver3", simd_bits=256)) == \
        "mcpu znver5 -> znver3, simd_bits 512 -> 256"
    assert machine_difference(zen5, {"kind": "cuda", "mcpu": ""}) == "kind cpu -> cuda"
    assert machine_difference(None, zen5) is None and machine_difference(zen5, {}) is None


def test_machine_difference_of_a_model_trained_on_several_machines():
    from cwm.hardware import machine_difference

    # the shipped model: trained on a Xeon, on records of four machines
    xeon = {"kind": "cpu", "mcpu": "rocketlake", "simd_bits": 512}
    machines = ["rocketlake", "znver3", "znver4", "znver5"]
    zen5 = {"kind": "cpu", "mcpu": "znver5", "simd_bits": 512, "l2_kb": 1024}
    assert machine_difference(xeon, zen5) == "mcpu rocketlake -> znver5"  # the training host alone
    assert machine_difference(xeon, zen5, machines) is None  # a Zen 5 host is one of its machines
    assert machine_difference(xeon, dict(zen5, mcpu="znver3", simd_bits=256), machines) is None
    assert machine_difference(xeon, {"kind": "cpu", "mcpu": "haswell", "simd_bits": 256}, machines) == \
        "mcpu rocketlake/znver3/znver4/znver5 -> haswell"
    assert machine_difference(xeon, {"kind": "cuda", "mcpu": "sm_90", "simd_bits": 1024}, machines) == \
        "kind cpu -> cuda, mcpu rocketlake/znver3/znver4/znver5 -> sm_90, simd_bits 256/512 -> 1024"
    # a single named machine behaves like the model's own hardware; "unknown" records took it
    assert machine_difference(zen5, dict(zen5, mcpu="znver3", simd_bits=256), ["znver5"]) == \
        "mcpu znver5 -> znver3, simd_bits 512 -> 256"
    assert machine_difference(zen5, zen5, ["unknown"]) is None
    assert machine_difference(xeon, None, machines) is None


def test_the_tvm_runtime_gets_one_thread_per_physical_core():
    """TVM's own default is half the logical CPUs on x86: one thread on a 2-vCPU machine without SMT."""
    import subprocess
    import sys

    from cwm.hardware import RUNTIME_THREADS_ENV, physical_cores

    env = {k: v for k, v in os.environ.items() if k != RUNTIME_THREADS_ENV}
    code = "import cwm, tvm; print(tvm.runtime.num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[-1]) == physical_cores()


def test_a_thread_count_the_user_set_is_kept(monkeypatch):
    from cwm.hardware import RUNTIME_THREADS_ENV, physical_cores, use_physical_cores

    monkeypatch.setenv(RUNTIME_THREADS_ENV, "3")
    assert use_physical_cores() == 3
    monkeypatch.delenv(RUNTIME_THREADS_ENV)
    assert use_physical_cores() == physical_cores()
    assert os.environ[RUNTIME_THREADS_ENV] == str(physical_cores())
