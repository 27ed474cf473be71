"""The AIP-151 client: :class:`AipOperationsAdapter`, the :class:`~adapters.base.ToolAdapter` verbs over
REST/JSON through an injected ``httpx2.Client``.

Every HTTP request is charged to the caller's ``budget`` once, immediately before it is sent; a refusal
leaves the verb unchanged (:mod:`adapters.metering`). Every httpx2 exception and every error answer is
mapped at this edge (:func:`adapters.aip151.wire.classify_error`); the answers are read, bounded in size
and time, by the pure functions of :mod:`adapters.aip151.wire`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

import httpx2

from adapters.aip151.transport import RestClient, decode_json, query_value
from adapters.aip151.wire import (
    ADAPTER_VERSION,
    PROTOCOL,
    PROTOCOL_VERSION,
    StatusNotFound,
    build_create,
    operation_path,
    parse_operation,
    parse_operation_page,
    route_digest,
)
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
    ToolRoute,
)
from adapters.errors import (
    AnswerTooLarge,
    CapabilityRefused,
    NotFound,
    OutcomeUnknown,
    ProtocolViolation,
    Rejected,
    ResultNotReady,
)
from adapters.metering import budget_edge

__all__ = ["DEDUPE_TRUST_S", "AipOperationsAdapter"]

#: How long after a submission its lookup may repeat the create (AIP-155: a server keeps a request id
#: "for any reasonable timeframe", unsaid). Past it, a server that forgot the id would make a second
#: operation, so the lookup says "unprovable" and an operator decides. Google's APIs keep request ids for
#: at least an hour; ten minutes is well inside that, and the fleet looks up at once after a lost answer.
DEDUPE_TRUST_S: Final = 600.0


class AipOperationsAdapter:
    """AIP-151 ``google.longrunning`` over REST/JSON. One instance per (server, worker process); holds no
    state between calls but the configuration, so any worker resumes any operation from its name."""

    def __init__(self, config: AdapterConfig, http: httpx2.Client) -> None:
        if (config.protocol, config.protocol_version) != (PROTOCOL, PROTOCOL_VERSION):
            raise ValueError(
                f"{type(self).__name__} speaks {PROTOCOL} {PROTOCOL_VERSION}, not "
                f"{config.protocol} {config.protocol_version}"
            )
        self._config = config
        self._rest = RestClient(http, config)

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

    # -- capabilities ------------------------------------------------------------------------------

    def _route(self, tool: str) -> ToolRoute:
        route = self._config.tools.get(tool)
        if route is None or route.create is None or route.request_id_field is None:
            raise CapabilityRefused(
                f"tool {tool!r} on AIP-151 server {self.name!r} has no create route (configure its create "
                f"and request_id_field): it cannot be started"
            )
        return route

    @budget_edge
    def capabilities(self, tool: str, *, budget: RequestBudget = UNMETERED) -> ToolCapabilities:
        """From the configuration alone (AIP-151 has no discovery; nothing is sent): every tool with a
        ``create`` route starts a long-running operation.

        Raises:
            CapabilityRefused: the tool has no create route.
        """
        del budget
        route = self._route(tool)
        return ToolCapabilities(
            server=self.name,
            tool=tool,
            protocol_version=PROTOCOL_VERSION,
            server_task_calls=True,
            task_support="required",
            can_list=False,
            can_cancel=True,
            descriptor_digest=route_digest(tool, route),
        )

    # -- create and lookup -------------------------------------------------------------------------

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
        """Send the tool's create call with ``submission_key`` as its AIP-155 request id. ``ttl_ms`` and
        ``sync_upper_bound_s`` have no meaning here (no TTL on the wire; every create is an operation).

        An operation already done with an empty name (validate-only) is a synchronous result.

        Raises:
            CapabilityRefused: the tool has no create route. Rejected: a definitive refusal (NOT_FOUND
                included: the parent resource is unknown, nothing was created), or arguments that do
                not fit the route (nothing sent).
            NoWorkDone: a 429 / RESOURCE_EXHAUSTED, or the request never left.
            OutcomeUnknown: anything else once it may have been sent (5xx, timeout, an unreadable answer).
        """
        del ttl_ms, sync_upper_bound_s
        status = self._create(tool, arguments, submission_key, budget)
        if status.remote_id == "":
            if status.result is None:
                raise OutcomeUnknown(
                    f"server {self.name!r}: create of {tool!r} answered an unnamed operation"
                )
            return Created(ref=None, status=None, sync_result=status.result)
        return Created(ref=self._ref(status.remote_id), status=status)

    def _create(
        self, tool: str, arguments: Mapping[str, Any], submission_key: str, budget: RequestBudget
    ) -> RemoteStatus:
        """The create call; any 404 to it is a refusal (its parent is unknown: nothing was created)."""
        try:
            return self._send_create(tool, arguments, submission_key, budget)
        except NotFound as exc:
            raise Rejected(str(exc), code=exc.code, http_status=404) from exc

    def _send_create(
        self, tool: str, arguments: Mapping[str, Any], submission_key: str, budget: RequestBudget
    ) -> RemoteStatus:
        """The create call as sent: a 404 raised as what it is (:class:`StatusNotFound` when the server
        said NOT_FOUND in a google.rpc.Status, else a plain :class:`NotFound`); an answer that cannot be
        read (over the size cap included) is :class:`OutcomeUnknown`: it may have started."""
        request = build_create(tool, self._route(tool), arguments, submission_key)
        what = f"server {self.name!r}: create {tool!r} ({request.method} {request.path})"
        query = request.method in ("GET", "DELETE")
        try:
            answer = self._rest.send(
                request.method,
                request.path,
                what=what,
                effect=True,
                budget=budget,
                json_body=None if query else request.body,
                params={k: query_value(v) for k, v in request.body.items()} if query else None,
            )
            return parse_operation(decode_json(answer.body, what), server=self.name)
        except ProtocolViolation as exc:
            raise OutcomeUnknown(f"{what}: the answer is unreadable ({exc}); it may have started") from exc

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
        """AIP-155: the create repeated with the same request id IS the lookup; the server answers the
        operation the first one made (found), or makes it now (found too: still exactly one).

        NOT_FOUND to the repeated create (its parent is gone), in the server's own words — an HTTP 404
        whose body is a google.rpc.Status NOT_FOUND (:func:`~adapters.aip151.wire.is_status_not_found`) —
        is the proof of ``never_created``. A plain 404 (a proxy's page, a wrong route: no such Status)
        proves nothing; it, any other refusal, an answer with no name or one too large to read, or a
        submission older than :data:`DEDUPE_TRUST_S` (the server may have forgotten the id and would make
        a second operation) is ``unprovable``.

        Raises:
            Transient, RateLimited, OutcomeUnknown, ProtocolViolation: nothing was learned; ask again.
        """
        if tool is None or arguments is None:
            return _unprovable(
                f"lookup of {submission_key} on {self.name!r} needs the tool and its arguments"
            )
        if submitted_after is not None:
            if submitted_after.tzinfo is None:
                submitted_after = submitted_after.replace(tzinfo=UTC)
            age = (datetime.now(UTC) - submitted_after).total_seconds()
            if age > DEDUPE_TRUST_S:
                return _unprovable(
                    f"submission {submission_key} is {age:.0f} s old, past the {DEDUPE_TRUST_S:.0f} s a "
                    f"request id is trusted to be remembered: repeating the create could make a second "
                    f"operation on {self.name!r}"
                )
        try:
            status = self._send_create(tool, arguments, submission_key, budget)
        except StatusNotFound as exc:
            return LookupResult(
                proof="never_created", ref=None, detail=f"the repeated create was NOT_FOUND: {exc}"
            )
        except NotFound as exc:
            return _unprovable(
                f"the repeated create of {submission_key} was answered a plain 404, with no "
                f"google.rpc.Status NOT_FOUND (a proxy or a wrong route?): it proves nothing: {exc}"
            )
        except Rejected as exc:
            return _unprovable(f"the repeated create of {submission_key} was refused: {exc}")
        except OutcomeUnknown as exc:
            if not isinstance(exc.__cause__, AnswerTooLarge):
                raise
            return _unprovable(
                f"the repeated create of {submission_key} answered {exc.__cause__.size_seen}, over the "
                f"transport's cap: an operation may exist, its answer cannot be read"
            )
        if status.remote_id == "":
            return _unprovable(f"the repeated create of {submission_key} answered an unnamed operation")
        return LookupResult(
            proof="found",
            ref=self._ref(status.remote_id),
            detail=f"the create repeated with request id {submission_key} answered {status.remote_id}",
        )

    # -- follow an operation -----------------------------------------------------------------------

    @budget_edge
    def get(
        self, remote: RemoteRef, *, read_input: bool = True, budget: RequestBudget = UNMETERED
    ) -> RemoteStatus:
        """``GetOperation``: ``GET {url}/v1/{name}``. A done status carries its result.

        Raises:
            NotFound: deleted, expired, or never known (the executor classifies).
            Transient, RateLimited, Rejected, ProtocolViolation.
        """
        del read_input  # no input rounds in AIP-151
        what = f"server {self.name!r}: GetOperation {remote.remote_id}"
        answer = self._rest.send(
            "GET", operation_path(remote.remote_id), what=what, effect=False, budget=budget
        )
        return parse_operation(
            decode_json(answer.body, what), server=self.name, expected_name=remote.remote_id
        )

    @budget_edge
    def result(
        self, remote: RemoteRef, *, status: RemoteStatus | None = None, budget: RequestBudget = UNMETERED
    ) -> RemoteResult:
        """The done Operation itself: from ``status`` when it carries it (no request), else read once.

        Raises:
            ResultNotReady: not done. NotFound, Transient, RateLimited, Rejected, ProtocolViolation.
        """
        if status is None or status.result is None:
            status = self.get(remote, read_input=False, budget=budget)
        if status.remote_id != remote.remote_id:
            raise ValueError(f"status of {status.remote_id} given for {remote.remote_id}")
        if status.result is None:
            raise ResultNotReady(f"operation {remote.remote_id} is not done")
        return status.result

    @budget_edge
    def cancel(
        self, remote: RemoteRef, *, budget: RequestBudget = UNMETERED, read_status_first: bool = False
    ) -> CancelOutcome:
        """``CancelOperation``: ``POST {url}/v1/{name}:cancel``. Its ``Empty`` confirms nothing
        (``acknowledged``: the outcome is polled for; a completion may still win). FAILED_PRECONDITION is
        ``already_terminal``; a silent ``Empty`` for a done operation is an acknowledgement like any other.

        Raises:
            Rejected: UNIMPLEMENTED and other refusals (the outcome comes from polling). NotFound.
            OutcomeUnknown (an unreadable answer included), Transient, RateLimited (a 429),
            ProtocolViolation (the status read first).
        """
        if read_status_first:
            observed = self.get(remote, read_input=False, budget=budget)
            if observed.terminal is not None:
                return CancelOutcome(
                    kind="already_terminal", status=observed, message=observed.status_message
                )
        what = f"server {self.name!r}: CancelOperation {remote.remote_id}"
        try:
            self._rest.send(
                "POST",
                operation_path(remote.remote_id) + ":cancel",
                what=what,
                effect=True,
                budget=budget,
                json_body={},
            )
        except Rejected as exc:
            if exc.code == 9:  # FAILED_PRECONDITION: done already
                return CancelOutcome(kind="already_terminal", status=None, message=str(exc))
            raise
        except ProtocolViolation as exc:
            # An answer we cannot read (one over the size cap included) says nothing of whether it landed.
            raise OutcomeUnknown(f"{what}: the answer is unreadable ({exc}); it may have landed") from exc
        return CancelOutcome(kind="acknowledged", status=None, message=None)

    @budget_edge
    def list_operations(
        self, collection: str, *, page_size: int | None = None, budget: RequestBudget = UNMETERED
    ) -> list[RemoteStatus]:
        """``ListOperations``: every page of ``GET {url}/v1/{collection}`` (e.g.
        ``projects/p/operations``), at most ``limits.max_pages`` pages, one request each.

        Raises:
            ProtocolViolation: more pages than ``max_pages``, or a malformed page. NotFound, Rejected
                (UNIMPLEMENTED: the server lists nothing), Transient, RateLimited.
        """
        path = operation_path(collection)
        found: list[RemoteStatus] = []
        token: str | None = None
        for _ in range(self._config.limits.max_pages):
            params: dict[str, str] = {}
            if page_size is not None:
                params["pageSize"] = str(page_size)
            if token is not None:
                params["pageToken"] = token
            what = f"server {self.name!r}: ListOperations {collection}"
            answer = self._rest.send(
                "GET", path, what=what, effect=False, budget=budget, params=params or None
            )
            page, token = parse_operation_page(decode_json(answer.body, what), server=self.name)
            found.extend(page)
            if token is None:
                return found
        raise ProtocolViolation(f"server {self.name!r}: ListOperations {collection} has over max_pages pages")

    # -- no input rounds in AIP-151 ------------------------------------------------------------------

    @budget_edge
    def reply_input(
        self,
        remote: RemoteRef,
        request: InputRequest,
        response: Mapping[str, Any],
        *,
        budget: RequestBudget = UNMETERED,
    ) -> None:
        """Refused: a long-running operation cannot ask its caller anything (nothing is sent).

        Raises:
            CapabilityRefused: always.
        """
        del request, response, budget
        raise CapabilityRefused(f"AIP-151 has no input rounds: nothing to reply to for {remote.remote_id}")

    def check_reply(self, request: InputRequest, response: Mapping[str, Any]) -> str | None:
        del request, response
        return "AIP-151 has no input rounds: an operation never asks for input"

    # -- HTTP ----------------------------------------------------------------------------------------

    def _ref(self, name: str) -> RemoteRef:
        return RemoteRef(
            remote_id=name, session_ref=None, protocol_version=PROTOCOL_VERSION, protocol=PROTOCOL
        )


def _unprovable(detail: str) -> LookupResult:
    return LookupResult(proof="unprovable", ref=None, detail=detail)
