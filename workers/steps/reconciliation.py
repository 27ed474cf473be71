"""Rule 11, the operator's side: unanswered input rounds handed over, overdue records flagged, and an
operator's evidence-backed decision on an operation in MANUAL_RECONCILIATION applied.

Rule 14's side too: an operation on a server the configuration no longer names (removed or renamed) is
never left unclaimed in silence. :func:`reconcile` hands each one to an operator (SERVER_UNCONFIGURED), and
a step that meets the unknown server does the same (:func:`server_unconfigured`), except where nothing needs
the server: a create never sent ends with a failed receipt that says why (nothing ran, nothing can: no
second operation is possible), and a cancelled end or a result already held is accepted. Only operations
older than this fleet's configuration are handed over: one created since, on a server this configuration
does not name, was made by another fleet whose configuration names it (the newer half of a rolling deploy
that added the server) and is reported, never taken from it.

Only the fleet that owns the execution epoch reconciles (rule 13): another one's ``longcall.reconcile`` does
nothing but say so.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Any, Literal

import redis

from adapters import SHIPPED, AdapterError, NotFound, RemoteRef
from ledger.errors import StaleTransition
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation
from ledger.states import OpState, TerminalKind
from workers.errors import NoToken, UnknownServer, WrongState
from workers.steps.context import StepAction, StepContext, StepOutcome, describe
from workers.steps.input_rounds import found_again
from workers.steps.result import accept, failed_here, fetch, result_json, storable

log = logging.getLogger("longcall.executor")

#: How many operations of unconfigured servers one ``longcall.reconcile`` run takes (the next run takes
#: the rest): each is a claim and a move or two.
UNCONFIGURED_BATCH = 100

#: Where an operation that needs its (unconfigured) server goes to an operator from, as the state table
#: allows (ledger/states.py); SUBMITTING and TERMINAL_OBSERVED go through an edge first.
_TO_OPERATOR_FROM = frozenset(
    {
        OpState.SUBMISSION_UNKNOWN,
        OpState.WORKING,
        OpState.INPUT_REQUIRED,
        OpState.CANCEL_REQUESTED,
        OpState.FETCHING_RESULT,
    }
)


@dataclass(frozen=True, slots=True)
class Resolution:
    """An operator's evidence-backed decision (``longcall reconcile``)."""

    kind: Literal["found", "never_created", "terminal"]
    evidence: str
    actor: str
    remote_id: str | None = None
    session_ref: str | None = None
    terminal: TerminalKind | None = None


def reconcile(ctx: StepContext) -> dict[str, int]:
    """Hand the operations of servers the configuration no longer names to an operator (rule 14), hand
    unanswered input rounds past their deadline to an operator, report what waits for one, flag each record
    past its deadline once (a ``reconciliation_overdue`` event) so alerting can key on it, and apply the
    retention of final operations' events and dispatched outbox rows (DESIGN §3). A fleet that does not own
    the epoch does none of it (rule 13)."""
    ownership = ctx.ledger.epoch_ownership()
    if not ownership.owns:
        ctx.runtime.say_not_owner(ownership, "its longcall.reconcile does nothing (the owner's does)")
        return {"not_owner": 1}
    handled, left = hand_over_unconfigured(ctx)
    now = ctx.now()
    unanswered = 0
    for op in ctx.ledger.overdue_inputs():
        # Nobody answered in time: the server still waits, so an operator decides (cancel or answer late).
        try:
            ctx.hand_to_operator(
                op,
                Fence(op.execution_epoch, op.cancel_generation),
                ReconciliationReason.DEADLINE_EXCEEDED,
                {"why": f"input round {op.input_round} was not answered before its deadline"},
            )
            unanswered += 1
        except StaleTransition:
            continue
    records = ctx.ledger.open_reconciliations()
    overdue = [r for r in records if r.deadline <= now and not r.detail.get("overdue_flagged")]
    for record in overdue:
        ctx.ledger.flag_overdue(record.id)
        log.warning(
            "reconciliation %s of %s (%s) is past its deadline", record.id, record.op_id, record.reason
        )
    purged = ctx.ledger.purge_history(
        event_retention_s=ctx.settings.event_retention_s, outbox_retention_s=ctx.settings.outbox_retention_s
    )
    return {
        "unconfigured_handled": handled,
        "unconfigured_left": left,
        "open": len(records),
        "newly_overdue": len(overdue),
        "inputs_timed_out": unanswered,
        "events_purged": purged.events,
        "outbox_purged": purged.outbox_rows,
    }


