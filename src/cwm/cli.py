"""The ``cwm`` command line: each command is a thin wrapper over a library function."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from .compiler.api import format_table, task_rows
from .data.database import RECORD_FILE, merge_databases
from .data.dataset import load_dataset
from .data.reference import REFERENCE_ARCHIVE, SHIPPED_TRAINING_DB, SHIPPED_TRAINING_SPLIT, pack_database, resolve_db
from .data.split import load_split, make_split, task_shapes
from .data.stats import format_dataset_stats, plot_dataset_stats
from .deploy.build import build_network, random_inputs
from .deploy.check import check_against_torch, tolerance_for
from .deploy.runtime import load_and_run
from .errors import CwmError
from .frontend.files import MODEL_FILES, is_model_file, load_model_file
from .hardware import make_target
from .io import atomic_write_text
from .tuning.collect import collect as run_collect
from .tuning.collect import collected_task_ids
from .tuning.measure import RPCAddress
from .tuning.registry import cost_model_help, cost_model_names
from .tuning.tuner import tune as run_tune
from .tuning.tuner import tune_network
from .workloads import (
    OPERATORS,
    load_tir_file,
    network_tasks,
    registry_tasks,
    resolve_task,
    tunable,
)
from .workloads.networks import get_network, torch_model
from .workloads.reference import reference_tasks

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Compiler world models for tensor program search.")
workloads_app = typer.Typer(no_args_is_help=True, help="Operator registry and networks.")
dataset_app = typer.Typer(no_args_is_help=True, help="Action-state trajectory dataset.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks writing JSON, PNG and markdown under benchmarks/results/.")
app.add_typer(workloads_app, name="workloads")
app.add_typer(dataset_app, name="dataset")
app.add_typer(bench_app, name="bench")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _quiet_tvm_logs() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("tvm.s_tir.meta_schedule", "tvm"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _tasks_from(names: list[str], network: Optional[str], target=None):
    tasks = []
    if network is not None:  # an empty name is an unknown network, not no network
        tasks += [t for t in network_tasks(network, target) if tunable(t)]
    for name in names:
        if name == "reference":
            tasks += reference_tasks(target)
        elif name == "registry":
            tasks += registry_tasks()
        else:
            tasks.append(resolve_task(name, target))
    return tasks


@workloads_app.command("list")
def workloads_list(
    network: Optional[str] = typer.Option(None, help="List the tasks of this network instead of the registry."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON lines."),
):
    """List registry operators (with default shapes) or the tasks of a network."""
    if network is not None:
        rows = [t.summary() for t in network_tasks(network)]
    else:
        rows = []
        for op in OPERATORS.values():
            t = op.task()
            rows.append({**t.summary(), "source": op.source})
    for row in rows:
        if as_json:
            typer.echo(json.dumps(row))
        else:
            typer.echo(f"{row['id']}  {row['kind']:<17} w={row['weight']:<5g} {row['flops'] / 1e6:>9.2f} MFLOP  {row['name']}")


@app.command()
def collect(
    tasks: list[str] = typer.Argument(None, help="Workload specs, network task names, 'reference' or 'registry' (every operator and shape preset)."),
    db: Path = typer.Option(..., "--db", help="MetaSchedule JSON database directory (created or resumed)."),
    network: Optional[str] = typer.Option(None, help="Collect every tunable task of this network."),
    random: int = typer.Option(100, help="Random design-space samples per task."),
    evolutionary: int = typer.Option(100, help="Evolutionary-search candidates per task."),
    batch: int = typer.Option(32, help="Candidates measured per batch (committed together)."),
    seed: int = typer.Option(0),
    target: Optional[str] = typer.Option(None, help="'cpu' (default, this host), 'cuda' or target JSON."),
    rpc: Optional[str] = typer.Option(None, help="Measure through a TVM RPC tracker HOST:PORT:KEY."),
    jobs: int = typer.Option(1, help="Tasks collected at once (each its own process; needs --rpc)."),
    skip_collected: list[Path] = typer.Option(None, "--skip-collected",
                                              help="Skip tasks that have records in this database (repeatable)."),
):
    """Measure candidates into a resumable MetaSchedule database."""
    _quiet_tvm_logs()
    tgt = make_target(target)
    chosen = _tasks_from(tasks or [], network, tgt)
    if not chosen:
        _fail("no tasks given; name workloads, 'reference', or --network")
    if skip_collected:
        known = collected_task_ids(d for d in skip_collected if d.resolve() != db.resolve())
        chosen = list({t.id: t for t in chosen if t.id not in known}.values())
        if not chosen:
            typer.echo(json.dumps({"measured": 0, "skipped": "every task has records in --skip-collected"}))
            return
    report = run_collect(chosen, db, n_random=random, n_evolutionary=evolutionary, batch=batch, seed=seed,
                         target=tgt, rpc=RPCAddress.parse(rpc) if rpc else None, jobs=jobs)
    typer.echo(json.dumps({k: v for k, v in report.as_json().items() if k != "per_task"}))


DEFAULT_WORKLOAD = "dense_relu:M=128,N=512,K=256"
MODEL_FILE_HELP = ("A model file: " + ", ".join(f"{s} ({d})" for s, (_, d) in MODEL_FILES.items()) + ".")
WORLD_MODEL_HELP = "World model directory (default: the shipped model for this host); --model is the old spelling."


def _input_shapes(specs: list[str] | None) -> dict:
    """``NAME=1x3x224x224`` options as {name: [1, 3, 224, 224]}."""
    shapes = {}
    for spec in specs or []:
        name, sep, dims = spec.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = [int(d) for d in dims.lower().split("x")]
        except ValueError:
            _fail(f"--input-shape takes NAME=DxDx..., e.g. input=1x3x224x224, got {spec!r}")
    return shapes


def _load_model_file(path: Path, target, input_shape: list[str] | None):
    shapes = _input_shapes(input_shape)
    return load_model_file(path, target=target, **({"input_shapes": shapes} if shapes else {}))


@app.command()
def tune(
    workload: Optional[str] = typer.Argument(None, help=f"Registry workload, network task or model file "
                                             f"({', '.join(MODEL_FILES)}) (default {DEFAULT_WORKLOAD})."),
    network: Optional[str] = typer.Option(None, help="Tune a network: its compute tasks share --trials (at least 4 each, the rest by estimated time); "
                                          "its layout tasks get 8 trials each on top."),
    tir: Optional[Path] = typer.Option(None, "--tir", help="A TVMScript file with your own kernel."),
    model_file: Optional[Path] = typer.Option(None, "--model-file", help=MODEL_FILE_HELP + " Tuned like --network."),
    input_shape: list[str] = typer.Option(None, "--input-shape", help="NAME=1x3x224x224: the shape of a model "
                                          "file's input with dynamic dimensions (repeatable)."),
    trials: int = typer.Option(64, help="Measurement budget in total."),
    cost_model: str = typer.Option("cwm", help=cost_model_help()),
    model: Optional[Path] = typer.Option(None, "--world-model", "--model", help=WORLD_MODEL_HELP),
    target: Optional[str] = typer.Option(None, help="'cpu' (default, this host), 'cuda' or target JSON."),
    rpc: Optional[str] = typer.Option(None, help="Measure through a TVM RPC tracker HOST:PORT:KEY."),
    work_dir: Path = typer.Option(Path("runs/tune"), help="Database and report directory (resumable)."),
    seed: int = typer.Option(0),
    per_iter: int = typer.Option(32, help="Candidates measured per search iteration."),
    finetune_transition: bool = typer.Option(False, help="cwm: also fine-tune the transition online on the "
                                             "measured candidates' replayed states (slower per round)."),
    transfer: bool = typer.Option(False, "--transfer/--no-transfer", help="Measure first, from each task's "
                                  "budget, the best schedules of the most similar tasks tuned before it in the run "
                                  "or seen by the world model, refitted to the task's loops (off by default: see "
                                  "docs/deployment.md)."),
):
    """Tune a workload, a network or a TVMScript kernel; writes a database and a report."""
    _quiet_tvm_logs()
    if trials <= 0:
        _fail(f"--trials must be positive, got {trials}")
    if finetune_transition and cost_model != "cwm":
        _fail(f"--finetune-transition needs --cost-model cwm, got {cost_model}")
    address = RPCAddress.parse(rpc) if rpc else None
    if address:
        address.check_reachable()
    tgt = make_target(target)
    settings = dict(work_dir=work_dir, cost_model=cost_model, model_path=model, target=tgt, rpc=address, seed=seed,
                    num_trials_per_iter=per_iter, finetune_transition=finetune_transition, transfer=transfer)
    if model_file is None and workload is not None and is_model_file(workload):
        model_file, workload = Path(workload), None
    layout = None
    if tir is not None:
        tasks = [load_tir_file(tir)]
        result = run_tune(tasks, trials=trials, **settings)
    elif model_file is not None:
        from .workloads.pipeline import extract_tasks

        imported = _load_model_file(model_file, tgt, input_shape)
        result, layout = tune_network(extract_tasks(imported.mod, tgt, network=imported.name), trials=trials,
                                      **settings)
        tasks = result.tasks
    elif network is not None:  # an empty name is an unknown network, not no network
        named = _tasks_from([workload] if workload is not None else [], None, tgt)
        result, layout = tune_network(network_tasks(network, tgt) + named, trials=trials, **settings)
        tasks = result.tasks
    else:
        tasks = _tasks_from([workload if workload is not None else DEFAULT_WORKLOAD], None, tgt)
        result = run_tune(tasks, trials=trials, **settings)
    if layout is not None:
        typer.echo(f"{len(layout.tasks)} layout tasks: {len(layout.best)} tuned, "
                   f"{len(layout.tasks) - len(layout.best)} without a valid candidate")
    if len(tasks) > 1:  # a network: where its time goes, largest share first
        typer.echo(format_table(task_rows(tasks, work_dir)))
        if result.weighted_latency:
            typer.echo(f"weighted total: {result.weighted_latency * 1e3:.3f} ms")
    else:
        task, best = tasks[0], result.best.get(tasks[0].id)
        if best:
            typer.echo(f"{task.name}: best {best['latency'] * 1e3:.4f} ms ({best['gflops']:.1f} GFLOP/s)")
        else:
            typer.echo(f"{task.name}: no valid candidate measured")
    typer.echo(f"report: {work_dir / 'report.json'}, curve: {work_dir / 'best_so_far.png'}")


@app.command()
def train(
    db: Path = typer.Option(..., "--db", help="MetaSchedule JSON database directory."),
    split: Path = typer.Option(..., "--split", help="Split JSON (see `cwm dataset split`)."),
    out: Path = typer.Option(..., "--out", help="Model directory to write."),
    tiny: bool = typer.Option(False, help="Tiny sizes, for tests and smoke runs."),
    encoder_checkpoint: Optional[Path] = typer.Option(None, help="Local RoBERTa checkpoint directory to start E from."),
    cache_dir: Optional[Path] = typer.Option(None, help="Cache for replayed states and latents."),
    seed: int = typer.Option(0),
):
    """Train E (contrastive), F (rollout loss) and R (LambdaRank) on the train split.

    Data-parallel on CPU: torchrun --nproc_per_node 2 -m cwm.cli train --db ... (rank 0 writes).
    """
    from .model import distributed
    from .model.training import TrainSettings
    from .model.training import train as run_train

    _quiet_tvm_logs()
    settings = TrainSettings.tiny() if tiny else TrainSettings()
    settings.seed = seed
    if encoder_checkpoint:
        settings.encoder_checkpoint = str(encoder_checkpoint)
    with distributed.process_group():  # under torchrun; a no-op in a single process
        logging.getLogger("cwm").setLevel(logging.INFO if distributed.is_main() else logging.WARNING)
        _, report = run_train(resolve_db(db), load_split(split), out, settings, cache_dir=cache_dir)
        if not distributed.is_main():
            return
    typer.echo(json.dumps({"seconds": report.seconds, "validation": report.validation,
                           "peak_rss_mb": round(report.peak_rss_mb)}, default=float))
    typer.echo(f"model written to {out}")


@app.command("eval")
def evaluate(
    db: Path = typer.Option(..., "--db", help="MetaSchedule JSON database directory."),
    split: Path = typer.Option(..., "--split", help="Split JSON."),
    out: Path = typer.Option(Path("benchmarks/results/eval"), help="Where to write eval.json/md/png and the model."),
    records_per_task_cap: int = typer.Option(64, help="Training records per task for every contender's ranker "
                                             "(one seeded sample, the same for all; 0: no cap). Test records are "
                                             "never capped."),
    seed: int = typer.Option(0),
    tiny: bool = typer.Option(False, help="Tiny models, for tests."),
    cache_dir: Optional[Path] = typer.Option(None),
):
    """Held-out ranking quality: cwm and every ablation and baseline trained in this run on the split's training
    tasks, scored on its test tasks with bootstrap intervals over tasks."""
    from .benchmarks.offline import evaluate as run_eval
    from .model.training import TrainSettings

    _quiet_tvm_logs()
    settings = TrainSettings.tiny() if tiny else TrainSettings()
    report = run_eval(resolve_db(db), load_split(split), out, settings=settings,
                      records_per_task_cap=8 if tiny else records_per_task_cap, seed=seed,
                      throughput_batch=64 if tiny else 512, cache_dir=cache_dir, curve_repeats=1 if tiny else 5)
    for name, m in report["intervals"].items():
        typer.echo(f"{name:<15} " + "  ".join(f"{k} {v['mean']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]"
                                              for k, v in m.items()))
    t = report["throughput"]
    typer.echo(f"throughput (geomean over test tasks): cwm {t['cwm_candidates_per_second']:.0f}/s, xgb-static "
               f"{t['xgb-static_candidates_per_second']:.0f}/s ({t['speedup']:.1f}x in the search loop, "
               f"{t['speedup_from_trace']:.1f}x from a trace); 2048 candidates from actions in "
               f"{t['predict_2048_seconds']:.3f} s")
    curve = report["learning_curve"]
    for name, per_size in curve["by_model"].items():
        points = ", ".join(f"{n} tasks {v['top1']['mean']:.3f}" for n, v in per_size.items())
        typer.echo(f"learning curve, {name} top1 on {curve['heldout_tasks']} held-out tasks: {points}")
    typer.echo(f"report: {out / 'eval.json'}")


@app.command("compare-models")
def compare_models(
    models: list[Path] = typer.Argument(..., help="World model directories."),
    db: Path = typer.Option(..., "--db", help="MetaSchedule JSON database directory to rank."),
    out: Optional[Path] = typer.Option(None, help="Where to write the JSON report."),
):
    """Ranking quality of world models on every task of a database (pairwise, ndcg@10, top-1, top-5)."""
    from .benchmarks.offline import compare_models as run_compare
    _quiet_tvm_logs()
    names = [str(m) for m in models]
    if len(set(names)) != len(names):
        _fail("each model may be given once")
    report = run_compare({n: m for n, m in zip(names, models)}, resolve_db(db))
    typer.echo(f"{report['records']} records of {report['tasks']} tasks")
    for name, m in report["metrics"].items():
        typer.echo(f"{name:<40} pairwise {m['pairwise_accuracy']:.3f}  ndcg@10 {m['ndcg@10']:.3f}  "
                   f"top1 {m['top1']:.3f}  top5 {m['top5']:.3f}")
    if out:
        atomic_write_text(out, json.dumps(report, indent=1, default=float) + "\n")
        typer.echo(f"report: {out}")


@bench_app.command("search")
def bench_search(
    subgraphs: list[str] = typer.Argument(None, help="Workloads (default: the 12-subgraph set)."),
    budget: int = typer.Option(64, help="Trials per run."),
    large_budget: Optional[int] = typer.Option(None, help="Also run --large-contender at this budget and cwm at a "
                                               "tenth of it (sample efficiency)."),
    large_contender: str = typer.Option("xgb-pretrained", help="The sample-efficiency baseline run at "
                                        "--large-budget (e.g. xgb for cold XGBoost)."),
    seeds: int = typer.Option(3, help="Seeds per contender (at least 3 for a report)."),
    contenders: str = typer.Option(",".join(("cwm", "xgb", "xgb-pretrained", "random")),
                                   help="Comma-separated; also cwm-initial (no-transition ablation), "
                                   "cwm-finetune (transition fine-tuned online), cwm-zscore (the per-call "
                                   "score transform of earlier releases) and cwm-boost-copy (their online "
                                   "update); NAME@P runs NAME with an evolutionary population of P "
                                   "(MetaSchedule's default: 512), e.g. cwm@128."),
    model: Optional[Path] = typer.Option(None, "--world-model", "--model", help=WORLD_MODEL_HELP),
    db: Path = typer.Option(Path(SHIPPED_TRAINING_DB), help="Training database (for xgb-pretrained and cwm-initial)."),
    split: Path = typer.Option(SHIPPED_TRAINING_SPLIT, help="Split (for xgb-pretrained and cwm-initial)."),
    out: Path = typer.Option(Path("benchmarks/results/search")),
    work_root: Path = typer.Option(Path("runs/bench_search"), help="Per-run databases (resumable)."),
    per_iter: int = typer.Option(32, help="num_trials_per_iter of the search."),
    remeasure_runs: int = typer.Option(30, help="Interleaved re-measurements of each final best."),
):
    """Fixed-budget search against MetaSchedule's XGBoost model, interleaved, >= 3 seeds."""
    from .benchmarks.search import DEFAULT_SUBGRAPHS, run_search_benchmark
    from .model.world_model import default_model_dir

    _quiet_tvm_logs()
    chosen = [c.strip() for c in contenders.split(",") if c.strip()]
    named = set(chosen) | ({large_contender} if large_budget else set())
    needs_training_data = "xgb-pretrained" in named or "cwm-initial" in named
    summary = run_search_benchmark(
        subgraphs or DEFAULT_SUBGRAPHS, out, budget=budget, large_budget=large_budget,
        large_contender=large_contender, seeds=tuple(range(seeds)),
        contenders=chosen, model_path=model or default_model_dir(),
        train_db=resolve_db(db) if needs_training_data else None,
        split=load_split(split) if needs_training_data else None, work_root=work_root,
        num_trials_per_iter=per_iter, remeasure_runs=remeasure_runs)
    for c, o in summary["overall"].items():
        typer.echo(f"{c:<15} geomean speed-up vs xgb {o['geomean_speedup_vs_xgb']:.3f}x "
                   f"(min {o['min']:.2f}, max {o['max']:.2f})")
    for c, o in summary["vs_xgb_pretrained"].items():
        typer.echo(f"{c:<15} geomean speed-up vs xgb-pretrained {o['geomean']:.3f}x "
                   f"(min {o['min']:.2f}, max {o['max']:.2f})")
    typer.echo(f"report: {out / 'search.json'}, {out / 'search.md'}, {out / 'search.png'}")


