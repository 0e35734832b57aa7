"""A replica group cut off from its peers, but not from the lighthouse, for
three to four times the collective timeout (``ftdist chaos``'s
``cut-peers-long``, real network namespaces; root only).

It still heartbeats, so before ftdist left such a group out the lighthouse
put it in every quorum and the whole job failed every step until the cut was
lifted. Now the groups report whom they cannot reach after the step the cut
broke, the lighthouse leaves the cut group out of the next quorum
(:mod:`ftdist.lighthouse.partition`), the others train on, and the cut group
rejoins and heals once the cut is lifted; every group ends bit-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftdist.chaos import netns, schedule
from tests.integration.chaos_runs import run_chaos

WHY_NOT = netns.unavailable()
pytestmark = [
    pytest.mark.skipif(WHY_NOT is not None, reason=f"no namespaces: {WHY_NOT}"),
    # Loads the machine like the chaos and demo runs: one worker runs them in turn.
    pytest.mark.xdist_group("heavy"),
]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_group_cut_from_its_peers_past_the_timeout_costs_one_step(tmp_path: Path) -> None:
    # One cut of 15-20 s fits before the end; a second one may start and be
    # lifted early by the end of the run, so only the first is judged.
    run = run_chaos(
        [
            *["--duration", "32", "--groups", "3", "--group-size", "1", "--ballast", "1"],
            *["--gap", "2", "3", "--kinds", schedule.CUT_PEERS_LONG],
        ],
        tmp_path,
        timeout_s=180,
    )
    stdout, logs = run.stdout, run.logs()
    assert run.returncode == 0, stdout[-6000:] + logs
    report = run.report()
    assert report["verdict"]["ok"], (report["verdict"], stdout[-6000:], logs)
    first = report["injections"][0]
    assert first["kind"] == schedule.CUT_PEERS_LONG and first["outcome"] == "done", first
    assert first["hold_s"] >= 3 * schedule.COLLECTIVE_TIMEOUT_S, first
    # The others trained on through the cut, losing at most the step it broke.
    assert first["others_failed_steps"] <= 1, (first, stdout[-4000:])
    assert first["committed_during"] >= 5, (first, stdout[-4000:], logs)
    # The cut group came back: it rejoined a full quorum after the cut,
    # having healed the steps it missed, and every group ends identical.
    assert first["recover_s"] is not None, first
    assert report["heal_transfer"]["count"] >= 1, report["heal_transfer"]
    assert report["divergence"]["ok"] and len(report["divergence"]["hashes"]) == 3
    assert report["hangs"] == [] and report["unexpected_exits"] == []
    assert run.leftovers() == []
