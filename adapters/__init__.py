"""Protocol adapters: one per protocol version, behind one small interface (DESIGN §6).

This package knows HTTP and one protocol per module; it imports nothing from ``ledger`` or ``workers``
and nothing of Celery.
"""

from adapters.base import (
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
    TaskSupport,
    TerminalKind,
    Timeouts,
    ToolAdapter,
    ToolCapabilities,
)
from adapters.errors import (
    AdapterError,
    CapabilityRefused,
    NotFound,
    OutcomeUnknown,
    ProtocolViolation,
    RateLimited,
    Rejected,
    ResultNotReady,
    Transient,
    UnknownAdapter,
    WrongTaskMode,
)
from adapters.mcp_2025_11_25 import McpTasksAdapter
from adapters.registry import AdapterFactory, AdapterRegistry, default_registry

__all__ = [
    "AdapterConfig",
    "AdapterError",
    "AdapterFactory",
    "AdapterRegistry",
    "CancelOutcome",
    "CapabilityRefused",
    "Created",
    "ErrorInfo",
    "InputRequest",
    "Limits",
    "LookupResult",
    "McpTasksAdapter",
    "NotFound",
    "OutcomeUnknown",
    "ProtocolViolation",
    "RateLimited",
    "Rejected",
    "RemoteRef",
    "RemoteResult",
    "RemoteStatus",
    "ResultNotReady",
    "TaskSupport",
    "TerminalKind",
    "Timeouts",
    "ToolAdapter",
    "ToolCapabilities",
    "Transient",
    "UnknownAdapter",
    "WrongTaskMode",
    "default_registry",
]
