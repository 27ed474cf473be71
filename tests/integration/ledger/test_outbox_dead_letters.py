"""Issue 19 item 10 (rule 9): every receipt is delivered, or shown undeliverable.

An outbox row whose publish failed used to be tried again every drain (every second), for ever, with a warning
line: a receipt the broker refuses every time was never delivered and nobody was told. Now a failed publish
waits a growing pause (``outbox.next_attempt_at``), and after ``outbox_max_attempts`` failures the row is
dead-lettered (``status = 'dead'``, an OUTBOX_UNDELIVERABLE record with the error, an
``outbox_dead_lettered`` event), shown by ``longcall status`` and ``longcall_outbox_dead_rows``, and sent
again by ``longcall reconcile --resend``. A broker that is down is not counted: an outage dead-letters
nothing.

Real Postgres; the fleet test runs real workers on RabbitMQ, which refuses the receipt's queue declaration
(PRECONDITION_FAILED) until the test removes the cause; a signature that could never be delivered is refused
by ``longcall.submit`` itself.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import amqp.exceptions
import kombu
import pytest
from click.testing import CliRunner
from kombu.exceptions import OperationalError
from sqlalchemy import text

from console.main import main
from console.metrics import ledger_families
from ledger.errors import PublishUnavailable
from ledger.metrics_reads import read_metrics
from ledger.outbox import OutboxRetry
from ledger.reasons import ReconciliationReason
from ledger.records import OutboxMessage
from ledger.repository import Ledger
from ledger.states import OpState, TerminalKind
from tests import support
from tests.support.fleet import Fleet, FleetParts, running_fleet
from tests.support.ledger_rows import evidence_for, place
from workers.app import create_app
from workers.delivery import broker_unreachable, publisher
from workers.settings import FleetConfig, Settings

#: A Celery app made in this process takes, when it is finalized, the shared tasks of every app made before
#: it: tests/support/pipeline_app.py's pipeline tasks (shared by default) from each fleet started earlier
#: in the same test process, which then warn as duplicates of one another. Nothing to do with what is tested.
PIPELINE_TASKS_SHARED = pytest.mark.filterwarnings("ignore::celery.exceptions.DuplicateTaskNameWarning")

#: What the tests (and the fleet, through LONGCALL_OUTBOX_MAX_ATTEMPTS / _RETRY_MAX_S) retry with.
RETRY = OutboxRetry(max_attempts=3, max_pause_s=1.0, first_pause_s=0.5)


def accepted_row(ledger: Ledger) -> tuple[uuid.UUID, int]:
    op = place(ledger, OpState.FETCHING_RESULT)
    acceptance = ledger.accept_terminal(op.id, evidence_for(op, TerminalKind.COMPLETED))
    assert acceptance.outbox_id is not None
    return op.id, acceptance.outbox_id


def outbox_row(ledger: Ledger, outbox_id: int) -> Any:
    with ledger.engine.connect() as conn:
        return conn.execute(
            text(
                "SELECT status, attempts, last_error, next_attempt_at, dispatched_at,"
                " extract(epoch FROM next_attempt_at - now()) AS pause_s FROM outbox WHERE id = :id"
            ),
            {"id": outbox_id},
        ).one()


def make_due(ledger: Ledger) -> None:
    """As if every pause had run out (setup: the pauses themselves are asserted where they are set)."""
    with ledger.engine.begin() as conn:
        conn.execute(text("UPDATE outbox SET next_attempt_at = now() WHERE next_attempt_at IS NOT NULL"))


def dead_gauge(ledger: Ledger) -> dict[str, float]:
    families = ledger_families(read_metrics(ledger.engine), FleetConfig.model_validate({"servers": {}}))
    family = next(f for f in families if f.name == "longcall_outbox_dead_rows")
    return {s.labels["kind"]: s.value for s in family.samples}


class Refusing:
    """A publisher that refuses every message (as a broker refusing it would) while ``refusing``; records
    what it was given and what it sent."""

    def __init__(self) -> None:
        self.refusing = True
        self.tried: list[int] = []
        self.sent: list[OutboxMessage] = []

    def __call__(self, message: OutboxMessage) -> None:
        self.tried.append(message.id)
        if self.refusing:
            raise amqp.exceptions.PreconditionFailed(
                "Queue.declare: (406) PRECONDITION_FAILED - inequivalent"
            )
        self.sent.append(message)


def test_a_row_that_never_publishes_is_dead_lettered_after_its_attempts_with_a_record_and_an_event(
    ledger: Ledger,
) -> None:
    op_id, outbox_id = accepted_row(ledger)
    publish = Refusing()
    assert dead_gauge(ledger) == {"input_required": 0, "terminal": 0}

    first = ledger.drain_outbox(publish, retry=RETRY)
    assert (first.failed, first.dead) == ((outbox_id,), ())
    row = outbox_row(ledger, outbox_id)
    assert (row.status, row.attempts) == ("ready", 1)
    # Paced: the row waits out its pause; a drain now passes it by.
    assert 0.3 < row.pause_s <= 0.5
    assert ledger.drain_outbox(publish, retry=RETRY).failed == ()
    assert publish.tried == [outbox_id]

    make_due(ledger)
    ledger.drain_outbox(publish, retry=RETRY)
    make_due(ledger)
    third = ledger.drain_outbox(publish, retry=RETRY)

    assert third.dead == (outbox_id,)
    row = outbox_row(ledger, outbox_id)
    assert (row.status, row.attempts, row.next_attempt_at, row.dispatched_at) == ("dead", 3, None, None)
    assert "PRECONDITION_FAILED" in row.last_error
    [record] = [r for r in ledger.reconciliations_for(op_id) if r.resolved_at is None]
    assert record.reason is ReconciliationReason.OUTBOX_UNDELIVERABLE
    assert (record.detail["outbox_ids"], record.detail["attempts"], record.detail["kind"]) == (
        [outbox_id],
        3,
        "terminal",
    )
    assert "PRECONDITION_FAILED" in record.detail["error"]
    [event] = [e for e in ledger.events(op_id) if e["kind"] == "outbox_dead_lettered"]
    assert event["detail"]["outbox_id"] == outbox_id
    assert event["detail"]["reconciliation_id"] == record.id
    assert dead_gauge(ledger) == {"input_required": 0, "terminal": 1}

    # Never tried again by a drain, however often it runs.
    make_due(ledger)
    for _ in range(3):
        assert ledger.drain_outbox(publish, retry=RETRY).failed == ()
    assert len(publish.tried) == 3
    assert ledger.ready_outbox_count() == 0


def test_failed_publishes_wait_a_pause_that_grows_to_its_bound(ledger: Ledger) -> None:
    _, outbox_id = accepted_row(ledger)
    publish = Refusing()
    retry = OutboxRetry(max_attempts=10, max_pause_s=8.0, first_pause_s=1.0)
    pauses = []
    for _ in range(5):
        make_due(ledger)
        ledger.drain_outbox(publish, retry=retry)
        pauses.append(outbox_row(ledger, outbox_id).pause_s)
    assert [round(p) for p in pauses] == [1, 2, 4, 8, 8]
    assert outbox_row(ledger, outbox_id).status == "ready"


@PIPELINE_TASKS_SHARED
def test_a_broker_that_is_down_dead_letters_nothing_and_the_rows_go_out_once_it_is_back(
    ledger: Ledger, broker_prefix: str
) -> None:
    """Delivery's own publisher on a broker nobody listens on: each drain meets a refused connection, which
    is not counted (attempts stay 0, the row is paced, the drain stops at the first row); many more drains
    than ``max_attempts`` dead-letter nothing, and the first drain once the broker is back sends both."""
    rows = [accepted_row(ledger)[1] for _ in range(2)]
    down = create_app(Settings(broker_url="redis://127.0.0.1:1/0", redis_url=support.REDIS_URL))
    try:
        for _ in range(2 * RETRY.max_attempts):
            make_due(ledger)
            report = ledger.drain_outbox(publisher(down), retry=RETRY)
            assert (len(report.failed), report.dead) == (1, ())
    finally:
        down.close()
    for outbox_id in rows:
        row = outbox_row(ledger, outbox_id)
        assert (row.status, row.attempts) == ("ready", 0)
    assert "Connection refused" in outbox_row(ledger, rows[0]).last_error
    assert all(ledger.reconciliations_for(ledger_op(ledger, i)) == [] for i in rows)

    up = create_app(
        Settings(broker_url=support.REDIS_URL, redis_url=support.REDIS_URL, broker_keyprefix=broker_prefix)
    )
    try:
        make_due(ledger)
        assert sorted(ledger.drain_outbox(publisher(up), retry=RETRY).dispatched) == sorted(rows)
    finally:
        up.close()


def ledger_op(ledger: Ledger, outbox_id: int) -> uuid.UUID:
    with ledger.engine.connect() as conn:
        return uuid.UUID(
            str(conn.execute(text("SELECT op_id FROM outbox WHERE id = :id"), {"id": outbox_id}).scalar_one())
        )


@pytest.mark.parametrize(
    ("failure", "unreachable"),
    [
        (OperationalError("[Errno 111] Connection refused"), True),
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError("timed out"), True),
        (amqp.exceptions.RecoverableConnectionError("(320) CONNECTION_FORCED - broker shutdown"), True),
        (amqp.exceptions.PreconditionFailed("(406) PRECONDITION_FAILED"), False),
        (amqp.exceptions.NotFound("(404) NOT_FOUND - no exchange"), False),
        (TypeError("'NoneType' object is not iterable"), False),
        (KeyError("receipt"), False),
    ],
)
def test_an_outage_is_told_from_a_refusal(failure: BaseException, unreachable: bool) -> None:
    assert broker_unreachable(failure, (amqp.exceptions.ChannelError,)) is unreachable
    # kombu wraps what it meets in an OperationalError; the cause decides.
    assert broker_unreachable(wrapped(failure), (amqp.exceptions.ChannelError,)) is unreachable
    assert not broker_unreachable(wrapped(amqp.exceptions.MessageNacked()), ())


def wrapped(cause: BaseException) -> OperationalError:
    """An OperationalError raised from ``cause``, as kombu raises it (its ``__cause__`` set)."""
    error = OperationalError(str(cause))
    error.__cause__ = cause
    return error


def test_publish_unavailable_from_a_publisher_is_paced_and_not_counted(ledger: Ledger) -> None:
    _, outbox_id = accepted_row(ledger)

    def down(_: OutboxMessage) -> None:
        raise PublishUnavailable("OperationalError: refused") from ConnectionRefusedError(111, "refused")

    for _ in range(5):
        make_due(ledger)
        ledger.drain_outbox(down, retry=RETRY)
    row = outbox_row(ledger, outbox_id)
    assert (row.status, row.attempts) == ("ready", 0)
    assert row.last_error == "ConnectionRefusedError: [Errno 111] refused"
    assert 0.3 < row.pause_s <= RETRY.first_pause_s


# ---------------------------------------------------------------------------------- the operator's side


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, database_url: str, broker_prefix: str) -> None:
    monkeypatch.setenv("LONGCALL_DATABASE_URL", database_url)
    monkeypatch.setenv("LONGCALL_BROKER_KEYPREFIX", broker_prefix)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def dead_letter(ledger: Ledger, publish: Refusing) -> None:
    for _ in range(RETRY.max_attempts):
        make_due(ledger)
        ledger.drain_outbox(publish, retry=RETRY)


def test_status_shows_a_dead_row_and_reconcile_resend_sends_it_once_the_cause_is_gone(
    cli_env: None, ledger: Ledger
) -> None:
    op_id, outbox_id = accepted_row(ledger)
    publish = Refusing()
    dead_letter(ledger, publish)

    code, shown = run("status", str(op_id))
    assert code == 0, shown
    assert f"outbox {outbox_id} (terminal): DEAD after 3 failed attempts" in shown
    assert f"longcall reconcile --resend {outbox_id}" in shown
    code, shown = run("status", str(op_id), "--json")
    [row] = json.loads(shown)["outbox"]
    assert (row["outbox_id"], row["status"], row["attempts"]) == (outbox_id, "dead", 3)
    assert "PRECONDITION_FAILED" in row["last_error"]
    code, listed = run("reconcile", "--json")
    assert [r["reason"] for r in json.loads(listed)] == ["OUTBOX_UNDELIVERABLE"]

    code, refused = run("reconcile", "--resend", str(outbox_id))
    assert code != 0
    assert "--evidence" in refused
    publish.refusing = False  # the cause is gone (the queue redeclared, the permission granted, ...)
    code, answer = run("reconcile", "--resend", str(outbox_id), "--evidence", "queue recreated durable")
    assert code == 0, answer
    assert f"outbox row {outbox_id} ready again" in answer

    row = outbox_row(ledger, outbox_id)
    assert (row.status, row.attempts, row.last_error) == ("ready", 0, None)
    assert [r for r in ledger.reconciliations_for(op_id) if r.resolved_at is None] == []
    [resent] = [e for e in ledger.events(op_id) if e["kind"] == "outbox_resent"]
    assert resent["detail"]["evidence"] == "queue recreated durable"
    assert resent["detail"]["attempts"] == 3
    assert ledger.drain_outbox(publish, retry=RETRY).dispatched == (outbox_id,)
    assert [m.id for m in publish.sent] == [outbox_id]
    assert dead_gauge(ledger)["terminal"] == 0

    code, again = run("reconcile", "--resend", str(outbox_id), "--evidence", "twice")
    assert code != 0
    assert "dispatched, not dead" in again
    code, missing = run("reconcile", "--resend", "999999", "--evidence", "none")
    assert code != 0
    assert "no outbox row 999999" in missing


def test_two_dead_rows_of_one_operation_share_one_record_resolved_when_the_last_is_resent(
    ledger: Ledger,
) -> None:
    op_id, terminal_id = accepted_row(ledger)
    with ledger.engine.begin() as conn:
        input_id = conn.execute(
            text(
                "INSERT INTO outbox (kind, op_id, input_round, payload) VALUES ('input_required', :op, 1,"
                " CAST(:payload AS jsonb)) RETURNING id"
            ),
            {"op": op_id, "payload": json.dumps({"signature": None, "input_request": {"op_id": str(op_id)}})},
        ).scalar_one()
    dead_letter(ledger, Refusing())

    [record] = [r for r in ledger.reconciliations_for(op_id) if r.resolved_at is None]
    assert sorted(record.detail["outbox_ids"]) == sorted([terminal_id, input_id])
    assert dead_gauge(ledger) == {"input_required": 1, "terminal": 1}

    first = ledger.resend_outbox(terminal_id, actor="test", evidence="one")
    assert (first.resent, first.resolved) == (True, ())
    [record] = [r for r in ledger.reconciliations_for(op_id) if r.resolved_at is None]
    assert record.detail["outbox_ids"] == [input_id]
    last = ledger.resend_outbox(input_id, actor="test", evidence="two")
    assert last.resolved == (record.id,)
    assert [r for r in ledger.reconciliations_for(op_id) if r.resolved_at is None] == []


# ------------------------------------------------------------------------------------------- the fleet


@pytest.fixture
def strict_fleet(fleet_parts: FleetParts) -> Iterator[Fleet]:
    """The fleet on RabbitMQ with small bounds, its pipeline worker not started: the test declares the
    ``pipeline`` queue first, non-durable, so that longcall's (durable) declaration of it is refused."""
    env = {"LONGCALL_OUTBOX_MAX_ATTEMPTS": "3", "LONGCALL_OUTBOX_RETRY_MAX_S": "1"}
    with running_fleet(fleet_parts, env=env, pipeline=False) as fleet:
        yield fleet


