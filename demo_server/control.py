"""The test harness's ``/_control/*`` endpoints, answered the same way by every demo server.

A server lists its endpoints as ``(name, HTTP method) -> endpoint``: an endpoint gets the request body
(None when the client went away first) and returns the HTTP status and the JSON body (None: no body).
What each server's endpoints answer is documented in its module (``demo_server.mcp``,
``demo_server.aip151``, ``demo_server.mcp_ext``); the fault switches' three endpoints and a log's two are
built here once.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from demo_server._asgi import Receive, Send, dumps, read_body, respond

PREFIX = "/_control/"
#: The HTTP status and the JSON body (None: an empty body).
Answer = tuple[int, object]
Endpoint = Callable[[bytes | None], Answer]
Endpoints = dict[tuple[str, str], Endpoint]


class Control:
    """The endpoints of one server under ``/_control/``; an unknown one is 404 (with ``explain_missing``, a
    JSON body that names it)."""

    def __init__(
        self, endpoints: Mapping[tuple[str, str], Endpoint], *, explain_missing: bool = True
    ) -> None:
        self._endpoints = dict(endpoints)
        self._explain_missing = explain_missing

    async def answer(self, path: str, method: str, receive: Receive, send: Send) -> None:
        name = path.removeprefix(PREFIX)
        endpoint = self._endpoints.get((name, method))
        if endpoint is None:
            missing = {"error": f"no control endpoint {method} /_control/{name}"}
            await respond(send, 404, dumps(missing) if self._explain_missing else b"")
            return
        status, payload = endpoint(await read_body(receive))
        await respond(send, status, b"" if payload is None else dumps(payload))


def switch_endpoints(
    show: Callable[[], dict[str, Any]],
    update: Callable[[dict[str, Any]], dict[str, Any]],
    reset: Callable[[], dict[str, Any]],
) -> Endpoints:
    """``GET /_control/faults`` shows the switches, ``POST`` sets the named ones (a JSON object; ``update``
    raises pydantic's ValidationError on a bad value: 400), ``DELETE`` resets them; each answers the
    switches as they then are."""

    def post(body: bytes | None) -> Answer:
        try:
            changes = json.loads(body or b"")
        except ValueError as error:
            changes = error
        if not isinstance(changes, dict):
            return 400, {"error": "the body must be a JSON object of fault switches"}
        try:
            return 200, update(changes)
        except ValidationError as error:
            return 400, {"error": str(error)}

    return {
        ("faults", "GET"): lambda _: (200, show()),
        ("faults", "POST"): post,
        ("faults", "DELETE"): lambda _: (200, reset()),
    }


def log_endpoints(name: str, entries: Callable[[], Iterable[object]], clear: Callable[[], None]) -> Endpoints:
    """``GET /_control/<name>`` -> ``{"entries": [...]}``; ``DELETE`` clears them."""

    def delete(_: bytes | None) -> Answer:
        clear()
        return 200, {"entries": []}

    return {
        (name, "GET"): lambda _: (200, {"entries": list(entries())}),
        (name, "DELETE"): delete,
    }
