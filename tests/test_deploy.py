"""Deployment: tuned database -> network library -> run -> compare with PyTorch; the e2e benchmark."""

import json
import logging
import shutil

import numpy as np
import pytest

from cwm.errors import CwmError

# MetaSchedule's TuneContext imports tvm.s_tir.tensor_intrin, whose TVMScript parser calls
# inspect.getmodule thousands of times; each call scans sys.modules, so with torch loaded the
# import takes minutes instead of ~20 s. Import it first.
import tvm.s_tir.tensor_intrin  # noqa: E402,F401  isort: skip

torch = pytest.importorskip("torch")


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).eval()
    return model, (torch.randn(1, 32),)


def _cnn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4),
    ).eval()
    with torch.no_grad():  # non-trivial running statistics, so a wrong fold would show
        bn = model[1]
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return model, (torch.randn(1, 3, 16, 16),)


@pytest.fixture(scope="module")
def target():
    from cwm.hardware import make_target

    return make_target()


def _tasks(mod, target, only_largest=False):
    """Tasks as a user would make them: MetaSchedule's extraction wrapped in cwm Tasks."""
    import tvm.s_tir.meta_schedule as ms

    from cwm.workloads.pipeline import fused_module
    from cwm.workloads import Task

    extracted = ms.relax_integration.extract_tasks(fused_module(mod, target), target)
    tasks = [Task(name=str(e.task_name), mod=e.dispatched[0], weight=float(e.weight)) for e in extracted]
    if only_largest:
        tasks = [max(tasks, key=lambda t: t.flops)]
    return tasks


@pytest.fixture(scope="module")
def mlp_build(tmp_path_factory, target):
    """The MLP tuned for 8 trials (4 per task) with xgb, built and exported."""
    from cwm.deploy.build import build_network
    from cwm.workloads.pipeline import relax_from_torch
    from cwm.tuning.tuner import tune

    model, inputs = _mlp()
    mod = relax_from_torch(model, inputs, target)
    root = tmp_path_factory.mktemp("mlp")
    db = root / "db"
    tune(_tasks(mod, target), trials=8, work_dir=db, cost_model="xgb", target=target, progress=False,
         num_trials_per_iter=4, report=False)
    result = build_network(mod, db, target, root / "mlp.so")
    return model, inputs, mod, db, result


def test_mlp_tuned_build_runs_and_matches_torch(mlp_build):
    from cwm.deploy.check import check_against_torch
    from cwm.deploy.runtime import load_and_run
    from cwm.deploy.build import sidecar_path

    model, inputs, mod, db, result = mlp_build
    assert result.lib_path.exists() and sidecar_path(result.lib_path).exists()
    assert result.total_tasks == 2
    assert result.tuned_tasks == 2 and result.missing == []  # both fused dense layers got their schedule
    # CPU builds prepack: both dense layers' weights were laid out for their schedules at build time
    assert result.weight_prepack and len(result.prepacked) == 2
    assert "TransformLayout" in (db / "database_tuning_record.json").read_text()
    out = load_and_run(result.lib_path, [x.numpy() for x in inputs])
    assert out[0].shape == (1, 10)
    report = check_against_torch(model, inputs, out)  # default 1e-4 / 1e-4
    assert report["max_abs_diff"] < 1e-4


def test_the_profile_times_each_kernel_inside_the_network_call(mlp_build):
    from cwm.deploy.profile import profile_network

    model, inputs, mod, db, result = mlp_build
    profile = profile_network(result.lib_path, [x.numpy() for x in inputs], runs=3, warmup=1)
    assert sorted(k.name for k in profile.kernels) == sorted(result.prepacked)  # the two dense layers, once each
    assert all(k.calls == 1 and k.ms > 0 for k in profile.kernels)
    assert profile.call_ms > 0 and profile.builtin_ms > 0
    assert profile.kernel_ms < 10 * profile.call_ms  # per call, not summed over the runs
    table = profile.markdown()
    assert all(k.name in table for k in profile.kernels) and "outside them" in table
    with pytest.raises(CwmError, match="expects|shape"):
        profile_network(result.lib_path, [np.zeros((2, 3), "float32")], runs=1)


def test_a_database_tuned_without_weight_prepack_builds_without_it(mlp_build, tmp_path, target):
    """Prepacking changes the tasks, so the build follows the database: one tuned before
    prepacking existed still applies, and forcing the other mode leaves every task missing."""
    from cwm.deploy.build import build_network
    from cwm.deploy.check import check_against_torch
    from cwm.workloads.pipeline import extract_tasks
    from cwm.deploy.runtime import load_and_run
    from cwm.tuning.tuner import tune

    model, inputs, mod, prepacked_db, _ = mlp_build
    forced = build_network(mod, prepacked_db, target, weight_prepack=False)
    assert forced.tuned_tasks == 0 and len(forced.missing) == 2

    tasks = extract_tasks(mod, target, weight_prepack=False)
    assert not any("layout_free_buffers" in (t.mod["main"].attrs or {}) for t in tasks)
    tune(tasks, trials=4, work_dir=tmp_path / "db", cost_model="xgb", target=target, progress=False,
         num_trials_per_iter=2, report=False)
    result = build_network(mod, tmp_path / "db", target, tmp_path / "plain.so")
    assert not result.weight_prepack and result.prepacked == []
    assert result.tuned_tasks == 2
    out = load_and_run(result.lib_path, [x.numpy() for x in inputs])
    assert check_against_torch(model, inputs, out)["max_abs_diff"] < 1e-4


