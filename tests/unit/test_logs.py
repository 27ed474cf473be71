"""workers.logs and workers.celery_logs on records as Celery makes them: idle ticks demoted, op and call
node on every line, JSON."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from workers import celery_logs, logs
from workers.errors import ConfigError

SUCCESS = "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s"
RECEIVED = "Task %(name)s[%(id)s] received"


def celery_record(logger: str, msg: str, args: object) -> logging.LogRecord:
    """A record as ``celery.app.trace.info`` / the worker strategy / beat log it (one dict, or a tuple)."""
    record = logging.LogRecord(logger, logging.INFO, __file__, 1, msg, None, None)
    record.args = args  # type: ignore[assignment]  # logging keeps a lone dict argument as args
    if isinstance(args, dict):
        record.data = args
    return record


def trace(name: str, return_value: str) -> logging.LogRecord:
    context = {"id": "t-1", "name": name, "return_value": return_value, "runtime": 0.01}
    return celery_record("celery.app.trace", SUCCESS, context)


@pytest.fixture
def info_level() -> Iterator[None]:
    """Celery's loggers at INFO (a worker started with --loglevel INFO), restored after."""
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.setLevel(before)


def test_an_idle_tick_is_demoted_and_dropped_at_info(info_level: None) -> None:
    quiet = celery_logs.QuietTicks()
    for name, value in [
        ("longcall.dispatch_due", "{'dispatched': 0}"),
        ("longcall.drain_outbox", "{'dispatched': 0, 'failed': 0}"),
        ("longcall.reconcile", "{'expired_inputs': 0, 'overdue': 0}"),
    ]:
        record = trace(name, value)
        assert quiet.filter(record) is False, name
        assert record.levelname == "DEBUG"
    received = celery_record(
        "celery.worker.strategy", RECEIVED, {"id": "t-2", "name": "longcall.dispatch_due"}
    )
    assert quiet.filter(received) is False
    sending = celery_record(
        "celery.beat",
        "Scheduler: Sending due task %s (%s)",
        ("longcall.drain_outbox", "longcall.drain_outbox"),
    )
    assert quiet.filter(sending) is False


def test_a_tick_that_did_something_and_every_other_task_keep_info(info_level: None) -> None:
    quiet = celery_logs.QuietTicks()
    for record in [
        trace("longcall.dispatch_due", "{'dispatched': 3}"),
        trace("longcall.drain_outbox", "{'dispatched': 0, 'failed': 1}"),
        trace("longcall.poll", "{'dispatched': 0}"),
        trace("longcall.dispatch_due", "not a dict"),
        celery_record("celery.worker.strategy", RECEIVED, {"id": "t-3", "name": "longcall.submit"}),
        celery_record("celery.beat", "Scheduler: Sending due task %s (%s)", ("nightly", "pipeline.nightly")),
    ]:
        assert quiet.filter(record) is True, record.getMessage()
        assert record.levelname == "INFO"


def test_a_demoted_tick_is_shown_when_the_worker_logs_debug() -> None:
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.DEBUG)
    try:
        record = trace("longcall.dispatch_due", "{'dispatched': 0}")
        assert celery_logs.QuietTicks().filter(record) is True
        assert record.levelno == logging.DEBUG
    finally:
        root.setLevel(before)


def render(formatter: logging.Formatter, record: logging.LogRecord) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(logs.LogContext())
    handler.handle(record)
    return stream.getvalue().strip()


def plain_record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("longcall", logging.WARNING, __file__, 1, msg, args, None)


def test_plain_lines_end_with_op_and_call_node_while_bound() -> None:
    formatter = logs.PlainFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    with logs.bind(op_id="op-1", call_node_id="run-1/report"):
        line = render(formatter, plain_record("stale step on %s", "op-1"))
    assert line == "[WARNING] stale step on op-1 op=op-1 node=run-1/report"
    assert render(formatter, plain_record("nothing bound")) == "[WARNING] nothing bound"
    assert logs.current() == (None, None)