@bench_app.command("ranker-variants")
def bench_ranker_variants(
    variants: list[str] = typer.Argument(None, help="Variant names (default: all); action-features, the "
                                         "baseline, is always fitted."),
    model: Optional[Path] = typer.Option(None, "--world-model", "--model", help=WORLD_MODEL_HELP),
    db: Path = typer.Option(Path(SHIPPED_TRAINING_DB), help="Database the model's split names."),
    split: Path = typer.Option(SHIPPED_TRAINING_SPLIT, help="Split with the test tasks (held out from the model)."),
    folds: int = typer.Option(4, help="Folds of the training tasks for the out-of-fold F (1: no oof columns)."),
    out: Path = typer.Option(Path("benchmarks/results"), help="Where world_model_experiments.json/md live."),
    cache_dir: Optional[Path] = typer.Option(None, help="Feature cache (default: $CWM_CACHE/experiments)."),
    seed: int = typer.Option(0),
    transition: str = typer.Option("shipped", help="F whose columns the variants use: shipped (the model's), or "
                                   "an F refit on the training tasks with changed settings, e.g. relative-tiles "
                                   "(refit: unchanged, the control; a wrong name lists them all)."),
    encoder: str = typer.Option("shipped", help="E of the final-state variant's columns: shipped (the model's), "
                                "refit (the control) or latency-head (E with a within-task ranking loss), "
                                "refit on the training tasks."),
):
    """The world model's fast experiment loop: ranker variants on cached features, scored on held-out tasks with
    paired bootstrap intervals against action-features; rows merge into world_model_experiments.md."""
    from .benchmarks.ranker_variants import VARIANTS, run_variants
    from .compiler.cache import cache_root
    from .model.world_model import default_model_dir

    _quiet_tvm_logs()
    if folds < 1:
        _fail(f"--folds must be at least 1, got {folds}")
    chosen = variants or list(VARIANTS)
    command = "cwm bench ranker-variants " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else \
        "cwm bench ranker-variants"
    report = run_variants(model or default_model_dir(), resolve_db(db), load_split(split), chosen, out,
                          folds=folds, cache_dir=cache_dir or cache_root() / "experiments", seed=seed,
                          command=command, transition=transition, encoder=encoder)
    for r in report["rows"]:
        m = r["metrics"]
        typer.echo(f"{r['variant']:<22} {r['machine']:<8} F {r.get('transition', 'shipped'):<14} "
                   f"E {r.get('encoder', 'shipped'):<12} top1 {m['top1']['mean']:.3f} ({m['top1']['vs_baseline']:+.3f})"
                   f"  top5 {m['top5']['mean']:.3f}  pairwise {m['pairwise_accuracy']['mean']:.3f}"
                   f" ({m['pairwise_accuracy']['vs_baseline']:+.3f})")
    typer.echo(f"report: {out / 'world_model_experiments.md'}")


