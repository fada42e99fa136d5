"""Cost models for MetaSchedule's search: the world model, and a timing wrapper for any model."""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import numpy as np
import tvm.s_tir.meta_schedule as ms
from tvm.ir.utils import derived_object

from ..data.database import valid_run_secs
from ..errors import CwmError
from ..hardware import hardware_for_target, machine_difference
from ..schedule.actions import (
    changes_ir,
    model_actions,
    replay,
    replay_states,
    trace_json_from_text,
    trace_json_text,
    trace_to_json,
)
from ..workloads.task import task_id_of

log = logging.getLogger(__name__)


@derived_object
class TimedCostModel(ms.cost_model.PyCostModel):
    """Delegate to another cost model and count the seconds spent inside it."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seconds_spent = 0.0
        self.predicted = 0

    def load(self, path: str) -> None:
        self.inner.load(path)

    def save(self, path: str) -> None:
        self.inner.save(path)

    def update(self, context, candidates, results) -> None:
        start = time.perf_counter()
        self.inner.update(context, candidates, results)
        self.seconds_spent += time.perf_counter() - start

    def predict(self, context, candidates) -> np.ndarray:
        start = time.perf_counter()
        scores = self.inner.predict(context, candidates)
        self.seconds_spent += time.perf_counter() - start
        self.predicted += len(candidates)
        return scores


# How a task's ranker learns from its measured candidates: ``TaskAdapter``; ``task-ensemble``,
# bootstrapped adapters scored pessimistically (``PessimisticEnsemble``); or (the earlier update,
# kept for the A/B) more trees boosted onto a copy of the pretrained ranker on all its columns.
ADAPTATIONS = ("task-adapter", "task-ensemble", "boost-copy")


def adapt_ranker(adaptation: str, model, X: np.ndarray, latencies: np.ndarray, rounds: int, seed: int = 0):
    """The ranker of one task after an online update of ``model``'s ranker on the task's measured rows."""
    import copy

    from ..model.ranker import PessimisticEnsemble, TaskAdapter
    from ..model.world_model import candidate_columns

    columns = candidate_columns(model.feature_names)
    if adaptation == "task-adapter":
        return TaskAdapter(model.ranker, columns, num_boost_round=rounds).fit(X, latencies)
    if adaptation == "task-ensemble":
        return PessimisticEnsemble.fit_bootstrap(model.ranker, columns, X, latencies, seed=seed,
                                                 num_boost_round=rounds)
    if adaptation == "boost-copy":
        ranker = copy.deepcopy(model.ranker)
        return ranker.update(X, latencies, np.zeros(len(latencies)), num_boost_round=rounds)
    raise CwmError(f"unknown adaptation {adaptation!r}; choose one of {', '.join(ADAPTATIONS)}")


# The fixed score transform's temperature, in units of the spread (standard deviation) of the
# task's first scored population. Chosen offline on held-out candidate populations: MetaSchedule's
# parent sampling then spreads its weight about as predicted normalized throughput would (what its
# own XGBoost model predicts), neither flat nor degenerate (docs/design.md, "Scores across predict calls").
SCORE_TEMPERATURE = 0.75
SCORE_TRANSFORMS = ("sigmoid", "zscore")
_SIGMOID_CLIP = 30.0  # |argument| beyond which scores tie; sigmoid(-30) ~ 1e-13 stays positive


def zscore_scores(raw: np.ndarray) -> np.ndarray:
    """The transform of earlier releases: z-score the call's raw scores and map its best to 1.0.

    A candidate's score depends on the other candidates of the call, so the scores of MetaSchedule's
    successive predict calls (one per generation of its evolutionary search) do not compare.
    """
    raw = np.asarray(raw, dtype=np.float64)
    if raw.size == 0:
        return raw.astype(np.float32)
    z = (raw - raw.mean()) / (raw.std() + 1e-9)
    return np.exp(np.clip(z - z.max(), -20.0, 0.0)).astype(np.float32)


def score_scale(raw: np.ndarray) -> tuple[float, float]:
    """(center, spread) of a population's raw ranker scores: their maximum and standard deviation
    (1.0, a unit of LambdaRank margin, when they do not spread).

    The center is the maximum, not the median: below its center a sigmoid is nearly exp, so the
    ratio of two candidates' weights depends on their raw scores alone, and parent sampling keeps
    its pressure as the evolved generations improve. Above a median, weights differ at most 2x:
    a generation better than the first population's median would be sampled almost uniformly.
    """
    raw = np.asarray(raw, dtype=np.float64)
    spread = float(raw.std()) if raw.size > 1 else 0.0
    return float(raw.max()), spread if spread > 1e-9 else 1.0


def sigmoid_scores(raw: np.ndarray, center: float, spread: float,
                   temperature: float = SCORE_TEMPERATURE) -> np.ndarray:
    """Map raw ranker scores to (0, 1] through one fixed, increasing function: a candidate's score
    depends on its raw score alone, so the scores of different predict calls compare."""
    x = (np.asarray(raw, dtype=np.float64) - center) / (spread * temperature)
    # float64: MetaSchedule reads doubles, and float32 would tie the best candidates near 1.0
    return 1.0 / (1.0 + np.exp(-np.clip(x, -_SIGMOID_CLIP, _SIGMOID_CLIP)))


def sampling_weight_stats(scores: np.ndarray, top: float = 0.1) -> tuple[float, float]:
    """How MetaSchedule's parent sampling (in proportion to the scores) spreads over a population:
    the effective sample size of the normalized weights over N (1: flat; 1/N: one parent), and the
    share of the weight on the best ``top`` fraction of it (``top``: flat)."""
    p = np.asarray(scores, dtype=np.float64)
    p = p / p.sum()
    k = max(1, int(round(top * p.size)))
    return float(1.0 / np.sum(p * p) / p.size), float(np.sort(p)[::-1][:k].sum())


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic garbage collector while candidates are scored.

    Decoding thousands of traces allocates millions of small lists and dicts, which triggers
    full collections that walk the whole heap (TVM, torch, the model): measured at ~85% of the
    decoding time. The scoring code makes no reference cycles worth collecting mid-batch.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@derived_object
class WorldModelCostModel(ms.cost_model.PyCostModel):
    """MetaSchedule cost model backed by the world model.

    predict: E(s0) once per task (cached), each candidate's trace as actions, batched rollout,
    LambdaRank scores. update: keep the measured candidates of each task and fit the task's
    correction of the pretrained ranker on them (``adaptation``: ``TaskAdapter`` by default).
    The encoder stays frozen; so does the transition, unless ``finetune_transition``: then a copy
    of F per task is fine-tuned with the rollout loss on the measured candidates' replayed and
    encoded intermediate states (at most ``finetune_states`` per candidate), and the task's
    features are recomputed with it.

    ``score_transform``: how raw ranker scores become MetaSchedule's scores in (0, 1]. ``sigmoid``
    (default): one fixed increasing function per task and ranker (``sigmoid_scores``), so the
    scores of successive predict calls compare, as MetaSchedule's evolutionary search assumes when
    it keeps one heap of the best candidates over all its generations. ``zscore``: the per-call
    transform of earlier releases (``zscore_scores``), kept for the A/B (``cwm-zscore``).
    """

    def __init__(self, model, *, online: bool = True, update_rounds: int = 20, min_update: int = 8,
                 hardware: dict | None = None, seed: int = 0, finetune_transition: bool = False,
                 finetune_epochs: int = 3, finetune_states: int = 4, score_transform: str = "sigmoid",
                 adaptation: str = "task-adapter"):
        super().__init__()
        if finetune_transition and (model.transition is None or model.config.latent != "rollout"):
            raise CwmError("finetune_transition needs a world model that rolls out its transition")
        if score_transform not in SCORE_TRANSFORMS:
            raise CwmError(f"unknown score transform {score_transform!r}; choose one of {', '.join(SCORE_TRANSFORMS)}")
        if adaptation not in ADAPTATIONS:
            raise CwmError(f"unknown adaptation {adaptation!r}; choose one of {', '.join(ADAPTATIONS)}")
        self.model = model
        self.online = online
        self.update_rounds = update_rounds
        self.min_update = min_update
        self.hardware = hardware
        self.seed = seed
        self.finetune_transition = finetune_transition
        self.finetune_epochs = finetune_epochs
        self.finetune_states = finetune_states
        self.score_transform = score_transform
        self.adaptation = adaptation
        # task key -> ((ranker, transition), center, spread) of its sigmoid transform, frozen at their first call
        self._score_scales: dict[str, tuple[tuple, float, float]] = {}
        self._initial: dict[int, str] = {}
        # task key -> {"X": [...], "latency": [...]}, plus "actions" and "targets" when fine-tuning
        self.measured: dict[str, dict[str, list]] = {}
        self.adapted: dict[str, object] = {}  # task key -> adapted ranker
        self.task_models: dict[str, object] = {}  # task key -> world model with its fine-tuned transition
        # Evolutionary search re-scores surviving candidates every generation: keep their rows.
        self.max_cached_rows = 65536
        self._rows: dict[tuple[str, bytes], np.ndarray] = {}

    def _task(self, context) -> tuple[str, str]:
        key = id(context.mod)
        if key not in self._initial:
            self._initial[key] = (task_id_of(context.mod), context.mod.script())
        return self._initial[key]

    def _hardware(self, context) -> dict | None:
        if self.hardware is None and context.target is not None:
            self.hardware = hardware_for_target(context.target).as_json()
            # A model trained on several machines' records matches a host like any one of them.
            difference = machine_difference(self.model.config.hardware, self.hardware, self.model.config.machines)
            if difference:
                # Its pretrained ranking encodes the training machine's preferences; they need not
                # hold here (benchmarks/results/search_zen3/NOTES.md), and the online updates only see what it picks.
                log.warning("the world model was trained on measurements from another machine (%s); its "
                            "ranking may not transfer: `cwm collect` and `cwm train` on this machine give it "
                            "measurements of its own", difference)
        return self.hardware

    def _features(self, context, candidates) -> tuple[str, np.ndarray]:
        """Feature rows of the candidates; rows of traces seen before come from the cache."""
        import hashlib

        with gc_paused():  # every candidate decoded here: see gc_paused
            tid, text = self._task(context)
            traces = [trace_json_text(c.sch.trace) for c in candidates]
            keys = [(tid, hashlib.blake2b(t.encode(), digest_size=16).digest()) for t in traces]
            missing = {}
            for i, k in enumerate(keys):
                if k not in self._rows and k not in missing:
                    missing[k] = i
            if missing:
                actions = [model_actions(trace_json_from_text(traces[i], candidates[i].sch.trace))
                           for i in missing.values()]
                new = self.task_models.get(tid, self.model).features(text, actions, self._hardware(context))
                if len(self._rows) + len(missing) > self.max_cached_rows:
                    # Bounded memory: drop the cache, but keep the rows this batch still needs.
                    self._rows = {k: self._rows[k] for k in keys if k in self._rows}
                self._rows.update(zip(missing, new))
        return tid, np.stack([self._rows[k] for k in keys])

    def predict(self, context, candidates) -> np.ndarray:
        if not candidates:
            return np.zeros(0, dtype=np.float32)
        tid, X = self._features(context, candidates)
        ranker = self.adapted.get(tid, self.model.ranker)
        raw = ranker.predict(X)
        if self.score_transform == "zscore":
            return zscore_scores(raw)
        return sigmoid_scores(raw, *self._score_scale(tid, ranker, raw))

    def _score_scale(self, tid: str, ranker, raw: np.ndarray) -> tuple[float, float]:
        """The task's (center, spread), frozen from the first call that this ranker (and, when
        fine-tuning, the task's transition) scores.

        LambdaRank margins only rank within a task: their offset and spread differ from task to task
        and change when a ranker is refit, so no constant would do. The first call of a search is
        its initial population, a fair sample of the design space. The online update replaces the
        ranker (``self.adapted[tid]`` is a new object; so is a fine-tuned transition) and then the
        transform is frozen anew; that happens only between MetaSchedule's search batches (``update``
        follows the measurements), so all the predict calls of one batch, whose scores share one
        heap, use one function.
        """
        key = (ranker, self.task_models.get(tid))
        frozen = self._score_scales.get(tid)
        if frozen is None or frozen[0][0] is not key[0] or frozen[0][1] is not key[1]:
            frozen = self._score_scales[tid] = (key, *score_scale(raw))
        return frozen[1], frozen[2]

    def update(self, context, candidates, results) -> None:
        if not self.online or not candidates:
            return
        tid, X = self._features(context, candidates)
        store = self.measured.setdefault(tid, {"X": [], "latency": []})
        valid = []
        for i, (row, res) in enumerate(zip(X, results)):
            secs = [float(s) for s in res.run_secs] if res.run_secs is not None else []
            if res.error_msg is None and valid_run_secs(secs):
                store["X"].append(row)
                store["latency"].append(float(np.median(secs)))
                valid.append(i)
        if self.finetune_transition and valid:
            self._add_targets(context, tid, [candidates[i] for i in valid])
            self._finetune(context, tid)
        self._adapt(tid)

    def _add_targets(self, context, tid: str, candidates) -> None:
        """Actions and encoded true intermediate states of newly measured candidates."""
        store = self.measured[tid]
        for cand in candidates:
            actions = model_actions(trace_to_json(cand.sch.trace))
            ir_steps = [i + 1 for i, a in enumerate(actions) if changes_ir(a)]
            # A few evenly spaced IR-changing steps, always the last: each is replayed from s0.
            picks = sorted({ir_steps[round(j)] for j in np.linspace(0, len(ir_steps) - 1,
                                                                    min(self.finetune_states, len(ir_steps)))}
                           ) if ir_steps else []
            try:
                states = replay_states(context.mod, actions, picks)
            except Exception:  # a trace that no longer replays: its trajectory gets no targets
                states = {}
            steps = sorted(states)
            vectors = self.model.encoder.encode([states[t] for t in steps]) if steps else []
            store.setdefault("actions", []).append(actions)
            store.setdefault("targets", []).append({int(t): np.asarray(v, np.float32) for t, v in zip(steps, vectors)})

    def _finetune(self, context, tid: str) -> None:
        """Fine-tune a copy of the pretrained F on the task's measured trajectories; refresh its features."""
        import copy
        import dataclasses

        _, text = self._task(context)
        store = self.measured[tid]
        base = self.model
        transition = copy.deepcopy(base.transition)
        transition.config = dataclasses.replace(transition.config, seed=self.seed)
        z0 = np.repeat(base.initial_latent(text)[None, :], len(store["actions"]), axis=0)
        transition.fit(z0, store["actions"], store["targets"], progress=False, warm_start=True,
                       epochs=self.finetune_epochs)
        self._use_transition(tid, transition, text, self._hardware(context))

    def _use_transition(self, tid: str, transition, text: str, hardware) -> None:
        task_model = self.task_models[tid] = self.model.with_transition(transition)
        self._rows = {k: v for k, v in self._rows.items() if k[0] != tid}
        self.measured[tid]["X"] = list(task_model.features(text, self.measured[tid]["actions"], hardware))

    def _adapt(self, tid: str) -> None:
        """Update the task's ranker on its measured candidates (``adapt_ranker``)."""
        store = self.measured[tid]
        if len(store["latency"]) < self.min_update:
            return
        self.adapted[tid] = adapt_ranker(self.adaptation, self.task_models.get(tid, self.model),
                                         np.stack(store["X"]), np.asarray(store["latency"]), self.update_rounds,
                                         seed=self.seed)

    def save(self, path: str) -> None:
        """The per-task online state: measured features and latencies, and with fine-tuning the
        trajectories, their target states and the fine-tuned transition weights (the base model
        is saved separately)."""
        import json

        payload = {}
        for tid, v in self.measured.items():
            if not v["X"]:
                continue
            payload[f"{tid}/X"] = np.stack(v["X"])
            payload[f"{tid}/latency"] = np.asarray(v["latency"])
            if "actions" in v:
                payload[f"{tid}/actions"] = np.array(json.dumps(v["actions"]))
                payload[f"{tid}/targets"] = np.array(json.dumps(
                    [{str(t): vec.tolist() for t, vec in tg.items()} for tg in v["targets"]]))
        for tid, task_model in self.task_models.items():
            for name, tensor in task_model.transition.model_.state_dict().items():
                payload[f"{tid}/transition/{name}"] = tensor.detach().numpy()
        with open(path, "wb") as f:
            np.savez(f, **payload)

    def load(self, path: str) -> None:
        import copy
        import json

        import torch

        with np.load(path) as data:
            files = set(data.files)
            tids = {k.split("/")[0] for k in files}
            self.measured, weights = {}, {}
            for t in tids:
                store = {"X": list(data[f"{t}/X"]), "latency": list(data[f"{t}/latency"])}
                if f"{t}/actions" in files:
                    store["actions"] = json.loads(str(data[f"{t}/actions"]))
                    store["targets"] = [{int(k): np.asarray(v, np.float32) for k, v in tg.items()}
                                        for tg in json.loads(str(data[f"{t}/targets"]))]
                self.measured[t] = store
                prefix = f"{t}/transition/"
                state = {k[len(prefix):]: torch.from_numpy(data[k].copy()) for k in files if k.startswith(prefix)}
                if state:
                    weights[t] = state
        self.task_models, self._rows = {}, {}
        for tid, state in weights.items():
            transition = copy.deepcopy(self.model.transition)
            transition.model_.load_state_dict(state)
            self.task_models[tid] = self.model.with_transition(transition)
        self.adapted = {}
        for tid in self.measured:
            self._adapt(tid)


