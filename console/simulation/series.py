"""The generator: one ordered series per (seed, index), the same for the same pair on every run.

A series is a timeline on a tick clock (the driver runs one executor step per tick): the server's task
works until ``term_tick`` and ends in ``terminal``; the faults it meets on the wire; the client's actions
(a cancel at a tick, duplicate submissions, a replayed old step) and the delivery effects (a step delivered
twice, a worker crash between the create attempt and its answer, a late completion offered after the end, a
completion from a fenced execution epoch).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Protocol = Literal["mcp", "aip151", "mcp-ext"]
Terminal = Literal["completed", "failed"]
CreateFault = Literal["none", "429", "429_retry_after", "lost_503", "lost_cut", "crash_before", "crash_after"]
Expiry = Literal["none", "before_seen", "404_while_working"]
CancelPolicy = Literal["honour", "ignore"]

#: The protocols the generator knows: MCP 2025-11-25 core Tasks, AIP-151, the MCP tasks extension
#: (2026-07-28).
PROTOCOLS: tuple[Protocol, ...] = ("mcp", "aip151", "mcp-ext")
#: A status read's faults on the wire: a 429 or a 503 (each with or without Retry-After), an answer cut
#: short, an answer about another operation.
READ_FAULTS = ("429", "429_retry_after", "503", "503_retry_after", "truncated", "other_task")
#: A result read's faults (MCP ``tasks/result``): lost (503), cut short, bound to another task.
RESULT_FAULTS = ("503", "truncated", "other_task")
#: The longest series, in ticks, the driver runs before it calls a series stalled.
MAX_TICKS = 60


@dataclass(frozen=True)
class Series:
    """One generated series. Ticks count executor steps from the submission (tick 0)."""

    seed: int
    index: int
    protocol: Protocol
    terminal: Terminal
    #: The tick from which the server's task is terminal (>= 1).
    term_tick: int
    create_fault: CreateFault = "none"
    #: Status reads (by their number, from 1) answered with a fault instead of the status.
    read_faults: dict[int, str] = field(default_factory=dict)
    #: MCP: the first ``tasks/result`` answered with this fault (then the real result).
    result_fault: str | None = None
    expiry: Expiry = "none"
    #: The tick at which the client cancels (None: no cancel); -1: before any create is attempted.
    cancel_tick: int | None = None
    #: MCP: the answer to the first ``tasks/cancel`` is lost (the server cancelled the task).
    cancel_ack_lost: bool = False
    #: AIP-151: whether the server honours a cancel of a running operation or lets it complete.
    cancel_policy: CancelPolicy = "honour"
    #: MCP: the server answers a cancel "cancelled" but the work completes anyway (a completion is later
    #: offered at the acceptance point: it must never advance).
    stubborn: bool = False
    #: Ticks at which the client submits the same call node again (same arguments).
    duplicate_ticks: tuple[int, ...] = ()
    #: Ticks at which the step just run is delivered again (a redelivered message, an old cursor).
    redeliver_ticks: tuple[int, ...] = ()
    #: Offer a late completion at the acceptance point after the series ended (an old step's callback).
    late_offer: bool = False
    #: MCP tasks extension: the task asks for input (one round) before it works on; the client answers at
    #: once, then replays the answered round (refused). The task's end counts from the answer.
    ask_input: bool = False
    #: From this tick on, the first acceptance the executor asks for is preceded by the same evidence from
    #: the previous execution epoch (a step a rollback or a take-over fenced, arriving late, with its own
    #: result) at the acceptance point (None: none arrives). It changes nothing.
    old_epoch_tick: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v)
            for k, v in asdict(self).items()
        }


def generate(seed: int, index: int, protocols: tuple[Protocol, ...] = PROTOCOLS) -> Series:
    """The series ``index`` of ``seed``: a function of the pair and the protocol list only."""
    rng = random.Random(f"longcall-sim:{seed}:{index}")  # noqa: S311 - a reproducible schedule, not a secret
    protocol = protocols[index % len(protocols)]
    terminal: Terminal = rng.choice(("completed", "completed", "failed"))
    term_tick = rng.randint(1, 6)
    create_fault: CreateFault = rng.choice(
        ("none",) * 6 + ("429", "429_retry_after", "lost_503", "lost_cut", "crash_before", "crash_after")
    )
    read_faults = {n: rng.choice(READ_FAULTS) for n in range(1, 8) if rng.random() < 0.15}
    result_fault = rng.choice(RESULT_FAULTS) if protocol == "mcp" and rng.random() < 0.2 else None
    expiry: Expiry = rng.choice(("none",) * 8 + ("before_seen", "404_while_working"))
    cancel_tick: int | None = None
    roll = rng.random()
    if roll < 0.08:
        cancel_tick = -1
    elif roll < 0.45:
        cancel_tick = rng.randint(1, 7)
    cancel_ack_lost = protocol == "mcp" and cancel_tick is not None and rng.random() < 0.3
    cancel_policy: CancelPolicy = rng.choice(("honour", "ignore"))
    stubborn = protocol == "mcp" and cancel_tick is not None and not cancel_ack_lost and rng.random() < 0.3
    duplicate_ticks = tuple(sorted({rng.randint(0, 6) for _ in range(rng.choice((0, 0, 1, 2)))}))
    redeliver_ticks = tuple(sorted({rng.randint(0, 6) for _ in range(rng.choice((0, 0, 1, 2)))}))
    late_offer = rng.random() < 0.3
    ask_input = protocol == "mcp-ext" and rng.random() < 0.3
    # Drawn after every other field: a seed's earlier series keep their timelines.
    old_epoch_tick = rng.randint(0, 6) if rng.random() < 0.2 else None
    if ask_input:
        # The answer's tick is the client's: no cancel, no lost create, no expiry to race it.
        cancel_tick, create_fault, expiry = None, "none", "none"
    return Series(
        seed=seed,
        index=index,
        protocol=protocol,
        terminal=terminal,
        term_tick=term_tick,
        create_fault=create_fault,
        read_faults=read_faults,
        result_fault=result_fault,
        expiry=expiry,
        cancel_tick=cancel_tick,
        cancel_ack_lost=cancel_ack_lost,
        cancel_policy=cancel_policy,
        stubborn=stubborn,
        duplicate_ticks=duplicate_ticks,
        redeliver_ticks=redeliver_ticks,
        late_offer=late_offer,
        ask_input=ask_input,
        old_epoch_tick=old_epoch_tick,
    )