@bench_app.command("transfer-coverage")
def bench_transfer_coverage(
    networks: list[str] = typer.Argument(..., help="Built-in networks (cwm workloads list --networks)."),
    model: Optional[Path] = typer.Option(None, "--world-model", "--model", help=WORLD_MODEL_HELP),
    run_db: list[str] = typer.Option([], "--run-db", help="NETWORK=DIR: a tuned database of that network, for "
                                     "in-run transfer (repeatable)."),
    out: Path = typer.Option(Path("benchmarks/results/transfer"), help="Where transfer_coverage.json/md go."),
):
    """How many compute tasks of each network get a transferred schedule, from the world model's training tasks
    and from the network's tasks tuned before them (no measurement)."""
    from .benchmarks.transfer import transfer_coverage, write_coverage
    from .model.world_model import default_model_dir

    _quiet_tvm_logs()
    dbs = {}
    for spec in run_db:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            _fail(f"--run-db must be NETWORK=DIR, got {spec!r}")
        if not Path(path).is_dir():
            _fail(f"--run-db {spec}: {path} is not a directory")
        dbs[name] = Path(path)
    unknown = set(dbs) - set(networks)
    if unknown:
        _fail(f"--run-db names a network that is not benchmarked: {', '.join(sorted(unknown))}")
    for net in networks:
        get_network(net)
    reports = [transfer_coverage(net, model or default_model_dir(), dbs.get(net)) for net in networks]
    for r in reports:
        typer.echo(f"{r['network']:<16} {r['tasks']} compute tasks: {r['from_model']} from the model"
                   + (f", {r['in_run']} from the run, {r['either']} from either" if "in_run" in r else ""))
    typer.echo(f"report: {write_coverage(reports, out)}")


