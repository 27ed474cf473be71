"""A pipeline's thin, typed client of longcall: the signatures of the tasks a pipeline sends, the queues they
go to, and the shapes of what longcall sends back. It imports Celery only (nothing of the worker's, no ledger,
no Redis): a pipeline may install longcall for it, or keep sending by task name, as this module itself does.

::

    from celery import Celery, chain
    from workers import client

    app = Celery("pipeline", broker="redis://127.0.0.1:6379/0")
    app.conf.task_routes = client.TASK_ROUTES  # a longcall task sent by name finds its queue

    @app.task(name="pipeline.publish_report")
    def publish_report(receipt: client.Receipt) -> None: ...

    client.call(
        "run-42/monthly-report",
        server="reports",
        tool="slow_report",
        arguments={"month": "2026-11"},
        then=publish_report.s(),  # runs once, with the receipt, when the operation has ended
        app=app,
    ).apply_async()

``then`` is what runs when the operation has ended: a task's signature, a chain (its first task receives the
receipt, the next ones what the one before returned) or a group (each member receives it). A chain that puts
``longcall.submit`` before the next step does not wait for the operation: Celery runs the next link as soon as
the submission is answered, a tenth of a second later, with the submission's answer. ``then`` is the link that
waits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, TypedDict

from celery import Celery, Signature, current_app, signature

__all__ = [
    "CANCEL",
    "CONTROL_QUEUE",
    "OUTBOX_QUEUE",
    "POLL_QUEUE",
    "PROVIDE_INPUT",
    "SUBMIT",
    "TASK_ROUTES",
    "InputRequest",
    "Receipt",
    "call",
    "cancel",
    "provide_input",
]

#: The queue of what a pipeline sends (submissions, cancels, input replies) and of longcall's control steps.
CONTROL_QUEUE = "longcall.control"
#: The queue of longcall's status reads.
POLL_QUEUE = "longcall.poll"
#: The queue that hands receipts and input requests to the pipeline's tasks.
OUTBOX_QUEUE = "longcall.outbox"

SUBMIT = "longcall.submit"
CANCEL = "longcall.cancel"
PROVIDE_INPUT = "longcall.provide_input"

#: Every longcall task name and its queue, for a pipeline's ``task_routes``: a longcall task sent by name
#: without ``queue=`` goes to its queue instead of the pipeline's default one, where no longcall worker takes
#: it (and nothing says so). longcall's workers route by the same map.
TASK_ROUTES: Mapping[str, Mapping[str, str]] = {
    name: {"queue": queue, "routing_key": queue}
    for name, queue in {
        SUBMIT: CONTROL_QUEUE,
        CANCEL: CONTROL_QUEUE,
        "longcall.fetch_result": CONTROL_QUEUE,
        PROVIDE_INPUT: CONTROL_QUEUE,
        "longcall.reconcile": CONTROL_QUEUE,
        "longcall.dispatch_due": CONTROL_QUEUE,
        "longcall.record_legacy_outcome": CONTROL_QUEUE,
        "longcall.poll": POLL_QUEUE,
        "longcall.drain_outbox": OUTBOX_QUEUE,
    }.items()
}


class Receipt(TypedDict):
    """What ``then`` receives, as its keyword argument ``receipt``: the operation's one terminal receipt.
    Delivery is at least once: dedupe on ``outbox_id``."""

    receipt_id: str
    outbox_id: int
    op_id: str
    call_node_id: str
    request_digest: str
    #: The server's id of the operation (an MCP task id, an AIP-151 operation name); None if none was made
    #: (cancelled before its create).
    remote_id: str | None
    terminal_state: Literal["completed", "failed", "cancelled"]
    #: ``sha256:`` over the result's canonical JSON; None when cancelled.
    result_digest: str | None
    #: The tool's result as the server gave it (for MCP, a ``CallToolResult``); None when cancelled.
    result: Any
    execution_epoch: int
    cancel_generation: int
    #: When the ledger accepted the end (ISO 8601, UTC).
    accepted_at: str


class InputRequest(TypedDict):
    """What ``on_input`` receives, as its keyword argument ``input_request``: the server asks for input
    (the approval gate). Answer it with :func:`provide_input` (``op_id``, ``input_round``)."""

    op_id: str
    outbox_id: int
    call_node_id: str
    input_round: int
    #: The protocol's method of the request (MCP: ``elicitation/create``; the tasks extension: its
    #: ``inputRequests`` round).
    method: str
    #: The server's request as sent (MCP: the ``elicitation/create`` params).
    request: dict[str, Any]
    schema_digest: str
    #: The latest the answer is waited for (ISO 8601, UTC).
    deadline: str


def call(
    call_node_id: str,
    *,
    server: str,
    tool: str,
    arguments: Mapping[str, Any],
    then: Signature | Mapping[str, Any],
    on_input: Signature | Mapping[str, Any] | None = None,
    ttl_ms: int | None = None,
    wait_budget_s: float | None = None,
    app: Celery | None = None,
) -> Signature:
    """A ``longcall.submit`` signature on :data:`CONTROL_QUEUE`: one operation for ``call_node_id`` (the
    same id never runs twice), ``then`` run with its :class:`Receipt` when it has ended, ``on_input`` with
    an :class:`InputRequest` when the server asks for input. Applying it answers with the submission
    (``op_id``, ``created``), not the end: the end goes to ``then``. What the worker refuses (an unknown
    server, bad arguments, a malformed signature) fails the applied task with ``SubmissionRefused`` and the
    reason; ``then`` not being a signature is refused here. ``app``: the pipeline's Celery app the signature
    is sent with (else Celery's current app, as for any signature)."""
    kwargs: dict[str, Any] = {
        "call_node_id": call_node_id,
        "server": server,
        "tool": tool,
        "arguments": dict(arguments),
        "on_terminal": _signature("then", then, app),
    }
    if on_input is not None:
        kwargs["on_input"] = _signature("on_input", on_input, app)
    if ttl_ms is not None:
        kwargs["ttl_ms"] = ttl_ms
    if wait_budget_s is not None:
        kwargs["wait_budget_s"] = wait_budget_s
    return signature(SUBMIT, kwargs=kwargs, queue=CONTROL_QUEUE, app=app)


def cancel(
    *, call_node_id: str | None = None, op_id: str | None = None, app: Celery | None = None
) -> Signature:
    """A ``longcall.cancel`` signature: the cancel of the operation of ``call_node_id`` (the pipeline's own
    id) or of ``op_id``, one of them. A request: the server's answer decides the receipt. A call node whose
    submission has not been taken yet ends cancelled when it is, with no create sent."""
    if (call_node_id is None) == (op_id is None):
        raise ValueError("cancel takes call_node_id or op_id (one of them)")
    kwargs = {"call_node_id": call_node_id} if call_node_id is not None else {"op_id": op_id}
    return signature(CANCEL, kwargs=kwargs, queue=CONTROL_QUEUE, app=app)


def provide_input(
    op_id: str, input_round: int, response: Mapping[str, Any], *, app: Celery | None = None
) -> Signature:
    """A ``longcall.provide_input`` signature: the answer to round ``input_round`` of ``op_id``'s input
    request, ``response`` the protocol's reply body (MCP elicitation: ``{"action": "accept", "content":
    {...}}``; the tasks extension: the ``inputResponses`` map keyed as the request's ``inputRequests``)."""
    kwargs = {"op_id": op_id, "input_round": input_round, "response": dict(response)}
    return signature(PROVIDE_INPUT, kwargs=kwargs, queue=CONTROL_QUEUE, app=app)


def _signature(name: str, value: Signature | Mapping[str, Any], app: Celery | None) -> dict[str, Any]:
    """A downstream signature as ``longcall.submit`` takes it: a plain dict (JSON; the worker checks it),
    each task in it given the queue the pipeline's app routes it to when it names none. longcall sends it
    from its own app, which knows nothing of the pipeline's routes: without a queue it would go to
    Celery's default queue."""
    if not isinstance(value, Mapping) or not isinstance(value.get("task"), str):
        raise TypeError(f"{name} must be a Celery signature (a task's .s(), a chain, a group), got {value!r}")
    plain: dict[str, Any] = json.loads(json.dumps(value))
    return _with_queues(plain, app or current_app)


def _with_queues(sig: dict[str, Any], app: Celery) -> dict[str, Any]:
    options = sig.setdefault("options", {}) or {}
    sig["options"] = options
    kind = sig.get("subtask_type")
    if kind is None and not options.get("queue"):
        route = app.amqp.router.route({}, sig["task"])
        queue = route.get("queue")
        options["queue"] = getattr(queue, "name", None) or app.conf.task_default_queue
    kwargs = sig.get("kwargs") or {}
    for part in ("tasks", "header", "body"):
        member = kwargs.get(part) if kind is not None else None
        if isinstance(member, dict):
            _with_queues(member, app)
        elif isinstance(member, list):
            for each in member:
                if isinstance(each, dict):
                    _with_queues(each, app)
    for link in ("link", "link_error"):
        linked = options.get(link)
        for each in linked if isinstance(linked, list) else [linked] if isinstance(linked, dict) else []:
            _with_queues(each, app)
    return sig
