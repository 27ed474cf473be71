"""What the ``longcall`` command prints: the JSON shapes of ``--json`` and the tables and lines for people.

Pure functions of what the ledger returned; the commands in ``console.main`` read, decide and print. The
JSON keys are part of the command's interface (scripts parse them): add keys, never rename one.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

from ledger.states import OpState

if TYPE_CHECKING:
    from ledger.listing import LastError
    from ledger.outbox import OutboxResend, OutboxRow
    from ledger.records import ControlState, Operation, Receipt, ReconciliationRecord

STATUS_ROWS = (
    "op_id",
    "call_node_id",
    "state",
    "routing",
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
)

INPUT_HINT = 'answer with: longcall input OP --round N --response \'{"action": "accept", "content": {...}}\''


def jsonable(value: Any) -> Any:
    """``value`` with its datetimes and UUIDs as strings, recursively through dicts."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def operation_json(op: Operation) -> dict[str, Any]:
    return {
        "op_id": str(op.id),
        "call_node_id": op.call_node_id,
        "state": op.state.value,
        # live: longcall delivers its receipt; shadow: run beside the caller's legacy path, never delivered.
        "routing": op.routing,
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
        "next_poll_at": jsonable(op.next_poll_at),
        "input_round": op.input_round,
        "result_digest": op.result_digest,
        "created_at": jsonable(op.created_at),
        "updated_at": jsonable(op.updated_at),
    }


def status_json(
    op: Operation,
    receipt: Receipt | None,
    events: Sequence[Mapping[str, Any]] | None,
    outbox: Sequence[OutboxRow] | None = None,
    *,
    last_error: LastError | None = None,
    records: Sequence[ReconciliationRecord] = (),
    now: dt.datetime | None = None,
) -> dict[str, Any]:
    """``status --json``: the operation, how long it has run (``duration_s``: to its receipt once it has
    one), its polls, the last error its steps recorded, its receipt (or null) and the receipt's delivery
    (``dispatched``, ``pending`` or ``dead``, from its outbox row), its open reconciliation records, its
    outbox rows (what was, or is still to be, sent downstream: ``outbox``) and, when asked for, its
    events."""
    now = now or dt.datetime.now(dt.UTC)
    data = operation_json(op)
    ended = receipt.accepted_at if receipt is not None else None
    data["duration_s"] = round(((ended or now) - op.created_at).total_seconds(), 3)
    data["polls"] = {
        "unchanged": op.unchanged_polls,
        "no_token": op.no_token_count,
        "last_polled_at": jsonable(op.last_polled_at),
    }
    data["last_error"] = (
        None
        if last_error is None
        else {"error": last_error.error, "kind": last_error.kind, "at": last_error.at.isoformat()}
    )
    data["open_reconciliations"] = [
        {
            "id": r.id,
            "reason": r.reason.value,
            "opened_at": r.opened_at.isoformat(),
            "deadline": r.deadline.isoformat(),
            "overdue": r.deadline < now,
        }
        for r in records
    ]
    terminal = [row for row in outbox or () if row.kind == "terminal"]
    data["delivery"] = None if not terminal else _delivery(terminal[-1])
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
    if outbox is not None:
        data["outbox"] = [outbox_json(row) for row in outbox]
    if events is not None:
        data["events"] = [jsonable(e) for e in events]
    return data


def _delivery(row: OutboxRow) -> dict[str, Any]:
    """The receipt's delivery as its outbox row says: dispatched (when), pending (its attempts, last error
    and next try) or dead (``longcall reconcile --resend`` once the cause is fixed)."""
    status = {"ready": "pending"}.get(row.status, row.status)
    return {
        "status": status,
        "outbox_id": row.id,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "dispatched_at": jsonable(row.dispatched_at),
        "next_attempt_at": jsonable(row.next_attempt_at),
    }