@bench_app.command("noise")
def bench_noise(
    db: Path = typer.Option(..., "--db", help="Database whose records to re-measure (this machine's records)."),
    out: Path = typer.Option(..., "--out", help="Directory for noise.json, noise.md and noise.png."),
    records: int = typer.Option(512, help="Records to re-measure, spread over tasks."),
    min_per_task: int = typer.Option(16, help="Records per task (tasks with fewer are not chosen)."),
    seed: int = typer.Option(0),
):
    """Label noise: re-measure recorded candidates and compare the passes (Spearman, top-k ceilings)."""
    from .benchmarks.noise import remeasure

    _quiet_tvm_logs()
    summary = remeasure(resolve_db(db), out, n_records=records, min_per_task=min_per_task, seed=seed)
    typer.echo(json.dumps({k: v for k, v in summary.items() if k not in ("per_task", "pairs", "target")}))


@bench_app.command("online-adaptation")
def bench_online_adaptation(
    roots: list[Path] = typer.Argument(..., help="Work roots of `cwm bench search` runs (or unpacked runs_*.tar.gz)."),
    model: Optional[Path] = typer.Option(None, "--world-model", "--model", help=WORLD_MODEL_HELP),
    rounds: int = typer.Option(20, help="Boosting rounds of each online update."),
    out: Path = typer.Option(Path("benchmarks/results/online_adaptation")),
):
    """Online adaptation replayed on search runs: after K measured candidates, how well each update ranks the next 16."""
    from .benchmarks.online import replay_online_adaptation

    for root in roots:
        if not root.is_dir():
            _fail(f"no such directory: {root}")
    summary = replay_online_adaptation(roots, out, model_path=model, rounds=rounds)
    for e in summary["results"]:
        p = e["pairwise"]
        typer.echo(f"{e['proposer']:<6} K={e['k']:<3} {e['adapter']:<13} pairwise {p['mean']:.3f} "
                   f"(vs boost-copy {p['vs_boost-copy']['mean']:+.3f})")
    typer.echo(f"report: {out / 'online_adaptation.json'}, {out / 'online_adaptation.md'}, {out / 'online_adaptation.png'}")


