"""What the parts of the 2025-11-25 demo server share: its options, a client's session, one posted message.

The server (``demo_server.mcp``) is three parts over these: the transport (``mcp``: HTTP checks, sessions,
routing), the JSON-RPC methods (``mcp_methods``) and the SSE streams that carry a task's input requests and
its ``tasks/result`` answer (``mcp_streams``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from demo_server._asgi import dumps

#: What a session's GET stream is handed to end it (the session is deleted, or the server stops).
CLOSE = object()


@dataclass(frozen=True)
class ServerOptions:
    stateless: bool = False
    json_response: bool = False
    poll_interval_ms: int = 500
    max_ttl_ms: int | None = None
    page_size: int = 50

    def session_headers(self, session: Session | None) -> dict[str, str]:
        """The headers every answer in ``session`` carries (none when stateless)."""
        return {} if session is None or self.stateless else {"mcp-session-id": session.session_id}


@dataclass(eq=False)
class Session:
    session_id: str
    client_capabilities: dict[str, Any] = field(default_factory=dict)
    stream: asyncio.Queue[object] | None = None

    def push(self, message: object) -> None:
        """Best effort: onto the GET stream when one is open, else dropped."""
        if self.stream is not None:
            self.stream.put_nowait(message)


@dataclass(frozen=True)
class Incoming:
    """One JSON-RPC message posted to /mcp, with the session it came in."""

    message: dict[str, Any]
    session: Session | None

    @property
    def method(self) -> str | None:
        method = self.message.get("method")
        return method if isinstance(method, str) else None

    @property
    def params(self) -> dict[str, Any]:
        params = self.message.get("params")
        return params if isinstance(params, dict) else {}

    @property
    def session_id(self) -> str | None:
        return None if self.session is None else self.session.session_id


def transport_error(code: int, message: str) -> bytes:
    """A transport-level error body (the SDK's ``"id": "server-error"``)."""
    return dumps({"jsonrpc": "2.0", "id": "server-error", "error": {"code": code, "message": message}})
