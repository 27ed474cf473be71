"""Issue 19 item 8 (rule 3): every configured server gets its share of every dispatch tick, whatever the
others have due. A tick used to fill ``dispatch_batch`` taking servers in name order, so when the first
servers' due rows exceeded the batch, the later ones got no polls, no cancel retries and no deadline checks.

The claim orders its rows by each server's rank scaled by its room, ``(rank - 1) / room``: every server's
first due row before any server's second, the rest in proportion to the budgets; ties between servers are
broken by a rotation that moves on by the batch at every tick (``dispatch_tick``), so that with more servers
than the batch every server is reached within ``ceil(servers / batch)`` ticks.
"""

from __future__ import annotations

import math
import random
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
from sqlalchemy import bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.types import Integer, Text

from ledger.repository import Ledger
from tests import support
from workers.executor import Executor
from workers.runtime import Runtime
from workers.settings import Settings

SERVERS = [f"srv-{i:02d}" for i in range(40)]

#: Due rows by server, heaviest (and most overdue) first: the first two servers alone hold more than ten
#: batches of 20, every other server has a few.
SKEWED = {name: (90 if i < 2 else 1 + i % 3) for i, name in enumerate(SERVERS)}

LOAD = text(
    """
    INSERT INTO tool_operation (
        id, call_node_id, request_digest, tool_name, body, server, protocol, protocol_version,
        adapter_version, remote_id, submission_key, submit_attempted_at, state, server_state, poll_cursor,
        next_poll_at, poll_interval_ms, execution_epoch, event_seq
    )
    SELECT
        gen_random_uuid(), 'fair-' || s.server || '-' || g, 'digest', 'slow_report', '{}'::jsonb, s.server,
        'mcp', '2025-11-25', 'test', 'task-' || s.server || '-' || g, gen_random_uuid(),
        now() - interval '2 hours', 'WORKING', 'working', 1,
        -- The first servers' rows are the most overdue: due order alone would starve the others too.
        now() - interval '1 hour' + s.ord * interval '1 minute' + g * interval '1 millisecond',
        500, (SELECT execution_epoch FROM executor_control WHERE id = 1), 1
    FROM unnest(:servers, :counts) WITH ORDINALITY AS s(server, n, ord), generate_series(1, s.n) AS g
    RETURNING id, server
    """
).bindparams(
    bindparam("servers", type_=ARRAY(Text())),
    bindparam("counts", type_=ARRAY(Integer())),
)


def load_due(ledger: Ledger, counts: Mapping[str, int]) -> dict[uuid.UUID, str]:
    """``counts[server]`` due, unleased WORKING rows on each server; their server by id."""
    with ledger.engine.begin() as conn:
        rows = conn.execute(LOAD, {"servers": list(counts), "counts": list(counts.values())}).all()
    assert len(rows) == sum(counts.values())
    return {row.id: row.server for row in rows}


def servers_claimed(
    ledger: Ledger, rooms: list[tuple[str, int]], limit: int, server_of: Mapping[uuid.UUID, str]
) -> Counter[str]:
    claims = ledger.claim_due_by_server(rooms, limit=limit, lease_s=30.0, epoch="current")
    assert len(claims) == limit
    return Counter(server_of[c.op_id] for c in claims)


@pytest.mark.parametrize("batch", [20, 50])
def test_every_server_is_claimed_within_two_ticks_whatever_the_first_servers_have_due(
    ledger: Ledger, batch: int
) -> None:
    """40 servers, more than 10 x the batch due, most of it on the first two: every server is claimed
    within two ticks (in one when the batch is at least the number of servers)."""
    server_of = load_due(ledger, SKEWED)
    assert len(server_of) >= 10 * 20
    rooms = [(name, 1000) for name in SERVERS]  # budgets far above the batch: the batch is what is shared

    first = servers_claimed(ledger, rooms, batch, server_of)
    second = servers_claimed(ledger, rooms, batch, server_of)

    assert set(first) | set(second) == set(SERVERS), (
        f"never claimed: {sorted(set(SERVERS) - set(first) - set(second))}"
    )
    if batch >= len(SERVERS):
        assert set(first) == set(SERVERS)
    else:
        assert len(first) == len(second) == batch  # one row each: every first row before any second


