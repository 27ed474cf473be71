"""Detection lag as ``bench/soak.py`` and ``bench/isolation.py`` measure it: operations already WORKING are
completed on the demo server at instants the benchmark chooses (``POST /_control/finish``), and each one's
lag is the time from the server's completion (the ``lastUpdatedAt`` it answered) to the ledger's
``terminal_observed`` event for it.

A sample is drawn from the operations the ledger has WORKING, so it is polled on the cadence every other
operation in flight is: no fresh submission, no first poll at a special time.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx2
import psycopg
from _harness import database_url, wait_for


@dataclass(frozen=True)
class Member:
    """One operation of a sample: its ledger id and the demo server's task id."""

    op_id: str
    remote_id: str


@dataclass
class Sample:
    """The operations completed on one server and when the server completed each (epoch seconds)."""

    control: str
    finished: dict[str, float] = field(default_factory=dict)
    #: Members the server did not complete (no longer working when asked): left out of every figure.
    refused: list[str] = field(default_factory=list)


def working(db_name: str, call_node_prefix: str, server: str, count: int) -> list[Member]:
    """Up to ``count`` operations of ``server`` the ledger has WORKING under a call node prefix, at random."""
    with psycopg.connect(database_url(db_name), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT id, remote_id FROM tool_operation WHERE call_node_id LIKE %s AND server = %s"
            " AND state = 'WORKING' AND remote_id IS NOT NULL ORDER BY random() LIMIT %s",
            (f"{call_node_prefix}%", server, count),
        ).fetchall()
    return [Member(str(op_id), str(remote_id)) for op_id, remote_id in rows]


def working_count(db_name: str, call_node_prefix: str, server: str | None = None) -> int:
    """How many operations under a call node prefix (of ``server``, or of every server) are WORKING."""
    sql = "SELECT count(*) FROM tool_operation WHERE call_node_id LIKE %s AND state = 'WORKING'"
    params: tuple[str, ...] = (f"{call_node_prefix}%",)
    if server is not None:
        sql += " AND server = %s"
        params += (server,)
    with psycopg.connect(database_url(db_name), autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
    return int(row[0]) if row else 0


def finish(sample: Sample, remote_ids: Sequence[str]) -> None:
    """Complete these tasks on the server now; record when it did (its ``lastUpdatedAt``)."""
    answer = httpx2.post(f"{sample.control}/finish", json={"task_ids": list(remote_ids)}, timeout=10)
    answer.raise_for_status()
    finished: dict[str, str] = answer.json()["finished"]
    for remote_id in remote_ids:
        if remote_id in finished:
            sample.finished[remote_id] = dt.datetime.fromisoformat(finished[remote_id]).timestamp()
        else:
            sample.refused.append(remote_id)


def finish_spread(
    sample: Sample,
    members: Sequence[Member],
    start: float,
    end: float,
    *,
    each_tick: Callable[[], None] = lambda: None,
    tick_s: float = 0.25,
) -> None:
    """Complete ``members`` one after another at instants spread evenly over ``[start, end)`` (epoch
    seconds), calling ``each_tick`` between them (at most every ``tick_s``); returns at ``end``."""
    step = (end - start) / max(1, len(members))
    due = [start + index * step for index in range(len(members))]
    done = 0
    while True:
        now = time.time()
        upto = done
        while upto < len(members) and due[upto] <= now:
            upto += 1
        if upto > done:
            finish(sample, [member.remote_id for member in members[done:upto]])
            done = upto
        each_tick()
        if now >= end:
            return
        time.sleep(max(0.0, min(tick_s, end - time.time())))


def observed(db_name: str, remote_ids: Sequence[str]) -> dict[str, float]:
    """When the ledger recorded these operations' ``terminal_observed`` (epoch seconds), by task id."""
    with psycopg.connect(database_url(db_name), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT o.remote_id, min(e.at) FROM operation_event e JOIN tool_operation o ON o.id = e.op_id"
            " WHERE e.kind = 'terminal_observed' AND o.remote_id = ANY(%s) GROUP BY o.remote_id",
            (list(remote_ids),),
        ).fetchall()
    return {str(remote_id): at.timestamp() for remote_id, at in rows}


@dataclass(frozen=True)
class Lags:
    """A sample's detection lags in seconds: of the completions observed, and the lower bounds of those
    still unobserved when the wait ended (the time from their completion to then)."""

    observed: list[float]
    unobserved: list[float]

    @property
    def all(self) -> list[float]:
        """Every lag, the unobserved ones at their lower bound, in order."""
        return sorted(self.observed + self.unobserved)


def lags(db_name: str, sample: Sample, *, wait_s: float) -> Lags:
    """Each completed member's detection lag, once every one is observed or ``wait_s`` has passed."""
    wanted = list(sample.finished)
    seen: dict[str, float] = {}

    def all_seen() -> bool:
        seen.update(observed(db_name, wanted))
        return len(seen) == len(wanted)

    with contextlib.suppress(TimeoutError):  # the unobserved ones are counted, not waited for for ever
        wait_for(f"{len(wanted)} completions observed", all_seen, timeout=wait_s, interval=0.5)
    now = time.time()
    return Lags(
        sorted(seen[r] - sample.finished[r] for r in wanted if r in seen),
        sorted(now - sample.finished[r] for r in wanted if r not in seen),
    )
