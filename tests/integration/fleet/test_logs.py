"""What a real idle worker and beat log at INFO (nearly nothing), and the JSON lines of ``--log-format json``
(worker) and ``LONGCALL_LOG_FORMAT=json`` (beat), with the op id of the task in hand."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests import support

#: How many idle dispatch ticks beat must have sent before the worker's log is read (250 ms apart: ~4 s).
TICKS = 16


def json_lines(log: str) -> list[dict[str, Any]]:
    """The log's JSON lines (Celery's start banner, printed before logging is set up, is plain text)."""
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_an_idle_fleet_is_quiet_at_info_and_logs_json_with_the_op(
    database_url: str, broker_prefix: str, tmp_path: Path
) -> None:
    env = {
        "LONGCALL_DATABASE_URL": database_url,
        "LONGCALL_BROKER_KEYPREFIX": broker_prefix,
        "LONGCALL_OUTBOX_INTERVAL_S": "0.5",
    }
    worker = support.start_celery(
        [
            *("-A", "workers.app", "worker", "-Q", "longcall.control,longcall.poll,longcall.outbox"),
            *("-c", "1", "-n", "quiet@%h", "--loglevel", "INFO", "--without-gossip", "--without-mingle"),
            *("--log-format", "json"),
        ],
        env=env,
        log_dir=tmp_path,
        name="worker",
        ready_marker=" ready.",
    )
    beat = support.start_celery(
        ["-A", "workers.app", "beat", "-s", str(tmp_path / "beat-schedule"), "--loglevel", "DEBUG"],
        env={**env, "LONGCALL_LOG_FORMAT": "json"},
        log_dir=tmp_path,
        name="beat",
        ready_marker="beat: Starting",
    )
    with support.running([worker, beat]):
        started = len(worker.log().splitlines())

        def sent_ticks() -> list[dict[str, Any]]:
            return [
                line
                for line in json_lines(beat.log())
                if "Sending due task longcall.dispatch_due" in line["message"]
            ]

        support.wait_for(f"{TICKS} dispatch ticks", lambda: len(sent_ticks()) >= TICKS, timeout=30)
        assert {line["level"] for line in sent_ticks()} == {"DEBUG"}  # beat at DEBUG shows them, demoted
        idle = worker.log().splitlines()[started:]
        assert not [line for line in idle if "longcall." in line], idle  # no tick received or succeeded
        assert len(idle) <= 2, idle

        # A task about an operation: its lines carry the op id (a cancel of an unknown one, refused).
        op_id = str(uuid.uuid4())
        app = Celery("probe", broker=support.REDIS_URL, backend=support.REDIS_URL, set_as_current=False)
        app.conf.broker_transport_options = {"global_keyprefix": broker_prefix}
        app.conf.result_backend_transport_options = {"global_keyprefix": broker_prefix}
        with pytest.raises(Exception, match="no operation"):
            app.send_task("longcall.cancel", kwargs={"op_id": op_id}, queue="longcall.control").get(
                timeout=30
            )
        app.close()

        def about_op() -> list[dict[str, Any]] | None:
            return [line for line in json_lines(worker.log()) if line["op_id"] == op_id] or None

        lines = support.wait_for("a worker line with the op id", about_op, timeout=10)
        assert {line["task_name"] for line in lines} == {"longcall.cancel"}, lines
        assert all(line["logger"] and line["ts"] for line in lines)
        # Every line JSON once running (Celery prints its banner, and "Warm shutdown" at the end, itself).
        assert all(json.loads(line) for line in worker.log().splitlines()[started:])
