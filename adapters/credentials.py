"""How every transport authenticates a request: the bearer token as it is now, else the URL's basic auth.

A bearer token is a value, or a provider called before every request (a rotated token is used from then
on). ``user:password`` in a server's URL is taken out of the URL and sent as a basic-auth header: never as
a part of the URL that httpx2 would log (its INFO line names every request's URL) or put into an error.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import httpx2

from adapters.errors import AdapterError, NoBearerToken, TokenRenewed, Transient, Unauthorized
from adapters.oauth import challenge_params

__all__ = ["BearerToken", "Credentials", "RenewableToken"]

#: A token, or a provider of the token as it is now (None: no token).
BearerToken = str | Callable[[], str | None] | None


@runtime_checkable
class RenewableToken(Protocol):
    """A token provider that can be told its token was refused (``adapters.oauth.ClientCredentialsToken``)."""

    def __call__(self) -> str | None: ...

    def renew(self, refused: str | None, *, resource_metadata_url: str | None = None) -> bool:
        """Drop ``refused``; True when a new token is worth a second request (a fresh token refused in its
        turn is not renewed again)."""


@dataclass(frozen=True)
class Credentials:
    """A server's bearer token, and the basic-auth header its URL's ``user:password`` makes."""

    token: BearerToken = field(default=None, repr=False)
    basic: str | None = field(default=None, repr=False)

    @classmethod
    def of(cls, url: httpx2.URL, token: BearerToken) -> tuple[httpx2.URL, Credentials]:
        """``url`` without its ``user:password``, and the credentials: ``token``, and that pair as basic
        auth."""
        if not url.userinfo:
            return url, cls(token)
        pair = f"{url.username}:{url.password}".encode()
        basic = "Basic " + base64.b64encode(pair).decode("ascii")
        return url.copy_with(username=None, password=None), cls(token, basic)

    def bearer(self) -> str | None:
        """The bearer token as it is now.

        Raises:
            NoBearerToken: the token provider failed (a variable not set, a token endpoint down): nothing was
                sent, so a create is undone (rule 1), never taken for an unknown outcome; the provider's
                ``retry_after`` (its backoff) is kept.
        """
        token = self.token
        if callable(token):
            try:
                return token()
            except Exception as exc:  # any failure to read the token: the request is not sent
                retry_after = exc.retry_after if isinstance(exc, Transient) else None
                raise NoBearerToken(
                    f"not sent: the bearer token could not be read: {exc}", retry_after=retry_after
                ) from exc
        return token

    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header as the credentials are now: the bearer token, else basic auth, else
        none.

        Raises:
            NoBearerToken: the token provider failed; nothing was sent.
        """
        token = self.bearer()
        authorization = f"Bearer {token}" if token is not None else self.basic
        return {} if authorization is None else {"Authorization": authorization}

    def refused(self, exc: AdapterError, sent: Mapping[str, str]) -> AdapterError:
        """What a ``401`` to a request sent with the headers ``sent`` means: :class:`TokenRenewed` when its
        bearer token was refused as invalid (RFC 6750 ``invalid_token``, or no error named) and the provider
        renewed it; else ``exc`` as it is (a static token, a 403, a fresh token refused again), the token
        taken out of its message if the server echoed it."""
        provider = self.token
        if not isinstance(exc, Unauthorized):
            return exc
        authorization = sent.get("Authorization", "")
        token = authorization.removeprefix("Bearer ") if authorization.startswith("Bearer ") else None
        if token and token in str(exc):  # a server that echoes the token it refused does not log it here
            text = str(exc).replace(token, "[redacted]")
            exc = Unauthorized(
                text, http_status=exc.http_status or 401, challenge=exc.challenge, code=exc.code
            )
        if exc.http_status != 401 or not isinstance(provider, RenewableToken):
            return exc
        params = challenge_params(exc.challenge or "")
        if params.get("error", "invalid_token") != "invalid_token":
            return exc
        if provider.renew(token, resource_metadata_url=params.get("resource_metadata")):
            return TokenRenewed(f"{exc} (the bearer token was renewed: the request is sent again)")
        return exc
