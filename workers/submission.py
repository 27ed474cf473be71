"""Rule 1 at the boundary: validate a submission once, into the value the ledger records.

Everything a caller sends through ``longcall.submit`` is checked here, before the ledger is touched:
:func:`validate_submission` turns the task's keyword arguments into a :class:`~ledger.records.NewOperation`
the executor records as it is. A refusal writes nothing and says exactly what was wrong.
"""

from __future__ import annotations

import dataclasses
import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from adapters import SHIPPED
from ledger.digests import canonical_json, digest, request_digest
from ledger.errors import NotAdmitted, NotJson
from ledger.records import NewOperation, Operation
from ledger.routing import RECORDED_DECISION, RecordedDecision
from ledger.states import TerminalKind
from workers import __version__
from workers.errors import InvalidSubmission
from workers.rollout import RolloutState, Routing, decide, is_side_effect_free
from workers.settings import FleetConfig
from workers.signatures import JSON_RULE, DeliveryCheck, check_absolute_expiry, checked_signature

SUBMIT_KWARGS = frozenset(
    {"call_node_id", "server", "tool", "arguments", "on_terminal", "on_input", "ttl_ms", "wait_budget_s"}
)
MAX_TTL_MS = 7 * 24 * 3600 * 1000
MAX_NAME = 512
ADAPTERS = frozenset(SHIPPED.keys())


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """The keyword arguments of ``longcall.submit``, each of the right shape (not yet checked against the
    fleet: see :func:`validate_submission`)."""

    call_node_id: str
    server: str
    tool: str
    arguments: dict[str, Any]
    on_terminal: dict[str, Any] | None
    on_input: dict[str, Any] | None
    ttl_ms: int | None
    wait_budget_s: float | None


def validate_submission(
    kwargs: Mapping[str, Any],
    fleet: FleetConfig,
    *,
    max_body_bytes: int,
    max_delay_s: float | None = None,
    delivery: DeliveryCheck = JSON_RULE,
) -> NewOperation:
    """The whole check of a submission: its shape, then its server, adapter, arguments (as its protocol
    version's spec checks them: ``check_arguments``) and body size.

    ``max_delay_s`` bounds the countdown (or ETA ahead) of the downstream signatures
    (``Settings.max_callback_delay_s``: inside a Redis broker's visibility timeout); ``delivery``: what the
    serializer and Celery say of them (``Runtime.delivery``).

    Raises:
        InvalidSubmission: what was wrong; nothing was written.
    """
    request = parse_submit_kwargs(kwargs, max_delay_s=max_delay_s, delivery=delivery)
    server = fleet.servers.get(request.server)
    if server is None:
        known = ", ".join(sorted(fleet.servers)) or "none (set LONGCALL_CONFIG)"
        raise InvalidSubmission(f"unknown server {request.server!r}; configured servers: {known}")
    if (server.protocol, server.protocol_version) not in ADAPTERS:
        known = ", ".join(f"{p} {v}" for p, v in sorted(ADAPTERS))
        raise InvalidSubmission(
            f"server {request.server!r} speaks {server.protocol} {server.protocol_version}, which this "
            f"version of longcall has no adapter for (it has: {known})"
        )
    try:
        body_json = canonical_json(request.arguments)
    except NotJson as exc:
        raise InvalidSubmission(f"arguments are not JSON: {exc}") from exc
    spec = SHIPPED.spec(server.protocol, server.protocol_version)
    refusal = spec.check_arguments(server.tools.get(request.tool), request.arguments)
    if refusal is not None:  # e.g. an AIP-151 create route's placeholders not filled
        raise InvalidSubmission(f"tool {request.tool!r} on server {request.server!r}: {refusal}")
    size = len(body_json.encode("utf-8"))
    if size > max_body_bytes:
        raise InvalidSubmission(
            f"arguments are {size} bytes of JSON; the limit is {max_body_bytes} (LONGCALL_MAX_BODY_BYTES)"
        )
    wait_budget_s = request.wait_budget_s if request.wait_budget_s is not None else server.wait_budget_s
    check_absolute_expiry("on_terminal", request.on_terminal, wait_budget_s)
    check_absolute_expiry("on_input", request.on_input, wait_budget_s)
    return NewOperation(
        call_node_id=request.call_node_id,
        request_digest=request_digest(server=request.server, tool=request.tool, arguments=request.arguments),
        server=request.server,
        protocol=server.protocol,
        protocol_version=server.protocol_version,
        adapter_version=f"longcall/{__version__}",
        tool_name=request.tool,
        body=request.arguments,
        on_terminal=request.on_terminal,
        on_input=request.on_input,
        ttl_ms=request.ttl_ms if request.ttl_ms is not None else server.default_ttl_ms,
        wait_budget_s=wait_budget_s,
    )


