"""Rule 10: input rounds. A server's input request goes to the approval gate; its reply comes back.

Round N opens when a status read carries an input request (:func:`ask_for_input`): polling pauses and the
request, the schema digest and a deadline go out as an outbox row. :func:`provide_input` takes the gate's
reply for the current round only, before the deadline, in the shape the adapter accepts
(``ToolAdapter.check_reply``: the protocol's own rules live with the protocol), then polling resumes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Mapping
from typing import Any

from adapters import AdapterError, InputRequest, RemoteStatus
from adapters.mcp_2026_07_28.wire import REPLY_METHOD as KEYED_ROUND
from adapters.mcp_2026_07_28.wire import without_answered
from ledger.digests import digest
from ledger.errors import StaleTransition
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation
from ledger.states import OpState
from workers.errors import InputRefused, NoToken
from workers.steps.context import StepContext, StepOutcome, describe, remote_ref, server_status

#: How soon to look again when the server says it waits for input whose request could not be read yet.
AWAITING_INPUT_RECHECK_S = 1.0


def ask_for_input(
    ctx: StepContext, op: Operation, fence: Fence, status: RemoteStatus, request: InputRequest
) -> StepOutcome:
    """Open round N + 1: INPUT_REQUIRED, and the request on its way to the approval gate."""
    request = unanswered_part(op, request) or request
    deadline = ctx.now() + dt.timedelta(seconds=ctx.settings.input_timeout_s)
    if op.wait_deadline is not None:
        deadline = min(deadline, op.wait_deadline)
    schema_digest = digest(dict(request.schema) if request.schema is not None else None)
    round_ = op.input_round + 1
    op = ctx.ledger.ask_for_input(
        op.id,
        fence,
        from_state=op.state,
        input_round=round_,
        request_json=request.to_json(),
        schema_digest=schema_digest,
        deadline=deadline,
        status=server_status(status),
        gate_payload={
            "signature": op.on_input,
            "input_request": {
                "op_id": str(op.id),
                "call_node_id": op.call_node_id,
                "input_round": round_,
                "method": request.method,
                "request": dict(request.params),
                "schema_digest": schema_digest,
                "deadline": deadline.isoformat(),
            },
        },
    )
    return StepOutcome(
        op.id, EventKind.INPUT_REQUIRED.value, op.state, drain_now=True, detail={"input_round": round_}
    )


def answered_already(op: Operation, request: InputRequest) -> bool:
    """The server shows again the question round ``op.input_round`` answered: the same request id, one
    round (rule 10). The reply is committed before it is posted, so until the server takes it a poll sees
    the question again; after a reply that failed, the question is open again and opens a new round."""
    if request.method == KEYED_ROUND:
        return op.state is OpState.WORKING and unanswered_part(op, request) is None
    stored = op.input_request
    return (
        op.state is OpState.WORKING
        and op.input_round >= 1
        and isinstance(stored, Mapping)
        and not stored.get("reply_failed")
        and stored.get("request_id") == request.request_id
        and stored.get("task_id") == request.task_id
    )


def unanswered_part(op: Operation, request: InputRequest) -> InputRequest | None:
    """A keyed round (the MCP tasks extension: ``request`` is the ``inputRequests`` map) without the keys
    the last round answered, None when none is left: a key already answered is never asked, nor sent,
    twice (DESIGN §7). After a reply that failed, its keys are open again. Other requests as they are."""
    stored = op.input_request
    if (
        request.method != KEYED_ROUND
        or op.input_round < 1
        or not isinstance(stored, Mapping)
        or stored.get("reply_failed")
        or stored.get("method") != KEYED_ROUND
        or stored.get("task_id") != request.task_id
    ):
        return request
    answered = stored.get("params")
    return without_answered(request, answered.keys() if isinstance(answered, Mapping) else ())


def unreadable_input(
    ctx: StepContext, op: Operation, fence: Fence, status: RemoteStatus, interval_s: float
) -> StepOutcome:
    """WORKING, and the server says it waits for input whose request could not be read (the stream that
    carried it was cut, and neither its resumption nor a re-read brought it back): look again soon, for
    at most ``input_unreadable_s`` (the bound is kept in ``input_deadline``); then an operator decides,
    with an INPUT_UNREADABLE record (rule 10). Never a silent poll until the wait budget ends."""
    now = ctx.now()
    bound = dt.timedelta(seconds=ctx.settings.input_unreadable_s)
    recheck_s = ctx.jittered(min(interval_s, AWAITING_INPUT_RECHECK_S))
    read_by = op.input_deadline
    if read_by is None:
        read_by = now + bound
        op = ctx.ledger.wait_for_input_request(
            op.id, fence, status=server_status(status), read_by=read_by, next_poll_in_s=recheck_s
        )
        return StepOutcome(op.id, "input_unreadable", op.state, detail={"read_by": read_by.isoformat()})
    if read_by > now:
        op = ctx.ledger.record_poll(
            op.id, fence, state=op.state, status=server_status(status), next_poll_in_s=recheck_s
        )
        return StepOutcome(op.id, "input_unreadable", op.state, detail={"read_by": read_by.isoformat()})
    stored = op.input_request if isinstance(op.input_request, Mapping) else {}
    op = ctx.hand_to_operator(
        op,
        fence,
        ReconciliationReason.INPUT_UNREADABLE,
        {
            "why": "the server waits for input, but its request could not be read (its stream was cut "
            "and neither a resumption nor a re-read brought it back)",
            "unreadable_since": (read_by - bound).isoformat(),
            "read_by": read_by.isoformat(),
            "remote_id": op.remote_id,
            "server_state": status.server_state,
            "status_message": status.status_message,
            "input_round": op.input_round,
            "last_answered_request_id": stored.get("request_id"),
        },
    )
    return StepOutcome(op.id, "input_unreadable_to_operator", op.state)


def provide_input(
    ctx: StepContext, op: Operation, input_round: int, response: Mapping[str, Any]
) -> StepOutcome:
    """The approval gate's reply to round ``input_round``; a refusal is recorded and raised.

    Raises:
        InputRefused: not the current round, past the deadline, or a reply the adapter refuses.
        NoToken: no control token for the reply now; the caller retries shortly.
    """
    refusal = input_refusal(ctx, op, input_round, response)
    if refusal is not None:
        ctx.ledger.record_event(op.id, EventKind.INPUT_REFUSED, {"input_round": input_round, "why": refusal})
        raise InputRefused(f"input for operation {op.id} round {input_round} refused: {refusal}")
    request = InputRequest.from_json(op.input_request or {})
    # The reply's token is taken before the reply is recorded (a reply recorded is a reply sent); the
    # budget passed to the adapter uses it for the reply's request.
    ctx.take(op.server, "control")
    op = ctx.ledger.record_input_reply(
        op.id,
        Fence(op.execution_epoch, op.cancel_generation),
        input_round=input_round,
        action=response.get("action"),
    )
    try:
        ctx.adapter(op).reply_input(
            remote_ref(op), request, response, budget=ctx.request_budget(op.server, "control", prepaid=1)
        )
    except (AdapterError, NoToken) as exc:
        # Polling resumes either way: a server still waiting shows the question again, and after a failed
        # reply that is a new round (see answered_already).
        # A stale write means the operation moved on meanwhile (its refusal is recorded): nothing to mark.
        with contextlib.suppress(StaleTransition):
            op = ctx.ledger.record_input_reply_failed(
                op.id,
                Fence(op.execution_epoch, op.cancel_generation),
                input_round=input_round,
                answered=op.input_request or {},
                error=describe(exc),
            )
        return StepOutcome(op.id, "input_reply_failed", op.state)
    return StepOutcome(op.id, "input_provided", op.state)


def input_refusal(
    ctx: StepContext, op: Operation, input_round: int, response: Mapping[str, Any]
) -> str | None:
    """Why the reply cannot be taken, or None: the round and the deadline here, the reply's shape by the
    adapter that will send it."""
    if op.state is not OpState.INPUT_REQUIRED:
        return f"the operation is {op.state}, not waiting for input"
    if input_round != op.input_round:
        return f"round {input_round} is not the current round {op.input_round}"
    if op.input_deadline is not None and op.input_deadline <= ctx.now():
        return f"the deadline {op.input_deadline.isoformat()} has passed"
    if op.input_request is None:
        return None
    return ctx.adapter(op).check_reply(InputRequest.from_json(op.input_request), response)
