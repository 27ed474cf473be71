"""MCP 2025-11-25 as the worker knows it: its tools are listed by the server, its tasks bound to a session."""

from __future__ import annotations

from collections.abc import Mapping

from adapters.mcp_2025_11_25.adapter import McpTasksAdapter
from adapters.mcp_2025_11_25.wire import PROTOCOL, PROTOCOL_VERSION
from adapters.spec import AdapterSpec, ToolSettings

__all__ = ["SPEC", "check_listed_tools"]


def check_listed_tools(protocol_version: str, tools: Mapping[str, ToolSettings]) -> None:
    """An MCP server lists its tools, so a create route on one (AIP-151's way of starting a tool) is a
    mistake, refused rather than ignored.

    Raises:
        ValueError: a tool carries ``create`` or ``request_id_field``.
    """
    for name, tool in tools.items():
        if tool.create is not None or tool.request_id_field is not None:
            raise ValueError(
                f"{PROTOCOL} tool {name!r}: create and request_id_field are for aip151 servers "
                f"(an MCP server lists its tools)"
            )


#: Tasks are bound to the session that created them over Streamable HTTP: a stateful server answers every
#: read of a task without its ``Mcp-Session-Id`` "400 Missing session ID", one on another session "not
#: found". The session is recorded on the operation from the create's answer; when that answer was lost,
#: only the operator's evidence can name it.
SPEC = AdapterSpec(
    PROTOCOL, PROTOCOL_VERSION, McpTasksAdapter, check_config=check_listed_tools, session_bound=True
)
