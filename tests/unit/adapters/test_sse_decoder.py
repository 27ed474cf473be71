from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.sse import SseDecoder, SseEvent, decode_sse


def decode(*chunks: bytes) -> list[SseEvent]:
    return list(decode_sse(chunks))


def test_crlf_framing_as_sent_by_mcp_1_30_yields_the_message() -> None:
    body = b'event: message\r\ndata: {"jsonrpc":"2.0","id":1,"result":{}}\r\n\r\n'
    assert decode(body) == [SseEvent(event="message", data='{"jsonrpc":"2.0","id":1,"result":{}}')]


def test_lf_and_lone_cr_line_endings_are_equivalent() -> None:
    assert decode(b"data: a\n\n") == decode(b"data: a\r\r") == decode(b"data: a\r\n\r\n")


def test_crlf_split_between_chunks_is_one_line_ending() -> None:
    events = decode(b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n")
    assert [e.data for e in events] == ["a", "b"]


def test_multibyte_utf8_split_between_chunks_is_reassembled() -> None:
    raw = "data: caf\u00e9 \u2713\n\n".encode()
    assert [e.data for e in decode(*[raw[i : i + 1] for i in range(len(raw))])] == ["caf\u00e9 \u2713"]


def test_event_without_data_is_dropped() -> None:
    assert decode(b"event: ping\n\n: comment\n\nid: 7\n\n") == []


def test_priming_event_with_empty_data_field_is_kept_with_empty_data() -> None:
    events = decode(b"id: 0\ndata:\n\n")
    assert events == [SseEvent(event="message", data="", id="0")]


def test_multi_line_data_is_joined_with_newlines() -> None:
    assert decode(b'data: {\ndata: "a": 1\ndata: }\n\n')[0].data == '{\n"a": 1\n}'


def test_id_retry_and_comments_are_read_but_not_required() -> None:
    events = decode(b": keepalive\nid: 42\nretry: 1500\nevent: message\ndata: x\n\n")
    assert events == [SseEvent(event="message", data="x", id="42", retry=1500)]


def test_field_without_colon_and_value_without_space() -> None:
    assert decode(b"data\ndata:x\n\n")[0].data == "\nx"


def test_leading_bom_is_ignored() -> None:
    assert decode(b"\xef\xbb\xbfdata: x\n\n")[0].data == "x"


def test_unterminated_final_event_is_discarded() -> None:
    assert decode(b"data: complete\n\ndata: cut off") == [SseEvent(event="message", data="complete")]


def test_invalid_utf8_raises() -> None:
    decoder = SseDecoder()
    with pytest.raises(UnicodeDecodeError):
        decoder.feed(b"data: \xff\xfe\n\n")


_line_text = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\r\n\x00"), max_size=30
)
_events = st.lists(
    st.tuples(
        st.sampled_from(["message", "update", ""]),
        st.lists(_line_text, min_size=1, max_size=4),
        st.one_of(st.none(), st.text(alphabet="abc123-", min_size=1, max_size=8)),
    ),
    max_size=6,
)


@given(
    events=_events,
    newline=st.sampled_from(["\n", "\r", "\r\n"]),
    comments=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_round_trip_of_arbitrary_framing_and_chunking(
    events: list[tuple[str, list[str], str | None]], newline: str, comments: bool, cuts: list[int]
) -> None:
    text = ""
    expected: list[SseEvent] = []
    last_id: str | None = None
    for name, lines, event_id in events:
        if comments:
            text += f": note{newline}"
        if name:
            text += f"event: {name}{newline}"
        if event_id is not None:
            text += f"id: {event_id}{newline}"
            last_id = event_id
        for line in lines:
            # A value starting with a space needs the separating space written explicitly.
            text += f"data: {line}{newline}"
        text += newline
        expected.append(SseEvent(event=name or "message", data="\n".join(lines), id=last_id))
    raw = text.encode()
    bounds = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    chunks = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    assert list(decode_sse(chunks)) == expected
