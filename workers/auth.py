"""Each server's bearer token, as its configuration says, for one worker process (``RemotePool``).

A server with ``auth_env`` / ``auth_file`` (or ``[auth] kind = "bearer"``) has its token read before every
request (``ServerConfig.token``). A server with ``[auth] kind = "oauth_client_credentials"`` has one
:class:`~adapters.ClientCredentialsToken` per process: its tokens cached, renewed before they expire, asked
for on a client of their own (the token endpoint's requests are not the server's traffic: they take none
of its request budget, and are not counted as its requests). Nothing here keeps a secret: the client's
secret and key are read from the environment and the key file at each token request.

:func:`check_credentials` is a worker's start: a variable not set or a key file that cannot be read is
refused then, naming the key, not found on the first call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx2

from adapters import ClientCredentialsToken
from workers.settings import FleetConfig, OAuthClientCredentialsAuth, ServerConfig

__all__ = ["TokenProviders", "check_credentials"]

#: The token endpoint's timeouts: a small form POST and a small JSON answer.
TOKEN_TIMEOUT = httpx2.Timeout(connect=5.0, read=10.0, write=5.0, pool=5.0)


def _resource(url: str) -> str:
    """The server's URL as a resource identifier (RFC 8707): without the ``user:password`` the transport
    sends as basic auth."""
    return str(httpx2.URL(url).copy_with(username=None, password=None))


class TokenProviders:
    """The token providers of one worker process, one per server, made when first asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: httpx2.Client | None = None
        self._providers: dict[str, ClientCredentialsToken] = {}

    def provider(self, name: str, server: ServerConfig) -> Callable[[], str | None]:
        """What the adapters of server ``name`` call before every request for the bearer token."""
        auth = server.auth
        if not isinstance(auth, OAuthClientCredentialsAuth):
            return server.token
        with self._lock:
            provider = self._providers.get(name)
            if provider is None:
                if self._client is None:
                    self._client = httpx2.Client(timeout=TOKEN_TIMEOUT, follow_redirects=False)
                key = f"servers.{name}.auth"
                provider = ClientCredentialsToken(
                    lambda: auth.credentials(key),
                    _resource(server.url),
                    client=self._client,
                    token_url=auth.token_url,
                )
                self._providers[name] = provider
            return provider

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
            self._providers.clear()


def check_credentials(fleet: FleetConfig) -> None:
    """Every OAuth server's variables set and key file readable (a worker's start).

    Raises:
        ConfigError: naming the key (``servers.X.auth.client_secret_env``) and what is missing.
    """
    for name, server in fleet.servers.items():
        if isinstance(server.auth, OAuthClientCredentialsAuth):
            server.auth.credentials(f"servers.{name}.auth")
