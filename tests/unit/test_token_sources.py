"""Where a server's bearer token comes from (issue 8, item 16): ``auth_env`` or ``auth_file``, read at every
request through the adapter's token provider, so a rotated token needs no restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.errors import ConfigError
from workers.remote import RemotePool
from workers.settings import FleetConfig, ServerConfig

BASE = {"protocol": "mcp", "protocol_version": "2025-11-25", "url": "http://u:pw@127.0.0.1:9/mcp"}


def test_auth_env_is_read_at_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    server = ServerConfig.model_validate({**BASE, "auth_env": "REPORTS_TOKEN"})
    monkeypatch.setenv("REPORTS_TOKEN", "token-A")
    assert server.token() == "token-A"
    monkeypatch.setenv("REPORTS_TOKEN", "token-B")
    assert server.token() == "token-B"
    monkeypatch.setenv("REPORTS_TOKEN", "")
    with pytest.raises(ConfigError, match="empty"):
        server.token()


def test_auth_file_is_read_at_every_call(tmp_path: Path) -> None:
    path = tmp_path / "token"
    server = ServerConfig.model_validate({**BASE, "auth_file": str(path)})
    with pytest.raises(ConfigError, match="cannot be read"):
        server.token()
    path.write_text("token-A\n")
    assert server.token() == "token-A"
    path.write_text("token-B")
    assert server.token() == "token-B"


def test_auth_env_and_auth_file_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        ServerConfig.model_validate({**BASE, "auth_env": "T", "auth_file": str(tmp_path / "t")})


def test_the_pool_gives_the_adapter_a_provider_not_a_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the adapter reads no token (an empty variable no longer fails it): each request does."""
    monkeypatch.delenv("REPORTS_TOKEN", raising=False)
    fleet = FleetConfig.model_validate({"servers": {"reports": {**BASE, "auth_env": "REPORTS_TOKEN"}}})
    pool = RemotePool(fleet)
    try:
        adapter = pool.adapter("reports")
        assert adapter.name == "reports"
    finally:
        pool.close()
