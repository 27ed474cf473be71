"""The launch gate's report: its verdict, its JSON shape, and how the list behind a failure is capped."""

from __future__ import annotations

from console.launch_gate import Criterion, GateReport, behind_list


def test_the_gate_passes_only_when_every_criterion_does() -> None:
    ok = Criterion("a", "0", "0", True)
    bad = Criterion("b", "2", "0", False, ["op 1", "op 2"])
    assert GateReport([ok]).passed
    assert not GateReport([ok, bad]).passed
    assert GateReport([ok, bad]).failing == [bad]
    assert GateReport([ok, bad]).to_json() == {
        "passed": False,
        "verdict": "failed",
        "criteria": [
            {
                "name": "a",
                "measured": "0",
                "target": "0",
                "passed": True,
                "behind": [],
                "missing": [],
                "verdict": "pass",
            },
            {
                "name": "b",
                "measured": "2",
                "target": "0",
                "passed": False,
                "behind": ["op 1", "op 2"],
                "missing": [],
                "verdict": "fail",
            },
        ],
    }


def test_a_criterion_without_its_evidence_neither_passes_nor_fails_the_gate() -> None:
    ok = Criterion("a", "0", "0", True)
    unknown = Criterion("b", "no simulation run yet", "0", False, missing=["run longcall gate simulate"])
    bad = Criterion("c", "2", "0", False, ["op 1"])
    assert unknown.verdict == "no evidence"
    assert (GateReport([ok, unknown]).passed, GateReport([ok, unknown]).verdict) == (
        False,
        "missing evidence",
    )
    assert GateReport([ok, unknown]).missing == ["run longcall gate simulate"]
    assert GateReport([ok, unknown, bad]).verdict == "failed"
    assert GateReport([ok]).verdict == "passed"


def test_the_list_behind_a_failure_says_how_many_more_there_are() -> None:
    assert behind_list(["a", "b"], 2) == ["a", "b"]
    assert behind_list(["a", "b"], 5) == ["a", "b", "and 3 more"]
    assert behind_list([], 0) == []
