"""Canary and shadow routing (issue 12): which submissions longcall takes, which it only shadows, and which
it answers "not routed" so the caller keeps its legacy path.

The rollout lives in ``executor_control.rollout`` (``ledger/control.py``), changed by ``longcall rollout``
and audited:

- ``canary_percent`` — absent until a canary is first enabled, and then everything is routed as before.
  Once set, a call node is routed live when its **bucket** is below ``percent * 100``: the bucket is the
  first 8 bytes of ``sha256(call_node_id as UTF-8)`` as a big-endian integer, modulo 10,000. The same id has
  the same bucket in every process, after every restart and on every machine (no salt, no ``hash()``), and
  raising the percentage only adds call nodes: one routed at 5 % stays routed at 10 %.
- ``shadow`` — shadow mode. A call node that is not routed live, for a tool marked ``side_effect_free`` in
  LONGCALL_CONFIG, runs in shadow: driven and receipted, never delivered (its downstream signatures are not
  kept), its receipt compared with the legacy outcome the caller records (``longcall.record_legacy_outcome``).
  Before any canary, shadow mode shadows every side-effect-free call; a tool without the mark is never
  shadowed.

Decision for one submission (:func:`decide`)::

    canary set and the call node in it ................... live
    shadow on and the tool side-effect-free ............... shadow (the caller keeps its legacy path)
    no canary set ......................................... live (as before any rollout)
    otherwise ............................................. not routed: {"routed": false, "reason": "canary",
                                                            "percent": P}: no operation, nothing sent

The decision is taken inside the ledger's submission transaction, under a lock per call node
(``workers.submission.canary_admission`` via ``Ledger.record_submission``): a call node that has its
operation already keeps it, whatever the rollout says now, and every decision taken while a canary is set
is recorded in ``routing_decision`` and given again to a later submission of the same call node (a retry
or a redelivered ``longcall.submit`` after a raise never turns a "not routed" answer into a second,
live operation).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ledger.control import CANARY_PERCENT, SHADOW
from workers.settings import FleetConfig

#: The canary's resolution: a percentage is applied to 10,000 buckets (steps of 0.01 %).
BUCKETS = 10_000
#: The first canary: enabling one at this percentage or below asks no gate (it routes less than before);
#: above it, and any later raise, asks the launch gate (``longcall rollout --percent``).
FIRST_CANARY_PERCENT = 5

Route = Literal["live", "shadow", "not_routed"]


def canary_bucket(call_node_id: str) -> int:
    """The call node's bucket, 0..9999: stable across processes, restarts and machines."""
    head = hashlib.sha256(call_node_id.encode("utf-8")).digest()[:8]
    return int.from_bytes(head, "big") % BUCKETS


def in_canary(call_node_id: str, percent: float) -> bool:
    """Whether the call node is routed at ``percent`` (0..100)."""
    return canary_bucket(call_node_id) < round(percent * BUCKETS / 100)


def plain_percent(percent: float) -> float | int:
    """5.0 as 5 (how a percentage is stored and answered), 0.5 as 0.5."""
    return int(percent) if float(percent).is_integer() else float(percent)


@dataclass(frozen=True, slots=True)
class Routing:
    """How one submission is routed, and why."""

    route: Route
    reason: str
    percent: float | int | None = None

    def answer(self) -> dict[str, Any]:
        """``longcall.submit``'s answer for a call node it does not take: no ledger row, no remote call."""
        return {"routed": False, "reason": self.reason, "percent": self.percent}


@dataclass(frozen=True, slots=True)
class RolloutState:
    """``executor_control.rollout`` as read."""

    canary_percent: float | int | None
    shadow: bool

    @classmethod
    def from_control(cls, rollout: Mapping[str, Any]) -> RolloutState:
        percent = rollout.get(CANARY_PERCENT)
        return cls(
            canary_percent=plain_percent(percent) if isinstance(percent, int | float) else None,
            shadow=bool(rollout.get(SHADOW, False)),
        )

    def to_json(self) -> dict[str, Any]:
        return {"canary_percent": self.canary_percent, "shadow": self.shadow}


def decide(call_node_id: str, *, side_effect_free: bool, rollout: RolloutState) -> Routing:
    """The routing of one call node (the table in the module docstring)."""
    percent = rollout.canary_percent
    if percent is not None and in_canary(call_node_id, percent):
        return Routing("live", "canary", percent)
    if rollout.shadow and side_effect_free:
        return Routing("shadow", "shadow", percent)
    if percent is None:
        return Routing("live", "no_canary")
    return Routing("not_routed", "canary", percent)


def is_side_effect_free(fleet: FleetConfig, server: str, tool: str) -> bool:
    configured = fleet.servers.get(server)
    tool_config = configured.tools.get(tool) if configured is not None else None
    return tool_config is not None and tool_config.side_effect_free


def side_effect_free_tools(fleet: FleetConfig) -> list[str]:
    """``server/tool`` of every tool marked side-effect-free."""
    return sorted(
        f"{name}/{tool}"
        for name, server in fleet.servers.items()
        for tool, config in server.tools.items()
        if config.side_effect_free
    )
