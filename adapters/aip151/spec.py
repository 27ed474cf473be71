"""AIP-151 ``v1`` as the worker knows it: each tool is started by its configured create route, whose
``{placeholder}`` path segments a submission's arguments must fill; no session, no input round."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.aip151.adapter import AipOperationsAdapter
from adapters.aip151.wire import PLACEHOLDER, PROTOCOL, PROTOCOL_VERSION
from adapters.spec import AdapterSpec, ToolSettings

__all__ = ["PATH_BREAKERS", "SPEC", "check_route_arguments", "check_tool_routes"]

#: What a placeholder's value may not contain: it would leave its path segment (or the path).
PATH_BREAKERS = ("/", "\\", "..", "?", "#")


def check_tool_routes(protocol_version: str, tools: Mapping[str, ToolSettings]) -> None:
    """An AIP-151 server names version ``v1`` (a server naming another is checked here too: it is
    refused), and each of its tools has the create route it is started by and the body field of its
    AIP-155 request id; none has a synchronous bound (a create always makes an operation).

    Raises:
        ValueError: what is wrong, naming the tool.
    """
    if protocol_version != PROTOCOL_VERSION:
        raise ValueError(
            f'protocol "{PROTOCOL}" has protocol_version "{PROTOCOL_VERSION}", not {protocol_version!r}'
        )
    for name, tool in tools.items():
        missing = [k for k in ("create", "request_id_field") if getattr(tool, k) is None]
        if missing:
            raise ValueError(
                f"{PROTOCOL} tool {name!r} needs {' and '.join(missing)} (how it is started, and the "
                f"body field of its AIP-155 request id)"
            )
        if tool.sync_upper_bound_s is not None:
            raise ValueError(
                f"{PROTOCOL} tool {name!r}: sync_upper_bound_s is for MCP tools (an AIP-151 create "
                f"always makes an operation)"
            )


def check_route_arguments(tool: ToolSettings | None, arguments: Mapping[str, Any]) -> str | None:
    """Why the arguments cannot fill the tool's create route, or None: every ``{placeholder}`` (filled as
    :func:`~adapters.aip151.wire.build_create` fills it) needs a non-empty string or integer that stays
    inside its path segment (no ``/``, ``\\``, ``..``, ``?``, ``#``). A tool with no create route is left
    to the adapter, which refuses it."""
    if tool is None or tool.create is None:
        return None
    names = PLACEHOLDER.findall(tool.create)
    missing = sorted({n for n in names if n not in arguments})
    if missing:
        return (
            f"the create route {tool.create!r} needs the argument(s) {', '.join(missing)} (its path "
            f"placeholders); they are missing"
        )
    bad: list[str] = []
    for name in sorted(set(names)):
        value = arguments[name]
        if isinstance(value, bool) or not isinstance(value, str | int):
            bad.append(f"{name} must be a string or an integer, got {type(value).__name__}")
        elif isinstance(value, str) and not value.strip():
            bad.append(f"{name} must not be empty")
        elif isinstance(value, str) and (value == "." or any(b in value for b in PATH_BREAKERS)):
            bad.append(f"{name}={value!r} would change the path (it is '.', or contains / \\ .. ? or #)")
    if bad:
        return f"the create route {tool.create!r} cannot be filled: " + "; ".join(bad)
    return None


SPEC = AdapterSpec(
    PROTOCOL,
    PROTOCOL_VERSION,
    AipOperationsAdapter,
    check_config=check_tool_routes,
    check_arguments=check_route_arguments,
    lookup_may_create=True,
)
