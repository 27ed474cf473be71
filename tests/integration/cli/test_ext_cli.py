"""``longcall adapters`` with both MCP generations configured: the probed generation of each server
(``--detect``), a server that does not speak its configured version said so, and the extension's
adapter version disabled and enabled by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from console.main import main
from ledger.repository import Ledger
from tests.support.ext_fleet import ext_config, start_ext_demo_server
from tests.support.fleet import McpServer, fleet_config, start_mcp_server


@pytest.fixture
def servers(log_dir: Path) -> Iterator[tuple[McpServer, McpServer]]:
    legacy = start_mcp_server(log_dir)
    modern = start_ext_demo_server(log_dir)
    try:
        yield legacy, modern
    finally:
        modern.process.stop()
        legacy.process.stop()


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


def test_adapters_detect_shows_each_servers_generation(
    monkeypatch: pytest.MonkeyPatch,
    database_url: str,
    ledger: Ledger,
    tmp_path: Path,
    servers: tuple[McpServer, McpServer],
) -> None:
    legacy, modern = servers
    config = tmp_path / "longcall.toml"
    mismatched = ext_config(legacy.url).replace("[servers.tasks_ext]", "[servers.mismatched]")
    config.write_text(fleet_config(legacy.url) + ext_config(modern.url) + mismatched)
    monkeypatch.setenv("LONGCALL_DATABASE_URL", database_url)
    monkeypatch.setenv("LONGCALL_CONFIG", str(config))

    code, output = run("adapters", "--detect", "--json")
    assert code == 0, output
    answer = json.loads(output)
    assert {row["adapter"] for row in answer["adapters"]} >= {"mcp/2025-11-25", "mcp/2026-07-28"}
    found = {row["server"]: row for row in answer["servers"]}
    assert (found["reports"]["generation"], found["reports"]["speaks_configured"]) == ("2025-11-25", True)
    assert (found["tasks_ext"]["generation"], found["tasks_ext"]["tasks"]) == ("2026-07-28", True)
    assert found["tasks_ext"]["speaks_configured"] is True
    assert (found["mismatched"]["configured"], found["mismatched"]["generation"]) == (
        "2026-07-28",
        "2025-11-25",
    )
    assert found["mismatched"]["speaks_configured"] is False

    code, text = run("adapters", "--detect")
    assert code == 0, text
    assert "does NOT speak the configured version" in " ".join(text.split())  # the console wraps lines

    code, output = run("adapters", "--disable", "mcp/2026-07-28", "--json")
    assert code == 0, output
    assert {row["adapter"]: row["disabled"] for row in json.loads(output)} == {
        "aip151/v1": False,
        "mcp/2025-11-25": False,
        "mcp/2026-07-28": True,
    }
    assert ledger.control().disabled_adapters == ("mcp/2026-07-28",)
