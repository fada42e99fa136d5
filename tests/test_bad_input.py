"""Bad input: every command and the public API answer malformed input with one clear line that
names the problem and a non-zero exit, never a Python traceback.

Most cases run ``cwm.cli.main`` in this process (``main`` re-raises anything that is not a
``CwmError`` or a usage error, so a traceback fails the test with that traceback); a few run
``python -m cwm`` in a subprocess to check the real stderr. Nothing here measures or compiles:
``tune_tasks`` and the network importers are replaced by guards that fail the test if a bad input
gets that far. The world models with a wrong version are edited copies of the shipped model
(same files as the ``tiny_model`` fixture, without training one).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from cwm.errors import CwmError

from .conftest import TINY

ROOT = Path(__file__).resolve().parents[1]


def _png() -> bytes:
    """A valid 1x1 PNG image."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0\0\0\0")) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def f(tmp_path_factory):
    """Bad files and directories of every kind, shared by the cases below."""
    from cwm.data.database import open_database
    from cwm.data.database import write_task_index
    from cwm.model.world_model import CONFIG_FILE, default_model_dir
    from cwm.workloads import get_task

    d = tmp_path_factory.mktemp("bad")
    noise = random.Random(0).randbytes(4096)
    png = d / "image.png"
    png.write_bytes(_png())
    rand = d / "random.bin"
    rand.write_bytes(noise)
    randdb = d / "randdb"  # a "database" whose files are random bytes
    randdb.mkdir()
    (randdb / "database_workload.json").write_bytes(noise)
    (randdb / "database_tuning_record.json").write_bytes(noise[::-1])
    # A real database with one task and no records, written without measuring anything.
    empty_db = d / "empty_db"
    task = get_task(TINY)
    open_database(empty_db).commit_workload(task.mod)
    write_task_index(empty_db, [task])
    split = d / "split.json"
    split.write_text(json.dumps({"train": [task.id], "val": [], "test": [task.id]}))
    (d / "notjson.json").write_text("{not json")
    (d / "list.json").write_text("[1, 2]")
    (d / "badsplit.json").write_text(json.dumps({"train": "abc", "val": [], "test": []}))
    (d / "empty.py").write_text("")
    (d / "notscript.py").write_text("x = 1\n")
    nonempty = d / "nonempty"
    nonempty.mkdir()
    (nonempty / "keep.txt").write_text("not a model\n")
    # Libraries: a PNG with a static signature, one with a symbolic one, one with a corrupt sidecar.
    lib = d / "lib"
    lib.mkdir()
    for name, side in (("png.so", {"signature": {"inputs": [{"shape": [2, 3], "dtype": "float32"}]}}),
                       ("symbolic.so", {"signature": {"inputs": [{"shape": ["n", 3], "dtype": "float32"}]}}),
                       ("corrupt.so", None)):
        (lib / name).write_bytes(_png())
        (lib / (name + ".json")).write_text(json.dumps(side) if side else "{not json")
    # World models from "another version" and damaged ones: edited copies of the shipped model.
    models = {}

    def model(name, edit):
        path = d / "models" / name
        shutil.copytree(default_model_dir(), path)
        edit(path)
        models[name] = path

    def set_config(**changes):
        def edit(path):
            cfg = json.loads((path / CONFIG_FILE).read_text())
            cfg.update(changes)
            (path / CONFIG_FILE).write_text(json.dumps(cfg))
        return edit

    def truncate(rel):
        def edit(path):
            data = (path / rel).read_bytes()
            (path / rel).write_bytes(data[: len(data) // 3])
        return edit

    model("v0", set_config(format_version=0))
    model("v99", set_config(format_version=99))
    model("layout", set_config(feature_layout="000000000000"))
    model("latent_dim", set_config(latent_dim="wide"))
    model("cfg_random", lambda p: (p / CONFIG_FILE).write_bytes(noise))
    model("cfg_list", lambda p: (p / CONFIG_FILE).write_text("[1, 2]"))
    model("encoder_weights", truncate("encoder/encoder.safetensors"))
    model("transition_weights", truncate("transition/transition.safetensors"))
    model("ranker_model", truncate("ranker/ranker.json"))
    model("no_tokenizer", lambda p: (p / "encoder" / "tokenizer.json").unlink())
    return SimpleNamespace(dir=d, png=png, rand=rand, randdb=randdb, empty_db=empty_db, split=split,
                           notjson=d / "notjson.json", list=d / "list.json", badsplit=d / "badsplit.json",
                           empty_py=d / "empty.py", notscript=d / "notscript.py", nonempty=nonempty,
                           lib=lib, models=models, missing=d / "missing", nodir=d / "no" / "such" / "dir")


@pytest.fixture(autouse=True)
def no_measuring(monkeypatch):
    """Bad input must fail before any measurement or network import: those fail the test here."""
    import tvm.s_tir.meta_schedule as ms

    import cwm.workloads.networks as networks

    def guard(*_args, **_kwargs):
        raise AssertionError("bad input got as far as tuning/compiling")

    monkeypatch.setattr(ms, "tune_tasks", guard)
    monkeypatch.setattr(networks, "relax_module", guard)
    monkeypatch.setattr(networks, "torch_model", guard)


def cli(*args) -> tuple[int, str, str]:
    """``cwm ARGS`` through ``cwm.cli.main`` in this process: (exit code, stdout, stderr)."""
    from cwm.cli import main

    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["cwm", *(str(a) for a in args)]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as ex:
        code = ex.code
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def assert_one_clear_line(code, stderr: str, *needles: str) -> str:
    assert code not in (0, None), f"exit code {code}, stderr: {stderr}"
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


DB = "--db={empty_db}"  # never the default (it unpacks the reference dataset)

# Each case: the arguments (strings with {placeholders} of the fixture ``f`` and ``tmp``), and
# the words the one error line must hold.
CASES = [
    # workloads
    (["workloads", "list", "--network", "nosuchnet"], ["unknown network 'nosuchnet'"]),
    (["workloads", "list", "--network", ""], ["unknown network ''"]),
    # collect: shapes
    (["collect", "", "--db", "{tmp}/db"], ["unknown workload ''"]),
    (["collect", "matmul:M=", "--db", "{tmp}/db"], ["'M='", "not an integer"]),
    (["collect", "matmul:M=10**12", "--db", "{tmp}/db"], ["'10**12' is not an integer"]),
    (["collect", "matmul:M=1000000000000", "--db", "{tmp}/db"], ["M=1000000000000 is too large"]),
    (["collect", "matmul:M=1048576,N=1048576,K=1048576", "--db", "{tmp}/db"], ["tensor A would hold", "GiB"]),
    (["collect", "softmax:M=1048576,N=1048576", "--db", "{tmp}/db"], ["elements"]),
    (["collect", "matmul:M=-4", "--db", "{tmp}/db"], ["M must be >= 1, got -4"]),
    (["collect", "matmul:M=0", "--db", "{tmp}/db"], ["M must be >= 1, got 0"]),
    (["collect", "conv2d:pad=-1", "--db", "{tmp}/db"], ["pad must be >= 0, got -1"]),
    (["collect", "matmul:M=abc", "--db", "{tmp}/db"], ["'abc' is not an integer"]),
    (["collect", "matmul:M=1.5", "--db", "{tmp}/db"], ["'1.5' is not an integer"]),
    (["collect", "matmul:Q=3", "--db", "{tmp}/db"], ["no parameter 'Q'", "M, N, K"]),
    (["collect", "matmul:M", "--db", "{tmp}/db"], ["write KEY=VALUE"]),
    (["collect", "matmul:=3", "--db", "{tmp}/db"], ["malformed shape '=3'"]),
    (["collect", "matmul:M=1,M=2", "--db", "{tmp}/db"], ["M is given twice"]),
    (["collect", "max_pool2d:H=1,W=1,R=3,pad=0", "--db", "{tmp}/db"], ["not a valid shape", "[1, 64, 0, 0]"]),
    (["collect", "conv2d:H=1,W=1,R=7,pad=0", "--db", "{tmp}/db"], ["not a valid shape", "negative output"]),
    # collect: names
    (["collect", "nosuchop", "--db", "{tmp}/db"], ["unknown workload 'nosuchop'"]),
    (["collect", "nosuchnet/fused_conv2d", "--db", "{tmp}/db"], ["unknown network 'nosuchnet'"]),
    (["collect", "--network", "nosuchnet", "--db", "{tmp}/db"], ["unknown network 'nosuchnet'"]),
    (["collect", "--network", "", "--db", "{tmp}/db"], ["unknown network ''"]),
    (["collect", "--db", "{tmp}/db"], ["no tasks given"]),
    # collect: paths, budgets, targets, RPC
    (["collect", TINY, "--db", "{png}"], ["{png}", "is a file, not a directory"]),
    (["collect", TINY, "--db", "{randdb}"], ["database_workload.json", "none of its", "parses"]),
    (["collect", TINY, "--db", "{tmp}/db", "--random", "0", "--evolutionary", "0"], ["positive number"]),
    (["collect", TINY, "--db", "{tmp}/db", "--random", "-3"], ["positive number"]),
    (["collect", TINY, "--db", "{tmp}/db", "--batch", "0"], ["batch must be positive, got 0"]),
    (["collect", TINY, "--db", "{tmp}/db", "--target", '{"kind": "llvm", "mcpu": 3}'], ["invalid target", "'mcpu'"]),
    (["collect", TINY, "--db", "{tmp}/db", "--target", '{"kind": "nope"}'], ["invalid target", '"nope"']),
    (["collect", TINY, "--db", "{tmp}/db", "--target", "{not json"], ["target must be", "'{not json'"]),
    (["collect", TINY, "--db", "{tmp}/db", "--target", ""], ["target must be"]),
    (["collect", TINY, "--db", "{tmp}/db", "--target", "[1, 2]"], ["needs a 'kind' field"]),
    (["collect", TINY, "--db", "{tmp}/db", "--target", '{"kind": "llvm", "num-cores": "many"}'], ["'num-cores'"]),
    (["collect", TINY, "--db", "{tmp}/db", "--target", '{"kind": "llvm", "bogus": 1}'], ["'bogus'"]),
    (["collect", TINY, "--db", "{tmp}/db", "--rpc", "nonsense"], ["HOST:PORT:KEY", "'nonsense'"]),
    (["collect", TINY, "--db", "{tmp}/db", "--rpc", "127.0.0.1:1:key"], ["127.0.0.1:1 is unreachable"]),
    # tune
    (["tune", TINY, "--trials", "0", "--work-dir", "{tmp}/t"], ["--trials must be positive, got 0"]),
    (["tune", TINY, "--trials", "-2", "--work-dir", "{tmp}/t"], ["--trials must be positive, got -2"]),
    (["tune", TINY, "--trials", "4", "--per-iter", "0", "--work-dir", "{tmp}/t"], ["num_trials_per_iter", "got 0"]),
    (["tune", TINY, "--trials", "4", "--cost-model", "xgb", "--finetune-transition", "--work-dir", "{tmp}/t"],
     ["--finetune-transition needs --cost-model cwm, got xgb"]),
    (["tune", "matmul:M=-1", "--trials", "4", "--work-dir", "{tmp}/t"], ["M must be >= 1"]),
    (["tune", "nosuchop", "--trials", "4", "--work-dir", "{tmp}/t"], ["unknown workload 'nosuchop'"]),
    (["tune", "", "--trials", "4", "--work-dir", "{tmp}/t"], ["unknown workload ''"]),
    (["tune", "--network", "", "--trials", "4", "--work-dir", "{tmp}/t"], ["unknown network ''"]),
    (["tune", "--network", "nosuchnet", "--trials", "4", "--work-dir", "{tmp}/t"], ["unknown network"]),
    (["tune", TINY, "--trials", "4", "--cost-model", "nosuch", "--work-dir", "{tmp}/t"],
     ["unknown cost model 'nosuch'"]),
    (["tune", TINY, "--trials", "4", "--model", "{png}", "--work-dir", "{tmp}/t"], ["{png}", "is a file"]),
    (["tune", TINY, "--trials", "4", "--model", "{randdb}", "--work-dir", "{tmp}/t"], ["world_model.json is missing"]),
    (["tune", TINY, "--trials", "4", "--model", "{missing}", "--work-dir", "{tmp}/t"], ["{missing} does not exist"]),
    (["tune", TINY, "--trials", "4", "--model", "{models[v0]}", "--work-dir", "{tmp}/t"],
     ["format version 0", "reads version 1"]),
    (["tune", TINY, "--trials", "4", "--model", "{models[layout]}", "--work-dir", "{tmp}/t"],
     ["another feature layout", "retrain"]),
    (["tune", TINY, "--trials", "4", "--cost-model", "xgb-pretrained", "--model", "{png}", "--work-dir", "{tmp}/t"],
     ["{png} is not a saved XGBModel"]),
    (["tune", TINY, "--trials", "4", "--cost-model", "xgb-pretrained", "--work-dir", "{tmp}/t"],
     ["needs a saved XGBModel file"]),
    (["tune", "--tir", "{png}", "--trials", "4", "--work-dir", "{tmp}/t"], ["{png} is not a text file"]),
    (["tune", "--tir", "{rand}", "--trials", "4", "--work-dir", "{tmp}/t"], ["{rand} is not a text file"]),
    (["tune", "--tir", "{dir}", "--trials", "4", "--work-dir", "{tmp}/t"], ["is a directory"]),
    (["tune", "--tir", "{empty_py}", "--trials", "4", "--work-dir", "{tmp}/t"], ["does not parse as TVMScript"]),
    (["tune", "--tir", "{notscript}", "--trials", "4", "--work-dir", "{tmp}/t"], ["does not parse as TVMScript"]),
    (["tune", "--tir", "{missing}", "--trials", "4", "--work-dir", "{tmp}/t"], ["{missing} does not exist"]),
    (["tune", TINY, "--trials", "4", "--cost-model", "random", "--work-dir", "{png}"], ["{png} is a file"]),
    (["tune", TINY, "--trials", "4", "--target", '{"kind": "nope"}', "--work-dir", "{tmp}/t"], ["invalid target"]),
    (["tune", TINY, "--trials", "4", "--rpc", "127.0.0.1:notaport:key", "--work-dir", "{tmp}/t"],
     ["port must be an integer"]),
    # train
    (["train", "--db", "{missing}", "--split", "{split}", "--out", "{tmp}/m"], ["{missing} does not exist"]),
    (["train", "--db", "{png}", "--split", "{split}", "--out", "{tmp}/m"], ["{png} is a file"]),
    (["train", "--db", "{randdb}", "--split", "{split}", "--out", "{tmp}/m"], ["none of its", "parses"]),
    (["train", "--db", "{empty_db}", "--split", "{png}", "--out", "{tmp}/m"], ["split file", "not a text file"]),
    (["train", "--db", "{empty_db}", "--split", "{notjson}", "--out", "{tmp}/m"], ["not valid JSON"]),
    (["train", "--db", "{empty_db}", "--split", "{list}", "--out", "{tmp}/m"], ["must hold a JSON object"]),
    (["train", "--db", "{empty_db}", "--split", "{badsplit}", "--out", "{tmp}/m"], ["'train' must be a list"]),
    (["train", "--db", "{empty_db}", "--split", "{missing}", "--out", "{tmp}/m"], ["split file", "does not exist"]),
    (["train", "--db", "{empty_db}", "--split", "{split}", "--out", "{png}"], ["{png} is a file"]),
    (["train", "--db", "{empty_db}", "--split", "{split}", "--out", "{nonempty}"], ["holds no world model"]),
    (["train", "--db", "{empty_db}", "--split", "{split}", "--out", "{tmp}/m", "--tiny"], ["no valid records"]),
    # eval
    (["eval", "--db", "{empty_db}", "--split", "{split}", "--records-per-task-cap", "-1", "--out", "{tmp}/e"],
     ["records_per_task_cap must be 0 (no cap) or positive"]),
    (["eval", "--db", "{empty_db}", "--split", "{png}", "--out", "{tmp}/e"], ["not a text file"]),
    (["eval", "--db", "{empty_db}", "--split", "{split}", "--out", "{png}"], ["output directory", "is a file"]),
    (["eval", "--db", "{randdb}", "--split", "{split}", "--out", "{tmp}/e"], ["parses"]),
    (["eval", "--db", "{empty_db}", "--split", "{split}", "--out", "{tmp}/e"], ["test split has no valid records"]),
    # build and run
    (["build", "--network", "nosuchnet", "--out", "{tmp}/n.so"], ["unknown network 'nosuchnet'"]),
    (["build", "--network", "resnet18", "--db", "{png}", "--out", "{tmp}/n.so"], ["is not a directory"]),
    (["build", "--network", "resnet18", "--db", "{randdb}", "--out", "{tmp}/n.so"], ["parses"]),
    (["build", "--network", "resnet18", "--db", "{missing}", "--out", "{tmp}/n.so"], ["does not exist"]),
    (["build", "--network", "resnet18", "--target", '{"kind": "nope"}', "--out", "{tmp}/n.so"], ["invalid target"]),
    (["run", "{missing}"], ["library {missing} does not exist"]),
    (["run", "{png}"], ["has no shape sidecar"]),
    (["run", "{lib}/png.so"], ["cannot load", "png.so"]),
    (["run", "{lib}/symbolic.so"], ["no static shape"]),
    (["run", "{lib}/corrupt.so"], ["corrupt.so.json", "is corrupt"]),
    (["run", "{png}", "--network", "nosuchnet"], ["unknown network 'nosuchnet'"]),
    # bench search (no xgb-pretrained contender unless the case is about its split)
    (["bench", "search", DB, "nosuchop", "--contenders", "xgb", "--out", "{tmp}/bs", "--work-root", "{tmp}/bsr"],
     ["unknown workload 'nosuchop'"]),
    (["bench", "search", DB, TINY, "--budget", "0", "--contenders", "xgb", "--out", "{tmp}/bs"],
     ["budgets must be positive"]),
    (["bench", "search", DB, TINY, "--large-budget", "-1", "--contenders", "xgb", "--out", "{tmp}/bs"],
     ["budgets must be positive"]),
    (["bench", "search", DB, TINY, "--seeds", "0", "--contenders", "xgb", "--out", "{tmp}/bs"], ["at least one seed"]),
    (["bench", "search", DB, TINY, "--contenders", "xgb,nosuch", "--out", "{tmp}/bs"], ["unknown contender 'nosuch'"]),
    (["bench", "search", DB, TINY, "--contenders", ",", "--out", "{tmp}/bs"], ["no contenders"]),
    (["bench", "search", DB, TINY, "--contenders", "xgb,cwm", "--model", "{models[v0]}", "--out", "{tmp}/bs"],
     ["format version 0"]),
    (["bench", "search", DB, TINY, "--split", "{png}", "--out", "{tmp}/bs"], ["not a text file"]),
    (["bench", "search", DB, TINY, "--contenders", "xgb", "--out", "{png}"], ["{png} is a file"]),
    # bench e2e: every case fails before the ~20 s tensor_intrin import
    (["bench", "e2e", "nosuchnet", "--out", "{tmp}/be", "--work-root", "{tmp}/ber"], ["unknown network 'nosuchnet'"]),
    (["bench", "e2e", "resnet18", "--trials-per-task", "0", "--out", "{tmp}/be"], ["must be positive"]),
    (["bench", "e2e", "resnet18", "--runs", "0", "--out", "{tmp}/be"], ["must be positive"]),
    (["bench", "e2e", "resnet18", "--num-trials-per-iter", "0", "--out", "{tmp}/be"], ["must be positive"]),
    (["bench", "e2e", "resnet18", "--seeds", "0", "--out", "{tmp}/be"], ["at least one tuning seed"]),
    (["bench", "e2e", "resnet18", "--cost-models", "xgb,nosuch", "--out", "{tmp}/be"], ["unknown cost model 'nosuch'"]),
    (["bench", "e2e", "resnet18", "--cost-models", ",", "--out", "{tmp}/be"], ["at least one cost model"]),
    (["bench", "e2e", "resnet18", "--model", "{missing}", "--out", "{tmp}/be"], ["{missing} does not exist"]),
    (["bench", "e2e-combine", "{missing}", "--out", "{tmp}/bc"], ["{missing}", "does not exist"]),
    (["bench", "e2e-combine", "{notjson}", "--out", "{tmp}/bc"], ["not a readable e2e.json"]),
    (["bench", "e2e-combine", "{png}", "--out", "{tmp}/bc"], ["not a readable e2e.json"]),
    (["bench", "e2e-combine", "{list}", "--out", "{tmp}/bc"], ["not a readable e2e.json", "no 'networks'"]),
    # dataset
    (["dataset", "stats", "--db", "{png}"], ["{png} is a file"]),
    (["dataset", "stats", "--db", "{randdb}"], ["none of its", "parses"]),
    (["dataset", "stats", "--db", "{missing}"], ["{missing} does not exist"]),
    (["dataset", "stats", "--db", "{dir}"], ["is not a MetaSchedule database"]),
    (["dataset", "stats", "--db", "{empty_db}", "--plot", "{nodir}/p.png"], ["cannot write", "p.png"]),
    (["dataset", "stats", "--db", "{empty_db}", "--plot", "{tmp}/p.nosuchformat"], ["cannot write", "nosuchformat"]),
    (["dataset", "split", "--db", "{randdb}", "--out", "{tmp}/s.json"], ["parses"]),
    (["dataset", "split", "--db", "{empty_db}", "--out", "{nodir}/s.json"], ["cannot write", "s.json"]),
    (["dataset", "split", "--db", "{empty_db}", "--out", "{dir}"], ["cannot write", "is a directory"]),
    (["dataset", "pack", "--db", "{png}", "--out", "{tmp}/p"], ["{png} is a file"]),
    (["dataset", "pack", "--db", "{empty_db}", "--out", "{png}"], ["output directory", "is a file"]),
    (["dataset", "pack", "--db", "{empty_db}", "--split", "{rand}", "--out", "{tmp}/p"], ["not a text file"]),
    (["dataset", "export", "--db", "{randdb}", "--out", "{tmp}/e.jsonl"], ["parses"]),
    (["dataset", "export", "--db", "{empty_db}", "--out", "{nodir}/e.jsonl"], ["cannot write", "e.jsonl"]),
    (["dataset", "export", "--db", "{empty_db}", "--out", "{dir}"], ["cannot write", "is a directory"]),
]


def _fill(items, f, tmp):
    """Replace ``{name}`` and ``{models[key]}`` by the fixture's paths (JSON braces stay)."""
    values = {**vars(f), "tmp": tmp}

    def sub(m):
        value = values[m.group(1)]
        return str(value[m.group(2)] if m.group(2) else value)

    return [re.sub(r"\{(\w+)(?:\[(\w+)\])?\}", sub, s) if isinstance(s, str) else s for s in items]


@pytest.mark.parametrize("args, needles", CASES, ids=lambda v: " ".join(v)[:70] if isinstance(v, list) else None)
def test_cli_bad_input(args, needles, f, tmp_path):
    code, _, err = cli(*_fill(args, f, tmp_path))
    assert_one_clear_line(code, err, *_fill(needles, f, tmp_path))


@pytest.mark.parametrize("args", [["tune", TINY, "--trials", "abc"], ["collect", TINY], ["dataset", "nosuch"],
                                  ["bench", "search", TINY, "--budget", "1.5"]])
def test_usage_errors_are_clicks_short_message(args):
    code, _, err = cli(*args)
    assert code == 2 and "Traceback" not in err and "Error:" in err


UNREADABLE = [
    (["tune", "--tir", "{tmp}/locked.py", "--trials", "4", "--work-dir", "{tmp}/t"], ["cannot read", "locked.py"]),
    (["train", "--db", "{tmp}/locked_db", "--split", "{tmp}/locked.json", "--out", "{tmp}/m"],
     ["cannot read split file", "locked.json"]),
    (["dataset", "stats", "--db", "{tmp}/locked_db"], ["cannot read", "locked_db"]),
    (["tune", TINY, "--trials", "4", "--model", "{tmp}/locked_model", "--work-dir", "{tmp}/t"],
     ["cannot read", "locked_model"]),
    (["collect", TINY, "--db", "{tmp}/locked_dir/db"], ["cannot create", "locked_dir"]),
]


def _locked_files(f, tmp_path):
    from cwm.model.world_model import default_model_dir

    (tmp_path / "locked.py").write_text("x = 1\n")
    (tmp_path / "locked.json").write_text(f.split.read_text())
    shutil.copytree(f.empty_db, tmp_path / "locked_db")
    shutil.copytree(default_model_dir(), tmp_path / "locked_model")
    (tmp_path / "locked_dir").mkdir()
    return [tmp_path / "locked.py", tmp_path / "locked.json", tmp_path / "locked_db" / "database_workload.json",
            tmp_path / "locked_model" / "world_model.json", tmp_path / "locked_dir"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="running as root: chmod 000 does not stop root from reading "
                           "(test_unreadable_paths_simulated covers the same cases)")
@pytest.mark.parametrize("args, needles", UNREADABLE)
def test_unreadable_paths(args, needles, f, tmp_path):
    locked = _locked_files(f, tmp_path)
    for p in locked:
        p.chmod(0)
    try:
        code, _, err = cli(*_fill(args, f, tmp_path))
    finally:
        for p in locked:
            p.chmod(0o700)
    assert_one_clear_line(code, err, *_fill(needles, f, tmp_path))


@pytest.mark.parametrize("args, needles", UNREADABLE)
def test_unreadable_paths_simulated(args, needles, f, tmp_path, monkeypatch):
    """The same cases where chmod cannot be used (as root): opening or creating the locked paths
    raises PermissionError, as the OS would for another user."""
    import builtins
    import pathlib

    locked = {str(p) for p in _locked_files(f, tmp_path)}

    def denied(path) -> bool:
        path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
        return any(path == p or path.startswith(p + os.sep) for p in locked)

    def guard(real):
        def wrapper(path, *args, **kwargs):
            if denied(path):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real(path, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(builtins, "open", guard(builtins.open))
    monkeypatch.setattr(pathlib.Path, "open", guard(pathlib.Path.open))
    monkeypatch.setattr(os, "mkdir", guard(os.mkdir))
    code, _, err = cli(*_fill(args, f, tmp_path))
    assert_one_clear_line(code, err, *_fill(needles, f, tmp_path))


# -- through a real process: the actual stderr, the exit code, and how fast a bad RPC fails ----------


def run_cwm(*args, cwd=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "cwm", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)
    return proc, time.time() - start


@pytest.mark.parametrize("args, needle", [
    (["tune", TINY, "--trials", "4", "--rpc", "127.0.0.1:1:key", "--work-dir", "{tmp}/t"],
     "127.0.0.1:1 is unreachable"),
    (["train", "--db", "{empty_db}", "--split", "{png}", "--out", "{tmp}/m"], "not a text file"),
    (["dataset", "stats", "--db", "{randdb}"], "none of its"),
])
def test_subprocess_bad_input_is_one_line_and_exit_2(args, needle, f, tmp_path):
    proc, seconds = run_cwm(*_fill(args, f, tmp_path), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr
    if "--rpc" in args:
        assert seconds < 60, f"an unreachable tracker took {seconds:.0f} s to report"
        assert not (tmp_path / "t").exists(), "the work dir was created before the tracker was checked"


# -- the Python API -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, needle", [
    ("", "unknown workload ''"),
    ("   ", "unknown workload ''"),
    (":M=1", "unknown workload ''"),
    ("matmul:M=10**12", "not an integer"),
    ("matmul:M=-1", "M must be >= 1"),
    ("matmul:M=0,N=0", "must be >= 1"),
    ("matmul:M=abc", "not an integer"),
    ("matmul:M=1e3", "not an integer"),
    ("matmul:M=2097152", "too large"),
    ("matmul:M=1048576,N=1048576,K=1048576", "elements"),
    ("matmul,M=1", "unknown workload"),
    ("matmul:K", "KEY=VALUE"),
    ("nosuchnet/task", "unknown network"),
    (None, "written as a string"),
    (128, "written as a string"),
])
def test_resolve_task_bad_specs(spec, needle):
    from cwm.workloads import resolve_task

    with pytest.raises(CwmError, match=None) as info:
        resolve_task(spec)
    assert needle in str(info.value)


def test_resolve_task_never_raises_anything_but_cwm_error():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from cwm.workloads import parse_workload

    pieces = st.sampled_from(["matmul", "softmax", ":", ",", "=", "M", "N", "K", "-", "0", "1", "9", "x", " ",
                              "/", "1e9", "\x00", "é"])

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(pieces, max_size=12).map("".join) | st.text(max_size=20))
    def check(spec):
        try:
            name, overrides = parse_workload(spec)
        except CwmError:
            return
        assert isinstance(name, str) and all(isinstance(v, int) for v in overrides.values())

    check()


@pytest.mark.parametrize("spec, needle", [
    ('{"kind": "llvm", "mcpu": 3}', "'mcpu'"),
    ('{"kind": "nope"}', '"nope"'),
    ("{not json", "target must be"),
    ("", "target must be"),
    ("[1]", "needs a 'kind'"),
    ({"kind": "llvm", "num-cores": -1.5}, "num-cores"),
    ({"mcpu": "x"}, "needs a 'kind'"),
    (3, "needs a 'kind'"),
])
def test_make_target_bad_specs(spec, needle):
    from cwm.hardware import make_target

    with pytest.raises(CwmError) as info:
        make_target(spec)
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name, needle", [
    ("v0", "format version 0"),
    ("v99", "format version 99"),
    ("layout", "another feature layout"),
    ("latent_dim", "latent_dim must be an integer"),
    ("cfg_random", "world_model.json is corrupt"),
    ("cfg_list", "expected a JSON object"),
    ("encoder_weights", "encoder.safetensors"),
    ("transition_weights", "transition.safetensors"),
    ("ranker_model", "ranker.json"),
    ("no_tokenizer", "tokenizer.json"),
])
def test_world_model_load_bad_directories(name, needle, f):
    from cwm.model.world_model import WorldModel

    with pytest.raises(CwmError) as info:
        WorldModel.load(f.models[name])
    assert needle in str(info.value)


