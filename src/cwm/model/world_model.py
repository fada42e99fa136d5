"""The world model: encoder E, transition F and ranker R behind one predict call.

A candidate is scored from its task's initial TensorIR (encoded once per task, cached) and its
action sequence (rolled out in latent space), never from its materialized final code.

The ``latent`` setting chooses what stands for the terminal state in the ranker's features:
``rollout`` (the world model), or the ablations ``final`` (E of the real final state, the
static snapshot) and ``initial`` (E of the initial state only). All variants also get the
structured action features and the hardware features, so they differ only in the latent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from ..errors import CwmError
from ..features.action_features import STRUCT_NAMES, structured_features_batch
from ..features.loop_nest import SCHEDULE_FEATURE_NAMES, schedule_features
from ..hardware import HARDWARE_FEATURE_NAMES
from ..io import atomic_directory, atomic_write_text

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CONFIG_FILE = "world_model.json"
TRAIN_SPLIT_FILE = "train_split.json"  # beside the model: the split it was trained on
LATENTS = ("rollout", "final", "initial", "none")


def feature_names(latent_dim: int, latent: str, perf_score: bool = False) -> list[str]:
    """The ranker's columns: the latent (none for ``none``), F's score head on it (``perf_score``, only
    for ``rollout``), then the action, loop-nest and hardware features."""
    z = [] if latent == "none" else [f"z{i}" for i in range(latent_dim)]
    if perf_score and latent == "rollout":
        z.append("perf")
    return (z + [f"act:{n}" for n in STRUCT_NAMES] + [f"sched:{n}" for n in SCHEDULE_FEATURE_NAMES]
            + [f"hw:{n}" for n in HARDWARE_FEATURE_NAMES])


def candidate_columns(names: list[str]) -> list[int]:
    """The columns that describe a candidate's schedule itself: F's score head and the action and
    loop-nest features, not the latent or the machine (what a task's online correction splits on)."""
    return [i for i, n in enumerate(names) if n == "perf" or n.startswith(("act:", "sched:"))]


def layout_id(names: list[str]) -> str:
    return hashlib.sha1("\n".join(names).encode()).hexdigest()[:12]


def shipped_models() -> dict[str, Path]:
    """The world models shipped inside the package, by directory name: one, ``default``, trained on the
    records of several machines with each record's hardware features (docs/data.md, "The shipped models")."""
    root = Path(str(resources.files("cwm") / "pretrained"))
    return {p.name: p for p in sorted(root.iterdir()) if (p / CONFIG_FILE).is_file()}


SHIPPED_MODEL = "default"


def default_model_dir() -> Path:
    """The shipped model, for every machine: its ranker sees the hardware features of the machine a
    candidate is scored for, and ``cwm tune`` warns on a machine unlike every one its records came from
    (``cwm.hardware.machine_difference``)."""
    models = shipped_models()
    if SHIPPED_MODEL not in models:
        raise CwmError(f"the package ships no world model {SHIPPED_MODEL!r} (found: {', '.join(models) or 'none'}); "
                       "reinstall cwm or pass a model directory")
    return models[SHIPPED_MODEL]


def training_tasks(directory: str | Path) -> set[str] | None:
    """Ids of the tasks a model directory was trained or validated on (its ``train_split.json``), or
    None when the model does not say."""
    path = Path(directory) / TRAIN_SPLIT_FILE
    if not path.is_file():
        return None
    try:
        split = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CwmError(f"{path} is corrupt: {err}") from None
    return set(split.get("train", [])) | set(split.get("val", []))


def check_output_dir(directory: str | Path) -> None:
    """CwmError unless ``directory`` can become a model directory: absent, empty or a model already
    (saving replaces it as a whole, so anything else in it would be lost)."""
    directory = Path(directory)
    if not directory.exists():
        return
    if not directory.is_dir():
        raise CwmError(f"model output path {directory} is a file, not a directory")
    if (directory / CONFIG_FILE).exists() or not any(directory.iterdir()):
        return
    raise CwmError(f"{directory} is not empty and holds no world model ({CONFIG_FILE}); "
                   "choose a new or empty output directory")


@dataclass
class WorldModelConfig:
    latent: str = "rollout"
    hardware: dict = field(default_factory=dict)  # the machine the training data came from
    trained_on: dict = field(default_factory=dict)  # dataset summary, for the record
    metrics: dict = field(default_factory=dict)

    @property
    def machines(self) -> list[str]:
        """The LLVM CPUs its training records came from (one for a single-machine model)."""
        names = (self.trained_on or {}).get("machines") or [(self.hardware or {}).get("mcpu")]
        return [str(m) for m in names if m]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WorldModelConfig":
        """The config from ``to_dict``'s output; unknown keys are an error, missing ones keep their defaults."""
        if not isinstance(data, dict):
            raise CwmError(f"a world model config is a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CwmError(f"unknown world model config key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**data)


class WorldModel:
    """E + F + R. ``predict(initial_text, actions_list)`` returns scores, higher is faster."""

    def __init__(self, encoder, transition, ranker, config: WorldModelConfig | None = None):
        self.encoder = encoder
        self.transition = transition
        self.ranker = ranker
        self.config = config or WorldModelConfig()
        if self.config.latent not in LATENTS:
            raise CwmError(f"unknown latent {self.config.latent!r}; choose one of {LATENTS}")
        self._z0_cache: dict[str, np.ndarray] = {}

    # -- features -------------------------------------------------------------------------
    @property
    def latent_dim(self) -> int:
        return self.encoder.dim

    @property
    def perf_score(self) -> bool:
        """Whether the ranker sees F's score head (a rolled-out model whose F has one)."""
        return (self.config.latent == "rollout" and self.transition is not None
                and getattr(self.transition, "has_score_head", False))

    @property
    def feature_names(self) -> list[str]:
        return feature_names(self.latent_dim, self.config.latent, self.perf_score)

    def initial_latent(self, initial_text: str) -> np.ndarray:
        """E(s0), computed once per distinct initial state."""
        key = hashlib.sha1(initial_text.encode()).hexdigest()
        if key not in self._z0_cache:
            self._z0_cache[key] = self.encoder.encode([initial_text])[0]
        return self._z0_cache[key]

    def hardware_vector(self, hardware: dict | None) -> np.ndarray:
        hw = dict(hardware or self.config.hardware)
        hw.setdefault("is_gpu", 1 if hw.get("kind") == "cuda" else 0)
        return np.array([float(hw.get(n, 0) or 0) for n in HARDWARE_FEATURE_NAMES], dtype=np.float32)

    def features(self, initial_text: str, actions_list: list[list[dict]], hardware: dict | None = None,
                 final_latents: np.ndarray | None = None) -> np.ndarray:
        """Ranker features of candidates that share one initial state."""
        n = len(actions_list)
        parts = []
        latent = self.config.latent
        if latent == "rollout":
            z0 = np.repeat(self.initial_latent(initial_text)[None, :], n, axis=0)
            z_T = self.transition.predict(z0, actions_list).astype(np.float32)
            parts.append(z_T)
            if self.perf_score:
                parts.append(self.transition.scores(z0, z_T)[:, None])
        elif latent == "initial":
            parts.append(np.repeat(self.initial_latent(initial_text)[None, :], n, axis=0))
        elif latent == "final":
            if final_latents is None:
                raise CwmError("the final-state ablation needs the encoded final states")
            parts.append(np.asarray(final_latents, dtype=np.float32))
        parts.append(structured_features_batch(actions_list).astype(np.float32)
                     if n else np.zeros((0, len(self.feature_names)), np.float32))
        hw = self.hardware_vector(hardware)
        cores, lanes = int(hw[0]) or 1, max(1, int(hw[1]) // 32)  # cores, fp32 SIMD lanes
        parts.append(np.stack([schedule_features(a, cores, lanes) for a in actions_list]))
        parts.append(np.repeat(hw[None, :], n, axis=0))
        return np.concatenate(parts, axis=1)

    def predict(self, initial_text: str, actions_list: list[list[dict]], hardware: dict | None = None,
                final_latents: np.ndarray | None = None) -> np.ndarray:
        if not actions_list:
            return np.zeros(0, dtype=np.float32)
        return self.ranker.predict(self.features(initial_text, actions_list, hardware, final_latents))

    def with_transition(self, transition) -> "WorldModel":
        """The same E and R with another transition F (e.g. fine-tuned on one task); E(s0) stays cached
        for both, since it does not depend on F."""
        other = WorldModel(self.encoder, transition, self.ranker, self.config)
        other._z0_cache = self._z0_cache
        return other

    # -- persistence ----------------------------------------------------------------------
    def save(self, directory: str | Path, extra_files: dict[str, str | bytes] | None = None) -> Path:
        """Write the model directory atomically: a reader (or a run killed meanwhile) sees no
        directory, the complete old one or the complete new one. ``extra_files`` (name -> text or bytes)
        are written into it too (e.g. the training report)."""
        final = Path(directory)
        check_output_dir(final)
        with atomic_directory(final) as directory:
            self._save_into(directory)
            for name, content in (extra_files or {}).items():
                path = directory / name
                path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        return final

    def _save_into(self, directory: Path) -> None:
        self.encoder.save(directory / "encoder")
        if self.transition is not None:
            self.transition.save(directory / "transition")
        self.ranker.save(directory / "ranker")
        names = self.feature_names
        meta = {
            "format_version": FORMAT_VERSION,
            "latent": self.config.latent,
            "latent_dim": self.latent_dim,
            "perf_score": self.perf_score,
            "feature_layout": layout_id(names),
            "n_features": len(names),
            **{k: v for k, v in self.config.to_dict().items() if k != "latent"},
        }
        atomic_write_text(directory / CONFIG_FILE, json.dumps(meta, indent=1) + "\n")

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path | None = None) -> "WorldModel":
        """A shipped model by name (see ``shipped_models``: ``default``), or a model directory; with no
        argument, the shipped model (``default_model_dir``)."""
        if name_or_path is None:
            return cls.load()
        shipped = shipped_models()
        path = Path(name_or_path)
        if isinstance(name_or_path, str) and name_or_path in shipped and not path.exists():
            return cls.load(shipped[name_or_path])
        if not path.exists() and isinstance(name_or_path, str) and "/" not in name_or_path:
            raise CwmError(f"no world model named {name_or_path!r} and no such directory; "
                           f"shipped models: {', '.join(shipped)}")
        return cls.load(path)

    @classmethod
    def load(cls, directory: str | Path | None = None) -> "WorldModel":
        """Load a model directory; with no argument, the model shipped inside the package."""
        from .encoder import StateEncoder
        from .ranker import LambdaRanker
        from .transition import Transition

        directory = Path(directory) if directory is not None else default_model_dir()
        cfg_path = directory / CONFIG_FILE
        if not directory.exists():
            raise CwmError(f"world model directory {directory} does not exist")
        if not directory.is_dir():
            raise CwmError(f"world model path {directory} is a file, not a model directory")
        if not cfg_path.exists():
            raise CwmError(f"{cfg_path} is missing: {directory} is not a world model directory")
        try:
            meta = json.loads(cfg_path.read_text())
        except OSError as err:
            raise CwmError(f"cannot read {cfg_path}: {err.strerror or err}") from None
        except ValueError as err:  # bad JSON, or not text at all
            raise CwmError(f"{cfg_path} is corrupt: {err}") from None
        if not isinstance(meta, dict):
            raise CwmError(f"{cfg_path} is corrupt: expected a JSON object")
        if meta.get("format_version") != FORMAT_VERSION:
            raise CwmError(f"{cfg_path} has format version {meta.get('format_version')}, "
                           f"this cwm reads version {FORMAT_VERSION}")
        latent = meta.get("latent", "rollout")
        if latent not in LATENTS:
            raise CwmError(f"{cfg_path}: unknown latent {latent!r}; this cwm knows {', '.join(LATENTS)}")
        try:
            names = feature_names(int(meta.get("latent_dim", 0)), latent, bool(meta.get("perf_score", False)))
        except (TypeError, ValueError):
            raise CwmError(f"{cfg_path}: latent_dim must be an integer, got {meta.get('latent_dim')!r}") from None
        if meta.get("feature_layout") != layout_id(names):
            raise CwmError(f"{cfg_path} was trained for another feature layout "
                           f"({meta.get('feature_layout')}, this cwm uses {layout_id(names)}); retrain it")
        encoder = StateEncoder.load(directory / "encoder")
        transition = Transition.load(directory / "transition") if latent == "rollout" else None
        if bool(meta.get("perf_score", False)) != bool(transition is not None and transition.has_score_head):
            raise CwmError(f"{cfg_path} and {directory / 'transition'} disagree on F's score head; retrain it")
        ranker = LambdaRanker.load(directory / "ranker")
        if ranker.n_features_ != len(names):
            raise CwmError(f"{directory / 'ranker'} expects {ranker.n_features_} features, "
                           f"the layout has {len(names)}")
        config = WorldModelConfig.from_dict({k: meta[k] for k in ("hardware", "trained_on", "metrics") if k in meta}
                                            | {"latent": latent})
        return cls(encoder, transition, ranker, config)
