"""Protocol adapters: one per protocol version, behind one small interface (DESIGN §6).

This package knows HTTP and one protocol per module (or package, for a large one); it imports nothing
from ``ledger`` or ``workers`` and nothing of Celery or SQLAlchemy.
"""

from adapters.base import (
    UNMETERED,
    AdapterConfig,
    CancelOutcome,
    Created,
    ErrorInfo,
    InputRequest,
    Limits,
    LookupResult,
    RemoteRef,
    RemoteResult,
    RemoteStatus,
    RequestBudget,
    TaskSupport,
    TerminalKind,
    Timeouts,
    ToolAdapter,
    ToolCapabilities,
)
from adapters.errors import (
    AdapterError,
    AnswerTooLarge,
    CapabilityRefused,
    NotFound,
    NotSent,
    NoWorkDone,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    ResultNotReady,
    TooManyRequests,
    Transient,
    UnknownAdapter,
    WrongTaskMode,
)
from adapters.mcp_2025_11_25 import McpTasksAdapter
from adapters.registry import AdapterFactory, AdapterRegistry, default_registry

# Plainly sorted (test_the_package_exports_a_sorted_all), not isort-style: one rule for the reader.
__all__ = [  # noqa: RUF022
    "AdapterConfig",
    "AdapterError",
    "AdapterFactory",
    "AdapterRegistry",
    "AnswerTooLarge",
    "CancelOutcome",
    "CapabilityRefused",
    "Created",
    "ErrorInfo",
    "InputRequest",
    "Limits",
    "LookupResult",
    "McpTasksAdapter",
    "NoWorkDone",
    "NotFound",
    "NotSent",
    "OutcomeUnknown",
    "ProtocolViolation",
    "RateLimited",
    "Rejected",
    "RemoteRef",
    "RemoteResult",
    "RemoteStatus",
    "RequestBudget",
    "ResultNotReady",
    "TaskSupport",
    "TerminalKind",
    "Timeouts",
    "TooManyRequests",
    "ToolAdapter",
    "ToolCapabilities",
    "Transient",
    "UNMETERED",
    "UnknownAdapter",
    "WrongTaskMode",
    "default_registry",
]
