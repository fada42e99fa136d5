"""Property-based: any trace sampled from a design space round-trips through the action JSON."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

WORKLOADS = ["matmul:M=32,N=48,K=16", "dense_relu:M=8,N=24,K=40", "softmax:M=16,N=40",
             "conv2d:N=1,C=4,H=10,W=10,K=8,R=3,stride=1,pad=1", "layernorm:M=8,N=24"]


def _spaces(spec, seed):
    import tvm.s_tir.meta_schedule as ms

    from cwm.hardware import make_target
    from cwm.workloads import get_task

    task = get_task(spec)
    ctx = ms.TuneContext(mod=task.mod, target=make_target(), space_generator="post-order-apply",
                         search_strategy="replay-trace", task_name="p", rand_state=seed)
    return task, ctx.space_generator.generate_design_space(task.mod)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(WORKLOADS), st.integers(min_value=1, max_value=2**30))
def test_sampled_traces_round_trip(spec, seed):
    from tvm_ffi import structural_equal

    from cwm.schedule.actions import actions_from_trace_json, replay, trace_json_from_actions, trace_to_json
    from cwm.data.dataset import Trajectory

    task, spaces = _spaces(spec, seed)
    for sch in spaces:
        trace_json = trace_to_json(sch.trace)
        actions = json.loads(json.dumps(actions_from_trace_json(trace_json)))
        assert trace_json_from_actions(actions) == trace_json
        assert structural_equal(replay(task.mod, actions).mod, sch.mod)
        assert all(isinstance(s, int) for s in Trajectory("t", actions, None).ir_steps)