def measure_candidates(mod, actions_list) -> list:
    """MetaSchedule MeasureCandidates of recorded action sequences on ``mod``."""
    args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    return [ms.MeasureCandidate(replay(mod, actions), args_info) for actions in actions_list]


def xgb_scores(model, mod, actions_list, target, task_name: str = "main") -> np.ndarray:
    """A MetaSchedule cost model's scores of recorded action sequences on ``mod`` (higher is better)."""
    context = ms.TuneContext(mod=mod, target=target, task_name=task_name)
    return np.asarray(model.predict(context, measure_candidates(mod, actions_list)))


def learn_trajectories(model, mod, trajectories, target, task_name: str = "main") -> None:
    """One MetaSchedule cost-model update with measured trajectories of ``mod`` (valid ones)."""
    context = ms.TuneContext(mod=mod, target=target, task_name=task_name)
    model.update(context, measure_candidates(mod, [t.actions for t in trajectories]),
                 runner_results([t.latency for t in trajectories]))


def runner_results(latencies) -> list:
    return [ms.runner.RunnerResult(run_secs=[float(x)], error_msg=None) for x in latencies]


def pretrain_xgb(ds, target, seed: int = 0, progress: bool = True):
    """MetaSchedule's XGBModel (PerStoreFeature) trained on a dataset's valid records."""
    from tqdm import tqdm
    from tvm.s_tir.meta_schedule.cost_model.xgb_model import XGBConfig

    model = ms.cost_model.XGBModel(config=XGBConfig(seed=seed), adaptive_training=False, verbose_eval=10**6)
    for tid, trajs in tqdm(sorted(ds.by_task.items()), desc="xgb-static features", disable=not progress):
        trajs = [t for t in trajs if t.valid]
        if trajs:
            learn_trajectories(model, ds.modules[tid], trajs, target, tid)
    return model
