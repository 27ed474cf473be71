"""The ``longcall`` command. Reads go to the ledger; ``submit`` goes through the fleet like any pipeline.

What each command prints is built in ``workers.cli_output``; here are the options, the reads and the
decisions, and the exit codes (:data:`EXIT_CODES`, stable: scripts rely on them). A service that cannot be
reached is one line on stderr naming it (credentials masked), never a traceback: :class:`LongcallGroup`
maps the connection errors of every command, and the CLI's own connections time out within seconds.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode

import click
import httpx
import kombu.exceptions
import psycopg
import redis.exceptions
import sqlalchemy.exc
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeout
from rich.console import Console

from adapters import detect_generation, redact_url
from ledger import migrate as migrations
from ledger.errors import LedgerError, OperationNotFound
from ledger.records import ControlState, Operation
from ledger.repository import Ledger
from ledger.states import TerminalKind
from workers import cli_output as output
from workers.app import celery_config, create_app, is_redis
from workers.budget import label_request
from workers.dev.command import dev
from workers.errors import ConfigError, NoToken, WrongState
from workers.executor import Executor, Resolution
from workers.launch_gate import evaluate_gate
from workers.metrics import metrics
from workers.rollout import FIRST_CANARY_PERCENT, RolloutState, plain_percent, side_effect_free_tools
from workers.runtime import Runtime
from workers.settings import Settings, load_settings
from workers.simulation.command import simulate
from workers.steps.context import StepContext, spread, utc_now
from workers.submission import ADAPTERS

console = Console()
errors = Console(stderr=True)

EXIT_OK = 0
#: A refusal: the request was understood and refused (a bad configuration, no such operation, a wrong
#: state, a worker's refusal), with its reason.
EXIT_REFUSED = 1
#: A usage error: a missing or bad option or argument (click's own code).
EXIT_USAGE = 2
#: The database, Redis or the broker cannot be reached: one line naming which and where.
EXIT_UNREACHABLE = 3
#: Nothing answered in time: no worker took the request within ``--timeout``, or ``watch`` ran out.
EXIT_TIMEOUT = 4
EXIT_CODES = {
    EXIT_OK: "ok",
    EXIT_REFUSED: "refused (the reason on stderr)",
    EXIT_USAGE: "usage error",
    EXIT_UNREACHABLE: "the database, Redis or the broker cannot be reached",
    EXIT_TIMEOUT: "timed out waiting for a worker (or, for watch, for a final state)",
}
#: Seconds the CLI's own connections (Postgres, Redis, the broker) may take to connect, and a Redis
#: command to answer (libpq's smallest connect_timeout is 2 s): a command fails within about 5 s.
CONNECT_TIMEOUT_S = 2


class Unreachable(click.ClickException):
    """A service the command needs cannot be reached: which, where (credentials masked) and why."""

    exit_code = EXIT_UNREACHABLE

    def show(self, file: Any = None) -> None:
        click.echo(f"longcall: {self.message}", err=True)


class TimedOut(click.ClickException):
    exit_code = EXIT_TIMEOUT


class LongcallGroup(click.Group):
    """Every command's connection errors become one line and :data:`EXIT_UNREACHABLE`; a database without
    the ledger's tables is a refusal that says to run ``longcall migrate``."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException:
            raise
        except Exception as exc:
            unreachable = _unreachable(exc)
            if unreachable is not None:
                raise unreachable from None
            if isinstance(exc, sqlalchemy.exc.ProgrammingError) and isinstance(
                exc.orig, psycopg.errors.UndefinedTable
            ):
                missing = str(exc.orig).splitlines()[0]
                raise click.ClickException(
                    f"the ledger has no tables yet ({missing}): run longcall migrate"
                ) from None
            raise


#: The errors of a connection that failed (refused, timed out, dropped), by the service they come from.
_DATABASE_ERRORS = (psycopg.OperationalError, psycopg.InterfaceError)
_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
_BROKER_ERRORS = (kombu.exceptions.OperationalError,)


