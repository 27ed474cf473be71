"""Rule 10: input rounds. A server's input request goes to the approval gate; its reply comes back.

Round N opens when a status read carries an input request (:func:`ask_for_input`): polling pauses and the
request, the schema digest and a deadline go out as an outbox row. :func:`provide_input` takes the gate's
reply for the current round only, before the deadline, in the shape the adapter accepts
(``ToolAdapter.check_reply``: the protocol's own rules live with the protocol), then polling resumes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from adapters import (
    SHIPPED,
    AdapterError,
    InputRequest,
    KeyedRounds,
    NotFound,
    Rejected,
    RemoteStatus,
    Unauthorized,
)
from ledger.digests import canonical_json, digest
from ledger.events import EventKind
from ledger.reasons import ReconciliationReason
from ledger.records import Fence, Operation
from ledger.states import OpState
from workers.errors import InputRefused
from workers.steps.context import (
    StepAction,
    StepContext,
    StepOutcome,
    describe,
    remote_ref,
    retry_s,
    server_status,
    unauthorized_pause,
)
from workers.steps.result import not_found

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
        request_json=stored_request(op, request),
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
        op.id, EventKind.INPUT_REQUIRED, op.state, drain_now=True, detail={"input_round": round_}
    )


def answered_already(op: Operation, request: InputRequest) -> bool:
    """The server shows again the question round ``op.input_round`` answered: the same request id, one
    round (rule 10). The reply is stored before it is sent, so until the server takes it a poll sees the
    question again (and :func:`still_asked` bounds how long after it was taken); after a reply the server
    refused, the question is open again and opens a new round; so does a round that holds no reply (nobody
    answered it before its deadline, and an operator then found the task alive and still asking)."""
    if keyed_rounds(op) is not None:
        return op.state is OpState.WORKING and unanswered_part(op, request) is None
    stored = op.input_request
    return (
        op.state is OpState.WORKING
        and op.input_round >= 1
        and replied(op)
        and isinstance(stored, Mapping)
        and not stored.get("reply_failed")
        and stored.get("request_id") == request.request_id
        and stored.get("task_id") == request.task_id
    )


def replied(op: Operation) -> bool:
    """The current round holds a reply (sent or not) that was not given up."""
    held = op.input_reply
    return (
        isinstance(held, Mapping) and held.get("input_round") == op.input_round and not held.get("given_up")
    )


def unanswered_part(op: Operation, request: InputRequest) -> InputRequest | None:
    """A keyed round (the MCP tasks extension: ``request`` is the ``inputRequests`` map) without the keys
    answered so far (:func:`answered_keys`), None when none is left: a key already answered is never asked,
    nor sent, twice (DESIGN §7). Other requests as they are."""
    without_answered = keyed_rounds(op)
    if without_answered is None or op.input_round < 1 or not _same_task(op, request):
        return request
    return without_answered(request, answered_keys(op))


def answered_keys(op: Operation) -> set[str]:
    """The keys of the operation's keyed rounds answered so far: those the rounds before the current one
    answered (kept with it: ``answered_keys``), and the current round's own once it holds a reply that was
    not given up. The server's ack of a reply is eventually consistent: a poll may show a key answered two
    rounds back beside a new one, and it is not asked again. The keys of a reply the server refused, or of a
    round nobody answered, are open again."""
    stored = op.input_request
    if not isinstance(stored, Mapping):
        return set()
    before = stored.get("answered_keys")
    keys = {key for key in before if isinstance(key, str)} if isinstance(before, list) else set()
    params = stored.get("params")
    if replied(op) and not stored.get("reply_failed") and isinstance(params, Mapping):
        keys.update(key for key in params if isinstance(key, str))
    return keys


def stored_request(op: Operation, request: InputRequest) -> dict[str, Any]:
    """What the ledger keeps of round N + 1's ``request``: the request, and for a keyed round of the same
    task the keys answered before it (:func:`answered_keys`)."""
    stored = request.to_json()
    if keyed_rounds(op) is not None and op.input_round >= 1 and _same_task(op, request):
        keys = answered_keys(op)
        if keys:
            stored["answered_keys"] = sorted(keys)
    return stored


def _same_task(op: Operation, request: InputRequest) -> bool:
    stored = op.input_request
    return (
        isinstance(stored, Mapping)
        and stored.get("method") == request.method
        and stored.get("task_id") == request.task_id
    )


def keyed_rounds(op: Operation) -> KeyedRounds | None:
    """How the operation's protocol version leaves the answered keys out of a round (its spec's
    ``without_answered``), None when its rounds are answered whole (or no adapter is shipped for it)."""
    spec = SHIPPED.find(op.protocol, op.protocol_version)
    return spec.without_answered if spec is not None else None


def answered_round(op: Operation) -> Mapping[str, Any] | None:
    """The current round's reply once the server took it (``sent_at`` set), else None."""
    if replied(op) and op.input_reply.get("sent_at") is not None:
        held: Mapping[str, Any] = op.input_reply
        return held
    return None


