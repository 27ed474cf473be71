"""``[servers.X.auth]`` (issue 23): the kinds and their keys, refused at start with the key named; the
secrets read from the environment and the key file when a token is asked for, never kept in the settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from workers.auth import TokenProviders, check_credentials
from workers.errors import ConfigError
from workers.settings import BearerAuth, FleetConfig, GoogleAuth, OAuthClientCredentialsAuth

SERVER = """
[servers.reports]
protocol = "mcp"
protocol_version = "2025-11-25"
url = "https://reports.example/mcp"
"""
SECRET_AUTH = """
[servers.reports.auth]
kind = "oauth_client_credentials"
client_id_env = "REPORTS_CLIENT_ID"
client_secret_env = "REPORTS_CLIENT_SECRET"
scope = "reports.run"
"""


def _fleet(tmp_path: Path, body: str) -> FleetConfig:
    path = tmp_path / "longcall.toml"
    path.write_text(body)
    return FleetConfig.from_toml(path)


def test_each_kind_loads(tmp_path: Path) -> None:
    oauth = _fleet(tmp_path, SERVER + SECRET_AUTH).servers["reports"].auth
    assert isinstance(oauth, OAuthClientCredentialsAuth)
    assert (oauth.client_id_env, oauth.scope, oauth.token_url) == ("REPORTS_CLIENT_ID", "reports.run", None)
    key = SECRET_AUTH.replace(
        'client_secret_env = "REPORTS_CLIENT_SECRET"', 'private_key_file = "/k.pem"\nkey_id = "k1"'
    )
    jwt = _fleet(tmp_path, SERVER + key).servers["reports"].auth
    assert isinstance(jwt, OAuthClientCredentialsAuth)
    assert (jwt.private_key_file, jwt.key_id) == (Path("/k.pem"), "k1")
    bearer = _fleet(tmp_path, SERVER + '[servers.reports.auth]\nkind = "bearer"\ntoken_env = "T"\n')
    assert isinstance(bearer.servers["reports"].auth, BearerAuth)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ('kind = "oauth_client_credentials"', 'kind = "kerberos"'),
            r"servers\.reports\.auth.*oauth_client_credentials",
        ),
        (("scope =", "scopes ="), r"servers\.reports\.auth\.oauth_client_credentials\.scopes: unknown key"),
        (('"REPORTS_CLIENT_SECRET"', '"s3cret value"'), "NAME of an environment variable"),
        (
            (
                'client_secret_env = "REPORTS_CLIENT_SECRET"',
                'client_secret_env = "S"\nprivate_key_file = "/k"',
            ),
            "client_secret_env or private_key_file",
        ),
        (
            ('client_secret_env = "REPORTS_CLIENT_SECRET"', 'client_secret_env = "S"\nkey_id = "k1"'),
            "key_id goes with",
        ),
        (('scope = "reports.run"', 'token_url = "ftp://x"'), r"token_url"),
        (
            ('scope = "reports.run"', 'token_url = "http://auth.example/token"'),
            r"token_url: Value error, must be https",
        ),
        (
            ('scope = "reports.run"', 'token_url = "https://u:p@auth.example/token"'),
            r"token_url: .*no user:password",
        ),
        (
            ('scope = "reports.run"', 'token_endpoint_auth_method = "private_key_jwt"'),
            "private_key_jwt needs private_key_file",
        ),
    ],
)
def test_a_bad_auth_table_is_refused_naming_the_key(
    tmp_path: Path, change: tuple[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _fleet(tmp_path, SERVER + SECRET_AUTH.replace(*change, 1))


def test_auth_and_auth_env_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[auth\] or auth_env / auth_file, not both"):
        _fleet(tmp_path, SERVER + 'auth_env = "T"\n' + SECRET_AUTH)


def test_a_variable_not_set_is_refused_at_a_workers_start_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = _fleet(tmp_path, SERVER + SECRET_AUTH)
    monkeypatch.setenv("REPORTS_CLIENT_ID", "reports-worker")
    monkeypatch.delenv("REPORTS_CLIENT_SECRET", raising=False)
    with pytest.raises(
        ConfigError, match=r"servers\.reports\.auth\.client_secret_env 'REPORTS_CLIENT_SECRET'"
    ):
        check_credentials(fleet)
    monkeypatch.setenv("REPORTS_CLIENT_SECRET", "s3cret")
    check_credentials(fleet)
    assert "s3cret" not in repr(fleet)


def test_the_key_file_is_read_when_a_token_is_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pem = tmp_path / "reports.pem"
    auth = SECRET_AUTH.replace('client_secret_env = "REPORTS_CLIENT_SECRET"', f'private_key_file = "{pem}"')
    fleet = _fleet(tmp_path, SERVER + auth)
    monkeypatch.setenv("REPORTS_CLIENT_ID", "reports-worker")
    with pytest.raises(ConfigError, match=r"servers\.reports\.auth\.private_key_file .* cannot be read"):
        check_credentials(fleet)
    pem.write_text("not a key")
    with pytest.raises(ConfigError, match="holds no PEM private key"):
        check_credentials(fleet)
    key = ec.generate_private_key(ec.SECP256R1())
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    server = fleet.servers["reports"]
    assert isinstance(server.auth, OAuthClientCredentialsAuth)
    credentials = server.auth.credentials("servers.reports.auth")
    assert (credentials.client_id, credentials.secret, credentials.scope) == (
        "reports-worker",
        None,
        "reports.run",
    )
    assert credentials.private_key_pem is not None
    assert "PRIVATE" not in repr(credentials)


def test_one_provider_per_server_and_process_and_the_static_token_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet = _fleet(
        tmp_path,
        SERVER + SECRET_AUTH + '[servers.plain]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\n'
        'url = "http://127.0.0.1:9/mcp"\nauth_env = "PLAIN_TOKEN"\n',
    )
    monkeypatch.setenv("PLAIN_TOKEN", "plain-token")
    providers = TokenProviders()
    try:
        reports = providers.provider("reports", fleet.servers["reports"])
        assert providers.provider("reports", fleet.servers["reports"]) is reports
        assert providers.provider("plain", fleet.servers["plain"])() == "plain-token"
    finally:
        providers.close()


def test_the_google_kind_loads_with_the_cloud_platform_scope_by_default(tmp_path: Path) -> None:
    fleet = _fleet(
        tmp_path,
        '[servers.exports]\nprotocol = "aip151"\nprotocol_version = "v1"\nurl = "https://exports.example"\n'
        '[servers.exports.auth]\nkind = "google"\n',
    )
    auth = fleet.servers["exports"].auth
    assert isinstance(auth, GoogleAuth)
    assert (auth.credentials_file, auth.scopes) == (None, ["https://www.googleapis.com/auth/cloud-platform"])
    with pytest.raises(
        ConfigError, match=r"servers\.reports\.auth\.google\.scopes: List should have at least 1"
    ):
        _fleet(tmp_path, SERVER + '[servers.reports.auth]\nkind = "google"\nscopes = []\n')