def outbox_json(row: OutboxRow) -> dict[str, Any]:
    """One outbox row: ``status`` ready (``next_attempt_at``: not tried again before), dispatched, or dead
    (not published after its bounded attempts: ``longcall reconcile --resend ID`` once the cause is
    fixed)."""
    return {
        "outbox_id": row.id,
        "kind": row.kind,
        "input_round": row.input_round,
        "status": row.status,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "created_at": jsonable(row.created_at),
        "next_attempt_at": jsonable(row.next_attempt_at),
        "dispatched_at": jsonable(row.dispatched_at),
    }


def outbox_lines(rows: Iterable[OutboxRow]) -> list[str]:
    """``status``: one line per outbox row; a dead one in red with the command that sends it again."""
    lines = []
    for row in rows:
        what = f"outbox {row.id} ({row.kind}" + (f", round {row.input_round})" if row.input_round else ")")
        if row.status == "dispatched" and row.dispatched_at is not None:
            lines.append(f"{what}: dispatched {row.dispatched_at.isoformat(timespec='milliseconds')}")
        elif row.status == "dead":
            lines.append(
                f"[bold red]{what}: DEAD[/] after {row.attempts} failed attempts: "
                f"{escape(row.last_error or '')}\n  once the cause is fixed: "
                f"longcall reconcile --resend {row.id} --evidence '...'"
            )
        elif row.last_error:
            retry = row.next_attempt_at.isoformat(timespec="seconds") if row.next_attempt_at else "now"
            lines.append(
                f"{what}: not sent yet, {row.attempts} failed attempts counted, next try {retry}: "
                f"{escape(row.last_error)}"
            )
        else:
            lines.append(f"{what}: ready, to be sent")
    return lines


def resend_json(resend: OutboxResend) -> dict[str, Any]:
    return {
        "outbox_id": resend.outbox_id,
        "op_id": jsonable(resend.op_id),
        "status": "ready",
        "resolved_reconciliations": list(resend.resolved),
    }


def resend_line(resend: OutboxResend) -> str:
    resolved = ", ".join(str(r) for r in resend.resolved)
    return f"outbox row {resend.outbox_id} ready again: the next drain sends it" + (
        f"; record {resolved} resolved" if resolved else ""
    )


def status_table(data: Mapping[str, Any], receipt: Receipt | None) -> Table:
    table = Table(show_header=False, box=None)
    for key in STATUS_ROWS:
        table.add_row(key, "" if data[key] is None else str(data[key]))
    table.add_row("started", str(data["created_at"]))
    table.add_row("duration", f"{data['duration_s']:.1f} s" + ("" if receipt is not None else " so far"))
    polls = data["polls"]
    table.add_row(
        "polls",
        f"{polls['unchanged']} unchanged, {polls['no_token']} waited for a token"
        + (f", last {polls['last_polled_at']}" if polls["last_polled_at"] else ""),
    )
    error = data["last_error"]
    if error is not None:
        table.add_row("last error", escape(f"{error['kind']} at {error['at']}: {error['error']}"))
    if receipt is not None:
        table.add_row("receipt", f"{receipt.terminal_state.value} {receipt.id}")
    delivery = data["delivery"]
    if delivery is not None:
        table.add_row("delivery", delivery["status"])
    return table


def record_line(record: ReconciliationRecord) -> str:
    """``status``: an open reconciliation record of the operation, what an operator is asked to decide."""
    overdue = " [bold red]OVERDUE[/]" if record.deadline < dt.datetime.now(dt.UTC) else ""
    opened, deadline = (
        moment.isoformat(timespec="seconds") for moment in (record.opened_at, record.deadline)
    )
    return (
        f"reconciliation {record.id}: {record.reason.value}, opened {opened}, deadline {deadline}{overdue}"
        " (longcall reconcile)"
    )


