"""End-to-end benchmark: tuned networks against PyTorch.

For each network: tune its compute tasks with each cost model under the same budget
(``trials_per_task`` x number of compute tasks, split over the tasks by ``cwm.tuning.budget``; a
contender ``NAME:T`` is tuned at T trials per task instead, for time-to-quality comparisons, and
``NAME+transfer`` measures transferred schedules first, ``parse_contender``) and its
layout tasks with ``LAYOUT_TRIALS_PER_TASK`` trials each, build
the untuned and tuned libraries, check each against PyTorch, then time PyTorch eager,
``torch.compile`` (inductor), TVM untuned and TVM tuned per cost model in rotating blocks
(``cwm.benchmarks.timing.time_interleaved``), median of ``runs`` calls. Also records the tuning wall time and a
roofline: the GFLOP/s of the best tuned kernels of the largest compute-bound tasks as a fraction
of a measured torch matmul peak.

Everything is resumable: tuning resumes from each work directory's database, libraries are
rebuilt only when their database changed, and ``e2e.json`` is rewritten after each network (a
finished network with the same settings is skipped on the next run). After each cost model and
seed, the network's tuning databases are archived beside the report
(``databases_<network>.tar.gz``): the figures keep their databases, and a run whose work directories
were lost (another machine, a cleaned ``runs/``) resumes from the archive.

The learned cost models are reported with what they saw: each network's entry names the world model
of ``cwm`` and the pretrained XGBoost file of ``xgb-pretrained`` (trained on ``split``'s training
records of ``train_db``) and how many of the network's compute tasks were in their training data
(``held_out``: none). With ``leave_network_out``, both are retrained for each network on ``split`` less
that network's tasks (``<work_root>/<network>/leave_out_model``, reused when it exists), so every
network is held out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import tarfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..data.database import RECORD_FILE, WORKLOAD_FILE, TaskInfo
from ..data.split import NEAR_DUPLICATE_TOLERANCE, task_shapes, tasks_to_leave_out
from ..deploy.build import PREPACKED_SUFFIX, build_network, sidecar_path
from ..deploy.check import check_against_torch, check_outputs, tolerance_for, torch_outputs
from ..deploy.profile import profile_network
from ..deploy.runtime import load_and_run
from ..errors import CwmError, first_line
from ..frontend import zoo
from ..hardware import host_cpu, make_target
from ..io import atomic_file, atomic_write_text, portable_path
from ..model.metrics import geomean as metrics_geomean
from ..tuning.registry import check_cost_model
from ..tuning.tuner import add_invocation_time, tune_network
from ..workloads import tunable
from ..workloads.networks import LAYOUT_TRIALS_PER_TASK, NETWORKS, torch_model
from ..workloads.pipeline import PIPELINE_VERSION, extract_tasks, relax_from_torch
from .timing import (
    TIMING_BLOCK,
    ort_runner,
    peak_matmul_stats,
    set_threads,
    time_interleaved,
    torch_runner,
    tvm_runner,
)

log = logging.getLogger(__name__)

DEFAULT_NETWORKS = ("resnet18", "resnet50", "mobilenet_v2", "bert-base", "gpt2")
COMPUTE_BOUND_KINDS = ("conv2d", "dense", "matmul", "batch_matmul")
EAGER = "torch_eager"
COMPILED = "torch_compile"
ORT = "onnxruntime"  # CPU execution provider, all graph optimizations, the benchmark's threads
UNTUNED = "tvm_untuned"
TUNING_TIME_FILE = "e2e_tuning_time.json"
# Seconds of timed calls after which a slow contender stops (after at least 3 calls).
TIMING_BUDGET_S = 60.0
# The cost models trained on records: what they saw is reported, and leave-network-out retrains them.
LEARNED = ("cwm", "xgb-pretrained")
LEAVE_OUT_MODEL_DIR = "leave_out_model"  # <work_root>/<network>/: the world model that never saw the network
LEAVE_OUT_SUFFIX = "-leave-out"  # work directories and libraries of the leave-network-out contenders


def geomean(values) -> float | None:
    """The geometric mean, or None (JSON null) when no value is usable."""
    g = metrics_geomean(values)
    return None if math.isnan(g) else g


def tuned_name(cost_model: str) -> str:
    return f"tvm_{cost_model}"


def _seed_name(cost_model: str, seed: int) -> str:
    return f"tvm_{cost_model}@s{seed}"


def _network_spec(entry):
    """(name, torch model, example inputs) from a network name or such a tuple (tiny mode)."""
    if isinstance(entry, str):
        model, inputs = torch_model(entry) if entry in NETWORKS else zoo.resolve(entry)[1]()
        return _label_of(entry), model, tuple(inputs)
    if isinstance(entry, (tuple, list)) and len(entry) == 3:
        name, model, inputs = entry
        if not isinstance(inputs, (tuple, list)):
            inputs = (inputs,)
        return str(name), model, tuple(inputs)
    raise CwmError(f"a network is a name or a (name, torch model, example inputs) tuple, got {entry!r}")


def _label_of(name: str) -> str:
    """A network's name in the report and under the work root: a model file by its file name."""
    return Path(name).name if name.endswith(".pt2") else name


def _db_fingerprint(db_dir: Path | None) -> list | None:
    """Sizes and mtimes of the database files: a library is rebuilt when they change."""
    if db_dir is None:
        return None
    out = []
    for name in (WORKLOAD_FILE, RECORD_FILE):
        p = Path(db_dir) / name
        out.append([p.stat().st_size, int(p.stat().st_mtime_ns)] if p.exists() else None)
    return out


def _weights_fingerprint(model) -> str:
    """A hash of the model's parameters and buffers: they are bound into the library as constants."""
    import hashlib

    h = hashlib.sha1()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _build_cached(mod_fn, db_dir, target, lib_path: Path, weights: str) -> dict:
    """build_network, unless ``lib_path`` exists and was built from the same weights and database state."""
    fp = [weights, _db_fingerprint(db_dir), PIPELINE_VERSION]
    side = sidecar_path(lib_path)
    if lib_path.exists() and side.exists():
        try:
            meta = json.loads(side.read_text())
            if meta.get("db_fingerprint", "none") == fp and meta.get("target") == str(target):
                meta["cached"] = True
                return meta
        except (json.JSONDecodeError, OSError):
            pass
    result = build_network(mod_fn(), db_dir, target, lib_path)
    meta = result.as_json()
    meta["db_fingerprint"] = fp
    atomic_write_text(side, json.dumps(meta, indent=1) + "\n")
    meta["cached"] = False
    return meta


