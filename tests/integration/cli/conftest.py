"""The ``longcall`` command's environment for the CLI tests: this test's ledger, broker prefix and a
configuration file naming one server (never reached: the tests here read and write the ledger)."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFIG = """
[servers.reports]
protocol = "mcp"
protocol_version = "2025-11-25"
url = "http://127.0.0.1:9/mcp"
"""


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch, database_url: str, broker_prefix: str, tmp_path: Path) -> None:
    config = tmp_path / "longcall.toml"
    config.write_text(CONFIG)
    monkeypatch.setenv("LONGCALL_DATABASE_URL", database_url)
    monkeypatch.setenv("LONGCALL_BROKER_KEYPREFIX", broker_prefix)
    monkeypatch.setenv("LONGCALL_CONFIG", str(config))
