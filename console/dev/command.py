"""``longcall dev``: the click command. See ``console.dev`` for the parts."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import IO

import click
import httpx2
from rich.console import Console

from console.dev.demo import Demo
from console.dev.display import print_lines, receipts_table
from console.dev.fleet import FleetOptions, LocalFleet, mask_password, start_fleet
from console.dev.processes import Children, clean_leftovers
from console.dev.questions import asker
from console.dev.services import DataDir, DevError, EmbeddedPostgres, lock_data_dir, prepare_data_dir

READY = "longcall dev: fleet ready"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _addresses(fleet: LocalFleet) -> list[tuple[str, str]]:
    flower_auth = (
        "credentials from LONGCALL_FLOWER_USER / LONGCALL_FLOWER_PASSWORD"
        if fleet.flower_password_from_env
        else f"user {fleet.flower_user}, password {fleet.flower_password}"
    )
    lines = [
        ("ledger", mask_password(fleet.database_url) + ("  (embedded)" if fleet.embedded_postgres else "")),
        ("redis", mask_password(fleet.redis_url) + ("  (embedded)" if fleet.embedded_redis else "")),
        ("MCP server", f'{fleet.demo_url}  (server "reports", longcall\'s demo server)'),
        ("flower", f"{fleet.flower_url}  ({flower_auth})"),
    ]
    lines.append(("metrics", fleet.metrics_url))
    lines.append(("logs", str(fleet.data.logs)))
    return lines


def _save_demo_server_record(fleet: LocalFleet) -> None:
    """The demo server's own record (its tasks and requests), kept after it stops: what the server saw."""
    try:
        tasks = httpx2.get(f"{fleet.demo_control_url}/tasks", timeout=5).json()
        log = httpx2.get(f"{fleet.demo_control_url}/log", timeout=5).json()
    except (httpx2.HTTPError, ValueError):
        return
    fleet.data.demo_server_record.write_text(json.dumps({"tasks": tasks, "log": log}, indent=1))


def _run_until_interrupted(children: Children) -> None:
    while True:
        if exited := children.exited():
            first = exited[0]
            raise DevError(f"{first.name} exited with {first.process.returncode} (log {first.log})")
        time.sleep(0.5)


#: What the demo MCP server needs beyond longcall's own dependencies (the ``demo`` extra).
DEMO_PACKAGES = ("uvicorn",)


def missing_demo_packages(find: Callable[[str], object] | None = None) -> list[str]:
    """The demo extra's packages this install lacks (``longcall dev`` says which extra to add)."""
    finder = find or importlib.util.find_spec
    return [name for name in DEMO_PACKAGES if finder(name) is None]