def still_asked(ctx: StepContext, op: Operation, fence: Fence, status: RemoteStatus) -> StepOutcome | None:
    """WORKING, the current round's reply taken by the server, and the server still asks for input (the
    same question, or input required with its question not shown): past ``input_reply_s`` since the reply
    was taken, an operator decides (INPUT_REPLY_NOT_TAKEN: the reply did not unblock the task); within it,
    None (the caller polls again soon). None too when no reply of this round was taken."""
    reply = answered_round(op)
    if reply is None or op.state is not OpState.WORKING:
        return None
    since_s = (ctx.now() - bound_start(reply, "sent_at")).total_seconds()
    if since_s <= ctx.settings.input_reply_s:
        return None
    op = ctx.hand_to_operator(
        op,
        fence,
        ReconciliationReason.INPUT_REPLY_NOT_TAKEN,
        {
            "why": f"the server still asks for input {since_s:.0f} s after it took the reply to round "
            f"{op.input_round}"
            + (" (counted since an operator found the task)" if reply.get("bound_from") else ""),
            "input_round": op.input_round,
            "sent_at": reply["sent_at"],
            "server_state": status.server_state,
            "status_message": status.status_message,
            "remote_id": op.remote_id,
        },
    )
    return StepOutcome(op.id, StepAction.INPUT_REPLY_TO_OPERATOR, op.state)


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
        return StepOutcome(
            op.id, StepAction.INPUT_UNREADABLE, op.state, detail={"read_by": read_by.isoformat()}
        )
    if read_by > now:
        op = ctx.ledger.record_poll(
            op.id, fence, state=op.state, status=server_status(status), next_poll_in_s=recheck_s
        )
        return StepOutcome(
            op.id, StepAction.INPUT_UNREADABLE, op.state, detail={"read_by": read_by.isoformat()}
        )
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
    return StepOutcome(op.id, StepAction.INPUT_UNREADABLE_TO_OPERATOR, op.state)


def record_reply(
    ctx: StepContext, op: Operation, input_round: int, response: Mapping[str, Any]
) -> Operation | StepOutcome:
    """The approval gate's reply to round ``input_round``, stored with its round before anything is sent
    (rule 10): the operation as recorded (WORKING, the reply pending: :func:`send_reply` sends it), or, for
    a repeat of the reply the round already holds (a redelivered ``longcall.provide_input``, or one tried
    again after its commit's answer was lost), the outcome that says so. A refusal is recorded and raised.

    Raises:
        InputRefused: not the current round, past the deadline, or a reply the adapter refuses.
    """
    held = op.input_reply if isinstance(op.input_reply, Mapping) else None
    if (
        held is not None
        and held.get("input_round") == input_round
        and canonical_json(held.get("response")) == canonical_json(response)
    ):
        return StepOutcome(
            op.id,
            StepAction.INPUT_RECORDED,
            op.state,
            detail={"input_round": input_round, "sent": held.get("sent_at") is not None, "repeat": True},
        )
    refusal = input_refusal(ctx, op, input_round, response)
    if refusal is not None:
        ctx.ledger.record_event(op.id, EventKind.INPUT_REFUSED, {"input_round": input_round, "why": refusal})
        raise InputRefused(f"input for operation {op.id} round {input_round} refused: {refusal}")
    return ctx.ledger.record_input_reply(
        op.id, Fence(op.execution_epoch, op.cancel_generation), input_round=input_round, response=response
    )


def bound_start(reply: Mapping[str, Any], since: str) -> dt.datetime:
    """When the ``input_reply_s`` bound of ``reply`` started: at its ``since`` time (``recorded_at``: the
    bound to deliver it; ``sent_at``: the bound for the server to act on it), or later, when an operator
    resolved the operation as found (``bound_from``: :func:`found_again`)."""
    start = dt.datetime.fromisoformat(str(reply[since]))
    restarted = reply.get("bound_from")
    return max(start, dt.datetime.fromisoformat(str(restarted))) if restarted else start