def hand_over_unconfigured(ctx: StepContext) -> tuple[int, int]:
    """Rule 14: every operation not final and not with an operator yet, on a server this fleet's
    configuration does not name, created before this fleet read its configuration, is claimed (its lease
    free: a step under way keeps it, the next run takes it) and handed over or ended
    (:func:`server_unconfigured`). Returns (handled, left for later or to another fleet)."""
    runtime = ctx.runtime
    handled = left = 0
    newer: collections.Counter[str] = collections.Counter()
    for op in ctx.ledger.unconfigured_in_flight(sorted(runtime.fleet.servers), limit=UNCONFIGURED_BATCH):
        if op.created_at >= runtime.started_at:
            newer[op.server] += 1
            left += 1
            continue
        claim = ctx.ledger.claim(op.id, lease_s=ctx.settings.lease_s)
        if claim is None:
            left += 1
            continue
        try:
            server_unconfigured(ctx, ctx.ledger.get(op.id), claim.fence)
        except StaleTransition:
            left += 1
            continue
        handled += 1
    if newer:
        log.warning(
            "operations in flight on servers LONGCALL_CONFIG does not name, created after this fleet "
            "started (another fleet's, whose configuration names them), left to it: %s",
            ", ".join(f"{server} ({n})" for server, n in sorted(newer.items())),
        )
    return handled, left


def server_unconfigured(ctx: StepContext, op: Operation, fence: Fence) -> StepOutcome:
    """The operation's server is not in this fleet's configuration (removed or renamed), under the claim
    ``fence``: nothing can be sent to it. What needs the server goes to an operator (SERVER_UNCONFIGURED);
    the state table has no edge to MANUAL_RECONCILIATION from SUBMITTING or TERMINAL_OBSERVED, so

    - a create never attempted ends now, with no create: cancelled when a cancel was asked for, else a
      failed receipt that names the server (event ``create_never_sent``). Nothing ran and nothing can, so
      no rule is left undecided and the pipeline hears why at once; an operator's record would only wait
      for a server that is gone;
    - a create attempted, its answer unknown, is what SUBMISSION_UNKNOWN means: there first, then to an
      operator (a lookup by key needs the server too);
    - a terminal state observed: a cancelled end or a result already held is accepted (no request needed);
      otherwise the fetch starts (FETCHING_RESULT) and goes to an operator, who resolves it once the
      server is reachable under a configured name again.

    A cancel requested stays with the operation (its generation). MANUAL_RECONCILIATION and NOT_FOUND_SAFE
    are left as they are (with an operator already; about to be resubmitted)."""
    why = f"server {op.server!r} is not in LONGCALL_CONFIG (removed or renamed)"
    detail: dict[str, Any] = {"why": why, "server": op.server}
    state = op.state
    if state is OpState.SUBMITTING and op.submit_attempted_at is None:
        if op.cancel_generation > 0:
            return accept(ctx, op, TerminalKind.CANCELLED, None, audit={**detail, "no_create": True})
        return _never_sent(ctx, op, fence, why)
    if state is OpState.SUBMITTING:
        detail["why"] = f"{why}: the answer of the create attempted on it is not known"
        op = ctx.ledger.mark_submission_unknown(op.id, fence, detail=detail)
    elif state in (OpState.TERMINAL_OBSERVED, OpState.FETCHING_RESULT) and (
        op.observed_terminal is TerminalKind.CANCELLED or op.result is not None
    ):
        return fetch(ctx, op, fence)  # accepted from what is held: no request
    elif state is OpState.TERMINAL_OBSERVED:
        op = ctx.ledger.start_fetch(op.id, fence)
    if op.state not in _TO_OPERATOR_FROM:
        return StepOutcome(op.id, StepAction.NOTHING_TO_DO, op.state, detail={"server": op.server})
    log.error("operation %s: %s; handed to an operator (SERVER_UNCONFIGURED)", op.id, why)
    op = ctx.hand_to_operator(op, fence, ReconciliationReason.SERVER_UNCONFIGURED, detail)
    return StepOutcome(op.id, StepAction.MANUAL_RECONCILIATION, op.state, detail={"server": op.server})


def _never_sent(ctx: StepContext, op: Operation, fence: Fence, why: str) -> StepOutcome:
    """No create was attempted and none can be sent: SUBMITTING -> TERMINAL_OBSERVED -> FETCHING_RESULT
    with a failed result held that says why, then accepted (a failed receipt)."""
    message = f"{why}: no create was sent, and none can be"
    refused = failed_here(message)
    op = ctx.ledger.hold_create_result(
        op.id,
        fence,
        kind=TerminalKind.FAILED,
        server_state=None,
        result=storable(ctx, result_json(refused)),
        event=EventKind.CREATE_NEVER_SENT,
    )
    return fetch(ctx, op, fence)


