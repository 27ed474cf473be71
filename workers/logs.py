"""What longcall's workers and beat log: quiet when idle, each line with its operation, plain or JSON.

- :func:`bind` / :func:`note_operation` keep the op id and call node id of the work in hand in context
  variables; :class:`LogContext` (a filter on the handlers) puts them, and the Celery task's name and id,
  on every record, so a plain line ends with ``op=... node=...`` and a JSON line has them as keys.
- :class:`QuietTicks` demotes Celery's INFO lines about the periodic ticks (``longcall.dispatch_due``,
  ``longcall.drain_outbox``, ``longcall.reconcile``) to DEBUG: "received", beat's "Sending due task", and
  "succeeded" when the task's return value says it did nothing (every count zero). A tick that dispatched
  or drained something keeps its "succeeded" line at INFO. ``LONGCALL_LOG_IDLE_TICKS=1`` keeps them all.
- ``--log-format json`` (a preload option of ``celery -A workers.app worker|beat``) or
  ``LONGCALL_LOG_FORMAT=json``: one JSON object per line (:class:`JsonFormatter`).

No credentials in a line: a ``scheme://user:password@`` in a message shows ``user:***``.
"""

from __future__ import annotations

import ast
import contextlib
import datetime as dt
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from contextvars import ContextVar, Token
from typing import Any

import click
from celery import signals
from celery._state import get_current_task

from ledger.redact import mask_credentials
from workers.errors import ConfigError

#: The ticks beat sends every few hundred milliseconds or seconds: logged at INFO only when they did work.
QUIET_TASKS = frozenset({"longcall.dispatch_due", "longcall.drain_outbox", "longcall.reconcile"})
LOG_FORMATS = ("plain", "json")
#: The loggers whose INFO lines about the ticks :class:`QuietTicks` demotes.
CELERY_TICK_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")

_op_id: ContextVar[str | None] = ContextVar("longcall_op_id", default=None)
_call_node_id: ContextVar[str | None] = ContextVar("longcall_call_node_id", default=None)


#: The format asked for on the command line (``--log-format``); None: the environment decides.
_requested_format: str | None = None