def found_again(op: Operation, now: dt.datetime) -> dict[str, Any] | None:
    """The current round's reply with its bound started again at ``now``, None when the round holds none
    (or it was given up). An operator who finds the operation alive after its reply went to them
    (INPUT_REPLY_NOT_TAKEN) sends it on its way again: a reply not yet taken is sent again for another
    ``input_reply_s``, instead of going straight back to the operator and being lost (no other reply is
    taken while the operation does not wait for input); one taken is watched for as long again."""
    if not replied(op):
        return None
    return {**op.input_reply, "bound_from": now.isoformat()}


def pending_reply(op: Operation) -> Mapping[str, Any] | None:
    """The current round's stored reply while the server has not taken it (and it was not given up)."""
    if op.state is OpState.WORKING and replied(op) and op.input_reply.get("sent_at") is None:
        held: Mapping[str, Any] = op.input_reply
        return held
    return None


def send_reply(ctx: StepContext, op: Operation, fence: Fence) -> StepOutcome:
    """WORKING with the round's reply stored and not yet taken: send it (the same reply, every time: a
    reply the server may already hold is answered again, idempotently) on the control budget. Taken: the
    round is acknowledged and polling goes on. Not delivered (a refused or cut connection, a 5xx, a timeout,
    no token): sent again shortly by the next step. Refused by the server: given up, so the question, if
    the server still shows it, opens a new round. Still not taken ``input_reply_s`` after it was stored: an
    operator decides (INPUT_REPLY_NOT_TAKEN), never a silent wait."""
    reply = pending_reply(op)
    if reply is None:
        return StepOutcome(op.id, StepAction.NOTHING_TO_DO, op.state)
    waited_s = (ctx.now() - bound_start(reply, "recorded_at")).total_seconds()
    if waited_s > ctx.settings.input_reply_s:
        op = ctx.hand_to_operator(
            op,
            fence,
            ReconciliationReason.INPUT_REPLY_NOT_TAKEN,
            {
                "why": f"the reply to input round {op.input_round} was not delivered in {waited_s:.0f} s"
                + (" since an operator found the task" if reply.get("bound_from") else ""),
                "input_round": op.input_round,
                "recorded_at": reply["recorded_at"],
                "attempts": reply.get("attempts"),
                "last_error": reply.get("last_error"),
                "remote_id": op.remote_id,
            },
        )
        return StepOutcome(op.id, StepAction.INPUT_REPLY_TO_OPERATOR, op.state)
    request = InputRequest.from_json(op.input_request or {})
    try:
        ctx.adapter(op).reply_input(
            remote_ref(op), request, reply["response"], budget=ctx.budget.per_request(op.server, "control")
        )
    except NotFound as exc:
        return not_found(ctx, op, fence, exc)  # the task (or its session) is gone: as a poll would find
    except Unauthorized as exc:
        # The credentials refused, not the reply (the server did nothing with it): kept, and sent again
        # after a growing pause, within the reply's own bound (LONGCALL_INPUT_REPLY_S, then an operator).
        pause = unauthorized_pause(ctx, op)
        op = ctx.ledger.record_input_reply_failed(
            op.id, fence, reply=reply, error=describe(exc), retry_in_s=pause
        )
        return StepOutcome(op.id, StepAction.INPUT_REPLY_FAILED, op.state, detail={"sent_again_in_s": pause})
    except Rejected as exc:
        op = ctx.ledger.record_input_reply_failed(
            op.id, fence, reply=reply, error=describe(exc), answered=op.input_request or {}
        )
        return StepOutcome(op.id, StepAction.INPUT_REPLY_REFUSED, op.state)
    except AdapterError as exc:
        ctx.budget.hold(op.server, exc)
        op = ctx.ledger.record_input_reply_failed(
            op.id, fence, reply=reply, error=describe(exc), retry_in_s=retry_s(exc)
        )
        return StepOutcome(
            op.id, StepAction.INPUT_REPLY_FAILED, op.state, detail={"sent_again_in_s": retry_s(exc)}
        )
    op = ctx.durably(
        lambda: ctx.ledger.record_input_reply_sent(op.id, fence, reply=reply),
        what=f"the delivered reply of {op.id} round {op.input_round}",
    )
    return StepOutcome(op.id, StepAction.INPUT_PROVIDED, op.state)


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