def test_a_schedule_with_prepacked_weights_is_remeasured(mlp_build, target):
    """Re-measuring a best schedule passes the weight in its rewritten layout, as the build does."""
    from cwm.schedule.actions import trace_to_json
    from cwm.data.database import open_database
    from cwm.workloads.pipeline import extract_tasks
    from cwm.tuning.tuner import measure_median

    _, _, mod, db, _ = mlp_build
    task = max(extract_tasks(mod, target), key=lambda t: t.flops)
    database = open_database(db, create=False)
    best = database.query_tuning_record(task.mod, target, "main")
    assert "transform_layout" in str(best.trace)  # the best schedule rewrites a weight's layout
    assert 0 < measure_median(task, trace_to_json(best.trace), target, runs=3, min_ms=1.0) < 0.1  # a float budget too


def test_the_world_model_sees_schedules_without_their_derived_layout_rewrites(mlp_build, target):
    from cwm.schedule.actions import actions_from_trace_json, model_actions, replay, trace_to_json, without_layout_rewrites
    from cwm.data.database import open_database
    from cwm.workloads.pipeline import extract_tasks

    _, _, mod, db, _ = mlp_build
    task = max(extract_tasks(mod, target), key=lambda t: t.flops)
    trace = trace_to_json(open_database(db, create=False).query_tuning_record(task.mod, target, "main").trace)
    full, seen = actions_from_trace_json(trace), model_actions(trace)
    dropped = [a["kind"] for a in full if a not in seen]
    n = dropped.count("TransformLayout")
    assert n >= 1 and sorted(dropped) == sorted(["CacheRead", "Annotate", "TransformLayout"] * n)
    assert seen == [a for a in full if a in seen]  # the order of the rest is kept
    assert not any(a["kind"] == "TransformLayout" for a in seen)
    replay(task.mod, seen)  # the schedule the model scores still replays
    assert without_layout_rewrites(seen) == seen  # nothing else is dropped


def test_batch_norm_after_a_convolution_without_bias_is_folded_into_its_weights(tmp_path, target):
    """Inference batch norm after a bias-free convolution (torchvision's CNNs) becomes a scaled weight
    and a bias: the fused kernel keeps no subtract/divide/multiply epilogue, and the outputs match."""
    from cwm.deploy.build import build_network
    from cwm.deploy.check import check_against_torch
    from cwm.deploy.runtime import load_and_run
    from cwm.workloads.pipeline import fused_module, relax_from_torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU6(), torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
                                torch.nn.BatchNorm2d(8)).eval()
    with torch.no_grad():
        for bn in (model[1], model[4]):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(1, 4, 12, 12)
    mod = relax_from_torch(model, (x,), target)
    convs = [gv.name_hint for gv in fused_module(mod, target).functions if "conv2d" in gv.name_hint]
    assert len(convs) == 2 and not any(op in n for n in convs for op in ("subtract", "divide", "multiply")), convs
    result = build_network(mod, None, target, tmp_path / "folded.so")
    out = load_and_run(result.lib_path, [x.numpy()])
    assert check_against_torch(model, (x,), out)["max_rel_diff"] < 1e-5


def test_cnn_tuned_build_folds_batch_norm_and_matches_torch(tmp_path, target):
    from cwm.deploy.build import build_network
    from cwm.deploy.check import check_against_torch, tolerance_for
    from cwm.workloads.pipeline import fused_module, relax_from_torch
    from cwm.deploy.runtime import load_and_run
    from cwm.tuning.tuner import tune

    model, inputs = _cnn()
    mod = relax_from_torch(model, inputs, target)
    ops = " ".join(mod.script().split())
    assert "batch_norm" not in ops  # decomposed for inference, statistics folded into constants
    # conv + batch norm + relu end up in one fused kernel: no separate batch-norm subgraph
    prim = [gv.name_hint for gv, f in fused_module(mod, target).functions.items() if gv.name_hint != "main"]
    conv = [n for n in prim if "conv2d" in n]
    assert len(conv) == 1 and conv[0].rstrip("0123456789").endswith("relu"), prim  # passes add suffixes
    assert not any("batch_norm" in n for n in prim)

    conv_task = _tasks(mod, target, only_largest=True)
    assert "conv2d" in conv_task[0].name
    tune(conv_task, trials=4, work_dir=tmp_path / "db", cost_model="xgb", target=target, progress=False,
         num_trials_per_iter=4, report=False)
    result = build_network(mod, tmp_path / "db", target, tmp_path / "cnn.so")
    assert result.tuned_tasks == 1 and result.tuned == [conv_task[0].name]
    assert result.total_tasks == len(prim) and len(result.missing) == result.total_tasks - 1
    assert "relax.nn.batch_norm" not in result.relax_ops
    assert result.conv_layout == "NHWC"  # the CPU default
    out = load_and_run(result.lib_path, [x.numpy() for x in inputs])
    tol = tolerance_for(model)
    assert tol == {"rtol": 1e-3, "atol": 1e-3, "relative_atol": True}
    assert check_against_torch(model, inputs, out, **tol)["max_rel_diff"] < 1e-5


