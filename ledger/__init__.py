"""The Postgres ledger: tables, the state table, guarded transitions, acceptance, outbox, migrations.

Knows Postgres and nothing about HTTP or Celery.
"""
