"""Measurement on real hardware: a builder that avoids the slow worker start-up, local and RPC runners."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from ..errors import CwmError
from ..hardware import physical_cores
from ..schedule.actions import actions_from_trace_json, replay


def build_without_tensor_intrin(mod, target, _params):
    """Build one candidate.

    MetaSchedule's default build function imports ``tvm.s_tir.tensor_intrin`` in every
    worker, which costs ~20 s here and makes the default LocalBuilder time out on 2 cores.
    CPU and CUDA candidates without tensorization do not need it.
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


# MetaSchedule's LocalBuilder starts new worker processes for every batch (about 3 s here, each
# worker imports TVM) because long-lived workers leak memory. Tuning task by task with small
# budgets means a batch or two per task, so that start-up was half the time of a 2-task, 1-trial
# tune (14.0 s against 7.5 s); the workers here are restarted after this many builds instead.
BUILDS_PER_WORKER_POOL = 256


def make_builder(max_workers: int | None = None, timeout_sec: float = 60.0):
    """A builder whose worker processes serve many batches (``BUILDS_PER_WORKER_POOL`` candidates) and
    build with ``build_without_tensor_intrin``; otherwise it behaves as MetaSchedule's LocalBuilder."""
    import tvm.s_tir.meta_schedule as ms
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder.local_builder import _serialize_params, _worker_func
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    @derived_object
    class PooledBuilder(ms.builder.PyBuilder):
        def __init__(self, max_workers: int, timeout_sec: float):
            self.max_workers, self.timeout_sec = max_workers, timeout_sec
            self.pool, self.built = None, 0

        def _fresh_pool(self):
            if self.pool is not None:
                self.pool.shutdown()
            self.pool = PopenPoolExecutor(max_workers=self.max_workers, timeout=self.timeout_sec)
            self.built = 0

        def build(self, build_inputs):
            if self.pool is None or self.built >= BUILDS_PER_WORKER_POOL:
                self._fresh_pool()
            self.built += len(build_inputs)
            jobs = [(build_without_tensor_intrin, None, b.mod, b.target, _serialize_params(b.params))
                    for b in build_inputs]
            results = []
            for outcome in self.pool.map_with_error_catching(lambda job: _worker_func(*job), jobs):
                if outcome.status == StatusKind.COMPLETE:
                    results.append(ms.builder.BuilderResult(outcome.value, None))
                elif outcome.status == StatusKind.TIMEOUT:
                    results.append(ms.builder.BuilderResult(
                        None, f"LocalBuilder: Timeout, killed after {self.timeout_sec} seconds"))
                else:
                    results.append(ms.builder.BuilderResult(
                        None, "LocalBuilder: An exception occurred\n" + str(outcome.value)))
            return results

    return PooledBuilder(max_workers or physical_cores(), timeout_sec)


@dataclass(frozen=True)
class EvaluatorSettings:
    """How each candidate is timed: ``repeat`` samples, each the mean of ``number`` runs."""

    number: int = 1
    repeat: int = 3
    min_repeat_ms: int = 10
    timeout_sec: float = 30.0

    def config(self):
        import tvm.s_tir.meta_schedule as ms

        return ms.runner.EvaluatorConfig(
            number=self.number,
            repeat=self.repeat,
            min_repeat_ms=self.min_repeat_ms,
            enable_cpu_cache_flush=False,
        )


@dataclass(frozen=True)
class RPCAddress:
    host: str
    port: int
    key: str

    @classmethod
    def parse(cls, spec: str) -> "RPCAddress":
        parts = spec.rsplit(":", 2)
        if len(parts) != 3 or not parts[0] or not parts[2]:
            raise CwmError(f"--rpc must be HOST:PORT:KEY, got {spec!r}")
        try:
            port = int(parts[1])
        except ValueError:
            raise CwmError(f"--rpc port must be an integer, got {parts[1]!r}") from None
        return cls(parts[0], port, parts[2])

    def check_reachable(self, timeout: float = 5.0) -> None:
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout):
                pass
        except OSError as err:
            raise CwmError(f"RPC tracker {self.host}:{self.port} is unreachable: {err}") from None

    def server_count(self) -> int:
        """Servers registered on the tracker under this key (free or busy)."""
        from tvm import rpc

        summary = rpc.connect_tracker(self.host, self.port).summary()
        servers = [s for s in summary.get("server_info", []) if str(s.get("key", "")).split(":")[-1] == self.key]
        return len(servers)