def test_convolution_layout_follows_the_database_and_relu6_stays_fused(tmp_path, target):
    """NHWC is the CPU default; a database tuned in NCHW still builds in NCHW, forcing the other
    layout leaves its tasks missing, and ReLU6 (``clip``) does not cost transposes in NHWC."""
    from cwm.deploy.build import build_network
    from cwm.deploy.check import check_against_torch
    from cwm.workloads.pipeline import conv_layout_of, extract_tasks, relax_from_torch
    from cwm.deploy.runtime import load_and_run
    from cwm.errors import CwmError
    from cwm.tuning.tuner import tune

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU6(), torch.nn.Conv2d(8, 8, 3, padding=1, groups=8),
        torch.nn.ReLU6(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
    ).eval()
    inputs = (torch.randn(1, 3, 16, 16),)
    mod = relax_from_torch(model, inputs, target)

    nhwc = extract_tasks(mod, target)
    assert {conv_layout_of(t.mod) for t in nhwc} - {None} == {"NHWC"}
    assert len([t for t in nhwc if "transpose" in t.name]) <= 2, [t.name for t in nhwc]  # in and out only
    nchw = extract_tasks(mod, target, conv_layout="NCHW")
    assert {conv_layout_of(t.mod) for t in nchw} - {None} == {"NCHW"}
    with pytest.raises(CwmError, match="convolution layout"):
        extract_tasks(mod, target, conv_layout="NCWH")

    largest = max(nchw, key=lambda t: t.flops)
    tune([largest], trials=4, work_dir=tmp_path / "db", cost_model="xgb", target=target, progress=False,
         num_trials_per_iter=4, report=False)
    result = build_network(mod, tmp_path / "db", target, tmp_path / "nchw.so")
    assert result.conv_layout == "NCHW" and result.tuned_tasks == 1
    out = load_and_run(result.lib_path, [x.numpy() for x in inputs])
    assert check_against_torch(model, inputs, out)["max_rel_diff"] < 1e-5
    forced = build_network(mod, tmp_path / "db", target, conv_layout="NHWC")
    assert forced.conv_layout == "NHWC" and forced.tuned_tasks == 0
    untuned = build_network(mod, None, target, tmp_path / "nhwc.so")
    out = load_and_run(untuned.lib_path, [x.numpy() for x in inputs])
    assert check_against_torch(model, inputs, out)["max_rel_diff"] < 1e-5


def test_database_of_another_network_falls_back_visibly(mlp_build, tmp_path, target, caplog):
    from cwm.deploy.build import build_network
    from cwm.deploy.check import check_against_torch, tolerance_for
    from cwm.deploy.runtime import load_and_run
    from cwm.workloads.pipeline import relax_from_torch

    _, _, _, mlp_db, _ = mlp_build
    model, inputs = _cnn()
    mod = relax_from_torch(model, inputs, target)
    empty = tmp_path / "empty_db"
    empty.mkdir()
    for i, db in enumerate([empty, mlp_db]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cwm.deploy.build"):
            result = build_network(mod, db, target, tmp_path / f"cnn{i}.so")
        assert result.tuned_tasks == 0 and result.total_tasks > 0
        assert len(result.missing) == result.total_tasks
        assert any("conv2d" in n for n in result.missing)
        assert any(r.levelno == logging.WARNING for r in caplog.records)
        if db is mlp_db:  # the warning names the tasks that fall back
            assert any(result.missing[0] in r.getMessage() for r in caplog.records)
        out = load_and_run(result.lib_path, [x.numpy() for x in inputs])
        check_against_torch(model, inputs, out, **tolerance_for(model))
    assert not any(empty.iterdir())  # building does not write into the database directory


def test_records_for_another_target_are_reported(mlp_build, tmp_path, target, caplog):
    """Records for another kind of target are dropped (MetaSchedule's query would apply them anyway);
    records for another CPU are used, and named."""
    from cwm.data.database import RECORD_FILE
    from cwm.deploy.build import build_network
    from cwm.deploy.check import check_against_torch
    from cwm.deploy.runtime import load_and_run

    model, inputs, mod, db, _ = mlp_build
    foreign = tmp_path / "foreign"
    shutil.copytree(db, foreign)
    lines = []
    for line in (foreign / RECORD_FILE).read_text().splitlines():
        index, body = json.loads(line)
        body[2] = {**body[2], "mcpu": "skylake-avx512"} if index == 0 else {"kind": "c", "keys": ["cpu"]}
        lines.append(json.dumps([index, body]))
    (foreign / RECORD_FILE).write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="cwm.deploy.build"):
        result = build_network(mod, foreign, target, tmp_path / "foreign.so")
    assert result.total_tasks == 2 and result.tuned_tasks == 1 and len(result.missing) == 1
    assert result.other_target == result.tuned
    assert result.skipped_records == sum(1 for line in lines if json.loads(line)[0] != 0)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "another kind of target" in messages and result.missing[0] in messages
    check_against_torch(model, inputs, load_and_run(result.lib_path, [x.numpy() for x in inputs]))


