"""The terminal-state protocol (DESIGN §5), one step at a time. No Celery here: tasks call these functions
and map the typed outcome to a Celery action.

Every step works under a claim (the operation's poll cursor) and writes with the full fence, so a step that
lost its claim, or whose epoch or cancel generation moved on, changes nothing. The ledger's ``next_poll_at``
drives all work: a step that cannot finish now (no token, a transient failure, a server still working)
schedules the operation again and returns; ``dispatch_due`` picks it up when it is due.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema

from adapters import (
    AdapterError,
    CapabilityRefused,
    Created,
    ErrorInfo,
    InputRequest,
    NotFound,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    RemoteRef,
    RemoteResult,
    RemoteStatus,
    ResultNotReady,
    ToolAdapter,
    Transient,
)
from ledger.digests import digest
from ledger.errors import StaleTransition
from ledger.reasons import ReconciliationReason
from ledger.repository import (
    Fence,
    NewReconciliation,
    Operation,
    Submission,
    TerminalEvidence,
    due_in,
)
from ledger.states import OpState, TerminalKind
from workers.hot import Budget
from workers.runtime import Runtime
from workers.submission import SubmitRequest, record_submission

log = logging.getLogger("longcall.executor")

S = OpState

#: Which task advances an operation in each state the dispatcher finds due.
TASK_FOR_STATE: Mapping[OpState, str] = {
    S.SUBMITTING: "longcall.poll",
    S.SUBMISSION_UNKNOWN: "longcall.poll",
    S.WORKING: "longcall.poll",
    S.CANCEL_REQUESTED: "longcall.cancel",
    S.TERMINAL_OBSERVED: "longcall.fetch_result",
    S.FETCHING_RESULT: "longcall.fetch_result",
}

MIN_POLL_S = 0.1
RETRY_FLOOR_S = 0.5


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What one step did. ``drain_now``: a receipt or an input request is waiting in the outbox."""

    op_id: uuid.UUID
    action: str
    state: OpState | None = None
    drain_now: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "op_id": str(self.op_id),
            "action": self.action,
            "state": self.state.value if self.state else None,
            **({"detail": dict(self.detail)} if self.detail else {}),
        }


@dataclass(frozen=True, slots=True)
class Dispatch:
    task: str
    op_id: uuid.UUID
    cursor: int
    #: Due this many seconds from now: at most one dispatch tick, so a short countdown, never a long ETA.
    delay_s: float = 0.0

    @property
    def task_id(self) -> str:
        return f"{self.task}:{self.op_id}:{self.cursor}"


@dataclass(frozen=True, slots=True)
class Resolution:
    """An operator's evidence-backed decision (``longcall reconcile``)."""

    kind: Literal["found", "never_created", "terminal"]
    evidence: str
    actor: str
    remote_id: str | None = None
    session_ref: str | None = None
    terminal: TerminalKind | None = None


class InputRefused(ValueError):
    """``longcall.provide_input`` refused the reply; the refusal was recorded as an event."""


class WrongState(ValueError):
    """The request does not apply to the operation in its current state."""


class NotCancellable(WrongState):
    """The operation is in a state a cancel cannot apply to (yet)."""


@dataclass(frozen=True, slots=True)
class NoToken(Exception):
    """The server's bucket had no token for this call; retry after ``wait_s``."""

    wait_s: float


