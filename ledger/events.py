"""The kinds of ``operation_event`` row, as data.

Pure, like ``ledger/states.py``: the database CHECK ``ck_operation_event_kind_known`` is generated from this
enum (``ledger/models.py``, migration 0003), so a write with a kind not listed here is refused. Event kinds
are public (DESIGN §7): operators and alerting key on them, so a value never changes once written.
"""

from __future__ import annotations

import enum


class EventKind(enum.StrEnum):
    # --- submission and create (rules 1, 2)
    SUBMITTED = "submitted"
    CREATE_ATTEMPTED = "create_attempted"
    CREATE_REFUSED_BEFORE_WORK = "create_refused_before_work"
    CREATED = "created"
    SUBMISSION_UNKNOWN = "submission_unknown"
    FOUND_BY_KEY = "found_by_key"
    NEVER_CREATED = "never_created"
    RESUBMISSION = "resubmission"
    #: The create call itself gave the final answer: a definitive refusal, or a synchronous result.
    REJECTED = "rejected"
    RAN_SYNCHRONOUSLY = "ran_synchronously"
    #: A queued create or a resubmission refused without a remote call: its adapter version is disabled.
    ADAPTER_DISABLED = "adapter_disabled"
    #: The wait budget ran out before the create could be sent (a 429 every time, no token for hours): the
    #: operation ends failed without any create, and its receipt says why (rule 3: a create's retries end).
    CREATE_NEVER_SENT = "create_never_sent"

    # --- polling (rule 3) and its rescheduling
    POLLED = "polled"
    NO_TOKEN = "no_token"  # noqa: S105 - the bucket had no token for the call, not a secret
    RATE_LIMITED = "rate_limited"
    CAPABILITIES_FAILED = "capabilities_failed"
    LOOKUP_FAILED = "lookup_failed"
    POLL_FAILED = "poll_failed"

    # --- terminal outcome and result (rules 7, 8)
    TERMINAL_OBSERVED = "terminal_observed"
    FETCHING_RESULT = "fetching_result"
    RESULT_FAILED = "result_failed"
    #: ``tasks/result`` answered something the observed terminal state rules out (an error for a task
    #: whose status said completed): read again later, an operator past ``result_contradiction_s``.
    RESULT_CONTRADICTS_STATUS = "result_contradicts_status"
    OUTCOME_FROM_RESULT = "outcome_from_result"
    TERMINAL_ACCEPTED = "terminal_accepted"

    # --- cancel (rule 6)
    CANCEL_REQUESTED = "cancel_requested"
    CANCEL_PENDING = "cancel_pending"
    CANCEL_REFUSED = "cancel_refused"
    CANCEL_FAILED = "cancel_failed"
    CANCEL_READ_FAILED = "cancel_read_failed"

    # --- input rounds (rule 10)
    INPUT_REQUIRED = "input_required"
    INPUT_PROVIDED = "input_provided"
    INPUT_REFUSED = "input_refused"
    INPUT_REPLY_FAILED = "input_reply_failed"
    #: The server waits for input whose request could not be read; it must be read by ``input_deadline``.
    INPUT_UNREADABLE = "input_unreadable"
    #: The server took the stored reply of the round (its POST answered): the round is acknowledged.
    INPUT_REPLY_SENT = "input_reply_sent"

    # --- outbox (rule 9)
    #: An outbox row could not be published after its bounded attempts: dead-lettered, an operator told.
    OUTBOX_DEAD_LETTERED = "outbox_dead_lettered"
    #: An operator put a dead-lettered outbox row back to ready (``longcall reconcile --resend``).
    OUTBOX_RESENT = "outbox_resent"

    # --- operators and reconciliation (rule 11)
    MANUAL_RECONCILIATION = "manual_reconciliation"
    RECONCILIATION_OPENED = "reconciliation_opened"
    RECONCILIATION_OVERDUE = "reconciliation_overdue"
    RESOLVED_FOUND = "resolved_found"
    RESOLVED_NEVER_CREATED = "resolved_never_created"
    RESOLVED_TERMINAL = "resolved_terminal"

    # --- fencing (rule 5)
    STALE_WRITE_REJECTED = "stale_write_rejected"

    #: A bare move along an edge of the state table, without a protocol step behind it: written only by
    #: the ledger's own generic edge move, which the exhaustive transition tests drive. Never by workers/.
    TRANSITION = "transition"