@bench_app.command("diagnose-search")
def bench_diagnose_search(
    work_root: Path = typer.Option(Path("runs/bench_search"), help="Run databases of `cwm bench search`."),
    budget: int = typer.Option(64, help="Which budget's runs."),
    model: Optional[Path] = typer.Option(None, "--world-model", "--model", help=WORLD_MODEL_HELP),
    out: Path = typer.Option(Path("benchmarks/results/search")),
):
    """Ranking quality of the world model on each contender's measured candidates, and their diversity."""
    from .benchmarks.search import diagnose_search_runs

    if not work_root.is_dir():
        _fail(f"no benchmark runs at {work_root}")
    summary = diagnose_search_runs(work_root, out, budget=budget, model_path=model)
    if not summary["runs"]:
        _fail(f"no finished {budget}-trial runs under {work_root}")
    for c, v in summary["by_contender"].items():
        typer.echo(f"{c:<15} runs {v['runs']:>3}  pairwise {v['pairwise']:.3f}  distinct {v['distinct']:.2f}  "
                   f"within 1.5x of best {v['near_best']:.2f}  median/best {v['median_over_best']:.2f}")
    for c, v in summary["headroom"].get("by_contender", {}).items():
        leads = "  ".join(f"@{k} {x:.3f}" for k, x in v["lead_vs_xgb_at"].items())
        typer.echo(f"{c:<15} gap to the pool best {v['gap_to_pool_best']:.3f}  lead vs xgb {leads}")
    typer.echo(f"report: {out / 'search_diagnosis.json'}, {out / 'search_diagnosis.md'}")


