"""The world model: state encoder E, transition F, ranker R, and their training."""

from __future__ import annotations

from .encoder import EncoderConfig, StateEncoder
from .ranker import LambdaRanker, RankerConfig, TaskAdapter
from .training import TrainSettings, train
from .transition import Transition, TransitionConfig
from .world_model import WorldModel, WorldModelConfig

__all__ = [
    "EncoderConfig",
    "LambdaRanker",
    "RankerConfig",
    "StateEncoder",
    "TaskAdapter",
    "TrainSettings",
    "Transition",
    "TransitionConfig",
    "WorldModel",
    "WorldModelConfig",
    "train",
]