def result_head(op: Operation, receipt: Receipt) -> str:
    """``result``: the receipt's terminal state, digest and acceptance, one per line (never cut to the
    terminal's width: a digest is copied whole), above the result itself."""
    rows = {
        "op_id": str(op.id),
        "call_node_id": op.call_node_id,
        "terminal_state": receipt.terminal_state.value,
        "result_digest": receipt.result_digest or "",
        "receipt": str(receipt.id),
        "accepted_at": receipt.accepted_at.isoformat(timespec="milliseconds"),
    }
    return "\n".join(f"{key:<15} {value}" for key, value in rows.items())


def result_text(result: Any) -> str:
    """The result pretty-printed (a cancelled operation has none)."""
    if result is None:
        return "(no result)"
    return json.dumps(result, indent=2, ensure_ascii=False)


def events_table(events: Iterable[Mapping[str, Any]]) -> Table:
    table = Table("seq", "at", "kind", "from", "to", "server_state")
    for event in events:
        table.add_row(
            str(event["seq"]),
            event["at"].isoformat(timespec="milliseconds"),
            event["kind"],
            event["from_state"] or "",
            event["to_state"] or "",
            event["server_state"] or "",
        )
    return table


def elapsed(seconds: float) -> str:
    """``42s``, ``7m05s``, ``3h12m``, ``2d04h``."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86_400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86_400}d{whole % 86_400 // 3600:02d}h"


def progress_json(op: Operation, now: dt.datetime) -> dict[str, Any]:
    """``watch --json``: the operation's progress between its events."""
    return {
        "op_id": str(op.id),
        "state": op.state.value,
        "server_state": op.server_state,
        "status_message": op.status_message,
        "unchanged_polls": op.unchanged_polls,
        "last_polled_at": jsonable(op.last_polled_at),
        "elapsed_s": round((now - op.created_at).total_seconds(), 1),
    }


def progress_text(op: Operation, now: dt.datetime) -> str:
    """``watch``'s live line: state, the server's, polls, elapsed, the server's message."""
    text = (
        f"{op.id}: {op.state.value} ({op.server_state or '-'}), {op.unchanged_polls} polls,"
        f" {elapsed((now - op.created_at).total_seconds())}"
    )
    return escape(text + (f": {op.status_message}" if op.status_message else ""))


def progress_line(op: Operation, now: dt.datetime) -> str:
    """``watch``: a line when the server's status or message changed between events."""
    said = f": {op.status_message}" if op.status_message else ""
    at = now.strftime("%H:%M:%S.%f")[:-3]
    return escape(
        f"{at} {'progress':<20} {op.state.value} ({op.server_state or '-'}){said}"
        f" after {op.unchanged_polls} polls, {elapsed((now - op.created_at).total_seconds())}"
    )


def event_line(event: Mapping[str, Any]) -> str:
    """One event as ``watch`` follows it: time, kind, the move (or the state it stayed in), server state."""
    moved = (
        f"{event['from_state']} -> {event['to_state']}"
        if event["from_state"] != event["to_state"]
        else event["to_state"]
    )
    return f"{event['at'].strftime('%H:%M:%S.%f')[:-3]} {event['kind']:<20} {moved}" + (
        f" ({event['server_state']})" if event["server_state"] else ""
    )


def reconciliations_table(records: Iterable[ReconciliationRecord], now: dt.datetime) -> Table:
    """Open records; one past its deadline (``now``) is marked OVERDUE (``--json``: ``"overdue": true``)."""
    table = Table("id", "op_id", "reason", "opened", "deadline", "")
    for r in records:
        table.add_row(
            str(r.id),
            str(r.op_id),
            r.reason.value,
            r.opened_at.isoformat(timespec="seconds"),
            r.deadline.isoformat(timespec="seconds"),
            "[bold red]OVERDUE[/]" if r.deadline <= now else "",
        )
    return table


def gate_rows(waiting: Iterable[Operation]) -> list[dict[str, Any]]:
    """``gate --json``: each operation whose server waits for input, with its round, deadline and request."""
    return [
        {
            "op_id": str(op.id),
            "call_node_id": op.call_node_id,
            "input_round": op.input_round,
            "deadline": jsonable(op.input_deadline),
            "method": (op.input_request or {}).get("method"),
            "request": (op.input_request or {}).get("params"),
            "schema": (op.input_request or {}).get("schema"),
            "schema_digest": op.input_schema_digest,
        }
        for op in waiting
    ]


