"""Google's access tokens for an AIP-151 API (``[servers.X.auth] kind = "google"``): google-auth's own
credentials (a service account's key file, or Application Default Credentials: workload identity, the
metadata server, ``gcloud auth application-default login``), asked for a token by google-auth, cached and
renewed here as every token is (:class:`~adapters.oauth.CachedToken`: before it expires, once after a
``401``, one request at a time, a backoff after failures). google-auth is imported when a token is first
asked for (the ``google`` extra: ``pip install 'longcall[google]'``).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from adapters.oauth import CachedToken, TokenUnavailable

__all__ = ["CLOUD_PLATFORM", "GoogleToken"]

#: The scope an AIP-151 API of Google Cloud takes by default.
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
#: The seconds a token request to Google's token endpoint may take.
TOKEN_TIMEOUT_S = 10.0


class GoogleToken(CachedToken):
    """Google credentials' access token: from ``credentials_file`` (a service account's JSON key), else
    Application Default Credentials, for ``scopes``."""

    def __init__(
        self,
        credentials_file: Path | None,
        scopes: Sequence[str] = (CLOUD_PLATFORM,),
        *,
        what: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(what, clock=clock)
        self._file = credentials_file
        self._scopes = tuple(scopes)
        self._credentials: Any = None

    def _ask(self) -> tuple[str, float | None]:
        try:
            import google.auth  # noqa: PLC0415 - the google extra, when a token is first asked for
            import google.auth.exceptions  # noqa: PLC0415
            import google.auth.transport.requests  # noqa: PLC0415
            from google.oauth2 import service_account  # noqa: PLC0415
        except ImportError:
            raise TokenUnavailable(
                "kind = \"google\" needs google-auth: pip install 'longcall[google]'"
            ) from None
        if self._credentials is None:
            try:
                if self._file is not None:
                    self._credentials = service_account.Credentials.from_service_account_file(  # type: ignore[no-untyped-call]
                        str(self._file), scopes=self._scopes
                    )
                else:
                    self._credentials, _ = google.auth.default(scopes=self._scopes)
            except (OSError, ValueError, google.auth.exceptions.GoogleAuthError) as exc:
                where = (
                    f"from {self._file}" if self._file is not None else "(Application Default Credentials)"
                )
                raise TokenUnavailable(
                    f"the Google credentials {where} cannot be loaded: {type(exc).__name__}: {exc}"
                ) from None
        request = google.auth.transport.requests.Request()

        def with_timeout(*args: Any, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", TOKEN_TIMEOUT_S)
            return request(*args, **kwargs)

        try:
            self._credentials.refresh(with_timeout)
        except google.auth.exceptions.GoogleAuthError as exc:
            raise TokenUnavailable(
                f"Google's token endpoint gave no token: {type(exc).__name__}: {exc}"
            ) from None
        token = self._credentials.token
        if not isinstance(token, str) or not token:
            raise TokenUnavailable("Google's token endpoint gave no token")
        expiry = self._credentials.expiry  # naive UTC, as google-auth keeps it
        if expiry is None:
            return token, None
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        return token, max(0.0, (expiry - now).total_seconds())
