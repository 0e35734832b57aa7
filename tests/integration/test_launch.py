"""ftdist.launch over real processes and Gloo, written as a user writes a training script:
a module-level function, a MultiprocessConfig, launch_subprocesses."""

from __future__ import annotations

import errno
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from ftdist._forkserver import forkserver_context
from ftdist.errors import ProcessFailedError
from ftdist.launch import MultiprocessConfig, launch_subprocesses
from ftdist.launch.layout import parallel_layout
from tests import _diagnostics

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


# -- the functions the launched processes run (module level: they are pickled by name) -------------
def groups_body(out: str) -> None:
    import torch
    import torch.distributed as dist

    from ftdist.launch import all_to_all, get_parallel_groups

    groups, rank = get_parallel_groups(), dist.get_rank()
    mp, pp, dp = groups  # the three coordinators
    record: dict[str, object] = {
        "rank": rank,
        "world": dist.get_world_size(),
        "env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")},
    }
    for kind, g in (("mp", mp), ("pp", pp), ("dp", dp)):
        # A real collective on each group: the sum of its members' ranks.
        total = g.all_reduce(torch.tensor([float(rank)])) if g.world_size > 1 else rank
        record[kind] = {
            "backend": g.backend,
            "ranks": g.ranks,
            "rank_in_group": g.rank_in_group,
            "sum": float(total[0]) if isinstance(total, torch.Tensor) else float(total),
        }
    x = (torch.arange(8.0) + 100 * rank).requires_grad_()
    y = all_to_all(x, None)
    (y * (torch.arange(8.0) * (rank + 1))).sum().backward()
    assert x.grad is not None
    record["a2a"], record["grad"] = y.tolist(), x.grad.tolist()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def failing_body(out: str) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    Path(out, f"pid{rank}").write_text(str(os.getpid()))
    if rank == 2:
        while len(list(Path(out).glob("pid*"))) < 4:
            time.sleep(0.01)
        raise ValueError("boom from rank 2")
    time.sleep(120)


def sleeping_body(out: str) -> None:
    Path(out, f"pid{os.getpid()}").write_text(f"{os.getpid()} {os.getppid()}")
    time.sleep(120)


def in_process_body(out: str) -> None:
    import torch.distributed as dist

    from ftdist.launch import get_parallel_groups

    groups = get_parallel_groups()
    sizes = [groups.mp.world_size, groups.pp.world_size, groups.dp.world_size]
    record = {"pid": os.getpid(), "world": dist.get_world_size(), "sizes": sizes}
    Path(out, "in_process.json").write_text(json.dumps(record))


def mark_setup(path: str) -> None:
    Path(path).write_text(str(os.getpid()))


# -- layouts, collectives, all_to_all, ports ---------------------------------------------------------
@pytest.mark.parametrize("mp,pp", [(2, 1), (2, 2)])
def test_groups_are_laid_out_and_work(tmp_path: Path, mp: int, pp: int) -> None:
    cfg = MultiprocessConfig(world_size=4, model_parallelism=mp, pipeline_parallelism=pp)
    cfg.backend = "gloo"
    cfg.pipeline_parallel_backend = "cpu:gloo"  # a backend per kind, else `backend`
    launch_subprocesses(groups_body, cfg, None, 0, str(tmp_path))
    layout = parallel_layout(4, mp, pp)
    assert cfg.master_port > 0  # the port the launcher's store bound, not 0
    for rank in range(4):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        places = layout.places(rank)
        assert rec["world"] == 4
        assert rec["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": "0",  # rank % local_world_size, which is 1 without CUDA
            "WORLD_SIZE": "4",
            "MASTER_PORT": str(cfg.master_port),
        }
        for kind in ("mp", "pp", "dp"):
            place = getattr(places, kind)
            assert rec[kind]["ranks"] == list(place.ranks), (rank, kind)
            assert rec[kind]["backend"] == ("cpu:gloo" if kind == "pp" else "gloo")
            assert rec[kind]["rank_in_group"] == place.rank, (rank, kind)
            assert rec[kind]["sum"] == sum(place.ranks), (rank, kind)
        # all_to_all: chunk j of the result is rank j's chunk `rank`; the
        # gradient is the all-to-all of the upstream gradients.
        assert rec["a2a"] == [100 * j + 2 * rank + i for j in range(4) for i in range(2)]
        assert rec["grad"] == [(2 * rank + i) * (s + 1) for s in range(4) for i in range(2)]


