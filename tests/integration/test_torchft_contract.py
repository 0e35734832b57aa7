"""Manager behaviour torchft code relies on, against a real lighthouse and manager server."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from ftdist.manager import Manager
from ftdist.process_group import ProcessGroupGloo

pytestmark = pytest.mark.timeout(60)

# torchft's bindings word a call's timeout this way; code written for torchft
# matches the message with a regex like this one.
TORCHFT_TIMEOUT = r"status: Cancelled, message.*Timeout expired"


def test_a_sync_quorum_that_times_out_raises_timeout_error_in_torchfts_words(lh: Any) -> None:
    lighthouse = lh.server(min_replicas=2)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # Group rank 0 of a group of 2: its peer never comes, so neither the
    # quorum nor the vote can complete.
    manager = Manager(
        pg=ProcessGroupGloo(),
        min_replica_size=2,
        load_state_dict=lambda sd: None,
        state_dict=lambda: None,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=2,
        lighthouse_addr=str(lighthouse.address()),
        port=0,
        use_async_quorum=False,
    )
    try:
        with pytest.raises(TimeoutError, match=TORCHFT_TIMEOUT):
            manager.start_quorum(timeout=timedelta(milliseconds=10))
        # ftdist's vote never raises (unlike torchft's): the timeout is the
        # step's recorded error, in the same words, and the vote is no.
        assert manager.should_commit(timeout=timedelta(milliseconds=10)) is False
        assert "should_commit" in str(manager.errored())
        assert re.search(TORCHFT_TIMEOUT, str(manager.errored()))
    finally:
        manager.shutdown(wait=False)
