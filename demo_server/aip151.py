"""longcall's own AIP-151 server: google.longrunning operations over REST/JSON, done the way the AIPs say.

Run: ``python -m demo_server.aip151 --host 127.0.0.1 --port 8151`` (plain ASGI under uvicorn, as
``demo_server.mcp``). The facts it follows are in reference/aip-151.md (AIP-151, 155, 193, operations.proto):

* ``POST /v1/projects/{project}/reports:run`` with ``{"seconds": S, "outcome"?: "response" | "error" |
  "empty" | "none", "requestId"?: "<up to 36 ASCII chars>"}`` starts a report and answers its Operation
  ``{"name": "projects/{project}/operations/{id}", "metadata": {"@type": ...ReportMetadata, state,
  progressPercent, createTime, cancelRequested, endTime?}}``: running (``done`` left out, proto3 JSON) or
  already done when S is 0 (AIP-133 allows it). When done: outcome "response" -> ``response`` is an Any
  ``{"@type": ...Report, name, seconds, rows}``; "error" -> ``error`` ``{code: 13, message, details:
  [ErrorInfo]}``; "empty" -> ``response`` is ``google.protobuf.Empty``; "none" -> neither (legal now).
  The same requestId again returns the same operation (AIP-155), with a different body too (the earlier
  response; switch ``request_id_conflict: "already_exists"`` for 409), and after the operation is gone the
  last Operation JSON it had.
* ``GET /v1/{name}`` GetOperation; ``GET /v1/projects/{project}/operations?pageSize=&pageToken=``
  ListOperations (oldest first, opaque ``nextPageToken``; a bad token or size is INVALID_ARGUMENT);
  ``POST /v1/{name}:cancel`` (empty body or a JSON object) answers ``{}``: a running operation becomes
  done with ``error {code: 1}`` (CANCELLED) and is kept; for a done one see ``cancel_of_done``;
  ``DELETE /v1/{name}`` answers ``{}`` and forgets the operation without cancelling it. An unknown,
  deleted or expired name is 404 NOT_FOUND.
* Errors are google.rpc.Status with an ErrorInfo (and RetryInfo for 429/503, with a ``Retry-After``
  header): AIP-193 ``{"error": {code: HTTP, status, message, details}}`` by default, grpc-gateway's bare
  ``{code: gRPC, message, details}`` with ``envelope: "grpc_gateway"``.

Control endpoints (test harness only, same port):

* ``GET /_control/log`` -> ``{"entries": [{"t": time.time(), "method", "path", "rpc", "status",
  "inside_retry_after", "request_id"}]}``: every request to ``/v1`` in arrival order (``status`` null when
  the connection was dropped; ``inside_retry_after``: it came while a Retry-After the server had given
  was still running). ``DELETE`` clears it.
* ``GET /_control/operations`` -> ``{"operations": [every operation's JSON, with "requestId" and
  "request"], "expired": [names], "deleted": [names]}``.
* ``GET /_control/faults`` shows the switches; ``POST`` a JSON object sets the named ones (others stay);
  ``DELETE`` resets them (the ``--expire-after-done-s``/``--envelope``/``--cancel-of-done`` start values
  included). The switches (``demo_server.aip151_model.FaultSwitches``):

  - ``envelope``: "aip193" | "grpc_gateway"; ``cancel_of_done``: "failed_precondition" (400) | "empty"
    (a silent ``{}``) | "unimplemented" (501); ``expire_after_done_s``: seconds (null: never).
  - ``lose_create_response: N`` — RunReport creates the operation, then the connection is closed unanswered.
  - ``status_after_create: {"count": N, "status": "UNAVAILABLE"}`` — creates it, then answers that error.
  - ``status_429`` / ``status_503: {"<Rpc>" | "*": {"count": N, "retry_after_s": S}}`` — the next N
    requests are refused with RetryInfo ``S s`` and ``Retry-After: S``; nothing is done.
  - ``rate_limit_window: {"rpc": "*", "seconds": W, "retry_after_s": S | null, "start_in_s": D}`` — every
    matching request from D s after the switch is set, for W s, gets 429 (Retry-After: S, or the window's
    time left rounded up); ``opens_at`` (time.time()) shows when it opens.
  - ``delay_ms: {"<Rpc>": ms}`` — requests of that RPC wait before they are handled.
  - ``go_empty`` (outcome "empty" written the Go way, ``"value": {}``), ``go_empty_response`` (every
    response is the Go-style Empty), ``unknown_type_response`` (an Any of an unknown ``@type``),
    ``emit_default_done`` (``"done": false`` on running operations), ``well_known_types`` (metadata and
    response as ``google.protobuf.Struct`` Any values, which a protobuf client can parse).
  - ``cancel_takes_ms: M`` — a cancel lands M ms after its answer; ``complete_on_cancel: N`` — the next N
    cancels are answered ``{}`` but the operation completes with its own outcome (completion wins).
  - ``ignore_request_id`` — no dedupe: a repeated create makes a second operation;
    ``request_id_window_s: W`` — a requestId is honoured for W s after its first create, then forgotten;
    ``request_id_conflict: "already_exists"`` — the same id with another body is 409 ALREADY_EXISTS.
  - ``missing_projects: ["p"]`` — RunReport under those projects is 404 NOT_FOUND, nothing is created.
  - ``plain_404_create: {"count": N, "after": K}`` — after K more RunReport handled as usual, the next N
    are answered a plain-text 404 with no google.rpc.Status (a proxy or a wrong route); nothing is created.
  - ``refuse: {"<Rpc>" | "*": {"count": N, "status": "PERMISSION_DENIED"}}`` — the next N requests are
    refused with that status (no RetryInfo, no Retry-After); nothing is done.
  - ``response_padding_bytes: B`` — every done Report response carries a ``padding`` string of B bytes.
  - ``malformed_response: true`` — every done Report response is a JSON string, not an Any object.

RPC names (log and switches): RunReport, GetOperation, ListOperations, CancelOperation, DeleteOperation.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import re
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from demo_server import control, serve
from demo_server._asgi import Receive, Scope, Send, drop_connection, dumps, lifespan, read_body, respond
from demo_server.aip151_model import (
    ApiError,
    CancelOfDone,
    Envelope,
    FaultSwitches,
    Operation,
    OperationStore,
    not_found,
)
from demo_server.aip151_requests import json_object, page_token, parse_page, parse_run

PROJECT = r"[a-z][a-z0-9-]{0,62}"
RUN_PATH = re.compile(rf"/v1/projects/(?P<project>{PROJECT})/reports:run")
LIST_PATH = re.compile(rf"/v1/projects/(?P<project>{PROJECT})/operations")
#: What ``plain_404_create`` answers: a proxy's (or a router's) own page, no google.rpc.Status.
PLAIN_404 = b"404 page not found\n"
OP_PATH = re.compile(rf"/v1/(?P<name>projects/{PROJECT}/operations/[A-Za-z0-9_-]+)(?P<verb>:cancel)?")


@dataclass(frozen=True)
class Defaults:
    """The start values of the switches a command line can set (``DELETE /_control/faults`` restores them)."""

    envelope: Envelope = "aip193"
    cancel_of_done: CancelOfDone = "failed_precondition"
    expire_after_done_s: float | None = None
    page_size: int = 50


Answer = tuple[int, dict[str, Any]]


@dataclass(frozen=True)
class Call:
    """One API request as a handler sees it: ``now`` is the monotonic time it is handled at, ``entry``
    its log entry, ``send`` the ASGI send (to drop the connection)."""

    scope: Scope
    body: bytes
    now: float
    entry: dict[str, Any]
    send: Send


#: A handler returns (HTTP status, JSON body) or raises ApiError.
Handler = Callable[[Call], Awaitable[Answer]]


class Dropped(Exception):
    """The connection was closed with no answer (a fault switch)."""


class AipDemoServer:
    def __init__(self, defaults: Defaults | None = None) -> None:
        self.defaults = defaults or Defaults()
        self.switches = self._fresh_switches()
        self.store = OperationStore()
        self.log: deque[dict[str, Any]] = deque(maxlen=100_000)
        #: Until this monotonic time the server has asked its clients to wait (a Retry-After it gave).
        self.wait_until = 0.0
        self.control = control.Control(
            {
                **control.switch_endpoints(self._show_switches, self._set_switches, self._reset_switches),
                **control.log_endpoints("log", lambda: self.log, self._clear_log),
                ("operations", "GET"): self._operations,
                ("operations", "DELETE"): self._forget_operations,
            }
        )

    def _fresh_switches(self) -> FaultSwitches:
        return FaultSwitches(
            envelope=self.defaults.envelope,
            cancel_of_done=self.defaults.cancel_of_done,
            expire_after_done_s=self.defaults.expire_after_done_s,
        )

    # ---- ASGI entry -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if path.startswith(control.PREFIX):
            await self.control.answer(path, scope["method"], receive, send)
        else:
            await self._api(scope, receive, send)

    async def _api(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        path: str = scope["path"]
        entry: dict[str, Any] = {
            "t": time.time(),
            "method": method,
            "path": path,
            "rpc": None,
            "status": None,
            "inside_retry_after": time.monotonic() < self.wait_until,
            "request_id": None,
        }
        self.log.append(entry)
        try:
            rpc, handler = self._route(method, path)
            entry["rpc"] = rpc
            delay_ms = self.switches.delay_ms.get(rpc, 0)
            if delay_ms:
                await asyncio.sleep(delay_ms / 1000)
            body = await read_body(receive)
            if body is None:
                return  # the client went away
            plain = self.switches.plain_404_create
            if rpc == "RunReport" and plain is not None and plain.take():
                # A proxy or a wrong route: no google.rpc.Status, and the server never saw the request.
                entry["status"] = 404
                await respond(send, 404, PLAIN_404, content_type="text/plain; charset=utf-8")
                return
            self._refuse_if_switched(rpc)
            now = time.monotonic()
            self.store.sweep(now, self.switches)
            status, answer = await handler(Call(scope, body, now, entry, send))
        except Dropped:
            return
        except ApiError as error:
            if error.retry_after_s is not None:
                self.wait_until = max(self.wait_until, time.monotonic() + error.retry_after_s)
            entry["status"] = error.http_status
            await respond(
                send, error.http_status, dumps(error.body(self.switches.envelope)), headers=error.headers()
            )
            return
        entry["status"] = status
        await respond(send, status, dumps(answer))

    def _route(self, method: str, path: str) -> tuple[str, Handler]:
        """The RPC a request is, and its handler bound to the path's project or operation name."""
        if (match := RUN_PATH.fullmatch(path)) is not None and method == "POST":
            return "RunReport", functools.partial(self._run, match["project"])
        if (match := LIST_PATH.fullmatch(path)) is not None and method == "GET":
            return "ListOperations", functools.partial(self._list, match["project"])
        if (match := OP_PATH.fullmatch(path)) is not None:
            name, verb = match["name"], match["verb"]
            if verb and method == "POST":
                return "CancelOperation", functools.partial(self._cancel, name)
            if not verb and method == "GET":
                return "GetOperation", functools.partial(self._get, name)
            if not verb and method == "DELETE":
                return "DeleteOperation", functools.partial(self._delete, name)
        raise ApiError("NOT_FOUND", f"No route {method} {path}", reason="NO_SUCH_METHOD")

    def _refuse_if_switched(self, rpc: str) -> None:
        window = self.switches.rate_limit_window
        if window is not None and window.rpc in ("*", rpc):
            left = window.left_s(time.time())
            if left is not None:
                retry = window.retry_after_s if window.retry_after_s is not None else math.ceil(left)
                raise ApiError(
                    "RESOURCE_EXHAUSTED",
                    "Rate limited (window)",
                    reason="RATE_LIMIT_EXCEEDED",
                    retry_after_s=retry,
                )
        for key in (rpc, "*"):
            refusal = self.switches.refuse.get(key)
            if refusal is not None and refusal.count > 0:
                refusal.count -= 1
                raise ApiError(refusal.status, f"{rpc} refused: {refusal.status}", reason="REFUSED_BY_SWITCH")
        for status, table in (
            ("RESOURCE_EXHAUSTED", self.switches.status_429),
            ("UNAVAILABLE", self.switches.status_503),
        ):
            for key in (rpc, "*"):
                fault = table.get(key)
                if fault is not None and fault.count > 0:
                    fault.count -= 1
                    reason = (
                        "RATE_LIMIT_EXCEEDED" if status == "RESOURCE_EXHAUSTED" else "SERVICE_UNAVAILABLE"
                    )
                    raise ApiError(
                        status, f"{rpc} refused: {status}", reason=reason, retry_after_s=fault.retry_after_s
                    )

    # ---- the Operations service and the report method -----------------------------------------------

    async def _run(self, project: str, call: Call) -> Answer:
        run = parse_run(call.body)
        request, request_id = run.body, run.request_id
        call.entry["request_id"] = request_id
        if project in self.switches.missing_projects:
            raise ApiError(
                "NOT_FOUND",
                f"Project {project} not found",
                reason="PROJECT_NOT_FOUND",
                metadata={"project": project},
            )
        window_s = self.switches.request_id_window_s
        if request_id is not None and not self.switches.ignore_request_id:
            seen = self.store.request_ids.get(request_id)
            if seen is not None and (window_s is None or call.now - seen[2] < window_s):
                earlier_body, name, _ = seen
                if earlier_body != request and self.switches.request_id_conflict == "already_exists":
                    raise ApiError(
                        "ALREADY_EXISTS",
                        f"requestId {request_id} was used with a different request",
                        reason="REQUEST_ID_REUSED",
                        metadata={"operation": name},
                    )
                return 200, self._answer_for(name, call.now)
        op = Operation(
            name=f"projects/{project}/operations/{uuid.uuid4().hex}",
            project=project,
            seconds=run.seconds,
            outcome=run.outcome,
            request_id=request_id,
            request=request,
            created=call.now,
        )
        self.store.operations[op.name] = op
        if request_id is not None:
            self.store.remember_request(request_id, request, op.name, call.now)
        if self.switches.lose_create_response > 0:
            self.switches.lose_create_response -= 1
            await drop_connection(call.send)
            raise Dropped
        after = self.switches.status_after_create
        if after is not None and after.count > 0:
            after.count -= 1
            raise ApiError(
                after.status, "The front end failed after the request was handled", reason="BACKEND_ERROR"
            )
        return 200, op.view(call.now, self.switches)

    def _answer_for(self, name: str, now: float) -> dict[str, Any]:
        op = self.store.operations.get(name)
        if op is not None:
            return op.view(now, self.switches)
        return self.store.last_seen[name]

    def _find(self, name: str) -> Operation:
        op = self.store.operations.get(name)
        if op is None:
            if name in self.store.expired:
                raise not_found(name, "has expired")
            raise not_found(name, "was deleted" if name in self.store.deleted else "not found")
        return op

    async def _get(self, name: str, call: Call) -> Answer:
        return 200, self._find(name).view(call.now, self.switches)

    async def _list(self, project: str, call: Call) -> Answer:
        start, size = parse_page(call.scope.get("query_string", b""), self.defaults.page_size)
        ops = [op for op in self.store.operations.values() if op.project == project]
        page = ops[start : start + size]
        answer: dict[str, Any] = {"operations": [op.view(call.now, self.switches) for op in page]}
        if start + size < len(ops):
            answer["nextPageToken"] = page_token(start + size)
        return 200, answer

    async def _cancel(self, name: str, call: Call) -> Answer:
        json_object(call.body, required=False)
        op = self._find(name)
        if op.done_at(call.now) is not None:
            if self.switches.cancel_of_done == "failed_precondition":
                raise ApiError(
                    "FAILED_PRECONDITION", f"Operation {name} is already done", reason="OPERATION_DONE"
                )
            if self.switches.cancel_of_done == "unimplemented":
                raise ApiError(
                    "UNIMPLEMENTED", "CancelOperation is not implemented", reason="NOT_IMPLEMENTED"
                )
            return 200, {}
        op.cancel_requested = True
        if op.cancel_at is None:
            op.cancel_at = call.now + self.switches.cancel_takes_ms / 1000
            if self.switches.complete_on_cancel > 0:
                self.switches.complete_on_cancel -= 1
                op.cancel_loses = True
            op.settle(call.now)
        return 200, {}

    async def _delete(self, name: str, call: Call) -> Answer:
        op = self._find(name)
        self.store.last_seen[name] = op.view(call.now, self.switches)
        del self.store.operations[name]
        self.store.deleted.append(name)
        return 200, {}

    # ---- control endpoints (demo_server.control) --------------------------------------------------

    def _show_switches(self) -> dict[str, Any]:
        return self.switches.model_dump()

    def _set_switches(self, changes: dict[str, Any]) -> dict[str, Any]:
        self.switches = FaultSwitches.model_validate({**self.switches.model_dump(), **changes})
        window = self.switches.rate_limit_window
        if "rate_limit_window" in changes and window is not None:
            window.opens_at = time.time() + window.start_in_s
        return self.switches.model_dump()

    def _reset_switches(self) -> dict[str, Any]:
        self.switches = self._fresh_switches()
        return self.switches.model_dump()

    def _clear_log(self) -> None:
        self.log.clear()
        self.wait_until = 0.0

    def _operations(self, _: bytes | None) -> control.Answer:
        now = time.monotonic()
        self.store.sweep(now, self.switches)
        ops = [
            {**op.view(now, self.switches), "requestId": op.request_id, "request": op.request}
            for op in self.store.operations.values()
        ]
        return 200, {"operations": ops, "expired": self.store.expired, "deleted": self.store.deleted}

    def _forget_operations(self, _: bytes | None) -> control.Answer:
        self.store = OperationStore()
        return 200, {"operations": [], "expired": [], "deleted": []}


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--envelope", choices=["aip193", "grpc_gateway"], default="aip193")
    parser.add_argument(
        "--cancel-of-done",
        choices=["failed_precondition", "empty", "unimplemented"],
        default="failed_precondition",
    )
    parser.add_argument(
        "--expire-after-done-s", type=float, default=None, help="forget a done operation after this"
    )
    parser.add_argument("--page-size", type=int, default=50, help="ListOperations default page size")


def _app(args: argparse.Namespace) -> AipDemoServer:
    defaults = Defaults(
        envelope=args.envelope,
        cancel_of_done=args.cancel_of_done,
        expire_after_done_s=args.expire_after_done_s,
        page_size=args.page_size,
    )
    return AipDemoServer(defaults)


def main(argv: list[str] | None = None) -> None:
    serve.run(argv, module="demo_server.aip151", doc=__doc__, port=8151, add_options=_options, build_app=_app)


if __name__ == "__main__":
    main()