def _zero_integer_tensors(repeated: list) -> list:
    """Integer inputs are indices (an embedding's token ids, a gather's positions): MetaSchedule's
    random ones fall outside the table and crash the runner, so a gather could never be measured.
    Zero is in range of every non-empty table."""
    import numpy as np

    for args in repeated:
        for arg in args:
            if str(arg.dtype).startswith(("int", "uint")):
                arg.copyfrom(np.zeros([int(d) for d in arg.shape], dtype=str(arg.dtype)))
    return repeated


def alloc_arguments(device, args_info, alloc_repeat: int) -> list:
    """The LocalRunner's arguments: MetaSchedule's random ones, integer tensors all zeros."""
    from tvm.s_tir.meta_schedule.runner.local_runner import default_alloc_argument

    return _zero_integer_tensors(default_alloc_argument(device, args_info, alloc_repeat))


def alloc_rpc_arguments(session, device, args_info, alloc_repeat: int) -> list:
    """The RPCRunner's arguments, on the remote device: as ``alloc_arguments``."""
    from tvm.s_tir.meta_schedule.runner.rpc_runner import default_alloc_argument

    return _zero_integer_tensors(default_alloc_argument(session, device, args_info, alloc_repeat))


def make_runner(settings: EvaluatorSettings | None = None, rpc: RPCAddress | None = None,
                max_workers: int | None = None):
    """A LocalRunner, or an RPCRunner through a tracker when ``rpc`` is given.

    Through RPC, a batch is measured on all servers of the key in parallel (one candidate per
    server at a time) unless ``max_workers`` says otherwise.
    """
    import tvm.s_tir.meta_schedule as ms

    settings = settings or EvaluatorSettings()
    if rpc is None:
        return ms.runner.LocalRunner(timeout_sec=settings.timeout_sec, evaluator_config=settings.config(),
                                     f_alloc_argument=alloc_arguments)
    rpc.check_reachable()
    if max_workers is None:
        max_workers = rpc.server_count()
        if max_workers == 0:
            raise CwmError(f"no RPC server is registered on tracker {rpc.host}:{rpc.port} with key {rpc.key!r}")
    return ms.runner.RPCRunner(
        rpc_config=ms.runner.RPCConfig(
            tracker_host=rpc.host,
            tracker_port=rpc.port,
            tracker_key=rpc.key,
            session_timeout_sec=max(60, int(settings.timeout_sec * 2)),
        ),
        evaluator_config=settings.config(),
        f_alloc_argument=alloc_rpc_arguments,
        max_workers=max_workers,
    )


def error_kind(builder_error: str | None, runner_error: str | None) -> str | None:
    """Classify a failed candidate: build/run, timeout or error."""
    if builder_error:
        return "build_timeout" if "Timeout" in builder_error else "build_error"
    if runner_error:
        return "run_timeout" if "Timeout" in runner_error or "timeout" in runner_error else "run_error"
    return None


def random_arguments(mod, device) -> list:
    """Random input/output tensors for the built "main" of ``mod``: a weight whose layout a
    schedule rewrites is passed in the rewritten layout (the rewrite block is not built).
    Integer tensors are zeros (``rand`` truncates), so gather indices stay in range."""
    import numpy as np
    import tvm
    import tvm.s_tir.meta_schedule as ms

    args = []
    for info in ms.arg_info.ArgInfo.from_entry_func(mod, remove_preproc=True):
        shape = [int(x) for x in info.shape]
        args.append(tvm.runtime.tensor(np.random.rand(*shape).astype(str(info.dtype)), device=device))
    return args


def compile_schedule(task, trace_json, target):
    """Build the schedule a trace gives on a task's module; returns (runtime module, arguments)."""
    import tvm

    sch = replay(task.mod, actions_from_trace_json(trace_json))
    lib = build_without_tensor_intrin(sch.mod, target, None)
    return lib, random_arguments(sch.mod, tvm.device("cuda" if target.kind.name == "cuda" else "cpu", 0))