def test_a_configured_port_in_use_is_refused_before_any_child_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = MultiprocessConfig(world_size=2, backend="gloo", master_port=port)
        with pytest.raises(OSError) as info:
            launch_subprocesses(sleeping_body, cfg, None, 0, str(tmp_path))
    assert info.value.errno == errno.EADDRINUSE and str(port) in str(info.value)
    assert not list(tmp_path.glob("pid*"))


def test_world_size_one_runs_in_this_process(tmp_path: Path) -> None:
    import torch.distributed as dist

    rank_before = os.environ.get("RANK")
    setup = functools.partial(mark_setup, str(tmp_path / "setup"))
    launch_subprocesses(
        in_process_body, MultiprocessConfig(world_size=1, backend="gloo"), setup, 0, str(tmp_path)
    )
    rec = json.loads((tmp_path / "in_process.json").read_text())
    assert rec == {"pid": os.getpid(), "world": 1, "sizes": [1, 1, 1]}
    assert (tmp_path / "setup").read_text() == str(os.getpid())
    # Torn down and the environment restored: the caller can launch again.
    assert not dist.is_initialized() and os.environ.get("RANK") == rank_before


# -- failures -------------------------------------------------------------------------------------------
def test_a_child_exception_reaches_the_caller_and_stops_the_others(tmp_path: Path) -> None:
    cfg = MultiprocessConfig(world_size=4, backend="gloo")
    with pytest.raises(ProcessFailedError) as info:
        launch_subprocesses(failing_body, cfg, None, 0, str(tmp_path))
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.rank == 2 and err.exitcode == 1 and err.replica_group == 0
    assert err.child_traceback is not None
    assert "ValueError: boom from rank 2" in err.child_traceback
    assert "in failing_body" in err.child_traceback
    assert "rank 2 raised" in str(err) and "boom from rank 2" in str(err)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(4)]
    assert _wait_gone(pids, timeout=5) == []  # the sleeping ranks were stopped


def test_unpicklable_function_is_refused_at_once() -> None:
    with pytest.raises(TypeError, match="picklable"):
        launch_subprocesses(lambda: None, MultiprocessConfig(world_size=2, backend="gloo"))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_children_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from ftdist.launch import MultiprocessConfig, launch_subprocesses\n"
        "from tests.integration.test_launch import sleeping_body\n"
        "if __name__ == '__main__':\n"
        "    cfg = MultiprocessConfig(world_size=2, backend='gloo')\n"
        "    launch_subprocesses(sleeping_body, cfg, None, 0, sys.argv[1])\n"
    )
    env = dict(os.environ, PYTHONPATH=_diagnostics.pythonpath(REPO / "src", REPO))
    launcher = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 90
        while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
            assert launcher.poll() is None, "the launcher exited early"
            time.sleep(0.05)
        records = [p.read_text().split() for p in tmp_path.glob("pid*")]
        assert len(records) == 2, "the children did not start"
        children = [int(pid) for pid, _ in records]
        fork_server = {int(ppid) for _, ppid in records}
        assert all(_alive(p) for p in children)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        assert _wait_gone(children + sorted(fork_server)) == []
    finally:
        _diagnostics.before_kill()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=10)
        for record in tmp_path.glob("pid*"):
            pid = int(record.read_text().split()[0])
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _watchdog_interval_set_after_the_fork(conn: Any) -> None:
    preloaded = "ftdist.futures" in sys.modules
    os.environ["FTDIST_WATCHDOG_TIMEOUT_SEC"] = "7"
    from ftdist.futures import _TIMEOUT_MANAGER, context_timeout

    with context_timeout(lambda: None, timedelta(seconds=5)):  # starts the timer thread
        pass
    interval = _TIMEOUT_MANAGER._watchdog_interval
    conn.send((preloaded, None if interval is None else interval.total_seconds()))
    _TIMEOUT_MANAGER.shutdown()


def test_a_child_of_the_fork_server_sets_its_environment_after_the_preloaded_imports() -> None:
    # The fork server imports the Manager's modules once for every child; a
    # setting those modules hold must still come from the child's environment.
    ctx = forkserver_context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_watchdog_interval_set_after_the_fork, args=(child,))
    proc.start()
    try:
        assert parent.poll(60), f"the child sent nothing (exit code {proc.exitcode})"
        preloaded, seconds = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    assert preloaded, "the fork server no longer imports ftdist.futures (with the Manager)"
    assert seconds == 7.0
