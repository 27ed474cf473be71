"""``longcall.submit`` input is validated at the boundary: a clear error, nothing written."""

from __future__ import annotations

from typing import Any

import pytest

from workers.errors import InvalidSubmission
from workers.settings import FleetConfig
from workers.submission import parse_submit_kwargs, validate_submission

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
