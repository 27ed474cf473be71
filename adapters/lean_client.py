"""An httpx2 client that sends the requests its route names straight on a :class:`SocketTransport`.

Issue 21 measured where the worker CPU of a status read goes: with the exchange itself on sockets parsed by
httptools (``adapters.socket_transport``), two thirds of what is left is httpx2's client around it, none of
it depending on the request: the URL parsed again, the client's headers merged into a new ``Headers``, a
``Request`` and a ``Response`` built and normalised, the request and answer hooks, the cookie jar, the
redirect and auth loops, and the transports' wrappers. The status reads are most of what a worker sends,
each the same POST to the same endpoint but for its body and its headers.

:class:`LeanClient` is httpx2's client. Given a :class:`LeanRoute` (by the worker, for the requests its
poll budget paid for), it sends those requests itself: their head written from a prefix made once per
method and URL (the request line and ``Host``), the request's headers and the client's own it does not
override, its body after, on the route's :class:`SocketTransport`, and the answer handed back as a
:class:`~adapters.socket_transport.LeanAnswer`: what of httpx2's ``Response`` the adapters read. What goes
on the wire is what httpx2 would send, in another order of the header lines. Every other request, and any
request this client cannot send as httpx2 would, goes through httpx2's client as before:

- a request with anything but a body of bytes (``json``, ``params``, ``data``, ``files``, ``cookies``,
  ``auth``, redirects or a timeout of its own), a header that is not ASCII or holds a line break, or a
  ``Host`` of its own;
- a client with cookies in its jar (a sticky-session load balancer's cookie is sent by httpx2), an auth,
  answer hooks or default query parameters of its own, or a transport mounted for the URL (a proxy given to
  the client; one named by ``HTTP_PROXY`` is not used by a client given its transport, as the adapters'
  clients are);
- a request the route does not take (:meth:`LeanRoute.label`).

The route sees each of its requests' outcome (:meth:`LeanRoute.counted`), as the worker's counting
transport sees the others'. A fault is the httpx2 exception the transport raises, as for any request.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, cast

import httpx2

from adapters.socket_transport import SocketTransport

__all__ = ["LeanClient", "LeanRoute"]

#: The arguments of ``stream`` a request it sends itself may give (any other given: httpx2 sends it).
_LEAN_ARGUMENTS = frozenset({"content", "headers", "extensions"})
#: How many (method, URL) heads a client keeps made: an adapter sends to one endpoint.
_PREFIXES_KEPT = 16
_FORBIDDEN = frozenset("\r\n\0")
#: A header's name (RFC 9110 ``token``).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: The headers this client writes itself.
_WRITTEN_HERE = frozenset({"host", "content-length", "transfer-encoding", "longcall-budget", "connection"})
_WRITTEN_HERE_RAW = frozenset(name.encode("ascii") for name in _WRITTEN_HERE - {"connection"})


class LeanRoute(Protocol):
    """Which requests a :class:`LeanClient` sends itself, and on what."""

    @property
    def transport(self) -> SocketTransport:
        """What the requests it takes are sent on."""
        ...

    def label(self) -> str | None:
        """Called as a request is about to be sent: None when it goes through httpx2's client as any
        request; else it is this route's, and its ``Longcall-Budget`` header (taken: the request hooks,
        which would name it, are not called for it)."""
        ...

    def counted(self, status: int | None) -> None:
        """One of its requests was answered with ``status``, or not answered (None)."""
        ...


class LeanClient(httpx2.Client):
    """httpx2's client; the requests of its :attr:`route` (when set) sent without httpx2's models (see the
    module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.route: LeanRoute | None = None
        self._prefixes: dict[tuple[str, str, tuple[tuple[bytes, bytes], ...]], tuple[httpx2.URL, bytes]] = {}

    @contextlib.contextmanager
    def stream(self, method: str, url: httpx2.URL | str, **kwargs: Any) -> Iterator[httpx2.Response]:
        route = self.route
        head = None if route is None else self._lean_head(method, url, kwargs)
        label = None if head is None or route is None else route.label()
        if head is None or label is None or route is None:
            with super().stream(method, url, **kwargs) as answer:
                yield answer
            return
        target, start = head
        content: bytes | None = kwargs.get("content")
        timeouts = _timeouts(kwargs.get("extensions"), self.timeout)
        lines = [start, b"Longcall-Budget: ", label.encode("ascii"), b"\r\n"]
        if content is not None:
            lines += (b"Content-Length: ", str(len(content)).encode("ascii"), b"\r\n\r\n", content)
        else:
            lines.append(b"\r\n")
        try:
            lean = route.transport.send_bytes(target, b"".join(lines), timeouts)
        except BaseException:
            route.counted(None)
            raise
        with lean:
            route.counted(lean.status_code)
            if "set-cookie" in lean.headers:
                # kept as httpx2 keeps it (a sticky-session load balancer's): the next request sends it
                self.cookies.extract_cookies(
                    httpx2.Response(
                        lean.status_code, headers=lean.headers.raw, request=httpx2.Request(method, target)
                    )
                )
            # what of an httpx2 Response the adapters read (adapters.socket_transport.LeanAnswer)
            yield cast(httpx2.Response, lean)

    def _lean_head(
        self, method: str, url: httpx2.URL | str, kwargs: Mapping[str, Any]
    ) -> tuple[httpx2.URL, bytes] | None:
        """The request's head up to its length (None: httpx2's client sends it): the request line, ``Host``
        and the client's headers (made once per method and URL), then the request's own."""
        if (
            method not in ("GET", "POST")
            or any(value is not None for name, value in kwargs.items() if name not in _LEAN_ARGUMENTS)
            or (method == "POST") != isinstance(kwargs.get("content"), bytes)
            or self._auth is not None
            or self.event_hooks["response"]
            or len(self.cookies.jar)
            or self.params
        ):
            return None
        headers: object = kwargs.get("headers") or {}
        if not isinstance(headers, Mapping):
            return None
        own = self.headers.raw
        key = (method, str(url), tuple(own))
        made = self._prefixes.get(key)
        if made is None:
            made = self._prefix(method, url, own)
            if made is None:
                return None
            if len(self._prefixes) >= _PREFIXES_KEPT:
                self._prefixes.clear()
            self._prefixes[key] = made
        target, prefix = made
        lines = [prefix]
        for name, value in headers.items():
            if (
                not isinstance(name, str)
                or not isinstance(value, str)
                or not _TOKEN.fullmatch(name)
                or not _value(value)
                or name.lower() in _WRITTEN_HERE
            ):
                return None
            lines.append(f"{name}: {value}\r\n".encode("ascii"))
        taken = {name.lower().encode("ascii") for name in headers}
        for raw_name, raw_value in own:
            if raw_name.lower() not in taken and raw_name.lower() not in _WRITTEN_HERE_RAW:
                lines += (raw_name, b": ", raw_value, b"\r\n")
        return target, b"".join(lines)

    def _prefix(
        self, method: str, url: httpx2.URL | str, own: list[tuple[bytes, bytes]]
    ) -> tuple[httpx2.URL, bytes] | None:
        target = self._merge_url(url)
        if (
            target.scheme not in ("http", "https")
            or not target.raw_host
            or target.fragment
            or target.userinfo  # a user and password in the URL: httpx2 sends them as basic auth
        ):
            return None
        if self._transport_for_url(target) is not self._transport:
            return None  # a transport mounted for it (a proxy given to the client)
        if any(_has_break(name) or _has_break(value) for name, value in own):
            return None
        host = target.netloc
        return target, b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode("ascii"), target.raw_path, host)


def _value(text: str) -> bool:
    return text.isascii() and not _FORBIDDEN.intersection(text)


def _has_break(value: bytes) -> bool:
    return b"\r" in value or b"\n" in value or b"\0" in value


def _timeouts(extensions: Mapping[str, Any] | None, default: httpx2.Timeout) -> Mapping[str, float | None]:
    """The request's timeouts per phase, as httpx2 gives them to its transport: its ``timeout`` extension,
    else the client's."""
    given = None if extensions is None else extensions.get("timeout")
    if given is not None:
        return cast(Mapping[str, float | None], given)
    return cast(Mapping[str, float | None], default.as_dict())
