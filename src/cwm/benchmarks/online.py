"""Online adaptation replayed on finished search runs (``cwm bench online-adaptation``).

Each run's measured candidates are taken in measurement order. After the first ``K`` of them, each
adapter is fitted on those and ranks the next ``next_n``: the round the search would pick next. The
frozen prior is the floor; ``boost-copy`` is the earlier update (continue boosting a copy of the
pretrained ranker on all its columns); ``task-adapter`` is ``TaskAdapter``, what the cost model uses;
``task-ensemble`` scores bootstrapped adapters pessimistically (``PessimisticEnsemble``).
Only tasks outside the world model's training and validation tasks count. Intervals resample tasks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from ..errors import CwmError
from ..io import atomic_write_text

log = logging.getLogger(__name__)

ADAPTERS = ("frozen", "boost-copy", "task-adapter", "task-ensemble")  # the frozen prior, then cost_model.ADAPTATIONS
BASELINE = "boost-copy"
PROPOSERS = ("cwm", "other")  # whose search proposed the candidates: cwm's own, or another cost model's


def proposer_of(contender: str) -> str:
    return "cwm" if contender.startswith("cwm") else "other"


def adapted_scores(adapter: str, model, X: np.ndarray, lat: np.ndarray, k: int, next_n: int,
                   rounds: int) -> np.ndarray:
    """Scores of rows ``k:k+next_n`` after fitting ``adapter`` on rows ``:k``."""
    from ..tuning.cost_model import adapt_ranker

    test = slice(k, k + next_n)
    if adapter == "frozen":
        return model.ranker.predict(X[test])
    return adapt_ranker(adapter, model, X[:k], lat[:k], rounds).predict(X[test])


def replay_online_adaptation(roots, out_dir, *, model_path=None, ks=(16, 32, 48), next_n: int = 16,
                             rounds: int = 20, resamples: int = 1000, progress: bool = True) -> dict:
    """Replay every finished run under ``roots`` (``*/b*/CONTENDER/seed*/run.json``, as ``cwm bench
    search`` writes them); writes ``online_adaptation.json``, ``.md`` and ``.png`` into ``out_dir``."""
    from tqdm import tqdm

    from ..data.dataset import load_dataset
    from ..model.metrics import bootstrap_ci, bootstrap_difference, bootstrap_indices, pairwise_accuracy
    from ..model.world_model import WorldModel, default_model_dir, training_tasks

    run_files = sorted({p for root in roots for p in Path(root).glob("**/b*/*/seed*/run.json")})
    if not run_files:
        raise CwmError(f"no finished search runs (…/b*/CONTENDER/seed*/run.json) under {', '.join(map(str, roots))}")
    model_dir = Path(model_path) if model_path else default_model_dir()
    model = WorldModel.load(model_dir)
    seen = training_tasks(model_dir)
    if seen is None:
        raise CwmError(f"{model_dir} names no training tasks (train_split.json), so held-out tasks cannot be told apart")
    rows, skipped = [], set()
    for run_json in tqdm(run_files, desc="runs", disable=not progress):
        info = json.loads(run_json.read_text())
        ds = load_dataset(run_json.parent).valid()
        for tid, trajs in ds.by_task.items():
            if tid in seen:
                skipped.add(info["task"])
                continue
            trajs = sorted(trajs, key=lambda t: t.record_index)
            X = model.features(ds.initial_states[tid], [t.actions for t in trajs], ds.hardware)
            lat = np.array([t.latency for t in trajs])
            for k in ks:
                if len(trajs) < k + max(2, next_n // 2):
                    continue
                nxt = lat[k:k + next_n]
                for adapter in ADAPTERS:
                    s = adapted_scores(adapter, model, X, lat, k, next_n, rounds)
                    rows.append({"task": info["task"], "contender": info["contender"], "seed": info["seed"],
                                 "proposer": proposer_of(info["contender"]), "k": k, "adapter": adapter,
                                 "pairwise": pairwise_accuracy(s, nxt, np.zeros(len(nxt))),
                                 "top2": float(nxt.min() / nxt[np.argsort(-s)[:2]].min())})
    if not rows:
        raise CwmError("no run has a held-out task with enough measured candidates to replay")
    summary = {"config": {"ks": list(ks), "next_n": next_n, "rounds": rounds, "resamples": resamples,
                          "model": str(model_path) if model_path else "shipped default",
                          "trained_on": "/".join(model.config.machines) or None,
                          "runs": len(run_files)},
               "skipped_in_training": sorted(skipped), "results": [], "rows": rows}
    for proposer in PROPOSERS:
        for k in ks:
            sub = [r for r in rows if r["proposer"] == proposer and r["k"] == k]
            tasks = sorted({r["task"] for r in sub})
            if not tasks:
                continue
            idx = bootstrap_indices(len(tasks), resamples)

            def per_task(adapter, metric):
                return np.array([np.mean([r[metric] for r in sub if r["task"] == t and r["adapter"] == adapter])
                                 for t in tasks])

            for adapter in ADAPTERS:
                entry = {"proposer": proposer, "k": k, "adapter": adapter, "tasks": len(tasks),
                         "runs": sum(r["adapter"] == adapter for r in sub)}
                for metric in ("pairwise", "top2"):
                    mean, lo, hi = bootstrap_ci(per_task(adapter, metric), indices=idx)
                    d, dlo, dhi = bootstrap_difference(per_task(adapter, metric), per_task(BASELINE, metric),
                                                       indices=idx)
                    entry[metric] = {"mean": mean, "lo": lo, "hi": hi,
                                     f"vs_{BASELINE}": {"mean": d, "lo": dlo, "hi": dhi}}
                summary["results"].append(entry)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "online_adaptation.json", json.dumps(summary, indent=1, default=float))
    atomic_write_text(out / "online_adaptation.md", online_markdown(summary))
    plot_online(summary, out / "online_adaptation.png")
    return summary


def online_markdown(summary: dict) -> str:
    cfg = summary["config"]
    lines = ["# Online adaptation replayed on search runs", "",
             f"{cfg['runs']} runs; after K measured candidates each adapter ranks the next {cfg['next_n']} "
             f"({cfg['rounds']} boosting rounds). Held-out tasks only; 90% intervals resample tasks. "
             f"Model: {cfg['model']}.", ""]
    if summary["skipped_in_training"]:
        lines += [f"Left out (in the model's training tasks): {', '.join(summary['skipped_in_training'])}.", ""]
    lines += ["| proposer | K | adapter | tasks | runs | pairwise | vs boost-copy | top-2 | vs boost-copy |",
              "|---|---|---|---|---|---|---|---|---|"]

    def cell(m, key=None):
        v = m if key is None else m[key]
        return f"{v['mean']:+.3f} [{v['lo']:+.3f}, {v['hi']:+.3f}]" if key else \
            f"{v['mean']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]"

    for e in summary["results"]:
        diff = f"vs_{BASELINE}"
        lines.append(f"| {e['proposer']} | {e['k']} | {e['adapter']} | {e['tasks']} | {e['runs']} | "
                     f"{cell(e['pairwise'])} | {cell(e['pairwise'], diff)} | {cell(e['top2'])} | "
                     f"{cell(e['top2'], diff)} |")
    return "\n".join(lines) + "\n"


def plot_online(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    proposers = [p for p in PROPOSERS if any(e["proposer"] == p for e in summary["results"])]
    fig, axes = plt.subplots(1, len(proposers), figsize=(5 * len(proposers), 3.6), squeeze=False)
    for ax, proposer in zip(axes[0], proposers):
        entries = [e for e in summary["results"] if e["proposer"] == proposer]
        ks = sorted({e["k"] for e in entries})
        width = 0.8 / len(ADAPTERS)
        for i, adapter in enumerate(ADAPTERS):
            es = [next(e for e in entries if e["k"] == k and e["adapter"] == adapter) for k in ks]
            mean = np.array([e["pairwise"]["mean"] for e in es])
            err = np.array([[m - e["pairwise"]["lo"], e["pairwise"]["hi"] - m] for m, e in zip(mean, es)]).T
            offset = (i - (len(ADAPTERS) - 1) / 2) * width
            ax.bar(np.arange(len(ks)) + offset, mean, width, yerr=err, capsize=3, label=adapter)
        ax.axhline(0.5, color="gray", lw=0.8, ls="--")
        ax.set_xticks(np.arange(len(ks)), [f"K={k}" for k in ks])
        ax.set_ylabel("pairwise accuracy on the next candidates")
        ax.set_title(f"candidates proposed by {proposer}")
        ax.set_ylim(0.3, 0.85)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
