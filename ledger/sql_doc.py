"""docs/ledger-sql.md: the ledger's SQL as PostgreSQL receives it, so no reader compiles it in their head.

``python -m ledger.sql_doc > docs/ledger-sql.md`` (a test checks it is current). Each named move is called
as a step calls it, on a ledger whose connection compiles what it is given instead of sending it (the
statement a move builds from its ``GuardedWrite`` and ``WriteShape``, exactly); each hot statement is built
by its builder, once per shape. Every statement is shown with the names of its bind parameters, never their
values: ``:fence_*`` in a guard, ``:new_*`` in a SET list, ``:event_*`` and ``:then_*`` in the event rows it
appends, ``:claim_*`` in a claim, ``:ev_*`` the acceptance's evidence. The values a statement fixes itself
(a state, a constant) are listed after it. No database is needed.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import BindParameter, Connection
from sqlalchemy.dialects.postgresql import psycopg

from ledger.acceptance import accept_update, insert_terminal_outbox
from ledger.claim_statements import (
    update_claim_due,
    update_claim_due_by_server,
    update_claim_one,
    update_release_claims,
)
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, ServerStatus
from ledger.repository import Ledger
from ledger.statements import (
    select_control,
    select_disabled_adapters,
    select_operation_by_call_node,
    select_operation_by_id,
    select_operations_by_ids,
    select_outbox_rows,
    select_ready_outbox,
    update_outbox_dispatched,
    update_outbox_failed,
)
from ledger.states import OpState, TerminalKind
from ledger.write_statements import insert_operation, update_unchanged_polls

#: The driver the engine pins (``ledger/engine.py``: psycopg 3), with ``:name`` placeholders for reading.
DIALECT = psycopg.dialect(paramstyle="named")  # type: ignore[no-untyped-call]  # its __init__ is untyped

#: Lines longer than this are wrapped at a top-level ``, `` or `` AND `` (whitespace only).
WIDTH = 110

S = OpState
#: A step's fence: it holds a claim (a poll cursor), so its writes are the epoch owner's (rule 13).
CLAIMED = Fence(execution_epoch=1, cancel_generation=0, poll_cursor=1)
#: An intent's fence: sent by name (a cancel, an input reply, an operator's decision), no claim.
BY_NAME = Fence(execution_epoch=1, cancel_generation=0)
STATUS = ServerStatus("working", "still at it", 1000)
WHEN = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
REPLY = {"input_round": 1, "response": {"action": "accept"}, "attempts": 0}


@dataclass(frozen=True, slots=True)
class Move:
    """One named move, called as its step calls it."""

    name: str
    does: str
    fence: Fence
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    #: Says which case of the move this is, when the move has more than one shape.
    case: str = ""


MOVES = (
    Move(
        "record_create_attempt",
        "SUBMITTING stays: the create is about to be sent, recorded once, unless its adapter is disabled.",
        CLAIMED,
        {"descriptor_version": "v1", "detail": {}, "unless_disabled": ("mcp", "2025-11-25")},
    ),
    Move(
        "undo_create_attempt",
        "SUBMITTING stays: the server refused the create before any work; due again in `retry_in_s`.",
        CLAIMED,
        {"retry_in_s": 5.0, "detail": {}},
    ),
    Move(
        "mark_submission_unknown",
        "SUBMITTING -> SUBMISSION_UNKNOWN: the create's answer was lost; a lookup by key is due at once.",
        CLAIMED,
        {"detail": {}},
    ),
    Move(
        "record_created",
        "SUBMITTING -> WORKING (or CANCEL_REQUESTED, a cancel meanwhile): the create returned a remote id.",
        CLAIMED,
        {
            "remote_id": "r",
            "session_ref": None,
            "status": STATUS,
            "expires_at": None,
            "next_poll_in_s": 1.0,
        },
    ),
    Move(
        "record_found_by_key",
        "SUBMISSION_UNKNOWN -> WORKING (or CANCEL_REQUESTED): a lookup by submission key found it.",
        CLAIMED,
        {"remote_id": "r", "session_ref": None, "detail": {}},
    ),
    Move(
        "resubmit",
        "-> NOT_FOUND_SAFE -> SUBMITTING in one statement: never created, so the same key is sent again.",
        CLAIMED,
        {"from_state": S.SUBMISSION_UNKNOWN, "detail": {}, "keep_claim": True},
    ),
    Move(
        "hold_create_result",
        "SUBMITTING -> TERMINAL_OBSERVED -> FETCHING_RESULT: the create itself gave the final answer.",
        CLAIMED,
        {
            "kind": TerminalKind.COMPLETED,
            "server_state": "completed",
            "result": {},
            "event": EventKind.RAN_SYNCHRONOUSLY,
        },
    ),
    Move(
        "record_poll",
        "Same state: the server still works on it; an event only when its status changed (the poll path).",
        CLAIMED,
        {"state": S.WORKING, "status": STATUS, "next_poll_in_s": 5.0},
    ),
    Move(
        "reschedule",
        "Same state: the step could not finish now; due again in `delay_s`, its event says why.",
        CLAIMED,
        {"state": S.WORKING, "delay_s": 1.0, "event": EventKind.RATE_LIMITED, "detail": {}},
        "a rate limit, a failed call",
    ),
    Move(
        "reschedule",
        "Same state: no token for the call; counted on the row (`no_token_count`), no event.",
        CLAIMED,
        {"state": S.WORKING, "delay_s": 1.0, "event": EventKind.NO_TOKEN, "detail": {}},
        "no token",
    ),
    Move(
        "renew_lease",
        "Same state, no event: the step holding the claim still runs; its lease runs on.",
        CLAIMED,
        {"lease_s": 30.0},
    ),
    Move(
        "observe_terminal",
        "-> TERMINAL_OBSERVED -> FETCHING_RESULT: the server says it ended; the caller fetches at once.",
        CLAIMED,
        {"from_state": S.WORKING, "kind": TerminalKind.COMPLETED, "status": STATUS, "fetch_now": True},
        "fetch now",
    ),
    Move(
        "observe_terminal",
        "-> TERMINAL_OBSERVED: the server says it ended; the fetch is due later, the claim let go.",
        CLAIMED,
        {"from_state": S.WORKING, "kind": TerminalKind.COMPLETED, "status": STATUS, "fetch_now": False},
        "fetch later",
    ),
    Move("start_fetch", "TERMINAL_OBSERVED -> FETCHING_RESULT.", CLAIMED),
    Move(
        "correct_observed_terminal",
        "Same state: the result says the outcome was another one (a completion carrying an error).",
        CLAIMED,
        {"state": S.FETCHING_RESULT, "kind": TerminalKind.FAILED, "was": TerminalKind.COMPLETED},
    ),
    Move(
        "request_cancel",
        "-> CANCEL_REQUESTED, the cancel generation bumped: every writer of the old one is fenced off.",
        BY_NAME,
        {"from_state": (S.WORKING, S.INPUT_REQUIRED)},
    ),
    Move(
        "record_cancel_intent",
        "Same state, the generation bumped: a cancel with no remote operation to send it to yet.",
        BY_NAME,
        {"from_state": S.SUBMITTING},
    ),
    Move(
        "ask_for_input",
        "-> INPUT_REQUIRED for a new round; the approval gate's outbox row follows in the transaction.",
        CLAIMED,
        {
            "from_state": S.WORKING,
            "input_round": 1,
            "request_json": {"method": "elicitation/create"},
            "schema_digest": "sha256:",
            "deadline": WHEN,
            "status": STATUS,
            "gate_payload": {},
        },
    ),
    Move(
        "record_input_reply",
        "INPUT_REQUIRED -> WORKING for the current round only: the reply is stored before it is sent.",
        BY_NAME,
        {"input_round": 1, "response": {"action": "accept"}},
    ),
    Move(
        "record_input_reply_sent",
        "WORKING stays, polled at once: the server took the stored reply.",
        CLAIMED,
        {"reply": REPLY},
    ),
    Move(
        "record_input_reply_failed",
        "WORKING stays: the stored reply was not delivered; it is sent again in `retry_in_s`.",
        CLAIMED,
        {"reply": REPLY, "error": "timeout", "retry_in_s": 1.0},
    ),
    Move(
        "wait_for_input_request",
        "WORKING stays: the server waits for input whose request could not be read, by `read_by`.",
        CLAIMED,
        {"status": STATUS, "read_by": WHEN, "next_poll_in_s": 5.0},
    ),
    Move(
        "hand_to_operator",
        "-> MANUAL_RECONCILIATION; its reconciliation record follows in the same transaction.",
        CLAIMED,
        {
            "from_state": S.WORKING,
            "reason": ReconciliationReason.INPUT_UNREADABLE,
            "detail": {},
            "deadline_s": 900.0,
        },
    ),
    Move(
        "resolve_found",
        "MANUAL_RECONCILIATION -> WORKING (or CANCEL_REQUESTED): an operator found it alive.",
        BY_NAME,
        {"remote_id": "r", "session_ref": None, "detail": {}, "resolution": "found"},
    ),
    Move(
        "resolve_terminal",
        "MANUAL_RECONCILIATION -> TERMINAL_OBSERVED: an operator found it ended.",
        BY_NAME,
        {"remote_id": "r", "kind": TerminalKind.FAILED, "detail": {}, "resolution": "ended"},
    ),
)


@dataclass(frozen=True, slots=True)
class Hot:
    """One hot statement, built by its builder for one shape."""

    title: str
    does: str
    build: Callable[..., Any]
    shape: tuple[Any, ...] = ()


def _claim_due(with_server: bool, with_epoch: bool) -> Hot:
    of = " of one server" if with_server else ""
    into = " into the epoch `:claim_epoch`" if with_epoch else ""
    title = f"update_claim_due(with_server={with_server}, with_epoch={with_epoch})"
    does = f"Claim up to `:claim_limit` due rows{of}{into}, SKIP LOCKED."
    return Hot(title, does, update_claim_due, (with_server, with_epoch))


def _claim_one(with_epoch: bool, before_create: bool) -> Hot:
    cancel = " (a cancel before any create takes it whatever its lease)" if before_create else ""
    title = f"update_claim_one(with_epoch={with_epoch}, cancel_before_create={before_create})"
    into = ", into the epoch `:claim_epoch`" if with_epoch else ""
    return Hot(
        title,
        f"Claim one row now, unless its lease is held{cancel}{into}.",
        update_claim_one,
        (with_epoch, before_create),
    )


HOT = (
    Hot(
        "insert_operation()",
        "The submission (rule 1): the SUBMITTING row and its `submitted` event; a repeat inserts neither.",
        insert_operation,
    ),
    Hot(
        "select_operation_by_id(with_body=False)",
        "A step's read of its row (without the arguments), and the control row's epoch and owner.",
        select_operation_by_id,
        (False,),
    ),
    Hot(
        "select_operation_by_id(with_body=True)",
        "The same read with the arguments: a step that sends them.",
        select_operation_by_id,
        (True,),
    ),
    Hot(
        "select_operations_by_ids()",
        "A batch of polls' read of its members' rows (without the arguments), in one statement.",
        select_operations_by_ids,
    ),
    Hot(
        "select_operation_by_call_node()",
        "A submission's read of the call node's existing operation.",
        select_operation_by_call_node,
    ),
    Hot(
        "update_claim_due_by_server(with_epoch='current')",
        "The dispatcher's tick: due rows of many servers, shared by their rooms, SKIP LOCKED, in the "
        "control row's epoch.",
        update_claim_due_by_server,
        ("current",),
    ),
    Hot(
        "update_claim_due_by_server(with_epoch='current', schedule=True)",
        "The dispatcher's tick as it runs (`Ledger.claim_due_by_server` with the servers' default poll "
        "intervals): the same claim, each WORKING row's next poll set ahead by it (rule 3: its interval "
        "plus jitter, never past its wait deadline or expiry), so that a poll that changes nothing needs "
        "no write of its schedule.",
        update_claim_due_by_server,
        ("current", True),
    ),
    Hot(
        "update_unchanged_polls()",
        "`Ledger.record_unchanged_polls`: the polls of a batch that changed nothing, one statement for "
        "all of them, each under its own fence and still claimed: counted, the claim let go, no event.",
        update_unchanged_polls,
    ),
    Hot(
        "update_claim_due_by_server(with_epoch=True)",
        "The same claim into the epoch `:claim_epoch`.",
        update_claim_due_by_server,
        (True,),
    ),
    Hot(
        "update_claim_due_by_server(with_epoch=False)",
        "The same claim, leaving each row's epoch as it is.",
        update_claim_due_by_server,
        (False,),
    ),
    *(_claim_due(with_server, with_epoch) for with_server in (False, True) for with_epoch in (False, True)),
    *(
        _claim_one(with_epoch, before_create)
        for with_epoch in (False, True)
        for before_create in (False, True)
    ),
    Hot(
        "update_release_claims()",
        "Hand claims back without running their steps (one, or the polls a worker process sheds): each "
        "lease cleared, nothing else.",
        update_release_claims,
    ),
    *(
        Hot(
            f"accept_update({kind.value})",
            f"The single acceptance point (rule 8) of a {kind.value} terminal: every piece of evidence "
            "in the guard, the receipt inserted by the same statement.",
            accept_update,
            (kind,),
        )
        for kind in TerminalKind
    ),
    Hot(
        "insert_terminal_outbox()",
        "The accepted operation's ready outbox row and its `terminal_accepted` event (the acceptance's "
        "second statement).",
        insert_terminal_outbox,
    ),
    Hot(
        "select_ready_outbox(with_op=False)",
        "The beat's outbox drain: ready rows whose pause is over, in order, SKIP LOCKED; their ids and "
        "stored payload sizes.",
        select_ready_outbox,
        (False,),
    ),
    Hot(
        "select_outbox_rows()",
        "The drain's rows within its byte budget, whole (locked by the statement before).",
        select_outbox_rows,
    ),
    Hot(
        "select_ready_outbox(with_op=True)",
        "The same drain for one operation's rows.",
        select_ready_outbox,
        (True,),
    ),
    Hot("update_outbox_dispatched()", "The drain marks the rows it published.", update_outbox_dispatched),
    Hot(
        "update_outbox_failed()",
        "The drain records a failed publish: attempts, error, status and pause.",
        update_outbox_failed,
    ),
    Hot(
        "select_disabled_adapters()",
        "The disabled adapters, the control row share-locked (a create attempt's first statement).",
        select_disabled_adapters,
    ),
    Hot("select_control()", "The control row.", select_control),
)


class _Compiled(Exception):
    """Raised where a move would read its statement's answer: what it sent is recorded by then."""


