"""Rules 7, 8 and 11: fetch the whole result, accept it at the one acceptance point, classify "not found".

The end of every path: a status read that saw a terminal state, a create that answered at once, a cancel
the server confirmed, all come here; nothing here calls back into the phase that called it. A "not found"
is classified by :func:`classify_not_found` and acted on by :func:`not_found`, which may continue into
:func:`fetch`; a fetch that meets "not found" itself never classifies again (it holds no result, so the
answer is always UNKNOWN).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping
from typing import Any

from adapters import (
    ENVELOPE_MARGIN_BYTES,
    AdapterError,
    AnswerTooLarge,
    ErrorInfo,
    NotFound,
    ProtocolViolation,
    Rejected,
    RemoteResult,
    RemoteStatus,
    ResultContradictsStatus,
    ResultNotReady,
)
from ledger.digests import canonical_json, digest
from ledger.errors import NotJson, UnstorableResult
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation, TerminalEvidence
from ledger.states import OpState, TerminalKind
from workers.errors import NoToken
from workers.steps.context import (
    TRY_AGAIN,
    StepAction,
    StepContext,
    StepOutcome,
    describe,
    remote_ref,
    retry_s,
)

#: The longest pause between two reads of a result that contradicts the observed terminal state.
CONTRADICTION_PAUSE_MAX_S = 30.0
#: A lost, truncated or early result read decided nothing: read it again later (rule 7), within a bound
#: (:func:`_read_failed`).
FETCH_AGAIN: tuple[type[AdapterError], ...] = (*TRY_AGAIN, ResultNotReady)
#: How many result reads in a row may meet the same protocol violation (the same unparsable or malformed
#: answer) before an operator gets the operation (RESULT_UNREADABLE): such an answer is definitive in kind
#: (the same request gets the same answer), so the first read and two more, 1 and 2 s apart, are all it
#: gets; a passing fault (a proxy's one bad answer) is read past.
MAX_SAME_VIOLATIONS = 3
#: The longest pause between two failed result reads (the pause doubles from 1 s).
RESULT_PAUSE_MAX_S = 30.0


class NotFoundKind(enum.Enum):
    """Rule 11's classes of "not found", as far as a status read or a fetch can tell. NEVER_CREATED is
    proved only by key, by the lookup (:mod:`workers.steps.submit`)."""

    #: The terminal state and the result were held already: acceptance continues.
    EXPIRED_WITH_RECEIPT = "expired_with_receipt"
    #: Everything else: an operator decides.
    UNKNOWN = "unknown"


def classify_not_found(op: Operation) -> NotFoundKind:
    if op.result is not None and op.observed_terminal is not None:
        return NotFoundKind.EXPIRED_WITH_RECEIPT
    return NotFoundKind.UNKNOWN


def not_found(ctx: StepContext, op: Operation, fence: Fence, exc: NotFound) -> StepOutcome:
    """The server no longer knows the task: accept what is held, or hand the operation to an operator."""
    if classify_not_found(op) is NotFoundKind.EXPIRED_WITH_RECEIPT:
        return fetch(ctx, op, fence)
    return _unknown(ctx, op, fence, exc)


def fetch(
    ctx: StepContext,
    op: Operation,
    fence: Fence,
    status: RemoteStatus | None = None,
    *,
    prepaid: int = 0,
) -> StepOutcome:
    """TERMINAL_OBSERVED / FETCHING_RESULT: read the result (unless it is held or the end is a cancel),
    then accept. Every request of the read (the status read first when ``status`` is not the terminal one
    just observed) is charged to the control budget, the first ``prepaid`` with the tokens the caller took
    already; without a token the fetch is due again later."""
    if op.state is OpState.TERMINAL_OBSERVED:
        op = ctx.ledger.start_fetch(op.id, fence)
    if op.observed_terminal is TerminalKind.CANCELLED:
        return accept(ctx, op, TerminalKind.CANCELLED, None, audit={"server_state": op.server_state})
    if op.result is not None:
        # Held already: the create call answered it, or an earlier fetch did (EXPIRED_WITH_RECEIPT).
        return accept(ctx, op, TerminalKind(op.observed_terminal or "failed"), op.result)
    if op.remote_id is None:
        # No remote operation to read from and nothing held: a synchronous answer that could not be stored,
        # whose hand-over to an operator was interrupted. Never a tight loop, never a second call.
        return _to_operator(
            ctx,
            op,
            fence,
            ReconciliationReason.RESULT_UNSTORABLE,
            {"why": "no result is held and there is no remote operation to read it from"},
        )
    try:
        result = ctx.adapter(op).result(
            remote_ref(op),
            status=status if status and status.terminal else None,
            budget=ctx.budget.per_request(op.server, "control", prepaid=prepaid),
        )
    except NoToken as no_token:
        return ctx.no_token(op, fence, no_token)  # nothing was read that is not read again
    except NotFound as exc:
        return _unknown(ctx, op, fence, exc)  # no result is held here (it would have been accepted above)
    except AnswerTooLarge as exc:
        return too_large(ctx, op, fence, exc)
    except ResultContradictsStatus as exc:
        return _contradicted(ctx, op, fence, exc, exc.code)
    except FETCH_AGAIN as exc:
        ctx.budget.hold(op.server, exc)
        # A lost or truncated result is fetched again; nothing advances without a whole one (rule 7).
        return _read_failed(ctx, op, fence, exc)
    except Rejected as exc:
        if op.observed_terminal is TerminalKind.COMPLETED:
            # A refusal to hand the result over is not the result: only a failed status fails a task.
            return _contradicted(ctx, op, fence, exc, exc.code)
        result = error_result(exc)
    if result.outcome == "cancelled":
        op = _correct_outcome(ctx, op, fence, TerminalKind.CANCELLED)
        return accept(ctx, op, TerminalKind.CANCELLED, None, audit=_storable_audit(ctx, result_json(result)))
    kind = TerminalKind(result.outcome)
    try:
        stored = storable(ctx, result_json(result))
    except UnstorableResult as exc:
        return unstorable(ctx, op, fence, exc, result)
    if kind is not op.observed_terminal:
        op = _correct_outcome(ctx, op, fence, kind)  # e.g. "completed" with isError: true is a failure
    audit = None if result.task_verified else {"task_verified": False, "why": "no related-task _meta"}
    return accept(ctx, op, kind, stored, audit=audit)


def storable(ctx: StepContext, value: Any) -> Any:
    """The result as it is stored, delivered and digested: the value Postgres jsonb gives back for it
    (``1e16`` becomes ``10000000000000000``, ``-0.0`` becomes ``0.0``), checked to pass the Celery JSON
    serializer unchanged (the runtime's :attr:`~workers.runtime.Runtime.delivery` says) and to be within
    ``max_result_bytes``.

    Raises:
        UnstorableResult: not JSON, refused by jsonb, changed by the Celery JSON serializer, or too large.
    """
    try:
        size = len(canonical_json(value).encode("utf-8"))
    except NotJson as exc:
        raise UnstorableResult(f"not JSON: {exc}") from exc
    if size > ctx.settings.max_result_bytes:
        raise UnstorableResult(f"too large: {size} bytes of JSON, over max_result_bytes")
    stored = ctx.ledger.as_stored(value)
    if not ctx.runtime.delivery.unchanged(stored):
        raise UnstorableResult(
            "the Celery JSON serializer would deliver another value (an object with exactly the keys "
            "__type__ and __value__)"
        )
    return stored


def accept(
    ctx: StepContext, op: Operation, kind: TerminalKind, result: Any, *, audit: Any = None
) -> StepOutcome:
    """Rule 8: the one acceptance point. The ledger matches the evidence against the row and writes the
    receipt and its outbox row, or nothing."""
    acceptance = ctx.ledger.accept_terminal(
        op.id,
        TerminalEvidence(
            call_node_id=op.call_node_id,
            request_digest=op.request_digest,
            remote_id=op.remote_id,
            tool_descriptor_version=op.tool_descriptor_version,
            execution_epoch=op.execution_epoch,
            cancel_generation=op.cancel_generation,
            terminal_state=kind,
            result=result,
            result_digest=digest(result) if result is not None else None,
            audit=audit,
        ),
    )
    return StepOutcome(
        op.id,
        StepAction(acceptance.outcome),
        None,
        # A shadow operation's outbox row names no signature (nothing is delivered): no drain is hurried.
        drain_now=acceptance.accepted and op.routing == "live",
        detail={"receipt_id": str(acceptance.receipt.id)}
        if acceptance.receipt
        else {"mismatches": list(acceptance.mismatches)},
    )


def failed_here(message: str) -> RemoteResult:
    """A failed result longcall itself gives, with no answer of the server's to carry (a create it refused
    or could never send, an operator's ``--terminal failed`` with no remote operation), saying why."""
    return RemoteResult(
        outcome="failed", server_state=None, payload={}, is_error=True, error=ErrorInfo(message=message)
    )


def error_result(exc: Rejected) -> RemoteResult:
    """A definitive refusal, as the failed result the receipt carries."""
    return RemoteResult(
        outcome="failed",
        server_state=None,
        payload={},
        is_error=True,
        error=ErrorInfo(message=str(exc), code=exc.code, data=exc.data),
    )


def result_json(result: RemoteResult) -> dict[str, Any]:
    """What the receipt carries as ``result``: the tool result, and the error when the call failed."""
    stored: dict[str, Any] = dict(result.payload)
    stored.setdefault("isError", result.is_error)
    if result.error is not None:
        stored["error"] = {
            "message": result.error.message,
            "code": result.error.code,
            "data": result.error.data,
        }
    return stored


def _correct_outcome(ctx: StepContext, op: Operation, fence: Fence, kind: TerminalKind) -> Operation:
    """The result tells a different end than the status did; the result wins."""
    return ctx.ledger.correct_observed_terminal(
        op.id, fence, state=op.state, kind=kind, was=op.observed_terminal
    )


def _contradicted(
    ctx: StepContext, op: Operation, fence: Fence, exc: AdapterError, code: int | None
) -> StepOutcome:
    """The server answered the result read with something the observed terminal state rules out (an
    error for a completed task): read again later, with a growing pause; past ``result_contradiction_s``
    since the first such answer, an operator decides (RESULT_CONTRADICTS_STATUS)."""
    attempts, elapsed_s = ctx.ledger.contradictions_since_fetch(op.id)
    detail = {
        "error": {"code": code, "message": describe(exc)},
        "observed_terminal": op.observed_terminal.value if op.observed_terminal else None,
        "server_state": op.server_state,
        "attempts": attempts + 1,
    }
    if elapsed_s is not None and elapsed_s >= ctx.settings.result_contradiction_s:
        return _to_operator(
            ctx,
            op,
            fence,
            ReconciliationReason.RESULT_CONTRADICTS_STATUS,
            {**detail, "for_s": round(elapsed_s, 3)},
        )
    delay = max(retry_s(exc), min(CONTRADICTION_PAUSE_MAX_S, 2.0**attempts))
    return ctx.reschedule(op, fence, delay, EventKind.RESULT_CONTRADICTS_STATUS, detail)


def unstorable(
    ctx: StepContext, op: Operation, fence: Fence, exc: UnstorableResult, result: RemoteResult
) -> StepOutcome:
    """A result that cannot be stored and delivered exactly: an operator decides (RESULT_UNSTORABLE),
    rather than a fetch retried for ever."""
    detail: dict[str, Any] = {
        "why": exc.why[:500],
        "outcome": result.outcome,
        "server_state": result.server_state,
        "max_result_bytes": ctx.settings.max_result_bytes,
    }
    with contextlib.suppress(NotJson):
        detail["fetched_digest"] = digest(result_json(result))
    return _to_operator(ctx, op, fence, ReconciliationReason.RESULT_UNSTORABLE, detail)


def too_large(ctx: StepContext, op: Operation, fence: Fence, exc: AnswerTooLarge) -> StepOutcome:
    """An answer over the transport's cap (``max_result_bytes`` plus the envelope margin): a result too
    large to store, proved by this read, so an operator decides now (RESULT_UNSTORABLE, with the size),
    rather than a read made again for ever (rule 7). The read is the result fetch's, or a status read that
    carries the result (the done AIP-151 Operation, the MCP tasks extension's ``tasks/get``)."""
    max_result_bytes = ctx.settings.max_result_bytes
    detail = {
        "why": (
            f"too large: the server's answer was {exc.size_seen}, over the transport's {exc.limit}-byte cap "
            f"(max_result_bytes {max_result_bytes} and a {ENVELOPE_MARGIN_BYTES}-byte envelope margin)"
        ),
        "error": describe(exc),
        "size_bytes": exc.declared_bytes,
        "more_than_bytes": exc.limit,
        "read_bytes": exc.read_bytes,
        "max_result_bytes": max_result_bytes,
        "observed_terminal": op.observed_terminal.value if op.observed_terminal else None,
        "server_state": op.server_state,
        "remote_id": op.remote_id,
    }
    return _to_operator(ctx, op, fence, ReconciliationReason.RESULT_UNSTORABLE, detail)


def _to_operator(
    ctx: StepContext, op: Operation, fence: Fence, reason: ReconciliationReason, detail: Mapping[str, Any]
) -> StepOutcome:
    """MANUAL_RECONCILIATION (:meth:`StepContext.hand_to_operator`), and the step's outcome saying so."""
    op = ctx.hand_to_operator(op, fence, reason, detail)
    return StepOutcome(op.id, StepAction.MANUAL_RECONCILIATION, op.state)


def _read_failed(ctx: StepContext, op: Operation, fence: Fence, exc: AdapterError) -> StepOutcome:
    """A result read that decided nothing (lost, cut, unparsable, refused for now, early): read again after
    a growing pause, never sooner than the server asked, within a bound (rule 7). The same protocol
    violation :data:`MAX_SAME_VIOLATIONS` times in a row, or failures for ``result_retry_s`` since the first
    one of this fetch (whatever they were: a server that never answers the read included), hand the
    operation to an operator (RESULT_UNREADABLE, with the last error and the count) instead of reading it
    for ever or until the wait deadline."""
    error = describe(exc)
    earlier = _failed_reads(ctx, op)
    failures = len(earlier) + 1
    same = 1
    for event in reversed(earlier):
        if event["detail"].get("error") != error:
            break
        same += 1
    elapsed_s = (ctx.now() - earlier[0]["at"]).total_seconds() if earlier else 0.0
    bound_s = ctx.settings.result_retry_s
    detail: dict[str, Any] = {"error": error, "failures": failures, "same_error": same}
    definitive = isinstance(exc, ProtocolViolation) and same >= MAX_SAME_VIOLATIONS
    if definitive or elapsed_s >= bound_s:
        why = (
            f"the result read met the same protocol violation {same} times in a row"
            if definitive
            else f"the result read failed {failures} times in {elapsed_s:.1f} s (result_retry_s {bound_s:g})"
        )
        return _to_operator(
            ctx,
            op,
            fence,
            ReconciliationReason.RESULT_UNREADABLE,
            {
                **detail,
                "why": why,
                "first_error": earlier[0]["detail"].get("error") if earlier else error,
                "for_s": round(elapsed_s, 3),
                "result_retry_s": bound_s,
                "observed_terminal": op.observed_terminal.value if op.observed_terminal else None,
                "server_state": op.server_state,
                "remote_id": op.remote_id,
            },
        )
    # Doubling from 1 s, at most RESULT_PAUSE_MAX_S, not past the bound (the read then is the last one
    # before an operator is asked), never sooner than the server's Retry-After.
    pause = min(RESULT_PAUSE_MAX_S, 2.0 ** (failures - 1), bound_s - elapsed_s)
    return ctx.reschedule(op, fence, max(retry_s(exc), pause), EventKind.RESULT_FAILED, detail)


def _failed_reads(ctx: StepContext, op: Operation) -> list[dict[str, Any]]:
    """The ``result_failed`` events of this fetch (since its latest ``fetching_result`` event, which a
    fetch an operator restarts writes again), oldest first, each ``detail`` a dict. Read only on a failed
    read: the events of one operation."""
    found: list[dict[str, Any]] = []
    for event in reversed(ctx.ledger.events(op.id)):
        if event["kind"] == EventKind.FETCHING_RESULT.value:
            break
        if event["kind"] == EventKind.RESULT_FAILED.value:
            detail = event["detail"] if isinstance(event["detail"], dict) else {}
            found.append({**event, "detail": detail})
    found.reverse()
    return found


def _storable_audit(ctx: StepContext, audit: Any) -> Any:
    """What a cancelled task left, for the receipt's audit; a note in its place when it cannot be stored."""
    try:
        return storable(ctx, audit)
    except UnstorableResult as exc:
        return {"unstorable": exc.why[:500]}


def _unknown(ctx: StepContext, op: Operation, fence: Fence, exc: NotFound) -> StepOutcome:
    return _to_operator(
        ctx,
        op,
        fence,
        ReconciliationReason.UNKNOWN_NOT_FOUND,
        {"error": describe(exc), "session_gone": exc.session_gone, "remote_id": op.remote_id},
    )
