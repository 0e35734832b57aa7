"""The lighthouse's job history through a real run: a group killed, restarted and healed."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest

from ftdist.cli.status_text import render
from tests.integration.lighthouse_helpers import Lighthouses
from tests.integration.test_manager import assert_consistent
from tests.integration.test_recovery import SLOW, _run

pytestmark = pytest.mark.integration


def _events(history: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in history["events"] if e["kind"] == kind]


@pytest.mark.timeout(150)
def test_a_failure_and_its_heal_show_in_the_history_json_metrics_and_terminal(
    lh: Lighthouses,
) -> None:
    server = lh.server(join_timeout_ms=30_000, heartbeat_timeout_ms=5_000, http_port=0)
    address = str(server.address())
    steps, victim, die_at = 30, 1, 5
    actions = {0: {**SLOW, "hold_until_rejoin_at": die_at + 2}, 1: {"die_at_step": die_at, **SLOW}}
    results = _run(address, 2, 1, steps, actions, [dict.fromkeys(range(2), SLOW)])
    assert_consistent(results, steps)

    status = lh.client(address).status()
    history = status["history"]
    context = repr(history["events"])
    failures = _events(history, "failure")
    # The SIGKILLed group's death, once, with its cause; then the groups
    # that ended their runs leave.
    dead = [f for f in failures if f["cause"] != "left"]
    assert len(dead) == 1, context
    assert dead[0]["cause"] in ("connection closed", "heartbeat timeout"), context
    assert history["failures_by_cause"][dead[0]["cause"]] == 1
    # The quorum without it, then one with the replacement (it rejoined).
    quorums = _events(history, "quorum")
    after = [q for q in quorums if q["t"] >= dead[0]["t"]]
    assert any(q["num_joined"] == 1 and q["members"] == 2 for q in after), context
    # The replacement's heal, as its manager reported it: phases that sum to
    # its total, the bytes it received, and the step it healed to.
    # (Every replica healed at step 0 from the primary too: init_sync.)
    heals = [h for h in _events(history, "heal") if h["ok"] and h["step"] >= die_at]
    assert heals, context
    heal = heals[0]
    parts = heal["quorum_s"] + heal["reconfigure_s"] + heal["transfer_s"] + heal["load_s"]
    assert heal["total_s"] == pytest.approx(parts, abs=1e-3)
    assert heal["transfer_bytes"] > 0 and heal["step"] >= die_at
    healed = next(r for r in results if r["replica"] == victim)
    assert heal["step"] in {h["step"] for h in healed["heals"] if h["role"] == "receive"}
    assert history["in_flight"] == []
    assert [s[1] for s in history["steps"]] == sorted(s[1] for s in history["steps"])

    dashboard = server.dashboard_address()
    assert dashboard is not None
    with urllib.request.urlopen(f"{dashboard}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    cause = dead[0]["cause"]
    assert f'ftdist_lighthouse_failures_total{{cause="{cause}"}} 1' in metrics, metrics
    assert f"ftdist_lighthouse_heals_total {history['heals_total']}" in metrics
    assert history["heals_total"] >= 1

    text = render(status, address)
    assert "History (last" in text and f"{cause}:" in text and "healed:" in text, text


def test_a_torchft_lighthouse_is_not_told_about_heals(lh: Lighthouses) -> None:
    # torchft's lighthouse does not serve ReportHeal: the client says so
    # instead of failing, and the manager's reporter only logs it.
    torchft = pytest.importorskip("torchft._torchft")
    server = torchft.LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=5000,
    )
    try:
        client = lh.client(server.address())
        assert client.report_heal("group-a", {"phase": "transfer", "step": 3}) is False
    finally:
        server.shutdown()


def test_a_malformed_heal_report_is_refused_and_the_lighthouse_goes_on(lh: Lighthouses) -> None:
    from ftdist.errors import CoordinationError

    server = lh.server()
    client = lh.client(server)
    with pytest.raises(CoordinationError, match="phase 'nonsense' is none of"):
        client.report_heal("group-a", {"phase": "nonsense"})
    with pytest.raises(CoordinationError, match="seconds between 0 and 1e7"):
        client.report_heal("group-a", {"phase": "done", "transfer_s": -1.0})
    report = {"phase": "transfer", "step": 4, "transfer_bytes": 100, "bytes_done": 40}
    assert client.report_heal("group-a", report)
    (heal,) = client.status()["history"]["in_flight"]
    assert (heal["phase"], heal["bytes_done"], heal["transfer_bytes"]) == ("transfer", 40, 100)
    assert client.report_heal("group-a", {"phase": "load", "step": 4, "quorum_s": 0.5})
    history = client.status()["history"]
    assert [h["phase"] for h in history["in_flight"]] == ["load"]
    assert client.report_heal("group-a", {"phase": "done", "step": 4, "transfer_bytes": 9})
    history = client.status()["history"]
    assert history["in_flight"] == [] and history["heals_total"] == 1
