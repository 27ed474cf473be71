"""The ``longcall`` command. Reads go to the ledger; ``submit`` goes through the fleet like any pipeline."""

from __future__ import annotations

import json
import sys
import uuid
from typing import Any

import click
from celery.exceptions import TimeoutError as CeleryTimeout
from rich.console import Console
from rich.table import Table

from ledger import migrate as migrations
from ledger.errors import LedgerError
from ledger.repository import Ledger, Operation
from workers.app import create_app
from workers.settings import ConfigError, Settings, load_settings

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
    app = create_app(_settings())
    try:
        answer = app.send_task("longcall.submit", kwargs=kwargs, queue="longcall.control").get(
            timeout=timeout
        )
    except CeleryTimeout:
        raise click.ClickException(
            f"no longcall worker answered within {timeout:g}s; is one consuming longcall.control?"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the worker's refusal arrives as a rebuilt exception class
        raise click.ClickException(f"refused: {exc}") from None
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


def _find(ledger: Ledger, ref: str) -> Operation:
    try:
        return ledger.get(uuid.UUID(ref))
    except ValueError:
        pass
    op = ledger.find_by_call_node(ref)
    if op is None and ":" in ref:
        server, _, remote_id = ref.partition(":")
        op = ledger.find_by_remote(server, remote_id)
    if op is None:
        raise click.ClickException(f"no operation with op id, call node id or SERVER:REMOTE_ID {ref!r}")
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
