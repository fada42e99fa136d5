"""The ``cwm`` command line: each command is a thin wrapper over a library function."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import CwmError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Compiler world models for tensor program search.")
workloads_app = typer.Typer(no_args_is_help=True, help="Operator registry and networks.")
dataset_app = typer.Typer(no_args_is_help=True, help="Action-state trajectory dataset.")
app.add_typer(workloads_app, name="workloads")
app.add_typer(dataset_app, name="dataset")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _quiet_tvm_logs() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("tvm.s_tir.meta_schedule", "tvm"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _tasks_from(names: list[str], network: Optional[str], target=None):
    from .workloads import network_tasks, resolve_task, tunable
    from .workloads.reference import reference_tasks

    tasks = []
    if network:
        tasks += [t for t in network_tasks(network, target) if tunable(t)]
    for name in names:
        if name == "reference":
            tasks += reference_tasks(target)
        else:
            tasks.append(resolve_task(name, target))
    return tasks


@workloads_app.command("list")
def workloads_list(
    network: Optional[str] = typer.Option(None, help="List the tasks of this network instead of the registry."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON lines."),
):
    """List registry operators (with default shapes) or the tasks of a network."""
    from .workloads import OPERATORS, network_tasks

    if network:
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
    tasks: list[str] = typer.Argument(None, help="Workload specs, network task names, or 'reference'."),
    db: Path = typer.Option(..., "--db", help="MetaSchedule JSON database directory (created or resumed)."),
    network: Optional[str] = typer.Option(None, help="Collect every tunable task of this network."),
    random: int = typer.Option(100, help="Random design-space samples per task."),
    evolutionary: int = typer.Option(100, help="Evolutionary-search candidates per task."),
    batch: int = typer.Option(32, help="Candidates measured per batch (committed together)."),
    seed: int = typer.Option(0),
    target: Optional[str] = typer.Option(None, help="'cpu' (default, this host), 'cuda' or target JSON."),
    rpc: Optional[str] = typer.Option(None, help="Measure through a TVM RPC tracker HOST:PORT:KEY."),
):
    """Measure candidates into a resumable MetaSchedule database."""
    from .collect import collect as run_collect
    from .hardware import make_target
    from .measure import RPCAddress

    _quiet_tvm_logs()
    tgt = make_target(target)
    chosen = _tasks_from(tasks or [], network, tgt)
    if not chosen:
        _fail("no tasks given; name workloads, 'reference', or --network")
    report = run_collect(chosen, db, n_random=random, n_evolutionary=evolutionary, batch=batch, seed=seed,
                         target=tgt, rpc=RPCAddress.parse(rpc) if rpc else None)
    typer.echo(json.dumps({k: v for k, v in report.as_json().items() if k != "per_task"}))


def main() -> None:
    """Console entry point: user errors become one line on stderr and exit code 2."""
    try:
        app(standalone_mode=False)
    except CwmError as err:
        typer.echo(f"error: {err}", err=True)
        sys.exit(2)
    except typer.Exit as ex:
        sys.exit(ex.exit_code)
    except typer.Abort:
        sys.exit(130)
    except Exception as err:  # click usage errors
        import click

        if isinstance(err, click.ClickException):
            err.show()
            sys.exit(err.exit_code)
        raise