def test_world_model_load_wrong_file_types(f):
    from cwm.model.world_model import WorldModel

    for path, needle in ((f.png, "is a file"), (f.randdb, "is missing"), (f.missing, "does not exist")):
        with pytest.raises(CwmError, match=needle):
            WorldModel.load(path)


def test_dataset_loading_bad_inputs(f, tmp_path):
    from cwm.data.dataset import load_dataset
    from cwm.data.split import load_split

    for path, needle in ((f.png, "is a file"), (f.randdb, "none of its"), (f.missing, "does not exist"),
                         (f.dir, "is not a MetaSchedule database")):
        with pytest.raises(CwmError, match=needle):
            load_dataset(path)
    for path, needle in ((f.png, "not a text file"), (f.rand, "not a text file"), (f.notjson, "not valid JSON"),
                         (f.list, "JSON object"), (f.badsplit, "list of task ids"), (f.missing, "does not exist")):
        with pytest.raises(CwmError, match=needle):
            load_split(path)
    # a corrupt task index is named
    db = tmp_path / "db"
    shutil.copytree(f.empty_db, db)
    (db / "tasks.json").write_bytes(f.rand.read_bytes())
    with pytest.raises(CwmError, match="tasks.json is corrupt"):
        load_dataset(db)


def test_tune_api_bad_input(f, tmp_path):
    from cwm.tuning.measure import RPCAddress
    from cwm.tuning.tuner import tune
    from cwm.workloads import get_task

    task = get_task(TINY)
    bad = [
        (dict(tasks=[], trials=4), "no tasks"),
        (dict(tasks=task, trials=0), "positive integer, got 0"),
        (dict(tasks=task, trials=-1), "positive integer, got -1"),
        (dict(tasks=task, trials=2.5), "positive integer, got 2.5"),
        (dict(tasks=task, trials=4, num_trials_per_iter=0), "num_trials_per_iter"),
        (dict(tasks=task, trials=4, population_size=0), "the population size must be a positive integer"),
        (dict(tasks=task, trials=4, population_size=64, strategy="replay-trace"), "needs the evolutionary search"),
        (dict(tasks=task, trials=4, cost_model="nosuch"), "unknown cost model"),
        (dict(tasks=3, trials=4), "Task objects or workload names"),
        (dict(tasks="matmul:M=0", trials=4), "M must be >= 1"),
        (dict(tasks=task, trials=4, model_path=f.models["v0"]), "format version 0"),
        (dict(tasks=task, trials=4, cost_model="random", work_dir=f.png), "is a file"),
    ]
    for kwargs, needle in bad:
        kwargs = {"work_dir": tmp_path / "t", "cost_model": "random", **kwargs}
        if "model_path" in kwargs:
            kwargs["cost_model"] = "cwm"
        with pytest.raises(CwmError) as info:
            tune(progress=False, **kwargs)
        assert needle in str(info.value), (kwargs, str(info.value))
    # An unreachable RPC tracker fails fast and names the tracker.
    start = time.time()
    with pytest.raises(CwmError, match="127.0.0.1:1 is unreachable"):
        tune(task, trials=4, work_dir=tmp_path / "rpc", cost_model="random", progress=False,
             rpc=RPCAddress("127.0.0.1", 1, "key"))
    assert time.time() - start < 30