def resolve(ctx: StepContext, op: Operation, resolution: Resolution) -> Operation:
    """Apply an operator's decision; open records of the operation are closed with the evidence.

    ``found``: the operation exists on the server under ``remote_id`` -> WORKING, polled at once. On a
    protocol version whose tasks are bound to a session (its spec's ``session_bound``: the session is
    recorded from the create's answer; when that answer was lost, only the operator's evidence can name
    it) with none recorded, the resolution names it (``session_ref``; an empty one says the server keeps
    no sessions): without it every status read would be refused.
    ``never_created``: the operator proved it never ran -> NOT_FOUND_SAFE -> SUBMITTING with the same
    submission key (the only resubmission there is); refused when the ledger knows a remote id for it.
    ``terminal``: it ended on the server -> its result is fetched and accepted like any other. With a
    cancel requested (rule 6): ``found`` goes to CANCEL_REQUESTED and the cancel is sent;
    ``never_created`` ends CANCELLED_ACCEPTED with no create (the create step finds the intent before it
    makes any call).

    Raises:
        WrongState: the operation is not waiting for an operator (or, for ``never_created``, the ledger
            knows a remote id for it).
        ValueError: the resolution lacks what its kind needs.
    """
    if op.state is not OpState.MANUAL_RECONCILIATION:
        raise WrongState(f"operation {op.id} is {op.state}, not waiting for an operator")
    fence = Fence(op.execution_epoch, op.cancel_generation)
    note = f"{resolution.kind} by {resolution.actor}: {resolution.evidence}"
    detail = {"actor": resolution.actor, "evidence": resolution.evidence}
    if resolution.kind == "found":
        if not resolution.remote_id:
            raise ValueError("a 'found' resolution names the remote id")
        _found_is_this_operations(ctx, op, resolution.remote_id)
        if (
            resolution.session_ref is None
            and op.session_ref is None
            and (spec := SHIPPED.find(op.protocol, op.protocol_version)) is not None
            and spec.session_bound
        ):
            raise ValueError(
                f"operation {op.id} is on {op.server} ({op.protocol} {op.protocol_version}), whose tasks are "
                "read on the session that created them, and no session is recorded: give --session "
                "SESSION_ID (the Mcp-Session-Id the task was created on; --session '' if the server keeps "
                "no sessions)"
            )
        return ctx.ledger.resolve_found(
            op.id,
            fence,
            remote_id=resolution.remote_id,
            session_ref=resolution.session_ref or op.session_ref,
            detail=detail,
            resolution=note,
            cancel_above=0,  # any cancel requested, before or while the operator decided, is sent now
            input_reply=found_again(op, ctx.now()),  # the round's reply gets its bound again, not lost
        )
    if resolution.kind == "never_created":
        if op.remote_id is not None:
            # The ledger holds the server's own name for it: something was created (its remote id changes
            # only with a move out of MANUAL_RECONCILIATION, which the resubmission's guard would refuse).
            raise WrongState(
                f"the ledger knows remote id {op.remote_id} for operation {op.id} on {op.server}: it was "
                "created, so --never-created is refused (resolve it with --found "
                f"{op.remote_id}, or --terminal)"
            )
        answered = _create_answered(ctx, op)
        if answered is not None:
            raise WrongState(
                f"the server answered the create of operation {op.id} on {op.server} ({answered}): the tool "
                "ran, so --never-created is refused (a resubmission would run it again); end it with "
                "--terminal failed (its error your evidence)"
            )
        return ctx.ledger.resubmit(op.id, fence, from_state=op.state, detail=detail, resolution=note)
    if resolution.terminal is None:
        raise ValueError("a 'terminal' resolution names the terminal state")
    remote_id = resolution.remote_id or op.remote_id
    held: dict[str, Any] | None = None
    if remote_id is None and resolution.terminal is TerminalKind.COMPLETED:
        raise ValueError(
            "a completed result is fetched by its remote id, and the ledger knows none for operation "
            f"{op.id}: name it with --found REMOTE_ID (it is then read from the server), or end it with "
            "--terminal failed (its error your evidence)"
        )
    if remote_id is None and resolution.terminal is TerminalKind.FAILED:
        # No remote operation to read a result from (a synchronous call whose answer was lost or could not
        # be stored): the failed result held is the operator's word.
        message = f"ended failed by {resolution.actor}, with no result from the server: {resolution.evidence}"
        held = storable(ctx, result_json(failed_here(message)))
    if remote_id is not None and resolution.terminal is TerminalKind.CANCELLED:
        # A cancelled end has no result whose read would correct it (a completed or failed one is read, and
        # the result wins): the server's status is asked here instead.
        detail["status_read"] = _cancelled_on_the_server(ctx, op, remote_id)
    return ctx.ledger.resolve_terminal(
        op.id,
        fence,
        remote_id=remote_id,
        kind=resolution.terminal,
        detail=detail,
        resolution=note,
        result=held,
    )