class _Result:
    def first(self) -> Any:
        raise _Compiled

    def scalar_one(self) -> Any:
        return []  # the disabled adapters: none


class _CompilingConnection:
    """Records each statement it is given, compiled for PostgreSQL; sends nothing."""

    def __init__(self, sent: list[Any]) -> None:
        self.sent = sent

    def execute(self, statement: Any, parameters: Any = None) -> _Result:
        self.sent.append(statement)
        return _Result()


class _CompilingLedger(Ledger):
    """A ledger whose transactions compile their statements instead of running them."""

    def __init__(self) -> None:  # no engine: nothing is sent
        self.executor_id = "fleet-a"
        self.reconcile_deadline = dt.timedelta(minutes=15)
        self.sent: list[Any] = []

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        yield cast(Connection, _CompilingConnection(self.sent))

    @contextmanager
    def _one_statement(self) -> Iterator[Connection]:
        yield cast(Connection, _CompilingConnection(self.sent))


def move_statements(move: Move) -> list[Any]:
    """The statements ``move`` sends, in order, up to the one whose answer it reads first."""
    ledger = _CompilingLedger()
    method = getattr(ledger, move.name)
    with suppress(_Compiled):
        method(uuid.UUID(int=1), move.fence, **move.kwargs)
    return ledger.sent


