"""Training the world model: E (contrastive), then F (rollout loss), then R (LambdaRank).

The budget is set by ``TrainSettings``: states are subsampled per task so that the whole run
fits in about an hour and a few GB on a 2-core machine.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..data.dataset import load_dataset
from ..errors import CwmError
from ..model import distributed
from ..schedule.transfer import TRANSFER_FILE, transfer_schedules_bytes

log = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    # encoder
    encoder_states_per_task: int = 16
    encoder_epochs: int = 3
    encoder_max_seconds: float = 480.0
    encoder_hidden: int = 64
    encoder_layers: int = 2
    encoder_window: int = 128
    encoder_stride: int = 96
    encoder_max_windows: int = 24
    vocab_size: int = 2048
    # E's within-task ranking loss (EncoderConfig.latency_weight; 0: contrastive only) and how many
    # measured final states per ranking group (task@machine) train it
    encoder_latency_weight: float = 0.0
    encoder_ranked_per_group: int = 32
    # transition
    transition_trajectories_per_task: int = 24
    transition_steps_per_trajectory: int = 4
    transition_epochs: int = 30
    transition_max_seconds: float = 240.0
    # performance-aware F: weight of the within-task ranking loss on F's score head (0: the paper's
    # state matching only), and how many measured trajectories per task train it
    transition_perf_weight: float = 1.0
    transition_perf_trajectories_per_task: int = 64
    # F's variants (issue: an F that learns speed): tile inputs relative to their loops, the residual MLP
    transition_relative_tiles: bool = False
    transition_residual: bool = False
    # ranker
    ranker_estimators: int = 200
    ranker_labels: str = "throughput"
    ranker_label_levels: int = 16
    ranker_early_stopping_rounds: int = 0
    seed: int = 0
    # a local Hugging Face RoBERTa checkpoint directory (e.g. codebert-base) to start E from
    encoder_checkpoint: str | None = None

    @classmethod
    def tiny(cls) -> "TrainSettings":
        """Sizes for tests: seconds, not minutes."""
        return cls(encoder_states_per_task=4, encoder_epochs=1, encoder_hidden=16, encoder_layers=1,
                   encoder_window=32, encoder_stride=24, encoder_max_windows=6, vocab_size=300,
                   transition_trajectories_per_task=4, transition_steps_per_trajectory=2,
                   transition_epochs=3, ranker_estimators=20)


def trained_settings(trained_on: dict | None) -> TrainSettings:
    """The settings a model's ``trained_on`` metadata records; fields added since then take their defaults,
    and fields this version does not know are left out."""
    saved = (trained_on or {}).get("settings") or {}
    return TrainSettings(**{k: v for k, v in saved.items() if k in TrainSettings.__dataclass_fields__})


@dataclass
class TrainReport:
    seconds: dict = field(default_factory=dict)
    encoder_loss: list = field(default_factory=list)
    transition_loss: list = field(default_factory=list)
    ranker_history: dict = field(default_factory=dict)
    validation: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    peak_rss_mb: float = 0.0

    def as_json(self) -> dict:
        return asdict(self)


def _rng(seed):
    return np.random.default_rng(seed)


def _sample(items, k, rng):
    if len(items) <= k:
        return list(items)
    idx = rng.choice(len(items), size=k, replace=False)
    return [items[i] for i in sorted(idx)]


def _require_tasks(ds, name: str):
    if not ds.trajectories:
        raise CwmError(f"the {name} split has no valid records; collect data for its tasks first")


def encoder_corpus(ds, per_task: int, rng) -> tuple[list[str], list[str]]:
    """States for contrastive training: initial, intermediate and final states of each task."""
    texts, groups = [], []
    for tid, trajs in sorted(ds.by_task.items()):
        texts.append(ds.initial_states[tid])
        groups.append(tid)
        for traj in _sample(trajs, per_task, rng):
            steps = traj.ir_steps
            step = int(rng.choice(steps)) if steps and rng.random() < 0.5 else len(traj.actions)
            texts.append(ds.state(traj, step))
            groups.append(tid)
    return texts, groups


def encoder_ranked_corpus(ds, per_group: int, rng) -> tuple[list[str], list[float], list[str]]:
    """Measured final states for E's ranking loss: (texts, latencies, ranking groups), at most
    ``per_group`` valid records of each task@machine group."""
    several = several_machines(ds)
    texts, latencies, groups = [], [], []
    for tid, trajs in ranked_trajectories(ds):
        by_group: dict[str, list] = {}
        for t in trajs:
            by_group.setdefault(ranking_group(tid, t.machine, several), []).append(t)
        for group, members in sorted(by_group.items()):
            if len(members) < 2:
                continue
            for t in _sample(members, per_group, rng):
                texts.append(ds.final_state(t))
                latencies.append(float(t.latency))
                groups.append(group)
    return texts, latencies, groups


def fit_encoder(train_ds, settings: TrainSettings, rng, progress: bool = True, cache_dir=None):
    """E trained on ``train_ds``: contrastive over the tasks' states, plus the within-task ranking loss on
    measured final states when ``settings.encoder_latency_weight`` > 0. Returns (encoder, states used)."""
    from .encoder import EncoderConfig, StateEncoder

    texts, groups = encoder_corpus(train_ds, settings.encoder_states_per_task, rng)
    ranked = None
    if settings.encoder_latency_weight > 0:
        ranked = encoder_ranked_corpus(train_ds, settings.encoder_ranked_per_group, rng)
        if not ranked[0]:
            raise CwmError("E's latency loss needs tasks with two or more measured records")
    latent_cache = cache_dir and Path(cache_dir) / "latents"
    if settings.encoder_checkpoint:
        encoder = StateEncoder.from_pretrained_checkpoint(
            settings.encoder_checkpoint, EncoderConfig(latency_weight=settings.encoder_latency_weight),
            cache_dir=latent_cache)
    else:
        encoder = StateEncoder(EncoderConfig(
            vocab_size=settings.vocab_size, hidden_size=settings.encoder_hidden, num_layers=settings.encoder_layers,
            num_heads=4 if settings.encoder_hidden >= 32 else 2, intermediate_size=2 * settings.encoder_hidden,
            window=settings.encoder_window, stride=settings.encoder_stride, max_windows=settings.encoder_max_windows,
            seed=settings.seed, latency_weight=settings.encoder_latency_weight), cache_dir=latent_cache)
    encoder.fit(texts, groups, epochs=settings.encoder_epochs, progress=progress,
                max_seconds=settings.encoder_max_seconds, ranked=ranked)
    return encoder, len(texts) + (len(ranked[0]) if ranked else 0)


def transition_data(ds, encoder, per_task: int, steps_per_traj: int, rng, progress: bool = True,
                    perf_per_task: int = 0):
    """(z0, actions, targets, latencies, groups): targets map a step to E(true state after that many
    actions) for ``per_task`` trajectories of each task; ``perf_per_task`` more valid trajectories
    per task (if it has them) come with no targets, only their latency and ranking group, for F's
    score head."""
    from tqdm import tqdm

    chosen = []
    several = several_machines(ds)
    for tid, trajs in sorted(ds.by_task.items()):
        picked_trajs = _sample(trajs, per_task, rng)
        for traj in picked_trajs:
            steps = traj.ir_steps
            picked = sorted(set(_sample(steps[:-1], steps_per_traj, rng)) | {len(traj.actions)})
            chosen.append((traj, picked))
        if perf_per_task:
            taken = {id(t) for t in picked_trajs}
            rest = [t for t in trajs if t.valid and id(t) not in taken]
            chosen.extend((traj, []) for traj in _sample(rest, perf_per_task, rng))
    texts, where = [], []
    for i, (traj, steps) in enumerate(tqdm(chosen, desc="replay states", disable=not progress)):
        for s in steps:
            texts.append(ds.state(traj, s))
            where.append((i, s))
    vectors = encoder.encode(texts)
    targets = [dict() for _ in chosen]
    for (i, s), v in zip(where, vectors):
        targets[i][s] = v
    task_ids = sorted({t.task_id for t, _ in chosen})
    initial = dict(zip(task_ids, encoder.encode([ds.initial_states[tid] for tid in task_ids])))
    z0 = np.stack([initial[t.task_id] for t, _ in chosen])
    latencies = [t.latency if t.valid else float("nan") for t, _ in chosen]
    groups = [ranking_group(t.task_id, t.machine, several) for t, _ in chosen]
    return z0, [t.actions for t, _ in chosen], targets, latencies, groups


def ranking_group(task_id: str, machine: str, several_machines: bool) -> str:
    """The group a record is ranked within: its task, and its machine when the data has several
    (latencies of one task on two machines are not comparable)."""
    return f"{task_id}@{machine}" if several_machines else task_id


def group_task(group: str) -> str:
    """The task id of a ranking group (see ``ranking_group``)."""
    return str(group).split("@")[0]


def group_weights(ds, groups) -> dict:
    """Each ranking group's weight: its task's (see ``ranking_group``)."""
    return {g: ds.tasks[group_task(g)].weight for g in set(groups)}


def several_machines(ds) -> bool:
    """Whether the valid records of ``ds`` come from more than one machine."""
    return len({t.machine for t in ds.trajectories if t.valid}) > 1


def ranked_trajectories(ds) -> list[tuple[str, list]]:
    """The valid records of ``ds`` in the order ``ranker_arrays`` gives them: task by task, and within a
    task machine by machine (record order within each)."""
    several = several_machines(ds)
    out = []
    for tid, trajs in sorted(ds.by_task.items()):
        trajs = [t for t in trajs if t.valid]
        if trajs:
            out.append((tid, sorted(trajs, key=lambda t: t.machine) if several else trajs))
    return out


def ranker_parts(ds):
    """(task id, hardware, records) of every valid record of ``ds`` in the order ``ranker_arrays`` gives
    their rows: task by task, and within a task machine by machine."""
    for tid, trajs in ranked_trajectories(ds):
        for hardware, rows in ds.by_hardware(trajs):
            yield tid, hardware, [trajs[i] for i in rows]


def ranker_arrays(model, ds, final_latents: dict | None = None):
    """Features, latencies and group labels of every valid record of ``ds``, task by task; each record
    gets the hardware features of the machine it was measured on, and is grouped by ``ranking_group``."""
    xs, lats, groups = [], [], []
    several = several_machines(ds)
    for tid, hardware, part in ranker_parts(ds):
        finals = None
        if final_latents is not None:
            finals = np.stack([final_latents[t.record_index] for t in part])
        xs.append(model.features(ds.initial_states[tid], [t.actions for t in part], hardware, finals))
        lats.extend(t.latency for t in part)
        groups.extend(ranking_group(tid, t.machine, several) for t in part)
    if not xs:
        raise CwmError("no valid records to build ranker features from")
    return np.concatenate(xs), np.asarray(lats, dtype=float), np.asarray(groups)


def fit_transition(train_ds, encoder, settings: TrainSettings, rng, progress: bool = True):
    """F trained on ``train_ds`` over ``encoder``'s latents: state matching on replayed states, plus the
    within-task ranking loss on its score head when ``settings.transition_perf_weight > 0``.
    Returns ``(Transition, counts)``."""
    from .transition import Transition, TransitionConfig

    perf = settings.transition_perf_weight > 0
    z0, actions, targets, latencies, groups = transition_data(
        train_ds, encoder, settings.transition_trajectories_per_task, settings.transition_steps_per_trajectory,
        rng, progress, perf_per_task=settings.transition_perf_trajectories_per_task if perf else 0)
    transition = Transition(TransitionConfig(state_dim=encoder.dim, epochs=settings.transition_epochs,
                                             perf_weight=settings.transition_perf_weight, seed=settings.seed,
                                             relative_tiles=settings.transition_relative_tiles,
                                             residual_mlp=settings.transition_residual))
    transition.fit(z0, actions, targets, progress=progress, max_seconds=settings.transition_max_seconds,
                   latencies=latencies if perf else None, groups=groups if perf else None)
    counts = {"transition_trajectories": len(actions),
              "transition_targets": int(sum(len(x) for x in targets)),
              "transition_ranked_trajectories": len(actions) if perf else 0}
    return transition, counts


def fit_ranker(model, train_ds, val_ds, settings: TrainSettings, final_latents=None):
    from .ranker import LambdaRanker, RankerConfig

    X, y, g = ranker_arrays(model, train_ds, final_latents)
    eval_set = ranker_arrays(model, val_ds, final_latents) if val_ds is not None and val_ds.trajectories else None
    # Pairwise LambdaRank with many pairs per sample generalized best to held-out tasks
    # (leave-one-task-out pairwise accuracy 0.68 vs 0.57 for rank:ndcg on the reference data).
    ranker = LambdaRanker(RankerConfig(objective="rank:pairwise", n_estimators=settings.ranker_estimators,
                                       max_depth=6, learning_rate=0.1, lambdarank_num_pair_per_sample=32,
                                       labels=settings.ranker_labels, label_levels=settings.ranker_label_levels,
                                       early_stopping_rounds=settings.ranker_early_stopping_rounds,
                                       seed=settings.seed))
    ranker.fit(X, y, g, eval_set=eval_set, feature_names=model.feature_names)
    return ranker


def train(db_dir, split: dict, out_dir, settings: TrainSettings | None = None, *, progress: bool = True,
          cache_dir=None):
    """Train E, F and R on the train split; returns (WorldModel, TrainReport) and saves to out_dir.

    Under ``torchrun --nproc_per_node N`` (``WORLD_SIZE`` > 1) the processes join a gloo
    process group and train E and F data-parallel (DistributedDataParallel, see
    :mod:`cwm.model.distributed`). Every rank builds the same corpus from the same seed. The ranker
    (XGBoost) is not data-parallel: rank 0 alone fits it, validates and writes ``out_dir``;
    the other ranks wait at a barrier, then return the model loaded from ``out_dir`` with a
    report that has no ranker or validation entries.
    """
    with distributed.process_group():
        return _train(db_dir, split, out_dir, settings, progress=progress, cache_dir=cache_dir)


def _train(db_dir, split: dict, out_dir, settings: TrainSettings | None, *, progress: bool, cache_dir):
    import resource

    import torch

    from .metrics import evaluate_ranking
    from .ranker import LambdaRanker
    from .world_model import TRAIN_SPLIT_FILE, WorldModel, WorldModelConfig, check_output_dir

    settings = settings or TrainSettings()
    progress = progress and distributed.is_main()
    out_dir = Path(out_dir)
    check_output_dir(out_dir)  # fail now, not after training
    rng = _rng(settings.seed)
    torch.manual_seed(settings.seed)
    report = TrainReport()
    t0 = time.time()
    ds = load_dataset(db_dir, cache_dir=cache_dir).valid()
    train_ds = ds.subset(split["train"])
    val_ds = ds.subset(split.get("val", []))
    _require_tasks(train_ds, "train")
    report.counts = {"train_tasks": len(train_ds.by_task), "train_records": len(train_ds),
                     "val_tasks": len(val_ds.by_task), "val_records": len(val_ds)}

    # 1. Encoder
    t = time.time()
    encoder, states = fit_encoder(train_ds, settings, rng, progress, cache_dir)
    report.encoder_loss = list(encoder.history_)
    report.counts["encoder_states"] = states
    report.seconds["encoder"] = time.time() - t

    # 2. Transition
    t = time.time()
    transition, counts = fit_transition(train_ds, encoder, settings, rng, progress)
    report.transition_loss = [h.get("loss") for h in transition.history_]
    report.counts.update(counts)
    if distributed.is_distributed():
        report.counts["ranks"] = distributed.world_size()
    report.seconds["transition"] = time.time() - t

    # 3. Ranker on the rolled-out latents, fitted and saved by rank 0 alone
    if not distributed.is_main():
        distributed.barrier()  # rank 0 has written out_dir
        report.seconds["total"] = time.time() - t0
        report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return WorldModel.load(out_dir), report
    t = time.time()
    model = WorldModel(encoder, transition, LambdaRanker(),
                       WorldModelConfig(latent="rollout", hardware=ds.hardware))
    model.ranker = fit_ranker(model, train_ds, val_ds, settings)
    report.ranker_history = {split: {metric: values[-1] for metric, values in evals.items() if values}
                             for split, evals in model.ranker.history_.items()}
    report.seconds["ranker"] = time.time() - t
    if val_ds.trajectories:
        X, y, g = ranker_arrays(model, val_ds)
        report.validation = evaluate_ranking(model.ranker.predict(X), y, g, group_weights(ds, g))
    report.seconds["total"] = time.time() - t0
    report.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model.config.trained_on = {"database": str(db_dir), **report.counts, "machines": sorted(ds.machines),
                               "settings": asdict(settings)}
    model.config.metrics = {"validation": report.validation}
    # Atomic: out_dir is the complete old model or the complete new one, even after a kill.
    model.save(out_dir, extra_files={
        TRANSFER_FILE: transfer_schedules_bytes(ds, list(split["train"]) + list(split.get("val", []))),
        "train_report.json": json.dumps(report.as_json(), indent=1, default=float) + "\n",
        TRAIN_SPLIT_FILE: json.dumps({k: sorted(split.get(k, [])) for k in ("train", "val")}, indent=1) + "\n"})
    distributed.barrier()  # let the other ranks load the saved model
    return model, report
