"""``ftdist demo --algorithm diloco``: DiLoCo under injected failures, end to end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_demo import DemoProcess

# One worker runs these in turn (make pytest: pytest-xdist, loadgroup):
# the chaos suite and the demos each load the whole machine, and a demo
# whose groups are starved by a concurrent chaos run never gets healthy
# enough to be struck.
pytestmark = pytest.mark.xdist_group("heavy")


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[list[DemoProcess]]:
    started: list[DemoProcess] = []
    yield started
    for d in started:
        d.kill_all()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_diloco_demo_with_failures_ends_with_one_global_state(
    tmp_path: Path, runs: list[DemoProcess]
) -> None:
    run = DemoProcess(
        ["--algorithm", "diloco", "--sync-every", "5", "--duration", "12", "--kill-every", "4"],
        tmp_path / "out",
    )
    runs.append(run)
    code, stdout = run.finish(timeout=170)
    assert code == 0, stdout
    assert "VERDICT: PASS" in stdout and "DiLoCo" in stdout
    report = run.report()
    assert report["options"]["algorithm"] == "diloco" and report["options"]["sync_every"] == 5
    verdict = report["verdict"]
    assert verdict["ok"] is True, verdict
    assert len(verdict["hashes"]) == 3 and len(set(verdict["hashes"].values())) == 1
    assert "global weights and outer optimizer state" in verdict["reason"]
    main = report["run"]
    assert main["injections"], f"no failure was injected: {stdout[-3000:]}"
    for injection in main["injections"]:
        assert injection["back_s"] is not None, injection
    # Every victim came back by healing the global state from a survivor.
    recoveries = [h for h in main["heals"] if h["role"] == "receive" and h["step"] > 1]
    assert len(recoveries) >= len(main["injections"])
    assert main["unexpected_exits"] == []
    assert main["loss"]["last"] < main["loss"]["first"], _why_no_learning(main)
    run.assert_nothing_left()


def _why_no_learning(main: dict[str, Any]) -> str:
    """What a run that did not learn looked like: its steps, who took part
    and who healed each, so that a failure under load explains itself."""
    heals = [(h["step"], h["replica"]) for h in main["heals"] if h["role"] == "receive"]
    tail = [(p["step"], p["participants"], p["loss"]) for p in main["curve"][-30:]]
    return (
        f"loss {main['loss']}; {len(main['curve'])} steps committed in {main['duration_s']} s; "
        f"{len(heals)} heals received (step, replica): {heals[-40:]}; injections "
        f"{main['injections']}; failed steps {main['failed_steps'][-20:]}; "
        f"last steps (step, participants, loss): {tail}"
    )
