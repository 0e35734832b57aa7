"""Fault-tolerant launching over real processes: replica groups under Managers, restarted
from the warm fork server; and `ftdist run`, the command-line form."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from ftdist.errors import ProcessFailedError
from ftdist.launch import MultiprocessConfig, launch_subprocesses
from ftdist.launch.config import FaultTolerance
from tests import _diagnostics
from tests.integration.test_launch import _wait_gone

REPO = Path(__file__).resolve().parents[2]
STEPS = 12
KILL_AT = 4


def training_body(out: str) -> None:
    """Train to STEPS committed steps; replica group 1's last rank SIGKILLs itself once."""
    import torch
    import torch.distributed as dist

    from ftdist.ddp import DistributedDataParallel
    from ftdist.launch import get_manager, get_parallel_groups, get_replica_info
    from ftdist.optim import OptimizerWrapper

    manager, info, groups = get_manager(), get_replica_info(), get_parallel_groups()
    assert info is not None
    rank, size = dist.get_rank(), dist.get_world_size()  # within the replica group
    torch.manual_seed(info.replica_group * 100 + info.attempt)  # different starts: heals align them
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    manager.register_state_dict_fn("optim", optim.load_state_dict, optim.state_dict)
    ddp, optimizer = DistributedDataParallel(manager, model), OptimizerWrapper(manager, optim)
    name = f"group{info.replica_group}.rank{rank}.attempt{info.attempt}.jsonl"
    log = Path(out, name).open("a")
    log.write(json.dumps({"mp": groups.mp.ranks, "dp": groups.dp.ranks, "size": size}) + "\n")
    while manager.current_step() < STEPS:
        step = manager.current_step()
        if (info.replica_group, info.attempt, rank) == (1, 0, size - 1) and step >= KILL_AT:
            # (>=: a group that starts late heals straight past KILL_AT)
            log.write(json.dumps({"killed_in": step}) + "\n")
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + rank))
        optimizer.zero_grad()
        ddp(x).pow(2).mean().backward()
        optimizer.step()
        log.write(json.dumps({"step": step, "after": manager.current_step()}) + "\n")
        log.flush()
        time.sleep(0.02)
    weights = [p.detach().tolist() for p in model.parameters()]
    log.write(json.dumps({"final": manager.current_step(), "weights": weights}) + "\n")
    log.close()


def unlucky_body(out: str) -> None:
    """Replica group 1 always fails; group 0 waits to be stopped."""
    from ftdist.launch import get_replica_info

    info = get_replica_info()
    assert info is not None
    Path(out, f"group{info.replica_group}.attempt{info.attempt}").write_text(str(os.getpid()))
    if info.replica_group == 1:
        raise RuntimeError(f"no luck on attempt {info.attempt}")
    time.sleep(120)


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_training(out: Path, size: int) -> None:
    names = sorted(p.name for p in out.glob("*.jsonl"))
    assert names == sorted(
        f"group{g}.rank{r}.attempt{a}.jsonl"
        for g, attempts in ((0, (0,)), (1, (0, 1)))
        for a in attempts
        for r in range(size)
    )
    killed = _lines(out / f"group1.rank{size - 1}.attempt0.jsonl")
    killed_in = int(killed[-1]["killed_in"])  # type: ignore[call-overload]
    assert killed_in >= KILL_AT
    finals: dict[int, list[dict[str, object]]] = {}  # by rank in the replica group
    for name in names:
        lines = _lines(out / name)
        assert lines[0] == {"mp": list(range(size)), "dp": [int(name[11])], "size": size}
        if ".attempt0" in name and name.startswith("group1"):
            continue  # killed (its last rank) or stopped by the launcher (the others)
        if name.startswith("group1"):
            # The replacement started from fresh weights at step 0 and healed:
            # its first step ends at (or past) the step its group died in.
            assert lines[1]["step"] == 0 and int(lines[1]["after"]) >= killed_in  # type: ignore[call-overload]
        finals.setdefault(int(name.split(".rank")[1][0]), []).append(lines[-1])
    # Each rank matches the same rank of the other replica group (ranks of one
    # group hold different model-parallel shards; here: different batches).
    assert sorted(finals) == list(range(size))
    for same_rank in finals.values():
        assert len(same_rank) == 2
        assert all(f["final"] == STEPS for f in same_rank)
        assert same_rank[0]["weights"] == same_rank[1]["weights"]


@pytest.mark.timeout(180)
def test_a_killed_replica_group_restarts_heals_and_ends_identical(tmp_path: Path) -> None:
    # min_replica_size=2: every step needs both groups, so the survivor waits for the
    # replacement instead of finishing alone first.
    ft = FaultTolerance(max_restarts=2, min_replica_size=2, timeout=timedelta(seconds=10))
    cfg = MultiprocessConfig(world_size=2, backend="gloo")
    launch_subprocesses(training_body, cfg, None, 0, str(tmp_path), fault_tolerant=ft)
    _check_training(tmp_path, size=1)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_replica_group_of_two_model_parallel_ranks_restarts_whole(tmp_path: Path) -> None:
    # min_replica_size=2: every step needs both groups, so the survivor waits for the
    # replacement instead of finishing alone first.
    ft = FaultTolerance(max_restarts=2, min_replica_size=2, timeout=timedelta(seconds=10))
    cfg = MultiprocessConfig(world_size=4, model_parallelism=2, backend="gloo")
    launch_subprocesses(training_body, cfg, None, 0, str(tmp_path), fault_tolerant=ft)
    _check_training(tmp_path, size=2)


