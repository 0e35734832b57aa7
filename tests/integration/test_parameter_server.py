"""ParameterServer: a session per client, each on its own Gloo group, over real sockets."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

from ftdist.parameter_server import ParameterServer
from ftdist.process_group import ProcessGroup, ProcessGroupGloo

pytestmark = pytest.mark.timeout(90)


class AddServer(ParameterServer):
    """Receives a tensor from the client, adds 23 (or fails on request), sends it back."""

    sessions: list[str]

    def __init__(self) -> None:
        self.sessions = []
        self.failed = threading.Event()
        super().__init__(port=0, host="::1")

    @classmethod
    def new_process_group(cls) -> ProcessGroup:
        return ProcessGroupGloo(timeout=timedelta(seconds=10))

    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        self.sessions.append(session_id)
        data = torch.zeros(1)
        for _ in range(2):
            pg.broadcast_one(data, root=1).wait()  # from the client
            if data.item() < 0:
                self.failed.set()
                raise ValueError("negative input")
            data += 23
            pg.broadcast_one(data, root=0).wait()  # to the client


def _round_trip(pg: ProcessGroup, value: float) -> float:
    data = torch.tensor([float(value)])
    pg.broadcast_one(data, root=1).wait()
    pg.broadcast_one(data, root=0).wait()
    return data.item()


def test_sessions_are_independent_and_a_failed_one_ends_alone() -> None:
    server = AddServer()
    try:
        assert server.address().endswith("/new_session")
        first = AddServer.new_session(server.address())
        second = AddServer.new_session(server.address())
        try:
            assert (first.rank(), first.size()) == (1, 2)
            assert _round_trip(first, 12) == 35
            assert _round_trip(second, 1) == 24
            assert _round_trip(first, 0) == 23  # several operations per session
        finally:
            first.shutdown()
            second.shutdown()
        assert len(set(server.sessions)) == 2

        doomed = AddServer.new_session(server.address())
        doomed.broadcast_one(torch.tensor([-1.0]), root=1).wait()
        assert server.failed.wait(10)
        doomed.shutdown()
        fresh = AddServer.new_session(server.address())  # the server goes on
        try:
            assert _round_trip(fresh, 2) == 25
        finally:
            fresh.shutdown()

        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(server.address().replace("new_session", "other"), timeout=10)

        idle = AddServer.new_session(server.address())
        server.shutdown()  # aborts the idle session's group and joins its thread
        idle.shutdown()
        with pytest.raises(urllib.error.URLError):
            AddServer.new_session(server.address(), timeout=5)
    finally:
        server.shutdown()