@app.command()
def build(
    network: Optional[str] = typer.Option(None, help="Network name (see `cwm workloads list`)."),
    model_file: Optional[Path] = typer.Option(None, "--model-file", help=MODEL_FILE_HELP),
    input_shape: list[str] = typer.Option(None, "--input-shape", help="NAME=1x3x224x224 (as for `cwm tune`)."),
    db: Optional[Path] = typer.Option(None, "--db", help="Tuned database directory (omit for untuned)."),
    out: Path = typer.Option(Path("runs/build/network.so"), help="Shared library to write."),
    target: Optional[str] = typer.Option(None, help="'cpu' (default), 'cuda' or target JSON."),
):
    """Build a network or a model file with its tuned schedules applied and export a shared library."""
    _quiet_tvm_logs()
    if (network is None) == (model_file is None):
        _fail("give one of --network NAME and --model-file FILE")
    tgt = make_target(target)
    source = network if model_file is None else _load_model_file(model_file, tgt, input_shape).mod
    result = build_network(source, db, tgt, out)
    typer.echo(f"{result.tuned_tasks}/{result.total_tasks} tasks tuned"
               + (f"; missing from the database: {', '.join(result.missing)}" if result.missing else ""))
    typer.echo(f"library: {result.lib_path}")


@app.command()
def run(
    lib: Path = typer.Argument(..., help="Library written by `cwm build`."),
    network: Optional[str] = typer.Option(None, help="Check the outputs against this PyTorch network."),
    model_file: Optional[Path] = typer.Option(None, "--model-file", "--check-model",
                                              help="Run on this model file's example inputs and check the outputs "
                                              "against it (PyTorch for .pt2, ONNX Runtime for .onnx)."),
    input_shape: list[str] = typer.Option(None, "--input-shape", help="NAME=1x3x224x224 (as for `cwm tune`)."),
    seed: int = typer.Option(0, help="Seed of the random inputs."),
    profile: bool = typer.Option(False, "--profile", help="Then time each kernel inside the network call and "
                                 "the time outside the kernels."),
    runs: int = typer.Option(20, help="Calls timed by --profile (plain, then instrumented)."),
):
    """Run a built network on the Relax VM with random inputs (checked against PyTorch with --network, against
    the source model with --model-file)."""
    import numpy as np

    _quiet_tvm_logs()
    if not lib.exists():
        _fail(f"library {lib} does not exist")
    if network is not None and model_file is not None:
        _fail("give at most one of --network and --model-file")
    if model_file is not None:
        from .deploy.check import check_outputs

        imported = _load_model_file(model_file, None, input_shape)
        outputs = load_and_run(lib, imported.example_inputs)
        for i, o in enumerate(outputs):
            typer.echo(f"output {i}: shape {tuple(o.shape)} {o.dtype}, mean {float(np.mean(o)):.6g}")
        check_outputs(imported.expected_outputs(), outputs, **imported.tolerance, reference=imported.reference_name)
        typer.echo(f"outputs match {imported.reference_name}")
        inputs = imported.example_inputs
    else:
        if network is not None:
            get_network(network)  # an unknown name fails before PyTorch is imported
            model, example = torch_model(network)
            inputs = [x.numpy() for x in example]
        else:
            inputs = random_inputs(lib, seed)  # from the sidecar `cwm build` writes; --network otherwise
        outputs = load_and_run(lib, inputs)
        for i, o in enumerate(outputs):
            typer.echo(f"output {i}: shape {tuple(o.shape)} {o.dtype}, mean {float(np.mean(o)):.6g}")
        if network is not None:
            check_against_torch(model, example, outputs, **tolerance_for(model))
            typer.echo("outputs match PyTorch")
    if profile:
        from .deploy.profile import profile_network

        typer.echo(profile_network(lib, inputs, runs=runs).markdown())


