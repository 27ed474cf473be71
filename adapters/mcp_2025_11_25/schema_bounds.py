"""A server-supplied input schema is validated in bounded time (issue 8, item 18).

The schema comes from the server and the content from the approval gate; neither is trusted to be small or
kind. ``jsonschema`` runs in this worker's thread with the GIL held, and Python's ``re`` backtracks: one
``"pattern": "^(a+)+$"`` against 30 characters is minutes of CPU that nothing can interrupt. So before any
validation, :func:`bounds_refusal` checks, in time linear in the sizes it has already capped:

* the schema's and the content's JSON size (:data:`MAX_SCHEMA_BYTES`, :data:`MAX_CONTENT_BYTES`) and the
  schema's nesting (:data:`MAX_SCHEMA_DEPTH`);
* keywords whose cost has no bound: regular expressions (``pattern``, ``patternProperties``: not part of
  MCP's elicitation schema subset, ``PrimitiveSchemaDefinition``) and references (``$ref`` and kin: a
  reference may be remote or recursive);
* the work validation may do: at most every content node against every schema node
  (:data:`MAX_VALIDATION_STEPS`), and for ``uniqueItems`` (quadratic in ``jsonschema``) every pair of
  content nodes too.

Every shape of MCP 2025-11-25's ``PrimitiveSchemaDefinition`` is far inside these bounds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

MAX_SCHEMA_BYTES: Final = 64 * 1024
MAX_CONTENT_BYTES: Final = 256 * 1024
MAX_SCHEMA_DEPTH: Final = 12
MAX_VALIDATION_STEPS: Final = 2_000_000

#: Keywords with no bound on their cost; a schema that uses one is refused, never run.
UNBOUNDED_KEYWORDS: Final = frozenset(
    {"pattern", "patternProperties", "$ref", "$dynamicRef", "$recursiveRef"}
)
#: Keywords whose value maps names (not keywords) to subschemas.
_NAMED_SUBSCHEMAS: Final = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})
#: Keywords whose value is data, not schema: never searched for keywords.
_DATA: Final = frozenset(
    {"enum", "const", "default", "examples", "enumNames", "required", "title", "description"}
)


def bounds_refusal(schema: Any, content: Any) -> str | None:
    """Why validating ``content`` against ``schema`` could take unbounded time, or None when it cannot."""
    schema_bytes = _json_size(schema)
    if schema_bytes is None or schema_bytes > MAX_SCHEMA_BYTES:
        return (
            f"the server's schema is {schema_bytes or 'not JSON, or over'} bytes; at most {MAX_SCHEMA_BYTES}"
        )
    content_bytes = _json_size(content)
    if content_bytes is None or content_bytes > MAX_CONTENT_BYTES:
        size = content_bytes or "not JSON, or over"
        return f"the reply's content is {size} bytes; at most {MAX_CONTENT_BYTES}"
    schema_nodes, quadratic = 0, False
    for depth, keyword in _keywords(schema, 1):
        if depth > MAX_SCHEMA_DEPTH:
            return f"the server's schema is nested too deep (more than {MAX_SCHEMA_DEPTH} levels)"
        if keyword in UNBOUNDED_KEYWORDS:
            return (
                f"the server's schema uses {keyword!r}, which cannot be checked in bounded time (regular "
                "expressions and references are not part of MCP's elicitation schemas)"
            )
        schema_nodes += 1
        quadratic = quadratic or keyword == "uniqueItems"
    content_nodes = _count_nodes(content)
    steps = max(schema_nodes, 1) * content_nodes + (content_nodes**2 if quadratic else 0)
    if steps > MAX_VALIDATION_STEPS:
        return (
            f"the reply is too large to check against the server's schema ({steps} steps; at most "
            f"{MAX_VALIDATION_STEPS})"
        )
    return None


def _json_size(value: Any) -> int | None:
    try:
        return len(json.dumps(value, separators=(",", ":"), allow_nan=False).encode("utf-8"))
    except (TypeError, ValueError, RecursionError):
        return None


def _keywords(schema: Any, depth: int) -> Iterator[tuple[int, str]]:
    """Every keyword of ``schema`` with the depth of the subschema it is in (names and data skipped); past
    :data:`MAX_SCHEMA_DEPTH` one empty keyword says so, and the walk goes no deeper."""
    if depth > MAX_SCHEMA_DEPTH:
        yield depth, ""
        return
    if isinstance(schema, list):
        for item in schema:
            yield from _keywords(item, depth + 1)
        return
    if not isinstance(schema, dict):
        return
    for keyword, value in schema.items():
        yield depth, keyword
        if keyword in _DATA:
            continue
        if keyword in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            for subschema in value.values():
                yield from _keywords(subschema, depth + 1)
        else:
            yield from _keywords(value, depth + 1)


def _count_nodes(value: Any) -> int:
    """How many JSON values ``value`` holds (itself included), without recursion."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count
