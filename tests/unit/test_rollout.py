"""The canary's stable hash, the routing table, and the boundary check of a legacy outcome (issue 12)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from ledger.digests import digest
from ledger.states import TerminalKind
from workers.errors import InvalidSubmission
from workers.rollout import RolloutState, canary_bucket, decide, in_canary
from workers.submission import parse_legacy_outcome

IDS = [f"pipeline-7/run-{i}/call-{i % 13}" for i in range(2000)]


def test_the_bucket_is_sha256_of_the_call_node_id_and_never_changes() -> None:
    # Pinned: a change of the hash re-routes every call node of a running canary.
    assert [canary_bucket(i) for i in ("node-1", "n/a", "é")] == [4842, 6495, 2051]
    head = hashlib.sha256(b"node-1").digest()[:8]
    assert canary_bucket("node-1") == int.from_bytes(head, "big") % 10_000


def test_five_percent_routes_about_five_percent_and_raising_only_adds() -> None:
    at5 = {i for i in IDS if in_canary(i, 5)}
    at10 = {i for i in IDS if in_canary(i, 10)}
    # 2,000 draws at p = 0.05: mean 100, standard deviation ~9.7; 4 sigma either side.
    assert 60 <= len(at5) <= 140
    assert at5 < at10
    assert not any(in_canary(i, 0) for i in IDS)
    assert all(in_canary(i, 100) for i in IDS)


def test_the_routed_set_is_the_same_in_another_process() -> None:
    """Another interpreter, another hash seed: the same ids are routed (no process-local hash)."""
    here = sorted(i for i in IDS if in_canary(i, 5))
    script = (
        "import json, sys; from workers.rollout import in_canary; "
        "ids = json.load(sys.stdin); print(json.dumps(sorted(i for i in ids if in_canary(i, 5))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(IDS),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        check=True,
    )
    assert json.loads(done.stdout) == here


def test_the_routing_table() -> None:
    inside = next(i for i in IDS if in_canary(i, 5))
    outside = next(i for i in IDS if not in_canary(i, 5))
    none = RolloutState(canary_percent=None, shadow=False)
    shadow_only = RolloutState(canary_percent=None, shadow=True)
    canary = RolloutState(canary_percent=5, shadow=False)
    both = RolloutState(canary_percent=5, shadow=True)
    cases = [
        (none, outside, False, "live"),
        (shadow_only, outside, True, "shadow"),
        (shadow_only, outside, False, "live"),  # a tool with side effects is never shadowed
        (canary, inside, False, "live"),
        (canary, outside, True, "not_routed"),
        (both, inside, True, "live"),
        (both, outside, True, "shadow"),
        (both, outside, False, "not_routed"),
    ]
    for rollout, call_node, side_effect_free, route in cases:
        assert decide(call_node, side_effect_free=side_effect_free, rollout=rollout).route == route, (
            rollout,
            side_effect_free,
        )
    answer = decide(outside, side_effect_free=False, rollout=canary).answer()
    assert answer == {"routed": False, "reason": "canary", "percent": 5}


def test_a_legacy_outcome_is_checked_at_the_boundary() -> None:
    result = {"content": [{"type": "text", "text": "ok"}], "isError": False}
    parsed = parse_legacy_outcome(
        {"call_node_id": "n/1", "terminal_state": "completed", "result": result}, max_body_bytes=1000
    )
    assert (parsed.terminal_state, parsed.result_digest) == (TerminalKind.COMPLETED, digest(result))
    refusals: dict[str, dict[str, Any]] = {
        "needs ['terminal_state']": {"call_node_id": "n/1"},
        "terminal_state must be one of": {"call_node_id": "n/1", "terminal_state": "ACCEPTED"},
        "result_digest must look like": {
            "call_node_id": "n/1",
            "terminal_state": "failed",
            "result_digest": "x",
        },
        "not the result_digest given": {
            "call_node_id": "n/1",
            "terminal_state": "completed",
            "result": result,
            "result_digest": "sha256:" + "0" * 64,
        },
        "result is not JSON": {"call_node_id": "n/1", "terminal_state": "completed", "result": float("nan")},
        "bytes of JSON; the limit is 1000": {
            "call_node_id": "n/1",
            "terminal_state": "completed",
            "result": "x" * 2000,
        },
        "unknown argument(s) ['state']": {"call_node_id": "n/1", "terminal_state": "failed", "state": 1},
        "call_node_id must not be empty": {"call_node_id": " ", "terminal_state": "failed"},
        "detail must be a JSON object": {"call_node_id": "n/1", "terminal_state": "failed", "detail": [1]},
    }
    for message, kwargs in refusals.items():
        with pytest.raises(InvalidSubmission) as refused:
            parse_legacy_outcome(kwargs, max_body_bytes=1000)
        assert message in str(refused.value), (message, str(refused.value))