@contextlib.contextmanager
def bind(op_id: object | None = None, call_node_id: str | None = None) -> Iterator[None]:
    """The operation the enclosed work is about. On the way out both values are restored to what they were
    before, whatever :func:`note_operation` set inside (so work run in process, such as a simulation's
    steps, leaves nothing bound behind it)."""
    tokens: list[tuple[ContextVar[str | None], Token[str | None]]] = [
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


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: The context each running task bound (:func:`task_started`), by task id, undone by :func:`task_ended`.
_bound: dict[str, list[tuple[ContextVar[str | None], Token[str | None]]]] = {}


def _clean(value: object) -> str | None:
    """A value fit for a log line: a string, no control characters (no forged lines), bounded."""
    if value is None:
        return None
    return _CONTROL.sub("?", str(value))[:200]


def task_started(task_id: str | None, task: object, kwargs: Mapping[str, Any] | None) -> None:
    """``task_prerun``: a longcall task's ``op_id`` (and ``call_node_id``, for a submit) from its arguments;
    a step adds the call node with :func:`note_operation` once it has the row."""
    if not task_id or not str(getattr(task, "name", "")).startswith("longcall."):
        return
    given = kwargs or {}
    _bound[task_id] = [
        (_op_id, _op_id.set(_clean(given.get("op_id")))),
        (_call_node_id, _call_node_id.set(_clean(given.get("call_node_id")))),
    ]


def task_ended(task_id: str | None) -> None:
    """``task_postrun``: the context as it was before the task."""
    for var, token in reversed(_bound.pop(task_id or "", [])):
        try:
            var.reset(token)
        except ValueError:  # set in another context (a pool that moved the task): clear instead
            var.set(None)


def current() -> tuple[str | None, str | None]:
    """(op id, call node id) of the work in hand."""
    return _op_id.get(), _call_node_id.get()


#: Libraries whose INFO lines repeat what a step's own lines say: httpx writes "HTTP Request: POST ..." for
#: every request, a line per poll (and its formatting cost, in every step). Shown from WARNING unless the
#: application set the logger's level itself (``logging.getLogger("httpx").setLevel(logging.INFO)``).
QUIET_LIBRARY_LOGGERS = ("httpx", "httpcore")


class LogContext(logging.Filter):
    """Adds ``op_id``, ``call_node_id``, ``task_name`` and ``task_id`` to every record (None when none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "op_id"):
            record.op_id, record.call_node_id = current()
        if not hasattr(record, "task_id"):
            data = getattr(record, "data", None)
            task = get_current_task()
            if isinstance(data, Mapping) and "id" in data:
                record.task_name, record.task_id = data.get("name"), data.get("id")
            elif task is not None and task.request.id is not None:
                record.task_name, record.task_id = task.name, task.request.id
            else:
                record.task_name, record.task_id = None, None
        return True


class QuietTicks(logging.Filter):
    """Demotes Celery's INFO lines about an idle periodic tick to DEBUG (and drops them unless the logger
    shows DEBUG). Installed on :data:`CELERY_TICK_LOGGERS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not _is_idle_tick(record):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _is_idle_tick(record: logging.LogRecord) -> bool:
    if record.name == "celery.beat":  # 'Scheduler: Sending due task %s (%s)' % (entry name, task name)
        args = record.args if isinstance(record.args, tuple) else ()
        return "Sending due task" in record.msg and any(a in QUIET_TASKS for a in args)
    data = record.args if isinstance(record.args, Mapping) else getattr(record, "data", None)
    if not isinstance(data, Mapping) or data.get("name") not in QUIET_TASKS:
        return False
    if "return_value" not in data:  # "received": said of every tick, before anyone knows what it does
        return "received" in str(record.msg)
    return _did_nothing(data["return_value"])


def _did_nothing(return_value: object) -> bool:
    """The tick's return value (Celery logs its repr) is a dict of counts, all zero."""
    try:
        value = ast.literal_eval(str(return_value)) if len(str(return_value)) < 2000 else None
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False
    return isinstance(value, dict) and all(isinstance(v, int) and v == 0 for v in value.values())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, op_id, call_node_id, task_name, task_id,
    process, and exc_info (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        LogContext().filter(record)
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
    """Celery's own line (the wrapped formatter), credentials masked, with ``op=... node=...`` at the end
    when the record is about an operation."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        LogContext().filter(record)
        text = mask_credentials(self.inner.format(record))
        op_id, call_node_id = getattr(record, "op_id", None), getattr(record, "call_node_id", None)
        if op_id is None and call_node_id is None:
            return text
        return f"{text} op={op_id or '-'} node={call_node_id or '-'}"


def log_format() -> str:
    """``--log-format`` when given, else ``LONGCALL_LOG_FORMAT``, else plain.

    Raises:
        ConfigError: an unknown format.
    """
    chosen = _requested_format or os.environ.get("LONGCALL_LOG_FORMAT") or "plain"
    if chosen not in LOG_FORMATS:
        raise ConfigError(f"LONGCALL_LOG_FORMAT: {chosen!r} is not one of {', '.join(LOG_FORMATS)}")
    return chosen


def request_format(value: str | None) -> None:
    """What ``--log-format`` said (the preload option's handler calls this before logging is set up)."""
    global _requested_format  # noqa: PLW0603 - one process-wide choice, made once at start
    _requested_format = value


def idle_ticks_shown() -> bool:
    return os.environ.get("LONGCALL_LOG_IDLE_TICKS", "").strip().lower() in {"1", "true", "yes", "on"}


def install(logger: logging.Logger) -> None:
    """Put the context filter and the chosen formatter on ``logger``'s handlers (Celery's after it set them
    up), and the quiet-ticks filter on Celery's tick loggers (once)."""
    try:
        chosen = log_format()
    except ConfigError as exc:
        raise SystemExit(f"longcall: {exc}") from None
    for handler in logger.handlers:
        if not any(isinstance(f, LogContext) for f in handler.filters):
            handler.addFilter(LogContext())
        current_formatter = handler.formatter
        if chosen == "json" and not isinstance(current_formatter, JsonFormatter):
            handler.setFormatter(JsonFormatter())
        elif chosen == "plain" and not isinstance(current_formatter, PlainFormatter):
            handler.setFormatter(PlainFormatter(current_formatter))
    for name in QUIET_LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        # Only at INFO, when the application left the level alone: a worker run at DEBUG to look into its
        # connections shows their lines.
        if library.level == logging.NOTSET and library.getEffectiveLevel() == logging.INFO:
            library.setLevel(logging.WARNING)
    if idle_ticks_shown():
        return
    for name in CELERY_TICK_LOGGERS:
        tick_logger = logging.getLogger(name)
        if not any(isinstance(f, QuietTicks) for f in tick_logger.filters):
            tick_logger.addFilter(QuietTicks())


LOG_FORMAT_OPTION = click.Option(
    ["--log-format"],
    type=click.Choice(LOG_FORMATS),
    default=None,
    help="longcall: plain lines (with op and call node) or one JSON object per line "
    "(default: LONGCALL_LOG_FORMAT, else plain).",
)


_connected = False


def connect_signals() -> None:
    """Celery's logging and task signals (process-wide, connected once): :func:`install` on the loggers
    Celery sets up (a worker's, beat's, the task logger), the task context around each task."""
    global _connected  # noqa: PLW0603 - the signals are process-wide; connect them once
    if _connected:
        return
    _connected = True

    def on_logger(logger: logging.Logger | None = None, **_: Any) -> None:
        if logger is not None:
            install(logger)

    def on_prerun(task_id: str | None = None, task: object = None, kwargs: Any = None, **_: Any) -> None:
        task_started(task_id, task, kwargs if isinstance(kwargs, Mapping) else None)

    def on_postrun(task_id: str | None = None, **_: Any) -> None:
        task_ended(task_id)

    signals.after_setup_logger.connect(on_logger, weak=False)
    signals.after_setup_task_logger.connect(on_logger, weak=False)
    signals.task_prerun.connect(on_prerun, weak=False)
    signals.task_postrun.connect(on_postrun, weak=False)
