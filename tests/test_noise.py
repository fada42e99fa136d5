"""Label noise: a second measuring pass over recorded candidates."""

import json

import numpy as np
import pytest

from cwm.benchmarks.noise import noise_metrics


def test_identical_passes_have_perfect_agreement_and_ceilings():
    first = np.array([1.0, 2.0, 3.0, 4.0, 1.5, 2.5, 3.5]) * 1e-3
    groups = np.array(["a"] * 4 + ["b"] * 3)
    m = noise_metrics(first, first.copy(), groups)
    assert m["spearman_within_tasks"] == pytest.approx(1.0) and m["spearman_pooled"] == pytest.approx(1.0)
    assert m["top1_ceiling"] == 1.0 and m["median_abs_relative_change"] == 0.0


def test_a_second_pass_that_reverses_the_order_lowers_the_ceiling():
    first = np.array([1.0, 2.0, 3.0, 4.0]) * 1e-3
    second = first[::-1].copy()
    m = noise_metrics(first, second, np.array(["a"] * 4))
    assert m["spearman_within_tasks"] == pytest.approx(-1.0)
    assert m["top1_ceiling"] == pytest.approx(0.25)  # it picks the slowest: best 1 ms / picked 4 ms


def test_failed_second_measurements_are_left_out():
    first = np.array([1.0, 2.0, 3.0]) * 1e-3
    second = np.array([1.1, np.nan, 3.1]) * 1e-3
    assert noise_metrics(first, second, np.array(["a"] * 3))["records"] == 2


def test_remeasure_writes_its_report(multi_db, tmp_path):
    from cwm.benchmarks.noise import remeasure

    out = tmp_path / "noise"
    summary = remeasure(multi_db, out, n_records=8, min_per_task=4, progress=False)
    assert summary["records"] + summary["failed_second_pass"] == len(summary["pairs"]) >= 4
    saved = json.loads((out / "noise.json").read_text())
    assert saved["machine"] == summary["machine"] and (out / "noise.png").stat().st_size > 0
    assert "top-1 ceiling" in (out / "noise.md").read_text()


def test_remeasure_needs_records_of_this_machine(multi_db, tmp_path):
    from cwm.errors import CwmError
    from cwm.benchmarks.noise import remeasure

    with pytest.raises(CwmError, match="no task has 100000 valid records"):
        remeasure(multi_db, tmp_path / "n", n_records=8, min_per_task=100000, progress=False)


def test_too_few_records_measured_twice_is_a_clear_error():
    from cwm.errors import CwmError

    with pytest.raises(CwmError, match="only 1 record"):
        noise_metrics(np.array([1e-3, 2e-3]), np.array([1e-3, np.nan]), np.array(["a", "a"]))
