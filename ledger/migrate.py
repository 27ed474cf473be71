"""Run the ledger's Alembic migrations from code (``longcall migrate``) or from ``alembic.ini``."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

from ledger.engine import normalize_database_url

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # Alembic's config is a ConfigParser: a literal % in a URL must be doubled.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def ensure_database(database_url: str) -> bool:
    """Create the ledger's database when the server does not have it yet; True if it was created."""
    url = make_url(normalize_database_url(database_url))
    if not url.database:
        raise ValueError("LONGCALL_DATABASE_URL names no database")
    engine = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with engine.connect() as conn:
            exists = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": url.database})
            if exists.first() is not None:
                return False
            quoted = conn.dialect.identifier_preparer.quote(url.database)
            conn.execute(text(f"CREATE DATABASE {quoted}"))
            return True
    finally:
        engine.dispose()


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def current_heads(database_url: str) -> tuple[str, ...]:
    return tuple(ScriptDirectory.from_config(alembic_config(database_url)).get_heads())
