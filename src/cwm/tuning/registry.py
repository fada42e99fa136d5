"""Cost models by name: one registry for ``cwm tune``, the benchmarks and the CLI's help text.

Like MetaSchedule's ``CostModel.create(kind)``: each kind is a factory registered under its name.
Factories import TVM and the world model themselves, so listing the names stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import CwmError


@dataclass(frozen=True)
class CostModelKind:
    name: str
    description: str
    factory: Callable  # (model_path, seed, finetune_transition) -> a MetaSchedule cost model


_REGISTRY: dict[str, CostModelKind] = {}


def register_cost_model(name: str, description: str):
    """Register ``factory(model_path, seed, finetune_transition)`` under ``name``."""

    def wrap(factory):
        if name in _REGISTRY:
            raise ValueError(f"cost model {name!r} is registered twice")
        _REGISTRY[name] = CostModelKind(name, description, factory)
        return factory

    return wrap


def cost_model_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def cost_model_help() -> str:
    """One line per kind, for a CLI option's help."""
    return "; ".join(f"{k.name}: {k.description}" for k in _REGISTRY.values())


def check_cost_model(kind: str) -> None:
    if kind not in _REGISTRY:
        raise CwmError(f"unknown cost model {kind!r}; choose one of {', '.join(_REGISTRY)}")


def create_cost_model(kind: str, model_path=None, seed: int = 0, finetune_transition: bool = False):
    """A timed cost model by name; ``model_path`` is the world model directory for ``cwm`` and
    ``cwm-zscore`` and the saved XGBModel file for ``xgb-pretrained``. ``finetune_transition`` (``cwm`` only) also
    fine-tunes the transition online on each task's measured candidates."""
    check_cost_model(kind)
    if finetune_transition and kind != "cwm":
        raise CwmError(f"only the cwm cost model has a transition to fine-tune, not {kind!r}")
    from .cost_model import TimedCostModel

    return TimedCostModel(_REGISTRY[kind].factory(model_path, seed, finetune_transition))


def world_model_cost_model(model=None, **kwargs):
    """A ``cwm.tuning.cost_model.WorldModelCostModel`` (a MetaSchedule cost model) on ``model``: a
    ``WorldModel``, a shipped model's name or a model directory; by default the shipped model picked
    for this host (``WorldModel.from_pretrained``). ``kwargs`` go to ``WorldModelCostModel``.
    ``cwm.WorldModelCostModel()`` is this function: ``ms.tune_tir(..., cost_model=cwm.WorldModelCostModel())``."""
    from ..model.world_model import WorldModel
    from .cost_model import WorldModelCostModel

    if not isinstance(model, WorldModel):
        model = WorldModel.from_pretrained(model)
    return WorldModelCostModel(model, **kwargs)


@register_cost_model("cwm", "the world model (default: the shipped model picked for this host)")
def _world_model(model_path, seed, finetune_transition):
    return world_model_cost_model(model_path, seed=seed, finetune_transition=finetune_transition)


def _xgb(seed):
    import tvm.s_tir.meta_schedule as ms
    from tvm.s_tir.meta_schedule.cost_model.xgb_model import XGBConfig

    return ms.cost_model.XGBModel(config=XGBConfig(seed=seed))


@register_cost_model("xgb", "MetaSchedule's XGBoost model, starting untrained")
def _cold_xgb(model_path, seed, finetune_transition):
    return _xgb(seed)


@register_cost_model("xgb-pretrained", "MetaSchedule's XGBoost model loaded from a saved XGBModel file")
def _pretrained_xgb(model_path, seed, finetune_transition):
    if model_path is None or not Path(model_path).is_file():
        raise CwmError(f"xgb-pretrained needs a saved XGBModel file, got {model_path}")
    model = _xgb(seed)
    try:
        model.load(str(model_path))
    except Exception as err:  # XGBModel.load untars the file and raises RuntimeError or TVM errors
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        raise CwmError(f"{model_path} is not a saved XGBModel: {' '.join(lines[:2])}") from None
    return model


@register_cost_model("random", "random scores (MetaSchedule's RandomModel)")
def _random(model_path, seed, finetune_transition):
    import tvm.s_tir.meta_schedule as ms

    return ms.cost_model.RandomModel(seed=seed)


@register_cost_model("cwm-zscore", "cwm with the per-call z-score transform of earlier releases, for the A/B")
def _world_model_zscore(model_path, seed, finetune_transition):
    return world_model_cost_model(model_path, seed=seed, finetune_transition=finetune_transition,
                                  score_transform="zscore")


@register_cost_model("cwm-boost-copy", "cwm with the online update of earlier releases (more trees on a copy of the "
                     "pretrained ranker), for the A/B")
def _world_model_boost_copy(model_path, seed, finetune_transition):
    return world_model_cost_model(model_path, seed=seed, finetune_transition=finetune_transition,
                                  adaptation="boost-copy")