def render(statement: Any) -> str:
    """The statement as PostgreSQL receives it, then its binds: the caller's by name, the fixed ones with
    their values."""
    compiled = statement.compile(dialect=DIALECT)
    sql = "\n".join(line for raw in str(compiled).splitlines() for line in _wrap(raw.rstrip()))
    named: set[str] = set()
    fixed: dict[str, str] = {}
    for bind, name in compiled.bind_names.items():
        if isinstance(bind, BindParameter) and bind.unique:
            fixed[name] = _value(bind.value)
        else:
            named.add(name)
    lines = ["```sql", sql, "```", ""]
    if named:
        lines.append("Binds: " + ", ".join(f"`:{name}`" for name in sorted(named)) + ".")
    if fixed:
        lines.append("Fixed: " + ", ".join(f"`:{name}` = `{fixed[name]}`" for name in sorted(fixed)) + ".")
    return "\n".join(lines).rstrip() + "\n"


def _value(value: Any) -> str:
    if isinstance(value, str | int | float | bool) or value is None:
        return repr(value)
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return repr(sorted(value))  # a list of states, from a set: sorted, so the document stays the same
    if isinstance(value, Mapping):
        return repr(dict(value))
    return type(value).__name__


def _wrap(line: str) -> list[str]:
    """``line`` split (whitespace only) to ``WIDTH`` at its outermost ``, `` and `` AND ``, and before its
    outermost ``SET``, ``FROM``, ``WHERE`` and ``RETURNING``, never inside quotes."""
    if len(line) <= WIDTH:
        return [line]
    candidates: list[tuple[int, int]] = []  # (depth, cut)
    depth, quoted = 0, False
    for i, char in enumerate(line):
        if char == "'":
            quoted = not quoted
        elif quoted:
            continue
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif line.startswith(", ", i):
            candidates.append((depth, i + 2))
        elif any(line.startswith(f" {word} ", i) for word in _CUT_BEFORE):
            candidates.append((depth, i + 1))
    if not candidates:
        return [line]
    outermost = min(depth for depth, _ in candidates)
    cuts = [cut for depth, cut in candidates if depth == outermost]
    pieces, start = [], 0
    for cut in [*cuts, len(line)]:
        pieces.append(line[start:cut])
        start = cut
    lines: list[str] = []
    current = ""
    for piece in pieces:
        if current.strip() and len(current) + len(piece) > WIDTH:
            lines.append(current.rstrip())
            current = "    " + piece
        else:
            current += piece
    lines.append(current.rstrip())
    return lines


