import numpy as np

from cwm.features.loop_nest import SCHEDULE_FEATURE_NAMES, schedule_features

# A CPU matmul trace (128x128x256) as MetaSchedule writes it, post-processing included.
TRACE = [
    {"kind": "GetSBlock", "inputs": [], "attrs": ["C", "main"], "outputs": ["b0"], "decision": None},
    {"kind": "GetSBlock", "inputs": [], "attrs": ["root", "main"], "outputs": ["b1"], "decision": None},
    {"kind": "Annotate", "inputs": ["b0", '"SSRSRS"'], "attrs": ["meta_schedule.tiling_structure"], "outputs": [], "decision": None},
    {"kind": "GetLoops", "inputs": ["b0"], "attrs": [], "outputs": ["l2", "l3", "l4"], "decision": None},
    {"kind": "SamplePerfectTile", "inputs": ["l2"], "attrs": [4, 64], "outputs": ["v5", "v6", "v7", "v8"], "decision": [4, 4, 4, 2]},
    {"kind": "Split", "inputs": ["l2", "v5", "v6", "v7", "v8"], "attrs": [1, 0], "outputs": ["l9", "l10", "l11", "l12"], "decision": None},
    {"kind": "SamplePerfectTile", "inputs": ["l3"], "attrs": [4, 64], "outputs": ["v13", "v14", "v15", "v16"], "decision": [2, 2, 1, 32]},
    {"kind": "Split", "inputs": ["l3", "v13", "v14", "v15", "v16"], "attrs": [1, 0], "outputs": ["l17", "l18", "l19", "l20"], "decision": None},
    {"kind": "SamplePerfectTile", "inputs": ["l4"], "attrs": [2, 64], "outputs": ["v21", "v22"], "decision": [16, 16]},
    {"kind": "Split", "inputs": ["l4", "v21", "v22"], "attrs": [1, 0], "outputs": ["l23", "l24"], "decision": None},
    {"kind": "Reorder", "inputs": ["l9", "l17", "l10", "l18", "l23", "l11", "l19", "l24", "l12", "l20"], "attrs": [], "outputs": [], "decision": None},
    {"kind": "CacheWrite", "inputs": ["b0", []], "attrs": [0, "global"], "outputs": ["b25"], "decision": None},
    {"kind": "ReverseComputeAt", "inputs": ["b25", "l18"], "attrs": [1, -1], "outputs": [], "decision": None},
    {"kind": "SampleCategorical", "inputs": [], "attrs": [[0, 16, 64, 512], [0.25, 0.25, 0.25, 0.25]], "outputs": ["v26"], "decision": 3},
    {"kind": "EnterPostproc", "inputs": [], "attrs": [], "outputs": [], "decision": None},
    {"kind": "GetChildBlocks", "inputs": ["b1"], "attrs": [], "outputs": ["b28", "b29"], "decision": None},
    {"kind": "GetLoops", "inputs": ["b28"], "attrs": [], "outputs": [f"l{i}" for i in range(30, 40)], "decision": None},
    {"kind": "Fuse", "inputs": ["l30", "l31", "l32", "l33"], "attrs": [1], "outputs": ["l40"], "decision": None},
    {"kind": "Parallel", "inputs": ["l40"], "attrs": [], "outputs": [], "decision": None},
    {"kind": "Fuse", "inputs": ["l39"], "attrs": [1], "outputs": ["l41"], "decision": None},
    {"kind": "Vectorize", "inputs": ["l41"], "attrs": [], "outputs": [], "decision": None},
    {"kind": "Annotate", "inputs": ["l40", 512], "attrs": ["pragma_auto_unroll_max_step"], "outputs": [], "decision": None},
    {"kind": "Annotate", "inputs": ["l40", 1], "attrs": ["pragma_unroll_explicit"], "outputs": [], "decision": None},
]


def test_loop_nest_quantities_follow_from_the_actions():
    f = dict(zip(SCHEDULE_FEATURE_NAMES, schedule_features(TRACE, cores=2, simd_lanes=16)))
    assert len(f) == len(SCHEDULE_FEATURE_NAMES)
    assert f["spatial_level0_log2"] == 3.0  # 4 * 2
    assert f["spatial_level3_log2"] == 6.0  # 2 * 32
    assert f["reduce_level0_log2"] == 4.0 and f["reduce_level1_log2"] == 4.0
    assert f["spatial_total_log2"] == 14.0 and f["reduce_total_log2"] == 8.0
    # Fused l9 l17 l10 l18 = 4 * 2 * 4 * 2 = 64 parallel iterations; l20 (32) vectorized.
    assert f["parallel_extent_log2"] == 6.0 and f["parallel_per_core"] == 32.0
    assert f["vector_extent_log2"] == 5.0 and f["vector_lanes_fraction"] == 2.0
    assert f["unroll_max_step_log2"] == np.float32(np.log2(513))
    assert f["write_back_level"] == 1.0  # at the second split level of j


def test_robust_to_odd_input():
    odd = [None, {"kind": "Split"}, {"kind": "Fuse", "inputs": "x"}, {"kind": "Nope", "inputs": [[1, 2]]},
           {"kind": "SamplePerfectTile", "inputs": ["l1"], "decision": ["a", None]}]
    out = schedule_features(odd)
    assert out.shape == (len(SCHEDULE_FEATURE_NAMES),) and np.isfinite(out).all()
    assert schedule_features([]).shape == (len(SCHEDULE_FEATURE_NAMES),)
