"""Bad input at the boundary (issue 8, item 18): downstream signatures whose countdown or ETA outlasts the
Redis broker's visibility timeout (Redis would deliver them twice), and input replies over the body limit,
are refused before anything is written."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from workers import delivery, signatures
from workers.app import celery_config, create_app
from workers.errors import ConfigError, InvalidSubmission, RequestRefused
from workers.replies import check_reply, reply_size_refusal
from workers.settings import AMQP_CONSUMER_TIMEOUT_S, REDIS_VISIBILITY_TIMEOUT_S, FleetConfig, Settings
from workers.submission import validate_submission

FLEET = FleetConfig.model_validate(
    {"servers": {"reports": {"protocol": "mcp", "protocol_version": "2025-11-25", "url": "http://h/mcp"}}}
)


def submission(**options: Any) -> dict[str, Any]:
    signature = {"task": "pipeline.next", "args": [], "kwargs": {}, "options": options}
    return {
        "call_node_id": "n/1",
        "server": "reports",
        "tool": "slow_report",
        "arguments": {},
        "on_terminal": signature,
        "on_input": {"task": "pipeline.gate", "options": {}},
    }


def in_hours(hours: float) -> str:
    return (dt.datetime.now(dt.UTC) + dt.timedelta(hours=hours)).isoformat()


REDIS = Settings(broker_url="redis://127.0.0.1:6379/0")
AMQP = Settings(broker_url="amqp://guest@127.0.0.1:5672//")


def validate(kwargs: dict[str, Any], settings: Settings = REDIS) -> None:
    validate_submission(kwargs, FLEET, max_body_bytes=1000, max_delay_s=settings.max_callback_delay_s)


@pytest.mark.parametrize(
    "options",
    [
        {"countdown": 2 * 3600},
        {"countdown": REDIS_VISIBILITY_TIMEOUT_S},
        {"eta": in_hours(2)},
    ],
)
def test_a_signature_that_outlasts_the_visibility_timeout_is_refused_on_redis(
    options: dict[str, Any],
) -> None:
    with pytest.raises(InvalidSubmission, match="visibility timeout"):
        validate(submission(**options))
    on_input = submission()
    on_input["on_input"] = {"task": "pipeline.gate", "options": options}
    with pytest.raises(InvalidSubmission, match="on_input"):
        validate(on_input)


@pytest.mark.parametrize(
    "options",
    [{"countdown": "soon"}, {"countdown": -5}, {"countdown": float("nan")}, {"eta": "tomorrow"}, {"eta": 5}],
)
def test_a_signature_with_a_malformed_delay_is_refused(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidSubmission, match="on_terminal"):
        validate(submission(**options), AMQP)


def test_short_delays_pass_on_both_brokers() -> None:
    validate(submission(countdown=60, expires=7200))
    validate(submission(eta=in_hours(0.1)))
    validate(submission(countdown=20 * 60), AMQP)


@pytest.mark.parametrize("options", [{"countdown": 2 * 3600}, {"countdown": AMQP_CONSUMER_TIMEOUT_S}])
def test_a_signature_that_outlasts_rabbitmqs_consumer_timeout_is_refused(options: dict[str, Any]) -> None:
    # RabbitMQ closes the channel of a consumer that holds a delivery past consumer_timeout (30 min by
    # default): the worker holding the delayed message exits and the message comes back.
    with pytest.raises(InvalidSubmission, match="consumer timeout"):
        validate(submission(**options), AMQP)
    assert AMQP.max_callback_delay_s is not None
    assert AMQP.max_callback_delay_s < AMQP_CONSUMER_TIMEOUT_S


@pytest.mark.parametrize("broker_url", ["redis://127.0.0.1:6379/0", "amqp://guest@127.0.0.1:5672//"])
def test_a_synchronous_bound_longer_than_the_broker_lets_a_delivery_be_held_is_refused_at_start(
    broker_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "longcall.toml"
    settings = Settings(broker_url=broker_url, config=config)
    limit = settings.max_held_delivery_s
    assert limit is not None
    config.write_text(
        '[servers.reports]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\nurl = "http://127.0.0.1:1/mcp"\n'
        f"[servers.reports.tools.slow]\nsync_upper_bound_s = {limit + 1}\n"
        f"[servers.reports.tools.quick]\nsync_upper_bound_s = {limit}\n"
    )
    with pytest.raises(ConfigError, match=r"servers\.reports\.tools\.slow\.sync_upper_bound_s"):
        settings.checked_fleet()
    config.write_text(
        config.read_text().replace(f"sync_upper_bound_s = {limit + 1}", "sync_upper_bound_s = 20")
    )
    assert set(settings.checked_fleet().servers["reports"].tools) == {"slow", "quick"}


def test_the_limit_is_the_brokers_own_visibility_timeout() -> None:
    assert (
        celery_config(REDIS)["broker_transport_options"]["visibility_timeout"] == REDIS_VISIBILITY_TIMEOUT_S
    )
    assert REDIS.max_callback_delay_s is not None
    assert REDIS.max_callback_delay_s < REDIS_VISIBILITY_TIMEOUT_S


def test_a_shorter_visibility_timeout_is_the_brokers_and_bounds_the_countdowns() -> None:
    """LONGCALL_REDIS_VISIBILITY_TIMEOUT_S: how soon a killed worker's messages come back. The broker gets it,
    and what may be held that long shrinks with it (a quarter of it kept as margin)."""
    short = Settings(broker_url="redis://127.0.0.1:6379/0", redis_visibility_timeout_s=20)
    assert celery_config(short)["broker_transport_options"]["visibility_timeout"] == 20
    assert short.max_callback_delay_s == 15
    with pytest.raises(ValidationError):
        Settings(redis_visibility_timeout_s=5)


def test_an_input_reply_over_the_body_limit_is_refused() -> None:
    small = {"action": "accept", "content": {"note": "x" * 10}}
    big = {"action": "accept", "content": {"note": "x" * 2000}}
    assert reply_size_refusal(small, max_body_bytes=1000) is None
    refusal = reply_size_refusal(big, max_body_bytes=1000)
    assert refusal is not None
    assert "LONGCALL_MAX_BODY_BYTES" in refusal
    assert reply_size_refusal({"x": float("nan")}, max_body_bytes=1000) is not None


ENVELOPE_CASES: list[Any] = [
    {"content": [], "isError": False},
    {"structuredContent": {"__type__": "decimal", "__value__": "1.5"}},
    [{"__type__": "datetime", "__value__": "2026-01-01T00:00:00"}],
    {"__type__": "bytes", "__value__": "x"},
    {"__type__": "base64", "__value__": "eA=="},
    {"__type__": "uuid", "__value__": {"hex": "0" * 32}},
    {"__type__": "uuid", "__value__": "not a uuid"},
    {"__type__": "date", "__value__": "not a date"},
    {"__type__": "no-such-type", "__value__": 1},
    {"__type__": "decimal", "__value__": "1", "more": True},
    {"__type__": "decimal"},
    {"a": {"b": [1, 2.5, None, True, "__type__", {"__value__": 3}]}},
    {"1": "one", "two": [], "three": {}},
    "text",
    10**20,
    -0.0,
    None,
    float("nan"),
    {"bad": "\ud800"},
    {"x": object()},
]


@pytest.mark.parametrize("value", ENVELOPE_CASES)
def test_the_json_rule_answers_as_celerys_serializer_does(value: Any) -> None:
    """The engine's rule (``workers.signatures.delivered_unchanged``, no Celery) and the serializer itself
    (``workers.delivery.delivered_unchanged``, kombu's round trip) agree."""
    assert signatures.delivered_unchanged(value) is delivery.delivered_unchanged(value)


def test_a_worker_checks_signatures_with_celery_itself() -> None:
    """A worker's runtime answers with kombu's serializer and Celery's own build (``workers/app.py``); the
    same submission validates to the same operation with or without them."""
    holder = create_app(REDIS).longcall_runtime  # type: ignore[attr-defined]
    assert holder.get().delivery is delivery.CELERY_DELIVERY
    kwargs = submission(countdown=5)
    with_celery = validate_submission(kwargs, FLEET, max_body_bytes=1000, delivery=delivery.CELERY_DELIVERY)
    assert with_celery == validate_submission(kwargs, FLEET, max_body_bytes=1000)
    with pytest.raises(InvalidSubmission, match="is not a signature Celery can build"):
        delivery.buildable("on_terminal", {"task": "celery.chord", "subtask_type": "chord", "kwargs": 5})


@pytest.mark.parametrize(
    ("input_round", "response", "message"),
    [
        (1, ["not", "an", "object"], "response must be the protocol's reply body, a JSON object"),
        (True, {"approved": True}, "input_round must be a whole number"),
        ("1", ["neither"], "response must be the protocol's reply body"),  # the response is checked first
        (1, {"x": "y" * 2000}, r"response is \d+ bytes of JSON; the limit is 1000"),
        (1, {"x": float("nan")}, "response is not JSON"),
    ],
)
def test_an_input_reply_is_refused_at_the_boundary_with_what_was_wrong(
    input_round: Any, response: Any, message: str
) -> None:
    with pytest.raises(RequestRefused, match=message):
        check_reply("op-1", input_round, response, max_body_bytes=1000)
    check_reply("op-1", 1, {"approved": True}, max_body_bytes=1000)