class _BoolOps(torch.nn.Module):
    """A cumsum over a bool mask and a bool == bool compare, as in transformers' GPT-2 mask code."""

    def forward(self, x):
        count = (x > 0).cumsum(-1)
        same = (x > 0.5) == (x < 1.0)
        return x * same + count.to(x.dtype)


def test_bool_mask_ops_compile_and_match_torch(tmp_path, target):
    """TVM's LLVM codegen aborts on these (bool add, fcmp on i1); build_network rewrites them."""
    import tvm

    from cwm.deploy.build import build_network
    from cwm.deploy.check import check_against_torch
    from cwm.deploy.runtime import load_and_run
    from cwm.workloads.pipeline import relax_from_torch

    model, x = _BoolOps().eval(), torch.randn(2, 16)
    mod = relax_from_torch(model, (x,), target)
    with pytest.raises(Exception):
        tvm.compile(mod, target=target)  # the TVM bug this works around; remove the rewrite once it passes
    result = build_network(mod, None, target, tmp_path / "bool.so")
    out = load_and_run(result.lib_path, [x.numpy()])
    assert check_against_torch(model, (x,), out)["max_abs_diff"] == 0.0


class _Activations(torch.nn.Module):
    """Every op ``rewrite_fast_math`` touches, plus a power it must leave alone."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.linear(x) * 4  # spread the inputs over erf's and tanh's curved range
        gelu_new = 0.5 * y * (1 + torch.tanh(0.7978845608 * (y + 0.044715 * torch.pow(y, 3.0))))
        return (torch.nn.functional.gelu(y), torch.nn.functional.gelu(y, approximate="tanh"), torch.erf(y),
                gelu_new, torch.pow(y, 2.0), torch.pow(y.abs(), 2.5))


def test_fast_math_removes_libm_calls_and_matches_torch(tmp_path, target):
    """GELU, erf, tanh and x**2, x**3 become vectorizable code within a few ulp of PyTorch."""
    from cwm.deploy.build import build_network
    from cwm.deploy.check import check_against_torch
    from cwm.deploy.runtime import load_and_run
    from cwm.workloads.pipeline import relax_from_torch, relax_op_counts, rewrite_fast_math

    torch.manual_seed(0)
    model, x = _Activations().eval(), torch.randn(4, 16)
    mod = relax_from_torch(model, (x,), target)
    before = relax_op_counts(mod)
    assert before["relax.nn.gelu"] == before["relax.nn.gelu_tanh"] == before["relax.erf"] == 1
    assert before["relax.tanh"] == 1 and before["relax.power"] == 3
    after = relax_op_counts(rewrite_fast_math(mod))
    for op in ("relax.nn.gelu", "relax.nn.gelu_tanh", "relax.erf", "relax.tanh"):
        assert op not in after
    assert after["relax.power"] == 1  # x ** 2.5 stays a pow
    assert after["relax.call_tir"] == 4
    result = build_network(mod, None, target, tmp_path / "act.so")
    assert result.fast_math == {"relax.nn.gelu": 1, "relax.nn.gelu_tanh": 1, "relax.erf": 1, "relax.tanh": 1,
                                "relax.power": 2}
    out = load_and_run(result.lib_path, [x.numpy()])
    diffs = [np.abs(o - r.detach().numpy()).max() / max(1.0, np.abs(r.detach().numpy()).max())
             for o, r in zip(out, model(x))]
    assert max(diffs) < 1e-6, diffs
    check_against_torch(model, (x,), out, rtol=1e-6, atol=1e-6, relative_atol=True)


def test_fast_math_leaves_other_modules_alone(target):
    from cwm.workloads.pipeline import relax_from_torch, rewrite_fast_math

    model, (x,) = _mlp()
    mod = relax_from_torch(model, (x,), target)
    assert rewrite_fast_math(mod) is mod


def test_load_and_run_rejects_wrong_inputs(mlp_build):
    from cwm.deploy.runtime import load_and_run

    result = mlp_build[4]
    with pytest.raises(CwmError, match=r"expects 1 input.*\(1, 32\) float32.*got 1.*\(1, 33\) float32"):
        load_and_run(result.lib_path, [np.zeros((1, 33), "float32")])
    with pytest.raises(CwmError, match=r"\(1, 32\) float32.*float64"):
        load_and_run(result.lib_path, [np.zeros((1, 32), "float64")])
    with pytest.raises(CwmError, match=r"expects 1 input.*got 2"):
        load_and_run(result.lib_path, [np.zeros((1, 32), "float32")] * 2)


def test_load_and_run_without_sidecar_still_checks_count(mlp_build, tmp_path):
    from cwm.deploy.runtime import load_and_run

    lib = tmp_path / "bare.so"
    shutil.copy(mlp_build[4].lib_path, lib)
    with pytest.raises(CwmError, match=r"expects 1 input\(s\), got 2"):
        load_and_run(lib, [np.zeros((1, 32), "float32")] * 2)
    with pytest.raises(CwmError):
        load_and_run(lib, [np.zeros((1, 33), "float32")])  # the VM's own shape check, as a CwmError
    assert load_and_run(lib, [np.zeros((1, 32), "float32")])[0].shape == (1, 10)


def test_missing_database_and_library_are_clear_errors(mlp_build, tmp_path, target):
    from cwm.deploy.build import build_network
    from cwm.deploy.runtime import load_and_run

    mod = mlp_build[2]
    with pytest.raises(CwmError, match="does not exist"):
        build_network(mod, tmp_path / "no_such_db", target)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    with pytest.raises(CwmError, match="not a MetaSchedule database"):
        build_network(mod, tmp_path / "junk", target)
    with pytest.raises(CwmError, match="does not exist"):
        load_and_run(tmp_path / "missing.so", [np.zeros((1, 32), "float32")])


def test_check_against_torch_mismatch_is_an_error():
    from cwm.deploy.check import check_against_torch

    model, inputs = _mlp()
    with torch.no_grad():
        good = model(*inputs).numpy()
    assert check_against_torch(model, inputs, [good])["max_abs_diff"] == 0.0
    with pytest.raises(CwmError, match="max abs diff 0.01"):
        check_against_torch(model, inputs, [good + 0.01])
    # relative_atol: the absolute tolerance follows the output range, so tiny outputs are checked too
    # (random-init MobileNetV2 has logits ~1e-9: with a fixed atol, all zeros would pass).
    tiny = torch.nn.Sequential(model, _Scale(1e-6)).eval()
    zeros = [np.zeros_like(good)]
    check_against_torch(tiny, inputs, zeros, rtol=1e-3, atol=1e-3)  # vacuous
    with pytest.raises(CwmError, match="x output range"):
        check_against_torch(tiny, inputs, zeros, rtol=1e-3, atol=1e-3, relative_atol=True)


class _Scale(torch.nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def test_timing_helpers_interleave_and_report_medians():
    from cwm.benchmarks.timing import peak_matmul_gflops, time_interleaved

    calls = []
    timings, errors = time_interleaved(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "bad": lambda: 1 / 0},
        runs=4, warmup=1, block=2, settle_s=0)
    assert set(timings) == {"a", "b"} and "ZeroDivisionError" in errors["bad"]
    # Rotating blocks: an untimed call, then two timed ones, per contender and round.
    assert calls[2:] == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3
    assert timings["a"].runs == 4 and timings["a"].median_s >= 0
    assert peak_matmul_gflops(n=128, runs=5) > 0

    # A slow contender stops after min_runs once its calls pass max_seconds; a fast one runs on.
    import time

    timings, _ = time_interleaved({"slow": lambda: time.sleep(0.02), "fast": lambda: None},
                                  runs=12, warmup=1, max_seconds=0.05, min_runs=3, settle_s=0)
    assert timings["slow"].runs == 3 and timings["fast"].runs == 12
    # A call over a tenth of max_seconds ends the warm-up, counts as a timed call, and such a
    # contender gets no untimed call per block.
    calls.clear()
    timings, _ = time_interleaved({"slow": lambda: (calls.append(1), time.sleep(0.06))},
                                  runs=12, warmup=3, max_seconds=0.1, min_runs=2, settle_s=0)
    assert len(calls) == 2 and timings["slow"].runs == 2
    with pytest.raises(CwmError, match="block"):
        time_interleaved({"a": lambda: None}, block=0)


def test_a_single_contender_is_timed_without_pauses_or_untimed_calls(monkeypatch):
    from cwm.benchmarks import timing as deploy

    pauses, calls = [], []
    monkeypatch.setattr(deploy.time, "sleep", pauses.append)
    timings, _ = deploy.time_interleaved({"only": lambda: calls.append(1)}, runs=4, warmup=1, block=2,
                                         settle_s=0.5)
    assert len(calls) == 1 + 4 and timings["only"].runs == 4 and not pauses
    calls.clear()
    deploy.time_interleaved({"a": lambda: calls.append(1), "b": lambda: None}, runs=4, warmup=1, block=2,
                            settle_s=0.5)
    assert len(calls) == 1 + 2 * (1 + 2) and pauses == [0.5] * 4


def test_e2e_benchmark_tiny_mode(mlp_build, tmp_path, target):
    import tarfile

    from cwm.benchmarks.e2e import TUNING_TIME_FILE, database_archive_path, run_e2e_benchmark
    from cwm.data.database import RECORD_FILE, WORKLOAD_FILE

    model, inputs, _, db, _ = mlp_build
    work_root = tmp_path / "work"
    # The MLP's database already holds 4 trials per task: the benchmark resumes it, no new tuning.
    shutil.copytree(db, work_root / "mlp" / "xgb" / "seed0")
    out = tmp_path / "out"
    kwargs = dict(trials_per_task=4, seeds=(0,), cost_models=("xgb",), work_root=work_root, progress=False,
                  runs=5, warmup=1, target=target, peak_n=256)
    summary = run_e2e_benchmark([("mlp", model, inputs)], out, **kwargs)
    for name in ("e2e.json", "e2e.png", "e2e.md"):
        assert (out / name).stat().st_size > 0
    data = json.loads((out / "e2e.json").read_text())
    assert data == json.loads(json.dumps(summary))
    assert {"config", "networks", "peak_matmul_gflops", "contenders", "geomean_speedup_vs_eager", "host"} <= set(data)
    e = data["networks"]["mlp"]
    assert e["status"] == "done" and e["tunable_tasks"] == 2 and e["trials_per_cost_model"] == 8
    assert e["tuning"]["xgb"]["0"]["tasks_with_records"] == 2
    assert e["builds"]["tvm_xgb@s0"]["tuned_tasks"] == 2 and e["builds"]["tvm_untuned"]["tuned_tasks"] == 0
    assert len(e["builds"]["tvm_xgb@s0"]["prepacked"]) == 2 and not e["builds"]["tvm_untuned"]["prepacked"]
    assert "2 / 2, 2 with prepacked weights" in (out / "e2e.md").read_text()
    assert all(c["ok"] for c in e["checks"].values())
    for c in ("torch_eager", "tvm_untuned", "tvm_xgb"):
        assert e["latency_ms"][c] > 0 and e["speedup_vs_eager"][c] > 0
        assert e["timing"].get(c, e["timing"].get("tvm_xgb@s0"))["runs"] == 5
    # torch.compile: a number, or the reason it failed here
    assert e["latency_ms"]["torch_compile"] is not None or "torch_compile" in e["errors"]
    # ONNX Runtime: exported with torch.onnx.export, checked against PyTorch, timed in the same rotation
    assert e["checks"]["onnxruntime"]["ok"] and e["timing"]["onnxruntime"]["runs"] == 5
    assert e["latency_ms"]["onnxruntime"] > 0 and "ONNX Runtime" in (out / "e2e.md").read_text()
    assert e["tuning_seconds"] >= 0 and "tuning s" in (out / "e2e.md").read_text()
    assert e["roofline"] and 0 < e["roofline"][0]["by_cost_model"]["xgb"]["fraction_of_peak"]
    shares = e["time_shares"]["xgb"]  # where the tuned time goes: every tuned task, largest share first
    assert len(shares) == 2 and abs(sum(r["share"] for r in shares) - 1) < 1e-9
    assert shares[0]["share"] >= shares[1]["share"] and "## Where the time goes: mlp" in (out / "e2e.md").read_text()
    # ... and inside the network call of the fastest seed's library, each task's kernel by its own name
    assert e["profile"]["library"] == "tvm_xgb@s0" and e["profile"]["call_ms"] > 0
    assert sorted(k["name"] for k in e["profile"]["kernels"]) == sorted(e["builds"]["tvm_xgb@s0"]["prepacked"])
    rows = [ln for ln in (out / "e2e.md").read_text().splitlines() if ln.startswith("| fused_")]
    assert len(rows) == 2 and all(ln.split("|")[5].strip() for ln in rows)  # the in-network ms column is filled
    assert e["peak_matmul_gflops"] == data["peak_matmul_gflops"]
    assert data["geomean_speedup_vs_eager"]["tvm_xgb"] > 0
    assert "geometric mean" in (out / "e2e.md").read_text()
    with tarfile.open(database_archive_path(out, "mlp")) as tar:
        names = set(tar.getnames())
    assert {f"mlp/xgb/seed0/{f}" for f in (RECORD_FILE, WORKLOAD_FILE, TUNING_TIME_FILE)} <= names
    # Resumable: a second run with the same settings skips the finished network.
    again = run_e2e_benchmark([("mlp", model, inputs)], out, **kwargs)
    assert again["networks"]["mlp"]["seconds"] == e["seconds"]
    # New weights (the same tasks): the libraries, weights bound in, are rebuilt, not reused.
    import copy

    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed[0].weight.mul_(-1.0)
    (out / "e2e.json").unlink()
    # The work directories lost too (another machine): tuning resumes from the archive beside the report.
    shutil.rmtree(work_root)
    redo = run_e2e_benchmark([("mlp", changed, inputs)], out, **kwargs)["networks"]["mlp"]
    times = json.loads((work_root / "mlp" / "xgb" / "seed0" / TUNING_TIME_FILE).read_text())
    assert times["invocations"] == 2 and redo["tuning"]["xgb"]["0"]["tasks_with_records"] == 2
    # (Not re-checked here: this process still has the old libraries loaded; dlopen reuses them by path.)
    assert not any(b["cached"] for b in redo["builds"].values())


def test_e2e_tuning_time_survives_a_crash(tmp_path, monkeypatch):
    import cwm.tuning.tuner
    from cwm.benchmarks.e2e import TUNING_TIME_FILE, _tune_timed

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-tune")

    monkeypatch.setattr(cwm.tuning.tuner, "tune", crash)
    (tmp_path / TUNING_TIME_FILE).write_text(json.dumps({"seconds": 100.0, "invocations": 1}))
    with pytest.raises(RuntimeError):
        _tune_timed([], 8, tmp_path, "xgb", None, None, 0, 4, False)
    saved = json.loads((tmp_path / TUNING_TIME_FILE).read_text())
    assert saved["invocations"] == 2 and saved["seconds"] >= 100.0


def test_e2e_tunes_seed_major_so_cost_models_alternate(tmp_path, monkeypatch, target):
    """xgb s0, random s0, xgb s1, ...: machine drift hits every cost model alike, and an
    interrupted benchmark leaves complete seed pairs."""
    import types

    import cwm.benchmarks.e2e as e2e

    calls = []

    class Stop(Exception):
        pass

    def tune_timed(tasks, budget, work_dir, cost_model, model_path, target, seed, per_iter, progress,
                   transfer=False):
        calls.append((cost_model, seed))
        if len(calls) == 3:
            raise Stop  # the order of the calls is the point; nothing is tuned
        return types.SimpleNamespace(weighted_latency=None, best={}), 0.0, 0.0

    monkeypatch.setattr(e2e, "_tune_timed", tune_timed)
    model, inputs = _mlp()
    with pytest.raises(Stop):
        e2e.run_e2e_benchmark([("mlp", model, inputs)], tmp_path / "out", trials_per_task=4, seeds=(0, 1),
                              cost_models=("xgb", "random"), work_root=tmp_path / "work", progress=False,
                              target=target, peak_n=64, torch_compile=False)
    assert calls == [("xgb", 0), ("random", 0), ("xgb", 1)]


def test_e2e_markdown_names_each_networks_peak():
    from cwm.benchmarks.e2e import markdown

    def net(peak):
        return {"latency_ms": {"torch_eager": 2.0}, "speedup_vs_eager": {"torch_eager": 1.0}, "errors": {},
                "total_tasks": 1, "tunable_tasks": 1, "tuning": {}, "builds": {}, "checks": {}, "roofline": [],
                "trials_per_cost_model": 1, "peak_matmul_gflops": peak, "peak_matmul_gflops_best": peak + 10}

    summary = {"contenders": ["torch_eager"], "config": {"runs": 30, "seeds": [0], "trials_per_task": 1,
                                                         "cost_models": ["xgb"]},
               "host": {"threads": 2, "cpu": "test"}, "peak_matmul_gflops": 150.0, "peak_matmul_gflops_best": 160.0,
               "networks": {"a": net(100.0), "b": net(120.0)}}
    text = markdown(summary)
    assert "100.0 GFLOP/s (fastest call 110.0) for a" in text and "120.0 GFLOP/s (fastest call 130.0) for b" in text
    summary["networks"]["b"] = net(100.0)
    assert "100.0 GFLOP/s (fastest call 110.0)." in markdown(summary)
    assert "World model" not in markdown(summary)
    summary["world_model"] = {"path": "/models/zen3", "trained_on": "znver3"}
    assert "World model of `cwm`: `/models/zen3` (trained on `znver3`)." in markdown(summary)


def test_e2e_combine_keeps_each_networks_run_and_refuses_mixed_settings(tmp_path):
    import math

    from typer.testing import CliRunner

    from cwm.benchmarks.e2e import combine_e2e_results
    from cwm.cli import app

    config = {"runs": 30, "seeds": [0], "trials_per_task": 1, "cost_models": ["xgb"], "timing_block": 5}

    def net(speedup, peak, status="done"):
        return {"status": status, "config": dict(config), "latency_ms": {"torch_eager": 2.0, "tvm_xgb": 2.0 / speedup},
                "speedup_vs_eager": {"torch_eager": 1.0, "tvm_xgb": speedup}, "errors": {}, "total_tasks": 1,
                "tunable_tasks": 1, "tuning": {}, "builds": {}, "checks": {}, "roofline": [],
                "trials_per_cost_model": 1, "peak_matmul_gflops": peak, "peak_matmul_gflops_best": peak + 10}

    def run(name, networks, **extra):
        summary = {"config": dict(config), "host": {"threads": 2, "cpu": "test"}, "contenders": ["torch_eager", "tvm_xgb"],
                   "peak_matmul_gflops": 150.0, "peak_matmul_gflops_best": 160.0, "networks": networks, **extra}
        (tmp_path / name).mkdir()
        (tmp_path / name / "e2e.json").write_text(json.dumps(summary))
        return tmp_path / name

    a = run("a", {"n1": net(2.0, 100.0), "half": net(9.0, 1.0, status="tuning")})
    b = run("b", {"n2": net(0.5, 120.0)})
    out = tmp_path / "out"
    combined = combine_e2e_results([a, b / "e2e.json"], out)
    assert list(combined["networks"]) == ["n1", "n2"]  # the unfinished network is left out
    assert math.isclose(combined["geomean_speedup_vs_eager"]["tvm_xgb"], 1.0)
    assert combined["networks"]["n2"]["peak_matmul_gflops"] == 120.0
    assert json.loads((out / "e2e.json").read_text())["sources"] == {"n1": str(a / "e2e.json"), "n2": str(b / "e2e.json")}
    text = (out / "e2e.md").read_text()
    assert f"n2 from `{b / 'e2e.json'}`" in text and "| n2 |" in text and "half" not in text
    assert (out / "e2e.png").stat().st_size > 0
    result = CliRunner().invoke(app, ["bench", "e2e-combine", str(a), str(b), "--out", str(tmp_path / "out_cli")])
    assert result.exit_code == 0 and "2 networks: n1, n2" in result.stdout

    with pytest.raises(CwmError, match="n1 is in both"):
        combine_e2e_results([a, a], tmp_path / "dup")
    other = net(1.0, 100.0)
    other["config"]["trials_per_task"] = 64
    with pytest.raises(CwmError, match="other settings"):
        combine_e2e_results([a, run("c", {"n3": other})], tmp_path / "mixed")
    with pytest.raises(CwmError, match="differ in host"):
        combine_e2e_results([a, run("d", {"n4": net(1.0, 100.0)}, host={"threads": 1, "cpu": "test"})], tmp_path / "host")


def test_e2e_names_a_shipped_model_without_the_checkout_path(tmp_path, monkeypatch):
    from cwm.io import portable_path
    from cwm.model.world_model import shipped_models

    name, path = next(iter(shipped_models().items()))
    assert portable_path(path) == f"cwm/pretrained/{name}"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert portable_path(tmp_path / "models" / "mine") == "models/mine"
    assert portable_path("/") == "/"


def test_e2e_database_archive_restores_one_work_dir_and_refuses_a_corrupt_one(tmp_path, monkeypatch):
    import tarfile

    from cwm.benchmarks.e2e import _archive_databases, _restore_work_dir
    from cwm.data.database import RECORD_FILE
    from cwm.errors import CwmError

    for cm, seed in (("xgb", 0), ("cwm", 0), ("cwm", 1)):
        wd = tmp_path / "work" / "net" / cm / f"seed{seed}"
        wd.mkdir(parents=True)
        (wd / RECORD_FILE).write_text(f"{cm} {seed}\n")
        (wd / "best_so_far.png").write_bytes(b"\x89PNG")  # not a database: left out
    archive = tmp_path / "databases_net.tar.gz"
    _archive_databases(archive, tmp_path / "work" / "net", "net")
    target = tmp_path / "elsewhere" / "cwm" / "seed1"
    assert _restore_work_dir(archive, target, "net", "cwm", 1)
    assert sorted(p.name for p in target.iterdir()) == [RECORD_FILE]
    assert (target / RECORD_FILE).read_text() == "cwm 1\n"
    (target / RECORD_FILE).write_text("newer\n")
    assert not _restore_work_dir(archive, target, "net", "cwm", 1)  # never overwrites a database
    assert (target / RECORD_FILE).read_text() == "newer\n"
    assert not _restore_work_dir(archive, tmp_path / "x", "net", "xgb", 2)  # not in the archive
    # A write that fails half-way keeps the old archive and leaves no temporary file beside it.
    before = archive.read_bytes()

    def failing_add(self, *args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(tarfile.TarFile, "add", failing_add)
        with pytest.raises(OSError):
            _archive_databases(archive, tmp_path / "work" / "net", "net")
    assert archive.read_bytes() == before and sorted(p.name for p in archive.parent.iterdir() if p.is_file()) == [
        archive.name]
    archive.write_bytes(b"not a tar")
    with pytest.raises(CwmError, match="unreadable"):
        _restore_work_dir(archive, tmp_path / "y", "net", "xgb", 0)