def test_a_task_run_binds_its_operation_and_a_step_adds_the_call_node() -> None:
    class Task:
        name = "longcall.poll"

    celery_logs.task_started("t-9", Task(), {"op_id": "op-9", "cursor": 3})
    assert logs.current() == ("op-9", None)
    logs.note_operation("op-9", "run-9/report\nforged line")
    assert logs.current() == ("op-9", "run-9/report?forged line")  # no line a value could forge
    celery_logs.task_ended("t-9")
    assert logs.current() == (None, None)


def test_json_lines_carry_context_task_and_exception_without_credentials() -> None:
    formatter = logs.JsonFormatter()
    record = logging.LogRecord(
        "longcall", logging.ERROR, __file__, 1, "cannot publish to %s", ("amqp://u:hunter2@mq//",), None
    )
    failure = ConnectionError("redis://:hunter2@10.0.0.5:6379/0 refused")
    record.exc_info = (ConnectionError, failure, None)
    with logs.bind(op_id="op-2", call_node_id="run-2/x"):
        line = render(formatter, record)
    data = json.loads(line)
    assert data["message"] == "cannot publish to amqp://u:***@mq//"
    assert (data["level"], data["logger"], data["op_id"], data["call_node_id"]) == (
        "ERROR",
        "longcall",
        "op-2",
        "run-2/x",
    )
    assert set(data) >= {"ts", "task_name", "task_id", "process", "exc_info"}
    assert "ConnectionError" in data["exc_info"]
    assert "hunter2" not in line


def test_the_trace_record_names_its_task_in_json() -> None:
    line = render(logs.JsonFormatter(), trace("longcall.poll", "{'action': 'polled'}"))
    data = json.loads(line)
    assert (data["task_name"], data["task_id"]) == ("longcall.poll", "t-1")


def test_the_format_comes_from_the_option_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LONGCALL_LOG_FORMAT", raising=False)
    assert celery_logs.log_format() == "plain"
    monkeypatch.setenv("LONGCALL_LOG_FORMAT", "json")
    assert celery_logs.log_format() == "json"
    celery_logs.request_format("plain")
    try:
        assert celery_logs.log_format() == "plain"
    finally:
        celery_logs.request_format(None)
    monkeypatch.setenv("LONGCALL_LOG_FORMAT", "xml")
    with pytest.raises(ConfigError, match="'xml' is not one of plain, json"):
        celery_logs.log_format()


@pytest.fixture
def library_levels() -> Iterator[None]:
    """httpx2's and httpcore2's logger levels, restored after."""
    before = {name: logging.getLogger(name).level for name in celery_logs.QUIET_LIBRARY_LOGGERS}
    try:
        yield
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


def test_httpx_request_lines_are_not_shown_at_info_unless_the_application_asks(
    info_level: None, library_levels: None
) -> None:
    """A worker at INFO does not write httpx2's "HTTP Request: POST ..." line for every poll; an application
    that set httpx2's level itself keeps it."""
    for name in celery_logs.QUIET_LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    celery_logs.install(logging.getLogger("longcall-test-install"))
    assert not logging.getLogger("httpx2").isEnabledFor(logging.INFO)
    assert logging.getLogger("httpx2").isEnabledFor(logging.WARNING)

    logging.getLogger("httpx2").setLevel(logging.INFO)
    celery_logs.install(logging.getLogger("longcall-test-install"))
    assert logging.getLogger("httpx2").isEnabledFor(logging.INFO)


def test_httpx_lines_stay_when_the_worker_logs_debug(library_levels: None) -> None:
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.DEBUG)
    try:
        for name in celery_logs.QUIET_LIBRARY_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
        celery_logs.install(logging.getLogger("longcall-test-install"))
        assert logging.getLogger("httpx2").isEnabledFor(logging.DEBUG)
    finally:
        root.setLevel(before)