_CUT_BEFORE = ("AND", "SET", "FROM", "WHERE", "RETURNING")


def sql_document() -> str:
    """docs/ledger-sql.md: ``python -m ledger.sql_doc > docs/ledger-sql.md`` (a test checks it is current)."""
    parts = [
        "# The ledger's SQL",
        "",
        "Generated from `ledger/` by `python -m ledger.sql_doc > docs/ledger-sql.md`; do not edit.",
        "",
        "Each statement is what PostgreSQL receives (the psycopg 3 driver; `:name` marks a bind parameter,",
        "shown here by name; the driver sends `%(name)s`). Bind names say where a value goes: `:fence_*` in",
        "a guard, `:new_*` in a SET list, `:event_*` and `:then_*` in the event rows a statement appends,",
        "`:claim_*` in a claim, `:ev_*` the evidence of an acceptance. `Fixed` lists the values a statement",
        "sets itself. `__[POSTCOMPILE_name]` is a list bound as one parameter per element.",
        "",
        "## Named moves",
        "",
        "Each move of `ledger/moves.py` and `ledger/intent_moves.py`, called as its step calls it (under",
        "a claim, or by name for an intent), is one guarded statement that appends its own event rows. The",
        "side rows a move owns (a reconciliation record, the approval gate's outbox row, the closing of open",
        "records) follow in the same transaction and are not shown.",
        "",
    ]
    for move in MOVES:
        title = f"`{move.name}`" + (f" ({move.case})" if move.case else "")
        fence = "under a claim" if move.fence.poll_cursor is not None else "by name"
        parts += [f"### {title}", "", f"{move.does} Called {fence}.", ""]
        for statement in move_statements(move):
            parts.append(render(statement))
    parts += [
        "## Hot statements",
        "",
        "The submission, a step's read, the claims, the acceptance and the outbox drain, each built once per",
        "shape (`ledger.statements.STATEMENTS`) with a bind parameter for every value.",
        "",
    ]
    for hot in HOT:
        parts += [f"### `{hot.title}`", "", hot.does, "", render(hot.build(*hot.shape))]
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(sql_document(), end="")
