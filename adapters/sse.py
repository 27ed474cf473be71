"""A sans-I/O decoder for ``text/event-stream`` (the WHATWG "event stream interpretation").

Feed it bytes as they arrive, in chunks of any size; it yields whole events. It accepts CRLF, LF and CR
line endings (also split across chunks), comments, a leading BOM, fields without a colon, ``id`` and
``retry`` fields it does not need, and events without ``data`` (which it drops, as the standard says).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

__all__ = ["SseDecoder", "SseEvent", "decode_sse"]


@dataclass(frozen=True)
class SseEvent:
    event: str
    data: str
    id: str | None = None
    retry: int | None = None


class SseDecoder:
    """Incremental decoder: ``feed`` chunks, then ``close`` at the end of the stream."""

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="strict")
        self._line = ""
        self._after_cr = False
        self._at_start = True
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None
        self._reconnect_ms: int | None = None

    @property
    def last_event_id(self) -> str | None:
        """The last ``id`` field seen (kept across events, as the standard's last-event-ID buffer)."""
        return self._id or None

    @property
    def reconnect_ms(self) -> int | None:
        """The last ``retry`` field seen: how long to wait before reconnecting."""
        return self._reconnect_ms

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """Decode one chunk; return the events it completed.

        Raises:
            UnicodeDecodeError: the stream is not UTF-8.
        """
        return self._feed_text(self._text.decode(chunk, final=False))

    def close(self) -> list[SseEvent]:
        """End of stream. An event not terminated by a blank line is discarded, as the standard says."""
        events = self._feed_text(self._text.decode(b"", final=True))
        self._line = ""
        self._data = []
        self._event = ""
        return events

    def _feed_text(self, text: str) -> list[SseEvent]:
        if not text:
            return []  # (a chunk that ends inside a UTF-8 character) a CR before it still awaits its LF
        if self._at_start:
            self._at_start = False
            text = text.removeprefix("\ufeff")
        if self._after_cr and text.startswith("\n"):
            text = text[1:]  # the second half of a CRLF split between chunks
        self._after_cr = text.endswith("\r")
        # Split by str methods at one character at a time (memchr, not a Python loop over every character
        # nor a search for "\r\n", slow on long lines): every poll of a server answering in SSE decodes an
        # event, which may be large. A CR just before an LF is a CRLF; any other CR ends a line of its own.
        pieces = text.split("\n")
        lines: list[str] = []
        for piece in pieces[:-1]:
            lines += piece.removesuffix("\r").split("\r")
        *ended, rest = pieces[-1].split("\r")
        lines += ended
        if not lines:
            self._line += rest
            return []
        lines[0] = self._line + lines[0]
        self._line = rest
        events: list[SseEvent] = []
        for line in lines:
            event = self._process_line(line)
            if event is not None:
                events.append(event)
        return events

    def _process_line(self, line: str) -> SseEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon:
            value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = self._reconnect_ms = int(value)
        return None

    def _dispatch(self) -> SseEvent | None:
        data, event, retry = self._data, self._event, self._retry
        self._data, self._event, self._retry = [], "", None
        if not data:
            return None
        return SseEvent(event=event or "message", data="\n".join(data), id=self._id, retry=retry)


def decode_sse(chunks: Iterable[bytes]) -> Iterator[SseEvent]:
    """Decode a whole stream given as chunks."""
    decoder = SseDecoder()
    for chunk in chunks:
        yield from decoder.feed(chunk)
    yield from decoder.close()