@click.command()
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path(".longcall-dev"),
    show_default=True,
    help="Where the embedded Postgres and Redis keep their data, and the logs; reuse it to reuse the ledger.",
)
@click.option("--no-demo", is_flag=True, help="Only the fleet: print the lines to use it, run until Ctrl-C.")
@click.option("--exit", "exit_after", is_flag=True, help="Stop everything when the demo has ended.")
@click.option("--yes", is_flag=True, help="Answer the demo's questions (approval, operator) yes, unasked.")
@click.option("--workers", type=click.IntRange(1, 16), default=2, show_default=True, help="Worker processes.")
@click.option(
    "--concurrency",
    type=click.IntRange(1, 64),
    default=2,
    show_default=True,
    help="Pool size of each worker.",
)
@click.option(
    "--flower-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Flower's port (else kept from the last run).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="The metrics endpoint's port (else kept from the last run).",
)
@click.option(
    "--demo-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="The demo MCP server's port (else kept from the last run).",
)
def dev(  # noqa: PLR0917 (click passes each option as a parameter)
    data_dir: Path,
    no_demo: bool,
    exit_after: bool,
    yes: bool,
    workers: int,
    concurrency: int,
    flower_port: int | None,
    metrics_port: int | None,
    demo_port: int | None,
) -> None:
    """Run the whole fleet locally, with nothing installed, and a demo of what longcall does.

    Postgres and Redis are embedded (from wheels, data under --data-dir) unless LONGCALL_DATABASE_URL /
    LONGCALL_REDIS_URL name real ones. It migrates the ledger and starts the demo MCP server (server
    "reports"), worker processes, beat, Flower (basic auth: LONGCALL_FLOWER_USER / LONGCALL_FLOWER_PASSWORD,
    else generated once and kept in the data directory) and `longcall metrics`, each on the port it had the
    last time on this data directory when that port is free (--flower-port, --metrics-port, --demo-port set
    them). The demo submits a dozen report calls through
    the broker: one is cancelled, one asks for approval, one loses its create answer and goes to an operator
    (never called twice). Ctrl-C (or the end of the demo with --exit) stops everything it started.
    """
    missing = missing_demo_packages()
    if missing:
        raise click.ClickException(
            f"longcall dev runs longcall's demo MCP server, which needs {', '.join(missing)}: install the"
            " demo extra, pip install -e '.[demo]' (or pip install 'longcall[demo]')"
        )
    asked = {"flower": flower_port, "metrics": metrics_port, "demo": demo_port}
    ports = {part: port for part, port in asked.items() if port is not None}
    console = Console()
    try:
        data = prepare_data_dir(data_dir)
        lock: IO[str] = lock_data_dir(data)
    except DevError as exc:
        raise click.ClickException(str(exc)) from None
    if cleaned := clean_leftovers(data.processes):
        console.print(f"stopped what a previous longcall dev left running: {', '.join(cleaned)}")
    children = Children(data.logs, data.processes, Path.cwd())
    postgres = EmbeddedPostgres(data.pgdata)
    # Ctrl-C, a kill and a closed terminal all stop the fleet, even when the shell that started this one
    # ignored SIGINT (a background job of a script inherits SIG_IGN).
    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    failure: DevError | None = None
    started: list[LocalFleet] = []
    try:
        _run(
            console,
            data,
            children,
            postgres,
            FleetOptions(workers, concurrency, ports=ports),
            started=started,
            no_demo=no_demo,
            exit_after=exit_after,
            yes=yes,
        )
    except KeyboardInterrupt:
        console.print("\ninterrupted")
    except DevError as exc:
        failure = exc
    finally:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # the teardown runs to its end (each step is bounded)
        console.print("longcall dev: stopping everything it started ...")
        for fleet in started:
            _save_demo_server_record(fleet)
        children.stop_all()
        postgres.stop()
        lock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        console.print("longcall dev: stopped")
    if failure is not None:
        raise click.ClickException(str(failure))


def _run(
    console: Console,
    data: DataDir,
    children: Children,
    postgres: EmbeddedPostgres,
    options: FleetOptions,
    *,
    started: list[LocalFleet],
    no_demo: bool,
    exit_after: bool,
    yes: bool,
) -> None:
    console.print(f"longcall dev: starting the fleet in {data.root} ...")
    fleet = start_fleet(data, children, postgres, options)
    started.append(fleet)
    os.environ.update(fleet.env)
    console.print(READY)
    print_lines(console, _addresses(fleet))
    if not no_demo:
        _demo(fleet, console, yes)
        if exit_after:
            return
    console.print("Use it from another shell (e.g. longcall submit, longcall status):")
    for line in fleet.exports():
        console.print(f"  {line}", highlight=False, soft_wrap=True)
    console.print("Ctrl-C stops everything.")
    _run_until_interrupted(children)


def _demo(fleet: LocalFleet, console: Console, yes: bool) -> None:
    from ledger.repository import Ledger  # noqa: PLC0415
    from workers.app import create_app  # noqa: PLC0415 (reads the environment set above)

    # Asked at the terminal only when there is one to ask at and to show the question on.
    at_terminal = sys.stdin.isatty() and console.is_terminal
    ask = asker(yes=yes, stdin_fd=sys.stdin.fileno() if at_terminal else None)
    ledger = Ledger.from_url(fleet.database_url, pool_size=2)
    try:
        demo = Demo(fleet, console, ask, create_app(), ledger)
        rows = demo.run()
        console.print(receipts_table(rows, prefix=f"dev/{demo.run_id}/"))
        lost = demo.node(demo.by_role("lost"))
        console.print(
            f"server tasks for {lost}: {len(demo.server_tasks_for(demo.by_role('lost')))} "
            "(its create answer was lost; it was found by an operator, never called again)",
            highlight=False,
        )
    finally:
        ledger.dispose()
    print_lines(console, [("flower", fleet.flower_url), ("metrics", fleet.metrics_url)])
