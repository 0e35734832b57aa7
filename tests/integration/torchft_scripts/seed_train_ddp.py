"""torchft's seed-era (early 2025) ``train_ddp.py``, written as its example is
written, with only ``torchft`` replaced by ``ftdist`` in the imports.

Differences from the original, for a test on a CPU machine without
downloads: synthetic CIFAR-shaped data instead of torchvision's CIFAR10, a
plain ``DataLoader`` instead of torchdata's ``StatefulDataLoader``, a step
limit from the environment, and a last line with a hash of the weights.
"""

import hashlib
import logging
import os
from datetime import timedelta

import torch
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset

from ftdist import (
    DistributedDataParallel,
    DistributedSampler,
    Manager,
    Optimizer,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
)

logging.basicConfig(level=logging.INFO)

REPLICA_GROUP_ID = int(os.environ.get("REPLICA_GROUP_ID", 0))
NUM_REPLICA_GROUPS = int(os.environ.get("NUM_REPLICA_GROUPS", 2))
STEPS = int(os.environ.get("STEPS", 30))

g = torch.Generator().manual_seed(0)
trainset = TensorDataset(
    torch.randn(512, 3, 32, 32, generator=g), torch.randint(0, 10, (512,), generator=g)
)
sampler = DistributedSampler(
    trainset,
    replica_group=REPLICA_GROUP_ID,
    num_replica_groups=NUM_REPLICA_GROUPS,
    rank=0,
    num_replicas=1,
    shuffle=True,
)
trainloader = DataLoader(trainset, batch_size=16, num_workers=0, sampler=sampler)


def load_state_dict(state_dict):
    m.load_state_dict(state_dict["model"])
    optimizer.load_state_dict(state_dict["optim"])


def state_dict():
    return {"model": m.state_dict(), "optim": optimizer.state_dict()}


device = "cuda" if torch.cuda.is_available() else "cpu"
pg = (
    ProcessGroupBabyNCCL(timeout=timedelta(seconds=5))
    if torch.cuda.is_available()
    else ProcessGroupGloo(timeout=timedelta(seconds=5))
)

manager = Manager(
    pg=pg,
    min_replica_size=1,
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    replica_id=f"train_ddp_{REPLICA_GROUP_ID}",
    timeout=timedelta(seconds=10),
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


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
        if manager.current_step() >= STEPS:
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
