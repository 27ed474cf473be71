"""The log context: each line names the operation in hand, plain or JSON, with no credentials. No Celery.

- :func:`bind` / :func:`note_operation` keep the op id and call node id of the work in hand in context
  variables; :class:`LogContext` (a filter on the handlers) puts them, and the task's name and id, on every
  record, so a plain line ends with ``op=... node=...`` and a JSON line has them as keys.
- :class:`JsonFormatter`: one JSON object per line; :class:`PlainFormatter`: the wrapped formatter's line
  with the context at its end.

No credentials in a line: a ``scheme://user:password@`` in a message shows ``user:***``.

Which task is running is the task runner's to say: :class:`LogContext` and the formatters take it as
``task_in_hand`` (the Celery wiring, ``workers/celery_logs.py``, gives Celery's current task; it also binds
a task's operation around each run with :func:`enter` and :func:`leave`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar, Token
from typing import Any

from ledger.redact import mask_credentials

_op_id: ContextVar[str | None] = ContextVar("longcall_op_id", default=None)
_call_node_id: ContextVar[str | None] = ContextVar("longcall_call_node_id", default=None)

#: What :func:`enter` set, for :func:`leave` to undo.
Bound = list[tuple[ContextVar[str | None], Token[str | None]]]
#: (task name, task id) of the task running in this context, (None, None) outside one.
TaskInHand = Callable[[], tuple[str | None, str | None]]


def no_task() -> tuple[str | None, str | None]:
    """No task runner: no task name or id on the records."""
    return None, None


@contextlib.contextmanager
def bind(op_id: object | None = None, call_node_id: str | None = None) -> Iterator[None]:
    """The operation the enclosed work is about. On the way out both values are restored to what they were
    before, whatever :func:`note_operation` set inside (so work run in process, such as a simulation's
    steps, leaves nothing bound behind it)."""
    tokens: Bound = [
        (_op_id, _op_id.set(_clean(op_id) if op_id is not None else _op_id.get())),
        (
            _call_node_id,
            _call_node_id.set(_clean(call_node_id) if call_node_id is not None else _call_node_id.get()),
        ),
    ]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def note_operation(op_id: object, call_node_id: str) -> None:
    """The operation a step now works on, until the enclosing :func:`bind` ends (a task's run)."""
    _op_id.set(_clean(op_id))
    _call_node_id.set(_clean(call_node_id))


def enter(op_id: object, call_node_id: object) -> Bound:
    """Bind the operation of a task about to run (either value may be None), until :func:`leave`: for a task
    runner whose start and end are two calls (signals), where :func:`bind` cannot enclose the run."""
    return [
        (_op_id, _op_id.set(_clean(op_id))),
        (_call_node_id, _call_node_id.set(_clean(call_node_id))),
    ]


def leave(bound: Bound) -> None:
    """The context as it was before :func:`enter`."""
    for var, token in reversed(bound):
        try:
            var.reset(token)
        except ValueError:  # set in another context (a pool that moved the task): clear instead
            var.set(None)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _clean(value: object) -> str | None:
    """A value fit for a log line: a string, no control characters (no forged lines), bounded. An operation
    id (a UUID: hex digits and hyphens) is that already: it is only written out (a member of every batched
    poll binds its own)."""
    if value is None:
        return None
    if isinstance(value, uuid.UUID):
        return str(value)
    return _CONTROL.sub("?", str(value))[:200]


def current() -> tuple[str | None, str | None]:
    """(op id, call node id) of the work in hand."""
    return _op_id.get(), _call_node_id.get()


class LogContext(logging.Filter):
    """Adds ``op_id``, ``call_node_id``, ``task_name`` and ``task_id`` to every record (None when none).
    ``task_in_hand``: the running task's (name, id), asked when the record does not name its task itself
    (a Celery trace record carries it as ``data``)."""

    def __init__(self, task_in_hand: TaskInHand = no_task) -> None:
        super().__init__()
        self.task_in_hand = task_in_hand

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "op_id"):
            record.op_id, record.call_node_id = current()
        if not hasattr(record, "task_id"):
            data = getattr(record, "data", None)
            if isinstance(data, Mapping) and "id" in data:
                record.task_name, record.task_id = data.get("name"), data.get("id")
            else:
                record.task_name, record.task_id = self.task_in_hand()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, op_id, call_node_id, task_name, task_id,
    process, and exc_info (the formatted traceback) when there is one."""

    def __init__(self, task_in_hand: TaskInHand = no_task) -> None:
        super().__init__()
        self.context = LogContext(task_in_hand)

    def format(self, record: logging.LogRecord) -> str:
        self.context.filter(record)
        line: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": mask_credentials(record.getMessage()),
            "op_id": getattr(record, "op_id", None),
            "call_node_id": getattr(record, "call_node_id", None),
            "task_name": getattr(record, "task_name", None),
            "task_id": getattr(record, "task_id", None),
            "process": record.processName,
        }
        if record.exc_info:
            line["exc_info"] = mask_credentials(self.formatException(record.exc_info))
        elif record.exc_text:
            line["exc_info"] = mask_credentials(record.exc_text)
        return json.dumps(line, default=str, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """The wrapped formatter's line (Celery's own, in a worker), credentials masked, with
    ``op=... node=...`` at the end when the record is about an operation."""

    def __init__(self, inner: logging.Formatter | None, task_in_hand: TaskInHand = no_task) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.context = LogContext(task_in_hand)

    def format(self, record: logging.LogRecord) -> str:
        self.context.filter(record)
        text = mask_credentials(self.inner.format(record))
        op_id, call_node_id = getattr(record, "op_id", None), getattr(record, "call_node_id", None)
        if op_id is None and call_node_id is None:
            return text
        return f"{text} op={op_id or '-'} node={call_node_id or '-'}"
