"""The ledger's database URL and engine: all that ``longcall migrate`` and the Alembic env need."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine


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


def make_engine(url: str, *, pool_size: int = 5, connect_timeout_s: int | None = None) -> Engine:
    """The engine every ledger transaction runs on. ``connect_timeout_s`` bounds a connect (a reader that
    must answer even when the database is down, such as a metrics scrape)."""
    return create_engine(
        normalize_database_url(url),
        # No pre-ping: it would double every ledger transaction. A connection the server dropped fails
        # its statement once (SQLAlchemy then discards the pool's stale connections) and the step is
        # retried under a new claim when its lease runs out; recycling bounds how old a connection gets.
        pool_recycle=600,
        pool_size=pool_size,
        max_overflow=pool_size,
        future=True,
        connect_args={
            **TCP_LIVENESS,
            **({} if connect_timeout_s is None else {"connect_timeout": connect_timeout_s}),
        },
    )
