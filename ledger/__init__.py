"""The Postgres ledger: tables, the state table, guarded moves, acceptance, outbox, migrations.

Knows Postgres and nothing about HTTP or Celery. ``repository.Ledger`` is the only port to the database;
``states`` and ``events`` are the pure tables its CHECK constraints are generated from; ``records`` the values
it takes and returns; ``moves`` and ``guarded`` the named guarded moves; ``submissions`` and ``acceptance``
rules 1 and 8; ``statements``, ``write_statements`` and ``claim_statements`` the SQL (rendered by ``sql_doc``
in docs/ledger-sql.md); ``errors`` the exception tree; ``engine`` the URL and engine (all that ``migrate``
needs).
"""
