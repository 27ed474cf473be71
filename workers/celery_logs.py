"""The log context wired into Celery: a worker's and beat's lines quiet when idle, each with its operation.

- :func:`connect_signals`: on the loggers Celery sets up, :func:`install` puts the context filter and the
  chosen formatter (``workers/logs.py``, told Celery's current task); around each longcall task, the
  operation its arguments name is bound (:func:`task_started`, :func:`task_ended`).
- :class:`QuietTicks` demotes Celery's INFO lines about the periodic ticks (``longcall.dispatch_due``,
  ``longcall.drain_outbox``, ``longcall.reconcile``) to DEBUG: "received", beat's "Sending due task", and
  "succeeded" when the task's return value says it did nothing (every count zero). A tick that dispatched
  or drained something keeps its "succeeded" line at INFO. ``LONGCALL_LOG_IDLE_TICKS=1`` keeps them all.
- ``--log-format json`` (a preload option of ``celery -A workers.app worker|beat``) or
  ``LONGCALL_LOG_FORMAT=json``: one JSON object per line (:class:`~workers.logs.JsonFormatter`).
"""

from __future__ import annotations

import ast
import logging
import os
from collections.abc import Mapping
from typing import Any

import click
from celery import signals
from celery._state import get_current_task

from workers.errors import ConfigError
from workers.logs import Bound, JsonFormatter, LogContext, PlainFormatter, enter, leave

#: The ticks beat sends every few hundred milliseconds or seconds: logged at INFO only when they did work.
QUIET_TASKS = frozenset({"longcall.dispatch_due", "longcall.drain_outbox", "longcall.reconcile"})
LOG_FORMATS = ("plain", "json")
#: The loggers whose INFO lines about the ticks :class:`QuietTicks` demotes.
CELERY_TICK_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.beat")
#: Libraries whose INFO lines repeat what a step's own lines say: httpx2 writes "HTTP Request: POST ..." for
#: every request, a line per poll (and its formatting cost, in every step). Shown from WARNING unless the
#: application set the logger's level itself (``logging.getLogger("httpx2").setLevel(logging.INFO)``).
QUIET_LIBRARY_LOGGERS = ("httpx2", "httpcore2")

#: The format asked for on the command line (``--log-format``); None: the environment decides.
_requested_format: str | None = None
#: The context each running task bound (:func:`task_started`), by task id, undone by :func:`task_ended`.
_bound: dict[str, Bound] = {}


def celery_task_in_hand() -> tuple[str | None, str | None]:
    """(name, id) of the Celery task running here, (None, None) outside one."""
    task = get_current_task()
    if task is not None and task.request.id is not None:
        return task.name, task.request.id
    return None, None


def task_started(task_id: str | None, task: object, kwargs: Mapping[str, Any] | None) -> None:
    """``task_prerun``: a longcall task's ``op_id`` (and ``call_node_id``, for a submit) from its arguments;
    a step adds the call node with :func:`~workers.logs.note_operation` once it has the row."""
    if not task_id or not str(getattr(task, "name", "")).startswith("longcall."):
        return
    given = kwargs or {}
    _bound[task_id] = enter(given.get("op_id"), given.get("call_node_id"))


def task_ended(task_id: str | None) -> None:
    """``task_postrun``: the context as it was before the task."""
    leave(_bound.pop(task_id or "", []))


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
            handler.addFilter(LogContext(celery_task_in_hand))
        current_formatter = handler.formatter
        if chosen == "json" and not isinstance(current_formatter, JsonFormatter):
            handler.setFormatter(JsonFormatter(celery_task_in_hand))
        elif chosen == "plain" and not isinstance(current_formatter, PlainFormatter):
            handler.setFormatter(PlainFormatter(current_formatter, celery_task_in_hand))
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
