"""The operator's decisions on what the fleet could not decide alone: ``reconcile`` (resolve an operation
with evidence, close a record, resend a dead-lettered outbox row) and ``gate`` (the launch gate's
criteria over the live ledger and Redis; ``gate simulate``, ``console.simulation``, is wired under it at
the end of this module)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Literal

import click

from console import output
from console.common import EXIT_REFUSED, acting_operator, cli_settings, console, find_operation, open_ledger
from console.launch_gate import evaluate_gate
from ledger.errors import LedgerError
from ledger.repository import Ledger
from ledger.states import TerminalKind
from workers.errors import WrongState
from workers.executor import Executor, Resolution
from workers.runtime import Runtime


@click.command()
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
@click.option(
    "--terminal",
    type=click.Choice(["completed", "failed", "cancelled"]),
    default=None,
    help="Resolve with this terminal state, read from the server by the operator (with --evidence); "
    "'cancelled' is refused unless the server's status says so too or the server no longer knows the task.",
)
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
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
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
    settings = cli_settings()
    decisions = [
        remote_id is not None,
        never_created,
        terminal is not None,
        close_id is not None,
        resend_id is not None,
    ]
    if sum(decisions) > 1:
        raise click.UsageError("choose one of --found, --never-created, --terminal, --close, --resend")
    with open_ledger(settings) as ledger:
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
        op = find_operation(ledger, ref)
        kind: Literal["found", "never_created", "terminal"] = (
            "found" if remote_id is not None else "never_created" if never_created else "terminal"
        )
        resolution = Resolution(
            kind,
            evidence,
            acting_operator(),
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
    """The open records, or one operation's: REF as every command takes it (an op id or its prefix, a call
    node id, SERVER:REMOTE_ID)."""
    op_id = None if ref is None else find_operation(ledger, ref).id
    records = [r for r in ledger.open_reconciliations() if op_id is None or r.op_id == op_id]
    now = dt.datetime.now(dt.UTC)
    if as_json:
        rows = [{**output.jsonable(dataclasses.asdict(r)), "overdue": r.deadline <= now} for r in records]
        click.echo(json.dumps(rows, indent=2))
        return
    console.print(output.reconciliations_table(records, now) if records else "nothing waits for an operator")


def _close_reconciliation(ledger: Ledger, close_id: int, evidence: str) -> None:
    """Close one open record as handled, unless it is what holds its operation in MANUAL_RECONCILIATION
    (its last open record there): closed, the operation would wait for an operator with nothing listed."""
    actor = acting_operator()
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
    resend = ledger.resend_outbox(outbox_id, actor=acting_operator(), evidence=evidence)
    if resend.found is None:
        raise click.ClickException(f"no outbox row {outbox_id}")
    if not resend.resent:
        raise click.ClickException(f"outbox row {outbox_id} is {resend.found}, not dead: nothing to resend")
    if as_json:
        click.echo(json.dumps(output.resend_json(resend), indent=2))
        return
    console.print(output.resend_line(resend))


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the gate as JSON.")
@click.pass_context
def gate(ctx: click.Context, as_json: bool) -> None:
    """The launch gate: the seed's rollout criteria over the live ledger and Redis (divergence, second
    operations, poll amplification, cancel confirmation, UNKNOWN age and deadlines, advances with a
    receipt). Exit code 1 when any criterion fails; each failing line names what is behind it. (What
    waits for input, the approval gate's queue, is "longcall inputs".)"""
    if ctx.invoked_subcommand is not None:
        return
    settings = cli_settings()
    with open_ledger(settings) as ledger:
        report = evaluate_gate(ledger, settings)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        console.print(output.launch_gate_table(report.to_json()))
        if report.verdict == "missing evidence":
            console.print(f"gate: MISSING EVIDENCE: {'; '.join(report.missing)}")
        else:
            console.print(f"gate: {report.verdict.upper()}")
    if not report.passed:
        ctx.exit(EXIT_REFUSED)


def _wire_simulate() -> None:
    from console.simulation.command import simulate  # noqa: PLC0415 - only with the gate

    gate.add_command(simulate)


_wire_simulate()
