"""``longcall.submit`` input is validated at the boundary: a clear error, nothing written."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, Signature, chain, chord, group
from celery.canvas import _chain
from celery.signals import before_task_publish

from ledger.records import NewOperation, OutboxMessage
from ledger.routing import RECORDED_DECISION, RecordedDecision
from workers.delivery import passed_expiry, publisher
from workers.errors import InvalidSubmission
from workers.rollout import in_canary
from workers.runtime import Runtime
from workers.settings import FleetConfig, Settings
from workers.signatures import JSON_RULE, makes_a_chord
from workers.submission import NotRouted, canary_admission, parse_submit_kwargs, validate_submission

GOOD: dict[str, Any] = {
    "call_node_id": "pipeline-1/report",
    "server": "reports",
    "tool": "slow_report",
    "arguments": {"month": "2026-11"},
    "on_terminal": {"task": "pipeline.next", "args": [], "kwargs": {}, "options": {}},
}


def test_a_good_submission_parses() -> None:
    request = parse_submit_kwargs(GOOD)
    assert (request.call_node_id, request.tool, request.arguments) == (
        "pipeline-1/report",
        "slow_report",
        {"month": "2026-11"},
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"call_node_id": ""}, "call_node_id must not be empty"),
        ({"call_node_id": "   "}, "call_node_id must not be empty"),
        ({"call_node_id": 42}, "call_node_id must be a string"),
        ({"call_node_id": "x" * 600}, "at most 512"),
        ({"call_node_id": "a\x00b"}, "control characters"),
        ({"arguments": [1, 2]}, "arguments must be a JSON object"),
        ({"on_terminal": "pipeline.next"}, "Celery signature as a dict"),
        ({"on_terminal": {"args": []}}, "must name its task"),
        ({"on_terminal": {"task": "t", "link": "x"}}, "does not have"),
        ({"ttl_ms": 0}, "ttl_ms"),
        ({"ttl_ms": True}, "ttl_ms"),
        ({"wait_budget_s": -1}, "wait_budget_s"),
        ({"wait_budget_s": float("nan")}, "wait_budget_s"),
        ({"surprise": 1}, r"unknown argument\(s\) \['surprise'\]"),
    ],
)
def test_bad_input_is_refused_with_a_clear_message(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSubmission, match=message):
        parse_submit_kwargs({**GOOD, **change})


def test_missing_arguments_are_named() -> None:
    with pytest.raises(InvalidSubmission, match=r"needs \['arguments', 'tool'\]"):
        parse_submit_kwargs({"call_node_id": "n", "server": "s"})


FLEET = FleetConfig.model_validate(
    {"servers": {"reports": {"protocol": "mcp", "protocol_version": "2025-11-25", "url": "http://h/mcp"}}}
)


def test_a_good_submission_becomes_the_operation_to_record() -> None:
    new = validate_submission(GOOD, FLEET, max_body_bytes=1024)
    assert (new.call_node_id, new.server, new.tool_name, new.body) == (
        "pipeline-1/report",
        "reports",
        "slow_report",
        {"month": "2026-11"},
    )
    assert (new.protocol, new.protocol_version, new.ttl_ms) == ("mcp", "2025-11-25", 600_000)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"server": "elsewhere"}, "unknown server 'elsewhere'; configured servers: reports"),
        (
            {"arguments": {"text": "x" * 2000}},
            r"bytes of JSON; the limit is 1024 \(LONGCALL_MAX_BODY_BYTES\)",
        ),
        ({"call_node_id": ""}, "call_node_id must not be empty"),
    ],
)
def test_a_submission_the_fleet_cannot_take_is_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSubmission, match=message):
        validate_submission({**GOOD, **change}, FLEET, max_body_bytes=1024)


# ------------------------------------------------------------------ AIP-151: the create route's arguments

AIP_FLEET = FleetConfig.model_validate(
    {
        "servers": {
            "exports": {
                "protocol": "aip151",
                "protocol_version": "v1",
                "url": "http://h",
                "tools": {
                    "run_report": {
                        "create": "POST /v1/projects/{project}/locations/{location}/reports:run",
                        "request_id_field": "requestId",
                    }
                },
            }
        }
    }
)
AIP_GOOD: dict[str, Any] = {
    "call_node_id": "pipeline-1/export",
    "server": "exports",
    "tool": "run_report",
    "arguments": {"project": "demo", "location": 7, "seconds": 1},
}


def test_aip_arguments_that_fill_the_create_route_are_taken() -> None:
    new = validate_submission(AIP_GOOD, AIP_FLEET, max_body_bytes=1024)
    assert (new.protocol, new.body) == ("aip151", {"project": "demo", "location": 7, "seconds": 1})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"seconds": 1}, r"needs the argument\(s\) location, project \(its path placeholders\)"),
        ({"project": "demo", "seconds": 1}, r"needs the argument\(s\) location \("),
        ({"project": "", "location": "eu"}, "project must not be empty"),
        ({"project": "  ", "location": "eu"}, "project must not be empty"),
        ({"project": True, "location": "eu"}, "project must be a string or an integer, got bool"),
        ({"project": ["x"], "location": "eu"}, "project must be a string or an integer, got list"),
        ({"project": "a/b", "location": "eu"}, "project='a/b' would change the path"),
        ({"project": "..", "location": "eu"}, "project='..' would change the path"),
        ({"project": "x..y", "location": "eu"}, "would change the path"),
        ({"project": ".", "location": "eu"}, "project='.' would change the path"),
        ({"project": "p?q=1", "location": "eu"}, "would change the path"),
        ({"project": "p#frag", "location": "eu"}, "would change the path"),
        ({"project": "a\\b", "location": "eu"}, "would change the path"),
    ],
)
def test_aip_arguments_that_do_not_fit_the_create_route_are_refused(
    arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidSubmission, match=message) as refused:
        validate_submission({**AIP_GOOD, "arguments": arguments}, AIP_FLEET, max_body_bytes=1024)
    # The error names the tool, the server and the route.
    assert "'run_report' on server 'exports'" in str(refused.value)
    assert "POST /v1/projects/{project}/locations/{location}/reports:run" in str(refused.value)


def test_mcp_arguments_are_not_held_to_a_route() -> None:
    validate_submission({**GOOD, "arguments": {"project": "a/b"}}, FLEET, max_body_bytes=1024)


# ----------------------------------------------------------- the canary answers from a recorded decision


def _new() -> NewOperation:
    return validate_submission(GOOD, FLEET, max_body_bytes=1024)


def _outside(low: float, high: float) -> str:
    """A call node routed at ``high`` % and not at ``low`` %."""
    return next(f"u/{i}" for i in range(10_000) if in_canary(f"u/{i}", high) and not in_canary(f"u/{i}", low))


def test_a_recorded_not_routed_decision_is_answered_whatever_the_rollout_says() -> None:
    node = _outside(5, 50)
    new = dataclasses.replace(_new(), call_node_id=node)
    admit = canary_admission(FLEET, new)
    recorded = {RECORDED_DECISION: RecordedDecision(routed=False, percent=5).to_json()}
    for rollout in ({"canary_percent": 50}, {"canary_percent": 100, "shadow": True}, {}):
        with pytest.raises(NotRouted) as answer:
            admit({**rollout, **recorded})
        assert answer.value.routing.answer() == {"routed": False, "reason": "canary", "percent": 5}
    # Without the record the same call node is decided by the rollout: routed at 50 %.
    assert admit({"canary_percent": 50}) == new


def test_a_recorded_routed_decision_is_answered_whatever_the_rollout_says() -> None:
    node = _outside(5, 50)
    new = dataclasses.replace(_new(), call_node_id=node)
    recorded = {RECORDED_DECISION: RecordedDecision(routed=True, percent=50).to_json()}
    assert canary_admission(FLEET, new)({"canary_percent": 5, **recorded}) == new
    with pytest.raises(NotRouted):
        canary_admission(FLEET, new)({"canary_percent": 5})


# ----------------------------------------- downstream signatures: published as delivery builds them (rule 9)

#: A Celery app made in this process takes, when it is finalized, the shared tasks of every app made before
#: it: tests/support/pipeline_app.py's pipeline tasks (shared by default) from each fleet started earlier
#: in the same test process, which then warn as duplicates of one another. Nothing to do with what is tested.
PIPELINE_TASKS_SHARED = pytest.mark.filterwarnings("ignore::celery.exceptions.DuplicateTaskNameWarning")

PIPELINE = Celery("pipeline", set_as_current=False)
STEP = PIPELINE.signature("pipeline.next", kwargs={"stage": 1}, queue="pipeline")
AFTER = PIPELINE.signature("pipeline.after", queue="pipeline")


def with_options(signature: Signature[Any], **options: Any) -> Signature[Any]:
    """A copy of ``signature`` with ``options`` added, whatever their type (this module gives bad ones)."""
    changed = signature.clone()
    changed.options.update(options)
    return changed


def in_minutes(minutes: float) -> str:
    return (dt.datetime.now(dt.UTC) + dt.timedelta(minutes=minutes)).isoformat()


def with_terminal(signature: Any, **extra: Any) -> dict[str, Any]:
    return {**GOOD, "on_terminal": json.loads(json.dumps(signature)), **extra}


@pytest.mark.parametrize(
    "signature",
    [
        STEP,
        with_options(STEP, expires=600, countdown=30, priority=5, headers={"trace": "t-1"}),
        chain(STEP, AFTER),
        group(STEP, AFTER),
        chord([STEP, AFTER], AFTER),
        chord(group(STEP, AFTER), AFTER),
        with_options(STEP, link=AFTER, link_error=[AFTER], retry=True),
        chain(STEP, group(AFTER, AFTER)),
        with_options(STEP, expires=in_minutes(24 * 60)),
    ],
    ids=["task", "options", "chain", "group", "chord", "chord-of-group", "links", "chain-of-group", "date"],
)
@PIPELINE_TASKS_SHARED
def test_a_signature_delivery_can_publish_is_taken_as_it_is_and_publishes(signature: Any) -> None:
    kwargs = with_terminal(signature)
    new = validate_submission(kwargs, FLEET, max_body_bytes=100_000)
    assert new.on_terminal == kwargs["on_terminal"]
    assert published(new.on_terminal)


@PIPELINE_TASKS_SHARED
def test_a_signature_dict_without_its_empty_parts_is_completed_so_that_it_can_take_the_receipt() -> None:
    """``{"task": ..., "options": {}}`` builds a signature whose kwargs are None: delivery's
    ``apply_async(kwargs={"receipt": ...})`` raised TypeError for it, every time. It is completed at submit,
    members of a chain too."""
    bare = {"task": "pipeline.gate", "options": {}}
    bare_chain = {**json.loads(json.dumps(chain(STEP, AFTER))), "kwargs": {"tasks": [bare, {"task": "p.x"}]}}
    for given in (bare, {"task": "pipeline.gate", "kwargs": None}, bare_chain):
        new = validate_submission({**GOOD, "on_terminal": given}, FLEET, max_body_bytes=100_000)
        assert new.on_terminal is not None
        assert published(new.on_terminal)
    assert validate_submission({**GOOD, "on_terminal": bare}, FLEET, max_body_bytes=100_000).on_terminal == {
        "task": "pipeline.gate",
        "args": [],
        "kwargs": {},
        "options": {},
    }


@PIPELINE_TASKS_SHARED
def test_a_bare_signature_stored_before_submit_completed_it_is_still_delivered() -> None:
    """An outbox row written before submit completed signatures (a ledger upgraded with rows in it) is
    completed by delivery itself: it used to raise TypeError at every publish, for ever."""
    bare = {"task": "pipeline.gate", "options": {}}
    assert published(bare)
    assert published({**json.loads(json.dumps(group(STEP, AFTER))), "kwargs": {"tasks": [bare, bare]}})
    assert published({"task": "pipeline.gate", "options": {"link": bare}})


def published(stored: dict[str, Any]) -> bool:
    """Whether delivery's own publisher (``workers.delivery.publisher``) sends ``stored`` with a receipt:
    on an in-memory broker (and result store, for a chord), every message it sends seen as it leaves."""
    app = Celery("longcall-probe", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.task_serializer = "json"
    sent: list[str] = []

    def seen(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers is not None and headers.get("longcall_outbox_id") == "7":
            sent.append(str(sender))

    before_task_publish.connect(seen, weak=False)
    try:
        receipt = {"receipt_id": str(uuid.uuid4()), "op_id": str(uuid.uuid4()), "result": None}
        publisher(app)(
            OutboxMessage(7, "terminal", uuid.uuid4(), None, {"signature": stored, "receipt": receipt}, 0)
        )
    finally:
        before_task_publish.disconnect(seen)
        app.close()
    return len(sent) > 0


@pytest.mark.parametrize(
    ("signature", "message"),
    [
        # Routes the broker may lack: refused (longcall sends by queue only).
        (with_options(STEP, exchange="pipeline.topic"), r"on_terminal: exchange refused: .* by queue"),
        (with_options(STEP, exchange_type="topic"), "exchange_type refused"),
        (with_options(STEP, routing_key="reports.done"), "routing_key refused"),
        (chain(STEP, with_options(AFTER, exchange="x")), r"on_terminal\.kwargs\.tasks\[1\]: exchange"),
        (chord([STEP], with_options(AFTER, routing_key="r")), r"on_terminal\.kwargs\.body: routing_key"),
        # Expiries shorter than delivery can take.
        (with_options(STEP, expires=5), r"expires=5s would let the message expire unrun"),
        (with_options(STEP, expires=80, countdown=60), r"at least 120s here"),
        (with_options(STEP, expires=0), "expires must be a positive number"),
        (with_options(STEP, expires=in_minutes(30)), "comes before the receipt can be sent"),
        (group(STEP, with_options(AFTER, expires=in_minutes(90))), r"group.*tasks\[1\]|tasks\[1\]"),
        (with_options(STEP, expires="next week"), "expires must be an ISO 8601 date"),
        # Options that are not JSON-safe Celery message options, or that would never arrive.
        (with_options(STEP, producer="p"), r"options \['producer'\] are not Celery message options"),
        (with_options(STEP, serializer="pickle"), "serializer must be json"),
        (with_options(STEP, priority="high"), "priority must be a whole number"),
        (with_options(STEP, delivery_mode=1), "delivery_mode must be persistent"),
        (with_options(STEP, compression="brotli"), "compression must be one of"),
        (with_options(STEP, retry_policy={"max_retries": -1}), r"retry_policy\.max_retries"),
        (with_options(STEP, time_limit="long"), "time_limit must be a positive number"),
        (with_options(STEP, queue=""), "queue must be a non-empty string"),
        (with_options(STEP, link={"task": "pipeline.x", "options": {"exchange": "e"}}), r"options\.link"),
        # Shapes Celery cannot publish with a receipt.
        (group(), r"on_terminal\.kwargs\.tasks must be a non-empty list"),
        (
            {**chain(STEP, AFTER), "kwargs": {"tasks": [dict(STEP), {"args": []}]}},
            r"on_terminal\.kwargs\.tasks\[1\] must name its task",
        ),
        ({**STEP, "subtask_type": "xmap"}, "subtask_type 'xmap' cannot take a receipt"),
        ({**STEP, "task": "celery.chain"}, "do not go together"),
        (STEP.clone(kwargs={"when": {"__type__": "datetime", "__value__": "2026-01-01"}}), "__type__"),
    ],
)
def test_a_signature_that_would_never_be_delivered_is_refused_at_submit(signature: Any, message: str) -> None:
    with pytest.raises(InvalidSubmission, match=message):
        validate_submission(with_terminal(signature), FLEET, max_body_bytes=100_000)


def test_on_input_is_held_to_the_same_checks() -> None:
    kwargs = {**GOOD, "on_input": json.loads(json.dumps(with_options(STEP, routing_key="gate")))}
    with pytest.raises(InvalidSubmission, match=r"^on_input: routing_key refused"):
        validate_submission(kwargs, FLEET, max_body_bytes=100_000)


def test_an_expiry_date_is_held_to_the_submissions_own_wait_budget() -> None:
    # 110 minutes from now: too early for the server's default hour of budget and the delivery margin's hour,
    # fine for a budget of ten minutes.
    signature = with_options(STEP, expires=in_minutes(110))
    with pytest.raises(InvalidSubmission, match="3600s from now"):
        validate_submission(with_terminal(signature), FLEET, max_body_bytes=100_000)
    validate_submission(with_terminal(signature, wait_budget_s=600), FLEET, max_body_bytes=100_000)


@pytest.mark.parametrize(
    ("signature", "a_chord"),
    [
        (chord([STEP, AFTER], STEP), True),
        (chain(group(STEP, AFTER), STEP), True),  # Celery sends a group followed by a task as a chord
        (chain(STEP, group(STEP, AFTER)), False),
        (group(STEP, AFTER), False),
        (STEP, False),
    ],
)
def test_a_chord_is_refused_at_submit_where_the_result_backend_keeps_no_chord_state(
    signature: Any, a_chord: bool
) -> None:
    """Beside a Redis Cluster with a RabbitMQ broker the result backend is rpc://, where Celery refuses to
    send a chord: one would be dead-lettered after its attempts once the operation ended. It is refused
    while the caller is there to hear it; elsewhere, and whatever is no chord, is taken."""
    kwargs = with_terminal(json.loads(json.dumps(signature)))
    no_chords = dataclasses.replace(JSON_RULE, chords=False)
    if a_chord:
        with pytest.raises(InvalidSubmission, match="keeps no chord state"):
            validate_submission(kwargs, FLEET, max_body_bytes=100_000, delivery=no_chords)
    else:
        validate_submission(kwargs, FLEET, max_body_bytes=100_000, delivery=no_chords)
    validate_submission(kwargs, FLEET, max_body_bytes=100_000)  # a result backend that keeps chords


def test_the_runtime_takes_no_chord_where_its_result_backend_is_rpc(tmp_path: Path) -> None:
    config = tmp_path / "longcall.toml"
    config.write_text(
        '[servers.reports]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\nurl = "http://127.0.0.1:1/mcp"\n'
    )
    beside_a_cluster = Settings(
        redis_url="redis://10.0.0.1:7000/0", redis_cluster=True, broker_url="amqp://rabbit//", config=config
    )
    assert Runtime.from_settings(beside_a_cluster).delivery.chords is False
    alone = Settings(redis_url="redis://cache:6379/1", broker_url="amqp://rabbit//", config=config)
    assert Runtime.from_settings(alone).delivery.chords is True


@pytest.mark.parametrize(
    ("signature", "a_chord"),
    [
        (_chain(_chain(STEP, group(STEP, AFTER)), AFTER), True),  # flattened by Celery, then joined
        (chain(group(STEP), AFTER), False),  # a group of one is sent as its task
    ],
)
def test_a_chord_is_told_as_celery_sends_it(signature: Any, a_chord: bool) -> None:
    assert makes_a_chord(json.loads(json.dumps(signature))) is a_chord


def test_an_error_callbacks_expiry_does_not_hold_up_the_delivery() -> None:
    past = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)).isoformat()
    errback = PIPELINE.signature("pipeline.failed", queue="pipeline")
    errback.options["expires"] = past
    stored = json.loads(json.dumps(STEP.clone(link_error=errback)))
    assert passed_expiry(stored) is None
    expiring = STEP.clone()
    expiring.options["expires"] = past
    assert passed_expiry(json.loads(json.dumps(expiring))) is not None