def inputs_rows(
    waiting: Iterable[Operation],
    unreadable: Iterable[tuple[Operation, ReconciliationRecord | None]],
    *,
    unreadable_s: float,
) -> list[dict[str, Any]]:
    """``inputs --json``: what waits for input. The approval gate's rounds (``unreadable`` false), then the
    operations whose server waits for input whose request could not be read (rule 10): no round, no
    request, and what is known: the server's state and message, since when, and the operator's record."""
    rows = [{**row, "state": OpState.INPUT_REQUIRED.value, "unreadable": False} for row in gate_rows(waiting)]
    for op, record in unreadable:
        deadline: dt.datetime | None
        if record is not None:
            since = record.detail.get("unreadable_since")
            deadline = record.deadline
        else:
            bound = dt.timedelta(seconds=unreadable_s)
            since = jsonable(op.input_deadline - bound) if op.input_deadline is not None else None
            deadline = op.input_deadline
        rows.append(
            {
                "op_id": str(op.id),
                "call_node_id": op.call_node_id,
                "input_round": op.input_round,
                "deadline": jsonable(deadline),
                "method": None,
                "request": None,
                "schema": None,
                "schema_digest": None,
                "state": op.state.value,
                "unreadable": True,
                "unreadable_since": since,
                "remote_id": op.remote_id,
                "server_state": op.server_state,
                "status_message": op.status_message,
                "reconciliation": record.reason.value if record is not None else None,
                "reconciliation_id": record.id if record is not None else None,
            }
        )
    return rows


def question(request: Any, method: Any) -> str:
    """What the server asks, for a person: the request's ``message``; for a round of several requests (the
    MCP tasks extension's ``inputRequests``: key -> ``{method, params}``) each key with its message."""
    if not isinstance(request, Mapping):
        return str(method)
    if "message" in request:
        return str(request["message"])
    asked = [
        f"{key}: {entry['params'].get('message', entry.get('method'))}"
        for key, entry in request.items()
        if isinstance(entry, Mapping) and isinstance(entry.get("params"), Mapping)
    ]
    return "; ".join(asked) if asked else str(method)


def inputs_table(rows: Iterable[Mapping[str, Any]]) -> Table:
    table = Table("op_id", "call node", "state", "round", "deadline", "asks")
    for row in rows:
        if row["unreadable"]:
            said = row["status_message"] or row["server_state"]
            asks = f"(unreadable since {row['unreadable_since']}: {said})"
        else:
            asks = question(row["request"], row["method"])
        table.add_row(
            row["op_id"],
            row["call_node_id"],
            row["state"],
            str(row["input_round"]),
            str(row["deadline"]),
            asks,
        )
    return table


def gate_table(rows: Iterable[Mapping[str, Any]]) -> Table:
    table = Table("op_id", "call node", "round", "deadline", "asks")
    for row in rows:
        table.add_row(
            row["op_id"],
            row["call_node_id"],
            str(row["input_round"]),
            str(row["deadline"]),
            question(row["request"], row["method"]),
        )
    return table


def ownership_json(control: ControlState, executor_id: str) -> dict[str, Any]:
    """Who owns the execution epoch (rule 13) and whether this environment's fleet (``executor_id``,
    LONGCALL_EXECUTOR_ID) is it; ``epoch_owner`` null: every fleet works in the epoch."""
    return {
        "execution_epoch": control.execution_epoch,
        "epoch_owner": control.epoch_owner,
        "executor_id": executor_id,
        "owns_epoch": control.owned_by(executor_id),
    }


