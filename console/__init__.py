"""The operator's wing: the ``longcall`` command and every tool a worker process never runs.

A worker process loads ``workers/`` (and ``ledger/``, ``adapters/``, ``beat_schedule``), never this
package (tests/unit/test_layers.py checks both the imports and what a worker's imports load). This package
may import all of them, Celery included: the command sends its requests to the fleet by task name.
"""
