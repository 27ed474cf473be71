"""A scripted MCP server behind ``httpx2.MockTransport``, and wire fixtures from reference/wire/.

The fake answers by JSON-RPC method from a script, echoing the request's id (the adapter uses random
ids), in SSE (CRLF framing, no event ids, like mcp 1.30) or JSON mode, and records every request.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2

from adapters import AdapterConfig, Limits, McpTasksAdapter, Timeouts

DATA = Path(__file__).parent / "data"
URL = "http://mcp.test/mcp"
SESSION = "9d029e60fd9944ec9f36b5431f692087"
RELATED = "io.modelcontextprotocol/related-task"

Json = dict[str, Any]


def wire(name: str) -> dict[str, Json]:
    """One transcript from reference/wire/ as {"NN title": {request, response, body, ...}}."""
    data: dict[str, Json] = json.loads((DATA / f"wire_{name}.json").read_text())
    return data


def wire_messages(entry: Mapping[str, Any]) -> list[Json]:
    """The JSON-RPC messages a transcript entry's answer carried (SSE events or the JSON body)."""
    body = entry.get("body")
    if isinstance(body, list):
        return [item["data"] for item in body if isinstance(item, Mapping) and "data" in item]
    if isinstance(body, Mapping):
        return [dict(body)]
    return []


def wire_result(name: str, title_start: str) -> Json:
    """The ``result`` of the response in a transcript entry, looked up by the start of its title."""
    for title, entry in wire(name).items():
        if title[3:].startswith(title_start) or title.startswith(title_start):
            for message in wire_messages(entry):
                if "result" in message:
                    result: Json = message["result"]
                    return result
    raise KeyError(title_start)


def sse_body(messages: list[Json], *, newline: str = "\r\n") -> bytes:
    parts = [f"event: message{newline}data: {json.dumps(m)}{newline}{newline}" for m in messages]
    return "".join(parts).encode()


def result_message(request_id: object, result: Mapping[str, Any]) -> Json:
    return {"jsonrpc": "2.0", "id": request_id, "result": dict(result)}


def error_message(request_id: object, code: int, message: str, data: object = None) -> Json:
    error: Json = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


class ChunkedStream(httpx2.SyncByteStream):
    """A body delivered in given chunks, optionally failing with ``fail`` after them."""

    def __init__(self, chunks: list[bytes], fail: Exception | None = None) -> None:
        self._chunks = chunks
        self._fail = fail

    def __iter__(self) -> Iterator[bytes]:
        yield from self._chunks
        if self._fail is not None:
            raise self._fail


Reply = Callable[[Json, httpx2.Request], "httpx2.Response | Json | list[Json]"]


@dataclass
class FakeMcpServer:
    """Routes each POST by method. A handler returns a full ``httpx2.Response``, one message (its id is
    replaced by the request's), or a list of messages to stream (server requests before the answer)."""

    mode: str = "sse"
    session_id: str | None = SESSION
    initialize_result: Json = field(default_factory=lambda: wire_result("sse", "[A] initialize"))
    tools: list[Json] = field(default_factory=lambda: list(wire_result("sse", "[A] tools/list")["tools"]))
    handlers: dict[str, deque[Reply]] = field(default_factory=dict)
    requests: list[httpx2.Request] = field(default_factory=list)
    bodies: list[Json] = field(default_factory=list)
    sessions_created: int = 0

    def on(self, method: str, *replies: Reply) -> None:
        """Queue replies for a method; the last one repeats."""
        self.handlers.setdefault(method, deque()).extend(replies)

    def on_result(self, method: str, result: Mapping[str, Any]) -> None:
        self.on(method, lambda body, _req: result_message(body["id"], result))

    def on_error(self, method: str, code: int, message: str) -> None:
        self.on(method, lambda body, _req: error_message(body["id"], code, message))

    def calls(self, method: str) -> list[Json]:
        return [body for body in self.bodies if body.get("method") == method]

    def headers_of(self, method: str) -> list[httpx2.Headers]:
        return [
            req.headers
            for req, body in zip(self.requests, self.bodies, strict=True)
            if body.get("method") == method
        ]

    def transport(self) -> httpx2.MockTransport:
        return httpx2.MockTransport(self)

    def _answer(self, request_id: object, messages: list[Json], headers: dict[str, str]) -> httpx2.Response:
        for message in messages:
            if "result" in message or "error" in message:
                message["id"] = request_id
        if self.mode == "json":
            payload = messages[-1] if len(messages) == 1 else messages
            return httpx2.Response(200, json=payload, headers=headers)
        return httpx2.Response(
            200, content=sse_body(messages), headers={**headers, "content-type": "text/event-stream"}
        )

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        if request.method != "POST":
            self.requests.append(request)
            self.bodies.append({"http": request.method})
            queue = self.handlers.get(f"<{request.method.lower()}>")
            if not queue:
                return httpx2.Response(405)
            reply = queue[0] if len(queue) == 1 else queue.popleft()
            produced = reply({}, request)
            assert isinstance(produced, httpx2.Response)
            return produced
        body: Json = json.loads(request.content)
        self.requests.append(request)
        self.bodies.append(body)
        headers: dict[str, str] = {}
        method = body.get("method")
        if method == "initialize":
            self.sessions_created += 1
            if self.session_id is not None:
                headers["mcp-session-id"] = self.session_id
            return self._answer(body["id"], [result_message(body["id"], self.initialize_result)], headers)
        if method is None or "id" not in body:
            # Notifications and responses: "accepted", nothing more.
            queue = self.handlers.get("<post>")
            if queue:
                reply = queue[0] if len(queue) == 1 else queue.popleft()
                produced = reply(body, request)
                if isinstance(produced, httpx2.Response):
                    return produced
            return httpx2.Response(202)
        if method == "tools/list" and method not in self.handlers:
            return self._answer(body["id"], [result_message(body["id"], {"tools": self.tools})], headers)
        queue = self.handlers.get(method)
        if not queue:
            return self._answer(body["id"], [error_message(body["id"], -32601, "Method not found")], headers)
        reply = queue[0] if len(queue) == 1 else queue.popleft()
        produced = reply(body, request)
        if isinstance(produced, httpx2.Response):
            return produced
        messages = produced if isinstance(produced, list) else [produced]
        return self._answer(body["id"], [dict(m) for m in messages], headers)


def make_adapter(
    server: FakeMcpServer | Callable[[httpx2.Request], httpx2.Response],
    *,
    token: str | None = None,
    timeouts: Timeouts | None = None,
    limits: Limits | None = None,
    name: str = "reports",
) -> McpTasksAdapter:
    config = AdapterConfig(
        name=name,
        url=URL,
        protocol="mcp",
        protocol_version="2025-11-25",
        bearer_token=token,
        timeouts=timeouts or Timeouts(read=5.0, input_wait=0.5),
        limits=limits or Limits(),
    )
    return McpTasksAdapter(config, httpx2.Client(transport=httpx2.MockTransport(server)))
