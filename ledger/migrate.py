"""Run the ledger's Alembic migrations from code (``longcall migrate``) or from ``alembic.ini``."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # Alembic's config is a ConfigParser: a literal % in a URL must be doubled.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def current_heads(database_url: str) -> tuple[str, ...]:
    return tuple(ScriptDirectory.from_config(alembic_config(database_url)).get_heads())