def _cancelled_on_the_server(ctx: StepContext, op: Operation, remote_id: str) -> str:
    """An operator's "cancelled" for an operation the server knows as ``remote_id``, held against the
    server's own word: one status read, charged to the server's control budget. Taken when the server says
    cancelled, or says in its own words that it does not know the task (its record expired or purged: not a
    404 from a proxy, nor a session's end), or is not in this fleet's configuration (nothing can be asked);
    what the read said is returned for the event.

    Raises:
        WrongState: the server says the task runs, waits for input or ended otherwise, or could not be
            asked now (no token, unreachable, an error): nothing is written, and the message says what to
            do instead.
    """
    remote = RemoteRef(remote_id, op.session_ref, op.protocol_version, op.protocol)
    try:
        status = ctx.adapter(op).get(
            remote, read_input=False, budget=ctx.budget.per_request(op.server, "control")
        )
    except UnknownServer as exc:
        return f"not read: {exc}"
    except NotFound as exc:
        if exc.servers_word:
            return f"the server does not know it: {describe(exc)}"
        raise WrongState(
            f"the status read of {remote_id} on {op.server} was answered not found, but not in the server's "
            f"own words ({describe(exc)}: a proxy's page, a wrong route, the session's end): it proves "
            "nothing about the task; --terminal cancelled is taken once the server says cancelled or that "
            "it does not know the task"
        ) from exc
    except (NoToken, AdapterError, redis.RedisError) as exc:
        if isinstance(exc, AdapterError):
            ctx.budget.hold(op.server, exc)  # a wait the server asked for holds for the fleet as well
        raise WrongState(
            f"the status of {remote_id} on {op.server} could not be read ({describe(exc)}): --terminal "
            "cancelled is taken once the server says cancelled or no longer knows the task; try again"
        ) from exc
    if status.terminal == TerminalKind.CANCELLED.value:
        return status.server_state
    if status.terminal is None:
        raise WrongState(
            f"the server says {remote_id} on {op.server} is {status.server_state!r}, not ended: resolve "
            f"operation {op.id} with --found {remote_id} (it is polled again, and a cancel asked of it is "
            f"sent), then `longcall cancel {op.id}` if it is to end"
        )
    raise WrongState(
        f"the server says {remote_id} on {op.server} ended {status.terminal} "
        f"({status.server_state!r}), not cancelled: resolve operation {op.id} with --terminal "
        f"{status.terminal} (its result is read from the server)"
    )


def _found_is_this_operations(ctx: StepContext, op: Operation, remote_id: str) -> None:
    """A remote id found by an operator names this operation only: not another remote operation than the
    one the ledger knows for it (which would be left running, untracked), nor one another operation of its
    server holds.

    Raises:
        WrongState: it names another one; nothing is written.
    """
    if op.remote_id is not None and op.remote_id != remote_id:
        raise WrongState(
            f"the ledger knows remote id {op.remote_id} for operation {op.id} on {op.server}, not "
            f"{remote_id}: resolve it with --found {op.remote_id} (or --terminal); {remote_id} is another "
            "remote operation"
        )
    holder = ctx.ledger.find_by_remote(op.server, remote_id)
    if holder is not None and holder.id != op.id:
        raise WrongState(
            f"remote id {remote_id} on {op.server} is operation {holder.id}'s (call node "
            f"{holder.call_node_id!r}), not operation {op.id}'s"
        )


def _create_answered(ctx: StepContext, op: Operation) -> str | None:
    """What says the server answered the operation's create (so its tool ran), when the ledger knows no
    remote id for it: a terminal answer observed (a synchronous result, held or not), or the create's own
    answer recorded as an event; None when nothing does."""
    if op.observed_terminal is not None:
        return f"its answer was {op.observed_terminal.value}"
    ran = (EventKind.RAN_SYNCHRONOUSLY.value, EventKind.REJECTED.value)
    seen = [e["kind"] for e in ctx.ledger.events(op.id) if e["kind"] in ran]
    return f"event {seen[-1]}" if seen else None
