"""``longcall gate simulate``: run N seeded series through the real executor, print the figures, record the
run in ``simulation_run`` (the launch gate reads the newest one), exit 1 on any failing series."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys

import click

from console.simulation.environment import run_many, same_database, scratch_url
from console.simulation.runner import Report, SeriesResult
from console.simulation.series import PROTOCOLS, Protocol
from ledger import simulation_runs as runs
from ledger.redact import error_line, mask_credentials
from ledger.repository import Ledger
from workers.settings import Settings, load_settings


def record(ledger: Ledger, report: Report, started_at: dt.datetime) -> int:
    return runs.record_run(
        ledger,
        started_at=started_at,
        finished_at=dt.datetime.now(dt.UTC),
        seed=report.seed,
        series=len(report.results),
        protocols=list(report.protocols),
        divergences=report.divergences,
        second_operations=report.second_operations,
        max_receipts_per_call_node=report.max_receipts_per_call_node,
        advances_without_receipt=report.advances_without_receipt,
        late_completions_advanced=report.late_completions_advanced,
        series_per_s=report.series_per_s,
        failures=report.failures[:50] or None,
        passed=report.passed,
    )


def figures(report: Report) -> list[tuple[str, str, str]]:
    return [
        ("series run", str(len(report.results)), ""),
        ("terminal-state divergences", str(report.divergences), "0"),
        ("second operations from duplicate submissions", str(report.second_operations), "0"),
        ("maximum receipts per call node", str(report.max_receipts_per_call_node), "1"),
        ("downstream advances without a receipt", str(report.advances_without_receipt), "0"),
        ("late completions after an accepted cancel advanced", str(report.late_completions_advanced), "0"),
        ("series/s", f"{report.series_per_s:.1f}", ""),
    ]


@click.command()
@click.option(
    "--series",
    "count",
    type=click.IntRange(min=1, max=1_000_000),
    default=500,
    show_default=True,
    help="How many random series of faults to run.",
)
@click.option(
    "--seed",
    type=click.IntRange(min=0, max=2**62),
    required=True,
    help="The seed of the series (the same seed runs the same series).",
)
@click.option(
    "--protocol",
    "protocols",
    type=click.Choice(PROTOCOLS),
    multiple=True,
    help="Generate only these protocols (repeatable); by default every one the simulation knows.",
)
@click.option("--index", type=click.IntRange(min=0), default=None, help="Replay this one series of the seed.")
@click.option(
    "--database-url",
    default=None,
    help="The database the series' rows go to (created and migrated). Default: LONGCALL_DATABASE_URL's "
    "database with '_simulation' appended, never the live ledger.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1, max=64),
    default=min(4, os.cpu_count() or 1),
    show_default=True,
    help="Processes the series are spread over (each runs series one after another).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def simulate(  # noqa: PLR0917 - click passes each option
    count: int,
    seed: int,
    protocols: tuple[Protocol, ...],
    index: int | None,
    database_url: str | None,
    workers: int,
    as_json: bool,
) -> None:
    """Run --series N seeded, ordered series (server timelines, wire faults, cancels, duplicate
    submissions, redeliveries, worker crashes, late completions) through the real executor steps, the real
    ledger and Redis, each series' server scripted at the wire, and check every series against the oracle.

    The series' rows go to a database of its own (by default LONGCALL_DATABASE_URL's name + '_simulation',
    created and migrated; never the live ledger). The run is recorded in simulation_run of that database
    and of the live ledger, where the launch gate reads the newest (a replay by --index is not recorded
    there). Exit status 1 when any series fails; a failing series prints its seed and index, and --index
    replays it alone."""
    settings = load_settings()
    chosen: tuple[Protocol, ...] = protocols or PROTOCOLS
    indexes = [index] if index is not None else list(range(count))
    started = dt.datetime.now(dt.UTC)
    done = [0]

    def progress(result: SeriesResult) -> None:
        done[0] += 1
        if not as_json and done[0] % 250 == 0:
            click.echo(f"  {done[0]}/{len(indexes)} series", err=True)
        if not result.passed and not as_json:
            click.echo(
                f"FAILED series: --seed {seed} --index {result.series.index} ({result.series.protocol}): "
                + "; ".join(result.problems),
                err=True,
            )

    url = database_url or scratch_url(settings.database_url)
    if same_database(url, settings.database_url):
        raise click.UsageError(
            "--database-url names the live ledger (LONGCALL_DATABASE_URL): the simulation creates rows, "
            "give it a database of its own"
        )
    report = run_many(
        settings,
        url,
        seed=seed,
        indexes=indexes,
        protocols=chosen,
        workers=min(workers, len(indexes)),
        progress=progress,
    )
    scratch = Ledger.from_url(url, pool_size=1)
    try:
        run_id = record(scratch, report, started)
    finally:
        scratch.dispose()
    if index is None:
        _record_live(settings, report, started)
    if as_json:
        click.echo(json.dumps({**report.to_json(), "simulation_run": run_id}, indent=2))
    else:
        width = max(len(name) for name, _, _ in figures(report))
        for name, measured, target in figures(report):
            click.echo(f"{name:<{width}}  {measured:>10}" + (f"   (gate: {target})" if target else ""))
        for failure in report.failures[:20]:
            click.echo(
                f"failing series: seed {failure['seed']} index {failure['index']} -> replay with "
                f"longcall gate simulate --seed {failure['seed']} --index {failure['index']}"
            )
        click.echo("simulation: PASSED" if report.passed else "simulation: FAILED")
    if not report.passed:
        sys.exit(1)


def _record_live(settings: Settings, report: Report, started: dt.datetime) -> None:
    """The run in the live ledger's simulation_run too, where ``longcall gate`` reads it."""
    ledger = Ledger.from_url(settings.database_url)
    try:
        record(ledger, report, started)
    except Exception as exc:  # noqa: BLE001 - the live ledger may be absent; the scratch copy stands
        click.echo(
            f"note: the run was not recorded in the live ledger at "
            f"{mask_credentials(settings.database_url)} ({error_line(getattr(exc, 'orig', None) or exc)}); "
            "`longcall gate` reads simulation runs from there (LONGCALL_DATABASE_URL)",
            err=True,
        )
    finally:
        ledger.dispose()
