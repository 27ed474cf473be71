"""Why a reconciliation record was opened (the ``reconciliation.reason`` column)."""

from __future__ import annotations

import enum


class ReconciliationReason(enum.StrEnum):
    #: The create call's answer was lost and the protocol cannot prove whether the operation exists.
    SUBMISSION_UNKNOWN = "SUBMISSION_UNKNOWN"
    #: The server no longer knows the operation and nothing proves whether it ran (rule 11, UNKNOWN).
    UNKNOWN_NOT_FOUND = "UNKNOWN_NOT_FOUND"
    #: A completion arrived after a cancel was accepted: the effect may have happened (rule 6).
    EFFECT_RECONCILIATION_REQUIRED = "EFFECT_RECONCILIATION_REQUIRED"
    #: The server answered something the protocol does not allow (e.g. a result for another task).
    PROTOCOL_VIOLATION = "PROTOCOL_VIOLATION"
    #: The wait budget or the input deadline ran out with the operation still open on the server.
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    #: The server waits for input, but its request could not be read within the bound (rule 10).
    INPUT_UNREADABLE = "INPUT_UNREADABLE"
    #: The result kept contradicting the observed terminal state (e.g. an error for a completed task).
    RESULT_CONTRADICTS_STATUS = "RESULT_CONTRADICTS_STATUS"
    #: The result cannot be stored and delivered exactly (not JSON, refused by jsonb, changed by the
    #: Celery JSON serializer) or is larger than ``max_result_bytes``.
    RESULT_UNSTORABLE = "RESULT_UNSTORABLE"
    #: The result could not be read within the bound: the same error every time (a refusal, an unparsable
    #: or over-size answer, a protocol violation) for ``result_retry_s`` or its tries (rule 7).
    RESULT_UNREADABLE = "RESULT_UNREADABLE"
    #: The round was answered, and the server still asks (or the reply could not be delivered) past
    #: ``input_reply_s`` (rule 10).
    INPUT_REPLY_NOT_TAKEN = "INPUT_REPLY_NOT_TAKEN"
    #: The operation's server is not in the configuration (removed or renamed) while it is in flight.
    SERVER_UNCONFIGURED = "SERVER_UNCONFIGURED"
    #: A receipt or an input request could not be published downstream after its bounded attempts.
    OUTBOX_UNDELIVERABLE = "OUTBOX_UNDELIVERABLE"
