"""The lighthouse dashboard in a real browser: headless Chromium loads the page
from a live lighthouse and the test reads what a person would see."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ftdist.coordination import LighthouseServer
from ftdist.etcd.local import LocalEtcdCluster
from ftdist.lighthouse.local import LocalLighthouseReplicas
from tests._browser import Chromium, find_chromium, parse_dom, png_size
from tests.etcd_fixtures import etcd_cluster  # noqa: F401
from tests.integration.lighthouse_helpers import TIMEOUT, Lighthouses, get_json, pool, wait_until

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120), pytest.mark.xdist_group("browser")]


@pytest.fixture(scope="session")
def chromium() -> Chromium:
    """Headless Chromium; the browser tier is skipped without one."""
    path = find_chromium()
    if path is None:
        pytest.skip("no Chromium found: `make setup-browser` installs it (or set FTDIST_CHROMIUM)")
    return Chromium(path)


def _form_quorums(server: LighthouseServer, lh: Lighthouses) -> None:
    """Quorum 1 of trainer-a and trainer-b; then quorum 2, which trainer-c
    joins at step 0 while the others are at step 40, so it is recovering."""
    client = lh.client(server)

    def join(rid: str, step: int) -> None:
        client.quorum(
            rid,
            TIMEOUT,
            address=f"http://{rid}.example:29510",
            store_address=f"{rid}.example:29500",
            step=step,
            world_size=8,
        )

    with pool(3) as executor:
        for future in [executor.submit(join, rid, 0) for rid in ("trainer-a", "trainer-b")]:
            future.result(TIMEOUT)
        # The newcomer asks first: once every previous member asks again the
        # quorum forms at once (fast quorum), with whoever is waiting by then.
        late = executor.submit(join, "trainer-c", 0)
        wait_until(
            lambda: any(
                w["replica_id"] == "trainer-c"
                for w in get_json(f"{server.dashboard_address()}/status.json")["waiting"]
            ),
            what="trainer-c waiting for a quorum",
        )
        futures = [executor.submit(join, rid, 40) for rid in ("trainer-a", "trainer-b")]
        for future in [late, *futures]:
            future.result(TIMEOUT)


def test_dashboard_shows_quorum_members_and_recovering_member(
    chromium: Chromium, lh: Lighthouses, tmp_path: Path
) -> None:
    # Long enough that no member is declared dead while a slow machine
    # starts the browser: nobody heartbeats after joining.
    server = lh.server(min_replicas=2, http_port=0, heartbeat_timeout_ms=120_000)
    _form_quorums(server, lh)
    url = f"{server.dashboard_address()}/"

    page = parse_dom(chromium.dump_dom(url))

    assert page.by_id("error").text == ""
    assert page.by_id("quorum-id").text == "2"
    assert page.by_id("num-members").text == "3"
    assert page.by_id("max-step").text == "40"
    assert page.by_id("quorum-age").text.endswith(" s")
    assert page.by_id("next-reason").text not in ("", "-")
    cards = {card.attrs["data-replica-id"]: card for card in page.by_class("member")}
    assert sorted(cards) == ["trainer-a", "trainer-b", "trainer-c"]
    for rid, card in cards.items():
        # The replica id is written on the card, not only in an attribute.
        assert card.by_class("rid")[0].text == rid
        assert f"http://{rid}.example:29510" in card.text
    assert "recovering" in cards["trainer-c"].classes
    assert cards["trainer-c"].by_class("step")[0].text == "0 (recovering)"
    for rid in ("trainer-a", "trainer-b"):
        assert "recovering" not in cards[rid].classes
        assert cards[rid].by_class("step")[0].text == "40"
    beats = {li.attrs["data-replica-id"] for li in page.by_class("heartbeat")}
    assert beats == {"trainer-a", "trainer-b", "trainer-c"}
    # The kill action is off without a token, so its controls are hidden.
    assert "Kill" not in page.by_id("members").text

    shot = tmp_path / "dashboard.png"
    chromium.screenshot(url, shot, size=(1280, 900))
    data = shot.read_bytes()
    assert png_size(data) == (1280, 900)
    # A blank page is ~5 KB and the dashboard without data (lighthouse
    # unreachable) ~28 KB; with three member cards it is ~85 KB.
    assert len(data) > 40_000, len(data)


def test_dashboard_before_the_first_quorum(chromium: Chromium, lh: Lighthouses) -> None:
    server = lh.server(min_replicas=2, http_port=0, kill_token="s3cret")
    lh.client(server).heartbeat("trainer-a")

    page = parse_dom(chromium.dump_dom(f"{server.dashboard_address()}/"))

    assert page.by_id("error").text == ""
    assert page.by_id("quorum-id").text == "0"
    assert page.by_id("num-members").text == "-"
    assert page.by_id("quorum-age").text == "-"
    assert page.by_id("num-heartbeating").text == "1"
    assert "need min_replicas 2" in page.by_id("next-reason").text
    assert page.by_class("member") == []
    [beat] = page.by_class("heartbeat")
    assert beat.text.startswith("trainer-a: seen ") and beat.text.endswith(" s ago")
    # With a kill token the token field is shown.
    assert "hidden" not in page.by_id("kill-controls").attrs


def test_single_lighthouse_hides_the_replicas_panel(chromium: Chromium, lh: Lighthouses) -> None:
    server = lh.server(http_port=0)

    page = parse_dom(chromium.dump_dom(f"{server.dashboard_address()}/"))

    assert page.by_id("error").text == ""
    assert page.by_id("quorum-id").text == "0"
    assert "hidden" in page.by_id("replication").attrs
    assert "hidden" in page.by_id("follower-notice").attrs


def test_dashboard_shows_the_lighthouse_replicas(
    chromium: Chromium,
    etcd_cluster: LocalEtcdCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    job = "browser-replicas"
    with LocalLighthouseReplicas(etcd_cluster.endpoint_arg, job, 3, log_dir=tmp_path / "lh") as lhs:
        leader = lhs.wait_leader()
        follower = (leader + 1) % 3
        names = [a.removeprefix("http://") for a in lhs.addresses]

        def settled(i: int) -> bool:
            # The replica set and etcd health are read every ~2 s.
            replication = get_json(f"{lhs.dashboards[i]}/status.json")["replication"]
            return (
                len(replication["replicas"]) == 3
                and {r["role"] for r in replication["replicas"]} == {"leader", "follower"}
                and bool(replication["failovers"])
                and bool(replication["etcd"])
                and all(m["ok"] for m in replication["etcd"])
            )

        wait_until(
            lambda: settled(leader) and settled(follower), 20, "the replicas see the replica set"
        )

        page = parse_dom(chromium.dump_dom(f"{lhs.dashboards[follower]}/"))
        assert page.by_id("error").text == ""
        assert "hidden" not in page.by_id("replication").attrs
        assert page.by_id("repl-job").text == job
        assert page.by_id("repl-self").text == names[follower]
        assert page.by_id("repl-role").text == "follower"
        [leader_anchor] = [e for e in page.by_id("repl-leader").iter() if e.tag == "a"]
        assert leader_anchor.text == names[leader]
        assert leader_anchor.attrs["href"] == lhs.dashboards[leader]
        # A follower's page says at once where the quorum view is.
        notice = page.by_id("follower-notice")
        assert "hidden" not in notice.attrs
        assert "follower" in notice.text and names[leader] in notice.text
        assert page.by_id("leader-link").attrs["href"] == lhs.dashboards[leader]
        assert page.by_id("repl-lease").text.startswith("TTL ")
        assert page.by_id("repl-serving").text.startswith("Not serving: ")
        rows = {row.attrs["data-name"]: row for row in page.by_class("replica")}
        assert sorted(rows) == sorted(names)
        for i, name in enumerate(names):
            role = "leader" if i == leader else "follower"
            assert rows[name].by_class("role")[0].text == role
            assert f"role-{role}" in rows[name].classes
            assert ("self" in rows[name].classes) is (i == follower)
        members = page.by_class("etcd-member")
        assert [m.attrs["data-endpoint"] for m in members] == etcd_cluster.endpoints
        assert all(m.by_class("health")[0].text == "ok" for m in members)
        assert all(m.by_class("version")[0].text not in ("", "-") for m in members)
        assert sum(m.by_class("raft")[0].text == "leader" for m in members) == 1
        assert all(m.by_class("latency")[0].text.endswith(" ms") for m in members)
        newest = page.by_class("failover")[0]
        assert newest.by_class("leader")[0].text == names[leader]
        assert newest.by_class("time")[0].text[:2] == "20"

        page = parse_dom(chromium.dump_dom(f"{lhs.dashboards[leader]}/"))
        assert page.by_id("repl-role").text.startswith("leader for ")
        assert "hidden" in page.by_id("follower-notice").attrs
        assert page.by_id("repl-serving").text.startswith("Serving: ")


def test_dashboard_history_shows_a_runs_failure_rejoin_and_heal(
    chromium: Chromium, lh: Lighthouses, tmp_path: Path
) -> None:
    # A real run: two replica groups train, one is SIGKILLed and restarted,
    # and heals live. The page is loaded while the survivors still train.
    import threading

    from tests.integration.test_manager import assert_consistent
    from tests.integration.test_recovery import SLOW, _run

    server = lh.server(join_timeout_ms=30_000, heartbeat_timeout_ms=5_000, http_port=0)
    address, status_url = str(server.address()), f"{server.dashboard_address()}/status.json"
    steps, die_at = 150, 5
    actions = {0: {**SLOW, "hold_until_rejoin_at": die_at + 2}, 1: {"die_at_step": die_at, **SLOW}}
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["results"] = _run(
                address, 2, 1, steps, actions, [dict.fromkeys(range(2), SLOW)]
            )
        except BaseException as exc:  # reported by the test thread
            outcome["error"] = exc

    trainer = threading.Thread(target=run, name="history-run")
    trainer.start()
    try:

        def healed() -> bool:
            events = get_json(status_url)["history"]["events"]
            return any(e["kind"] == "heal" and e["step"] >= die_at for e in events)

        wait_until(lambda: healed() or not trainer.is_alive(), timeout=90, what="the heal")
        url = f"{server.dashboard_address()}/"
        page = parse_dom(chromium.dump_dom(url))
        shot = tmp_path / "dashboard-history.png"
        chromium.screenshot(url, shot, size=(1280, 1600))
    finally:
        trainer.join(150)
    assert "error" not in outcome, outcome.get("error")
    assert_consistent(outcome["results"], steps)

    # One failure injected, one failure mark; the replacement's rejoin.
    marks = page.by_class("failure-mark")
    assert len(marks) == 1, [m.attrs for m in marks]
    assert marks[0].attrs["data-cause"] in ("connection closed", "heartbeat timeout")
    assert page.by_class("rejoin-mark"), "the replacement's rejoin is not marked"
    # Quorums of both groups, then (when the survivor's quorum came first)
    # one without the victim, then one with its replacement.
    assert int(page.by_id("participants-line").attrs["data-points"]) >= 2
    # Each heal bar is split into its phases, which sum to its total.
    heals = page.by_class("heal")
    assert any(int(h.attrs["data-step"]) >= die_at for h in heals), [h.attrs for h in heals]
    for heal in heals:
        phases = heal.by_class("phase")
        assert [p.attrs["data-phase"] for p in phases] == [
            "quorum_s",
            "reconfigure_s",
            "transfer_s",
            "load_s",
        ]
        total = sum(float(p.attrs["data-seconds"]) for p in phases)
        assert abs(total - float(heal.attrs["data-total"])) < 1e-3, heal.attrs
    assert page.by_class("rate-bar"), "no committed-steps bars"
    assert len(page.by_class("event")) >= 3
    data = shot.read_bytes()
    assert png_size(data) == (1280, 1600)
    assert len(data) > 60_000, len(data)
