"""Alembic's migrations on an empty database: upgrade, downgrade and upgrade again, and the autogenerate
drift guard against the models."""
