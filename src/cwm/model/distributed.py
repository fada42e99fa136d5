"""Data-parallel training helpers over ``torch.distributed`` (gloo on CPU).

Under ``torchrun --nproc_per_node N`` every process runs the same training script;
:func:`process_group` joins them into one gloo process group (from the ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` variables torchrun sets). The encoder and
transition ``fit`` methods then wrap their module in ``DistributedDataParallel`` and take
this rank's share of each epoch's mini-batches (:func:`shard`), so gradients are averaged
over all ranks at every step. Without a process group (a plain ``python`` run, or
``WORLD_SIZE`` 1) every helper here is a no-op and training is single-process as before.

``torch`` is imported lazily so that ``import cwm.model.distributed`` stays cheap.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "all_reduce_sum",
    "any_rank",
    "barrier",
    "broadcast_object",
    "cleanup",
    "ddp",
    "env_world_size",
    "init",
    "is_distributed",
    "is_main",
    "process_group",
    "rank",
    "shard",
    "world_size",
]


def _dist():
    import torch.distributed as dist

    return dist


def env_world_size() -> int:
    """``WORLD_SIZE`` from the environment (set by torchrun), 1 when unset or invalid."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def is_distributed() -> bool:
    """True inside an initialized process group of more than one rank."""
    try:
        dist = _dist()
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the process group (0 outside one)."""
    return _dist().get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks in the process group (1 outside one)."""
    return _dist().get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """True on rank 0, and always outside a process group: the rank that writes outputs."""
    return rank() == 0


def init(backend: str = "gloo", timeout_s: float = 3600.0) -> bool:
    """Join the process group torchrun describes; returns True if this call created it.

    Does nothing (returns False) when ``WORLD_SIZE`` is 1 or unset, when torch.distributed is
    unavailable, or when a process group already exists.
    """
    dist = _dist()
    if env_world_size() <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def cleanup() -> None:
    """Destroy the process group if one exists."""
    dist = _dist()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def process_group(backend: str = "gloo") -> Iterator[bool]:
    """Join torchrun's process group for the block (yields whether distributed) and leave it
    afterwards if this block created it; a no-op in a single process."""
    created = init(backend)
    try:
        yield is_distributed()
    finally:
        if created:
            cleanup()


def barrier() -> None:
    """Wait for every rank; a no-op outside a process group."""
    if is_distributed():
        _dist().barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (picklable objects); ``obj`` itself outside one."""
    if not is_distributed():
        return obj
    box = [obj]
    _dist().broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(values: Sequence[float]) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64); a copy outside a process group."""
    if not is_distributed():
        return [float(v) for v in values]
    import torch

    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    _dist().all_reduce(t, op=_dist().ReduceOp.SUM)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (e.g. a time limit reached)."""
    if not is_distributed():
        return bool(flag)
    return all_reduce_sum([1.0 if flag else 0.0])[0] > 0


def time_up(start: float, max_seconds: float | None) -> bool:
    """Whether ``max_seconds`` have passed since ``start`` (``time.monotonic()``), agreed by all
    ranks so that they stop at the same step."""
    import time

    if max_seconds is None:
        return False
    return any_rank(time.monotonic() - start > max_seconds)


def shard(items: Sequence[T], rank_: int | None = None, world: int | None = None) -> list[tuple[T, float]]:
    """This rank's share of one epoch's ``items`` (mini-batches) as ``(item, loss weight)`` steps.

    Rank ``r`` of ``W`` takes items ``r, r + W, r + 2W, ...``, so the ranks together use every
    item exactly once. Every rank gets the same number of steps, ``ceil(n / W)``, so their
    gradient all-reduces pair up: when the last round has only ``k < W`` items, the ranks
    without one repeat ``items[0]`` with weight 0 (no gradient) and the ``k`` real items get
    weight ``W / k``. DistributedDataParallel averages gradients over ``W`` ranks, so each
    step's gradient is then the mean over its real items. Weights are 1 everywhere else.
    """
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is not in [0, {w})")
    n = len(items)
    steps: list[tuple[T, float]] = []
    for start in range(0, n, w):
        k = min(w, n - start)
        if r < k:
            steps.append((items[start + r], 1.0 if k == w else w / k))
        else:
            steps.append((items[0], 0.0))
    return steps


_WRAPPER_CLASS: Any = None


def ddp(fn: Callable[..., Any], *modules: Any) -> Any:
    """``DistributedDataParallel`` over ``modules`` whose forward is ``fn(*args, **kwargs)``.

    For models trained through a method other than ``forward`` (several modules, or a
    ``rollout``): calling the returned wrapper runs ``fn`` with DDP's gradient hooks armed,
    so ``backward`` all-reduces the gradients of every parameter of ``modules``. Rank 0's
    parameters are broadcast to all ranks when the wrapper is built.
    """
    global _WRAPPER_CLASS
    import torch

    if _WRAPPER_CLASS is None:

        class _Forward(torch.nn.Module):
            def __init__(self, fn, modules):
                super().__init__()
                self.fn = fn
                self.parts = torch.nn.ModuleList(modules)

            def forward(self, *args, **kwargs):
                return self.fn(*args, **kwargs)

        _WRAPPER_CLASS = _Forward
    return torch.nn.parallel.DistributedDataParallel(_WRAPPER_CLASS(fn, modules))