@pytest.mark.timeout(120)
def test_a_replica_group_that_keeps_failing_ends_the_launch(tmp_path: Path) -> None:
    ft = FaultTolerance(max_restarts=1, connect_timeout=timedelta(seconds=10))
    cfg = MultiprocessConfig(world_size=2, backend="gloo")
    with pytest.raises(ProcessFailedError) as info:
        launch_subprocesses(unlucky_body, cfg, None, 0, str(tmp_path), fault_tolerant=ft)
    err = info.value
    assert err.replica_group == 1 and err.rank == 1
    assert err.child_traceback is not None and "no luck on attempt 1" in err.child_traceback
    assert "used all 1 restarts" in str(err)
    started = sorted(p.name for p in tmp_path.iterdir())
    assert started == ["group0.attempt0", "group1.attempt0", "group1.attempt1"]
    survivor = int((tmp_path / "group0.attempt0").read_text())
    assert _wait_gone([survivor], timeout=5) == []  # stopped with the launch


SCRIPT = """
    import json, os, sys
    import torch
    import torch.distributed as dist

    out = sys.argv[1]
    dist.init_process_group("gloo")  # env://: the store is the launcher's
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "REPLICA_GROUP_ID",
             "NUM_REPLICA_GROUPS", "TORCHELASTIC_RESTART_COUNT", "FTDIST_LIGHTHOUSE")
    record = {n: os.environ.get(n) for n in names}
    record.update(sum=total.item(), name=__name__, argv=sys.argv[2:])
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    group = os.environ["REPLICA_GROUP_ID"]
    with open(os.path.join(out, f"{group}.{os.environ['RANK']}.{attempt}.json"), "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
    if os.environ["RANK"] == "1" and attempt == "0":
        sys.exit(3)
    if sys.argv[2:] == ["--fail-group", group]:
        raise ValueError("still failing")
"""


def _ftdist_run(
    tmp_path: Path, argv: list[str], script_argv: list[str]
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "out").mkdir()
    env = dict(os.environ, PYTHONPATH=_diagnostics.pythonpath(REPO / "src"))
    for name in ("FTDIST_LIGHTHOUSE", "TORCHFT_LIGHTHOUSE"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "ftdist", "run", *argv, str(script), str(tmp_path / "out")]
    # On a timeout: every process's stack and the output so far, then the kill.
    return _diagnostics.run(cmd + script_argv, timeout=150, env=env)


@pytest.mark.timeout(180)
def test_ftdist_run_restarts_a_failed_group_with_a_fresh_store(tmp_path: Path) -> None:
    done = _ftdist_run(tmp_path, ["--nproc-per-node", "2", "--max-restarts", "1"], ["--flag"])
    assert done.returncode == 0, done.stderr
    records = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")}
    assert sorted(records) == ["0.0.0", "0.0.1", "0.1.0", "0.1.1"]
    for key, rec in records.items():
        _, rank, attempt = key.split(".")
        assert rec["RANK"] == rank and rec["WORLD_SIZE"] == "2" and rec["LOCAL_RANK"] == rank
        assert rec["TORCHELASTIC_RESTART_COUNT"] == attempt
        assert (rec["REPLICA_GROUP_ID"], rec["NUM_REPLICA_GROUPS"]) == ("0", "1")
        assert str(rec["FTDIST_LIGHTHOUSE"]).startswith("http://127.0.0.1:")  # embedded
        assert rec["sum"] == 3.0 and rec["name"] == "__main__" and rec["argv"] == ["--flag"]
    # One store per attempt, bound by the launcher on a free port.
    assert records["0.0.0"]["MASTER_PORT"] == records["0.1.0"]["MASTER_PORT"]
    assert records["0.0.0"]["MASTER_PORT"] != records["0.0.1"]["MASTER_PORT"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ftdist_run_reports_a_group_out_of_restarts(tmp_path: Path) -> None:
    argv = ["--nproc-per-node", "2", "--replica-groups", "2", "--max-restarts", "1"]
    failed = _ftdist_run(tmp_path, argv, ["--fail-group", "1"])
    assert failed.returncode == 1
    assert "ValueError: still failing" in failed.stderr
    assert "replica group 1 has used all 1 restarts" in failed.stderr
    records = sorted(p.stem for p in (tmp_path / "out").glob("*.json"))
    assert records == ["0.0.0", "1.0.0", "1.0.1"]  # group 0 ran once, group 1 twice
