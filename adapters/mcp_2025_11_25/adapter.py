"""The MCP 2025-11-25 client: :class:`McpTasksAdapter`, the :class:`~adapters.base.ToolAdapter` verbs.

It sends requests through :class:`adapters.streamable_http.StreamableHttpClient`, keeps its session
with :class:`~adapters.mcp_2025_11_25.session.ServerSession`, sends the requests about an existing
task with :class:`~adapters.mcp_2025_11_25.task_requests.TaskRequests`, and reads every answer with
the pure functions of :mod:`adapters.mcp_2025_11_25.wire`.

Each verb takes a ``budget`` (DESIGN rule 4), charged immediately before every HTTP request the verb
sends, handshake and re-reads included; a refusal leaves the verb unchanged (:mod:`adapters.metering`).
Where leaving would hide that a request with an effect went out, the verb answers for it instead: the
refusal of a server's question during a synchronous call is simply not sent (the call ends at its bound,
as when that refusal fails), and a stream of ``tools/call`` or ``tasks/cancel`` whose resumption is
refused is :class:`~adapters.errors.OutcomeUnknown`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import replace
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
from adapters.errors import (
    AdapterError,
    CapabilityRefused,
    NotFound,
    NotSent,
    NoWorkDone,
    OutcomeUnknown,
    ProtocolViolation,
    Rejected,
    ResultNotReady,
    Transient,
)
from adapters.http_answers import Exchange, Session, SessionGone
from adapters.jsonrpc import ErrorResponse, Request, Response
from adapters.mcp_2025_11_25.session import ServerSession, stored_session
from adapters.mcp_2025_11_25.task_requests import TaskRequests
from adapters.mcp_2025_11_25.wire import (
    ADAPTER_VERSION,
    INVALID_PARAMS,
    NO_INPUT_DURING_SYNC_CALL,
    PROTOCOL,
    PROTOCOL_VERSION,
    ServerFacts,
    TaskPage,
    descriptor_digest,
    find_tool,
    input_reply,
    parse_create_result,
    parse_task,
    reply_refusal,
    result_from_error,
    result_from_payload,
    result_of,
    rpc_error,
    strip_related_task,
    tool_task_support,
)
from adapters.metering import Refused, budget_edge
from adapters.streamable_http import StreamableHttpClient

__all__ = ["McpTasksAdapter"]


@contextlib.contextmanager
def _unreadable_answer_is_unknown(what: str) -> Iterator[None]:
    """For a request with an effect, an answer we cannot read says nothing about whether the effect
    happened: a protocol violation there is an unknown outcome, never a refusal to retry around."""
    try:
        yield
    except ProtocolViolation as exc:
        raise OutcomeUnknown(
            f"{what}: the answer is unreadable ({exc}); the request may have taken effect"
        ) from exc


@contextlib.contextmanager
def _not_sent_yet(what: str) -> Iterator[None]:
    """Around what a request with an effect needs before it is sent (the handshake, the tool list): a
    failure there is a fact about the request too — it never left, so the server did no work for it
    (:class:`NotSent`, the one failure besides a 429 after which a create is simply made again). A
    definitive refusal stays one."""
    try:
        yield
    except (NoWorkDone, Rejected):
        raise
    except AdapterError as exc:
        raise NotSent(
            f"{what} not sent: {type(exc).__name__}: {exc}", retry_after=getattr(exc, "retry_after", None)
        ) from exc


class McpTasksAdapter:
    """MCP 2025-11-25 over Streamable HTTP, through an injected ``httpx2.Client``.

    One instance per (server, worker process). It initializes a session lazily for ``capabilities``
    and ``create``; ``get``/``result``/``cancel``/``reply_input`` use the session stored in the
    :class:`RemoteRef` as-is, so any worker can resume any operation without re-initializing.
    """

    def __init__(self, config: AdapterConfig, http: httpx2.Client) -> None:
        if (config.protocol, config.protocol_version) != (PROTOCOL, PROTOCOL_VERSION):
            raise ValueError(
                f"{type(self).__name__} speaks {PROTOCOL} {PROTOCOL_VERSION}, not "
                f"{config.protocol} {config.protocol_version}"
            )
        self._config = config
        self._client = StreamableHttpClient(
            http,
            config.url,
            bearer_token=config.token_provider or config.bearer_token,
            timeouts=config.timeouts,
            limits=config.limits,
        )
        self._session = ServerSession(self._client, server=config.name, limits=config.limits)
        self._tasks = TaskRequests(
            self._client, self._session, server=config.name, timeouts=config.timeouts, limits=config.limits
        )

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

    @property
    def session_ref(self) -> str | None:
        """The current session's id (None when stateless or not initialized yet)."""
        return self._session.current_id

    @budget_edge
    def server_facts(self, *, budget: RequestBudget = UNMETERED) -> ServerFacts:
        """Initialize if needed; return what the server declared."""
        return self._session.facts(budget=budget)

    def _result_of(self, method: str, exchange: Exchange, *, tool: str | None = None) -> Mapping[str, Any]:
        return result_of(method, exchange.response, server=self.name, tool=tool)

    # -- capabilities ------------------------------------------------------------------------------

    @budget_edge
    def capabilities(self, tool: str, *, budget: RequestBudget = UNMETERED) -> ToolCapabilities:
        """Negotiate for one tool: the server's ``tasks.requests.tools.call`` and the tool's taskSupport.

        Raises:
            Rejected: the server does not list the tool, or negotiated another protocol version.
            Transient, RateLimited, ProtocolViolation, OutcomeUnknown: transport failures.
        """
        try:
            facts = self._session.facts(budget=budget)
            descriptor = find_tool(self._session.tools(budget=budget), tool)
        except SessionGone:
            self._session.gone(self._session.known, budget=budget)
            facts = self._session.facts(budget=budget)
            descriptor = find_tool(self._session.tools(budget=budget), tool)
        if descriptor is None:
            raise Rejected(f"server {self.name!r} lists no tool {tool!r}")
        return ToolCapabilities(
            server=self.name,
            tool=tool,
            protocol_version=facts.protocol_version,
            server_task_calls=facts.task_tool_calls,
            task_support=tool_task_support(descriptor),
            can_list=facts.can_list,
            can_cancel=facts.can_cancel,
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
        """Start the tool call: as a task when the server and tool declare it, else synchronously when
        ``sync_upper_bound_s`` allows, else refuse.

        MCP 2025-11-25 has no idempotency key: ``submission_key`` is not sent, and a lost answer is
        :class:`OutcomeUnknown` (never retried here).

        Raises:
            CapabilityRefused: no task support and no synchronous bound (or a required-task tool on a
                server without tasks).
            WrongTaskMode: the server refused the call's task mode (-32601/-32600).
            Rejected: any other definitive refusal.
            OutcomeUnknown: the request may have started the tool (anything but a 429 once it was sent:
                a 503, a 408, any 5xx, a timeout, a cut or unreadable answer).
            NoWorkDone: the server did no work for it: a 429 (:class:`TooManyRequests`), or the
                ``tools/call`` was never sent (:class:`NotSent`, its handshake or tool list included).
        """
        del submission_key  # no key in this protocol version; kept by the ledger only
        if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be a positive integer, got {ttl_ms!r}")
        call = f"server {self.name!r}: tools/call {tool!r}"
        with _not_sent_yet(call):
            caps = self.capabilities(tool, budget=budget)
        if caps.use_task:
            params = {"name": tool, "arguments": dict(arguments), "task": {"ttl": ttl_ms}}
            with _not_sent_yet(call):
                session = self._session.current(budget=budget)
            with _unreadable_answer_is_unknown(call):
                try:
                    exchange = self._client.request(
                        "tools/call", params, session=session, idempotent=False, budget=budget
                    )
                except SessionGone:
                    # 404 before dispatch: the call never ran, so sending it again on a new session is safe.
                    with _not_sent_yet(call):
                        self._session.gone(session, budget=budget)
                        session = self._session.current(budget=budget)
                    exchange = self._client.request(
                        "tools/call", params, session=session, idempotent=False, budget=budget
                    )
                return parse_create_result(
                    self._result_of("tools/call", exchange, tool=tool), session=session
                )
        if caps.task_support == "required":
            raise CapabilityRefused(
                f"tool {tool!r} on server {self.name!r} requires a task, but the server declares no "
                f"task-augmented tools/call"
            )
        if sync_upper_bound_s is None:
            why = (
                "the server declares no task-augmented tools/call"
                if not caps.server_task_calls
                else "the tool declares no task support"
            )
            raise CapabilityRefused(
                f"tool {tool!r} on server {self.name!r} cannot run as a task ({why}) and no synchronous "
                f"upper bound is configured for it"
            )
        return self._call_sync(tool, arguments, sync_upper_bound_s, budget)

    def _call_sync(
        self, tool: str, arguments: Mapping[str, Any], bound_s: float, budget: RequestBudget
    ) -> Created:
        params = {"name": tool, "arguments": dict(arguments)}
        call = f"server {self.name!r}: tools/call {tool!r}"
        with _not_sent_yet(call):
            session = self._session.current(budget=budget)

        def send(on: Session) -> Exchange:
            return self._client.request(
                "tools/call",
                params,
                session=on,
                idempotent=False,
                read_timeout=bound_s,
                on_request=lambda request: self._refuse_during_sync_call(on, request, tool, budget),
                budget=budget,
            )

        with _unreadable_answer_is_unknown(f"server {self.name!r}: tools/call {tool!r}"):
            try:
                exchange = send(session)
            except SessionGone:
                with _not_sent_yet(call):
                    self._session.gone(session, budget=budget)
                    session = self._session.current(budget=budget)
                exchange = send(session)
            result = self._result_of("tools/call", exchange, tool=tool)
            if "task" in result:
                raise ProtocolViolation(f"server {self.name!r} made a task of a call sent without one")
            return Created(
                ref=None,
                status=None,
                sync_result=result_from_payload(dict(result), server_state=None, status_message=None),
            )

    def _refuse_during_sync_call(
        self, session: Session, request: Request, tool: str, budget: RequestBudget
    ) -> None:
        """A synchronous call has no durable operation to park a question on: refuse the server's request
        (as an SDK client without that capability does) rather than answer for a human or hang."""
        refusal = {
            "jsonrpc": "2.0",
            "id": request.id,
            "error": {
                "code": NO_INPUT_DURING_SYNC_CALL,
                "message": f"longcall cannot answer {request.method} during the synchronous call of "
                f"{tool!r}; run the tool as a task to get input",
            },
        }
        # Unanswered, the call still ends at its synchronous bound. A refused charge is not passed on
        # either: the tools/call went out, and leaving now would hide that it may have run.
        with contextlib.suppress(AdapterError, Refused):
            self._client.post_message(
                refusal, session=session, what=f"refusal of {request.method}", budget=budget
            )

    # -- lookup ------------------------------------------------------------------------------------

    @budget_edge
    def lookup_by_key(
        self,
        submission_key: str,
        *,
        tool: str | None = None,
        submitted_after: datetime | None = None,
        arguments: Mapping[str, Any] | None = None,
        session_ref: str | None = None,
        budget: RequestBudget = UNMETERED,
    ) -> LookupResult:
        """MCP 2025-11-25 has no idempotency key and no client-chosen task id, so nothing can prove that
        a submission was never created. When the server lists tasks, tasks created after
        ``submitted_after`` are returned as candidates for an operator, never as proof.
        """
        detail = (
            f"MCP {PROTOCOL_VERSION} has no idempotency key: server {self.name!r} cannot be asked whether "
            f"submission {submission_key} created a task"
        )
        candidates: tuple[RemoteStatus, ...] = ()
        if submitted_after is not None:
            try:
                facts = self._session.facts(budget=budget)
                if facts.can_list:
                    candidates = tuple(
                        status
                        for status in self._tasks.list_all(session_ref=session_ref, budget=budget)
                        if status.created_at is None
                        or status.created_at.tzinfo is None
                        or status.created_at >= submitted_after
                    )
            except AdapterError as exc:
                detail += f"; listing candidates failed: {exc}"
        del tool, arguments  # no key to repeat a create with: the arguments prove nothing here
        return LookupResult(proof="unprovable", ref=None, detail=detail, candidates=candidates)

    @budget_edge
    def list_tasks(
        self, cursor: str | None = None, *, session_ref: str | None = None, budget: RequestBudget = UNMETERED
    ) -> TaskPage:
        """One ``tasks/list`` page (see :meth:`TaskRequests.list_page`)."""
        return self._tasks.list_page(cursor, session_ref=session_ref, budget=budget)

    @budget_edge
    def list_tasks_all(
        self, *, session_ref: str | None = None, budget: RequestBudget = UNMETERED
    ) -> list[RemoteStatus]:
        """Every ``tasks/list`` page (see :meth:`TaskRequests.list_all`)."""
        return self._tasks.list_all(session_ref=session_ref, budget=budget)

    # -- follow a task -----------------------------------------------------------------------------

    @budget_edge
    def get(
        self, remote: RemoteRef, *, read_input: bool = True, budget: RequestBudget = UNMETERED
    ) -> RemoteStatus:
        """Poll the task (``tasks/get``). On ``input_required`` (and ``read_input``), also read the
        server's input request from the ``tasks/result`` stream, waiting at most ``timeouts.input_wait``;
        the status says ``awaiting_input`` while that request is not in it.

        Raises:
            NotFound: unknown, expired, or its session is gone (-32602 / HTTP 404).
            Transient, RateLimited, Rejected, ProtocolViolation.
        """
        exchange = self._tasks.send("tasks/get", remote, idempotent=True, budget=budget)
        status = parse_task(self._result_of("tasks/get", exchange), expected_id=remote.remote_id)
        if status.awaiting_input and read_input:
            try:
                request = self.read_input_request(
                    remote, json_first=exchange.content_type == "application/json", budget=budget
                )
            except Transient:
                # The status itself was read; the input request is read again on the next poll.
                request = None
            if request is not None:
                status = replace(status, input_request=request, awaiting_input=False)
        return status

    @budget_edge
    def read_input_request(
        self, remote: RemoteRef, *, json_first: bool = False, budget: RequestBudget = UNMETERED
    ) -> InputRequest | None:
        """Read the server's pending input request for this task; None when none arrives in time
        (see :meth:`TaskRequests.read_input`)."""
        return self._tasks.read_input(remote, json_first=json_first, budget=budget)

    @budget_edge
    def result(
        self, remote: RemoteRef, *, status: RemoteStatus | None = None, budget: RequestBudget = UNMETERED
    ) -> RemoteResult:
        """Fetch the final result of a terminal task (``tasks/result``), verified to be this task's.

        ``status`` is the terminal status already observed; without it the adapter polls once first.

        Raises:
            ResultNotReady: the task is not terminal (``tasks/result`` would block).
            NotFound: unknown or expired. ProtocolViolation: another task's result, or malformed.
            Transient, RateLimited, Rejected.
        """
        if status is None:
            status = self.get(remote, read_input=False, budget=budget)
        if status.remote_id != remote.remote_id:
            raise ValueError(f"status of {status.remote_id} given for {remote.remote_id}")
        if status.terminal is None:
            retry = status.poll_interval_ms / 1000 if status.poll_interval_ms is not None else None
            raise ResultNotReady(
                f"task {remote.remote_id} is {status.server_state}, not terminal", retry_after=retry
            )
        exchange = self._tasks.send("tasks/result", remote, idempotent=True, budget=budget)
        response = exchange.response
        if isinstance(response, ErrorResponse):
            # A cancelled task has no defined result: servers answer an empty result, -32603 or -32602.
            # For a failed task, -32602 may be the call's own invalid-params error rather than "task
            # unknown": the task still being there tells them apart.
            if (
                response.code == INVALID_PARAMS
                and status.terminal != "cancelled"
                and (status.terminal != "failed" or not self._still_there(remote, budget))
            ):
                raise rpc_error("tasks/result", response, server=self.name)
            return result_from_error(response, server_state=status.server_state)
        if not isinstance(response, Response):
            raise ProtocolViolation(f"server {self.name!r}: tasks/result answered nothing")
        payload, verified = strip_related_task(response.result, task_id=remote.remote_id)
        outcome = result_from_payload(
            payload, server_state=status.server_state, status_message=status.status_message
        )
        return replace(outcome, task_verified=verified)

    def _still_there(self, remote: RemoteRef, budget: RequestBudget) -> bool:
        try:
            self.get(remote, read_input=False, budget=budget)
        except NotFound:
            return False
        return True

    @budget_edge
    def cancel(
        self, remote: RemoteRef, *, budget: RequestBudget = UNMETERED, read_status_first: bool = False
    ) -> CancelOutcome:
        """Ask the server to cancel (``tasks/cancel``). With ``read_status_first``, one ``tasks/get`` first
        skips the request when the task is terminal already (for a server that answers "cancelled" to a
        cancel of a completed task); both requests are charged to ``budget``.

        A success answer is the evidence of the cancelled terminal state. ``-32602`` means already
        terminal (or gone): the outcome says so and the caller reads the state with ``get``.

        Raises:
            OutcomeUnknown: the request may have cancelled the task; read the state with ``get``.
            NotFound: the session is gone. Rejected: the server does not implement tasks/cancel.
            Transient, RateLimited, ProtocolViolation.
        """
        if read_status_first:
            observed = self.get(remote, read_input=False, budget=budget)
            if observed.terminal is not None:
                # Already terminal: never send a cancel a lenient server might answer with "cancelled".
                return CancelOutcome(
                    kind="already_terminal", status=observed, message=observed.status_message
                )
        with _unreadable_answer_is_unknown(f"server {self.name!r}: tasks/cancel {remote.remote_id}"):
            exchange = self._tasks.send("tasks/cancel", remote, idempotent=False, budget=budget)
            response = exchange.response
            if isinstance(response, ErrorResponse) and response.code == INVALID_PARAMS:
                return CancelOutcome(kind="already_terminal", status=None, message=response.message)
            status = parse_task(self._result_of("tasks/cancel", exchange), expected_id=remote.remote_id)
        if status.server_state == "cancelled":
            return CancelOutcome(kind="cancelled", status=status, message=status.status_message)
        return CancelOutcome(kind="already_terminal", status=status, message=status.status_message)

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
        """Answer the server's input request with a separate POST (202 = accepted, nothing more).

        Raises:
            NotFound: the session is gone. OutcomeUnknown: the reply may or may not have arrived.
            Rejected, Transient, RateLimited.
        """
        if request.task_id != remote.remote_id:
            raise ValueError(f"input request of task {request.task_id} answered for {remote.remote_id}")
        session = stored_session(remote)
        what = f"reply to {request.method} for {remote.remote_id}"
        with self._session.ended_is_not_found(session, what, budget=budget):
            self._client.post_message(
                input_reply(request, response), session=session, what=request.method, budget=budget
            )

    def check_reply(self, request: InputRequest, response: Mapping[str, Any]) -> str | None:
        """Why ``response`` cannot answer ``request`` (an elicitation reply with another action, or
        content that does not match the requested schema), or None. Nothing is sent."""
        return reply_refusal(request, response)
