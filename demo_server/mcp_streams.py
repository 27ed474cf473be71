"""The 2025-11-25 demo server's SSE streams and the delivery of a task's input requests.

A task that asks for input (``elicitation/create``) waits on a :class:`~demo_server.tasks.PendingInput`
until the client's JSON-RPC response comes back in a POST (:meth:`Streams.take_reply`). The request travels
on one open stream at a time: the SSE answer of a pending ``tasks/result`` for that task, or in
``--json-response`` mode the session's GET stream; when that stream closes unanswered, the next one carries
it again. A ``tasks/result`` stream ends with the task's final answer; with ``sse_event_ids`` it can be
resumed by a GET with ``Last-Event-ID`` (``demo_server.resumable``). The fault switches that act here
(``lose_input_request``, ``drop_result``, ``truncate_result``, ``malformed_result``, ``result_error``) are
documented with the others in ``demo_server.mcp``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from demo_server._asgi import (
    JSON_TYPE,
    SSE_TYPE,
    Receive,
    Send,
    SseStream,
    drop_connection,
    dumps,
    respond,
    sse_event,
    wait_disconnect,
)
from demo_server.faults import Faults
from demo_server.mcp_session import CLOSE, Incoming, ServerOptions, Session, transport_error
from demo_server.resumable import LOST_IN_TRANSIT, ResumableStream, StreamLogs
from demo_server.tasks import RELATED_TASK, PendingInput, RpcError, Task, TaskStore

#: What ``malformed_result`` answers a ``tasks/result`` with: the same unparsable body every time.
MALFORMED_RESULT = b'{"jsonrpc": "2.0", "result": {"content": [ this is not JSON'


async def send_answer(send: Send, message: dict[str, Any], headers: dict[str, str], *, as_json: bool) -> None:
    """One JSON-RPC answer: an ``application/json`` body, or an SSE stream of that one event."""
    if as_json:
        await respond(send, 200, dumps(message), headers=headers)
    else:
        await respond(send, 200, sse_event(message), headers=headers, content_type=SSE_TYPE)


class Streams:
    """The input requests tasks wait on, and the streams that carry them and the tasks' final answers.

    ``sessions`` is the transport's own table (a task's session tells whether its client can be asked and,
    in JSON mode, which GET stream to ask on); ``after_result`` runs once a ``tasks/result`` answer has been
    sent (or its sending failed).
    """

    def __init__(
        self,
        options: ServerOptions,
        faults: Faults,
        store: TaskStore,
        sessions: Mapping[str, Session],
        *,
        after_result: Callable[[], None],
    ) -> None:
        self._options = options
        self._faults = faults
        self._store = store
        self._sessions = sessions
        self._after_result = after_result
        self._pending: dict[str, PendingInput] = {}
        self._stream_logs = StreamLogs()

    # ---- input requests ---------------------------------------------------------------------------

    async def elicit(
        self, task: Task, message: str, requested_schema: dict[str, Any], request_id: str
    ) -> dict[str, Any]:
        session = self._sessions.get(task.session_id or "")
        if session is not None and "elicitation" not in session.client_capabilities:
            raise RpcError(-32600, "Client does not support elicitation capability")
        request = {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "elicitation/create",
            "params": {
                "mode": "form",
                "message": message,
                "requestedSchema": requested_schema,
                "_meta": {RELATED_TASK: {"taskId": task.task_id}},
            },
        }
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        pending = PendingInput(request_id, request, task, answer)
        task.inputs[request_id] = pending
        self._pending[request_id] = pending
        try:
            task.set_status("input_required", "waiting for input")
            if self._options.json_response and session is not None and session.stream is not None:
                pending.holder = session.stream
                session.push(request)
            return await answer
        finally:
            del task.inputs[request_id]
            del self._pending[request_id]
            if not task.terminal:
                task.set_status("working", None)

    def take_reply(self, incoming: Incoming) -> bool:
        """A JSON-RPC response to one of our requests: hand it to the task that waits for it. False when no
        task waits for it (answered already, unknown id, another session): ignored, as the SDK does."""
        pending = self._pending.get(str(incoming.message.get("id")))
        if pending is None or pending.answer.done():
            return False
        if not self._options.stateless and pending.task.session_id != incoming.session_id:
            return False
        result = incoming.message.get("result")
        pending.answer.set_result(result if isinstance(result, dict) else {"action": "cancel"})
        return True

    # ---- tasks/result -----------------------------------------------------------------------------

    async def tasks_result(
        self, incoming: Incoming, receive: Receive, send: Send, headers: dict[str, str]
    ) -> None:
        request_id = incoming.message["id"]
        try:
            task = self._store.get(incoming.params.get("taskId"), incoming.session_id)
        except RpcError as error:
            refusal = {"jsonrpc": "2.0", "id": request_id, "error": error.wire()}
            await send_answer(send, refusal, headers, as_json=self._options.json_response)
            return
        stream = None
        if not self._options.json_response:
            stream = await self._result_stream(send, headers, task, request_id)
        if not await self._follow(task, stream, receive, send):
            return
        injected = self._faults.take_result_error()
        final = {"error": injected} if injected is not None else self._final_answer(task)
        result = {"jsonrpc": "2.0", "id": request_id, **final}
        try:
            await self._send_result(send, result, headers, stream)
        finally:
            self._after_result()

    async def _send_result(
        self, send: Send, result: dict[str, Any], headers: dict[str, str], stream: SseStream | None
    ) -> None:
        if self._faults.take("drop_result"):
            await drop_connection(send)
        elif self._faults.take("malformed_result"):
            if stream is not None:
                await stream.write(b"event: message\r\ndata: " + MALFORMED_RESULT + b"\r\n\r\n")
                await stream.close()
            else:
                await respond(send, 200, MALFORMED_RESULT, headers=headers)
        elif self._faults.take("truncate_result"):
            data = sse_event(result) if stream is not None else dumps(result)
            if stream is not None:
                await stream.write(data[: len(data) // 2])
            else:
                await send_partial(send, data, headers)
            await drop_connection(send)
        elif stream is not None:
            await stream.event(result)
            await stream.close()
        else:
            await respond(send, 200, dumps(result), headers=headers)

    async def _result_stream(
        self, send: Send, headers: dict[str, str], task: Task, request_id: object
    ) -> SseStream:
        if not self._faults.switches.sse_event_ids:
            return SseStream(send, headers)
        stream = ResumableStream(send, headers, self._stream_logs.open(task.task_id, request_id))
        await stream.prime()
        return stream

    async def _follow(self, task: Task, stream: SseStream | None, receive: Receive, send: Send) -> bool:
        """Carry the task's input requests on ``stream`` until the task is terminal (True), or until the
        client goes away or the stream is cut under a request (False: nothing more to send)."""
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        try:
            while not task.terminal:
                if stream is not None:
                    for pending in list(task.inputs.values()):
                        if pending.holder is None and not await self._deliver(pending, stream, send):
                            return False
                change = asyncio.ensure_future(task.changed().wait())
                await asyncio.wait({change, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                change.cancel()
                if disconnected.done():
                    return False
        finally:
            disconnected.cancel()
            if stream is not None:
                _release(task.inputs.values(), stream)
        return True

    async def _deliver(self, pending: PendingInput, stream: SseStream, send: Send) -> bool:
        """Send an input request on ``stream``; with ``lose_input_request``, cut the stream under it instead
        (False). A lost request counts as sent: only resuming this stream brings it back."""
        if not self._faults.take("lose_input_request"):
            pending.holder = stream
            await stream.event(pending.request)
            return True
        pending.holder = LOST_IN_TRANSIT
        if isinstance(stream, ResumableStream):
            stream.keep_unsent(pending.request)
        await stream.start()
        await drop_connection(send)
        return False

    async def resume(
        self, last_event_id: str, session: Session, receive: Receive, send: Send, headers: dict[str, str]
    ) -> None:
        """GET with ``Last-Event-ID``: replay what followed that event on its ``tasks/result`` stream, then
        go on as that stream (its input requests, then its final answer under the original request id).
        ``headers`` are the session's, for the resumed stream."""
        log = self._stream_logs.find(last_event_id)
        replay = log.after(last_event_id) if log is not None else None
        task = None
        if log is not None:
            with contextlib.suppress(RpcError):
                task = self._store.get(log.task_id, session.session_id)
        if log is None or replay is None or task is None:
            message = f"Bad Request: no stream to resume at event {last_event_id!r}"
            await respond(send, 400, transport_error(-32000, message))
            return
        stream = ResumableStream(send, headers, log)
        await stream.start()
        for replayed, data in replay:
            await stream.write(data)
            pending = task.inputs.get(str(replayed.get("id")))
            if pending is not None and pending.holder is LOST_IN_TRANSIT:
                pending.holder = stream
        if not await self._follow(task, stream, receive, send):
            return
        result = {"jsonrpc": "2.0", "id": log.request_id, **self._final_answer(task)}
        await self._send_result(send, result, headers, stream)

    @staticmethod
    def _final_answer(task: Task) -> dict[str, Any]:
        related = {RELATED_TASK: {"taskId": task.task_id}}
        if task.status == "cancelled":
            message = f"Task {task.task_id} was cancelled: a cancelled task has no result"
            return {"error": {"code": -32602, "message": message}}
        if task.error is not None:
            return {"error": task.error}
        result = dict(task.result or {})
        result["_meta"] = {**result.get("_meta", {}), **related}
        return {"result": result}

    # ---- the session's GET stream -----------------------------------------------------------------

    async def session_stream(
        self, session: Session, receive: Receive, send: Send, headers: dict[str, str]
    ) -> None:
        """The session's GET stream, open until the client goes away or the session ends: its task status
        notifications and, in JSON mode, its tasks' input requests."""
        queue: asyncio.Queue[object] = asyncio.Queue()
        session.stream = queue
        if self._options.json_response:
            for task in self._store.of_session(session.session_id):
                for pending in task.inputs.values():
                    if pending.holder is None:
                        pending.holder = queue
                        queue.put_nowait(pending.request)
        stream = SseStream(send, headers)
        disconnected = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await stream.start()
            while True:
                item = asyncio.ensure_future(queue.get())
                await asyncio.wait({item, disconnected}, return_when=asyncio.FIRST_COMPLETED)
                if not item.done():
                    item.cancel()
                    return
                outgoing = item.result()
                if outgoing is CLOSE:
                    await stream.close()
                    return
                await stream.event(outgoing)
        finally:
            disconnected.cancel()
            if session.stream is queue:
                session.stream = None
            _release(self._pending.values(), queue)


def _release(inputs: Iterable[PendingInput], stream: object) -> None:
    """A closed stream gives its undelivered-or-unanswered requests back for the next stream."""
    for pending in list(inputs):
        if pending.holder is stream:
            pending.holder = None
            pending.task.wake()


async def send_partial(send: Send, data: bytes, headers: dict[str, str]) -> None:
    """Announce the whole JSON body, then send only its first half (the caller drops the connection)."""
    start_headers = {**headers, "content-type": JSON_TYPE, "content-length": str(len(data))}
    raw = [(name.encode(), value.encode()) for name, value in start_headers.items()]
    await send({"type": "http.response.start", "status": 200, "headers": raw})
    await send({"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True})
