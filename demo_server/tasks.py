"""Tasks as the demo server keeps them: state, the wire form, waiting for changes, expiry."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

TaskStatus = Literal["working", "input_required", "completed", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
RELATED_TASK = "io.modelcontextprotocol/related-task"


def iso_now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


class RpcError(Exception):
    """A JSON-RPC error answer."""

    def __init__(self, code: int, message: str, data: object = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def wire(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


@dataclass(eq=False)
class PendingInput:
    """A server-to-client request (elicitation/create) a task waits on."""

    request_id: str
    request: dict[str, Any]
    task: Task
    answer: asyncio.Future[dict[str, Any]]
    holder: object | None = None  # the open stream it was sent on: never two at once (transports spec)


@dataclass(eq=False)
class Task:
    task_id: str
    session_id: str | None
    tool: str
    arguments: dict[str, Any]
    ttl_ms: int | None
    poll_interval_ms: int
    on_change: Callable[[Task], None]
    status: TaskStatus = "working"
    status_message: str | None = None
    created_at: str = field(default_factory=iso_now)
    last_updated_at: str = ""
    created_mono: float = field(default_factory=time.monotonic)
    terminal_mono: float | None = None
    purge_after_s: float | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    inputs: dict[str, PendingInput] = field(default_factory=dict)
    runner: asyncio.Task[None] | None = None
    #: Told once, when the task becomes terminal (its store: only terminal tasks are ever purged).
    on_terminal: Callable[[Task], None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.last_updated_at = self.created_at

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def wire(self) -> dict[str, Any]:
        """The Task object; `ttl` is always present (null = unlimited)."""
        task: dict[str, Any] = {"taskId": self.task_id, "status": self.status}
        if self.status_message is not None:
            task["statusMessage"] = self.status_message
        task.update(
            createdAt=self.created_at,
            lastUpdatedAt=self.last_updated_at,
            ttl=self.ttl_ms,
            pollInterval=self.poll_interval_ms,
        )
        return task

    def changed(self) -> asyncio.Event:
        """An event set at the next change of this task."""
        return self._changed

    def wake(self) -> None:
        """Wake everything waiting on this task without changing it (e.g. an input request freed up)."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def set_status(self, status: TaskStatus, message: str | None) -> None:
        if self.terminal:
            raise RuntimeError(f"task {self.task_id} is already {self.status}")
        self.status = status
        self.status_message = message
        self.last_updated_at = iso_now()
        if status in TERMINAL:
            self.terminal_mono = time.monotonic()
            if self.on_terminal is not None:
                self.on_terminal(self)
        self.wake()
        self.on_change(self)

    def expired(self, now: float) -> bool:
        """Only terminal tasks are purged: at createdAt + ttl, or earlier when `purge_after_s` says so."""
        if self.terminal_mono is None:
            return False
        deadlines = []
        if self.ttl_ms is not None:
            deadlines.append(self.created_mono + self.ttl_ms / 1000)
        if self.purge_after_s is not None:
            deadlines.append(self.terminal_mono + self.purge_after_s)
        return bool(deadlines) and now >= min(deadlines)

    def view(self) -> dict[str, Any]:
        """Everything the server holds, for `GET /_control/tasks`."""
        return {
            **self.wire(),
            "session": self.session_id,
            "tool": self.tool,
            "arguments": self.arguments,
            "result": self.result,
            "error": self.error,
            "pendingInputs": [pending.request for pending in self.inputs.values()],
        }


NOT_FOUND = "Failed to retrieve task: Task not found"
EXPIRED = "Failed to retrieve task: Task has expired"


class TaskStore:
    """Tasks by id; in stateful mode a task is visible only to the session that created it.

    Every request looks for expired tasks first, among the terminal ones only (kept apart as they end): a
    store of 10,000 working tasks answers a ``tasks/get`` as fast as a store of ten."""

    def __init__(self, *, remembered_expiries: int = 10_000) -> None:
        self._tasks: dict[str, Task] = {}
        self._terminal: dict[str, Task] = {}
        self._expired: OrderedDict[str, str | None] = OrderedDict()
        self._remembered = remembered_expiries

    def add(self, task: Task) -> None:
        self._tasks[task.task_id] = task
        task.on_terminal = self._ended

    def _ended(self, task: Task) -> None:
        self._terminal[task.task_id] = task

    def purge_expired(self) -> None:
        now = time.monotonic()
        for task in [task for task in self._terminal.values() if task.expired(now)]:
            del self._tasks[task.task_id]
            del self._terminal[task.task_id]
            self._expired[task.task_id] = task.session_id
            if len(self._expired) > self._remembered:
                self._expired.popitem(last=False)

    def get(self, task_id: object, session_id: str | None) -> Task:
        """The task, or -32602 ("not found" for an unknown id or another session's task)."""
        if not isinstance(task_id, str):
            raise RpcError(-32602, "Invalid params: taskId must be a string")
        self.purge_expired()
        task = self._tasks.get(task_id)
        if task is not None and _visible(task.session_id, session_id):
            return task
        if task_id in self._expired and _visible(self._expired[task_id], session_id):
            raise RpcError(-32602, EXPIRED)
        raise RpcError(-32602, NOT_FOUND)

    def find(self, task_id: str) -> Task | None:
        """The task whatever its session (the control endpoints'), None when unknown or purged."""
        self.purge_expired()
        return self._tasks.get(task_id)

    def of_session(self, session_id: str | None) -> list[Task]:
        self.purge_expired()
        return [task for task in self._tasks.values() if _visible(task.session_id, session_id)]

    def all(self) -> list[Task]:
        self.purge_expired()
        return list(self._tasks.values())

    def expired_ids(self) -> list[str]:
        return list(self._expired)


def _visible(owner: str | None, asker: str | None) -> bool:
    return owner is None or owner == asker