def parse_submit_kwargs(
    kwargs: Mapping[str, Any], *, max_delay_s: float | None = None, delivery: DeliveryCheck = JSON_RULE
) -> SubmitRequest:
    """The shape check alone (no fleet needed): names, arguments object, signatures (their delays within
    ``max_delay_s``, as ``delivery`` takes them), ttl and budget."""
    unknown = sorted(set(kwargs) - SUBMIT_KWARGS)
    if unknown:
        raise InvalidSubmission(
            f"unknown argument(s) {unknown} to longcall.submit; accepted: {sorted(SUBMIT_KWARGS)}"
        )
    missing = sorted(k for k in ("call_node_id", "server", "tool", "arguments") if k not in kwargs)
    if missing:
        raise InvalidSubmission(f"longcall.submit needs {missing}")
    arguments = kwargs["arguments"]
    if not isinstance(arguments, dict):
        raise InvalidSubmission(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return SubmitRequest(
        call_node_id=_name("call_node_id", kwargs["call_node_id"]),
        server=_name("server", kwargs["server"]),
        tool=_name("tool", kwargs["tool"]),
        arguments=arguments,
        on_terminal=checked_signature(
            "on_terminal", kwargs.get("on_terminal"), max_delay_s, delivery=delivery
        ),
        on_input=checked_signature("on_input", kwargs.get("on_input"), max_delay_s, delivery=delivery),
        ttl_ms=_ttl(kwargs.get("ttl_ms")),
        wait_budget_s=_budget(kwargs.get("wait_budget_s")),
    )


def operation_summary(op: Operation, *, created: bool | None = None) -> dict[str, Any]:
    """What ``longcall.submit`` returns about the operation (JSON)."""
    summary: dict[str, Any] = {
        "op_id": str(op.id),
        "call_node_id": op.call_node_id,
        "state": op.state.value,
        "server": op.server,
        "tool": op.tool_name,
        "remote_id": op.remote_id,
        "server_state": op.server_state,
        "request_digest": op.request_digest,
        # Shadow: longcall runs it, delivers nothing; the caller keeps its legacy path (workers/rollout.py).
        "routed": op.routing == "live",
        "routing": op.routing,
    }
    if op.routing == "shadow":
        summary["reason"] = "shadow"
    if created is not None:
        summary["created"] = created
    return summary


class NotRouted(NotAdmitted):
    """The call node is outside the canary: ``longcall.submit`` answers ``routing.answer()``; nothing is
    written but the decision itself (``routing_decision``), no operation, nothing sent (raised by the
    admission inside :meth:`ledger.repository.Ledger.record_submission`, again after its commit)."""

    def __init__(self, routing: Routing) -> None:
        super().__init__(f"call node not routed ({routing.reason}, {routing.percent} %)")
        self.routing = routing


def canary_admission(fleet: FleetConfig, new: NewOperation) -> Callable[[Mapping[str, Any]], NewOperation]:
    """The routing of a call node that has no operation yet, decided inside the insert's transaction under
    the call node's submission lock (``Ledger.record_submission(admit=...)``): the operation to insert
    (live, or shadow without downstream signatures), or :class:`NotRouted`.

    Why under the lock, in the insert's transaction: a submission that decided "live" and inserted its row
    (not yet committed) while ``longcall rollout --percent`` lowered the canary must not be followed by a
    second submission of the same call node that sees no row, reads the lowered percentage and answers "not
    routed" (the caller would run its legacy path beside longcall's live operation). Under the lock the
    second waits for the first to commit, then finds its row and returns it.

    The reverse (the canary raised while a "not routed" answer is being decided) makes no second
    operation out of that answer: the decision reads the percentage once, after the lock, in the transaction
    that would insert, and a "not routed" decision inserts no operation, so there is no row a raise could
    revive and no step ever starts one for that call node (rows are only made here, never by a rollout
    change). A concurrent submission of the same call node waits for the lock and decides after it.

    A submission that arrives AFTER a raise (a caller's retry, or a redelivered ``longcall.submit``
    message) is not decided afresh: every decision taken while a canary percentage is set is recorded in
    ``routing_decision`` in the same transaction (``ledger/routing.py``), and the ledger gives the record
    back here (``rollout_json["recorded_decision"]``): the call node gets the answer it got first, at the
    percentage it was decided at, whatever the rollout says now.
    """
    side_effect_free = is_side_effect_free(fleet, new.server, new.tool_name)

    def admit(rollout_json: Mapping[str, Any]) -> NewOperation:
        recorded = rollout_json.get(RECORDED_DECISION)
        if recorded is not None:
            decision = RecordedDecision.from_json(recorded)
            if decision.routed:
                return new
            raise NotRouted(Routing("not_routed", "canary", decision.percent))
        rollout = RolloutState.from_control(rollout_json)
        if rollout.canary_percent is None and not rollout.shadow:
            return new  # no rollout configured: everything is routed, as before issue 12
        routing = decide(new.call_node_id, side_effect_free=side_effect_free, rollout=rollout)
        if routing.route == "live":
            return new
        if routing.route == "shadow":
            return dataclasses.replace(new, routing="shadow", on_terminal=None, on_input=None)
        raise NotRouted(routing)

    return admit


LEGACY_KWARGS = frozenset({"call_node_id", "terminal_state", "result_digest", "result", "detail"})
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
MAX_LEGACY_DETAIL_BYTES = 16_384


@dataclass(frozen=True, slots=True)
class LegacyOutcome:
    """The keyword arguments of ``longcall.record_legacy_outcome``, checked: the result (when given) is
    kept as its digest only."""

    call_node_id: str
    terminal_state: TerminalKind
    result_digest: str | None
    detail: dict[str, Any] | None


def parse_legacy_outcome(kwargs: Mapping[str, Any], *, max_body_bytes: int) -> LegacyOutcome:
    """The boundary check of a legacy outcome: ``call_node_id``, ``terminal_state`` (completed, failed or
    cancelled), and optionally ``result_digest`` (``sha256:<64 hex>``) or ``result`` (JSON, digested as
    longcall digests a receipt's result: give it in the shape the receipt carries), and ``detail`` (a small
    JSON object kept beside it).

    Raises:
        InvalidSubmission: what was wrong; nothing was written.
    """
    unknown = sorted(set(kwargs) - LEGACY_KWARGS)
    if unknown:
        raise InvalidSubmission(
            f"unknown argument(s) {unknown} to longcall.record_legacy_outcome; "
            f"accepted: {sorted(LEGACY_KWARGS)}"
        )
    missing = sorted(k for k in ("call_node_id", "terminal_state") if k not in kwargs)
    if missing:
        raise InvalidSubmission(f"longcall.record_legacy_outcome needs {missing}")
    states = sorted(k.value for k in TerminalKind)
    state = kwargs["terminal_state"]
    if not isinstance(state, str) or state not in states:
        raise InvalidSubmission(f"terminal_state must be one of {states}, got {state!r}")
    given = kwargs.get("result_digest")
    if given is not None and (not isinstance(given, str) or not DIGEST.match(given)):
        raise InvalidSubmission("result_digest must look like sha256:<64 lowercase hex digits>")
    result_digest: str | None = given
    if "result" in kwargs and kwargs["result"] is not None:
        try:
            size = len(canonical_json(kwargs["result"]).encode("utf-8"))
        except NotJson as exc:
            raise InvalidSubmission(f"result is not JSON: {exc}") from exc
        if size > max_body_bytes:
            raise InvalidSubmission(f"result is {size} bytes of JSON; the limit is {max_body_bytes}")
        result_digest = digest(kwargs["result"])
        if given is not None and given != result_digest:
            raise InvalidSubmission(
                f"result digests to {result_digest}, not the result_digest given ({given})"
            )
    detail = kwargs.get("detail")
    if detail is not None:
        if not isinstance(detail, dict):
            raise InvalidSubmission("detail must be a JSON object")
        try:
            size = len(canonical_json(detail).encode("utf-8"))
        except NotJson as exc:
            raise InvalidSubmission(f"detail is not JSON: {exc}") from exc
        if size > MAX_LEGACY_DETAIL_BYTES:
            raise InvalidSubmission(f"detail is {size} bytes of JSON; at most {MAX_LEGACY_DETAIL_BYTES}")
    return LegacyOutcome(
        call_node_id=_name("call_node_id", kwargs["call_node_id"]),
        terminal_state=TerminalKind(state),
        result_digest=result_digest,
        detail=detail,
    )


def call_node_name(value: Any) -> str:
    """A call node id, checked as a submission's is (:class:`InvalidSubmission` with the reason)."""
    return _name("call_node_id", value)


def _name(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidSubmission(f"{field} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise InvalidSubmission(f"{field} must not be empty")
    if len(value) > MAX_NAME:
        raise InvalidSubmission(f"{field} is {len(value)} characters; at most {MAX_NAME}")
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise InvalidSubmission(f"{field} must not contain control characters")
    return value


def _ttl(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_TTL_MS:
        raise InvalidSubmission(f"ttl_ms must be a whole number of milliseconds in 1..{MAX_TTL_MS}")
    return value


def _budget(value: Any) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidSubmission("wait_budget_s must be a positive number of seconds")
    return float(value)
