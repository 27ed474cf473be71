"""``longcall.submit`` input is validated at the boundary: a clear error, nothing written."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ledger.records import NewOperation
from ledger.routing import RECORDED_DECISION, RecordedDecision
from workers.errors import InvalidSubmission
from workers.rollout import in_canary
from workers.settings import FleetConfig
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
