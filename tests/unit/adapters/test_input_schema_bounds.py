"""A server-supplied input schema is checked in bounded time (issue 8, item 18): a pathological schema (a
backtracking regex, a deep or huge schema, a reference) or an oversized reply cannot hold a worker."""

from __future__ import annotations

import time
from typing import Any

import pytest

from adapters import InputRequest
from adapters.mcp_2025_11_25.wire import reply_refusal

#: ``^(a+)+$`` against 34 ``a`` and a ``!`` backtracks 2**34 times: hours of CPU in ``re``, with the GIL.
EVIL_PATTERN = {"type": "object", "properties": {"x": {"type": "string", "pattern": "^(a+)+$"}}}
EVIL_CONTENT = {"x": "a" * 34 + "!"}
#: What "bounded" means here: far below what running the pathology takes (hours, or minutes for the
#: unique-items check of 300,000 items), far above a check on a loaded 2-core machine.
BOUND_S = 5.0


def ask(schema: Any) -> InputRequest:
    return InputRequest(request_id=1, method="elicitation/create", params={}, schema=schema, task_id="t")


def timed(schema: Any, content: Any) -> tuple[str | None, float]:
    started = time.perf_counter()
    refusal = reply_refusal(ask(schema), {"action": "accept", "content": content})
    return refusal, time.perf_counter() - started


def test_a_backtracking_pattern_is_refused_without_running_it() -> None:
    refusal, took = timed(EVIL_PATTERN, EVIL_CONTENT)
    assert took < BOUND_S, f"validating the reply took {took:.1f}s"
    assert refusal is not None
    assert "pattern" in refusal


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        (nested(40), "deep"),
        ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}, "bytes"),
        ({"type": "object", "properties": {"x": {"$ref": "https://example.invalid/s.json"}}}, "$ref"),
        ({"type": "object", "patternProperties": {"^(a|a)*$": {"type": "string"}}}, "patternProperties"),
    ],
)
def test_a_schema_beyond_the_bounds_is_refused(schema: dict[str, Any], why: str) -> None:
    refusal, took = timed(schema, {})
    assert took < BOUND_S
    assert refusal is not None
    assert why in refusal, refusal


def test_oversized_content_is_refused_before_it_is_validated() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}
    refusal, took = timed(schema, {"x": list(range(300_000))})
    assert took < BOUND_S, f"validating the reply took {took:.1f}s"
    assert refusal is not None
    assert "bytes" in refusal


def test_the_specs_own_schemas_still_validate() -> None:
    """Every shape of MCP 2025-11-25 ``PrimitiveSchemaDefinition`` is within the bounds."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "name": {
                "type": "string",
                "minLength": 1,
                "maxLength": 40,
                "format": "email",
                "default": "a@b.c",
            },
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "ok": {"type": "boolean", "default": False},
            "pick": {"type": "string", "enum": ["a", "b"], "enumNames": ["A", "B"]},
            "titled": {"type": "string", "oneOf": [{"const": "x", "title": "X"}]},
            "many": {"type": "array", "minItems": 1, "items": {"type": "string", "enum": ["a", "b"]}},
            "many_titled": {"type": "array", "items": {"anyOf": [{"const": "y", "title": "Y"}]}},
        },
        "required": ["name"],
    }
    content = {"name": "a@b.c", "age": 3, "ok": True, "pick": "a", "titled": "x", "many": ["b"]}
    assert reply_refusal(ask(schema), {"action": "accept", "content": content}) is None
    assert reply_refusal(ask(schema), {"action": "accept", "content": {"age": 3}}) is not None