class Executor:
    def __init__(self, runtime: Runtime, *, jitter: Callable[[float], float] | None = None) -> None:
        self.rt = runtime
        self.ledger = runtime.ledger
        self._jitter = jitter or (lambda interval: random.uniform(0.0, min(0.05 * interval, 0.25)))  # noqa: S311

    # ------------------------------------------------------------------------------------- submit (1, 2)

    def submit(self, request: SubmitRequest) -> tuple[Submission, StepOutcome | None]:
        """Record the call node's operation, then make the create call at once when this worker holds it."""
        submission = record_submission(self.rt, request, lease_s=self.rt.settings.lease_s)
        if not submission.created:
            return submission, None
        op = submission.operation
        return submission, self._guard(op, op.poll_cursor, self._create)

    def advance(self, op_id: uuid.UUID, cursor: int) -> StepOutcome:
        """``longcall.poll``: the step for a SUBMITTING, SUBMISSION_UNKNOWN or WORKING operation."""
        op = self.ledger.get(op_id)
        step = {
            S.SUBMITTING: self._create,
            S.SUBMISSION_UNKNOWN: self._lookup,
            S.WORKING: self._poll,
        }.get(op.state)
        if step is None:
            return StepOutcome(op.id, "nothing_to_do", op.state)
        return self._guard(op, cursor, step)

    def fetch_result(self, op_id: uuid.UUID, cursor: int) -> StepOutcome:
        op = self.ledger.get(op_id)
        if op.state not in (S.TERMINAL_OBSERVED, S.FETCHING_RESULT):
            return StepOutcome(op.id, "nothing_to_do", op.state)
        return self._guard(op, cursor, self._fetch)

    def send_cancel(self, op_id: uuid.UUID, cursor: int) -> StepOutcome:
        op = self.ledger.get(op_id)
        if op.state is not S.CANCEL_REQUESTED:
            return StepOutcome(op.id, "nothing_to_do", op.state)
        return self._guard(op, cursor, self._cancel)

    def _guard(
        self, op: Operation, cursor: int, step: Callable[[Operation, Fence], StepOutcome]
    ) -> StepOutcome:
        """Run a step under the caller's claim; map a lost claim, a stale write and a missing token."""
        if op.poll_cursor != cursor:
            return StepOutcome(
                op.id, "superseded", op.state, detail={"cursor": cursor, "now": op.poll_cursor}
            )
        fence = Fence(op.execution_epoch, op.cancel_generation, cursor)
        try:
            return step(op, fence)
        except StaleTransition as stale:
            log.info("stale step on %s: %s", op.id, stale)
            return StepOutcome(op.id, "stale", None, detail={"found": stale.found})
        except NoToken as no_token:
            return self._no_token(op, fence, no_token)

    def _create(self, op: Operation, fence: Fence) -> StepOutcome:
        if op.submit_attempted_at is not None:
            # Rule 1: a create was attempted and nothing was recorded after it; never call it again.
            moved = self._move(
                op,
                fence,
                S.SUBMISSION_UNKNOWN,
                {"next_poll_at": due_in(0)},
                "submission_unknown",
                {"why": "a create was attempted before and its answer was never recorded"},
            )
            return self._lookup(moved, fence)
        server = self.rt.remote.server(op.server)
        adapter = self._adapter(op)
        self._take(op.server, "control")
        try:
            capabilities = adapter.capabilities(op.tool_name)
        except Rejected as exc:
            return self._finish_without_task(op, fence, _error_result(exc), "rejected")
        except (Transient, ProtocolViolation, OutcomeUnknown, NotFound) as exc:
            return self._retry_later(op, fence, exc, "capabilities_failed")
        tool = server.tools.get(op.tool_name)
        op = self.ledger.update(
            op.id,
            fence,
            in_states=[S.SUBMITTING],
            values={
                "submit_attempted_at": dt.datetime.now(dt.UTC),
                "tool_descriptor_version": capabilities.descriptor_digest,
            },
            event="create_attempted",
            detail={"use_task": capabilities.use_task, "task_support": capabilities.task_support},
        )
        try:
            created = adapter.create(
                op.tool_name,
                op.body,
                submission_key=str(op.submission_key),
                ttl_ms=op.ttl_ms or server.default_ttl_ms,
                sync_upper_bound_s=tool.sync_upper_bound_s if tool else None,
            )
        except (CapabilityRefused, Rejected) as exc:
            return self._finish_without_task(op, fence, _error_result(exc), "rejected")
        except RateLimited as exc:
            # Refused before any work: the create did not happen, so the attempt is undone (rule 3).
            return self._undo_attempt(op, fence, exc)
        except Transient as exc:
            return self._undo_attempt(op, fence, exc)
        except (OutcomeUnknown, ProtocolViolation, NotFound) as exc:
            moved = self._move(
                op,
                fence,
                S.SUBMISSION_UNKNOWN,
                {"next_poll_at": due_in(0)},
                "submission_unknown",
                {"error": _describe(exc)},
            )
            return self._lookup(moved, fence)
        return self._created(op, fence, created)

    def _created(self, op: Operation, fence: Fence, created: Created) -> StepOutcome:
        if created.sync_result is not None:
            return self._finish_without_task(op, fence, created.sync_result, "ran_synchronously")
        if created.ref is None or created.status is None:
            raise ProtocolViolation("create answered neither a task nor a result")
        status = created.status
        op = self._move(
            op,
            fence,
            S.WORKING,
            {
                "remote_id": created.ref.remote_id,
                "session_ref": created.ref.session_ref,
                **self._status_values(status),
                "expires_at": _expiry(status),
                "next_poll_at": due_in(
                    self._interval_s(op, status) + self._jitter(self._interval_s(op, status))
                ),
                "lease_until": None,
            },
            "created",
            {"remote_id": created.ref.remote_id, "server_state": status.server_state},
        )
        if status.terminal is not None or status.input_request is not None:
            return self._observed(op, fence, status)
        return StepOutcome(op.id, "created", op.state, detail={"remote_id": op.remote_id})

    def _undo_attempt(self, op: Operation, fence: Fence, exc: Transient) -> StepOutcome:
        op = self.ledger.update(
            op.id,
            fence,
            in_states=[S.SUBMITTING],
            values={
                "submit_attempted_at": None,
                "next_poll_at": due_in(self._retry_s(exc)),
                "lease_until": None,
            },
            event="create_refused_before_work",
            detail={"error": _describe(exc)},
        )
        return StepOutcome(op.id, "create_retry", op.state)

    def _finish_without_task(
        self, op: Operation, fence: Fence, result: RemoteResult, why: str
    ) -> StepOutcome:
        """The create call itself gave the final answer (SUBMITTING -> TERMINAL_OBSERVED, documented)."""
        stored = _result_json(result)
        op = self._move(
            op,
            fence,
            S.TERMINAL_OBSERVED,
            {
                "observed_terminal": TerminalKind(result.outcome),
                "server_state": result.server_state,
                "result": stored,
                "result_digest": digest(stored),
                "next_poll_at": due_in(0),
            },
            why,
            {"outcome": result.outcome},
            then=S.FETCHING_RESULT,
        )
        return self._fetch(op, fence)

    def _lookup(self, op: Operation, fence: Fence) -> StepOutcome:
        """Rule 2: query by submission key; only a server's proof of "never created" allows a resubmission."""
        adapter = self._adapter(op)
        self._take(op.server, "control")
        try:
            found = adapter.lookup_by_key(
                str(op.submission_key), tool=op.tool_name, submitted_after=op.created_at
            )
        except (Transient, ProtocolViolation, OutcomeUnknown, NotFound) as exc:
            return self._retry_later(op, fence, exc, "lookup_failed")
        if found.proof == "found" and found.ref is not None:
            op = self._move(
                op,
                fence,
                S.WORKING,
                {
                    "remote_id": found.ref.remote_id,
                    "session_ref": found.ref.session_ref,
                    "next_poll_at": due_in(0),
                    "lease_until": None,
                },
                "found_by_key",
                {"detail": found.detail},
            )
            return StepOutcome(op.id, "found_by_key", op.state)
        if found.proof == "never_created":
            op = self._move(op, fence, S.NOT_FOUND_SAFE, {}, "never_created", {"detail": found.detail})
            op = self._move(
                op,
                fence,
                S.SUBMITTING,
                {"submit_attempted_at": None, "next_poll_at": due_in(0)},
                "resubmission",
                {"submission_key": str(op.submission_key)},
            )
            return self._create(op, fence)
        op = self._to_manual(
            op,
            fence,
            ReconciliationReason.SUBMISSION_UNKNOWN,
            {
                "why": found.detail,
                "submission_key": str(op.submission_key),
                "candidates": [c.remote_id for c in found.candidates],
            },
        )
        return StepOutcome(op.id, "manual_reconciliation", op.state)

    # ----------------------------------------------------------------------------------------- poll (3)

    def _poll(self, op: Operation, fence: Fence) -> StepOutcome:
        if op.wait_deadline is not None and op.wait_deadline <= dt.datetime.now(dt.UTC):
            op = self._to_manual(
                op,
                fence,
                ReconciliationReason.DEADLINE_EXCEEDED,
                {"why": "the wait budget ran out with the operation still open on the server"},
            )
            return StepOutcome(op.id, "wait_budget_exhausted", op.state)
        self._take(op.server, "poll")
        try:
            status = self._adapter(op).get(_ref(op))
        except RateLimited as exc:
            return self._reschedule(op, fence, self._retry_s(exc), "rate_limited", {"error": _describe(exc)})
        except NotFound as exc:
            return self._not_found(op, fence, exc)
        except (Transient, ProtocolViolation, OutcomeUnknown, Rejected) as exc:
            return self._retry_later(op, fence, exc, "poll_failed")
        return self._observed(op, fence, status)

    def _observed(self, op: Operation, fence: Fence, status: RemoteStatus) -> StepOutcome:
        if status.terminal is not None:
            kind = TerminalKind(status.terminal)
            values = {**self._status_values(status), "observed_terminal": kind}
            detail = {"server_state": status.server_state}
            if kind is not TerminalKind.CANCELLED:
                try:
                    self._take(op.server, "control")  # for the result fetch that follows at once
                except NoToken as no_token:
                    op = self._move(
                        op,
                        fence,
                        S.TERMINAL_OBSERVED,
                        {**values, "next_poll_at": due_in(no_token.wait_s), "lease_until": None},
                        "terminal_observed",
                        detail,
                    )
                    return StepOutcome(
                        op.id, "no_token", op.state, detail={"wait_s": round(no_token.wait_s, 3)}
                    )
            op = self._move(
                op,
                fence,
                S.TERMINAL_OBSERVED,
                {**values, "next_poll_at": due_in(0)},
                "terminal_observed",
                detail,
                then=S.FETCHING_RESULT,
            )
            return self._fetch(op, fence, status, token_taken=True)
        if status.input_request is not None:
            return self._input_required(op, fence, status, status.input_request)
        interval = self._interval_s(op, status)
        if status.server_state == "input_required":
            interval = min(interval, 1.0)  # the request could not be read yet: look again soon
        op = self.ledger.update(
            op.id,
            fence,
            in_states=[op.state],
            values={
                **self._status_values(status),
                "next_poll_at": due_in(interval + self._jitter(interval)),
                "lease_until": None,
            },
            event="polled",
            detail={"server_state": status.server_state},
        )
        return StepOutcome(op.id, "still_working", op.state)

    def _not_found(self, op: Operation, fence: Fence, exc: NotFound) -> StepOutcome:
        """Rule 11. NEVER_CREATED is proved only by key (see _lookup); with the terminal state and result
        held, acceptance continues; everything else is UNKNOWN and goes to an operator."""
        if op.result is not None and op.observed_terminal is not None:
            return self._fetch(op, fence)
        op = self._to_manual(
            op,
            fence,
            ReconciliationReason.UNKNOWN_NOT_FOUND,
            {"error": _describe(exc), "session_gone": exc.session_gone, "remote_id": op.remote_id},
        )
        return StepOutcome(op.id, "manual_reconciliation", op.state)

    # ------------------------------------------------------------------------------ result, accept (7, 8)

    def _fetch(
        self, op: Operation, fence: Fence, status: RemoteStatus | None = None, *, token_taken: bool = False
    ) -> StepOutcome:
        remote_call = op.observed_terminal is not TerminalKind.CANCELLED and op.result is None
        if remote_call and not token_taken:
            try:
                self._take(op.server, "control")
            except NoToken as no_token:
                return self._no_token(op, fence, no_token)
        if op.state is S.TERMINAL_OBSERVED:
            op = self._move(op, fence, S.FETCHING_RESULT, {}, "fetching_result", {})
        if op.observed_terminal is TerminalKind.CANCELLED:
            return self._accept(op, TerminalKind.CANCELLED, None, audit={"server_state": op.server_state})
        if op.result is not None:
            # Held already: the create call answered it, or an earlier fetch did (EXPIRED_WITH_RECEIPT).
            return self._accept(op, TerminalKind(op.observed_terminal or "failed"), op.result)
        try:
            result = self._adapter(op).result(_ref(op), status=status if status and status.terminal else None)
        except NotFound as exc:
            return self._not_found(op, fence, exc)
        except (Transient, ProtocolViolation, OutcomeUnknown, ResultNotReady) as exc:
            # A lost or truncated result is fetched again; nothing advances without a whole one (rule 7).
            return self._retry_later(op, fence, exc, "result_failed")
        except Rejected as exc:
            result = _error_result(exc)
        if result.outcome == "cancelled":
            op = self._set_observed(op, fence, TerminalKind.CANCELLED)
            return self._accept(op, TerminalKind.CANCELLED, None, audit=_result_json(result))
        kind = TerminalKind(result.outcome)
        if kind is not op.observed_terminal:
            op = self._set_observed(op, fence, kind)  # e.g. "completed" with isError: true is a failure
        audit = None if result.task_verified else {"task_verified": False, "why": "no related-task _meta"}
        return self._accept(op, kind, _result_json(result), audit=audit)

    def _set_observed(self, op: Operation, fence: Fence, kind: TerminalKind) -> Operation:
        return self.ledger.update(
            op.id,
            fence,
            in_states=[op.state],
            values={"observed_terminal": kind},
            event="outcome_from_result",
            detail={"was": op.observed_terminal, "now": kind.value},
        )

    def _accept(self, op: Operation, kind: TerminalKind, result: Any, *, audit: Any = None) -> StepOutcome:
        acceptance = self.ledger.accept_terminal(
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
            acceptance.outcome,
            None,
            drain_now=acceptance.accepted,
            detail={"receipt_id": str(acceptance.receipt.id)}
            if acceptance.receipt
            else {"mismatches": list(acceptance.mismatches)},
        )

    # ------------------------------------------------------------------------------------------ cancel (6)

    def request_cancel(self, op_id: uuid.UUID) -> StepOutcome:
        """``longcall.cancel``: the CAS on the hot generation, CANCEL_REQUESTED in the ledger, then the
        protocol request. A client that stops waiting never comes here: that is not a cancel."""
        op = self.ledger.get(op_id)
        if op.is_final or op.state is S.CANCEL_REQUESTED:
            return StepOutcome(op.id, "already_" + ("final" if op.is_final else "requested"), op.state)
        if op.state not in (S.WORKING, S.INPUT_REQUIRED):
            raise NotCancellable(
                f"operation {op.id} is {op.state}; a cancel applies once it is WORKING or INPUT_REQUIRED"
            )
        won, hot_generation = self.rt.hot.bump_cancel_generation(op.id, op.cancel_generation)
        if not won:
            if hot_generation > op.cancel_generation:
                # The hot copy ran ahead of the ledger (a cancel whose ledger write lost): the ledger wins.
                self.rt.hot.seed_cancel_generation(op.id, op.cancel_generation)
                won, _ = self.rt.hot.bump_cancel_generation(op.id, op.cancel_generation)
            if not won:
                return StepOutcome(op.id, "cancel_race_lost", op.state)
        try:
            op = self.ledger.transition(
                op.id,
                Fence(op.execution_epoch, op.cancel_generation),
                S.CANCEL_REQUESTED,
                from_states=[op.state],
                bump_generation=True,
                # The lease goes too: a poll in flight is fenced off by the generation, and the cancel is sent
                # under a fresh claim at once instead of after that poll's lease.
                values={"next_poll_at": due_in(0), "lease_until": None},
                event="cancel_requested",
                detail={"generation": op.cancel_generation + 1},
            )
        except StaleTransition:
            current = self.ledger.get(op_id)
            self.rt.hot.seed_cancel_generation(op.id, current.cancel_generation)
            return StepOutcome(op.id, "cancel_raced", current.state)
        claim = self.ledger.claim(op.id, lease_s=self.rt.settings.lease_s)
        if claim is None:
            return StepOutcome(op.id, "cancel_requested", op.state)
        return self.send_cancel(op.id, claim.poll_cursor)

    def _cancel(self, op: Operation, fence: Fence) -> StepOutcome:
        self._take(op.server, "control")
        self._take(op.server, "poll")  # the adapter reads the status first: that is a tasks/get
        adapter = self._adapter(op)
        try:
            outcome = adapter.cancel(_ref(op))
        except NotFound as exc:
            return self._not_found(op, fence, exc)
        except Rejected as exc:
            # No cancel on this server: the outcome comes from polling, as for AIP-151.
            return self._after_cancel(
                op, fence, adapter, None, event="cancel_refused", detail={"error": _describe(exc)}
            )
        except (Transient, OutcomeUnknown, ProtocolViolation) as exc:
            # A lost ACK is resolved by asking again: a second cancel finds the task terminal.
            return self._retry_later(op, fence, exc, "cancel_failed")
        if outcome.kind == "cancelled":
            return self._accept(op, TerminalKind.CANCELLED, None, audit={"server_state": "cancelled"})
        return self._after_cancel(op, fence, adapter, outcome.status, event="cancel_pending", detail={})

    def _after_cancel(
        self,
        op: Operation,
        fence: Fence,
        adapter: ToolAdapter,
        status: RemoteStatus | None,
        *,
        event: str,
        detail: Mapping[str, Any],
    ) -> StepOutcome:
        """Where the task stands after a cancel request that was not itself the evidence of a cancel."""
        if status is None or status.terminal is None:
            try:
                status = adapter.get(_ref(op), read_input=False)
            except NotFound as exc:
                return self._not_found(op, fence, exc)
            except AdapterError as exc:
                return self._retry_later(op, fence, exc, "cancel_read_failed")
        if status.terminal == "cancelled":
            return self._accept(
                op, TerminalKind.CANCELLED, None, audit={"server_state": status.server_state, **detail}
            )
        if status.terminal is not None:
            return self._observed(op, fence, status)  # the completion won the race
        return self._reschedule(op, fence, self._interval_s(op, status), event, detail)

    # ----------------------------------------------------------------------------------------- input (10)

    def _input_required(
        self, op: Operation, fence: Fence, status: RemoteStatus, request: InputRequest
    ) -> StepOutcome:
        deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.rt.settings.input_timeout_s)
        if op.wait_deadline is not None:
            deadline = min(deadline, op.wait_deadline)
        schema_digest = digest(dict(request.schema) if request.schema is not None else None)
        round_ = op.input_round + 1
        op = self._move(
            op,
            fence,
            S.INPUT_REQUIRED,
            {
                **self._status_values(status),
                "input_round": round_,
                "input_request": request.to_json(),
                "input_schema_digest": schema_digest,
                "input_deadline": deadline,
                "lease_until": None,
            },
            "input_required",
            {"input_round": round_, "method": request.method},
            input_outbox={
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
        return StepOutcome(op.id, "input_required", op.state, drain_now=True, detail={"input_round": round_})

    def provide_input(self, op_id: uuid.UUID, input_round: int, response: Mapping[str, Any]) -> StepOutcome:
        """``longcall.provide_input``: the current round only, schema-valid, before the deadline."""
        op = self.ledger.get(op_id)
        refusal = _input_refusal(op, input_round, response)
        if refusal is not None:
            self.ledger.record_event(op.id, "input_refused", {"input_round": input_round, "why": refusal})
            raise InputRefused(f"input for operation {op.id} round {input_round} refused: {refusal}")
        request = InputRequest.from_json(op.input_request)
        self._take(op.server, "control")
        op = self.ledger.transition(
            op.id,
            Fence(op.execution_epoch, op.cancel_generation),
            S.WORKING,
            from_states=[S.INPUT_REQUIRED],
            input_round=input_round,
            values={"next_poll_at": due_in(0)},
            event="input_provided",
            detail={"input_round": input_round, "action": response.get("action")},
        )
        try:
            self._adapter(op).reply_input(_ref(op), request, response)
        except AdapterError as exc:
            # Polling resumes either way: a server still waiting asks again, as round N + 1.
            self.ledger.record_event(
                op.id, "input_reply_failed", {"input_round": input_round, "error": _describe(exc)}
            )
            return StepOutcome(op.id, "input_reply_failed", op.state)
        return StepOutcome(op.id, "input_provided", op.state)

    # ------------------------------------------------------------------------------------ dispatch (3, 13)

    def dispatch_due(self, limit: int | None = None) -> list[Dispatch]:
        """Claim what is due, server by server, at most what each server's budgets can take before the next
        tick (twice that, for slack): a poll storm then waits in the ledger, ordered by due time, instead of
        churning through the broker and the buckets. The buckets remain the guarantee (rule 4)."""
        settings = self.rt.settings
        epoch = self.ledger.control().execution_epoch
        dispatches: list[Dispatch] = []
        budget = limit or settings.dispatch_batch
        for name, server in sorted(self.rt.fleet.servers.items()):
            share = math.ceil((server.poll_qps + server.control_qps) * settings.dispatch_interval_s * 2)
            room = min(budget - len(dispatches), max(1, share))
            if room <= 0:
                break
            claims = self.ledger.claim_due(
                limit=room,
                lease_s=settings.lease_s,
                epoch=epoch,
                server=name,
                horizon_s=settings.dispatch_interval_s,
            )
            dispatches.extend(
                Dispatch(TASK_FOR_STATE[c.state], c.op_id, c.poll_cursor, c.delay_s)
                for c in claims
                if c.state in TASK_FOR_STATE
            )
        return dispatches

    def reconcile(self) -> dict[str, int]:
        """``longcall.reconcile``: hand unanswered input rounds past their deadline to an operator, report
        what waits for one, and flag each record past its deadline once (a ``reconciliation_overdue`` event)
        so alerting can key on it."""
        now = dt.datetime.now(dt.UTC)
        unanswered = 0
        for op in self.ledger.overdue_inputs():
            # Nobody answered in time: the server still waits, so an operator decides (cancel or answer late).
            try:
                self._to_manual(
                    op,
                    Fence(op.execution_epoch, op.cancel_generation),
                    ReconciliationReason.DEADLINE_EXCEEDED,
                    {"why": f"input round {op.input_round} was not answered before its deadline"},
                )
                unanswered += 1
            except StaleTransition:
                continue
        records = self.ledger.open_reconciliations()
        overdue = [r for r in records if r.deadline <= now and not r.detail.get("overdue_flagged")]
        for record in overdue:
            self.ledger.flag_overdue(record.id)
            log.warning(
                "reconciliation %s of %s (%s) is past its deadline", record.id, record.op_id, record.reason
            )
        return {"open": len(records), "newly_overdue": len(overdue), "inputs_timed_out": unanswered}

    def resolve(self, op_id: uuid.UUID, resolution: Resolution) -> Operation:
        """An operator's decision on an operation in MANUAL_RECONCILIATION, with the evidence for it.

        ``found``: the operation exists on the server under ``remote_id`` -> WORKING, polled at once.
        ``never_created``: the operator proved it never ran -> NOT_FOUND_SAFE -> SUBMITTING with the same
        submission key (the only resubmission there is). ``terminal``: it ended on the server -> its result is
        fetched and accepted like any other. Open records of the operation are closed with the evidence.
        """
        op = self.ledger.get(op_id)
        if op.state is not S.MANUAL_RECONCILIATION:
            raise WrongState(f"operation {op.id} is {op.state}, not waiting for an operator")
        fence = Fence(op.execution_epoch, op.cancel_generation)
        note = f"{resolution.kind} by {resolution.actor}: {resolution.evidence}"
        detail = {"actor": resolution.actor, "evidence": resolution.evidence}
        if resolution.kind == "found":
            if not resolution.remote_id:
                raise ValueError("a 'found' resolution names the remote id")
            return self._move(
                op,
                fence,
                S.WORKING,
                {
                    "remote_id": resolution.remote_id,
                    "session_ref": resolution.session_ref or op.session_ref,
                    "next_poll_at": due_in(0),
                },
                "resolved_found",
                detail,
                resolve=note,
            )
        if resolution.kind == "never_created":
            op = self._move(op, fence, S.NOT_FOUND_SAFE, {}, "resolved_never_created", detail, resolve=note)
            return self._move(
                op,
                fence,
                S.SUBMITTING,
                {"submit_attempted_at": None, "next_poll_at": due_in(0)},
                "resubmission",
                {"submission_key": str(op.submission_key)},
            )
        if resolution.terminal is None:
            raise ValueError("a 'terminal' resolution names the terminal state")
        remote_id = resolution.remote_id or op.remote_id
        if remote_id is None and resolution.terminal is not TerminalKind.CANCELLED:
            raise ValueError("the result of a completed or failed operation is fetched by its remote id")
        return self._move(
            op,
            fence,
            S.TERMINAL_OBSERVED,
            {
                "remote_id": remote_id,
                "observed_terminal": resolution.terminal,
                "server_state": None,
                "next_poll_at": due_in(0),
            },
            "resolved_terminal",
            {**detail, "terminal": resolution.terminal.value},
            resolve=note,
        )

    # ------------------------------------------------------------------------------------------ helpers

    def _adapter(self, op: Operation) -> ToolAdapter:
        return self.rt.remote.adapter(op.server)

    def _take(self, server: str, budget: Budget) -> None:
        """Book a slot on the server's bucket (rule 4). A slot within one dispatch tick is waited for here;
        none within reach means NoToken: the step is rescheduled, never blocked."""
        config = self.rt.remote.server(server)
        token = self.rt.hot.take(
            server,
            budget,
            config.poll_qps if budget == "poll" else config.control_qps,
            horizon_s=self.rt.settings.dispatch_interval_s,
        )
        if not token.granted:
            raise NoToken(token.wait_s)
        if token.wait_s > 0:
            time.sleep(token.wait_s)  # bounded by the horizon: at most one dispatch tick

    def _move(  # noqa: PLR0917 - one call shape for every move of a step
        self,
        op: Operation,
        fence: Fence,
        to: OpState,
        values: Mapping[str, Any],
        event: str,
        detail: Mapping[str, Any],
        **extra: Any,
    ) -> Operation:
        return self.ledger.transition(
            op.id, fence, to, from_states=[op.state], values=values, event=event, detail=detail, **extra
        )

    def _to_manual(
        self, op: Operation, fence: Fence, reason: ReconciliationReason, detail: Mapping[str, Any]
    ) -> Operation:
        return self._move(
            op,
            fence,
            S.MANUAL_RECONCILIATION,
            {"next_poll_at": None, "lease_until": None},
            "manual_reconciliation",
            {"reason": reason.value, **detail},
            reconcile=NewReconciliation(
                reason, dt.timedelta(seconds=self.rt.settings.reconcile_deadline_s), detail
            ),
        )

    def _reschedule(
        self, op: Operation, fence: Fence, delay_s: float, event: str, detail: Mapping[str, Any]
    ) -> StepOutcome:
        self.ledger.update(
            op.id,
            fence,
            in_states=[op.state],
            values={"next_poll_at": due_in(delay_s), "lease_until": None},
            event=event,
            detail=detail,
        )
        return StepOutcome(op.id, event, op.state, detail={"delay_s": round(delay_s, 3)})

    def _no_token(self, op: Operation, fence: Fence, no_token: NoToken) -> StepOutcome:
        # A little spread, so operations refused together do not all come back at the same instant.
        delay = no_token.wait_s + random.uniform(0.0, 0.05)  # noqa: S311
        return self._reschedule(op, fence, delay, "no_token", {"wait_s": round(no_token.wait_s, 3)})

    def _retry_later(self, op: Operation, fence: Fence, exc: AdapterError, event: str) -> StepOutcome:
        return self._reschedule(op, fence, self._retry_s(exc), event, {"error": _describe(exc)})

    @staticmethod
    def _retry_s(exc: AdapterError) -> float:
        """Never sooner than the server's Retry-After; without one, a short pause."""
        retry_after = getattr(exc, "retry_after", None)
        if retry_after is not None:
            return max(RETRY_FLOOR_S, float(retry_after))
        return 1.0

    def _interval_s(self, op: Operation, status: RemoteStatus | None) -> float:
        if status is not None and status.poll_interval_ms is not None:
            return max(MIN_POLL_S, status.poll_interval_ms / 1000)
        if op.poll_interval_ms is not None:
            return max(MIN_POLL_S, op.poll_interval_ms / 1000)
        return self.rt.remote.server(op.server).default_poll_interval_ms / 1000

    @staticmethod
    def _status_values(status: RemoteStatus) -> dict[str, Any]:
        return {
            "server_state": status.server_state,
            "status_message": status.status_message,
            "poll_interval_ms": status.poll_interval_ms,
        }


def _ref(op: Operation) -> RemoteRef:
    if op.remote_id is None:
        raise ValueError(f"operation {op.id} has no remote id in state {op.state}")
    return RemoteRef(op.remote_id, op.session_ref, op.protocol_version, op.protocol)


def _expiry(status: RemoteStatus) -> dt.datetime | None:
    if status.ttl_ms is None:
        return None
    created = status.created_at or dt.datetime.now(dt.UTC)
    return created + dt.timedelta(milliseconds=status.ttl_ms)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _error_result(exc: Rejected) -> RemoteResult:
    return RemoteResult(
        outcome="failed",
        server_state=None,
        payload={},
        is_error=True,
        error=ErrorInfo(message=str(exc), code=exc.code, data=exc.data),
    )


def _result_json(result: RemoteResult) -> dict[str, Any]:
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


def _input_refusal(op: Operation, input_round: int, response: Mapping[str, Any]) -> str | None:
    if op.state is not S.INPUT_REQUIRED:
        return f"the operation is {op.state}, not waiting for input"
    if input_round != op.input_round:
        return f"round {input_round} is not the current round {op.input_round}"
    if op.input_deadline is not None and op.input_deadline <= dt.datetime.now(dt.UTC):
        return f"the deadline {op.input_deadline.isoformat()} has passed"
    request = op.input_request or {}
    if request.get("method") == "elicitation/create":
        action = response.get("action")
        if action not in ("accept", "decline", "cancel"):
            return "an elicitation reply needs action accept, decline or cancel"
        if action == "accept":
            schema = request.get("schema") or {}
            try:
                jsonschema.validate(response.get("content", {}), schema)
            except jsonschema.ValidationError as exc:
                return f"content does not match the requested schema: {exc.message}"
            except jsonschema.SchemaError as exc:
                return f"the server's schema is not usable: {exc.message}"
    return None