def epoch_line(control: ControlState, executor_id: str) -> str:
    """``adapters`` and ``status``: the epoch, its owner, and whether this environment is it."""
    if control.epoch_owner is None:
        return f"execution epoch {control.execution_epoch} is open to every fleet (no owner)"
    verdict = "is its owner" if control.owned_by(executor_id) else "is NOT its owner: it claims nothing"
    return (
        f"execution epoch {control.execution_epoch} is owned by {control.epoch_owner}: this environment "
        f"({executor_id}) {verdict}"
    )


def owned_by_text(control: ControlState, executor_id: str) -> str:
    """``rollback``: who the new epoch belongs to."""
    if control.epoch_owner is None:
        return "open to every fleet (no owner)"
    if control.epoch_owner == executor_id:
        return f"owned by {control.epoch_owner} (this environment)"
    return f"owned by {control.epoch_owner} (not this environment, {executor_id})"


def fleet_status_json(
    control: ControlState, executor_id: str, in_flight: Mapping[str, int], configured: Iterable[str]
) -> dict[str, Any]:
    """``status --json`` without an operation: the epoch and its owner (rule 13), admission, the operations
    not final by server, and those on servers this configuration does not name (rule 14)."""
    known = set(configured)
    return {
        **ownership_json(control, executor_id),
        "admission_open": control.admission_open,
        "in_flight": dict(sorted(in_flight.items())),
        "unconfigured_servers": {s: n for s, n in sorted(in_flight.items()) if s not in known and n},
    }


def fleet_status_lines(data: Mapping[str, Any], control: ControlState) -> list[str]:
    lines = [
        epoch_line(control, data["executor_id"]),
        f"admission {'open' if data['admission_open'] else 'closed'}",
        "in flight: " + (", ".join(f"{server} {n}" for server, n in data["in_flight"].items()) or "nothing"),
    ]
    lines += [
        f"[bold red]{escape(server)}[/]: {n} operations in flight on a server LONGCALL_CONFIG does not name "
        "(longcall reconcile lists them once handed to an operator: SERVER_UNCONFIGURED)"
        for server, n in data["unconfigured_servers"].items()
    ]
    return lines


def adapter_rows(
    adapters: Iterable[tuple[str, str]], disabled: Iterable[str], in_flight: Mapping[str, int]
) -> list[dict[str, Any]]:
    """``adapters --json``: each known protocol/version, whether new operations are refused, and how
    many of its operations are not final yet."""
    off = set(disabled)
    return [
        {"adapter": f"{p}/{v}", "disabled": f"{p}/{v}" in off, "in_flight": in_flight.get(f"{p}/{v}", 0)}
        for p, v in sorted(adapters)
    ]


def adapters_table(rows: Iterable[Mapping[str, Any]]) -> Table:
    table = Table("adapter", "new operations", "in flight")
    for row in rows:
        table.add_row(row["adapter"], "disabled" if row["disabled"] else "enabled", str(row["in_flight"]))
    return table


def launch_gate_table(report: Mapping[str, Any]) -> Table:
    """``longcall gate``: one line per criterion (``GateReport.to_json()``): measured, target, verdict, and
    what is behind a failure."""
    table = Table("criterion", "measured", "target", "", "behind", title="launch gate")
    marks = {"pass": "[green]pass[/]", "fail": "[bold red]FAIL[/]", "no evidence": "[yellow]no evidence[/]"}
    for c in report["criteria"]:
        table.add_row(
            c["name"],
            c["measured"],
            c["target"],
            marks[c["verdict"]],
            "\n".join(c["behind"] + c["missing"]),
        )
    return table


def auth_line(auth: Mapping[str, Any]) -> str:
    """How a server is authorized, in a line (``longcall adapters --detect``): the kind, and for OAuth the
    authorization server, the token endpoint and whether the credentials got a token."""
    if auth.get("kind") != "oauth_client_credentials":
        return str(auth.get("kind", "none"))
    parts = [
        "oauth_client_credentials",
        f"authorization server {auth.get('authorization_server', '?')}",
        f"token endpoint {auth.get('token_endpoint', '?')}",
        f"token {auth.get('token', '?')}",
    ]
    return "; ".join(parts)
