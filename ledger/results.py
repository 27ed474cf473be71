"""A result as the ledger stores it (issue 8, item 3), and how long a contradicted result has lasted (item 1).

A result is stored in ``jsonb`` and read back through psycopg's JSON loader. ``jsonb`` keeps numbers as
``numeric``, so a value does not always come back as it went in: ``1e16`` comes back as the integer
``10000000000000000``, ``-0.0`` as ``0.0``, ``1.5e300`` as a 301-digit integer; and it refuses ``\\u0000`` in
any string. The value a result digest is taken over is therefore the value Postgres gives back
(:meth:`ResultStorage.as_stored`), never the one fetched: what is stored, delivered and digested is one
value, and storing it again changes nothing.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.exc import DataError

from ledger.digests import NotJson, canonical_json
from ledger.errors import UnstorableResult
from ledger.events import EventKind
from ledger.guarded import GuardedWrites
from ledger.statements import EVENT, OP

#: The jsonb round trip, in Postgres itself: the same bind and result processing as the ``result`` column.
_STORED_FORM = select(bindparam("value", type_=OP.c.result.type).cast(OP.c.result.type))


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
        try:
            with self._tx() as conn:
                return conn.execute(_STORED_FORM, {"value": value}).scalar_one()
        except DataError as exc:
            raise UnstorableResult(f"not storable in jsonb: {str(exc.orig).splitlines()[0]}") from exc
        except ValueError as exc:  # read back: e.g. an integer over Python's digit limit
            raise UnstorableResult(f"not readable back from jsonb: {exc}") from exc

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
