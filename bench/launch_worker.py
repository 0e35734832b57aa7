"""One process of bench/launch.py's job: a replica group of one rank, training under a Manager.

The same script runs under ``torchrun`` with torchft (``LAUNCH_BENCH_LIB=torchft``)
and under ``ftdist run`` with ftdist (``LAUNCH_BENCH_LIB=ftdist``); the
launcher's environment gives it its replica group (``REPLICA_GROUP_ID``), the
lighthouse and the group's store. It appends JSON events to
``$LAUNCH_BENCH_OUT/events.<pid>.jsonl``: ``start`` (the script's first line
ran), ``ready`` (its Manager is up) and ``commit`` after each committed step,
and trains until the file ``$LAUNCH_BENCH_OUT/stop`` exists.
"""

import time

T_START = time.time()

import json  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

STEP_SLEEP_S = 0.02


class Events:
    """Append-only JSON lines, one flushed write per event."""

    def __init__(self, out: str) -> None:
        self._file = open(os.path.join(out, f"events.{os.getpid()}.jsonl"), "a", buffering=1)
        self.group = int(os.environ.get("REPLICA_GROUP_ID", 0))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    def emit(self, kind: str, **fields: Any) -> None:
        """Write one event with the group, attempt, pid and time."""
        record = {"kind": kind, "group": self.group, "attempt": self.attempt}
        record.update(pid=os.getpid(), t=time.time(), **fields)
        self._file.write(json.dumps(record) + "\n")


def train(manager: Any, ddp_cls: Any, optim_cls: Any, events: Events, out: str) -> None:
    """Train a small MLP until the stop file appears, logging each committed step."""
    torch.manual_seed(events.group * 100 + events.attempt)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
    ddp = ddp_cls(manager, model)
    optimizer = optim_cls(manager, optim)
    stop = os.path.join(out, "stop")
    while not os.path.exists(stop):
        step = manager.current_step()
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        if manager.current_step() > step:
            events.emit("commit", step=manager.current_step())
        time.sleep(STEP_SLEEP_S)


def main() -> None:
    """Build this library's Manager and train (the script's entry point)."""
    out = os.environ["LAUNCH_BENCH_OUT"]
    events = Events(out)
    events.emit("start", t_start=T_START)
    if os.environ.get("LAUNCH_BENCH_LIB") == "torchft":
        from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
        from torchft import Optimizer as OptimizerWrapper
    else:
        from ftdist.ddp import DistributedDataParallel
        from ftdist.manager import Manager
        from ftdist.optim import OptimizerWrapper
        from ftdist.process_group import ProcessGroupGloo
    from datetime import timedelta

    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        replica_id=f"launch_bench_{events.group}",
        timeout=timedelta(seconds=10),
    )
    events.emit("ready")
    try:
        train(manager, DistributedDataParallel, OptimizerWrapper, events, out)
    finally:
        manager.shutdown(wait=False)


def launched(out: str) -> None:
    """The same job as a function for ``launch_subprocesses(..., fault_tolerant=...)``."""
    from ftdist.ddp import DistributedDataParallel
    from ftdist.launch import get_manager, get_replica_info
    from ftdist.optim import OptimizerWrapper

    events = Events(out)
    info = get_replica_info()
    assert info is not None
    events.group, events.attempt = info.replica_group, info.attempt
    events.emit("start", t_start=time.time())
    manager = get_manager()
    events.emit("ready")
    train(manager, DistributedDataParallel, OptimizerWrapper, events, out)


if __name__ == "__main__":
    main()
