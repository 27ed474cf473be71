"""The Postgres ledger: tables, the state table, guarded moves, acceptance, outbox, migrations.

Knows Postgres and nothing about HTTP or Celery. ``repository.Ledger`` is the only port to the database;
``states`` and ``events`` are the pure tables its CHECK constraints are generated from; ``records`` the values
it takes and returns; ``moves`` and ``guarded`` the named guarded moves; ``statements`` the SQL; ``engine``
the URL and engine (all that ``migrate`` needs).
"""
