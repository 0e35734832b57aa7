"""MessageQueue across real processes: thousands of arrays, dead peers, single-reader queues.

Modelled on vLLM's ``test_shm_broadcast.py``: four processes, the writer is
rank 2, chunks are small (40 KiB, two of them) so that large arrays take
the overflow path, and every reader checks every array exactly, with random
sleeps on both sides. Here one reader is also served over TCP, as a reader
on another host would be.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from ftdist.launch.ranks import RankContext, Ranks, run_ranks


def _arrays(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 10_000, n)  # about 40 kB of int64 each on average
    return [rng.integers(0, 1 << 40, int(s), dtype=np.int64) for s in sizes]


def _torch_group(ctx: RankContext) -> Any:
    dist.init_process_group("gloo", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
    return dist.group.WORLD


def _ftdist_group(ctx: RankContext) -> Any:
    from ftdist.process_group import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=30)
    pg.configure(ctx.addr("mq"), ctx.rank, ctx.world_size)
    return pg


def _broadcast_arrays(ctx: RankContext, n: int, kind: str) -> dict[str, Any]:
    from ftdist.coordinator import MessageQueue

    pg = _torch_group(ctx) if kind == "torch" else _ftdist_group(ctx)
    writer = 2
    mq = MessageQueue.create_from_process_group(
        pg,
        40 * 1024,
        2,
        writer_rank=writer,
        remote_reader_ranks=[3],
        connect_ip="127.0.0.1",
        timeout=30,
    )
    seed = mq.broadcast_object(random.randrange(1 << 30) if ctx.rank == writer else None)
    arrays = _arrays(n, seed)
    rng = random.Random(seed + ctx.rank)
    checked = 0
    for a in arrays:
        if ctx.rank == writer:
            mq.enqueue(a, timeout=60)
        else:
            got = mq.dequeue(timeout=60)
            assert got.dtype == a.dtype and np.array_equal(got, a)
            checked += 1
        if rng.random() < 0.05:
            time.sleep(rng.random() * 0.002)
    path = (
        "writer" if mq.is_writer else "shm" if ctx.rank in mq.handle.local_reader_ranks else "tcp"
    )
    dist.barrier(group=pg)  # nothing may be in flight when the writer shuts down
    mq.shutdown()
    return {"checked": checked, "path": path, "seed": seed}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["torch", "ftdist"])
def test_thousands_of_random_arrays_reach_every_reader(kind: str) -> None:
    n = 3000 if kind == "torch" else 1000
    out = run_ranks(_broadcast_arrays, 4, n, kind, timeout=200)
    assert [o["path"] for o in out] == ["shm", "shm", "writer", "tcp"]
    assert [o["checked"] for o in out] == [n, n, 0, n]
    assert len({o["seed"] for o in out}) == 1


def _dead_reader(ctx: RankContext, remote: bool) -> dict[str, Any]:
    from ftdist.coordinator import MessageQueue, PeerGoneError

    pg = _torch_group(ctx)
    mq = MessageQueue.create_from_process_group(
        pg,
        1024,
        2,
        writer_rank=0,
        remote_reader_ranks=[1] if remote else [],
        connect_ip="127.0.0.1",
        timeout=30,
    )
    if ctx.rank == 1:
        assert mq.dequeue(timeout=30) == "first"
        os.kill(os.getpid(), signal.SIGKILL)
    if ctx.rank == 2:
        while True:  # a healthy reader keeps reading until the writer gives up
            try:
                mq.dequeue(timeout=60)
            except Exception as exc:
                return {"reader_error": type(exc).__name__}
    mq.enqueue("first")
    start = time.monotonic()
    try:
        for i in range(100_000):
            mq.enqueue(i, timeout=120)
    except PeerGoneError as exc:
        failed_after = time.monotonic() - start
        mq.shutdown()
        return {"ranks": exc.ranks, "message": str(exc), "seconds": failed_after}
    return {"ranks": None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("remote", [False, True], ids=["shm-reader", "tcp-reader"])
def test_writer_detects_a_dead_reader(remote: bool) -> None:
    with Ranks(_dead_reader, 3, args=(remote,)) as ranks:
        outcomes = ranks.join(timeout=100)
    assert outcomes[1].exitcode == -signal.SIGKILL
    writer = outcomes[0]
    assert writer.ok, writer.error
    # The writer names the dead reader; it did not wait out its 120 s timeout
    # (the test's own timeout is shorter).
    assert writer.value["ranks"] == [1], writer.value
    assert "reader rank(s) [1]" in writer.value["message"]
    # The healthy reader learns that the writer went away.
    assert outcomes[2].ok and outcomes[2].value == {"reader_error": "PeerGoneError"}


def _dead_writer(ctx: RankContext) -> dict[str, Any]:
    from ftdist.coordinator import MessageQueue, PeerGoneError

    pg = _torch_group(ctx)
    mq = MessageQueue.create_from_process_group(
        pg, 1024, 2, writer_rank=0, remote_reader_ranks=[2], connect_ip="127.0.0.1", timeout=30
    )
    if ctx.rank == 0:
        mq.enqueue("only message")
        dist.barrier(group=pg)
        os.kill(os.getpid(), signal.SIGKILL)
    assert mq.dequeue(timeout=30) == "only message"
    dist.barrier(group=pg)
    try:
        mq.dequeue()  # no timeout: only the writer's death can end this
    except PeerGoneError as exc:
        return {"ranks": exc.ranks, "message": str(exc)}
    return {"ranks": None}


@pytest.mark.timeout(120)
def test_readers_detect_a_dead_writer() -> None:
    with Ranks(_dead_writer, 3) as ranks:
        outcomes = ranks.join(timeout=100)
    assert outcomes[0].exitcode == -signal.SIGKILL
    for reader in outcomes[1:]:  # rank 1 reads shared memory, rank 2 TCP
        assert reader.ok, reader.error
        assert reader.value["ranks"] == [0], reader.value
        assert "writer rank 0 is gone" in reader.value["message"]


def _single_reader(ctx: RankContext) -> list[Any]:
    from ftdist.coordinator import GroupCoordinator, MessageQueue

    dist.init_process_group("gloo", store=ctx.store(), rank=ctx.rank, world_size=ctx.world_size)
    g = GroupCoordinator([list(range(ctx.world_size))], ctx.rank, "gloo", True, group_name="g")
    reader = 1
    mq, handles = g.create_single_reader_mq_broadcasters(reader_rank_in_group=reader)
    assert mq is not None
    received: list[Any] = []
    if ctx.rank == reader:
        assert len(handles) == ctx.world_size
        readers = [MessageQueue.create_from_handle(h, reader) for h in handles]
        mq.wait_until_ready(timeout=30)
        for r in readers:
            r.wait_until_ready(timeout=30)
        mq.enqueue(("from", ctx.rank))
        received = [r.dequeue(timeout=30) for r in readers]
        for r in readers:
            r.shutdown()
    else:
        assert handles == []
        mq.wait_until_ready(timeout=30)
        mq.enqueue(("from", ctx.rank))
    g.barrier()
    mq.shutdown()
    g.destroy()
    return received


@pytest.mark.timeout(120)
def test_single_reader_broadcasters_reach_the_reader() -> None:
    out = run_ranks(_single_reader, 3, timeout=100)
    assert out[1] == [("from", 0), ("from", 1), ("from", 2)]
    assert out[0] == out[2] == []


def _external_writer(ctx: RankContext) -> list[Any]:
    from ftdist.coordinator import MessageQueue

    pg = _torch_group(ctx)
    # A writer outside the group's roles: every rank of pg (rank 0 too) reads.
    external = (
        MessageQueue(ctx.world_size, ctx.world_size, list(range(ctx.world_size)))
        if ctx.rank == 0
        else None
    )
    handle = external.export_handle() if external is not None else None
    mq = MessageQueue.create_from_process_group(
        pg, 1 << 16, 4, writer_rank=0, external_writer_handle=handle, blocking=False
    )
    if external is not None:
        # Every rank subscribed while joining; the writer sees them, sends READY.
        external.wait_until_ready(timeout=30)
        for i in range(3):
            external.enqueue({"i": i})
    mq.wait_until_ready(timeout=30)
    got = [mq.dequeue(timeout=30) for _ in range(3)]
    dist.barrier(group=pg)
    mq.shutdown()
    if external is not None:
        external.shutdown()
    return got


@pytest.mark.timeout(120)
def test_external_writer_handle_makes_every_rank_a_reader() -> None:
    out = run_ranks(_external_writer, 3, timeout=100)
    assert out == [[{"i": 0}, {"i": 1}, {"i": 2}]] * 3