def _unreachable(exc: BaseException, settings: Settings | None = None) -> Unreachable | None:
    """``exc`` (or what it was raised from) as the one-line error of the service it comes from, or None
    when it is no connection failure. A database error with an SQLSTATE is the server's answer, not a
    connection failure."""
    if settings is None:
        try:
            settings = load_settings()
        except ConfigError:
            return None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sqlalchemy.exc.DBAPIError):
            current = current.orig
            continue
        what: str | None = None
        url = ""
        shared = settings.broker == settings.redis_url
        if isinstance(current, _BROKER_ERRORS):
            what, url = ("Redis (broker and result backend)" if shared else "the broker"), settings.broker
        elif isinstance(current, _REDIS_ERRORS):
            what = "Redis (broker and result backend)" if shared else "Redis (result backend, hot state)"
            url = settings.redis_url
        elif isinstance(current, _DATABASE_ERRORS) and getattr(current, "sqlstate", None) is None:
            what, url = "the database", settings.database_url
        if what is not None:
            reason = " ".join(str(current).split()) or type(current).__name__
            if what == "the database" and "does not exist" in reason:
                reason += " (longcall migrate creates it)"
            return Unreachable(f"cannot reach {what} at {redact_url(url)}: {reason[:300]}")
        current = current.__cause__ or current.__context__
    return None


def _settings() -> Settings:
    """The settings, the CLI's connect timeout added to the database URL (a command never hangs on a
    database that does not answer)."""
    try:
        settings = load_settings()
        settings.checked_fleet()  # refuse a bad LONGCALL_CONFIG before doing anything
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    return settings.model_copy(
        update={"database_url": with_connect_timeout(settings.database_url, CONNECT_TIMEOUT_S)}
    )


def with_connect_timeout(database_url: str, seconds: int) -> str:
    """``database_url`` with libpq's ``connect_timeout`` (unless it sets one already)."""
    base, _, query = database_url.partition("?")
    params = parse_qsl(query, keep_blank_values=True)
    if any(key == "connect_timeout" for key, _ in params):
        return database_url
    return f"{base}?{urlencode([*params, ('connect_timeout', str(seconds))])}"


