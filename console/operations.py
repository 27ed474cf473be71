"""The commands on one operation and what waits on them: ``submit``, ``status``, ``result``, ``watch``,
``cancel``, ``input`` and ``inputs``. Reads go to the ledger; ``submit``, ``cancel`` and ``input`` go
through the fleet like any pipeline (a task sent by name, a worker's answer awaited)."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

import click

from console import output
from console.common import (
    TimedOut,
    cli_settings,
    console,
    find_operation,
    json_option,
    lookup_operation,
    open_ledger,
    send_to_worker,
)
from ledger.errors import LedgerError


@click.command()
@click.option("--call-node", "call_node_id", required=True, help="The pipeline's id for this call node.")
@click.option("--server", required=True, help="A server name from LONGCALL_CONFIG.")
@click.option("--tool", required=True, help="The tool to call on that server.")
@click.option("--args", "arguments", default="{}", show_default=True, help="The arguments, a JSON object.")
@click.option("--on-terminal", default=None, help="A Celery signature as JSON, called with receipt=...")
@click.option("--ttl-ms", type=int, default=None, help="The task's time to live asked of the server, in ms.")
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
        "arguments": json_option("--args", arguments),
    }
    if on_terminal is not None:
        kwargs["on_terminal"] = json_option("--on-terminal", on_terminal)
    if ttl_ms is not None:
        kwargs["ttl_ms"] = ttl_ms
    answer = send_to_worker("longcall.submit", kwargs, timeout)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
    elif "op_id" not in answer:  # outside the canary: nothing was written (workers/rollout.py)
        console.print(f"not routed ({answer['reason']} at {answer['percent']}%): keep the legacy path")
    else:
        verb = "created" if answer.get("created") else "already exists"
        console.print(f"operation {answer['op_id']} {verb}: {answer['state']}")


@click.command()
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
    with open_ledger() as ledger:
        try:
            op = find_operation(ledger, ref)
            receipt = ledger.receipt_for(op.id)
            events = ledger.events(op.id) if show_events else None
            outbox = ledger.outbox_for(op.id)
            last_error = ledger.last_error(op.id)
            records = [r for r in ledger.reconciliations_for(op.id) if r.resolved_at is None]
        except LedgerError as exc:
            raise click.ClickException(str(exc)) from exc
    data = output.status_json(op, receipt, events, outbox, last_error=last_error, records=records)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    console.print(output.status_table(data, receipt))
    for line in output.outbox_lines(outbox):
        console.print(line)
    for record in records:
        console.print(output.record_line(record))
    if events is not None:
        console.print(output.events_table(events))


def _fleet_status(as_json: bool) -> None:
    settings = cli_settings()
    with open_ledger(settings) as ledger:
        control = ledger.control()
        in_flight = ledger.in_flight_by_server()
    data = output.fleet_status_json(control, settings.executor_id, in_flight, settings.fleet().servers)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for line in output.fleet_status_lines(data, control):
        console.print(line)


@click.command()
@click.argument("ref")
@click.option("--json", "as_json", is_flag=True, help="Print the result as stored (JSON), nothing else.")
def result(ref: str, as_json: bool) -> None:
    """Show the result of one operation's receipt, by op id, call node id, or SERVER:REMOTE_ID.

    Refused (exit code 1) while the operation has no receipt yet, naming its state."""
    with open_ledger() as ledger:
        try:
            op = find_operation(ledger, ref)
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


@click.command()
@click.argument("ref")
@click.option(
    "--call-node",
    "by_call_node",
    is_flag=True,
    help="REF is a call node id, sent as it is: a call node not submitted yet ends cancelled when it is.",
)
@click.option("--timeout", type=float, default=15.0, show_default=True, help="Seconds to wait for a worker.")
@click.option("--json", "as_json", is_flag=True, help="Print the worker's answer as JSON.")
def cancel(ref: str, by_call_node: bool, timeout: float, as_json: bool) -> None:
    """Request the cancel of one operation (a request: the server's answer decides the outcome)."""
    if by_call_node:
        answer = send_to_worker("longcall.cancel", {"call_node_id": ref}, timeout)
        if answer.get("op_id"):
            said = f"operation {answer['op_id']}"
        elif answer.get("action") == "not_routed":
            said = f"call node {ref} (outside the canary: it runs on the caller's legacy path)"
        else:
            said = f"call node {ref} (not submitted yet)"
    else:
        op = lookup_operation(ref)
        answer = send_to_worker("longcall.cancel", {"op_id": str(op.id)}, timeout)
        said = f"operation {op.id}"
    if as_json:
        click.echo(json.dumps(answer, indent=2))
    else:
        console.print(f"{said}: {answer['action']}")


@click.command("input")
@click.argument("ref")
@click.option("--round", "input_round", type=int, required=True, help="The input round being answered.")
@click.option(
    "--response", required=True, help='The reply body, e.g. {"action": "accept", "content": {...}}.'
)
@click.option("--timeout", type=float, default=15.0, show_default=True, help="Seconds to wait for a worker.")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def input_(ref: str, input_round: int, response: str, timeout: float, as_json: bool) -> None:
    """Answer an operation's input request for its current round (the approval gate, by hand)."""
    op = lookup_operation(ref)
    kwargs = {
        "op_id": str(op.id),
        "input_round": input_round,
        "response": json_option("--response", response),
    }
    answer = send_to_worker("longcall.provide_input", kwargs, timeout)
    if as_json:
        click.echo(json.dumps(answer, indent=2))
    else:
        console.print(f"operation {op.id}: {answer['action']}")


@click.command()
@click.argument("ref")
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="Stop watching after this long."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON line per event.")
def watch(ref: str, timeout: float, as_json: bool) -> None:
    """Follow one operation until it is final (or the timeout): its events as they come, and between them
    its progress (polls, the server's status message, elapsed time), a line each time the server's status
    or message changes (with --json: a "progress" object)."""
    with open_ledger() as ledger:
        deadline = time.monotonic() + timeout
        seen = 0
        op = find_operation(ledger, ref)
        said: tuple[str | None, str | None] = (op.server_state, op.status_message)
        with console.status(f"{op.id}: {op.state.value}") as spinner:
            while True:
                for event in ledger.events(op.id)[seen:]:
                    seen += 1
                    if as_json:
                        click.echo(json.dumps(output.jsonable(event)))
                    else:
                        console.print(output.event_line(event), soft_wrap=True)
                op = ledger.get(op.id, with_body=False)
                now = dt.datetime.now(dt.UTC)
                spinner.update(output.progress_text(op, now))
                if (op.server_state, op.status_message) != said and not op.is_final:
                    said = (op.server_state, op.status_message)
                    if as_json:
                        click.echo(json.dumps({"progress": output.progress_json(op, now)}))
                    else:
                        console.print(output.progress_line(op, now), soft_wrap=True)
                if op.is_final or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
    if not op.is_final:
        raise TimedOut(f"still {op.state.value} after {timeout:g}s")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def inputs(as_json: bool) -> None:
    """What waits for input: the approval gate's rounds (round, deadline, the server's question), and the
    operations whose server waits for input that could not be read (rule 10), with what is known."""
    settings = cli_settings()
    with open_ledger(settings) as ledger:
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