def _tune_timed(tasks, budget, work_dir: Path, cost_model, model_path, target, seed, per_iter, progress,
                transfer=False):
    """``tune_network`` with the wall time accumulated across resumed invocations in the work directory.
    ``tasks``: all of the network's."""
    start = time.time()
    try:
        result, _ = tune_network(tasks, trials=budget, work_dir=work_dir, cost_model=cost_model,
                                 model_path=model_path, target=target, seed=seed, num_trials_per_iter=per_iter,
                                 progress=progress, transfer=transfer)
    finally:  # a crashed invocation's time counts too: its records stay in the database
        elapsed = time.time() - start
        total = add_invocation_time(work_dir / TUNING_TIME_FILE, elapsed)
    return result, total["seconds"], elapsed


def database_archive_path(out_dir: Path, network: str) -> Path:
    return Path(out_dir) / f"databases_{_safe(network)}.tar.gz"


def _archive_databases(archive: Path, network_dir: Path, network: str) -> None:
    """Write the JSON files (databases, task lists, tuning time, failures) of every work directory
    under ``network_dir`` (``<cost model>/seed<k>``) into ``archive`` as ``network/...``, replacing
    it atomically."""
    base = Path(network_dir)
    files = sorted(f for f in base.glob("*/seed*/*") if f.is_file() and f.suffix in (".json", ".jsonl"))
    with atomic_file(archive) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f"{network}/{f.relative_to(base).as_posix()}")


def _restore_work_dir(archive: Path, work_dir: Path, network: str, cost_model: str, seed: int) -> bool:
    """Refill an empty work directory from ``archive``; True if something was restored."""
    if (work_dir / RECORD_FILE).exists() or not archive.exists():
        return False
    prefix = f"{network}/{cost_model}/seed{seed}/"
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = [m for m in tar.getmembers()
                       if m.isfile() and m.name.startswith(prefix) and "/" not in m.name[len(prefix):]]
            if not members:
                return False
            work_dir.mkdir(parents=True, exist_ok=True)
            for m in members:
                with tar.extractfile(m) as src:
                    atomic_write_text(work_dir / m.name[len(prefix):], src.read().decode())
    except (tarfile.TarError, OSError, UnicodeDecodeError) as err:
        raise CwmError(f"{archive} is unreadable ({err}); move it away to tune {work_dir} from scratch") from None
    log.warning("%s: restored %d files from %s", work_dir, len(members), archive)
    return True


def _roofline(tasks, tune_results: dict, peak: tuple[float, float], top: int) -> list[dict]:
    """GFLOP/s of the best tuned kernel of the largest compute-bound tasks, as a fraction of peak."""
    bound = [t for t in tasks if t.kind in COMPUTE_BOUND_KINDS and t.flops > 0]
    bound.sort(key=lambda t: t.flops, reverse=True)
    rows = []
    for t in bound[:top]:
        row = {"task": t.name, "kind": t.kind, "flops": t.flops, "weight": t.weight, "by_cost_model": {}}
        for cm, per_seed in tune_results.items():
            lats = [r.best[t.id]["latency"] for r in per_seed.values() if t.id in r.best]
            if not lats:
                continue
            lat = min(lats)
            gflops = t.flops / lat / 1e9
            row["by_cost_model"][cm] = {"latency_ms": lat * 1e3, "gflops": gflops,
                                        "fraction_of_peak": gflops / peak[0] if peak[0] else None,
                                        "fraction_of_best_peak": gflops / peak[1] if peak[1] else None}
        rows.append(row)
    return rows


# Tasks listed in the report's "where the time goes" table, by their share of the tuned network's time.
TIME_SHARE_TOP = 10


def time_shares(tasks, tune_results: dict, peak: float, top: int = TIME_SHARE_TOP) -> dict:
    """Per contender, the ``top`` tasks by share of its tuned compute time (calls x the best latency over
    its seeds), every kind included, with GFLOP/s and the fraction of the measured matmul ``peak``: where
    the network's time goes after tuning, and how far each kernel is from the machine."""
    out = {}
    for cm, per_seed in tune_results.items():
        best = {}
        for result in per_seed.values():
            for t in tasks:
                if t.id in result.best:
                    best[t.id] = min(best.get(t.id, math.inf), result.best[t.id]["latency"])
        total = sum(t.weight * best[t.id] for t in tasks if t.id in best)
        rows = [{"task": t.name, "kind": t.kind, "weight": t.weight, "latency_ms": best[t.id] * 1e3,
                 "share": t.weight * best[t.id] / total, "gflops": t.flops / best[t.id] / 1e9,
                 "fraction_of_peak": t.flops / best[t.id] / 1e9 / peak if peak else None}
                for t in tasks if t.id in best]
        out[cm] = sorted(rows, key=lambda r: -r["share"])[:top]
    return out


