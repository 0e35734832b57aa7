"""MessageQueue in one process: a writer here, readers on threads (shared memory and TCP)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from ftdist.coordinator import MessageQueue, PeerGoneError
from ftdist.coordinator.message_queue import QueueShutdownError
from ftdist.errors import CommunicationError


class Reader(threading.Thread):
    """Runs ``body(reader)`` on a thread; keeps what it returned or raised."""

    def __init__(self, mq: MessageQueue, body: Callable[[MessageQueue], Any]) -> None:
        super().__init__(name="test-mq-reader")
        self.mq, self.body = mq, body
        self.result: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.body(self.mq)
        except BaseException as exc:
            self.error = exc

    def outcome(self, timeout: float = 30) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "reader thread hung"
        if self.error is not None:
            raise self.error
        return self.result


# ``queues(local_ranks, remote_ranks, **MessageQueue kwargs)``: a writer and its readers.
MakeQueues = Callable[..., tuple[MessageQueue, list[MessageQueue]]]


@pytest.fixture
def queues() -> Iterator[MakeQueues]:
    made: list[MessageQueue] = []

    def make(
        local: list[int], remote: list[int], **kwargs: Any
    ) -> tuple[MessageQueue, list[MessageQueue]]:
        writer = MessageQueue(
            len(local) + len(remote), len(local), local, connect_ip="127.0.0.1", **kwargs
        )
        readers = [
            MessageQueue.create_from_handle(writer.export_handle(), r) for r in local + remote
        ]
        made.extend([writer, *readers])
        return writer, readers

    yield make
    for mq in made:
        mq.shutdown()


def _ready(writer: MessageQueue, readers: list[MessageQueue]) -> None:
    threads = [Reader(r, lambda mq: mq.wait_until_ready(10)) for r in readers]
    writer.wait_until_ready(10)
    for t in threads:
        t.outcome()


def test_every_reader_gets_every_object_in_order(queues: MakeQueues) -> None:
    writer, readers = queues([1, 2], [3], max_chunk_bytes=2048, max_chunks=2)
    _ready(writer, readers)
    rng = np.random.default_rng(0)
    # Small, chunk-sized and much larger objects (the overflow path), numpy
    # arrays above the out-of-band threshold, and plain Python values.
    objs: list[Any] = [rng.integers(0, 100, int(n)) for n in rng.integers(1, 1000, 150)]
    objs += [np.arange(400_000), {"k": b"x" * 5000}, None, "text"]
    threads = [Reader(r, lambda mq: [mq.dequeue(timeout=30) for _ in objs]) for r in readers]
    for obj in objs:
        writer.enqueue(obj, timeout=30)
    for t in threads:
        got = t.outcome()
        for a, b in zip(objs, got, strict=True):
            if isinstance(a, np.ndarray):
                assert np.array_equal(a, b) and b.flags.writeable
            else:
                assert a == b
    assert [r.rank for r in readers] == [1, 2, 3]


def test_dequeue_times_out_and_the_queue_stays_usable(queues: MakeQueues) -> None:
    writer, (reader,) = queues([1], [])
    _ready(writer, [reader])
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.01)
    writer.enqueue("after")
    assert reader.dequeue(timeout=10) == "after"


def test_shutdown_from_another_thread_cancels_a_blocked_dequeue(queues: MakeQueues) -> None:
    writer, (reader,) = queues([1], [])
    _ready(writer, [reader])
    t = Reader(reader, lambda mq: mq.dequeue(timeout=30))
    time.sleep(0.2)
    reader.shutdown()
    with pytest.raises(QueueShutdownError, match="shut down"):
        t.outcome(timeout=10)
    assert reader.shutting_down
    with pytest.raises(RuntimeError, match="shut down"):
        reader.dequeue(timeout=1)


def test_writer_blocked_on_a_reader_that_left_names_its_rank(queues: MakeQueues) -> None:
    writer, (r1, r2) = queues([4, 7], [], max_chunk_bytes=256, max_chunks=2)
    _ready(writer, [r1, r2])
    threads = Reader(r1, lambda mq: [mq.dequeue(timeout=30) for _ in range(50)])
    r2.shutdown()  # closes its socket: the writer gets the unsubscription
    with pytest.raises(PeerGoneError, match=r"reader rank\(s\) \[7\]") as info:
        for i in range(50):
            writer.enqueue(i, timeout=30)
    assert info.value.ranks == [7] and isinstance(info.value, CommunicationError)
    writer.shutdown()  # the remaining reader sees the writer go
    with pytest.raises((PeerGoneError, TimeoutError)):
        threads.outcome()


def test_timeouts_name_the_readers_that_are_behind(queues: MakeQueues) -> None:
    writer, (reader,) = queues([5], [], max_chunk_bytes=256, max_chunks=2)
    _ready(writer, [reader])
    writer.enqueue(1)
    writer.enqueue(2)
    with pytest.raises(TimeoutError, match=r"local reader rank\(s\) \[5\]"):
        writer.enqueue(3, timeout=0.05)


def test_misuse_is_refused(queues: MakeQueues) -> None:
    writer, (reader,) = queues([1], [], max_message_bytes=1000)
    with pytest.raises(RuntimeError, match="Only the writer"):
        reader.enqueue(1)
    with pytest.raises(RuntimeError, match="Only readers"):
        writer.dequeue()
    with pytest.raises(ValueError, match="max_message_bytes"):
        writer.enqueue(np.zeros(2 << 20, dtype=np.uint8))
    with pytest.raises(ValueError, match="n_local_reader"):
        MessageQueue(1, 2)
    with pytest.raises(ValueError, match="distinct"):
        MessageQueue(2, 2, [1, 1])
    with pytest.raises(TypeError, match="seconds"):
        reader.dequeue(timeout="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="remote socket"):
        MessageQueue.create_from_handle(writer.export_handle(), 9)
    with pytest.raises(RuntimeError, match="only the writer"):
        reader.export_handle()


def test_writer_handshake_times_out_naming_missing_readers() -> None:
    writer = MessageQueue(2, 2, [3, 4])
    try:
        reader = MessageQueue.create_from_handle(writer.export_handle(), 3)
        with pytest.raises(TimeoutError, match=r"local ranks \[4\]"):
            writer.wait_until_ready(timeout=0.3)
        reader.shutdown()
    finally:
        writer.shutdown()
