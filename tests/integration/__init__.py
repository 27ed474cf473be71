"""Integration tests on real Postgres, Redis and worker processes, one folder per subject: ``ledger``,
``steps``, ``fleet``, ``faults``, ``cli``, ``protocols``. Their fixtures (``conftest.py`` here) reach every
folder; their helpers are in ``tests.support``."""
