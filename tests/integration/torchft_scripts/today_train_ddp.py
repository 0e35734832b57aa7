"""torchft's ``train_ddp.py`` of today (late 2025 on), written as its example
is written, with only ``torchft`` replaced by ``ftdist`` in the imports.

Differences from the original, for a test on a CPU machine without
downloads: synthetic CIFAR-shaped data instead of torchvision's CIFAR10, a
plain ``DataLoader`` instead of torchdata's ``StatefulDataLoader``, no
profiler, a step limit from the environment, and a last line with a hash of
the weights.
"""

import argparse
import hashlib
import logging
import os
from datetime import timedelta

REPLICA_GROUP_ID = int(os.environ.get("REPLICA_GROUP_ID", 0))
os.environ["CUDA_VISIBLE_DEVICES"] = str(REPLICA_GROUP_ID % 4)
os.environ["NCCL_HOSTID"] = str(REPLICA_GROUP_ID)

import torch
from torch import nn, optim
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, TensorDataset

from ftdist import (
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupXCCL,
)
from ftdist.checkpointing.pg_transport import PGTransport

logging.basicConfig(level=logging.INFO)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(3, 6, 5),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
        )
        final_dim = 10
        self.classifier = nn.Sequential(
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, final_dim),
        )

    def forward(self, x):
        x = self.cnn(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


@record
def main() -> None:
    parser = argparse.ArgumentParser(description="TorchFT DDP Training")
    parser.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 30)))
    args = parser.parse_args()

    REPLICA_GROUP_ID = int(os.environ.get("REPLICA_GROUP_ID", 0))
    NUM_REPLICA_GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", 2))

    g = torch.Generator().manual_seed(0)
    trainset = TensorDataset(
        torch.randn(512, 3, 32, 32, generator=g), torch.randint(0, 10, (512,), generator=g)
    )
    sampler = DistributedSampler(
        trainset,
        replica_rank=REPLICA_GROUP_ID,
        num_replica_groups=NUM_REPLICA_GROUPS,
        group_rank=0,
        num_replicas=1,
        shuffle=True,
    )
    trainloader = DataLoader(trainset, batch_size=16, num_workers=0, sampler=sampler)

    def load_state_dict(state_dict):
        m.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optim"])

    def state_dict():
        return {"model": m.state_dict(), "optim": optimizer.state_dict()}

    if torch.cuda.is_available():
        device = "cuda"
        pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    elif torch.xpu.is_available():
        device = "xpu"
        pg = ProcessGroupXCCL(timeout=timedelta(seconds=30))
    else:
        device = "cpu"
        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))

    transport = PGTransport(pg, timeout=timedelta(seconds=10), device=device)

    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_ddp_{REPLICA_GROUP_ID}",
        timeout=timedelta(seconds=30),
        checkpoint_transport=transport,
    )

    m = Net().to(device)
    m = DistributedDataParallel(manager, m)
    optimizer = Optimizer(manager, optim.AdamW(m.parameters()))
    criterion = nn.CrossEntropyLoss()

    while True:
        for i, (inputs, labels) in enumerate(trainloader):
            inputs = inputs.to(device)
            labels = labels.to(device)

            optimizer.zero_grad()
            out = m(inputs)
            loss = criterion(out, labels)
            loss.backward()
            optimizer.step()

            print(f"[{manager.current_step()}] loss = {loss.item()}", flush=True)
            if manager.current_step() >= args.steps:
                digest = hashlib.sha256()
                for t in m.state_dict().values():
                    digest.update(t.detach().cpu().numpy().tobytes())
                print(
                    f"replica group {REPLICA_GROUP_ID}: step {manager.current_step()} "
                    f"sha256 {digest.hexdigest()}",
                    flush=True,
                )
                manager.shutdown()
                exit()


if __name__ == "__main__":
    main()
