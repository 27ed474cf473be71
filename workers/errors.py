"""The workers' one exception tree.

Everything ``workers/`` raises on purpose is one of these; what the ledger and the adapters raise keeps its
own tree (``ledger.errors``, ``adapters.errors``) and is mapped where a caller needs a different answer.
Each class says what its caller does with it::

    WorkerError
     ├── ConfigError            the settings or LONGCALL_CONFIG cannot be used (names the key); a worker
     │                          or beat refuses to start, the CLI exits 2. Fix the configuration.
     ├── UnknownServer          an operation names a server LONGCALL_CONFIG does not have (any more)
     ├── InvalidSubmission      a submission failed validation at the boundary; nothing was written
     ├── WrongState             the request does not apply to the operation in its current state
     │    └── NotCancellable    a cancel cannot apply to the operation's state (yet)
     ├── InputRefused           an input reply was refused; the refusal is recorded as an event
     ├── NoToken(wait_s)        the server's bucket had no token: reschedule in ``wait_s``, never block
     │
     │   raised out of Celery tasks: callers see these names (DESIGN §7)
     ├── SubmissionRefused      ``longcall.submit`` refused the call; nothing was written
     ├── RequestRefused         ``longcall.cancel`` or ``longcall.provide_input`` refused the request
     └── IntentNotRecorded      a message sent by name met a Postgres, Redis or broker fault for longer
                                than ``intent_retry_s``: it was not recorded (logged at ERROR); send it
                                again once the fault is gone

The classes that were ``ValueError`` or ``LookupError`` before this tree existed still are, so a caller
catching the builtin keeps working.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "InputRefused",
    "IntentNotRecorded",
    "InvalidSubmission",
    "NoToken",
    "NotCancellable",
    "RequestRefused",
    "SubmissionRefused",
    "UnknownServer",
    "WorkerError",
    "WrongState",
]


class WorkerError(Exception):
    """Base of every error ``workers/`` raises on purpose."""


class ConfigError(WorkerError, ValueError):
    """The configuration cannot be used; the message says where and why."""


class UnknownServer(WorkerError, LookupError):
    """The named server is not in LONGCALL_CONFIG."""


class InvalidSubmission(WorkerError, ValueError):
    """The submission was refused at the boundary; nothing was written."""


class WrongState(WorkerError, ValueError):
    """The request does not apply to the operation in its current state."""


class NotCancellable(WrongState):
    """The operation is in a state a cancel cannot apply to (yet)."""


class InputRefused(WorkerError, ValueError):
    """``longcall.provide_input`` refused the reply; the refusal was recorded as an event."""


class NoToken(WorkerError):
    """The server's bucket had no token for this call; retry after ``wait_s``.

    A plain exception, not a frozen dataclass: it travels through adapters and context managers, which
    set its ``__traceback__`` (a frozen instance refuses that).
    """

    def __init__(self, wait_s: float) -> None:
        super().__init__(wait_s)
        self.wait_s = wait_s

    def __str__(self) -> str:  # what an event's error and ``longcall list`` show: a wait, not a failure
        return f"no token left in the server's request budget; next in {self.wait_s:.2f} s"


class SubmissionRefused(WorkerError):
    """``longcall.submit`` refused the call; the message says why. Nothing was written."""


class RequestRefused(WorkerError):
    """A cancel or an input reply was refused; the message says why."""


class IntentNotRecorded(WorkerError):
    """A message sent by name (a submission, a cancel, an input reply) met an infrastructure fault for
    longer than ``intent_retry_s`` and was not recorded; the message names the fault and for how long."""
