"""A result as the ledger stores it (issue 8, item 3), and how long a contradicted result has lasted (item 1).

A result is stored in ``jsonb`` and read back through psycopg's JSON loader. ``jsonb`` keeps numbers as
``numeric``, so a value does not always come back as it went in: ``1e16`` comes back as the integer
``10000000000000000``, ``-0.0`` as ``0.0``, ``1.5e300`` as a 301-digit integer; and it refuses ``\\u0000`` in
any string. The value a result digest is taken over is therefore the value Postgres gives back
(:meth:`ResultStorage.as_stored`), never the one fetched: what is stored, delivered and digested is one
value, and storing it again changes nothing.

Most results need no round trip to learn that: a value made only of strings without ``\\u0000``, integers
of a sane size, floats Python spells without an exponent (``0.1``, ``2.0``; not ``1e16`` nor ``-0.0``),
booleans, nulls, and arrays and objects of those (string keys, bounded nesting) comes back from jsonb as it
went in (:func:`jsonb_keeps`). Only the rest is sent to Postgres to ask. ``accept_terminal`` still compares
the digest with the stored value's, so a value judged wrongly here is refused there, never accepted.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.exc import DataError

from ledger.digests import canonical_json
from ledger.errors import NotJson, UnstorableResult
from ledger.events import EventKind
from ledger.guarded import GuardedWrites
from ledger.statements import EVENT, OP

#: The jsonb round trip, in Postgres itself: the same bind and result processing as the ``result`` column.
_STORED_FORM = select(bindparam("value", type_=OP.c.result.type).cast(OP.c.result.type))

_SERVER_ENCODING = select(func.current_setting("server_encoding"))

#: The deepest nesting :func:`jsonb_keeps` vouches for; deeper values ask Postgres (its parser has a stack
#: depth limit of its own).
KEPT_DEPTH = 64
#: Integers of up to this many digits come back as they are (Python reads back at most 4300 by default).
KEPT_INT_DIGITS = 1000
_KEPT_INT_BOUND = 10**KEPT_INT_DIGITS


def jsonb_keeps(value: Any, *, utf8: bool = True) -> bool:
    """Whether Postgres jsonb gives ``value`` back unchanged (the same canonical JSON), known without asking
    it. True only for values made of: ``None``, booleans, integers under :data:`KEPT_INT_DIGITS` digits,
    finite floats whose ``repr`` has no exponent and that are not ``-0.0`` (jsonb keeps a number's digits
    and scale, and those are the digits Python reads back), strings without ``\\u0000`` that are Unicode
    text, lists of these, and dicts of these with string keys, nested at most :data:`KEPT_DEPTH`
    deep; on a database whose encoding is not UTF8 (``utf8=False``), strings of ASCII only. False means
    "ask Postgres", not "unstorable"."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if item is None or item is True or item is False:
            continue
        kind = type(item)
        if kind is str:
            if "\x00" in item or not _is_text(item) or not (utf8 or item.isascii()):
                return False
        elif kind is int:
            if not -_KEPT_INT_BOUND < item < _KEPT_INT_BOUND:
                return False
        elif kind is float:
            if not math.isfinite(item) or (item == 0 and math.copysign(1.0, item) < 0) or "e" in repr(item):
                return False
        elif kind is dict:
            if depth >= KEPT_DEPTH:
                return False
            for key, child in item.items():
                if type(key) is not str or "\x00" in key or not _is_text(key) or not (utf8 or key.isascii()):
                    return False
                pending.append((child, depth + 1))
        elif kind is list:
            if depth >= KEPT_DEPTH:
                return False
            pending.extend((child, depth + 1) for child in item)
        else:
            return False
    return True


def _is_text(value: str) -> bool:
    """No lone surrogate: encodable as UTF-8 (what jsonb stores)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class ResultStorage(GuardedWrites):
    """The result's storage questions; ``Ledger`` inherits them."""

    def as_stored(self, value: Any) -> Any:
        """``value`` as the ledger stores it and gives it back (one jsonb round trip in Postgres).

        Raises:
            UnstorableResult: not JSON (NaN, an infinity, a lone surrogate, a non-string key), or refused
                by jsonb (``\\u0000``), or not readable back.
        """
        try:
            canonical_json(value)
        except NotJson as exc:
            raise UnstorableResult(f"not JSON: {exc}") from exc
        if jsonb_keeps(value, utf8=self._utf8_database()):
            return value
        try:
            with self._tx() as conn:
                return conn.execute(_STORED_FORM, {"value": value}).scalar_one()
        except DataError as exc:
            raise UnstorableResult(f"not storable in jsonb: {str(exc.orig).splitlines()[0]}") from exc
        except ValueError as exc:  # read back: e.g. an integer over Python's digit limit
            raise UnstorableResult(f"not readable back from jsonb: {exc}") from exc

    def _utf8_database(self) -> bool:
        """Whether the ledger database stores text as UTF8 (read once: a database keeps its encoding)."""
        utf8: bool | None = getattr(self, "_utf8", None)
        if utf8 is None:
            with self._tx() as conn:
                utf8 = conn.execute(_SERVER_ENCODING).scalar_one() == "UTF8"
            self._utf8 = utf8
        return utf8

    def contradictions_since_fetch(self, op_id: uuid.UUID) -> tuple[int, float | None]:
        """How many ``result_contradicts_status`` events the operation has had since its result fetch
        began (its latest ``fetching_result`` event), and the seconds since the first of them (None when
        there is none), by the database's clock."""
        started = (
            select(func.coalesce(func.max(EVENT.c.seq), 0))
            .where(EVENT.c.op_id == op_id, EVENT.c.kind == EventKind.FETCHING_RESULT.value)
            .scalar_subquery()
        )
        query = select(
            func.count(),
            func.extract("epoch", func.now() - func.min(EVENT.c.at)),
        ).where(
            EVENT.c.op_id == op_id,
            EVENT.c.kind == EventKind.RESULT_CONTRADICTS_STATUS.value,
            EVENT.c.seq > started,
        )
        with self._tx() as conn:
            count, elapsed = conn.execute(query).one()
        return int(count), None if elapsed is None else float(elapsed)
