"""A user's own model: cwm.compile, torch.compile(backend="cwm"), .pt2 and .onnx files on the CLI, the cache,
the eager fallback and bad input."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

# Import before torch: with torch loaded, this import (MetaSchedule's first TuneContext) takes minutes.
import tvm.s_tir.tensor_intrin  # noqa: E402,F401  isort: skip

torch = pytest.importorskip("torch")

from cwm.errors import CwmError  # noqa: E402

from .test_deploy import _cnn, _mlp  # noqa: E402  the deployment tests' small MLP and CNN

TINY = {"cost_model": "random", "timing_runs": 0, "progress": False}


class _TwoOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.fc(x)
        return {"logits": y, "scaled": (y * 2.0,)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private compile cache for this module ($CWM_CACHE)."""
    root = tmp_path_factory.mktemp("cwm_cache")
    old = os.environ.get("CWM_CACHE")
    os.environ["CWM_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("CWM_CACHE", None)
    else:
        os.environ["CWM_CACHE"] = old


@pytest.fixture(autouse=True)
def few_layout_trials(monkeypatch):
    """Two trials per layout task instead of 8 (the CNN's two transposes), to keep the tests short."""
    import cwm.tuning.tuner as tuner

    monkeypatch.setattr(tuner, "LAYOUT_TRIALS_PER_TASK", 2)


def _close(a, b, tol=1e-4):
    return torch.allclose(a, b, rtol=tol, atol=tol * float(b.abs().max()))


# --------------------------------------------------------------------------------------------
# cwm.compile
# --------------------------------------------------------------------------------------------


def test_the_package_exports_its_nouns_lazily():
    code = ("import sys, cwm; assert 'torch' not in sys.modules and 'tvm' not in sys.modules; "
            "import cwm.cli; assert 'torch' not in sys.modules and 'tvm' not in sys.modules; "
            "print(sorted(n for n in ('compile', 'tune', 'WorldModel', 'WorldModelCostModel', 'CwmError') "
            "if callable(getattr(cwm, n))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["['CwmError',", "'WorldModel',", "'WorldModelCostModel',", "'compile',", "'tune']"]


def test_compile_mlp_with_the_default_world_model_then_a_cache_hit_in_a_fresh_process(cache, capsys):
    import cwm

    model, inputs = _mlp()
    compiled = cwm.compile(model, inputs, trials=4, timing_runs=3)  # cost_model="cwm": the shipped world model
    out = compiled(*inputs)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 10)
    assert _close(out, model(*inputs))
    x2 = torch.randn(1, 32)  # another input of the same shape runs too
    assert _close(compiled(x2), model(x2))
    report = compiled.report
    assert not report["cached"] and report["key"]["cost_model"] == "cwm" and report["key"]["trials"] == 4
    assert sum(r["trials"] for r in report["tasks"]) == 4
    err = capsys.readouterr().err
    assert "GFLOP/s" in err and "end to end: cwm" in err and "tune[cwm]" in err

    # A new process: the same model builds from the cache; tuning would raise.
    script = textwrap.dedent("""
        import torch, cwm, cwm.tuning.tuner as tuner
        def no_tuning(*a, **k):
            raise AssertionError("tuned again")
        tuner.tune_network = tuner.tune_layout_tasks = tuner.tune = no_tuning
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).eval()
        x = torch.randn(1, 32)
        compiled = cwm.compile(model, (x,), trials=4, timing_runs=0)
        assert compiled.report["cached"]
        assert torch.allclose(compiled(x), model(x), atol=1e-4)
        print("CACHED", compiled.lib_path)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CWM_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CACHED" in proc.stdout and "from the cache" in proc.stderr
    assert str(compiled.lib_path) in proc.stdout


def test_compile_cnn_in_nhwc_and_an_output_structure(cache):
    import cwm

    model, inputs = _cnn()
    compiled = cwm.compile(model, inputs, trials=3, **TINY)
    assert _close(compiled(*inputs), model(*inputs), 1e-3)
    assert compiled.report["build"]["conv_layout"] == "NHWC"

    torch.manual_seed(0)
    two = _TwoOutputs().eval()
    x = torch.randn(2, 8)
    out = cwm.compile(two, (x,), trials=1, **TINY)(x)
    assert set(out) == {"logits", "scaled"} and isinstance(out["scaled"], tuple)
    assert _close(out["logits"], two(x)["logits"]) and _close(out["scaled"][0], two(x)["scaled"][0])


def test_compile_an_exported_program_with_a_dynamic_batch_is_specialized(cache, caplog):
    import cwm

    model, (x,) = _mlp()
    batch = torch.export.Dim("batch", min=1, max=64)
    exported = torch.export.export(model, (torch.randn(4, 32),), dynamic_shapes=({0: batch},))
    x3 = torch.randn(3, 32)
    with caplog.at_level(logging.WARNING):
        compiled = cwm.compile(exported, (x3,), trials=1, **TINY)
    assert "dynamic dimensions; specialized to the example inputs [(3, 32) float32]" in caplog.text
    assert _close(compiled(x3), model(x3))
    with pytest.raises(CwmError, match="expects 1 input"):
        compiled(x3, x3)
    with pytest.raises(CwmError, match=r"expects .*\(3, 32\)"):
        compiled(torch.randn(5, 32))


def test_a_killed_compile_resumes_and_a_corrupt_entry_is_rebuilt(cache, caplog):
    import cwm
    from cwm.compiler.cache import CacheEntry, cache_key
    from cwm.frontend.pytorch import from_torch
    from cwm.hardware import make_target
    from cwm.tuning.collect import existing_counts
    from cwm.tuning.tuner import tune
    from cwm.workloads.pipeline import extract_tasks

    torch.manual_seed(1)
    model, x = torch.nn.Linear(16, 8).eval(), torch.randn(1, 16)
    target = make_target()
    imported = from_torch(model, (x,), target)
    entry = CacheEntry.for_key(cache_key(imported.mod, target, 3, "random"))
    # A compile killed after one of its three trials: the entry has a database and no record.
    tune(extract_tasks(imported.mod, target), trials=1, work_dir=entry.db, cost_model="random", target=target,
         progress=False, report=False)
    first = set(json.dumps(json.loads(line)[1]) for line in (entry.db / "database_tuning_record.json").open())
    compiled = cwm.compile(model, (x,), trials=3, **TINY)
    assert compiled.lib_path.parent == entry.directory and not compiled.report["cached"]
    assert sum(existing_counts(entry.db).values()) == 3  # resumed: two more, not three
    after = set(json.dumps(json.loads(line)[1]) for line in (entry.db / "database_tuning_record.json").open())
    assert first <= after

    entry.library.unlink()  # a new file: the loaded library stays mapped in this process
    entry.library.write_bytes(b"not a library")
    with caplog.at_level(logging.WARNING):
        again = cwm.compile(model, (x,), trials=3, **TINY)
    assert "is corrupt" in caplog.text and "rebuilding it" in caplog.text
    assert _close(again(x), model(x)) and sum(existing_counts(entry.db).values()) == 3
    (entry.directory / "entry.json").write_text("{not json")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert _close(cwm.compile(model, (x,), trials=3, **TINY)(x), model(x))
    assert "entry.json is unreadable" in caplog.text


def test_the_compile_lock_serializes_two_compiles(cache):
    from filelock import FileLock, Timeout

    from cwm.compiler.cache import CacheEntry

    entry = CacheEntry(cache / "some-entry", {})
    with entry.lock():
        with pytest.raises(Timeout):
            with FileLock(str(cache / "some-entry.lock"), timeout=0.1):
                pass


# --------------------------------------------------------------------------------------------
# torch.compile(backend="cwm")
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [_mlp, _cnn], ids=["mlp", "cnn"])
def test_torch_compile_backend(cache, caplog, make):
    torch._dynamo.reset()
    assert "cwm" in torch._dynamo.list_backends()
    model, inputs = make()
    fn = torch.compile(model, backend="cwm", options={"trials": 3, **TINY})
    with caplog.at_level(logging.WARNING):
        out = fn(*inputs)
    assert "in eager" not in caplog.text
    assert _close(out, model(*inputs), 1e-3)
    assert _close(fn(*inputs), model(*inputs), 1e-3)


class _Lgamma(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.lgamma(self.fc(x).abs() + 1.0)


def test_torch_compile_runs_an_unsupported_operator_in_eager_with_one_warning(cache, caplog):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Lgamma().eval(), torch.randn(2, 8)
    fn = torch.compile(model, backend="cwm", options={"trials": 1, **TINY})
    with caplog.at_level(logging.WARNING, logger="cwm"):
        out = fn(x)
    assert torch.allclose(out, model(x))
    warnings = [r for r in caplog.records if r.name.startswith("cwm") and "in eager" in r.getMessage()]
    assert len(warnings) == 1 and "lgamma" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()


# --------------------------------------------------------------------------------------------
# Model files on the CLI
# --------------------------------------------------------------------------------------------


def _save(kind, model, inputs, path):
    if kind == "pt2":
        torch.export.save(torch.export.export(model, inputs), str(path))
    else:
        torch.onnx.export(model, inputs, str(path), dynamo=True, verbose=False)


@pytest.mark.parametrize("make", [_mlp, _cnn], ids=["mlp", "cnn"])
@pytest.mark.parametrize("kind", ["pt2", "onnx"])
def test_cli_tunes_builds_and_runs_a_model_file(tmp_path, make, kind):
    from typer.testing import CliRunner

    from cwm.cli import app

    model, inputs = make()
    path = tmp_path / f"model.{kind}"
    _save(kind, model, inputs, path)
    db, lib = tmp_path / "db", tmp_path / "model.so"
    runner = CliRunner()
    result = runner.invoke(app, ["tune", str(path), "--trials", "2", "--cost-model", "random", "--work-dir", str(db)])
    assert result.exit_code == 0, result.output
    assert "best" in result.output
    result = runner.invoke(app, ["build", "--model-file", str(path), "--db", str(db), "--out", str(lib)])
    assert result.exit_code == 0, result.output
    tuned, total = map(int, result.output.split(" tasks tuned")[0].split()[-1].split("/"))
    assert tuned >= 1 and total >= 1
    result = runner.invoke(app, ["run", str(lib), "--check-model", str(path), "--profile", "--runs", "2"])
    assert result.exit_code == 0, result.output
    reference = "PyTorch" if kind == "pt2" else "ONNX Runtime"
    assert f"outputs match {reference}" in result.output
    assert "Network call" in result.output and "| kernel | calls |" in result.output
    # The check can fail: another model's file does not match this library.
    other = make()[0]
    torch.manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    wrong = tmp_path / f"other.{kind}"
    _save(kind, other.eval(), inputs, wrong)
    result = runner.invoke(app, ["run", str(lib), "--check-model", str(wrong)])
    assert result.exit_code != 0 and isinstance(result.exception, CwmError)
    assert "differs from" in str(result.exception)


# --------------------------------------------------------------------------------------------
# Bad input: one clear line
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["model.onnx", "model.pt2"])
def test_a_file_that_is_not_a_model_is_one_line(tmp_path, name):
    bad = tmp_path / name
    bad.write_text("this is not a model\n")
    proc = subprocess.run([sys.executable, "-m", "cwm", "tune", str(bad), "--trials", "2"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert "is not a model" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_an_onnx_operator_tvm_does_not_support_is_named(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from cwm.frontend import load_model_file

    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"])], "det",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    path = tmp_path / "det.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(CwmError, match="not supported.*Det") as err:
        load_model_file(path)
    assert "\n" not in str(err.value)


def test_bad_example_inputs_a_model_that_raises_and_bad_trials_are_one_line(cache):
    import cwm

    model, (x,) = _mlp()
    exported = torch.export.export(model, (x,))

    class Raises(torch.nn.Module):
        def forward(self, x):
            raise ValueError("this model is broken")

    cases = [
        (lambda: cwm.compile(exported, (torch.randn(1, 31),), **TINY), r"example input 0 .* has shape \(1, 31\)"),
        (lambda: cwm.compile(exported, (x.double(),), **TINY), "torch.float64; the exported program expects"),
        (lambda: cwm.compile(exported, (x, x), **TINY), "takes 1 input"),
        (lambda: cwm.compile(model, (torch.randn(1, 31),), **TINY), "raises in eager"),
        (lambda: cwm.compile(model, [x.numpy()], **TINY), "tuple of torch tensors"),
        (lambda: cwm.compile(Raises(), (x,), **TINY), "raises in eager .*ValueError: this model is broken"),
        (lambda: cwm.compile(model, (x,), trials=0, **TINY), "trials must be a positive integer"),
        (lambda: cwm.compile(model, (x,), trials=-3, **TINY), "trials must be a positive integer"),
        (lambda: cwm.compile("model.pt", (x,), **TINY), "nn.Module or a torch.export.ExportedProgram"),
    ]
    for call, message in cases:
        with pytest.raises(CwmError, match=message) as err:
            call()
        assert "\n" not in str(err.value)


def test_world_model_cost_model_with_no_argument_uses_the_host_model():
    import cwm
    from cwm.model.world_model import default_model_dir

    cost_model = cwm.WorldModelCostModel()
    assert type(cost_model).__name__ == "WorldModelCostModel"
    expected = json.loads((default_model_dir() / "world_model.json").read_text()).get("hardware")
    assert cost_model.model.config.hardware == expected


def test_bench_e2e_resolves_model_names_and_files(tmp_path):
    from cwm.frontend import zoo

    assert zoo.resolve("efficientnet_b0")[0] == "torchvision"
    assert zoo.resolve("transformers:roberta")[0] == "transformers"
    model, inputs = zoo.resolve("squeezenet1_0")[1]()
    assert tuple(model(*inputs).shape) == (1, 1000)
    for name, message in [("nosuchnet", "unknown network 'nosuchnet'"), ("torchvision:nosuch", "has no model"),
                          ("m.onnx", "needs a PyTorch model"), (str(tmp_path / "x.pt2"), "does not exist")]:
        with pytest.raises(CwmError, match=message):
            zoo.resolve(name)