def _split_sha(split: dict, keys=("train", "val")) -> str:
    text = json.dumps({k: sorted(split.get(k, [])) for k in keys}, sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _as_split(split) -> dict | None:
    """A split dict, or one read from a split file (see ``cwm dataset split``)."""
    if split is None or isinstance(split, dict):
        if split is not None and not isinstance(split.get("train"), list):
            raise CwmError("a split has a 'train' list of task ids")
        return split
    from ..data.split import load_split

    return load_split(split)


def leave_network_out_split(split: dict, task_ids) -> dict:
    """``split`` without ``task_ids`` (what a network rules out, ``network_leave_out_ids``) in train and
    val; test is kept as it is and other keys (such as ``names``) are dropped. ``split`` is not changed."""
    drop = set(task_ids)
    out = {k: [t for t in split.get(k, []) if t not in drop] for k in ("train", "val")}
    out["test"] = list(split.get("test", []))
    return out


def network_leave_out_ids(network: str, tasks, train_db) -> set[str]:
    """The tasks of ``train_db`` that holding out ``network`` (its extracted ``tasks``) rules out of
    training (``cwm.data.split.tasks_to_leave_out``): its tasks by id, the tasks the database records
    under its name, and their near-duplicates in other networks."""
    from ..data.dataset import load_tasks
    from ..schedule.tir import buffer_shapes

    infos, modules = load_tasks(train_db)
    shapes = task_shapes(modules)
    for t in tasks:
        infos[t.id] = TaskInfo(t.id, t.name, t.kind, network)
        shapes[t.id] = buffer_shapes(t.mod)
    return tasks_to_leave_out([t.id for t in tasks], infos, shapes, network=network)


def _model_meta(model_dir: Path) -> dict:
    from ..model.world_model import CONFIG_FILE

    path = Path(model_dir) / CONFIG_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CwmError(f"{path} is missing: {model_dir} is not a world model directory") from None
    except (OSError, ValueError) as err:
        raise CwmError(f"{path} is corrupt: {err}") from None
    if not isinstance(meta, dict):
        raise CwmError(f"{path} is corrupt: expected a JSON object")
    return meta


def training_overlap(task_ids, seen, *, path, trained_on) -> dict:
    """How many of ``task_ids`` (a network's compute tasks) are in ``seen`` (the ids a cost model was
    trained on; None: unknown). ``held_out``: none of them (None when unknown)."""
    ids = set(task_ids)
    k = None if seen is None else len(ids & set(seen))
    return {"path": portable_path(path) if path is not None else None, "trained_on": trained_on,
            "tasks_in_training": k, "tasks": len(ids), "held_out": None if k is None else k == 0}


def world_model_overlap(model_dir, task_ids) -> dict:
    """``training_overlap`` of a world model directory by its ``train_split.json`` (train + val), with
    its ``config.trained_on`` and the LLVM CPU (``mcpu``) of its training data."""
    from ..model.world_model import training_tasks

    meta = _model_meta(model_dir)
    out = training_overlap(task_ids, training_tasks(model_dir), path=model_dir,
                           trained_on=meta.get("trained_on") or {})
    out["mcpu"] = (meta.get("hardware") or {}).get("mcpu")
    return out


def xgb_pretrained_overlap(xgb_path, train_db, split: dict, task_ids) -> dict:
    """``training_overlap`` of a pretrained XGBModel file: it was fitted on ``split``'s train records
    of ``train_db`` (``cwm.benchmarks.search.pretrain_xgb_file``; val is not used)."""
    train = split.get("train", [])
    return training_overlap(task_ids, set(train), path=xgb_path,
                            trained_on={"database": str(train_db), "split": "train", "train_tasks": len(train),
                                        "split_sha1": _split_sha(split, ("train",))})


def _pretrained_xgb(train_db, split: dict, directory: Path, target) -> Path:
    """``pretrain_xgb_file`` into ``directory``, named by the training task ids (another split gets
    another file), written under a temporary name first: a killed run leaves no half file to reuse."""
    from .search import pretrain_xgb_file

    path = Path(directory) / f"xgb_pretrained_{_split_sha(split, ('train',))}.tar"
    if path.exists():
        return path
    tmp = path.with_name(path.name + ".partial")
    tmp.unlink(missing_ok=True)
    pretrain_xgb_file(train_db, split, tmp, target)
    tmp.replace(path)
    return path


def leave_out_world_model(train_db, split: dict, out_dir: Path, settings, progress: bool = True) -> Path:
    """A world model trained on ``split`` of ``train_db`` into ``out_dir``, or the one already there
    when it was trained on the same train/val tasks with the same settings (``train`` writes the
    directory atomically, so one that exists is complete)."""
    from ..model.training import TrainSettings, trained_settings
    from ..model.world_model import CONFIG_FILE, TRAIN_SPLIT_FILE

    out_dir = Path(out_dir)
    if (out_dir / CONFIG_FILE).exists():
        try:
            saved = json.loads((out_dir / TRAIN_SPLIT_FILE).read_text())
        except (OSError, ValueError):
            saved = None
        same_split = isinstance(saved, dict) and all(
            sorted(saved.get(k, [])) == sorted(split.get(k, [])) for k in ("train", "val"))
        # a model saved before a settings field was added has it at its default
        trained_on = _model_meta(out_dir).get("trained_on") or {}
        same_settings = (set(trained_on.get("settings") or {}) <= set(TrainSettings.__dataclass_fields__)
                         and trained_settings(trained_on) == settings)
        if not (same_split and same_settings):
            raise CwmError(f"{out_dir} was trained on another split or with other settings; remove it "
                           "(and the network's leave-out work directories) to train it again")
        log.info("%s: reusing the leave-network-out world model", out_dir)
        return out_dir
    if not split.get("train"):
        raise CwmError(f"{out_dir}: no training task is left once the network's tasks are removed")
    from ..model.training import train

    log.info("%s: training a world model on %d train and %d val tasks", out_dir, len(split["train"]),
             len(split.get("val", [])))
    train(train_db, split, out_dir, settings, progress=progress)
    return out_dir


class Contender(NamedTuple):
    """A tuned contender of the benchmark, parsed from ``NAME[+transfer][:T]``."""

    cost_model: str
    trials_per_task: int
    transfer: bool


TRANSFER_SUFFIX = "+transfer"


def parse_contender(contender: str, trials_per_task: int) -> Contender:
    """``xgb-pretrained:32`` is ``xgb-pretrained`` at 32 trials per task (time to quality: ``cwm`` at 8
    against it); ``cwm+transfer`` also measures schedules transferred from the world model's training
    tasks first (``cwm.schedule.transfer``); a plain cost model name is tuned at ``trials_per_task``."""
    name, sep, trials = str(contender).partition(":")
    if sep and (not trials.isdigit() or int(trials) < 1):
        raise CwmError(f"contender {contender!r}: what follows ':' must be the trials per task, a positive integer")
    transfer = name.endswith(TRANSFER_SUFFIX)
    return Contender(name.removesuffix(TRANSFER_SUFFIX), int(trials) if sep else trials_per_task, transfer)


def _kinds(contenders, trials_per_task) -> list[str]:
    return [parse_contender(c, trials_per_task).cost_model for c in contenders]


def _config(trials_per_task, seeds, cost_models, runs, target, peak_n=1024, *, leave_network_out=False,
            split=None) -> dict:
    config = {"trials_per_task": trials_per_task, "layout_trials_per_task": LAYOUT_TRIALS_PER_TASK,
              "seeds": list(seeds), "cost_models": list(cost_models), "runs": runs, "target": str(target),
              "peak_n": peak_n, "timing_block": TIMING_BLOCK}
    # Only when used, so the results of runs without them still match their settings.
    if leave_network_out:
        config["leave_network_out"] = True
    if split is not None and (leave_network_out or "xgb-pretrained" in _kinds(cost_models, trials_per_task)):
        config["training_split_sha1"] = _split_sha(split)
    return config


def run_e2e_benchmark(
    networks=DEFAULT_NETWORKS,
    out_dir="benchmarks/results/e2e",
    *,
    trials_per_task: int = 64,
    seeds=(0,),
    cost_models=("xgb", "cwm"),
    work_root="runs/bench_e2e",
    model_path=None,
    progress: bool = True,
    runs: int = 30,
    warmup: int = 3,
    threads: int = 2,
    target=None,
    num_trials_per_iter: int = 16,
    torch_compile: bool = True,
    onnxruntime: bool = True,
    roofline_top: int = 5,
    peak_n: int = 1024,
    train_db=None,
    split=None,
    leave_network_out: bool = False,
    train_settings=None,
) -> dict:
    """Run (or resume) the end-to-end benchmark; writes e2e.json, e2e.md and e2e.png in ``out_dir``.

    ``networks``: names from ``cwm.workloads.NETWORKS`` or ``(name, torch model, example inputs)``
    tuples (tiny mode for tests). Work directories: ``work_root/<network>/<cost_model>/seed<k>``.
    Libraries: ``out_dir/libs/<network>/``. Returns the summary written to e2e.json.

    ``train_db`` and ``split`` (a dict or a split file): the records the world model was trained on;
    needed by ``xgb-pretrained`` (fitted once on the train split, kept in ``work_root``) and by
    ``leave_network_out``, which for each network trains the ``cwm`` world model
    (``cwm.model.training.train`` with ``train_settings``, default ``TrainSettings()``) and fits
    ``xgb-pretrained`` on ``split`` less the network's tasks; their work directories and libraries
    are then named ``<cost model>-leave-out``, and ``model_path`` is not used.
    """
    if runs < 1 or trials_per_task < 1 or num_trials_per_iter < 1:
        raise CwmError("runs, trials_per_task and num_trials_per_iter must be positive")
    seeds = tuple(int(s) for s in seeds)
    if not seeds:
        raise CwmError("at least one tuning seed is needed")
    if not cost_models:
        raise CwmError("at least one cost model is needed")
    if len(set(cost_models)) != len(cost_models):
        raise CwmError(f"a contender is listed twice: {', '.join(cost_models)}")
    kinds = _kinds(cost_models, trials_per_task)
    for cm in kinds:
        check_cost_model(cm)
    if leave_network_out and not any(cm in LEARNED for cm in kinds):
        raise CwmError("leave_network_out retrains the cwm and xgb-pretrained cost models; neither is in "
                       f"cost_models ({', '.join(cost_models)})")
    if (leave_network_out or "xgb-pretrained" in kinds) and (train_db is None or split is None):
        who = "leave_network_out" if leave_network_out else "the xgb-pretrained cost model"
        raise CwmError(f"{who} needs the training records: pass train_db (the database the world model "
                       "was trained on) and split (its train/val/test split)")
    split = _as_split(split)
    if train_db is not None and split is not None and not Path(train_db).is_dir():
        raise CwmError(f"training database {train_db} does not exist")
    if train_settings is None and leave_network_out and "cwm" in kinds:
        from ..model.training import TrainSettings

        train_settings = TrainSettings()
    if "cwm" in kinds and not leave_network_out:
        from ..model.world_model import default_model_dir

        path = Path(model_path) if model_path is not None else default_model_dir()
        if not Path(path).exists():
            raise CwmError(f"the cwm cost model needs a world model directory; {path} does not exist "
                           "(pass model_path, or leave cwm out of cost_models)")
    for net in networks:  # unknown names fail now, not after hours of tuning the others
        if isinstance(net, str) and net not in NETWORKS:
            zoo.resolve(net)  # a torchvision or transformers name, or a .pt2 file

    # Tuning imports tvm.s_tir.tensor_intrin; its TVMScript parser scans sys.modules on every
    # inspect.getmodule call, which takes minutes once torch and transformers are loaded. Import
    # it while sys.modules is still small (a no-op if it is already imported), after the checks
    # above (it takes ~20 s) and before the world model below (which loads torch).
    import tvm.s_tir.tensor_intrin  # noqa: F401

    model_paths = {}  # cost model -> its model_path for tune (per network with leave_network_out)
    if "cwm" in kinds and not leave_network_out:
        from ..model.world_model import WorldModel

        world_model = WorldModel.load(path)  # a corrupt or outdated model fails now, not after the xgb runs
        model_paths["cwm"] = path
    target = make_target(target) if not hasattr(target, "kind") else target
    out_dir, work_root = Path(out_dir), Path(work_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    set_threads(threads)
    config = _config(trials_per_task, seeds, cost_models, runs, target, peak_n,
                     leave_network_out=leave_network_out, split=split)
    if "xgb-pretrained" in kinds and not leave_network_out:
        model_paths["xgb-pretrained"] = _pretrained_xgb(train_db, split, work_root, target)

    json_path = out_dir / "e2e.json"
    summary = {"config": config, "networks": {}}
    if json_path.exists():
        try:
            old = json.loads(json_path.read_text())
            summary["networks"] = {k: v for k, v in old.get("networks", {}).items()
                                   if v.get("config") == config and v.get("status") == "done"}
            summary["sources"] = {k: v for k, v in old.get("sources", {}).items() if k in summary["networks"]}
        except (json.JSONDecodeError, OSError):
            log.warning("%s is unreadable; starting it over", json_path)
    hw = host_cpu()
    summary["host"] = {"cpu": hw.model, "cores": hw.cores, "threads": threads, "python": platform.python_version()}
    if "cwm" in kinds and not leave_network_out:
        summary["world_model"] = {"path": portable_path(path),
                                  "trained_on": "/".join(world_model.config.machines) or None}
    if "cwm" in kinds and leave_network_out:
        _leave_out_summary_model(summary, work_root)
    peak = peak_matmul_stats(n=peak_n, runs=30, threads=threads)
    summary["peak_matmul_gflops"] = peak["median"]
    # The fastest call too: on a shared machine the median can be depressed by other load.
    summary["peak_matmul_gflops_best"] = peak["best"]
    summary["contenders"] = ([EAGER, COMPILED] + ([ORT] if onnxruntime else []) + [UNTUNED]
                             + [tuned_name(cm) for cm in cost_models])

    for net in networks:
        if isinstance(net, str) or not isinstance(net, (tuple, list)) or len(net) != 3:
            name = _label_of(net) if isinstance(net, str) else net
        else:
            name = str(net[0])
        if isinstance(name, str) and name in summary["networks"]:
            log.info("%s: already benchmarked with these settings, skipped", name)
            continue
        name, model, inputs = _network_spec(net)  # built only when needed
        entry = _benchmark_network(
            name, model, inputs, target=target, config=config, out_dir=out_dir, work_root=work_root,
            trials_per_task=trials_per_task, seeds=seeds, cost_models=cost_models, model_paths=model_paths,
            progress=progress, runs=runs, warmup=warmup, threads=threads, per_iter=num_trials_per_iter,
            torch_compile=torch_compile, onnxruntime=onnxruntime, roofline_top=roofline_top,
            peak=(summary["peak_matmul_gflops"], summary["peak_matmul_gflops_best"]),
            train_db=train_db, split=split, leave_network_out=leave_network_out, train_settings=train_settings,
        )
        summary["networks"][name] = entry
        if "cwm" in kinds and leave_network_out:
            _leave_out_summary_model(summary, work_root)
        _finish(summary, out_dir)
    _finish(summary, out_dir)
    return summary


def _leave_out_summary_model(summary: dict, work_root: Path) -> None:
    """The report's world model line with leave_network_out: one model per network, trained on the
    machine of the first one trained (``combine_e2e_results`` compares it)."""
    mcpus = [e["world_model"].get("mcpu") for e in summary["networks"].values() if e.get("world_model")]
    summary["world_model"] = {"path": portable_path(work_root / "<network>" / LEAVE_OUT_MODEL_DIR),
                              "trained_on": mcpus[0] if mcpus else None, "leave_network_out": True}


def _learned_models(name, all_tasks, tasks, *, cost_models, model_paths, work_root, target, train_db, split,
                    leave_network_out, train_settings, progress):
    """(model path, work directory name) per cost model, and the entry's training-data keys: what
    ``cwm`` and ``xgb-pretrained`` saw of this network; with ``leave_network_out`` their models are
    first trained on ``split`` less every task of the network."""
    kind = {c: parse_contender(c, 1).cost_model for c in cost_models}
    paths = {c: model_paths.get(kind[c]) for c in cost_models}
    labels = {c: c for c in cost_models}
    info = {}
    if not tasks:
        return paths, labels, info
    used_split = split
    if leave_network_out:
        used_split = leave_network_out_split(split, network_leave_out_ids(name, all_tasks, train_db))
        info["leave_network_out"] = {"removed_tasks": {k: len(split.get(k, [])) - len(used_split[k])
                                                       for k in ("train", "val")}}
        trained = {}
        if "cwm" in kind.values():
            trained["cwm"] = leave_out_world_model(train_db, used_split, Path(work_root) / name / LEAVE_OUT_MODEL_DIR,
                                                   train_settings, progress)
        if "xgb-pretrained" in kind.values():
            trained["xgb-pretrained"] = _pretrained_xgb(train_db, used_split, Path(work_root) / name, target)
        paths = {c: trained.get(kind[c], paths[c]) for c in cost_models}
        labels = {c: c + LEAVE_OUT_SUFFIX if kind[c] in LEARNED else c for c in cost_models}
    ids = [t.id for t in tasks]  # compute tasks: the layout tasks never consult a cost model
    path_of = {kind[c]: paths[c] for c in cost_models}
    if "cwm" in path_of:
        info["world_model"] = world_model_overlap(path_of["cwm"], ids)
    if "xgb-pretrained" in path_of:
        info["xgb_pretrained"] = xgb_pretrained_overlap(path_of["xgb-pretrained"], train_db, used_split, ids)
    for key, cm in (("world_model", "cwm"), ("xgb_pretrained", "xgb-pretrained")):
        o = info.get(key)
        if o and o["held_out"] is None:
            log.warning("%s: %s (%s) does not say which tasks it was trained on", name, cm, o["path"])
        elif o and not o["held_out"]:
            log.warning("%s: %s (%s) was trained on %d of its %d compute tasks: its result is not a held-out one",
                        name, cm, o["path"], o["tasks_in_training"], o["tasks"])
    return paths, labels, info


def _benchmark_network(name, model, inputs, *, target, config, out_dir, work_root, trials_per_task, seeds,
                       cost_models, model_paths, progress, runs, warmup, threads, per_iter, torch_compile,
                       roofline_top, peak, train_db=None, split=None, leave_network_out=False,
                       train_settings=None, onnxruntime=True) -> dict:
    t_start = time.time()
    model = model.eval()
    mod_cache = {}

    def mod_fn():
        if "mod" not in mod_cache:
            mod_cache["mod"] = relax_from_torch(model, inputs, target)
        return mod_cache["mod"]

    all_tasks = extract_tasks(mod_fn(), target, network=name)
    tasks = [t for t in all_tasks if tunable(t)]
    budget = trials_per_task * len(tasks)
    layout_budget = config["layout_trials_per_task"] * (len(all_tasks) - len(tasks))
    parsed = {c: parse_contender(c, trials_per_task) for c in cost_models}
    entry = {"config": config, "status": "running", "total_tasks": len(all_tasks), "tunable_tasks": len(tasks),
             "trials_per_cost_model": budget + layout_budget, "layout_trials": layout_budget,
             "trials_per_contender": {c: p.trials_per_task * len(tasks) + layout_budget for c, p in parsed.items()},
             "tuning": {}, "builds": {}, "checks": {}, "latency_ms": {},
             "latency_ms_per_seed": {}, "timing": {}, "errors": {}, "speedup_vs_eager": {},
             # A resumed benchmark measures the peak again; each network keeps the one its roofline used.
             "peak_matmul_gflops": peak[0], "peak_matmul_gflops_best": peak[1]}
    paths, labels, info = _learned_models(
        name, all_tasks, tasks, cost_models=cost_models, model_paths=model_paths, work_root=work_root,
        target=target, train_db=train_db, split=split, leave_network_out=leave_network_out,
        train_settings=train_settings, progress=progress)
    entry.update(info)

    # 1. Tuning, the same budget for every cost model and seed. Seed-major, so the cost models
    # alternate in time (machine drift hits both) and an interrupted run leaves complete seed pairs.
    tune_results: dict[str, dict[int, object]] = {cm: {} for cm in cost_models}
    archive = database_archive_path(out_dir, name)
    for seed in seeds:
        for cm in cost_models:
            wd = work_root / name / labels[cm] / f"seed{seed}"
            if not tasks:
                continue
            _restore_work_dir(archive, wd, _safe(name), labels[cm], seed)
            p = parsed[cm]
            result, total_s, this_s = _tune_timed(all_tasks, p.trials_per_task * len(tasks), wd, p.cost_model,
                                                  paths[cm], target, seed, per_iter, progress, transfer=p.transfer)
            tune_results[cm][seed] = result
            entry["tuning"].setdefault(cm, {})[str(seed)] = {
                "work_dir": str(wd), "seconds": round(total_s, 1), "seconds_this_run": round(this_s, 1),
                "weighted_latency_ms": (result.weighted_latency * 1e3 if result.weighted_latency else None),
                "tasks_with_records": len(result.best),
            }
            _archive_databases(archive, work_root / name, _safe(name))

    # 2. Builds: untuned, and one per cost model and seed.
    lib_dir = out_dir / "libs" / _safe(name)
    libs = {UNTUNED: (lib_dir / "untuned.so", None)}
    for cm in cost_models:
        for seed in seeds:
            wd = work_root / name / labels[cm] / f"seed{seed}"
            libs[_seed_name(cm, seed)] = (lib_dir / f"{labels[cm]}_s{seed}.so", wd if tasks else None)
    weights = _weights_fingerprint(model)  # a network rebuilt with new random weights needs new libraries
    for key, (path, db) in libs.items():
        meta = _build_cached(mod_fn, db, target, path, weights)
        entry["builds"][key] = {k: meta.get(k) for k in ("lib_path", "total_tasks", "tuned_tasks", "missing",
                                                          "fast_math", "weight_prepack", "conv_layout", "prepacked",
                                                          "seconds", "cached")}

    # 3. Correctness against PyTorch.
    tol = tolerance_for(model)
    np_inputs = [x.detach().cpu().numpy() for x in inputs]
    good = {}
    for key, (path, _) in libs.items():
        try:
            out = load_and_run(path, np_inputs)
            entry["checks"][key] = {"ok": True, **check_against_torch(model, inputs, out, **tol)}
            good[key] = path
        except CwmError as err:
            entry["checks"][key] = {"ok": False, "error": str(err), **tol}
            entry["errors"][key] = f"wrong output: {err}"
            log.error("%s %s: %s", name, key, err)

    # 4. Interleaved timing.
    contenders = {EAGER: torch_runner(model, inputs)}
    if torch_compile:
        import torch

        torch._dynamo.reset()
        contenders[COMPILED] = torch_runner(model, inputs, compile=True)
    else:
        entry["errors"][COMPILED] = "disabled"
    if onnxruntime:
        session = _onnxruntime_session(name, model, inputs, lib_dir / "model.onnx", tol, entry, threads)
        if session is not None:
            contenders[ORT] = ort_runner(session, np_inputs)
    for key, path in good.items():
        contenders[key] = tvm_runner(path, np_inputs)
    # Untuned TVM can take a minute a call (BERT): it is timed for about TIMING_BUDGET_S, at least
    # 3 calls, not 30.
    timings, errors = time_interleaved(contenders, runs=runs, warmup=warmup, threads=threads,
                                              max_seconds=TIMING_BUDGET_S, min_runs=3)
    entry["errors"].update(errors)
    entry["timing"] = {k: v.as_json() for k, v in timings.items()}
    lat = {k: v.median_s * 1e3 for k, v in timings.items()}
    entry["latency_ms"] = {k: lat.get(k) for k in (EAGER, COMPILED) + ((ORT,) if onnxruntime else ()) + (UNTUNED,)}
    for cm in cost_models:
        per_seed = {str(s): lat.get(_seed_name(cm, s)) for s in seeds}
        entry["latency_ms_per_seed"][tuned_name(cm)] = per_seed
        entry["latency_ms"][tuned_name(cm)] = geomean(per_seed.values())
    eager = entry["latency_ms"][EAGER]
    for k, v in entry["latency_ms"].items():
        entry["speedup_vs_eager"][k] = eager / v if eager and v else None
    if torch_compile:
        import torch

        torch._dynamo.reset()

    # 5. Roofline of the largest compute-bound tasks, and where the time goes: by the database, and
    # measured inside the network call of the first cost model's fastest seed.
    entry["roofline"] = _roofline(tasks, tune_results, peak, roofline_top)
    entry["time_shares"] = time_shares(tasks, tune_results, peak[0])
    if cost_models:
        entry["profile"] = _profile_fastest_seed(entry, cost_models[0], good, np_inputs, runs, warmup)
    entry["tuning_seconds"] = round(sum(t["seconds"] for per_seed in entry["tuning"].values()
                                        for t in per_seed.values()), 1)
    entry["seconds"] = round(time.time() - t_start, 1)
    entry["status"] = "done"
    return entry


def _profile_fastest_seed(entry: dict, cost_model: str, libraries: dict, np_inputs, runs: int, warmup: int) -> dict:
    """``profile_network`` of the cost model's fastest seed (its kernels' time inside the network call)."""
    per_seed = {s: v for s, v in entry["latency_ms_per_seed"].get(tuned_name(cost_model), {}).items() if v}
    if not per_seed:
        return {"error": f"{cost_model} has no timed library"}
    key = _seed_name(cost_model, int(min(per_seed, key=per_seed.get)))
    try:
        return {"library": key, **profile_network(libraries[key], np_inputs, runs=runs, warmup=warmup).as_json()}
    except CwmError as err:
        log.error("profiling %s: %s", key, err)
        return {"library": key, "error": str(err)}


def _onnxruntime_session(name, model, inputs, path: Path, tol: dict, entry: dict, threads: int):
    """The ONNX Runtime contender: the model exported with ``torch.onnx.export`` (once, beside the
    libraries), a session with the CPU execution provider, ORT_ENABLE_ALL and ``threads`` intra-op
    threads, its outputs checked against PyTorch like the TVM builds'. None (and the error recorded)
    when export, session or check fails."""
    from ..frontend.onnx_model import export_onnx, ort_session

    np_inputs = [x.detach().cpu().numpy() for x in inputs]
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(path) as tmp:
                export_onnx(model, inputs, tmp)
        session = ort_session(path, threads)
        outputs = session.run(None, {i.name: x for i, x in zip(session.get_inputs(), np_inputs)})
        entry["checks"][ORT] = {"ok": True, **check_outputs(torch_outputs(model, inputs), outputs, **tol)}
        return session
    except CwmError as err:
        entry["checks"][ORT] = {"ok": False, "error": str(err), **tol}
        entry["errors"][ORT] = str(err)
    except Exception as err:  # onnxruntime's own errors
        entry["errors"][ORT] = f"{type(err).__name__}: {first_line(err)}"[:500]
    log.error("%s %s: %s", name, ORT, entry["errors"][ORT])
    return None


def combine_e2e_results(sources, out_dir) -> dict:
    """One report from the finished networks of several ``e2e.json`` files (see ``run_e2e_benchmark``).

    Each network keeps the figures of the run that measured it: its contenders were timed against
    each other in one process, and its roofline against that run's own matmul peak, so its
    speed-ups stand on their own; the geometric mean is taken over them. The runs must share the
    settings (budget, seeds, cost models, target, timing), the host and the world model's
    hardware, and no network may come from two files. Writes e2e.json, e2e.md and e2e.png in
    ``out_dir``; ``sources`` in e2e.json says which file each network came from.
    """
    summaries = []
    for path in map(Path, sources):
        path = path / "e2e.json" if path.is_dir() else path
        try:
            summary = json.loads(path.read_text())
        except FileNotFoundError:
            raise CwmError(f"{path} does not exist") from None
        except (OSError, ValueError) as err:  # ValueError: not JSON, or not text at all
            raise CwmError(f"{path} is not a readable e2e.json: {err}") from None
        if not isinstance(summary, dict) or not isinstance(summary.get("networks"), dict):
            raise CwmError(f"{path} is not a readable e2e.json: it has no 'networks' object")
        summaries.append((path, summary))
    if not summaries:
        raise CwmError("no e2e.json to combine")

    def fail_unless_same(what: str, get) -> None:
        values = {json.dumps(get(s), sort_keys=True): str(path) for path, s in summaries}
        if len(values) > 1:
            raise CwmError(f"the runs differ in {what}: " + "; ".join(f"{v}: {k}" for k, v in values.items()))

    fail_unless_same("host", lambda s: s.get("host"))
    fail_unless_same("contenders", lambda s: s.get("contenders"))
    fail_unless_same("world model hardware", lambda s: (s.get("world_model") or {}).get("trained_on"))
    first_path, first = summaries[0]
    combined = {k: first[k] for k in ("config", "host", "contenders", "peak_matmul_gflops", "peak_matmul_gflops_best")
                if k in first}
    if first.get("world_model"):
        combined["world_model"] = first["world_model"]
    combined["networks"], combined["sources"] = {}, {}
    for path, summary in summaries:
        for name, entry in summary.get("networks", {}).items():
            if entry.get("status") != "done":
                log.warning("%s: %s is not finished there; left out", path, name)
                continue
            if name in combined["networks"]:
                raise CwmError(f"{name} is in both {combined['sources'][name]} and {path}; combine one of them")
            if entry.get("config") != first["config"]:
                raise CwmError(f"{name} in {path} was run with other settings than {first_path}: "
                               f"{entry.get('config')} against {first['config']}")
            entry = dict(entry)
            # Entries written before each network kept its own peak used their run's.
            entry.setdefault("peak_matmul_gflops", summary["peak_matmul_gflops"])
            entry.setdefault("peak_matmul_gflops_best", summary.get("peak_matmul_gflops_best", float("nan")))
            combined["networks"][name] = entry
            combined["sources"][name] = str(path)
    if not combined["networks"]:
        raise CwmError("none of the runs has a finished network")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _finish(combined, out_dir)
    return combined


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _finish(summary: dict, out_dir: Path) -> None:
    contenders = summary["contenders"]
    nets = summary["networks"]
    summary["geomean_speedup_vs_eager"] = {
        c: geomean(e["speedup_vs_eager"].get(c) for e in nets.values()) for c in contenders
    }
    atomic_write_text(out_dir / "e2e.json", json.dumps(summary, indent=1, default=_json_default) + "\n")
    atomic_write_text(out_dir / "e2e.md", markdown(summary))
    plot(summary, out_dir / "e2e.png")


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


_LABELS = {EAGER: "PyTorch eager", COMPILED: "torch.compile", ORT: "ONNX Runtime", UNTUNED: "TVM untuned"}


def _label(c: str) -> str:
    return _LABELS.get(c, f"TVM tuned ({c[4:]})" if c.startswith("tvm_") else c)


def _saw(cost_model: str, o: dict) -> str:
    who = f"{cost_model} `{o.get('path')}`"
    if o.get("held_out") is None:
        return f"{who} does not say which tasks it was trained on"
    if o["held_out"]:
        return f"{who}: held out (none of its {o['tasks']} tasks)"
    return f"{who} saw {o['tasks_in_training']} of {o['tasks']} tasks of this network"


def training_line(name: str, entry: dict) -> str | None:
    """One line of what ``cwm`` and ``xgb-pretrained`` saw of a network, or None (neither ran)."""
    parts = [_saw(cm, entry[key]) for key, cm in (("world_model", "cwm"), ("xgb_pretrained", "xgb-pretrained"))
             if entry.get(key)]
    removed = (entry.get("leave_network_out") or {}).get("removed_tasks")
    if parts and removed:
        parts[-1] += f" (left out of training: {removed.get('train', 0)} train, {removed.get('val', 0)} val tasks)"
    return f"{name}: " + "; ".join(parts) if parts else None


def markdown(summary: dict) -> str:
    contenders = summary["contenders"]
    cfg = summary["config"]
    lines = [
        "# End-to-end latency against PyTorch",
        "",
        f"Batch 1, fp32, {summary['host']['threads']} threads on {summary['host']['cpu']}; median of "
        f"{cfg['runs']} runs, in blocks of {cfg.get('timing_block', 1)} calls per contender, interleaved "
        f"(a contender slower than 2 s a call: at least 3 runs, about "
        f"{TIMING_BUDGET_S:.0f} s; `timing` in e2e.json has each count). Tuning budget per cost model and "
        f"seed (seeds {cfg['seeds']}): {cfg['trials_per_task']} trials x compute task, plus "
        f"{cfg.get('layout_trials_per_task', 0)} trials x layout task (reshape, transpose and other moves). "
        "Cells: latency in ms (speed-up over PyTorch eager).",
        "",
    ]
    if summary.get("world_model"):
        wm = summary["world_model"]
        lines += [f"World model of `cwm`: `{wm['path']}` (trained on `{wm['trained_on']}`).", ""]
    if cfg.get("leave_network_out"):
        lines += [("Leave-network-out: for each network, `cwm`'s world model and `xgb-pretrained`'s XGBoost "
                   "model were trained on the split less every task of that network (by id and by the network "
                   "name the training database records) and their near-duplicates in other networks (same "
                   f"kind and buffer shapes, one dimension within {NEAR_DUPLICATE_TOLERANCE:.0%})."), ""]
    seen = [line for name, e in summary["networks"].items() if (line := training_line(name, e))]
    if seen:
        lines += ["What the learned cost models saw of each network (its compute tasks in their training data):",
                  ""] + [f"- {line}" for line in seen] + [""]
    if summary.get("sources"):
        lines += ["Networks measured in other runs with the same settings and host, each as measured there: " + ", ".join(
            f"{name} from `{path}`" for name, path in summary["sources"].items()) + ".", ""]
    lines += [
        "| network | tasks (tunable) | tuning s | " + " | ".join(_label(c) for c in contenders) + " |",
        "|---|---|---|" + "---|" * len(contenders),
    ]
    for name, e in summary["networks"].items():
        cells = []
        for c in contenders:
            v, s = e["latency_ms"].get(c), e["speedup_vs_eager"].get(c)
            if v is None:
                reason = e["errors"].get(c) or next((msg for k, msg in e["errors"].items() if k.startswith(c + "@")), "")
                cells.append(f"n/a ({reason[:60]})" if reason else "n/a")
            else:
                cells.append(f"{v:.3f} ({s:.2f}x)")
        tuning_s = e.get("tuning_seconds")
        lines.append(f"| {name} | {e['total_tasks']} ({e['tunable_tasks']}) | "
                     f"{'-' if tuning_s is None else f'{tuning_s:.0f}'} | " + " | ".join(cells) + " |")
    geo = summary.get("geomean_speedup_vs_eager", {})
    lines.append("| **geometric mean** | | | " + " | ".join(
        f"**{geo[c]:.2f}x**" if geo.get(c) else "n/a" for c in contenders) + " |")
    latest = (summary["peak_matmul_gflops"], summary.get("peak_matmul_gflops_best", float("nan")))
    peaks = {}  # (median, fastest call) -> networks whose roofline used it; older entries used the latest
    for name, e in summary["networks"].items():
        peak = (e.get("peak_matmul_gflops", latest[0]), e.get("peak_matmul_gflops_best", latest[1]))
        peaks.setdefault(peak, []).append(name)
    peaks = peaks or {latest: []}
    measured = "; ".join(f"{m:.1f} GFLOP/s (fastest call {b:.1f})" + (f" for {', '.join(n)}" if len(peaks) > 1 else "")
                         for (m, b), n in peaks.items())
    lines += ["", f"Measured torch fp32 matmul peak ({cfg.get('peak_n', 1024)}^3, median of 30, in the run that "
              f"benchmarked each network): {measured}. Kernel GFLOP/s come from "
              "the tuning database (best measured latency); a fraction above 100% means the tuned kernel "
              "beats torch's matmul on this CPU (or the peak measurement was slowed by other load).", "",
              "## Tuning wall time (s) and tuned tasks", "",
              "| network | cost model | seed | trials | tuning s | tuned / total tasks in the build | check |",
              "|---|---|---|---|---|---|---|"]
    for name, e in summary["networks"].items():
        for cm, per_seed in e["tuning"].items():
            for seed, t in per_seed.items():
                key = f"tvm_{cm}@s{seed}"
                b, chk = e["builds"].get(key, {}), e["checks"].get(key, {})
                ok = "ok" if chk.get("ok") else "MISMATCH" if chk else "-"
                if chk.get("ok"):
                    ok += f" (max diff {chk['max_abs_diff']:.1e})"
                prepacked = f", {len(b['prepacked'])} with prepacked weights" if b.get("prepacked") else ""
                layout = f", convolutions in {b['conv_layout']}" if b.get("conv_layout") else ""
                trials = e.get("trials_per_contender", {}).get(cm, e["trials_per_cost_model"])
                lines.append(f"| {name} | {cm} | {seed} | {trials} | {t['seconds']:.0f} | "
                             f"{b.get('tuned_tasks')} / {b.get('total_tasks')}{prepacked}{layout} | {ok} |")
    lines += ["", "## Roofline: best tuned kernels of the largest compute-bound tasks", "",
              "| network | task | kind | GFLOP | " + " | ".join(
                  f"{cm} GFLOP/s (of peak)" for cm in cfg["cost_models"]) + " |",
              "|---|---|---|---|" + "---|" * len(cfg["cost_models"])]
    for name, e in summary["networks"].items():
        for r in e.get("roofline", []):
            cells = []
            for cm in cfg["cost_models"]:
                v = r["by_cost_model"].get(cm)
                cells.append(f"{v['gflops']:.1f} ({v['fraction_of_peak'] * 100:.0f}%)" if v else "n/a")
            lines.append(f"| {name} | {r['task'].split('/', 1)[-1]} | {r['kind']} | {r['flops'] / 1e9:.3f} | "
                         + " | ".join(cells) + " |")
    lines += time_share_lines(summary)
    return "\n".join(lines) + "\n"


def time_share_lines(summary: dict) -> list[str]:
    """The report's "where the time goes" section: for each network, the first contender's tasks."""
    lines = []
    for name, e in summary["networks"].items():
        shares = e.get("time_shares") or {}
        if not shares:
            continue
        cm = next(iter(shares))
        profile = e.get("profile") or {}
        in_network = {k["name"].removesuffix(PREPACKED_SUFFIX): k["ms"] / k["calls"]
                      for k in profile.get("kernels", []) if k["calls"]}
        lines += ["", f"## Where the time goes: {name}, tuned with `{cm}` (best of its seeds)", ""]
        if "call_ms" in profile:
            lines += [f"Measured inside the network call of `{profile['library']}` (`cwm run --profile`): "
                      f"{profile['call_ms']:.3f} ms a call, of which {profile['kernel_ms']:.3f} ms in the compiled "
                      f"kernels and {profile['outside_ms']:.3f} ms outside them (the VM's builtins "
                      f"{profile['builtin_ms']:.3f} ms). The database's ms are each kernel's best alone.", ""]
        lines += ["| task | kind | calls | ms a call (database) | ms a call (in the network) | share | "
                  "GFLOP/s (of peak) |", "|---|---|---|---|---|---|---|"]
        for r in shares[cm]:
            frac = f" ({r['fraction_of_peak'] * 100:.0f}%)" if r.get("fraction_of_peak") else ""
            task = r["task"].split("/", 1)[-1]
            measured = in_network.get(task)
            lines.append(f"| {task} | {r['kind']} | {r['weight']:g} | {r['latency_ms']:.4f} | "
                         f"{'' if measured is None else f'{measured:.4f}'} | "
                         f"{r['share'] * 100:.1f}% | {r['gflops']:.1f}{frac} |")
    return lines


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contenders = [c for c in summary["contenders"] if c != EAGER]
    groups = list(summary["networks"]) + ["geomean"]
    values = []
    for c in contenders:
        row = [summary["networks"][n]["speedup_vs_eager"].get(c) for n in summary["networks"]]
        row.append(summary.get("geomean_speedup_vs_eager", {}).get(c))
        values.append([v if v else np.nan for v in row])
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(groups) + 3.5), 4))
    width = 0.8 / max(1, len(contenders))
    x = np.arange(len(groups))
    for i, (c, row) in enumerate(zip(contenders, values)):
        ax.bar(x + (i - (len(contenders) - 1) / 2) * width, row, width, label=_label(c))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(x)
    ax.set_xticklabels(groups)
    ax.set_ylabel("speed-up over PyTorch eager")
    finite = [v for row in values for v in row if v == v]
    if finite and max(finite) / max(min(finite), 1e-9) > 20:
        ax.set_yscale("log")
    ax.set_title(f"End-to-end latency, batch 1, {summary['host']['threads']} threads")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: bars fill the axes
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
