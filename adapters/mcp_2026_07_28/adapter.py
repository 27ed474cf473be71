"""The MCP tasks extension client (spec 2026-07-28): :class:`McpExtTasksAdapter`, the
:class:`~adapters.base.ToolAdapter` verbs over :class:`~adapters.mcp_2026_07_28.transport.ExtHttp`.

No handshake and no session: every request carries the version header and the tasks opt-in in
``_meta``; a :class:`~adapters.base.RemoteRef` is the task id alone (``session_ref`` None), so any worker
resumes any operation. Each verb takes a ``budget`` charged before every HTTP request it sends
(:mod:`adapters.metering`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

import httpx2

from adapters.base import (
    UNMETERED,
    AdapterConfig,
    CancelOutcome,
    Created,
    InputRequest,
    LookupResult,
    RemoteRef,
    RemoteResult,
    RemoteStatus,
    RequestBudget,
    ToolCapabilities,
)
from adapters.errors import NotFound, OutcomeUnknown, ProtocolViolation, Rejected, ResultNotReady
from adapters.mcp_2025_11_25.wire import descriptor_digest, find_tool, parse_tools_page
from adapters.mcp_2026_07_28.discovery import LEGACY_VERSION, Generation, GenerationCache, detect
from adapters.mcp_2026_07_28.transport import ExtHttp
from adapters.mcp_2026_07_28.wire import (
    ADAPTER_VERSION,
    PROTOCOL,
    PROTOCOL_VERSION,
    parse_create_result,
    parse_task,
    reply_refusal,
)
from adapters.metering import budget_edge

__all__ = ["GENERATIONS", "McpExtTasksAdapter"]

#: The generations detected in this process, per server and URL (see :mod:`.discovery`).
GENERATIONS = GenerationCache()


@contextlib.contextmanager
def _unreadable_answer_is_unknown(what: str) -> Iterator[None]:
    """For a request with an effect, an answer we cannot read says nothing about whether it took effect."""
    try:
        yield
    except ProtocolViolation as exc:
        raise OutcomeUnknown(
            f"{what}: the answer is unreadable ({exc}); the request may have taken effect"
        ) from exc


class McpExtTasksAdapter:
    """MCP 2026-07-28 with the ``io.modelcontextprotocol/tasks`` extension, through an injected client."""

    def __init__(self, config: AdapterConfig, http: httpx2.Client) -> None:
        if (config.protocol, config.protocol_version) != (PROTOCOL, PROTOCOL_VERSION):
            raise ValueError(
                f"{type(self).__name__} speaks {PROTOCOL} {PROTOCOL_VERSION}, not "
                f"{config.protocol} {config.protocol_version}"
            )
        self._config = config
        self._http = ExtHttp(
            http,
            config.url,
            server=config.name,
            bearer_token=config.token_provider or config.bearer_token,
            timeouts=config.timeouts,
            limits=config.limits,
        )
        self._client = http
        self._tools: tuple[float, list[Mapping[str, Any]]] | None = None
        self._lock = threading.Lock()

    # -- identity ----------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def protocol(self) -> str:
        return PROTOCOL

    @property
    def protocol_version(self) -> str:
        return PROTOCOL_VERSION

    @property
    def adapter_version(self) -> str:
        return ADAPTER_VERSION

    def _check_ref(self, remote: RemoteRef) -> None:
        # Tasks are era-bound: a 2025-11-25 task id is never sent on this wire (reference §3.1).
        if (remote.protocol, remote.protocol_version) != (PROTOCOL, PROTOCOL_VERSION):
            raise ValueError(
                f"task {remote.remote_id} was made with {remote.protocol} {remote.protocol_version}, "
                f"not {PROTOCOL} {PROTOCOL_VERSION}"
            )

    # -- capabilities ------------------------------------------------------------------------------

    def generation(self, *, budget: RequestBudget = UNMETERED) -> Generation:
        """The MCP generation the server speaks (:mod:`.discovery`), cached per server for a while."""
        return GENERATIONS.get(
            self.name,
            self._config.url,
            lambda: detect(
                self._client,
                self._config.url,
                server=self.name,
                bearer_token=self._config.token_provider or self._config.bearer_token,
                timeouts=self._config.timeouts,
                budget=budget,
            ),
        )

    def _check_generation(self, budget: RequestBudget) -> None:
        found = self.generation(budget=budget)
        if found.generation == LEGACY_VERSION:
            raise Rejected(
                f"server {self.name!r} speaks MCP {LEGACY_VERSION}, not {PROTOCOL_VERSION} ({found.detail}): "
                f'configure protocol_version = "{LEGACY_VERSION}" for it'
            )

    def _tool_list(self, budget: RequestBudget) -> list[Mapping[str, Any]]:
        with self._lock:
            cached = self._tools
        if cached is not None and time.monotonic() - cached[0] < self._config.limits.tool_list_max_age_s:
            return cached[1]
        tools: list[Mapping[str, Any]] = []
        cursor: str | None = None
        for _ in range(self._config.limits.max_pages):
            params: dict[str, Any] = {} if cursor is None else {"cursor": cursor}
            page, cursor = parse_tools_page(
                self._http.call("tools/list", params, name=None, idempotent=True, budget=budget)
            )
            tools.extend(page)
            if cursor is None:
                break
        with self._lock:
            self._tools = (time.monotonic(), tools)
        return tools

    @budget_edge
    def capabilities(self, tool: str, *, budget: RequestBudget = UNMETERED) -> ToolCapabilities:
        """The tool as ``tools/list`` describes it. The extension has no per-tool task flag: the server
        alone decides whether a call becomes a task, so ``task_support`` is ``optional``.

        Raises:
            Rejected: the server lists no such tool. Transient, RateLimited, ProtocolViolation.
        """
        self._check_generation(budget)
        descriptor = find_tool(self._tool_list(budget), tool)
        if descriptor is None:
            raise Rejected(f"server {self.name!r} lists no tool {tool!r}")
        return ToolCapabilities(
            server=self.name,
            tool=tool,
            protocol_version=PROTOCOL_VERSION,
            server_task_calls=True,
            task_support="optional",
            can_list=False,
            can_cancel=True,
            descriptor_digest=descriptor_digest(descriptor),
        )

    # -- create ------------------------------------------------------------------------------------

    @budget_edge
    def create(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        submission_key: str,
        ttl_ms: int,
        sync_upper_bound_s: float | None = None,
        budget: RequestBudget = UNMETERED,
    ) -> Created:
        """``tools/call`` with the tasks opt-in: a task (``resultType: "task"``) or, when the server
        chose to run it at once, the tool's result.

        The extension has no idempotency key and the client cannot choose a TTL: ``submission_key`` and
        ``ttl_ms`` are the ledger's only. A synchronous answer is waited for up to
        ``sync_upper_bound_s`` (the read timeout otherwise).

        Raises:
            CapabilityRefused: -32021 (the opt-in missing: a definite error, never retried), or input asked
                for before a task exists.
            Rejected: any other refusal. NoWorkDone: a 429, or never sent.
            OutcomeUnknown: the call may have created a task (a 5xx, a timeout, a cut or unreadable answer).
        """
        del submission_key
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be a positive integer, got {ttl_ms!r}")
        read_s = max(self._config.timeouts.read, sync_upper_bound_s or 0.0)
        call = f"server {self.name!r}: tools/call {tool!r}"
        with _unreadable_answer_is_unknown(call):
            result = self._http.call(
                "tools/call",
                {"name": tool, "arguments": dict(arguments)},
                name=tool,
                idempotent=False,
                budget=budget,
                read_timeout=read_s,
            )
            return parse_create_result(result, server=self.name, tool=tool)

    # -- lookup ------------------------------------------------------------------------------------

    @budget_edge
    def lookup_by_key(
        self,
        submission_key: str,
        *,
        tool: str | None = None,
        submitted_after: datetime | None = None,
        arguments: Mapping[str, Any] | None = None,
        budget: RequestBudget = UNMETERED,
    ) -> LookupResult:
        """Always unprovable: the extension has no idempotency key, no client-chosen task id and no
        ``tasks/list``, so a lost create answer can be neither found nor proved never created."""
        del tool, submitted_after, arguments, budget
        return LookupResult(
            proof="unprovable",
            ref=None,
            detail=(
                f"MCP {PROTOCOL_VERSION} tasks extension has no idempotency key and no tasks/list: server "
                f"{self.name!r} cannot be asked whether submission {submission_key} created a task"
            ),
        )

    # -- follow a task -----------------------------------------------------------------------------

    @budget_edge
    def get(
        self, remote: RemoteRef, *, read_input: bool = True, budget: RequestBudget = UNMETERED
    ) -> RemoteStatus:
        """``tasks/get``: the status, its outstanding input requests (one round) and, once terminal, the
        result or error inline (``RemoteStatus.result``).

        Raises:
            NotFound: unknown or expired (-32602). CapabilityRefused: -32021.
            Transient, RateLimited, Rejected, ProtocolViolation.
        """
        del read_input  # the input requests are part of the status itself
        self._check_ref(remote)
        result = self._http.call(
            "tasks/get", {"taskId": remote.remote_id}, name=remote.remote_id, idempotent=True, budget=budget
        )
        return parse_task(result, expected_id=remote.remote_id)

    @budget_edge
    def result(
        self, remote: RemoteRef, *, status: RemoteStatus | None = None, budget: RequestBudget = UNMETERED
    ) -> RemoteResult:
        """The final outcome, read from the terminal status already observed (no request); without one
        (or one that lacks it), one ``tasks/get``.

        Raises:
            ResultNotReady: not terminal. NotFound: unknown or expired.
            ProtocolViolation: a completed task without its result. Transient, RateLimited, Rejected.
        """
        self._check_ref(remote)
        if status is not None and status.remote_id != remote.remote_id:
            raise ValueError(f"status of {status.remote_id} given for {remote.remote_id}")
        if status is None or (status.result is None and status.terminal != "cancelled"):
            status = self.get(remote, budget=budget)
        if status.terminal is None:
            retry = status.poll_interval_ms / 1000 if status.poll_interval_ms is not None else None
            raise ResultNotReady(
                f"task {remote.remote_id} is {status.server_state}, not terminal", retry_after=retry
            )
        if status.result is not None:
            return status.result
        if status.terminal == "cancelled":
            return RemoteResult(outcome="cancelled", server_state="cancelled", payload={}, is_error=False)
        raise ProtocolViolation(
            f"server {self.name!r}: task {remote.remote_id} is {status.server_state} "
            "without its inline outcome"
        )

    @budget_edge
    def cancel(
        self, remote: RemoteRef, *, budget: RequestBudget = UNMETERED, read_status_first: bool = False
    ) -> CancelOutcome:
        """``tasks/cancel``: an acknowledgement only (cooperative; the task may still complete), so the
        outcome is ``acknowledged`` and learned by polling. -32602 (unknown task) is ``already_terminal``
        with no status: the caller reads the state.

        Raises:
            OutcomeUnknown: the request may have reached the server. Rejected, Transient, RateLimited.
        """
        self._check_ref(remote)
        if read_status_first:
            observed = self.get(remote, budget=budget)
            if observed.terminal is not None:
                return CancelOutcome(
                    kind="already_terminal", status=observed, message=observed.status_message
                )
        try:
            with _unreadable_answer_is_unknown(f"server {self.name!r}: tasks/cancel {remote.remote_id}"):
                self._http.call(
                    "tasks/cancel",
                    {"taskId": remote.remote_id},
                    name=remote.remote_id,
                    idempotent=False,
                    budget=budget,
                )
        except NotFound as exc:
            return CancelOutcome(kind="already_terminal", status=None, message=str(exc))
        return CancelOutcome(kind="acknowledged", status=None, message="tasks/cancel acknowledged")

    # -- input -------------------------------------------------------------------------------------

    @budget_edge
    def reply_input(
        self,
        remote: RemoteRef,
        request: InputRequest,
        response: Mapping[str, Any],
        *,
        budget: RequestBudget = UNMETERED,
    ) -> None:
        """``tasks/update`` with ``inputResponses``: ``response`` keyed as the round's ``inputRequests``.
        The answer is an acknowledgement; polling shows the task move on.

        Raises:
            ValueError: the reply does not answer exactly this round (nothing sent).
            NotFound: unknown task. OutcomeUnknown: it may have arrived. Rejected, Transient, RateLimited.
        """
        self._check_ref(remote)
        if request.task_id != remote.remote_id:
            raise ValueError(f"input request of task {request.task_id} answered for {remote.remote_id}")
        refusal = reply_refusal(request, response)
        if refusal is not None:
            raise ValueError(f"reply to task {remote.remote_id} refused: {refusal}")
        with _unreadable_answer_is_unknown(f"server {self.name!r}: tasks/update {remote.remote_id}"):
            self._http.call(
                "tasks/update",
                {"taskId": remote.remote_id, "inputResponses": dict(response)},
                name=remote.remote_id,
                idempotent=False,
                budget=budget,
            )

    def check_reply(self, request: InputRequest, response: Mapping[str, Any]) -> str | None:
        """Why ``response`` cannot answer the round ``request``, or None. Nothing is sent."""
        return reply_refusal(request, response)
