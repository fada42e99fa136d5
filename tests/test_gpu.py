"""The CUDA target without a GPU: design spaces, candidates, trajectories and scoring.

Measuring needs a GPU; ``test_cuda_tune_on_a_gpu`` runs only where one is visible.
"""

import json

import numpy as np
import pytest

from cwm.hardware import cuda_target_json, hardware_for_target, make_target


@pytest.fixture(scope="module")
def cuda_candidates():
    """Design-space samples of a small matmul for CUDA, as MetaSchedule candidates."""
    import tvm.s_tir.meta_schedule as ms

    from cwm.workloads import get_task

    task = get_task("matmul:M=64,N=64,K=64")
    target = make_target(json.dumps(cuda_target_json()))
    ctx = ms.TuneContext(mod=task.mod, target=target, space_generator="post-order-apply",
                         search_strategy="replay-trace", task_name=task.name, rand_state=0, num_threads=1)
    spaces = ctx.space_generator.generate_design_space(task.mod)
    args = ms.arg_info.ArgInfo.from_prim_func(task.mod["main"])
    cands = []
    for seed in range(12):
        # Replaying a design space's trace without its decisions draws new ones.
        sch = _resample(task.mod, spaces[seed % len(spaces)].trace, seed)
        cands.append(ms.MeasureCandidate(sch, args))
    return task, ctx, cands


def _resample(mod, trace, seed):
    from tvm import s_tir

    sch = s_tir.Schedule(mod, seed=seed + 1, debug_mask="none")
    s_tir.Trace(trace.insts, {}).apply_to_schedule(sch, remove_postproc=True)
    return sch


def test_cuda_design_space_binds_threads(cuda_candidates):
    from cwm.schedule.actions import actions_from_trace_json, trace_to_json

    _, _, cands = cuda_candidates
    kinds = set()
    for c in cands:
        kinds |= {a["kind"] for a in actions_from_trace_json(trace_to_json(c.sch.trace))}
    assert "Bind" in kinds  # GPU schedules bind loops to blockIdx/threadIdx
    assert len({str(c.sch.trace) for c in cands}) > 1  # distinct samples


def test_cuda_trajectories_round_trip(cuda_candidates):
    import tvm
    from tvm_ffi import structural_equal

    from cwm.schedule.actions import actions_from_trace_json, replay, trace_to_json

    task, _, cands = cuda_candidates
    for c in cands[:4]:
        actions = json.loads(json.dumps(actions_from_trace_json(trace_to_json(c.sch.trace))))
        assert structural_equal(replay(task.mod, actions).mod, c.sch.mod)
    assert isinstance(cands[0].sch.mod, tvm.IRModule)


def test_cuda_hardware_features_without_a_gpu():
    target = make_target(json.dumps(cuda_target_json(max_shared_memory_per_block=49152)))
    hw = hardware_for_target(target)
    assert hw.kind == "cuda"
    assert hw.shared_mem_kb == 48 or hw.sm_count > 0  # from the target, or from a real device
    assert hw.as_json()["kind"] == "cuda"


def test_cwm_scores_cuda_candidates(cuda_candidates, tiny_model):
    from cwm.tuning.cost_model import WorldModelCostModel, runner_results
    from cwm.model.world_model import WorldModel

    _, ctx, cands = cuda_candidates
    cm = WorldModelCostModel(WorldModel.load(tiny_model), min_update=4)
    scores = cm.predict(ctx, cands)
    assert scores.shape == (len(cands),) and np.all(np.isfinite(scores)) and np.all(scores > 0)
    assert cm.hardware["kind"] == "cuda"
    cm.update(ctx, cands, runner_results(np.linspace(1e-4, 1e-3, len(cands))))
    assert np.all(np.isfinite(cm.predict(ctx, cands)))


def test_xgb_scores_cuda_candidates(cuda_candidates):
    import tvm.s_tir.meta_schedule as ms

    from cwm.tuning.cost_model import runner_results

    _, ctx, cands = cuda_candidates
    model = ms.cost_model.XGBModel(num_warmup_samples=0)
    model.update(ctx, cands, runner_results(np.linspace(1e-4, 1e-3, len(cands))))
    scores = model.predict(ctx, cands)
    assert scores.shape == (len(cands),) and np.all(np.isfinite(scores))


def _has_gpu() -> bool:
    import tvm

    try:
        return bool(tvm.cuda(0).exist)
    except Exception:
        return False


@pytest.mark.skipif(not _has_gpu(), reason="measuring CUDA candidates needs a GPU")
@pytest.mark.parametrize("cost_model", ["cwm", "xgb"])
def test_cuda_tune_on_a_gpu(cost_model, tmp_path):
    from cwm.tuning.tuner import tune
    from cwm.workloads import get_task

    task = get_task("matmul:M=64,N=64,K=64")
    result = tune(task, trials=8, work_dir=tmp_path, cost_model=cost_model, target="cuda",
                  num_trials_per_iter=8, progress=False)
    assert result.best[task.id]["latency"] > 0
