"""Where a server's bearer token comes from (issue 8, item 16): ``auth_env`` or ``auth_file``, read at every
request through the adapter's token provider (the file again whenever it changed), so a rotated token needs
no restart."""

from __future__ import annotations

import os
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
    path.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        server.token()


def test_an_unchanged_auth_file_is_not_read_again_and_a_changed_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status read costs a ``stat`` of the token file, not an open and a read (issue 21); any change, even
    to a token of the same length, is read at the next request."""
    path = tmp_path / "token"
    path.write_text("token-A")
    server = ServerConfig.model_validate({**BASE, "auth_file": str(path)})
    reads: list[Path] = []
    read_text = Path.read_text

    def counted(self: Path, encoding: str | None = None, errors: str | None = None) -> str:
        reads.append(self)
        return read_text(self, encoding, errors)

    monkeypatch.setattr(Path, "read_text", counted)
    assert [server.token() for _ in range(3)] == ["token-A"] * 3
    assert reads == [path]
    path.write_text("token-B")  # the same length
    os.utime(path, ns=(1, 1))  # however coarse the file system's clock: another modification time
    assert server.token() == "token-B"
    swapped = tmp_path / "swapped"
    swapped.write_text("token-C")
    os.utime(swapped, ns=(1, 1))  # the same length and times as before: another file (a secret's swap)
    swapped.replace(path)
    assert server.token() == "token-C"
    assert len(reads) == 3


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
