"""The ``longcall`` command. Reads go to the ledger; ``submit`` goes through the fleet like any pipeline."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import uuid
from typing import Any, Literal

import click
from celery.exceptions import TimeoutError as CeleryTimeout
from rich.console import Console
from rich.table import Table

from ledger import migrate as migrations
from ledger.errors import LedgerError, OperationNotFound
from ledger.repository import Ledger, Operation
from ledger.states import TerminalKind
from workers.app import create_app
from workers.executor import Executor, Resolution, WrongState
from workers.runtime import Runtime
from workers.settings import ConfigError, Settings, load_settings
from workers.submission import ADAPTERS

console = Console()
errors = Console(stderr=True)


def _settings() -> Settings:
    try:
        settings = load_settings()
        settings.fleet()  # refuse a bad LONGCALL_CONFIG before doing anything
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    return settings


@click.group()
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
    else:
        verb = "created" if answer.get("created") else "already exists"
        console.print(f"operation {answer['op_id']} {verb}: {answer['state']}")


@main.command()
@click.argument("ref")
@click.option("--events", "show_events", is_flag=True, help="Also list the operation's events.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def status(ref: str, show_events: bool, as_json: bool) -> None:
    """Show one operation, by op id, call node id, or SERVER:REMOTE_ID."""
    ledger = Ledger.from_url(_settings().database_url, pool_size=1)
    try:
        op = _find(ledger, ref)
        receipt = ledger.receipt_for(op.id)
        events = ledger.events(op.id) if show_events else []
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        ledger.dispose()
    data = _operation_json(op)
    data["receipt"] = (
        None
        if receipt is None
        else {
            "receipt_id": str(receipt.id),
            "terminal_state": receipt.terminal_state.value,
            "result_digest": receipt.result_digest,
            "accepted_at": receipt.accepted_at.isoformat(),
        }
    )
    if show_events:
        data["events"] = [_jsonable(e) for e in events]
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    table = Table(show_header=False, box=None)
    for key in (
        "op_id",
        "call_node_id",
        "state",
        "server",
        "tool",
        "remote_id",
        "server_state",
        "status_message",
        "cancel_generation",
        "execution_epoch",
        "poll_cursor",
        "next_poll_at",
        "updated_at",
    ):
        table.add_row(key, "" if data[key] is None else str(data[key]))
    if receipt is not None:
        table.add_row("receipt", f"{receipt.terminal_state.value} {receipt.id}")
    console.print(table)
    if show_events:
        events_table = Table("seq", "at", "kind", "from", "to", "server_state")
        for event in events:
            events_table.add_row(
                str(event["seq"]),
                event["at"].isoformat(timespec="milliseconds"),
                event["kind"],
                event["from_state"] or "",
                event["to_state"] or "",
                event["server_state"] or "",
            )
        console.print(events_table)


def _send(task: str, kwargs: dict[str, Any], timeout: float) -> Any:
    app = create_app(_settings())
    try:
        return app.send_task(task, kwargs=kwargs, queue="longcall.control").get(timeout=timeout)
    except CeleryTimeout:
        raise click.ClickException(
            f"no longcall worker answered within {timeout:g}s; is one consuming longcall.control?"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the worker's refusal arrives as a rebuilt exception class
        raise click.ClickException(f"refused: {exc}") from None


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
@click.option("--session", "session_ref", default=None, help="With --found: the MCP session it is bound to.")
@click.option("--never-created", is_flag=True, help="Evidence says the server never created it: resubmit.")
@click.option("--terminal", type=click.Choice(["completed", "failed", "cancelled"]), default=None)
@click.option(
    "--close", "close_id", type=int, default=None, help="Close reconciliation record ID as handled."
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
    evidence: str | None,
    as_json: bool,
) -> None:
    """List what waits for an operator, or resolve one operation (or close one record) with evidence."""
    settings = _settings()
    decisions = [remote_id is not None, never_created, terminal is not None, close_id is not None]
    if sum(decisions) > 1:
        raise click.UsageError("choose one of --found, --never-created, --terminal, --close")
    ledger = Ledger.from_url(settings.database_url, pool_size=1)
    try:
        if not any(decisions):
            records = [r for r in ledger.open_reconciliations() if ref is None or str(r.op_id) == ref]
            rows = [_jsonable(dataclasses.asdict(r)) for r in records]
            if as_json:
                click.echo(json.dumps(rows, indent=2))
                return
            table = Table("id", "op_id", "reason", "opened", "deadline")
            for r in records:
                table.add_row(
                    str(r.id),
                    str(r.op_id),
                    r.reason.value,
                    r.opened_at.isoformat(timespec="seconds"),
                    r.deadline.isoformat(timespec="seconds"),
                )
            console.print(table if records else "nothing waits for an operator")
            return
        if not evidence:
            raise click.UsageError("a decision needs --evidence (what it rests on; it is kept in the ledger)")
        actor = os.environ.get("USER", "operator")
        if close_id is not None:
            if not ledger.resolve_reconciliation(
                close_id,
                resolution=f"closed by {actor}: {evidence}",
                detail={"actor": actor, "evidence": evidence},
            ):
                raise click.ClickException(f"no open reconciliation record {close_id}")
            console.print(f"record {close_id} closed")
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
            actor,
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
    finally:
        ledger.dispose()
    if as_json:
        click.echo(json.dumps(_operation_json(after), indent=2))
    else:
        console.print(f"operation {after.id}: {after.state.value}")


@main.command()
@click.argument("ref")
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="Stop watching after this long."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per event.")
def watch(ref: str, timeout: float, as_json: bool) -> None:
    """Follow one operation's events until it is final (or the timeout)."""
    ledger = Ledger.from_url(_settings().database_url, pool_size=1)
    deadline = time.monotonic() + timeout
    seen = 0
    try:
        op = _find(ledger, ref)
        with console.status(f"{op.id}: {op.state.value}") as spinner:
            while True:
                for event in ledger.events(op.id)[seen:]:
                    seen += 1
                    if as_json:
                        click.echo(json.dumps(_jsonable(event)))
                    else:
                        moved = (
                            f"{event['from_state']} -> {event['to_state']}"
                            if event["from_state"] != event["to_state"]
                            else event["to_state"]
                        )
                        console.print(
                            f"{event['at'].strftime('%H:%M:%S.%f')[:-3]} {event['kind']:<20} {moved}"
                            + (f" ({event['server_state']})" if event["server_state"] else ""),
                            soft_wrap=True,
                        )
                op = ledger.get(op.id)
                spinner.update(f"{op.id}: {op.state.value} ({op.server_state or '-'})")
                if op.is_final or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    finally:
        ledger.dispose()
    if not op.is_final:
        raise click.ClickException(f"still {op.state.value} after {timeout:g}s")