def test_with_more_servers_than_the_batch_every_server_is_reached_within_its_rotation(ledger: Ledger) -> None:
    """40 servers with 5 due rows each and a batch of 7: ceil(40 / 7) = 6 ticks reach every server, each
    tick one row for each of 7 servers (the sixth tick wraps round to two servers the first one had)."""
    server_of = load_due(ledger, dict.fromkeys(SERVERS, 5))
    rooms = [(name, 100) for name in SERVERS]
    seen: Counter[str] = Counter()
    for _ in range(math.ceil(len(SERVERS) / 7)):
        claimed = servers_claimed(ledger, rooms, 7, server_of)
        assert max(claimed.values()) == 1
        seen.update(claimed)
    assert set(seen) == set(SERVERS), f"never claimed: {sorted(set(SERVERS) - set(seen))}"
    assert sum(seen.values()) - len(SERVERS) == 6 * 7 - 40


def test_beyond_the_first_rows_the_batch_is_shared_in_proportion_to_the_rooms(ledger: Ledger) -> None:
    """Past every server's first row, the batch is shared by the servers' rooms (their budgets per tick):
    rooms 30 and 10, both with plenty due, share a batch of 20 as 15 and 5. (In name order the first took
    all 20.)"""
    server_of = load_due(ledger, {"a": 60, "b": 60})

    claimed = servers_claimed(ledger, [("a", 30), ("b", 10)], 20, server_of)

    assert claimed == Counter({"a": 15, "b": 5})


def model_shares(counts: dict[str, int], rooms: dict[str, int], limit: int, tick: int) -> Counter[str]:
    """What a tick should claim of each server, computed by brute force: every due row of every server (up
    to its room and the limit) ranked by (rank - 1) / room, then by the rotation's turn, the limit first."""
    names = list(rooms)
    first = (tick % len(names)) * (limit % len(names)) % len(names)
    places = [
        ((rank - 1) / rooms[name], (i - first) % len(names), name)
        for i, name in enumerate(names)
        for rank in range(1, min(counts.get(name, 0), rooms[name], limit) + 1)
    ]
    return Counter(name for _, _, name in sorted(places)[:limit])


def test_one_busy_server_among_idle_ones_still_fills_the_batch(ledger: Ledger) -> None:
    """The claim counts each server at first only up to twice its share were every server busy; a server
    that had more, with the batch not filled, is counted again up to its room: one busy server among 40
    takes the whole batch, as in name order."""
    server_of = load_due(ledger, {"srv-07": 600})

    claimed = servers_claimed(ledger, [(name, 1000) for name in SERVERS], 500, server_of)

    assert claimed == Counter({"srv-07": 500})


@pytest.mark.parametrize("seed", range(6))
def test_what_a_tick_claims_of_each_server_is_the_exact_share(ledger: Ledger, seed: int) -> None:
    """Busy and idle servers, large and small rooms, mixed at random: each server gets exactly what the
    ranking gives it over all its due rows (the counts that bound the first reading never change it)."""
    rng = random.Random(seed)
    rooms = {name: rng.choice([1, 3, 10, 40, 200]) for name in SERVERS}
    counts = {name: rng.choice([0, 0, 1, 2, 5, 30, 150]) for name in SERVERS}
    limit = rng.choice([7, 60, 200])
    server_of = load_due(ledger, {name: n for name, n in counts.items() if n})
    expected = model_shares(counts, rooms, limit, tick=1)  # a fresh database's first tick

    claims = ledger.claim_due_by_server(list(rooms.items()), limit=limit, lease_s=30.0, epoch="current")

    assert Counter(server_of[c.op_id] for c in claims) == expected


# --------------------------------------------------------------------------- the dispatcher's own tick

MakeExecutor = Callable[[int], Executor]


