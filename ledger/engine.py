"""The ledger's database URL and engine: all that ``longcall migrate`` and the Alembic env need."""

from __future__ import annotations

from typing import Any, ClassVar

import psycopg
import psycopg._queries
import psycopg.errors
import sqlalchemy.exc
from psycopg.pq import ExecStatus
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import ExceptionContext


def normalize_database_url(url: str) -> str:
    """Accept the usual ``postgresql://`` spellings and pin the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    raise ValueError(
        f"LONGCALL_DATABASE_URL must be a postgresql:// URL, got {url.split('://', maxsplit=1)[0]}://..."
    )


#: libpq's TCP liveness settings on every ledger connection (ignored on a unix socket): a database host that
#: vanished without closing the connection (a failover, a dropped NAT entry) fails the statement waiting on it
#: within about half a minute instead of the kernel's default of many minutes. Without them, a step, or the
#: lease keeper renewing every claim of its process, could wait on a dead connection for as long.
TCP_LIVENESS = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}


#: psycopg converts a statement's ``%(name)s`` placeholders to ``$n`` with a regular expression, and caches
#: the conversion only for statements up to 4,096 bytes and 50 parameters (its guard against ORMs' one-off
#: multi-row INSERTs). The ledger's guarded write is one statement of about 5 KB (a CTE that reads, writes
#: and appends the event, returning the row) run on every poll, so it was converted afresh each time: about
#: an eighth of the ledger's CPU per poll. The ledger's statements are few and fixed (``ledger/statements.py``
#: caches one per shape), so the bounds are raised for them; the cache stays psycopg's (128 entries).
STATEMENT_CACHE_BOUNDS = {"MAX_CACHED_STATEMENT_LENGTH": 16_384, "MAX_CACHED_STATEMENT_PARAMS": 100}


def cache_long_statements() -> None:
    """Raise psycopg's bounds on the statements whose conversion it caches (never lowers them)."""
    for name, bound in STATEMENT_CACHE_BOUNDS.items():
        current = getattr(psycopg._queries, name, None)
        if isinstance(current, int) and current < bound:
            setattr(psycopg._queries, name, bound)


_RESULT_STATUSES = (ExecStatus.TUPLES_OK, ExecStatus.SINGLE_TUPLE, ExecStatus.TUPLES_CHUNK)


class LedgerCursor(psycopg.Cursor[Any]):
    """psycopg's cursor, with the description of a result shape built once per process.

    SQLAlchemy reads ``cursor.description`` after every statement, and psycopg builds a ``Column`` per
    result column each time (name decoded, type looked up): 43 of them for an operation row, twice per poll,
    a fifth of the ledger's CPU per poll. A result's description is made of its columns' names, type oids
    and type modifiers only, so it is kept per (names, oids, modifiers): the same immutable ``Column``
    objects each time, in a list of its own."""

    _descriptions: ClassVar[dict[tuple[tuple[Any, ...], ...], list[psycopg.Column]]] = {}
    #: A process that runs ad-hoc SQL does not grow the map for ever: past this many shapes, it builds afresh.
    MAX_SHAPES: ClassVar[int] = 512

    @property
    def description(self) -> list[psycopg.Column] | None:
        res = self.pgresult
        if res is None or not (res.nfields or res.status in _RESULT_STATUSES):
            return super().description
        n = res.nfields
        key = (
            tuple(res.fname(i) for i in range(n)),
            tuple(res.ftype(i) for i in range(n)),
            tuple(res.fmod(i) for i in range(n)),
        )
        known = self._descriptions.get(key)
        if known is None:
            known = super().description or []
            if len(self._descriptions) < self.MAX_SHAPES:
                self._descriptions[key] = known
        return list(known)


def no_primary_is_a_disconnect(context: ExceptionContext) -> BaseException | None:
    """A write refused because the server is no primary (``ReadOnlySqlTransaction``, SQLSTATE 25006: a
    demoted primary mid-failover, or a standby that DNS or a pooler still points at) is what a failover looks
    like from here, as much as a dropped connection is: the pool's connections are let go (the next
    statement connects afresh, to the primary once the names point there) and it is raised as an
    ``OperationalError``, which every caller takes for the database out of reach (``ledger.errors
    .UNAVAILABLE``: retried within its bound, never a failure that loses the message). psycopg files it as
    an ``InternalError``, which nothing retries."""
    original = context.original_exception
    if not isinstance(original, psycopg.errors.ReadOnlySqlTransaction):
        return None
    context.is_disconnect = True
    return sqlalchemy.exc.OperationalError(
        context.statement, context.parameters, original, connection_invalidated=True
    )


def make_engine(url: str, *, pool_size: int = 5, connect_timeout_s: int | None = None) -> Engine:
    """The engine every ledger transaction runs on. ``connect_timeout_s`` bounds a connect (a reader that
    must answer even when the database is down, such as a metrics scrape)."""
    cache_long_statements()
    engine = create_engine(
        normalize_database_url(url),
        # No pre-ping: it would double every ledger transaction. A connection the server dropped fails
        # its statement once (SQLAlchemy then discards the pool's stale connections) and the step is
        # retried under a new claim when its lease runs out; recycling bounds how old a connection gets.
        pool_recycle=600,
        pool_size=pool_size,
        max_overflow=pool_size,
        future=True,
        connect_args={
            "cursor_factory": LedgerCursor,
            **TCP_LIVENESS,
            **({} if connect_timeout_s is None else {"connect_timeout": connect_timeout_s}),
        },
    )
    event.listen(engine, "handle_error", no_primary_is_a_disconnect)
    return engine
