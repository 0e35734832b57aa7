"""LocalSGD and DiLoCo training in real processes, recorded for the reference.

Process ``i`` of a harness run is replica group ``i`` (one rank each). Each
process appends one JSON line per sync attempt to ``{out}/r{replica}.a{attempt}.jsonl``
(flushed, so that a process killed later leaves its history behind), with
what ``tests/local_sgd_reference.py`` needs to replay the run. Kills are
SIGKILLs of the process itself at a chosen point of a chosen sync.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftdist.launch.ranks import RankContext
from tests.integration.lighthouse_helpers import wait_for_quorum_request, wait_for_status
from tests.local_sgd_reference import Blocks, Config, batch, loss_of, make_inner, make_outer

UP, REJOINED, DONE = "up", "rejoined", "done"


def _wait_for(store: Any, key: str, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while int(store.add(key, 0)) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def _wait_heartbeat(lighthouse: str, replica_id: str, timeout: float = 30.0) -> None:
    def heard(status: dict[str, Any]) -> bool:
        beats = status.get("heartbeats", [])
        return any(b["replica_id"] == replica_id and b["healthy"] for b in beats)

    if not wait_for_status(lighthouse, heard, timeout):
        raise TimeoutError(f"the lighthouse never saw a heartbeat of {replica_id}")


def _tensors(t: Any) -> Any:
    """Nested state with tensors as lists (tensors do not cross the result pipe)."""
    if isinstance(t, torch.Tensor):
        return {"dtype": str(t.dtype), "shape": list(t.shape), "values": t.tolist()}
    if isinstance(t, dict):
        return {str(k): _tensors(v) for k, v in t.items()}
    if isinstance(t, (list, tuple)):
        return [_tensors(v) for v in t]
    return t


def train(
    ctx: RankContext,
    lighthouse: str,
    out: str,
    cfg_fields: dict[str, Any],
    steps: int,
    actions_by_replica: dict[str, dict[str, Any]],
    attempt: int = 0,
) -> dict[str, Any]:
    """Train until the Manager reaches ``steps``; return the end state.

    ``actions_by_replica[str(replica)]``: ``die``: ``[when, step]`` with ``when`` one of ``before``
    (between syncs of that step), ``during`` (the sync's average started,
    not awaited) or ``after`` (the sync committed); ``hold``: ``{step:
    count}`` waits at that step until ``count`` restarts are up and one of
    them waits for a quorum;
    ``quantize``/``bucketize``: DiLoCo options.
    """
    from ftdist.local_sgd import DiLoCo, LocalSGD
    from ftdist.manager import Manager
    from ftdist.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    cfg = Config(**cfg_fields)
    replica = ctx.rank
    actions = actions_by_replica.get(str(replica), {})
    if os.environ.get("FTDIST_LOG"):
        import logging

        logging.basicConfig(
            level=logging.DEBUG,
            filename=os.path.join(out, f"r{replica}.a{attempt}.log"),
            format="%(asctime)s %(name)s: %(message)s",
        )
    harness = ctx.store()
    own_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = Blocks(cfg.n_fragments)
    inner = make_inner(model, cfg.inner)
    outers = [make_outer(b) for b in model.blocks]
    timeout = timedelta(seconds=10)
    pg = ProcessGroupGloo(timeout=timeout)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        min_replica_size=1,
        use_async_quorum=False,
        init_sync=False,  # identical initial weights: nothing to heal at step 0
        replica_id=f"replica{replica}",
        lighthouse_addr=lighthouse,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=own_store.port,
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=10),
    )
    log = open(os.path.join(out, f"r{replica}.a{attempt}.jsonl"), "a", buffering=1)
    die = actions.get("die")
    holds = {int(k): v for k, v in actions.get("hold", {}).items()}

    def kill_if(when: str, step: int) -> None:
        if die is not None and die[0] == when and die[1] == step:
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def receives() -> int:
        return sum(t.role == "receive" for t in manager.heal_timelines)

    # Peers start once the lighthouse counts every group as alive: a first
    # quorum then waits for the others instead of forming without them (a
    # second history of the same steps). A survivor leaves a hold only once
    # the restart's quorum request waits (see wait_for_quorum_request).
    _wait_heartbeat(lighthouse, manager.replica_id())
    if attempt == 0:
        harness.add(UP, 1)
        _wait_for(harness, UP, ctx.world_size)
    else:
        harness.add(REJOINED, 1)
    try:
        if cfg.algorithm == "diloco":
            algo: Any = DiLoCo(
                manager,
                list(model.blocks),
                inner,
                outers,
                sync_every=cfg.sync_every,
                fragment_sync_delay=cfg.delay,
                fragment_update_alpha=cfg.alpha,
                should_quantize=actions.get("quantize", False),
                use_bucketization=actions.get("bucketize", False),
            )
        else:
            algo = LocalSGD(manager, model, inner, sync_every=cfg.sync_every)
        pending: dict[str, Any] = {}
        start_quorum = algo._start_quorum

        def record(committed: bool) -> None:
            log.write(json.dumps({**pending, "committed": committed}) + "\n")

        def on_start_quorum() -> None:
            before, heals = manager.current_step(), receives()
            start_quorum()
            pending.clear()
            pending.update(
                step_before=before,
                step=manager.current_step(),
                healed=receives() > heals,
                zeroed=manager.errored() is not None,
                quorum_id=manager.quorum_id(),
                participants=manager.num_participants(),
                fragment=0,
                round_step=manager.current_step(),
            )

        algo._start_quorum = on_start_quorum
        if cfg.algorithm == "diloco":
            prepare, perform = algo._prepare, algo._perform

            def on_prepare() -> None:
                prepare()
                pending.update(round_step=algo._sync_step(), fragment=algo._prepared)
                kill_if("during", pending["round_step"])

            def on_perform() -> None:
                step = manager.current_step()
                perform()
                record(manager.current_step() == step + 1)
                kill_if("after", step)

            algo._prepare, algo._perform = on_prepare, on_perform
        else:
            perform_sync = algo._perform_sync

            def on_perform_sync() -> None:
                step = manager.current_step()
                perform_sync()
                record(manager.current_step() == step + 1)

            algo._perform_sync = on_perform_sync
        with algo:
            while manager.current_step() < steps:
                index = algo._local_step
                step = manager.current_step()
                if index == 0 and step in holds:
                    _wait_for(harness, REJOINED, holds.pop(step))
                    if not wait_for_quorum_request(lighthouse, manager.replica_id()):
                        raise TimeoutError(f"held at step {step}: no restart asked for a quorum")
                if index == 1:
                    kill_if("before", step)
                x, y = batch(replica, step, index)
                inner.zero_grad()
                loss_of(model, x, y).backward()
                inner.step()
        # Leave together: a replica that exits while a peer still finishes
        # its last sync would look like a failure to that peer.
        harness.add(DONE, 1)
        _wait_for(harness, DONE, ctx.world_size)
        log.write(json.dumps({"final": True}) + "\n")
        state: dict[str, Any] = {
            "replica": replica,
            "attempt": attempt,
            "step": manager.current_step(),
            "model": _tensors(model.state_dict()),
        }
        if cfg.algorithm == "diloco":
            state["global"] = [
                _tensors(
                    {"backup": f.original_parameters, "outer": f._outer_optimizer.state_dict()}
                )
                for f in algo._fragments
            ]
            state["consistency_keys"] = manager.consistency_keys()
        return state
    finally:
        log.close()
        manager.shutdown()
        pg.shutdown()
        del own_store


def read_lineages(out: str, cfg: Config) -> list[Any]:
    """The recorded histories of every process, as reference lineages."""
    from tests.local_sgd_reference import Lineage, Record

    lineages = []
    for name in sorted(n for n in os.listdir(out) if n.endswith(".jsonl")):
        replica, attempt = (int(part[1:]) for part in name.split(".")[:2])
        lines = [json.loads(line) for line in open(os.path.join(out, name)) if line.strip()]
        records = [Record(**line) for line in lines if "final" not in line]
        finished = any("final" in line for line in lines)
        lineages.append(Lineage(replica, attempt, records, finished, cfg))
    return lineages


def as_tensors(t: Any) -> Any:
    """Undo :func:`_tensors`."""
    if isinstance(t, dict) and set(t) == {"dtype", "shape", "values"}:
        dtype = getattr(torch, t["dtype"].split(".")[-1])
        return torch.tensor(t["values"], dtype=dtype).reshape(t["shape"])
    if isinstance(t, dict):
        return {k: as_tensors(v) for k, v in t.items()}
    if isinstance(t, list):
        return [as_tensors(v) for v in t]
    return t


__all__ = ["as_tensors", "asdict", "read_lineages", "train"]
