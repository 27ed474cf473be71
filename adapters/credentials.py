"""How every transport authenticates a request: the bearer token as it is now, else the URL's basic auth.

A bearer token is a value, or a provider called before every request (a rotated token is used from then
on). ``user:password`` in a server's URL is taken out of the URL and sent as a basic-auth header: never as
a part of the URL that httpx2 would log (its INFO line names every request's URL) or put into an error.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx2

from adapters.errors import Transient

__all__ = ["BearerToken", "Credentials"]

#: A token, or a provider of the token as it is now (None: no token).
BearerToken = str | Callable[[], str | None] | None


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
            Transient: the token provider failed; nothing was sent.
        """
        token = self.token
        if callable(token):
            try:
                return token()
            except Exception as exc:  # any failure to read the token: the request is not sent
                raise Transient(f"not sent: the bearer token could not be read: {exc}") from exc
        return token

    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header as the credentials are now: the bearer token, else basic auth, else
        none.

        Raises:
            Transient: the token provider failed; nothing was sent.
        """
        token = self.bearer()
        authorization = f"Bearer {token}" if token is not None else self.basic
        return {} if authorization is None else {"Authorization": authorization}
