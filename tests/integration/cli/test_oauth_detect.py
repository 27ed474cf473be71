"""``longcall adapters --detect`` on an OAuth-protected server (issue 23): what the server requires (its
authorization server and token endpoint, discovered) and whether the configured credentials get a token;
never the token nor the secret. Against the real peers (tests/conformance/oauth_peer.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

from console.main import main
from ledger.repository import Ledger
from tests.conformance.oauth_peer import OAuthPeer, start_oauth_peer
from tests.support.oauth_fleet import CLIENT_ID_ENV, CLIENT_SECRET_ENV, SECURED, secured_config


@pytest.fixture
def peer(log_dir: Path) -> Iterator[OAuthPeer]:
    with contextmanager(start_oauth_peer)(log_dir) as running:
        yield running


def detect(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, database_url: str, peer: OAuthPeer, secret: str
) -> str:
    config = tmp_path / "longcall.toml"
    config.write_text(secured_config(peer.mcp_url))
    monkeypatch.setenv("LONGCALL_DATABASE_URL", database_url)
    monkeypatch.setenv("LONGCALL_CONFIG", str(config))
    monkeypatch.setenv(CLIENT_ID_ENV, "basic")
    monkeypatch.setenv(CLIENT_SECRET_ENV, secret)
    result = CliRunner().invoke(main, ["adapters", "--detect", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def test_detect_names_the_authorization_server_and_says_the_credentials_get_a_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, database_url: str, ledger: Ledger, peer: OAuthPeer
) -> None:
    secret = peer.clients["basic"].secret
    assert secret is not None
    output = detect(monkeypatch, tmp_path, database_url, peer, secret)
    [server] = json.loads(output)["servers"]
    assert server["server"] == SECURED
    assert server["probed"] is True  # the generation probe went through with the token
    auth = server["auth"]
    assert auth["kind"] == "oauth_client_credentials"
    assert auth["token"] == "granted"
    assert auth["token_endpoint"] == peer.token_url
    assert auth["authorization_server"].rstrip("/") == peer.issuer
    assert "client_secret_basic" in auth["token_endpoint_auth_methods"]
    for issued in peer.issued_tokens():
        assert issued not in output
    assert secret not in output


def test_detect_says_why_wrong_credentials_get_no_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, database_url: str, ledger: Ledger, peer: OAuthPeer
) -> None:
    output = detect(monkeypatch, tmp_path, database_url, peer, "not-the-secret")
    [server] = json.loads(output)["servers"]
    assert server["auth"]["token"].startswith("not granted: the token endpoint")
    assert "invalid_client" in server["auth"]["token"]
    assert server["probed"] is False
    assert server["detail"].startswith("no bearer token, nothing sent")
    assert "not-the-secret" not in output
