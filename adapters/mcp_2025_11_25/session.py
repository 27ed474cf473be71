"""One worker's session with one MCP server, and what the server declared on it.

:class:`ServerSession` owns the lifecycle: the lazy ``initialize`` handshake (and its
``notifications/initialized``), forgetting the session and initializing again when the server says it
is gone (HTTP 404), the :class:`~adapters.mcp_2025_11_25.wire.ServerFacts` the handshake returned and
the tool list, read again at most every ``limits.tool_list_max_age_s``. Operations already created do
not need it: their session is rebuilt from the stored :class:`~adapters.base.RemoteRef`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from adapters.base import Limits, RemoteRef, RequestBudget
from adapters.errors import AdapterError, NotFound, ProtocolViolation
from adapters.http_answers import Session, SessionGone
from adapters.mcp_2025_11_25.wire import (
    ADAPTER_VERSION,
    PROTOCOL,
    PROTOCOL_VERSION,
    ServerFacts,
    negotiate,
    parse_tools_page,
    result_of,
)
from adapters.streamable_http import StreamableHttpClient

__all__ = ["ServerSession", "stored_session"]


def stored_session(remote: RemoteRef) -> Session:
    """The session a stored reference names, rebuilt without a handshake."""
    if remote.protocol != PROTOCOL:
        raise ValueError(f"reference of protocol {remote.protocol!r} given to the MCP adapter")
    return Session(session_id=remote.session_ref, protocol_version=remote.protocol_version)


class ServerSession:
    """The current session with one server (thread-safe); every request it sends is charged to the
    ``budget`` of the call that needs it. A refused charge leaves no half-made session: the session is
    kept only once ``initialize`` and ``notifications/initialized`` have both been sent."""

    def __init__(self, client: StreamableHttpClient, *, server: str, limits: Limits) -> None:
        self._client = client
        self._server = server
        self._limits = limits
        self._lock = threading.RLock()
        self._session: Session | None = None
        self._facts: ServerFacts | None = None
        self._tools: list[Mapping[str, Any]] | None = None
        self._tools_read_at = 0.0

    @property
    def current_id(self) -> str | None:
        """The current session's id (None when stateless or not initialized yet)."""
        session = self._session
        return session.session_id if session is not None else None

    @property
    def known(self) -> Session | None:
        """The current session, without initializing one."""
        return self._session

    def facts(self, *, budget: RequestBudget) -> ServerFacts:
        """Initialize if needed; return what the server declared."""
        with self._lock:
            if self._facts is None or self._session is None:
                return self._initialize(budget)[1]
            return self._facts

    def current(self, *, budget: RequestBudget) -> Session:
        """The current session, initialized if needed."""
        with self._lock:
            if self._session is None:
                return self._initialize(budget)[0]
            return self._session

    def _initialize(self, budget: RequestBudget) -> tuple[Session, ServerFacts]:
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {"elicitation": {"form": {}}, "tasks": {}},
            "clientInfo": {"name": "longcall", "version": ADAPTER_VERSION},
        }
        exchange = self._client.request("initialize", params, session=None, idempotent=True, budget=budget)
        facts = negotiate(
            result_of("initialize", exchange.response, server=self._server), server=self._server
        )
        session = Session(session_id=exchange.session_id, protocol_version=facts.protocol_version)
        self._client.post_message(
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            session=session,
            what="notifications/initialized",
            idempotent=True,
            budget=budget,
        )
        self._session, self._facts, self._tools = session, facts, None
        return session, facts

    def gone(self, gone: Session | None, *, budget: RequestBudget) -> None:
        """A 404 for ``gone``: forget it and re-initialize (MUST, per the transport spec)."""
        with self._lock:
            if self._session is None or gone is None or self._session.session_id == gone.session_id:
                self._session, self._facts, self._tools = None, None, None
                try:
                    self._initialize(budget)
                except AdapterError:
                    # The next call initializes lazily; the caller is told NotFound either way.
                    self._session, self._facts, self._tools = None, None, None

    @contextlib.contextmanager
    def ended_is_not_found(self, session: Session, what: str, *, budget: RequestBudget) -> Iterator[None]:
        """Around a request on ``session``: a 404 for it (:class:`SessionGone`) starts a new session and
        is :class:`NotFound` with ``session_gone`` for the caller."""
        try:
            yield
        except SessionGone as exc:
            self.gone(session, budget=budget)
            raise NotFound(
                f"server {self._server!r}: {what}: session {session.session_id} is gone", session_gone=True
            ) from exc

    def tools(self, *, budget: RequestBudget) -> list[Mapping[str, Any]]:
        """The server's tool descriptors, every ``tools/list`` page, cached for ``tool_list_max_age_s``."""
        with self._lock:
            session = self.current(budget=budget)
            fresh = time.monotonic() - self._tools_read_at < self._limits.tool_list_max_age_s
            if self._tools is not None and fresh:
                return self._tools
            tools: list[Mapping[str, Any]] = []
            cursor: str | None = None
            for _ in range(self._limits.max_pages):
                params: dict[str, Any] = {"cursor": cursor} if cursor else {}
                exchange = self._client.request(
                    "tools/list", params, session=session, idempotent=True, budget=budget
                )
                page, cursor = parse_tools_page(
                    result_of("tools/list", exchange.response, server=self._server)
                )
                tools.extend(page)
                if cursor is None:
                    self._tools, self._tools_read_at = tools, time.monotonic()
                    return tools
            raise ProtocolViolation(
                f"server {self._server!r}: tools/list has more than {self._limits.max_pages} pages"
            )