@bench_app.command("e2e")
def bench_e2e(
    networks: list[str] = typer.Argument(None, help="Networks (default: resnet18 resnet50 mobilenet_v2 bert-base gpt2): "
                                         "built-in names, any torchvision model (e.g. efficientnet_b0), any "
                                         "transformers model type (e.g. roberta; random init), torchvision:NAME, "
                                         "transformers:TYPE, or a .pt2 file."),
    trials_per_task: int = typer.Option(64, help="Tuning budget per compute task, split over the tasks by estimated time (at least 4 each)."),
    model: Optional[Path] = typer.Option(None, "--world-model", "--model", help=WORLD_MODEL_HELP),
    out: Path = typer.Option(Path("benchmarks/results/e2e")),
    work_root: Path = typer.Option(
        Path("runs/bench_e2e"),
        help="Per-network tuning databases (resumable; also archived in OUT as databases_<network>.tar.gz, "
             "which a run without them resumes from)."),
    runs: int = typer.Option(30, help="Timed runs per contender (median), interleaved."),
    seeds: int = typer.Option(1, help="Tuning seeds per cost model (latency is their geometric mean)."),
    cost_models: str = typer.Option("xgb,cwm", help=f"Comma-separated cost models to tune with, of "
                                    f"{', '.join(cost_model_names())}; NAME:T tunes with NAME at T trials per "
                                    "task instead of --trials-per-task (e.g. cwm,xgb-pretrained:32), and "
                                    "NAME+transfer measures schedules transferred from the world model's "
                                    "training tasks first (e.g. cwm+transfer:1)."),
    num_trials_per_iter: int = typer.Option(16, help="Candidates measured per task-scheduler round."),
    db: Path = typer.Option(Path(SHIPPED_TRAINING_DB), "--db", help="Training database of the world model (for "
                            "xgb-pretrained and --leave-network-out)."),
    split: Path = typer.Option(SHIPPED_TRAINING_SPLIT, "--split",
                               help="Its split (for xgb-pretrained and --leave-network-out)."),
    onnxruntime: bool = typer.Option(True, "--onnxruntime/--no-onnxruntime", help="Time ONNX Runtime too (CPU "
                                     "provider, all graph optimizations, 2 threads; model from torch.onnx.export)."),
    leave_network_out: bool = typer.Option(False, "--leave-network-out", help="For each network, train cwm's world "
                                           "model and xgb-pretrained on the split less that network's tasks, so "
                                           "every network is held out; kept in WORK_ROOT/<network>/."),
):
    """End to end: PyTorch eager and compile vs TVM untuned and tuned networks (xgb, xgb-pretrained, cwm); the report
    says how many of each network's tasks every learned cost model was trained on."""
    from .benchmarks.e2e import DEFAULT_NETWORKS, parse_contender, run_e2e_benchmark
    from .model.world_model import default_model_dir

    _quiet_tvm_logs()
    chosen = tuple(c.strip() for c in cost_models.split(",") if c.strip())
    needs_training_data = "xgb-pretrained" in {parse_contender(c, 1).cost_model for c in chosen} or leave_network_out
    summary = run_e2e_benchmark(networks or DEFAULT_NETWORKS, out, trials_per_task=trials_per_task,
                                model_path=model or default_model_dir(), work_root=work_root, runs=runs,
                                seeds=tuple(range(seeds)), num_trials_per_iter=num_trials_per_iter,
                                cost_models=chosen, train_db=resolve_db(db) if needs_training_data else None,
                                split=load_split(split) if needs_training_data else None,
                                leave_network_out=leave_network_out, onnxruntime=onnxruntime)
    typer.echo(json.dumps(summary.get("geomean_speedup_vs_eager", {}), default=float))
    typer.echo(f"report: {out / 'e2e.json'}, {out / 'e2e.md'}, {out / 'e2e.png'}")


