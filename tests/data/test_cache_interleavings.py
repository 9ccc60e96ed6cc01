"""The arena's protocol explored: every interleaving of its actors' steps within a bound, and a SIGKILL at any step.

The explorer is ``tests/data/_interleavings.py`` (its docstring states the actors, the steps, the scope and the
invariants); each exploration runs in a process of its own, which loads the arena without torch. The orderings
that handed a reader another sample's bytes (the 0.4.0 review's two, found by reading, and one this exploration
found) are put back as mutations: the exploration must find each.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.data import _interleavings
from tests.data.test_cache import ROOT

#: Seconds one exploration may take on a loaded machine: the largest takes about 20 s on a quiet one.
EXPLORE_TIMEOUT_S = 600


def _explore(scenario: str, mutation: str = "", preemptions: int = 2, kills: int = 0) -> dict[str, Any]:
    args = [scenario, mutation, str(preemptions), str(kills)]
    proc = subprocess.run([sys.executable, "-m", "tests.data._interleavings", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=EXPLORE_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_the_steps_include_every_write_of_the_protocol() -> None:
    steps = _interleavings.step_lines(_interleavings.modules())
    lines = {kind: [] for kind in ("lock", "unlock", "write", "read")}  # type: dict[str, list[str]]
    for (path, number), kind in steps.items():
        with open(path) as f:
            lines[kind].append(f.read().splitlines()[number - 1].strip())
    assert "local.table[base] = READY  # last: readers take READY to mean complete" in lines["write"]
    assert "header[H_ERA] += 1" in lines["write"] and "table[gone, 0] = EMPTY" in lines["write"]
    assert "sizes[first] -= np.uint64(nbytes)" in lines["write"]
    assert "table[slot, _PID] = pid  # last: a slot killed half-written has no pid, and holds nothing" in lines["write"]
    assert "era = header[H_ERA]" in lines["read"] and len(lines["lock"]) == len(lines["unlock"]) == 1


@pytest.mark.parametrize("scenario", sorted(_interleavings.SCENARIOS))
@pytest.mark.parametrize("kills", [0, 1], ids=["preemptions", "a-kill-at-any-step"])
def test_every_interleaving_keeps_the_invariants(scenario: str, kills: int) -> None:
    # Its preemption bound without a kill; with one, the kill is the only switch an execution may make at will.
    preemptions = _interleavings.SCENARIOS[scenario].preemptions if not kills else 0
    result = _explore(scenario, "", preemptions, kills)
    assert result["violation"] is None, result
    assert result["executions"] >= 20, result  # the scope did not collapse (a step line no longer traced)


@pytest.mark.parametrize("mutation", sorted(_interleavings.MUTATIONS))
def test_each_ordering_the_review_found_is_found(mutation: str) -> None:
    scenario = {
        "era-before-evict": "evict-while-read",
        "reserve-without-recheck": "first-follow",
        "follow-asked-first": "read-across-first-follow",
    }[mutation]
    result = _explore(scenario, mutation, _interleavings.SCENARIOS[scenario].preemptions)
    assert result["violation"] is not None, result
