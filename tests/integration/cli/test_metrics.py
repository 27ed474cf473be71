"""``longcall metrics`` after a real run (issue 9): scraped over HTTP and checked against the ledger.

The fleet (longcall's MCP server, two longcall workers, beat, a pipeline worker) runs a few operations to
the end, one cancelled and one whose create answer is lost (UNKNOWN); ``longcall metrics`` runs as its own
process, as an operator starts it; its exposition is parsed with ``prometheus_client.parser`` and every
figure is set against a SQL count of the ledger (or, for the request rates, the MCP server's own log).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from ledger.repository import Ledger
from ledger.states import OpState
from tests import support
from tests.support.fleet import Fleet, free_port
from tests.support.ledger_rows import place

S = OpState
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Scraper:
    """A running ``longcall metrics --host 127.0.0.1 --port N`` and its parsed answers."""

    def __init__(self, fleet: Fleet) -> None:
        self.port = free_port()
        self.process = support.start_celery_like(
            [sys.executable, "-m", "console", "metrics", "--host", "127.0.0.1", "--port", str(self.port)],
            env=fleet.env,
            log_dir=fleet.log_dir,
            name="metrics",
            ready_marker="serving http://",
        )
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def text(self) -> str:
        answer = httpx2.get(self.url, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("text/plain")
        return answer.text

    def samples(self) -> Samples:
        found: Samples = {}
        for family in text_string_to_metric_families(self.text()):
            for sample in family.samples:
                found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return found


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, (
        f"{name}{labels} is not in the scrape: {sorted(k for k in samples if k[0] == name)}"
    )
    return samples[key]


def sql(fleet: Fleet, statement: str, **params: Any) -> list[Any]:
    with fleet.ledger.engine.begin() as conn:
        return list(conn.execute(text(statement), params).all())


@pytest.fixture
def scraper(fleet: Fleet) -> Iterator[Scraper]:
    scraper = Scraper(fleet)
    try:
        yield scraper
    finally:
        scraper.process.stop()


def poll_requests_in(fleet: Fleet, first: int, last: int) -> int:
    """Requests charged to the poll budget that the MCP server received in the whole seconds first..last."""
    entries = httpx2.get(f"{fleet.mcp.control}/http_log", timeout=5).json()["entries"]
    return sum(1 for e in entries if e["budget"] == "poll" and first <= int(e["t"]) <= last)


def test_metrics_after_a_run_match_the_ledger(fleet: Fleet, scraper: Scraper) -> None:
    started = time.time()
    # One UNKNOWN: the create's answer is lost, the operation goes to an operator (never re-called).
    fleet.mcp.faults(lose_create_response=1)
    lost = fleet.submit("m/lost", "slow_report", {"seconds": 30})
    fleet.wait_state(lost, S.MANUAL_RECONCILIATION)
    done = [fleet.submit(f"m/done-{i}", "slow_report", {"seconds": 0.3}) for i in range(3)]
    long = fleet.submit("m/cancelled", "slow_report", {"seconds": 60})
    for i in range(3):
        fleet.wait_receipt(f"m/done-{i}")
    fleet.wait_state(long, S.WORKING)

    # The request rates, while the long operation is polled (every 200 ms): the counters of the scrape's
    # last ten whole seconds against the MCP server's own log of the same seconds (a request charged just
    # before a second turns may reach the server just after it).
    support.wait_for(
        "ten seconds of polling",
        lambda: poll_requests_in(fleet, int(time.time()) - 10, int(time.time()) - 1) >= 10,
        timeout=60,
        interval=0.5,
    )

    def rate_scrape() -> tuple[Samples, int] | None:
        before = int(time.time())
        samples = scraper.samples()
        return (samples, before) if int(time.time()) == before else None  # the scrape within one second

    samples, now = support.wait_for("a scrape within one whole second", rate_scrape, timeout=30)
    counted = (
        value(samples, "longcall_server_requests_per_second", server="reports", **{"class": "poll"}) * 10
    )
    received = poll_requests_in(fleet, now - 10, now - 1)
    assert received >= 10
    # A broken meter (nothing counted) or a double count fails this; a loaded machine shifting a few
    # requests across the window's edges does not.
    assert abs(counted - received) <= max(3, 0.15 * received), (counted, received)
    peak = value(samples, "longcall_server_requests_max_per_second", server="reports", **{"class": "poll"})
    assert 1 <= peak <= value(samples, "longcall_server_qps_limit", server="reports", **{"class": "poll"})
    assert value(samples, "longcall_server_qps_limit", server="reports", **{"class": "control"}) == 50

    fleet.send("longcall.cancel", op_id=str(long))
    assert fleet.wait_receipt("m/cancelled")["terminal_state"] == "cancelled"
    support.wait_for("every receipt delivered", fleet.settled)

    scraped_at = time.time()
    samples = scraper.samples()
    assert value(samples, "longcall_ledger_up") == 1
    assert value(samples, "longcall_redis_up") == 1

    # Operations by state, protocol and server: every state listed, each equal to a SQL count.
    counts = {
        (state, protocol, server): n
        for state, protocol, server, n in sql(
            fleet, "SELECT state, protocol, server, count(*) FROM tool_operation GROUP BY 1, 2, 3"
        )
    }
    assert counts == {("ACCEPTED", "mcp", "reports"): 3, ("CANCELLED_ACCEPTED", "mcp", "reports"): 1} | {
        ("MANUAL_RECONCILIATION", "mcp", "reports"): 1
    }
    for state in OpState:
        assert value(
            samples, "longcall_operations", state=state.value, protocol="mcp", server="reports"
        ) == counts.get((state.value, "mcp", "reports"), 0), state

    # UNKNOWN: the lost create, aged from the event that handed it to an operator.
    assert value(samples, "longcall_unknown_operations", server="reports") == 1
    [(handed_at,)] = sql(
        fleet,
        "SELECT extract(epoch FROM at) FROM operation_event "
        "WHERE op_id = :id AND to_state = 'MANUAL_RECONCILIATION' AND from_state <> to_state",
        id=lost,
    )
    age = value(samples, "longcall_unknown_oldest_age_seconds", server="reports")
    assert abs(age - (scraped_at - float(handed_at))) < 2.0, (age, scraped_at - float(handed_at))
    assert 0 < age < time.time() - started
    assert value(samples, "longcall_reconciliations_open", reason="SUBMISSION_UNKNOWN") == 1

    # The counters (issue 22): receipts by terminal state, creates (one per operation, the lost one too),
    # no dead letter, the operations' durations.
    assert (
        value(
            samples, "longcall_receipts_total", terminal_state="completed", server="reports", protocol="mcp"
        )
        == 3
    )
    assert (
        value(
            samples, "longcall_receipts_total", terminal_state="cancelled", server="reports", protocol="mcp"
        )
        == 1
    )
    assert (
        value(samples, "longcall_receipts_total", terminal_state="failed", server="reports", protocol="mcp")
        == 0
    )
    assert value(samples, "longcall_creates_total", server="reports", protocol="mcp") == 5
    assert value(samples, "longcall_outbox_dead_total") == 0
    assert value(samples, "longcall_operation_duration_seconds_count", server="reports") == 4

    # Every request the workers sent, by budget and outcome (added to Redis every 2 s): the status reads
    # equal the server's own count of poll requests, and the lost create's answer is a no_answer.
    received_polls = poll_requests_in(fleet, 0, int(time.time()) + 1)

    def requests_counted() -> Samples | None:
        latest = scraper.samples()
        return latest if value(latest, "longcall_polls_total", server="reports") >= received_polls else None

    counted_samples = support.wait_for("the workers' request counts", requests_counted, timeout=15)
    polls_sent = sum(
        value(counted_samples, "longcall_requests_total", server="reports", budget="poll", outcome=outcome)
        for outcome in ("ok", "rate_limited", "client_error", "server_error", "no_answer")
    )
    assert value(counted_samples, "longcall_polls_total", server="reports") == polls_sent == received_polls
    lost_answers = value(
        counted_samples, "longcall_requests_total", server="reports", budget="control", outcome="no_answer"
    )
    assert lost_answers >= 1
    assert (
        value(counted_samples, "longcall_requests_total", server="reports", budget="control", outcome="ok")
        >= 5
    )

    # The outbox: every row dispatched.
    [(ready,)] = sql(fleet, "SELECT count(*) FROM outbox WHERE status = 'ready'")
    assert ready == 0
    assert value(samples, "longcall_outbox_ready", kind="terminal") == ready
    assert value(samples, "longcall_outbox_oldest_ready_age_seconds", kind="terminal") == 0

    # Cancel confirmation lag: the cancelled operation, from its cancel request to its cancelled receipt.
    [(lag,)] = sql(
        fleet,
        "SELECT extract(epoch FROM r.accepted_at - (SELECT min(at) FROM operation_event e "
        "WHERE e.op_id = r.op_id AND e.kind = 'cancel_requested')) "
        "FROM terminal_receipt r WHERE r.op_id = :id AND r.terminal_state = 'cancelled'",
        id=long,
    )
    histogram = "longcall_cancel_confirmation_lag_seconds"
    assert value(samples, f"{histogram}_count", server="reports") == 1
    assert value(samples, f"{histogram}_sum", server="reports") == pytest.approx(float(lag), abs=1e-3)
    assert 0 < float(lag) < 30
    for (name, labels), n in samples.items():
        if name == f"{histogram}_bucket":
            le = dict(labels)["le"]
            assert n == (1 if le == "+Inf" or float(lag) <= float(le) else 0), (le, n, lag)

    # Detection lag: the three completed operations (their ends were seen by polls); not the cancelled
    # one (its cancel was confirmed by the server's answer), not the UNKNOWN one.
    polled_ends = sql(
        fleet,
        "SELECT DISTINCT op_id FROM operation_event WHERE kind = 'terminal_observed' "
        "AND from_state IN ('WORKING', 'INPUT_REQUIRED', 'CANCEL_REQUESTED')",
    )
    assert {uuid.UUID(str(op_id)) for (op_id,) in polled_ends} == set(done)
    histogram = "longcall_terminal_detection_lag_seconds"
    assert value(samples, f"{histogram}_count", server="reports") == 3
    assert value(samples, f"{histogram}_bucket", server="reports", le="+Inf") == 3
    # Polled every 200 ms: each end was seen within a few seconds of the last poll that found it open.
    assert value(samples, f"{histogram}_bucket", server="reports", le="30.0") == 3
    assert 0 < value(samples, f"{histogram}_sum", server="reports") < 30


def test_metrics_once_prints_the_same_figures_as_text_and_json(
    ledger: Ledger, database_url: str, broker_prefix: str
) -> None:
    """No fleet needed: rows placed in the ledger, ``--once`` and ``--once --json`` read them alike."""
    for state in (S.WORKING, S.WORKING, S.SUBMISSION_UNKNOWN, S.ACCEPTED):
        place(ledger, state)
    env = support.celery_env(
        {"LONGCALL_DATABASE_URL": database_url, "LONGCALL_BROKER_KEYPREFIX": broker_prefix}
    )

    def longcall(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "console", "metrics", *args],
            cwd=support.REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    exposition = longcall("--once")
    assert exposition.returncode == 0, exposition.stderr
    samples: Samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition.stdout)
        for s in family.samples
    }
    for state, n in ((S.WORKING, 2), (S.SUBMISSION_UNKNOWN, 1), (S.ACCEPTED, 1), (S.SUBMITTING, 0)):
        assert value(samples, "longcall_operations", state=state.value, protocol="mcp", server="reports") == n
    assert value(samples, "longcall_unknown_operations", server="reports") == 1

    as_json = longcall("--once", "--json")
    assert as_json.returncode == 0, as_json.stderr
    metrics = {m["name"]: m for m in json.loads(as_json.stdout)["metrics"]}
    assert {name for name, _ in samples} == {s["name"] for m in metrics.values() for s in m["samples"]}
    for m in metrics.values():
        for sample in m["samples"]:
            key = (sample["name"], tuple(sorted(sample["labels"].items())))
            if not sample["name"].endswith("_seconds") and "age" not in sample["name"]:
                assert samples[key] == sample["value"], key  # ages move between the two runs
    assert metrics["longcall_terminal_detection_lag_seconds"]["type"] == "histogram"

    refused = longcall("--json")
    assert refused.returncode == 2
    assert "--json goes with --once" in refused.stderr


def test_an_unreachable_ledger_is_a_zero_not_a_failed_scrape(broker_prefix: str) -> None:
    unreachable = f"postgresql://postgres@127.0.0.1:{free_port()}/longcall"
    done = subprocess.run(
        [sys.executable, "-m", "console", "metrics", "--once"],
        cwd=support.REPO,
        env=support.celery_env(
            {"LONGCALL_DATABASE_URL": unreachable, "LONGCALL_BROKER_KEYPREFIX": broker_prefix}
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    families = {f.name: f for f in text_string_to_metric_families(done.stdout)}
    assert [s.value for s in families["longcall_ledger_up"].samples] == [0]
    assert [s.value for s in families["longcall_redis_up"].samples] == [1]
    assert "longcall_operations" not in families