@main.command()
@click.option("--json", "as_json", is_flag=True)
def gate(as_json: bool) -> None:
    """The approval gate: operations whose server waits for input, with round, deadline and request."""
    ledger = Ledger.from_url(_settings().database_url, pool_size=1)
    try:
        waiting = ledger.waiting_for_input()
    finally:
        ledger.dispose()
    rows: list[dict[str, Any]] = [
        {
            "op_id": str(op.id),
            "call_node_id": op.call_node_id,
            "input_round": op.input_round,
            "deadline": _jsonable(op.input_deadline),
            "method": (op.input_request or {}).get("method"),
            "request": (op.input_request or {}).get("params"),
            "schema": (op.input_request or {}).get("schema"),
            "schema_digest": op.input_schema_digest,
        }
        for op in waiting
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print("nothing waits for input")
        return
    table = Table("op_id", "call node", "round", "deadline", "asks")
    for row in rows:
        message = (row["request"] or {}).get("message", row["method"])
        table.add_row(
            row["op_id"], row["call_node_id"], str(row["input_round"]), str(row["deadline"]), str(message)
        )
    console.print(table)
    console.print(
        'answer with: longcall input OP --round N --response \'{"action": "accept", "content": {...}}\''
    )


@main.command()
@click.option("--disable", "disable", default=None, metavar="PROTOCOL/VERSION", help="e.g. mcp/2025-11-25")
@click.option("--enable", "enable", default=None, metavar="PROTOCOL/VERSION")
@click.option("--json", "as_json", is_flag=True)
def adapters(disable: str | None, enable: str | None, as_json: bool) -> None:
    """Adapters by protocol version: in-flight operations, and disabling one for new operations (rule 14).

    A disabled adapter refuses new submissions; query, cancel and reconciliation of its operations keep
    working until the last one is final.
    """
    ledger = Ledger.from_url(_settings().database_url, pool_size=1)
    actor = os.environ.get("USER", "operator")
    try:
        for key, disabled in ((disable, True), (enable, False)):
            if key is not None:
                protocol, _, version = key.partition("/")
                if (protocol, version) not in ADAPTERS:
                    known = ", ".join(f"{p}/{v}" for p, v in sorted(ADAPTERS))
                    raise click.BadParameter(f"no adapter {key!r} (known: {known})")
                ledger.set_adapter_disabled(protocol, version, disabled=disabled, actor=actor)
        control = ledger.control()
        in_flight = ledger.in_flight_by_adapter()
    finally:
        ledger.dispose()
    rows: list[dict[str, Any]] = [
        {
            "adapter": f"{p}/{v}",
            "disabled": f"{p}/{v}" in control.disabled_adapters,
            "in_flight": in_flight.get(f"{p}/{v}", 0),
        }
        for p, v in sorted(ADAPTERS)
    ]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table("adapter", "new operations", "in flight")
    for row in rows:
        table.add_row(row["adapter"], "disabled" if row["disabled"] else "enabled", str(row["in_flight"]))
    console.print(table)


@main.command()
@click.option("--json", "as_json", is_flag=True)
def rollback(as_json: bool) -> None:
    """Close admission and bump the execution epoch (rule 13): the executor that runs next takes over the
    in-flight operations on its next claim, and every write of the old epoch is refused from then on."""
    ledger = Ledger.from_url(_settings().database_url, pool_size=1)
    actor = os.environ.get("USER", "operator")
    try:
        ledger.set_admission(open_=False, actor=actor)
        control = ledger.bump_epoch(actor=actor)
    finally:
        ledger.dispose()
    _print_control(control, as_json, f"admission closed; execution epoch now {control.execution_epoch}")


@main.command()
@click.option("--json", "as_json", is_flag=True)
def rollout(as_json: bool) -> None:
    """Open admission of new operations (after a rollback, once the executor to keep runs)."""
    ledger = Ledger.from_url(_settings().database_url, pool_size=1)
    try:
        control = ledger.set_admission(open_=True, actor=os.environ.get("USER", "operator"))
    finally:
        ledger.dispose()
    _print_control(control, as_json, f"admission open; execution epoch {control.execution_epoch}")


def _print_control(control: Any, as_json: bool, text: str) -> None:
    if as_json:
        click.echo(json.dumps(_jsonable(dataclasses.asdict(control)), indent=2))
    else:
        console.print(text)


def _lookup(ref: str) -> Operation:
    ledger = Ledger.from_url(_settings().database_url, pool_size=1)
    try:
        return _find(ledger, ref)
    finally:
        ledger.dispose()


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


def _operation_json(op: Operation) -> dict[str, Any]:
    return {
        "op_id": str(op.id),
        "call_node_id": op.call_node_id,
        "state": op.state.value,
        "server": op.server,
        "tool": op.tool_name,
        "protocol": op.protocol,
        "protocol_version": op.protocol_version,
        "remote_id": op.remote_id,
        "server_state": op.server_state,
        "status_message": op.status_message,
        "submission_key": str(op.submission_key),
        "cancel_generation": op.cancel_generation,
        "execution_epoch": op.execution_epoch,
        "poll_cursor": op.poll_cursor,
        "next_poll_at": _jsonable(op.next_poll_at),
        "input_round": op.input_round,
        "result_digest": op.result_digest,
        "created_at": _jsonable(op.created_at),
        "updated_at": _jsonable(op.updated_at),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _json_option(name: str, value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=name) from exc


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
