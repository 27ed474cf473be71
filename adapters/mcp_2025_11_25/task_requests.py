"""Requests about a task the server already made, on the session its :class:`~adapters.base.RemoteRef`
stored: any worker sends them without a handshake.

:class:`TaskRequests` sends ``tasks/get``, ``tasks/result`` and ``tasks/cancel`` for one task, reads
the server's pending input request for it (from the ``tasks/result`` stream or the session's GET
stream) and lists a session's tasks (``tasks/list``). A 404 for the stored session becomes
``NotFound(session_gone=True)`` (:meth:`ServerSession.ended_is_not_found`).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

from adapters.base import InputRequest, Limits, RemoteRef, RemoteStatus, RequestBudget, Timeouts
from adapters.errors import ProtocolViolation, Rejected
from adapters.http_answers import Exchange, Session
from adapters.jsonrpc import Message, Request
from adapters.mcp_2025_11_25.session import ServerSession, stored_session
from adapters.mcp_2025_11_25.wire import (
    TaskPage,
    first_input_request,
    is_related_to,
    parse_input_request,
    parse_task_page,
    result_of,
)
from adapters.streamable_http import StreamableHttpClient

__all__ = ["TaskRequests"]


@dataclass(frozen=True)
class TaskRequests:
    """The requests about existing tasks on one server; each charged to the caller's ``budget``."""

    client: StreamableHttpClient
    session: ServerSession
    _: KW_ONLY
    server: str
    timeouts: Timeouts
    limits: Limits

    def send(
        self, method: str, remote: RemoteRef, *, idempotent: bool, budget: RequestBudget, **kwargs: Any
    ) -> Exchange:
        """One request whose params are the task's id (``tasks/get``, ``tasks/result``, ``tasks/cancel``).

        Raises:
            NotFound: the stored session is gone. Otherwise as ``StreamableHttpClient.request``.
        """
        session = stored_session(remote)
        with self.session.ended_is_not_found(session, f"{method} {remote.remote_id}", budget=budget):
            return self.client.request(
                method,
                {"taskId": remote.remote_id},
                session=session,
                idempotent=idempotent,
                budget=budget,
                **kwargs,
            )

    def read_input(
        self, remote: RemoteRef, *, json_first: bool, budget: RequestBudget
    ) -> InputRequest | None:
        """The server's pending input request for this task; None when none arrives in time.

        Servers deliver it on the SSE stream of ``tasks/result`` (mcp SDKs) or, answering in JSON mode, on
        the session's GET stream; both are tried, each for at most ``timeouts.input_wait``, the GET
        stream first when the server answers in JSON (``json_first``).
        """
        readers = [self._from_result_stream, self._from_get_stream]
        if json_first:
            readers.reverse()
        for reader in readers:
            request = reader(remote, budget)
            if request is not None:
                return request
        return None

    def _from_result_stream(self, remote: RemoteRef, budget: RequestBudget) -> InputRequest | None:
        task_id = remote.remote_id

        def is_input(message: Message) -> bool:
            return isinstance(message, Request) and parse_input_request(message, task_id=task_id) is not None

        exchange = self.send(
            "tasks/result",
            remote,
            idempotent=True,
            budget=budget,
            read_timeout=self.timeouts.input_wait,
            until=is_input,
            patient=True,
        )
        return first_input_request(exchange.server_requests, task_id)

    def _from_get_stream(self, remote: RemoteRef, budget: RequestBudget) -> InputRequest | None:
        if remote.session_ref is None:
            return None
        task_id = remote.remote_id
        session = stored_session(remote)

        def is_input(message: Message) -> bool:
            # On the GET stream only an explicit related-task _meta ties a request to this task.
            return (
                isinstance(message, Request)
                and is_related_to(message, task_id)
                and parse_input_request(message, task_id=task_id) is not None
            )

        with self.session.ended_is_not_found(session, f"GET stream for {task_id}", budget=budget):
            exchange = self.client.listen(
                session=session, wait_s=self.timeouts.input_wait, until=is_input, budget=budget
            )
        return first_input_request(exchange.server_requests, task_id)

    def list_page(self, cursor: str | None, *, session_ref: str | None, budget: RequestBudget) -> TaskPage:
        """One ``tasks/list`` page, on ``session_ref`` (or the current session).

        Raises:
            Rejected: the server does not declare ``tasks.list``.
            NotFound: the session is gone. Transient, RateLimited, ProtocolViolation.
        """
        facts = self.session.facts(budget=budget)
        if not facts.can_list:
            raise Rejected(f"server {self.server!r} does not declare tasks/list")
        session = (
            Session(session_id=session_ref, protocol_version=facts.protocol_version)
            if session_ref is not None
            else self.session.current(budget=budget)
        )
        params: dict[str, Any] = {"cursor": cursor} if cursor else {}
        with self.session.ended_is_not_found(session, "tasks/list", budget=budget):
            exchange = self.client.request(
                "tasks/list", params, session=session, idempotent=True, budget=budget
            )
        return parse_task_page(result_of("tasks/list", exchange.response, server=self.server))

    def list_all(self, *, session_ref: str | None, budget: RequestBudget) -> list[RemoteStatus]:
        """Every ``tasks/list`` page, at most ``limits.max_pages`` of them."""
        tasks: list[RemoteStatus] = []
        cursor: str | None = None
        for _ in range(self.limits.max_pages):
            page = self.list_page(cursor, session_ref=session_ref, budget=budget)
            tasks.extend(page.tasks)
            cursor = page.next_cursor
            if cursor is None:
                return tasks
        raise ProtocolViolation(
            f"server {self.server!r}: tasks/list has more than {self.limits.max_pages} pages"
        )