@bench_app.command("e2e-combine")
def bench_e2e_combine(
    sources: list[Path] = typer.Argument(..., help="e2e.json files (or their directories) of `cwm bench e2e` runs."),
    out: Path = typer.Option(..., "--out", help="Directory for the combined e2e.json, e2e.md and e2e.png."),
):
    """One end-to-end report, and its geometric mean, from networks benchmarked in separate runs."""
    from .benchmarks.e2e import combine_e2e_results

    summary = combine_e2e_results(sources, out)
    typer.echo(f"{len(summary['networks'])} networks: {', '.join(summary['networks'])}")
    typer.echo(json.dumps(summary.get("geomean_speedup_vs_eager", {}), default=float))
    typer.echo(f"report: {out / 'e2e.json'}, {out / 'e2e.md'}, {out / 'e2e.png'}")


@dataset_app.command("stats")
def dataset_stats(
    db: Path = typer.Option(..., "--db", help="MetaSchedule JSON database directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG of action kinds, trajectory lengths and records "
                                        "per machine."),
):
    """Records per task, valid/failed counts, latency spread, action kinds and trajectory lengths."""
    ds = load_dataset(resolve_db(db))
    stats = ds.stats()
    typer.echo(json.dumps(stats, indent=1) if as_json else format_dataset_stats(stats))
    if plot:
        plot_dataset_stats(ds, plot)
        typer.echo(f"plot written to {plot}")


@dataset_app.command("split")
def dataset_split(
    db: Path = typer.Option(..., "--db", help="MetaSchedule JSON database directory."),
    out: Path = typer.Option(..., "--out", help="Where to write the split JSON."),
    seed: int = typer.Option(0),
    test_network: list[str] = typer.Option(None, "--test-network",
                                           help="Hold out every task of this network (repeatable)."),
    test_kind: list[str] = typer.Option(None, "--test-kind", help="Hold out every task of this operator kind "
                                        "(repeatable)."),
):
    """Write a train/val/test split by task (about 70/15/15, with held-out kinds and shapes); near-duplicate
    shapes stay on one side."""
    ds = load_dataset(resolve_db(db))
    split = make_split(ds.tasks, seed=seed, shapes=task_shapes(ds.modules), test_networks=tuple(test_network or ()),
                       test_kinds=tuple(test_kind or ()))
    split["names"] = {k: [ds.tasks[t].name for t in v] for k, v in split.items()}
    atomic_write_text(out, json.dumps(split, indent=1) + "\n")
    typer.echo(" ".join(f"{k}={len(v)}" for k, v in split.items() if k != "names"))


@dataset_app.command("pack")
def dataset_pack(
    db: Path = typer.Option(..., "--db", help="MetaSchedule JSON database directory."),
    out: Path = typer.Option(Path("data/reference"), help="Directory for the archive and MANIFEST.json."),
    split: Optional[Path] = typer.Option(None, help="Split JSON to summarize in the manifest."),
    archive: str = typer.Option(REFERENCE_ARCHIVE, help="Archive file name in --out."),
):
    """Compress a database into an archive with a manifest (machines, targets, counts per task and machine)."""
    summary = pack_database(db, out, load_split(split) if split else None, archive=archive)
    typer.echo(f"{summary['records']} records ({summary['valid']} valid) of {summary['tasks']} tasks; "
               f"{summary['tasks_with_200_valid']} tasks have >= 200 valid -> {out / summary['archive']}")


@dataset_app.command("merge")
def dataset_merge(
    sources: list[Path] = typer.Argument(..., help="MetaSchedule JSON database directories to merge."),
    db: Path = typer.Option(..., "--db", help="Database directory to merge into (created if absent)."),
):
    """Merge tuning logs (e.g. `cwm tune` work directories) into one training database."""
    for source in sources:
        if not (source / RECORD_FILE).exists():
            _fail(f"{source} is not a MetaSchedule JSON database directory (no {RECORD_FILE})")
    from tqdm import tqdm

    with tqdm(total=len(sources), unit="db", desc="merge", dynamic_ncols=True) as bar:
        def report(source, added):
            bar.write(f"{source}: {added} records added")
            bar.update(1)

        total = sum(merge_databases(sources, db, on_source=report))
    typer.echo(f"{total} records added to {db}")


@dataset_app.command("export")
def dataset_export(
    db: Path = typer.Option(..., "--db", help="MetaSchedule JSON database directory."),
    out: Path = typer.Option(..., "--out", help="Output JSONL of trajectory records."),
    states: bool = typer.Option(False, help="Include replayed intermediate and final states."),
):
    """Export trajectory records (initial state, actions, states, latency, hardware) as JSONL."""
    n = load_dataset(resolve_db(db)).export_jsonl(out, with_states=states)
    typer.echo(f"{n} trajectories written to {out}")


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        code = app(standalone_mode=False)  # returns the exit code of typer.Exit in this mode
        sys.exit(code if isinstance(code, int) else 0)
    except CwmError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except typer.Exit as ex:
        sys.exit(ex.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as err:  # usage errors: typer raises its vendored click's, not click's own
        import click

        if isinstance(err, (click.ClickException, typer.TyperException)) and hasattr(err, "show"):
            err.show()
            sys.exit(getattr(err, "exit_code", 2))
        raise


if __name__ == "__main__":
    main()
