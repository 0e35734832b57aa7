"""
The demo's learning task
========================

Classify points of K interleaved spirals: a classic task that a linear model
cannot solve, so the loss falls only as the MLP learns the curved
boundaries, visibly, over a few hundred steps. The data is generated from the
seed (nothing to download) and is the same in every replica process; a held
out set measures the final model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import TensorDataset

CLASSES = 5
TURNS = 1.25
NOISE = 0.04
HIDDEN = 128


def make_spirals(n: int, seed: int) -> TensorDataset:
    """``n`` labelled points of ``CLASSES`` spirals, reproducible from ``seed``.

    Args:
        n: number of points (spread evenly over the classes).
        seed: generator seed; the same seed gives the same bytes everywhere.

    Returns:
        A dataset of ``(x: float32[2], y: int64)`` pairs.

    Raises:
        ValueError: ``n`` is smaller than the number of classes.
    """
    if n < CLASSES:
        raise ValueError(f"n ({n}) must be at least {CLASSES}, one point per class")
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % CLASSES
    radius = torch.rand(n, generator=g)
    angle = (
        radius * TURNS * 2 * math.pi
        + labels * (2 * math.pi / CLASSES)
        + torch.randn(n, generator=g) * NOISE
    )
    x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    x = x + torch.randn(n, 2, generator=g) * NOISE
    return TensorDataset(x.float(), labels)


def make_model(seed: int) -> nn.Module:
    """The MLP every replica trains; ``seed`` picks its random initial weights."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(2, HIDDEN),
        nn.SiLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.SiLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.SiLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset) -> tuple[float, float]:
    """Cross-entropy loss and accuracy of ``model`` on ``data``."""
    x, y = data.tensors
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y).item()
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return loss, accuracy


def state_hash(model: nn.Module, optim: torch.optim.Optimizer) -> str:
    """SHA-256 over every byte of the weights and the optimizer state.

    Two replicas with the same hash hold bit-identical training state.
    """
    return weights_hash(model.state_dict(), optim)


def weights_hash(weights: Mapping[str, torch.Tensor], optim: torch.optim.Optimizer) -> str:
    """SHA-256 over named tensors (DiLoCo's global weights, say) and an optimizer's state."""
    h = hashlib.sha256()
    for name, t in weights.items():
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for key, st in sorted(optim.state_dict()["state"].items()):
        h.update(str(key).encode())
        for name, v in sorted(st.items()):
            h.update(name.encode())
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()
