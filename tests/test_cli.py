"""The CLI: thin commands, one-line errors with a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import pytest


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "cwm", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "args, message",
    [
        (["workloads", "list", "--network", "nosuchnet"], "unknown network"),
        (["collect", "nosuchop", "--db", "/tmp/cwm-never"], "unknown workload"),
        (["collect", "matmul:M=1x", "--db", "/tmp/cwm-never"], "malformed shape"),
        (["dataset", "stats", "--db", "/nonexistent/db"], "does not exist"),
        (["tune", "matmul", "--trials", "0"], "must be positive"),
        (["tune", "matmul", "--rpc", "127.0.0.1:1:key"], "unreachable"),
        (["tune", "matmul", "--target", '{"kind": "nosuch"}'], "invalid target"),
    ],
)
def test_bad_input_is_one_clear_line(args, message):
    proc = run_cli(*args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


def test_tune_on_a_tvmscript_file_that_does_not_parse(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("this is not TVMScript(")
    proc = run_cli("tune", "--tir", str(bad), "--trials", "4")
    assert proc.returncode == 2 and "does not parse" in proc.stderr


def test_workloads_list():
    from typer.testing import CliRunner

    from cwm.cli import app

    result = CliRunner().invoke(app, ["workloads", "list", "--json"])
    assert result.exit_code == 0
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["kind"] for r in rows} >= {"matmul", "conv2d", "softmax"}


def test_dataset_stats_cli(tiny_db, tmp_path):
    from typer.testing import CliRunner

    from cwm.cli import app

    png = tmp_path / "stats.png"
    result = CliRunner().invoke(app, ["dataset", "stats", "--db", str(tiny_db), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "action kinds" in result.stdout and "SamplePerfectTile" in result.stdout
    assert png.stat().st_size > 1000
    result = CliRunner().invoke(app, ["dataset", "stats", "--db", str(tiny_db), "--json"])
    assert json.loads(result.stdout)["records"] == 16


def test_dataset_merge_cli(tiny_db, tmp_path):
    from typer.testing import CliRunner

    from cwm.cli import app
    from cwm.data.database import load_raw

    merged = tmp_path / "merged"
    result = CliRunner().invoke(app, ["dataset", "merge", str(tiny_db), str(tiny_db), "--db", str(merged)])
    assert result.exit_code == 0, result.output
    assert "16 records added to" in result.stdout  # the second copy adds nothing
    assert len(load_raw(merged).records) == 16
    result = CliRunner().invoke(app, ["dataset", "merge", str(tmp_path / "nothing"), "--db", str(merged)])
    assert result.exit_code == 2 and "not a MetaSchedule JSON database" in result.output