def _cli_app(settings: Settings) -> Celery:
    """The Celery app the CLI sends with: connects within seconds, retries no failed connect or publish
    (a worker's app waits for its broker; a person at a terminal should not)."""
    app = create_app(settings)
    config = celery_config(settings)
    quick = {"max_retries": 0, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
    broker_options = dict(config["broker_transport_options"])
    broker_options.update(quick)
    if is_redis(settings.broker):
        broker_options.update(socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=CONNECT_TIMEOUT_S)
    app.conf.update(
        broker_connection_timeout=CONNECT_TIMEOUT_S,
        broker_connection_max_retries=1,
        broker_transport_options=broker_options,
        task_publish_retry_policy=quick,
        redis_socket_connect_timeout=CONNECT_TIMEOUT_S,
        redis_socket_timeout=CONNECT_TIMEOUT_S,
        result_backend_transport_options={
            **config["result_backend_transport_options"],
            "retry_policy": quick,
        },
    )
    return app


@contextmanager
def _ledger(settings: Settings | None = None) -> Iterator[Ledger]:
    """The ledger for one command, on one connection, disposed on the way out whatever happens."""
    ledger = Ledger.from_url((settings or _settings()).database_url, pool_size=1)
    try:
        yield ledger
    finally:
        ledger.dispose()


def _actor() -> str:
    """Who an operator's decision is recorded as (kept in the ledger with the decision)."""
    return os.environ.get("USER", "operator")


@click.group(
    cls=LongcallGroup,
    epilog="Exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()) + ".",
)
@click.version_option(package_name="longcall")
def main() -> None:
    """longcall: long-running tool calls under a terminal-state protocol."""


@main.command()
def migrate() -> None:
    """Create or upgrade the ledger tables in LONGCALL_DATABASE_URL (Alembic, to head)."""
    settings = _settings()
    try:
        if migrations.ensure_database(settings.database_url):
            console.print("created the ledger database")
        migrations.upgrade(settings.database_url)
    except Exception as exc:
        if _unreachable(exc, settings) is not None:
            raise
        raise click.ClickException(f"migration failed: {exc}") from exc
    console.print(f"ledger at head ({', '.join(migrations.current_heads(settings.database_url))})")


@main.command()
@click.option("--call-node", "call_node_id", required=True, help="The pipeline's id for this call node.")
@click.option("--server", required=True, help="A server name from LONGCALL_CONFIG.")
@click.option("--tool", required=True)
@click.option("--args", "arguments", default="{}", show_default=True, help="The arguments, a JSON object.")
@click.option("--on-terminal", default=None, help="A Celery signature as JSON, called with receipt=...")
@click.option("--ttl-ms", type=int, default=None)
@click.option("--timeout", type=float, default=15.0, show_default=True, help="Seconds to wait for a worker.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def submit(
    call_node_id: str,
    server: str,
    tool: str,
    arguments: str,
    on_terminal: str | None,
    ttl_ms: int | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Enqueue longcall.submit through the broker, as a pipeline would, and print the operation."""
    kwargs: dict[str, Any] = {
        "call_node_id": call_node_id,
        "server": server,
        "tool": tool,
        "arguments": _json_option("--args", arguments),
    }
    if on_terminal is not None:
        kwargs["on_terminal"] = _json_option("--on-terminal", on_terminal)
    if ttl_ms is not None:
        kwargs["ttl_ms"] = ttl_ms
    answer = _send("longcall.submit", kwargs, timeout)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
    elif "op_id" not in answer:  # outside the canary: nothing was written (workers/rollout.py)
        console.print(f"not routed ({answer['reason']} at {answer['percent']}%): keep the legacy path")
    else:
        verb = "created" if answer.get("created") else "already exists"
        console.print(f"operation {answer['op_id']} {verb}: {answer['state']}")


@main.command()
@click.argument("ref", required=False)
@click.option("--events", "show_events", is_flag=True, help="Also list the operation's events.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def status(ref: str | None, show_events: bool, as_json: bool) -> None:
    """Show one operation, by op id, call node id, or SERVER:REMOTE_ID; without one, the fleet: who owns
    the execution epoch (and whether this environment, LONGCALL_EXECUTOR_ID, is it), admission, and the
    operations in flight by server, those on servers LONGCALL_CONFIG does not name called out."""
    if ref is None:
        _fleet_status(as_json)
        return
    with _ledger() as ledger:
        try:
            op = _find(ledger, ref)
            receipt = ledger.receipt_for(op.id)
            events = ledger.events(op.id) if show_events else None
            outbox = ledger.outbox_for(op.id)
        except LedgerError as exc:
            raise click.ClickException(str(exc)) from exc
    data = output.status_json(op, receipt, events, outbox)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    console.print(output.status_table(data, receipt))
    for line in output.outbox_lines(outbox):
        console.print(line)
    if events is not None:
        console.print(output.events_table(events))


def _fleet_status(as_json: bool) -> None:
    settings = _settings()
    with _ledger(settings) as ledger:
        control = ledger.control()
        in_flight = ledger.in_flight_by_server()
    data = output.fleet_status_json(control, settings.executor_id, in_flight, settings.fleet().servers)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for line in output.fleet_status_lines(data, control):
        console.print(line)


@main.command()
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print the result as stored (JSON), nothing else.")
def result(ref: str, as_json: bool) -> None:
    """Show the result of one operation's receipt, by op id, call node id, or SERVER:REMOTE_ID.

    Refused (exit code 1) while the operation has no receipt yet, naming its state."""
    with _ledger() as ledger:
        try:
            op = _find(ledger, ref)
            receipt = ledger.receipt_for(op.id)
        except LedgerError as exc:
            raise click.ClickException(str(exc)) from exc
    if receipt is None:
        raise click.ClickException(f"operation {op.id} has no receipt yet: it is {op.state.value}")
    if as_json:
        click.echo(json.dumps(op.result))
        return
    click.echo(output.result_head(op, receipt))
    click.echo(output.result_text(op.result))


def _send(task: str, kwargs: dict[str, Any], timeout: float) -> Any:
    settings = _settings()
    app = _cli_app(settings)
    try:
        return app.send_task(task, kwargs=kwargs, queue="longcall.control").get(timeout=timeout)
    except CeleryTimeout:
        raise TimedOut(
            f"no longcall worker answered within {timeout:g}s; is one consuming longcall.control?"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the worker's refusal arrives as a rebuilt exception class
        unreachable = _unreachable(exc, settings)
        if unreachable is not None:
            raise unreachable from None
        raise click.ClickException(f"refused: {exc}") from None
    finally:
        app.close()


@main.command()
@click.argument("ref")
@click.option("--timeout", type=float, default=15.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def cancel(ref: str, timeout: float, as_json: bool) -> None:
    """Request the cancel of one operation (a request: the server's answer decides the outcome)."""
    op = _lookup(ref)
    answer = _send("longcall.cancel", {"op_id": str(op.id)}, timeout)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
    else:
        console.print(f"operation {op.id}: {answer['action']}")


@main.command("input")
@click.argument("ref")
@click.option("--round", "input_round", type=int, required=True, help="The input round being answered.")
@click.option(
    "--response", required=True, help='The reply body, e.g. {"action": "accept", "content": {...}}.'
)
@click.option("--timeout", type=float, default=15.0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def input_(ref: str, input_round: int, response: str, timeout: float, as_json: bool) -> None:
    """Answer an operation's input request for its current round (the approval gate, by hand)."""
    op = _lookup(ref)
    kwargs = {
        "op_id": str(op.id),
        "input_round": input_round,
        "response": _json_option("--response", response),
    }
    answer = _send("longcall.provide_input", kwargs, timeout)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
    else:
        console.print(f"operation {op.id}: {answer['action']}")


@main.command()
@click.argument("ref", required=False)
@click.option(
    "--found", "remote_id", default=None, help="Evidence says it exists on the server as REMOTE_ID."
)
@click.option(
    "--session",
    "session_ref",
    default=None,
    help="With --found: the MCP session it is bound to (needed by MCP 2025-11-25 when none is recorded; "
    "'' for a server that keeps no sessions).",
)
@click.option("--never-created", is_flag=True, help="Evidence says the server never created it: resubmit.")
@click.option("--terminal", type=click.Choice(["completed", "failed", "cancelled"]), default=None)
@click.option(
    "--close", "close_id", type=int, default=None, help="Close reconciliation record ID as handled."
)
@click.option(
    "--resend",
    "resend_id",
    type=int,
    default=None,
    metavar="OUTBOX_ID",
    help="Put dead-lettered outbox row OUTBOX_ID back to ready, its attempts reset: the next drain sends it.",
)
@click.option("--evidence", default=None, help="What the decision rests on (kept in the ledger).")
@click.option("--json", "as_json", is_flag=True)
def reconcile(
    ref: str | None,
    remote_id: str | None,
    session_ref: str | None,
    never_created: bool,
    terminal: str | None,
    close_id: int | None,
    resend_id: int | None,
    evidence: str | None,
    as_json: bool,
) -> None:
    """List what waits for an operator, or resolve one operation (or close one record, or resend one
    dead-lettered outbox row) with evidence."""
    settings = _settings()
    decisions = [
        remote_id is not None,
        never_created,
        terminal is not None,
        close_id is not None,
        resend_id is not None,
    ]
    if sum(decisions) > 1:
        raise click.UsageError("choose one of --found, --never-created, --terminal, --close, --resend")
    with _ledger(settings) as ledger:
        if not any(decisions):
            _list_reconciliations(ledger, ref, as_json)
            return
        if not evidence:
            raise click.UsageError("a decision needs --evidence (what it rests on; it is kept in the ledger)")
        if close_id is not None:
            _close_reconciliation(ledger, close_id, evidence)
            return
        if resend_id is not None:
            _resend_outbox(ledger, resend_id, evidence, as_json)
            return
        if ref is None:
            raise click.UsageError("name the operation to resolve")
        op = _find(ledger, ref)
        kind: Literal["found", "never_created", "terminal"] = (
            "found" if remote_id is not None else "never_created" if never_created else "terminal"
        )
        resolution = Resolution(
            kind,
            evidence,
            _actor(),
            remote_id=remote_id,
            session_ref=session_ref,
            terminal=TerminalKind(terminal) if terminal else None,
        )
        runtime = Runtime.from_settings(settings)
        try:
            after = Executor(runtime).resolve(op.id, resolution)
        except (WrongState, ValueError, LedgerError) as exc:
            raise click.ClickException(str(exc)) from exc
        finally:
            runtime.close()
    if as_json:
        click.echo(json.dumps(output.operation_json(after), indent=2))
    else:
        console.print(f"operation {after.id}: {after.state.value}")


def _list_reconciliations(ledger: Ledger, ref: str | None, as_json: bool) -> None:
    records = [r for r in ledger.open_reconciliations() if ref is None or str(r.op_id) == ref]
    now = dt.datetime.now(dt.UTC)
    if as_json:
        rows = [{**output.jsonable(dataclasses.asdict(r)), "overdue": r.deadline <= now} for r in records]
        click.echo(json.dumps(rows, indent=2))
        return
    console.print(output.reconciliations_table(records, now) if records else "nothing waits for an operator")


def _close_reconciliation(ledger: Ledger, close_id: int, evidence: str) -> None:
    """Close one open record as handled, unless it is what holds its operation in MANUAL_RECONCILIATION
    (its last open record there): closed, the operation would wait for an operator with nothing listed."""
    actor = _actor()
    closed, op_id = ledger.close_reconciliation(
        close_id,
        resolution=f"closed by {actor}: {evidence}",
        detail={"actor": actor, "evidence": evidence},
    )
    if closed == "not_open":
        raise click.ClickException(f"no open reconciliation record {close_id}")
    if closed == "holds_operation":
        raise click.ClickException(
            f"record {close_id} holds operation {op_id} in MANUAL_RECONCILIATION (its last open record): "
            "closing it would hide the operation. Refused: resolve the operation instead: longcall reconcile "
            f"{op_id} --found REMOTE_ID | --never-created | --terminal STATE --evidence ..."
        )
    console.print(f"record {close_id} closed")


def _resend_outbox(ledger: Ledger, outbox_id: int, evidence: str, as_json: bool) -> None:
    """A dead-lettered outbox row back to ready (rule 9), for the beat's next drain to send."""
    resend = ledger.resend_outbox(outbox_id, actor=_actor(), evidence=evidence)
    if resend.found is None:
        raise click.ClickException(f"no outbox row {outbox_id}")
    if not resend.resent:
        raise click.ClickException(f"outbox row {outbox_id} is {resend.found}, not dead: nothing to resend")
    if as_json:
        click.echo(json.dumps(output.resend_json(resend), indent=2))
        return
    console.print(output.resend_line(resend))


@main.command()
@click.argument("ref")
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="Stop watching after this long."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per event.")
def watch(ref: str, timeout: float, as_json: bool) -> None:
    """Follow one operation's events until it is final (or the timeout)."""
    with _ledger() as ledger:
        deadline = time.monotonic() + timeout
        seen = 0
        op = _find(ledger, ref)
        with console.status(f"{op.id}: {op.state.value}") as spinner:
            while True:
                for event in ledger.events(op.id)[seen:]:
                    seen += 1
                    if as_json:
                        click.echo(json.dumps(output.jsonable(event)))
                    else:
                        console.print(output.event_line(event), soft_wrap=True)
                op = ledger.get(op.id)
                spinner.update(f"{op.id}: {op.state.value} ({op.server_state or '-'})")
                if op.is_final or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    if not op.is_final:
        raise TimedOut(f"still {op.state.value} after {timeout:g}s")


@main.command()
@click.option("--json", "as_json", is_flag=True)
def inputs(as_json: bool) -> None:
    """What waits for input: the approval gate's rounds (round, deadline, the server's question), and the
    operations whose server waits for input that could not be read (rule 10), with what is known."""
    settings = _settings()
    with _ledger(settings) as ledger:
        waiting = ledger.waiting_for_input()
        unreadable = ledger.unreadable_inputs()
    rows = output.inputs_rows(waiting, unreadable, unreadable_s=settings.input_unreadable_s)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print("nothing waits for input")
        return
    console.print(output.inputs_table(rows))
    console.print(output.INPUT_HINT)


@main.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the gate as JSON.")
@click.pass_context
def gate(ctx: click.Context, as_json: bool) -> None:
    """The launch gate: the seed's rollout criteria over the live ledger and Redis (divergence, second
    operations, poll amplification, cancel confirmation, UNKNOWN age and deadlines, advances with a
    receipt). Exit code 1 when any criterion fails; each failing line names what is behind it. (What
    waits for input, the approval gate's queue, is ``longcall inputs``.)"""
    if ctx.invoked_subcommand is not None:
        return
    settings = _settings()
    with _ledger(settings) as ledger:
        report = evaluate_gate(ledger, settings)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        console.print(output.launch_gate_table(report.to_json()))
        console.print("gate: PASSED" if report.passed else "gate: FAILED")
    if not report.passed:
        ctx.exit(EXIT_REFUSED)


REASON_HELP = "Why (kept with the change in executor_control_audit)."


@main.command()
@click.option("--disable", "disable", default=None, metavar="PROTOCOL/VERSION", help="e.g. mcp/2025-11-25")
@click.option("--enable", "enable", default=None, metavar="PROTOCOL/VERSION")
@click.option(
    "--detect",
    is_flag=True,
    help="also probe each configured MCP server's generation (server/discover, initialize)",
)
@click.option("--reason", default=None, help=REASON_HELP)
@click.option("--json", "as_json", is_flag=True)
def adapters(
    disable: str | None, enable: str | None, as_json: bool, detect: bool = False, reason: str | None = None
) -> None:
    """Adapters by protocol version: in-flight operations, and disabling one for new operations (rule 14).

    A disabled adapter refuses new submissions; query, cancel and reconciliation of its operations keep
    working until the last one is final.
    """
    with _ledger() as ledger:
        for key, disabled in ((disable, True), (enable, False)):
            if key is not None:
                protocol, _, version = key.partition("/")
                if (protocol, version) not in ADAPTERS:
                    known = ", ".join(f"{p}/{v}" for p, v in sorted(ADAPTERS))
                    raise click.BadParameter(f"no adapter {key!r} (known: {known})")
                ledger.set_adapter_disabled(
                    protocol, version, disabled=disabled, actor=_actor(), reason=reason
                )
        control = ledger.control()
        in_flight = ledger.in_flight_by_adapter()
    settings = _settings()
    rows = output.adapter_rows(ADAPTERS, control.disabled_adapters, in_flight)
    servers = _detected_generations(settings) if detect else None
    if as_json:
        # The plain list stays as it was (scripts read it); with --detect, an object that says who owns
        # the epoch too (``longcall status --json`` always does).
        answer: Any = rows
        if servers is not None:
            epoch = output.ownership_json(control, settings.executor_id)
            answer = {"adapters": rows, "servers": servers, "epoch": epoch}
        click.echo(json.dumps(answer, indent=2))
        return
    console.print(output.adapters_table(rows))
    console.print(output.epoch_line(control, settings.executor_id))
    for server in servers or []:
        if not server["probed"]:
            console.print(f"{server['server']}: not probed: {server['detail']}")
            continue
        speaks = "" if server["speaks_configured"] else "  (does NOT speak the configured version)"
        console.print(
            f"{server['server']}: configured {server['configured']}, detected {server['generation']}"
            f"{' with tasks' if server['tasks'] else ''}{speaks} - {server['detail']}"
        )


def _detected_generations(settings: Settings) -> list[dict[str, Any]]:
    """Each configured MCP server's generation as probed now (the MCP tasks extension's discovery), each
    request charged to the server's control budget as a step's are (rule 4: a control token per request,
    the request named ``Longcall-Budget: control`` and counted for ``longcall metrics``). Without a token
    the probe of that server stops there, and says so: never a request over the budget."""
    found: list[dict[str, Any]] = []
    runtime = Runtime.from_settings(settings)
    ctx = StepContext(runtime, jitter=spread, clock=utc_now)
    try:
        with httpx.Client(timeout=5.0, event_hooks={"request": [label_request]}) as client:
            for name, server in sorted(runtime.fleet.servers.items()):
                if server.protocol != "mcp":
                    continue
                configured = server.protocol_version
                try:
                    generation = detect_generation(
                        client,
                        server.url,
                        server=name,
                        bearer_token=server.token,
                        budget=ctx.request_budget(name, "control"),
                    ).to_json()
                except NoToken as no_token:
                    detail = (
                        f"no control token (the next in {no_token.wait_s:.1f} s; control_qps "
                        f"{server.control_qps:g}): nothing more is sent to it now, within its control budget"
                    )
                    generation = {"server": name, "generation": "unknown", "tasks": False, "detail": detail}
                    found.append(
                        {**generation, "configured": configured, "speaks_configured": False, "probed": False}
                    )
                    continue
                speaks = generation["generation"] == configured
                found.append(
                    {**generation, "configured": configured, "speaks_configured": speaks, "probed": True}
                )
    finally:
        runtime.close()
    return found


@main.command()
@click.option(
    "--owner",
    default=None,
    metavar="EXECUTOR_ID",
    help="The executor identity (LONGCALL_EXECUTOR_ID) of the fleet that owns the new epoch; by default "
    "this environment's.",
)
@click.option("--any-owner", is_flag=True, help="The new epoch is every fleet's (no owner).")
@click.option("--reason", default=None, help=REASON_HELP)
@click.option("--json", "as_json", is_flag=True)
def rollback(owner: str | None, any_owner: bool, reason: str | None, as_json: bool) -> None:
    """Close admission and bump the execution epoch (rule 13), owned by one executor identity (this
    environment's LONGCALL_EXECUTOR_ID unless --owner or --any-owner): the fleet running under it takes over
    the in-flight operations on its next claim; every write of the old epoch is refused from then on, and a
    fleet of any other identity claims nothing and sends nothing (stop it; a later rollback can hand it an
    epoch). ``longcall rollout`` then opens admission again."""
    if any_owner and owner is not None:
        raise click.UsageError("--owner names the new epoch's owner, --any-owner gives it none: choose one")
    if owner is not None and not owner.strip():
        raise click.UsageError(
            "--owner needs an executor identity (LONGCALL_EXECUTOR_ID of the fleet to keep)"
        )
    settings = _settings()
    actor = _actor()
    with _ledger(settings) as ledger:
        ledger.set_admission(open_=False, actor=actor, reason=reason)
        control = ledger.bump_epoch(
            actor=actor, reason=reason, owner=None if any_owner else (owner or settings.executor_id)
        )
    owned = output.owned_by_text(control, settings.executor_id)
    _print_control(
        control, as_json, f"admission closed; execution epoch now {control.execution_epoch}, {owned}"
    )


@main.command()
@click.option(
    "--percent",
    type=click.FloatRange(0, 100),
    default=None,
    help=f"The canary: the share of call nodes routed to longcall (first {FIRST_CANARY_PERCENT}; a raise "
    "asks the launch gate; lowering is always allowed).",
)
@click.option("--shadow", type=click.Choice(["on", "off"]), default=None, help="Shadow mode on or off.")
@click.option("--force", is_flag=True, help="Raise the percentage although the gate fails (needs --reason).")
@click.option("--reason", default=None, help=REASON_HELP)
@click.option("--history", is_flag=True, help="List the audited control changes, newest first.")
@click.option("--json", "as_json", is_flag=True)
def rollout(
    percent: float | None, shadow: str | None, force: bool, reason: str | None, history: bool, as_json: bool
) -> None:
    """Open admission of new operations (after a rollback, once the executor to keep runs); with
    --percent or --shadow, change the rollout instead (workers/rollout.py); --history shows the audit.

    Raising the canary's percentage is refused (exit 1, naming the failing criteria) while the launch gate
    fails, unless --force with a --reason (audited as force_canary_percent)."""
    if history:
        if percent is not None or shadow is not None or force:
            raise click.UsageError("--history only lists; give it alone (with --json)")
        _print_history(as_json)
        return
    if force and (percent is None or not reason):
        raise click.UsageError("--force needs --percent and a --reason (kept in the audit)")
    actor = _actor()
    if percent is None and shadow is None:
        with _ledger() as ledger:
            control = ledger.set_admission(open_=True, actor=actor, reason=reason)
        _print_control(control, as_json, f"admission open; execution epoch {control.execution_epoch}")
        return
    settings = _settings()
    with _ledger(settings) as ledger:
        if shadow == "on" and not side_effect_free_tools(settings.fleet()):
            raise click.ClickException(
                "shadow mode runs only tools marked side_effect_free = true in LONGCALL_CONFIG "
                "([servers.NAME.tools.TOOL]); none is: refused"
            )
        # The gate is asked before anything changes: a refused raise changes nothing.
        decided = None if percent is None else _canary_decision(ledger, settings, percent, force, reason)
        if shadow is not None:
            control = ledger.set_shadow(on=shadow == "on", actor=actor, reason=reason)
        if percent is not None and decided is not None:
            action, why = decided
            control = ledger.set_canary_percent(
                plain_percent(percent), actor=actor, reason=why, action=action
            )
    state = RolloutState.from_control(control.rollout)
    canary = "not set (everything routed)" if state.canary_percent is None else f"{state.canary_percent}%"
    _print_control(control, as_json, f"canary {canary}; shadow {'on' if state.shadow else 'off'}")


def _canary_decision(
    ledger: Ledger, settings: Settings, percent: float, force: bool, reason: str | None
) -> tuple[str, str | None]:
    """The audit action and reason of setting the canary to ``percent``; a raise past a failing launch
    gate is refused (naming the failing criteria) unless forced."""
    current = RolloutState.from_control(ledger.control().rollout).canary_percent
    if percent <= (current if current is not None else FIRST_CANARY_PERCENT):
        return "set_canary_percent", reason  # lowering (or the first step) is always allowed
    report = evaluate_gate(ledger, settings)
    if report.passed:
        return "set_canary_percent", reason
    if not force:
        failing = "; ".join(f"{c.name} ({c.measured}, target {c.target})" for c in report.failing)
        raise click.ClickException(
            f"the launch gate refuses raising the canary from {current}% to {plain_percent(percent)}%: "
            f"failing {failing}. longcall gate shows what is behind each; --force --reason overrides"
        )
    names = ", ".join(c.name for c in report.failing)
    return "force_canary_percent", f"forced past the launch gate (failing: {names}): {reason}"


def _print_history(as_json: bool) -> None:
    with _ledger() as ledger:
        changes = ledger.control_history()
    if as_json:
        click.echo(json.dumps([c.to_json() for c in changes], indent=2))
        return
    if not changes:
        console.print("no control change recorded")
        return
    for change in changes:
        console.print(
            f"{change.at:%Y-%m-%d %H:%M:%S} {change.actor} {change.action}: {change.reason or '(no reason)'}",
            soft_wrap=True,
        )


def _print_control(control: ControlState, as_json: bool, text: str) -> None:
    if as_json:
        click.echo(json.dumps(output.jsonable(dataclasses.asdict(control)), indent=2))
    else:
        console.print(text)


def _lookup(ref: str) -> Operation:
    with _ledger() as ledger:
        return _find(ledger, ref)


def _find(ledger: Ledger, ref: str) -> Operation:
    """An operation by op id, submission key, call node id, or SERVER:REMOTE_ID (in that order)."""
    op: Operation | None = None
    try:
        key = uuid.UUID(ref)
    except ValueError:
        pass
    else:
        try:
            return ledger.get(key)
        except OperationNotFound:
            op = ledger.find_by_submission_key(key)
    op = op or ledger.find_by_call_node(ref)
    if op is None and ":" in ref:
        server, _, remote_id = ref.partition(":")
        op = ledger.find_by_remote(server, remote_id)
    if op is None:
        raise click.ClickException(
            f"no operation with op id, submission key, call node id or SERVER:REMOTE_ID {ref!r}"
        )
    return op


def _json_option(name: str, value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=name) from exc


main.add_command(metrics)
main.add_command(dev)
gate.add_command(simulate)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
