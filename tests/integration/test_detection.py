"""Failure detection and clean exits, through a real lighthouse: a rank that
dies is news at once, whatever its rank; a group that shuts down leaves."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ftdist.coordination import LighthouseClient, LighthouseEvent, LighthouseServer
from ftdist.launch.ranks import Ranks
from tests.integration.ft_training import train
from tests.integration.lighthouse_helpers import Lighthouses
from tests.integration.test_recovery import SLOW

pytestmark = pytest.mark.slow


class _Events:
    """Collects a lighthouse's events on a thread until closed."""

    def __init__(self, address: str) -> None:
        self._client = LighthouseClient(address, 10.0)
        self._stream = self._client.subscribe("test")
        self.events: list[LighthouseEvent] = []
        self._thread = threading.Thread(target=self._run, name="test-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._stream:
                self.events.append(event)
        except Exception:
            pass

    def close(self) -> list[LighthouseEvent]:
        self._stream.close()
        self._thread.join(timeout=10)
        self._client.close()
        return self.events


def _about(events: list[LighthouseEvent], prefix: str, kind: str) -> list[LighthouseEvent]:
    return [e for e in events if e.kind == kind and e.replica_id.startswith(prefix)]


@pytest.mark.timeout(90)
def test_a_group_that_shuts_down_leaves_instead_of_failing(lh: Lighthouses) -> None:
    # Replica 1 stops at step 5 and shuts its Manager down; replica 0 goes on
    # to step 15. The lighthouse hears a leave, not a death, and replica 0
    # never fails a step for it (without the leave it would abort its
    # group on the failure news, or wait out the join timeout).
    server: LighthouseServer = lh.server(join_timeout_ms=30_000, heartbeat_timeout_ms=5_000)
    events = _Events(server.address())
    try:
        actions: dict[int, dict[str, Any]] = {
            0: {**SLOW, "finishers": 1},
            1: {**SLOW, "stop_at": 5, "finishers": 1},
        }
        with Ranks(train, 2, args=(server.address(), 1, 15, actions)) as ranks:
            outcomes = ranks.join(timeout=80)
    finally:
        seen = events.close()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    stayed, left = outcomes[0].value, outcomes[1].value
    assert left["step"] == 5 and stayed["step"] == 15
    assert not stayed["errors"], stayed["errors"]
    assert _about(seen, "replica1:", "member_left")
    assert not _about(seen, "replica1:", "member_failed"), seen


@pytest.mark.timeout(60)
def test_a_dead_non_zero_rank_is_news_like_rank_zero(lh: Lighthouses) -> None:
    # Two groups of two ranks, a 60 s collective timeout; group 1's rank 1
    # dies in the middle of an allreduce. Its closed connection is the news
    # (not a heartbeat: its rank 0 still heartbeats), and group 0 goes on
    # well within this test's limit.
    server: LighthouseServer = lh.server(join_timeout_ms=200, heartbeat_timeout_ms=5_000)
    events = _Events(server.address())
    try:
        actions: dict[int, dict[str, Any]] = {
            r: {**SLOW, "timeout_s": 60, "finishers": 2} for r in range(4)
        }
        actions[3].update(die_at_step=5, mid_allreduce=True)
        with Ranks(train, 4, args=(server.address(), 2, 12, actions)) as ranks:
            outcomes = ranks.join(timeout=50, only=[0, 1, 3])
    finally:
        seen = events.close()
    assert outcomes[3].exitcode == -9
    for survivor in outcomes[:2]:
        assert survivor.ok, survivor.error
        assert survivor.value["step"] == 12
    failed = _about(seen, "replica1:", "member_failed")
    assert failed and "connection" in failed[0].reason, failed
