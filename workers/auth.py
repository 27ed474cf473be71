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
from typing import Any

import httpx2

from adapters import (
    CachedToken,
    ClientCredentialsToken,
    GoogleToken,
    Transient,
    answer_within_transport,
)
from workers.request_outcomes import CountingTransport, RequestOutcomes
from workers.settings import BearerAuth, FleetConfig, GoogleAuth, OAuthClientCredentialsAuth, ServerConfig

__all__ = ["TokenProviders", "check_credentials", "describe_auth"]

#: The token endpoint's timeouts: a small form POST and a small JSON answer.
TOKEN_TIMEOUT = httpx2.Timeout(connect=5.0, read=10.0, write=5.0, pool=5.0)


def _resource(url: str) -> str:
    """The server's URL as a resource identifier (RFC 8707): without the ``user:password`` the transport
    sends as basic auth."""
    return str(httpx2.URL(url).copy_with(username=None, password=None))


class TokenProviders:
    """The token providers of one worker process, one per server, made when first asked for."""

    def __init__(self, outcomes: RequestOutcomes | None = None) -> None:
        self._lock = threading.Lock()
        self._outcomes = outcomes
        self._clients: list[httpx2.Client] = []
        self._providers: dict[str, CachedToken] = {}

    def provider(self, name: str, server: ServerConfig) -> Callable[[], str | None]:
        """What the adapters of server ``name`` call before every request for the bearer token."""
        auth = server.auth
        if not isinstance(auth, OAuthClientCredentialsAuth | GoogleAuth):
            return server.token
        with self._lock:
            provider = self._providers.get(name)
            if provider is None:
                provider = self._made(name, server.url, auth)
                self._providers[name] = provider
            return provider

    def _made(self, name: str, url: str, auth: OAuthClientCredentialsAuth | GoogleAuth) -> CachedToken:
        if isinstance(auth, GoogleAuth):  # google-auth asks Google's token endpoint on its own client
            return GoogleToken(auth.credentials_file, auth.scopes, what=url)
        # Its requests counted as the server's budget "token" (longcall_token_requests_total).
        outcomes = self._outcomes
        # A worker's (``outcomes`` given): every answer, the head included, within its timeout
        # (``adapters.answer_within``). The console's probe keeps httpx2's own, as its probe client does
        # (with the environment's proxies): a person waits there, and can stop it.
        transport = (
            None
            if outcomes is None
            else CountingTransport(answer_within_transport(), name, outcomes, budget="token")
        )
        client = httpx2.Client(timeout=TOKEN_TIMEOUT, follow_redirects=False, transport=transport)
        self._clients.append(client)
        key = f"servers.{name}.auth"
        return ClientCredentialsToken(
            lambda: auth.credentials(key), _resource(url), client=client, token_url=auth.token_url
        )

    def close(self) -> None:
        with self._lock:
            for client in self._clients:
                client.close()
            self._clients.clear()
            self._providers.clear()


def check_credentials(fleet: FleetConfig) -> None:
    """Every OAuth server's variables set and key file readable (a worker's start).

    Raises:
        ConfigError: naming the key (``servers.X.auth.client_secret_env``) and what is missing.
    """
    for name, server in fleet.servers.items():
        if isinstance(server.auth, OAuthClientCredentialsAuth):
            server.auth.credentials(f"servers.{name}.auth")


def _granted(provider: Callable[[], str | None]) -> str:
    """Whether the provider gets a token now (one token request), or why not; never the token."""
    try:
        provider()
    except Transient as exc:  # every failure to get one is a TokenUnavailable (adapters.oauth.CachedToken)
        return f"not granted: {exc}"
    return "granted"


def describe_auth(name: str, server: ServerConfig, providers: TokenProviders) -> dict[str, Any]:
    """How server ``name`` is authorized, for ``longcall adapters --detect``: the kind, and for OAuth the
    authorization server found (or configured) and whether the configured credentials get a token now (one
    token request; never the token, the secret or the key)."""
    auth = server.auth
    if isinstance(auth, GoogleAuth):
        return {"kind": auth.kind, "token": _granted(providers.provider(name, server))}
    if isinstance(auth, OAuthClientCredentialsAuth):
        provider = providers.provider(name, server)
        found: dict[str, Any] = {"kind": auth.kind, "scope": auth.scope, "token": _granted(provider)}
        if not isinstance(provider, ClientCredentialsToken):
            return found
        try:
            where = provider.authorization_server()
        except Transient as exc:
            found["authorization_server"] = f"not found: {exc}"
        else:
            found["authorization_server"] = where.issuer or "(configured token_url)"
            found["token_endpoint"] = where.token_endpoint
            found["token_endpoint_auth_methods"] = list(where.methods)
        return found
    if isinstance(auth, BearerAuth) or server.auth_env is not None or server.auth_file is not None:
        return {"kind": "bearer"}
    return {"kind": "none"}