def with_vhost_connection(fleet: Fleet, act: Callable[[Any], Any]) -> Any:
    assert fleet.vhost is not None
    url = fleet.env["LONGCALL_BROKER_URL"]
    with kombu.Connection(url) as conn:
        return act(conn.channel())


@pytest.mark.parametrize("broker", ["rabbitmq"])
def test_a_receipt_the_broker_refuses_is_dead_lettered_shown_and_resent_on_the_fleet(
    strict_fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = strict_fleet
    with_vhost_connection(
        fleet, lambda channel: kombu.Queue("pipeline", durable=False, channel=channel).declare()
    )
    op_id = fleet.submit("n/refused", "quick_lookup", {"key": "k1"})
    fleet.wait_state(op_id, OpState.ACCEPTED)

    def dead() -> Any:
        [row] = fleet.ledger.outbox_for(op_id)
        return row if row.status == "dead" else None

    row = support.wait_for("the receipt's row to be dead-lettered", dead, timeout=60)
    assert row.attempts == 3
    assert "PRECONDITION_FAILED" in (row.last_error or "")
    [record] = [r for r in fleet.ledger.reconciliations_for(op_id) if r.resolved_at is None]
    assert record.reason is ReconciliationReason.OUTBOX_UNDELIVERABLE
    assert dead_gauge(fleet.ledger)["terminal"] == 1
    assert fleet.receipts() == []

    for name, value in fleet.env.items():
        monkeypatch.setenv(name, value)
    code, shown = run("status", "n/refused")
    assert code == 0, shown
    assert "DEAD after 3 failed attempts" in shown, shown
    code, scraped = run("metrics", "--once")
    assert code == 0, scraped
    assert 'longcall_outbox_dead_rows{kind="terminal"} 1.0' in scraped, scraped
    assert "longcall_outbox_dead_total 1.0" in scraped, scraped

    # The cause goes: the wrong queue is deleted; the operator resends; the pipeline's worker starts.
    with_vhost_connection(fleet, lambda channel: channel.queue_delete("pipeline"))
    code, answer = run("reconcile", "--resend", str(row.id), "--evidence", "pipeline queue recreated")
    assert code == 0, answer
    fleet.start_pipeline()
    receipt = fleet.wait_receipt("n/refused", timeout=60)
    assert (receipt["op_id"], receipt["outbox_id"]) == (str(op_id), row.id)
    # The drain marks the row dispatched as its transaction commits, a moment after the publish.
    support.wait_for(
        "the resent row's drain to commit",
        lambda: [r.status for r in fleet.ledger.outbox_for(op_id)] == ["dispatched"],
        timeout=10,
    )
    assert [r for r in fleet.ledger.reconciliations_for(op_id) if r.resolved_at is None] == []
    code, scraped = run("metrics", "--once")
    assert code == 0, scraped
    # Sent again: no row dead now; the counter keeps the dead letter that was.
    assert 'longcall_outbox_dead_rows{kind="terminal"} 0.0' in scraped, scraped
    assert "longcall_outbox_dead_total 1.0" in scraped, scraped


def test_longcall_submit_refuses_a_signature_that_could_never_be_delivered_and_writes_nothing(
    fleet: Fleet,
) -> None:
    on_terminal = dict(
        fleet.pipeline.signature("pipeline.record", queue="pipeline", exchange="pipeline.topic")
    )
    with pytest.raises(Exception, match="exchange refused") as refused:
        fleet.send(
            "longcall.submit",
            call_node_id="n/never",
            server="reports",
            tool="quick_lookup",
            arguments={"key": "k1"},
            on_terminal=on_terminal,
        )
    assert type(refused.value).__name__ == "SubmissionRefused"
    expiring = dict(fleet.pipeline.signature("pipeline.record", queue="pipeline", expires=5))
    with pytest.raises(Exception, match="expire unrun"):
        fleet.send(
            "longcall.submit",
            call_node_id="n/never",
            server="reports",
            tool="quick_lookup",
            arguments={"key": "k1"},
            on_terminal=expiring,
        )
    assert fleet.ledger.find_by_call_node("n/never") is None
    with fleet.ledger.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM tool_operation")).scalar_one() == 0
    # A chain of two downstream tasks is taken, and each gets the receipt it names (the first as its
    # keyword, the second after it).
    then = fleet.pipeline.signature("pipeline.record", queue="pipeline") | fleet.pipeline.signature(
        "pipeline.record", queue="pipeline", immutable=True
    )
    answer = fleet.send(
        "longcall.submit",
        call_node_id="n/chain",
        server="reports",
        tool="quick_lookup",
        arguments={"key": "k2"},
        on_terminal=json.loads(json.dumps(then)),
    )
    assert answer["created"] is True
    receipt = fleet.wait_receipt("n/chain")
    support.wait_for("the chain's second task", lambda: len(fleet.deliveries()) >= 2)
    assert receipt["terminal_state"] == "completed"
