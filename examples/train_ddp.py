"""Fault-tolerant data-parallel training of one replica group, launched by torchrun.

Start one lighthouse for the whole job, then one torchrun per replica group:

    ftdist lighthouse --min-replicas 1
    FTDIST_LIGHTHOUSE=http://LIGHTHOUSE_HOST:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \\
        torchrun --standalone --nproc-per-node 2 --max-restarts 10 examples/train_ddp.py

and the same with REPLICA_GROUP_ID=1 for the second group (README.md shows a
group that spans several hosts).

Environment:
    REPLICA_GROUP_ID     this group's index, 0 .. NUM_REPLICA_GROUPS-1 (default 0)
    NUM_REPLICA_GROUPS   replica groups in the job; shards the data (default 1)
    FTDIST_LIGHTHOUSE    the lighthouse address (TORCHFT_LIGHTHOUSE works too)
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT   set by torchrun
    FTDIST_TIMEOUT_SEC, FTDIST_MANAGER_PORT, ... see ftdist.manager.config

Gradients are averaged in two stages: across replica groups by ftdist's DDP
(rank r of every live group; this set changes as groups fail and return),
then across the ranks of this group by a plain torch process group (a rank
that dies takes its whole group down; torchrun --max-restarts brings it back
and it heals from a peer). Each rank ends by printing the step and the SHA-256
of its weights and optimizer state, so replicas can be compared.
"""

import argparse
import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from ftdist.data import DistributedSampler
from ftdist.ddp import DistributedDataParallel
from ftdist.manager import Manager
from ftdist.optim import OptimizerWrapper
from ftdist.process_group import ProcessGroupGloo


def state_sha256(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, st in optim.state_dict()["state"].items():
        state.update({f"optim.{i}.{k}": v for k, v in st.items()})
    for name, t in sorted(state.items()):
        h.update(name.encode() + t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="committed steps to train")
    args = parser.parse_args()
    group_id = int(os.environ.get("REPLICA_GROUP_ID", 0))
    num_groups = int(os.environ.get("NUM_REPLICA_GROUPS", 1))

    # The group's own ranks talk over a plain torch group; ftdist's
    # reconfigurable group spans the replica groups. torchrun keeps its store
    # across restarts, so each attempt uses fresh keys: a restarted worker
    # must not read the addresses of the workers it replaces.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"train_ddp/{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    torch.manual_seed(0)  # the same start everywhere (init_sync would align it anyway)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # Synthetic regression data, identical on every rank; the sampler gives
    # each rank of each replica group its own shard.
    gen = torch.Generator().manual_seed(1234)
    x_all = torch.randn(4096, 16, generator=gen)
    y_all = x_all @ torch.randn(16, 1, generator=gen) + 0.1 * torch.randn(4096, 1, generator=gen)
    sampler = DistributedSampler(
        TensorDataset(x_all, y_all),
        replica_rank=group_id,
        num_replica_groups=num_groups,
        shuffle=True,
        seed=0,
        drop_last=True,
    )
    batch_size = 32
    per_epoch = len(sampler) // batch_size

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Indexed by the committed step, so a replica that heals to step s
        # reads step s's batch without saving a data-loader position.
        epoch, i = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        rows = list(sampler)[i * batch_size : (i + 1) * batch_size]
        return x_all[rows], y_all[rows]

    def load_state_dict(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])

    pg = ProcessGroupGloo()
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        min_replica_size=1,
        replica_id=f"train_ddp_{group_id}",
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, optim)

    while manager.current_step() < args.steps:
        x, y = batch(manager.current_step())
        optimizer.zero_grad()  # joins this step's quorum; heals in the background if behind
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # averaged over the live replica groups
        for grad in [p.grad for p in model.parameters() if p.grad is not None]:
            dist.all_reduce(grad)  # then over this group's ranks
            grad /= dist.get_world_size()
        optimizer.step()  # applied only if every rank of the group commits

    # Leave together: a group that exits while a peer still finishes its last
    # step looks like a failure to that peer. This quorum changes nothing but
    # forms only once every live group has asked for it, i.e. is done.
    manager.start_quorum(allow_heal=False, shrink_only=True)
    manager.wait_quorum()
    # One write per line, so that lines of ranks sharing a terminal never interleave.
    sys.stdout.write(
        f"replica group {group_id} rank {dist.get_rank()}: step "
        f"{manager.current_step()} sha256 {state_sha256(model, optim)}\n"
    )
    sys.stdout.flush()
    manager.shutdown()
    pg.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
