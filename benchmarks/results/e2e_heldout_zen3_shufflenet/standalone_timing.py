"""Each library of the run timed alone (200 calls back to back after 5 warm-up calls), in turn, twice.

Usage (from a worktree of the run, PYTHONPATH=src): python standalone_timing.py LIB_DIR OUT_JSON
"""
import sys, json
import cwm  # noqa: F401  (sets TVM threads)
import numpy as np
from cwm.benchmarks.timing import time_interleaved, tvm_runner, ort_runner
from cwm.frontend.onnx_model import ort_session
from cwm.workloads.networks import _vision
lib = sys.argv[1]
model, inputs = _vision("shufflenet_v2_x1_0")()
np_in = [x.numpy() for x in inputs]
c = {}
for s in (0, 1, 2):
    for cm in ("cwm", "xgb-pretrained"):
        c[f"{cm}_s{s}"] = tvm_runner(f"{lib}/{cm}_s{s}.so", np_in)
c["onnxruntime"] = ort_runner(ort_session(f"{lib}/model.onnx", 2), np_in)
out = {}
for rep in range(2):
    t, err = time_interleaved(c, runs=200, warmup=5, block=200, threads=2)
    out[rep] = {k: v.as_json() for k, v in t.items()}
    print(rep, {k: round(v.median_s * 1e3, 3) for k, v in t.items()}, flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
