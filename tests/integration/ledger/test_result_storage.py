"""A result's stored form, known without asking Postgres when it is the value itself (``jsonb_keeps``).

``Ledger.as_stored`` sends a value to Postgres only when jsonb might give back another one; these tests hold
the shortcut to what jsonb really does: for every value it vouches for, the real round trip gives back the
same canonical JSON, and the values jsonb changes or refuses are never vouched for.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event

from ledger.digests import canonical_json
from ledger.errors import UnstorableResult
from ledger.repository import Ledger
from ledger.results import _STORED_FORM, KEPT_DEPTH, jsonb_keeps


def round_trip(ledger: Ledger, value: Any) -> Any:
    """What Postgres jsonb really gives back for ``value`` (the statement ``as_stored`` asks with)."""
    with ledger.engine.begin() as conn:
        return conn.execute(_STORED_FORM, {"value": value}).scalar_one()


@pytest.fixture
def statements(ledger: Ledger) -> Iterator[list[str]]:
    """The SQL statements the ledger's engine runs while the test runs."""
    seen: list[str] = []
    ledger.as_stored(0)  # the database's encoding, read once per ledger, is not what these tests count

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    event.listen(ledger.engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(ledger.engine, "before_cursor_execute", note)


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


KEPT = [
    None,
    True,
    0,
    -17,
    10**300,
    0.1,
    2.0,
    -3.25,
    1234567890123456.8,
    "",
    "é \u2028 \U0001f600 plain",
    {"b": [1, 2.5, {"c": None}], "a": "x", "": False},
    nested(KEPT_DEPTH),
]

CHANGED_OR_REFUSED = [
    1e16,  # comes back as the integer 10000000000000000
    -0.0,  # comes back as 0.0
    1.5e300,  # comes back as a 301-digit integer
    5e-324,
    1e-7,
    10**1000,  # past KEPT_INT_DIGITS: asked, not vouched for
    "a\x00b",  # refused by jsonb
    {"k\x00": 1},
    [1, {"x": "\x00"}],
    nested(KEPT_DEPTH + 1),
]


@pytest.mark.parametrize("value", KEPT, ids=[json.dumps(v)[:30] for v in KEPT])
def test_a_value_jsonb_keeps_is_stored_as_it_is_without_a_round_trip(
    ledger: Ledger, statements: list[str], value: Any
) -> None:
    assert jsonb_keeps(value)
    stored = ledger.as_stored(value)
    assert stored is value
    assert statements == []  # nothing was asked of Postgres
    assert canonical_json(round_trip(ledger, value)) == canonical_json(value)


@pytest.mark.parametrize("value", CHANGED_OR_REFUSED, ids=[repr(v)[:30] for v in CHANGED_OR_REFUSED])
def test_a_value_jsonb_may_change_or_refuse_is_asked_of_postgres(
    ledger: Ledger, statements: list[str], value: Any
) -> None:
    assert not jsonb_keeps(value)
    with contextlib.suppress(UnstorableResult):  # refused by jsonb: the caller's unstorable path
        ledger.as_stored(value)
    assert len(statements) == 1


def test_on_a_database_not_in_utf8_only_ascii_text_is_vouched_for() -> None:
    """Postgres converts text to a non-UTF8 database's encoding (or refuses it): asked, not vouched for."""
    assert jsonb_keeps({"k": "plain"}, utf8=False)
    assert not jsonb_keeps({"k": "é"}, utf8=False)
    assert not jsonb_keeps({"é": 1}, utf8=False)
    assert jsonb_keeps({"é": "\u2028"}, utf8=True)


def test_the_floats_and_numbers_jsonb_changes_are_the_ones_it_is_not_trusted_with(ledger: Ledger) -> None:
    """The shortcut's reasons, checked on the real server: these do come back changed."""
    assert canonical_json(round_trip(ledger, 1e16)) == "10000000000000000"
    assert canonical_json(round_trip(ledger, -0.0)) == "0.0"
    assert canonical_json(round_trip(ledger, 2.0)) == "2.0"


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=JSON)
def test_every_value_the_shortcut_vouches_for_comes_back_from_jsonb_the_same(
    ledger: Ledger, value: Any
) -> None:
    """Generated JSON (floats of every spelling, strings with NUL and surrogates included): whenever
    ``jsonb_keeps`` says yes, the real round trip agrees."""
    if not jsonb_keeps(value):
        return
    assert canonical_json(round_trip(ledger, value)) == canonical_json(value)