@pytest.fixture
def make_executor(database_url: str, broker_prefix: str, tmp_path: Path) -> Iterator[MakeExecutor]:
    """An executor whose config has the 40 servers (budgets far above the batch) and ``dispatch_batch``."""
    runtimes: list[Runtime] = []
    config = tmp_path / "longcall.toml"
    config.write_text(
        "".join(
            f'[servers.{name}]\nprotocol = "mcp"\nprotocol_version = "2025-11-25"\n'
            f'url = "http://127.0.0.1:9/mcp/{name}"\npoll_qps = 1000\ncontrol_qps = 1000\n\n'
            for name in SERVERS
        )
    )

    def make(batch: int) -> Executor:
        settings = Settings(
            database_url=database_url,
            redis_url=support.REDIS_URL,
            broker_keyprefix=broker_prefix,
            config=config,
            dispatch_batch=batch,
        )
        runtimes.append(Runtime.from_settings(settings))
        return Executor(runtimes[-1])

    try:
        yield make
    finally:
        for runtime in runtimes:
            runtime.close()


@pytest.mark.parametrize("batch", [20, 50])
def test_the_dispatchers_ticks_poll_every_configured_server_within_two_ticks(
    make_executor: MakeExecutor, ledger: Ledger, batch: int
) -> None:
    executor = make_executor(batch)
    server_of = load_due(ledger, SKEWED)

    ticks = [executor.dispatch_due(), executor.dispatch_due()]

    assert [len(t) for t in ticks] == [batch, batch]
    assert all(d.task == "longcall.poll" for t in ticks for d in t)
    polled = {server_of[d.op_id] for t in ticks for d in t}
    assert polled == set(SERVERS), f"never polled: {sorted(set(SERVERS) - polled)}"


@pytest.mark.parametrize("state", ["CANCEL_REQUESTED", "TERMINAL_OBSERVED", "FETCHING_RESULT"])
def test_a_servers_rows_that_are_not_polls_are_claimed_before_its_backlog_of_polls(
    ledger: Ledger, state: str
) -> None:
    """A server whose polls are overdue by far more than a tick takes (a sustained overload of its budget):
    a cancel waiting to be sent or confirmed, or a result waiting to be fetched, due now, is claimed in the
    first tick, not after every poll due before it. Before, a server's rows were claimed in due order alone,
    so it waited behind the whole backlog (here three ticks) while its budget was the server's control
    budget, not the saturated poll budget."""
    server_of = load_due(ledger, {"busy": 60, "other": 5})
    urgent = [op_id for op_id, server in server_of.items() if server == "busy"][-2:]
    with ledger.engine.begin() as conn:  # the newest two: due now, past every poll of the backlog
        conn.execute(
            text(
                "UPDATE tool_operation SET state = :state, next_poll_at = now(), observed_terminal = CASE"
                " WHEN :state = 'CANCEL_REQUESTED' THEN NULL ELSE 'completed' END WHERE id = ANY(:ids)"
            ),
            {"state": state, "ids": urgent},
        )

    claims = ledger.claim_due_by_server(
        [("busy", 20), ("other", 20)], limit=20, lease_s=30.0, epoch="current"
    )

    claimed = {c.op_id for c in claims}
    assert set(urgent) <= claimed, "a row that is not a poll waited behind the server's polls"
    assert len(claims) == 20
    assert Counter(server_of[c.op_id] for c in claims) == Counter({"busy": 15, "other": 5})
    # The rest of the server's quota is its most overdue polls.
    polls = sorted((op_id for op_id, server in server_of.items() if server == "busy" and op_id not in urgent))
    with ledger.engine.connect() as conn:
        due_order = [
            row.id
            for row in conn.execute(
                text("SELECT id FROM tool_operation WHERE id = ANY(:ids) ORDER BY next_poll_at"),
                {"ids": polls},
            )
        ]
    assert claimed - set(urgent) - {c.op_id for c in claims if server_of[c.op_id] == "other"} == set(
        due_order[:13]
    )
