"""MCP 2026-07-28 with the tasks extension as the worker knows it: its tools are listed by the server (as
2025-11-25's), no session, and an input round is the ``inputRequests`` map, answered key by key."""

from __future__ import annotations

from adapters.mcp_2025_11_25.spec import check_listed_tools
from adapters.mcp_2026_07_28.adapter import McpExtTasksAdapter
from adapters.mcp_2026_07_28.wire import PROTOCOL, PROTOCOL_VERSION, without_answered
from adapters.spec import AdapterSpec

__all__ = ["SPEC"]

SPEC = AdapterSpec(
    PROTOCOL,
    PROTOCOL_VERSION,
    McpExtTasksAdapter,
    check_config=check_listed_tools,
    without_answered=without_answered,
)
