"""Resumable ``tasks/result`` streams for the demo server (transports spec: "Resumability and Redelivery").

With the fault switch ``sse_event_ids`` on, each ``tasks/result`` SSE stream gets an id, opens with a
priming event (an event id and empty data, so the client can reconnect before anything else arrived) and
numbers every event ``<stream id>-<n>``; the events are kept, so a GET with ``Last-Event-ID`` replays what
followed that id on that stream and the stream goes on there. Off (the default), streams carry no ids,
as the Python SDK's without an event store.

``LOST_IN_TRANSIT`` is the holder of an input request whose stream was cut under it (``lose_input_request``):
the server counts it as sent and never sends it on another stream (as the mcp 1.30 server does); only a
resumption of the stream it was on brings it back.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from demo_server._asgi import Send, SseStream, dumps

#: The holder of an input request lost with the stream that carried it (see the module docstring).
LOST_IN_TRANSIT = object()


@dataclass(eq=False)
class StreamLog:
    """One ``tasks/result`` stream's events, kept for replay: the task it follows and the request id its
    final answer carries."""

    stream_id: str
    task_id: str
    request_id: object
    events: list[tuple[dict[str, Any], bytes]] = field(default_factory=list)

    def frame(self, message: dict[str, Any]) -> bytes:
        """Keep ``message`` as this stream's next event; its bytes, id included."""
        event_id = f"{self.stream_id}-{len(self.events) + 1}"
        data = b"id: " + event_id.encode() + b"\r\nevent: message\r\ndata: " + dumps(message) + b"\r\n\r\n"
        self.events.append((message, data))
        return data

    def priming(self) -> bytes:
        return b"id: " + f"{self.stream_id}-0".encode() + b"\r\ndata: \r\n\r\n"

    def after(self, event_id: str) -> list[tuple[dict[str, Any], bytes]] | None:
        """The events that followed ``event_id`` on this stream; None when the id is not this stream's."""
        stream_id, _, number = event_id.rpartition("-")
        if stream_id != self.stream_id or not number.isdigit():
            return None
        return self.events[int(number) :]


class ResumableStream(SseStream):
    """An SSE answer whose events carry ids and are kept in its :class:`StreamLog`."""

    def __init__(self, send: Send, headers: Mapping[str, str], log: StreamLog) -> None:
        super().__init__(send, headers)
        self.log = log

    async def prime(self) -> None:
        await self.write(self.log.priming())

    async def event(self, message: object) -> None:
        if not isinstance(message, dict):
            raise TypeError("a resumable stream carries JSON-RPC messages (objects)")
        await self.write(self.log.frame(message))

    def keep_unsent(self, message: dict[str, Any]) -> None:
        """Number and keep ``message`` as if sent, without sending it (it is lost in transit)."""
        self.log.frame(message)


class StreamLogs:
    """The kept logs by stream id (the newest ``limit``)."""

    def __init__(self, limit: int = 1000) -> None:
        self._logs: dict[str, StreamLog] = {}
        self._limit = limit

    def open(self, task_id: str, request_id: object) -> StreamLog:
        log = StreamLog(f"s{uuid.uuid4().hex[:12]}", task_id, request_id)
        self._logs[log.stream_id] = log
        while len(self._logs) > self._limit:
            del self._logs[next(iter(self._logs))]
        return log

    def find(self, event_id: str) -> StreamLog | None:
        return self._logs.get(event_id.rpartition("-")[0])
