"""The lighthouse dashboard in a real browser: headless Chromium loads the page
from a live lighthouse and the test reads what a person would see."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftdist.coordination import LighthouseServer
from tests._browser import Chromium, find_chromium, parse_dom, png_size
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
