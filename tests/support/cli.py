"""``longcall`` commands run in the test's process (click's ``CliRunner``) on an in-process executor's
ledger, Redis, broker prefix and configuration."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from console.main import main
from workers.executor import Executor


def run_cli(monkeypatch: pytest.MonkeyPatch, executor: Executor, *args: str) -> Result:
    """``longcall ARGS`` as an operator on ``executor``'s fleet would run it; its exit code and output."""
    settings = executor.rt.settings
    monkeypatch.setenv("LONGCALL_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("LONGCALL_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("LONGCALL_BROKER_KEYPREFIX", settings.broker_keyprefix)
    monkeypatch.setenv("LONGCALL_CONFIG", str(settings.config))
    return CliRunner().invoke(main, list(args), catch_exceptions=False)
