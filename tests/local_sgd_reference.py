"""A single-process reference for DiLoCo and LocalSGD: every replica group's
training and syncs, simulated with plain tensor arithmetic.

It is written from the algorithms' definitions, not from ``ftdist.local_sgd``:
no hook, no fragment class, no Manager. Given the membership history of a
real run (which replica group took part in which sync, which healed, which
committed), it computes what every replica's global state (global weights
and outer optimizer state) and local weights must be, bit for bit.

Bit-identity holds for up to two replica groups: the Manager averages as a
Gloo SUM then a division, and a sum of two fp32 values does not depend on
the order (a sum of three would depend on Gloo's ring order).

The real runs (``tests/integration/local_sgd_training.py``) and this
reference share the task below: the model, the data of each inner step, the
loss and the optimizers.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

IN, HIDDEN = 6, 12


class Blocks(nn.Module):
    """A small MLP of ``n`` blocks; each block is one DiLoCo fragment."""

    def __init__(self, n: int) -> None:
        super().__init__()
        torch.manual_seed(1234)  # every replica and every restart starts identical
        dims = [IN] + [HIDDEN] * (n - 1) + [1]
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dims[i], dims[i + 1]), nn.Tanh()) for i in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def batch(replica: int, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of inner step ``index`` of a sync period at Manager step ``step``."""
    g = torch.Generator().manual_seed(replica * 1_000_003 + step * 1009 + index)
    x = torch.randn(8, IN, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def make_inner(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05)  # stateless: heals move no inner state


def make_outer(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True)
class Config:
    algorithm: str = "diloco"  # or "localsgd"
    n_fragments: int = 2
    sync_every: int = 4
    delay: int = 1
    alpha: float = 0.5
    inner: str = "sgd"


@dataclass
class Record:
    """One sync attempt of one process of a replica group (a lineage)."""

    step_before: int  # the Manager's step before the quorum
    step: int  # ... after it (a heal jumps it)
    round_step: int  # the quorum's step, which picks the fragment
    healed: bool
    zeroed: bool  # the step had already failed: the Manager sends zeros
    quorum_id: int
    participants: int
    fragment: int
    committed: bool


@dataclass
class Lineage:
    """One process of one replica group, as the reference simulates it."""

    replica: int
    attempt: int
    records: list[Record]
    finished: bool
    cfg: Config
    model: Blocks = field(init=False)
    inner: torch.optim.Optimizer = field(init=False)
    outers: list[torch.optim.Optimizer] = field(init=False)
    backups: list[dict[str, torch.Tensor]] = field(init=False)
    step: int = 0
    pseudo: dict[str, torch.Tensor] = field(default_factory=dict)
    local: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.model = Blocks(self.cfg.n_fragments)
        self.inner = make_inner(self.model, self.cfg.inner)
        self.outers = [make_outer(b) for b in self.model.blocks]
        self.backups = [
            {n: p.detach().clone() for n, p in b.named_parameters()} for b in self.model.blocks
        ]

    def train(self, count: int, first_index: int) -> None:
        for index in range(first_index, first_index + count):
            x, y = batch(self.replica, self.step, index)
            self.inner.zero_grad()
            loss_of(self.model, x, y).backward()
            self.inner.step()

    def block(self, f: int) -> nn.Module:
        return self.model.blocks[f]

    def set_block(self, f: int, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.block(f).named_parameters():
                p.copy_(values[n])

    def global_state(self) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
        return [
            ({n: t.clone() for n, t in b.items()}, copy.deepcopy(o.state_dict()))
            for b, o in zip(self.backups, self.outers, strict=True)
        ]


def _round_keys(records: list[Record]) -> list[tuple[int, int, int]]:
    seen: dict[tuple[int, int], int] = defaultdict(int)
    keys = []
    for r in records:
        keys.append((r.round_step, r.quorum_id, seen[(r.round_step, r.quorum_id)]))
        seen[(r.round_step, r.quorum_id)] += 1
    return keys


def _avg(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) > 2:
        raise ValueError("bit-identity with the Manager's Gloo sum needs at most 2 participants")
    total = tensors[0].clone() if len(tensors) == 1 else tensors[0] + tensors[1]
    return total / len(tensors)


def simulate(cfg: Config, lineages: list[Lineage]) -> dict[tuple[int, int], Lineage]:
    """Replay the recorded syncs; return every lineage's simulated end state.

    Raises:
        AssertionError: the history is inconsistent (two different global
            states for one step, a participant that cannot be found, ...).
    """
    n = cfg.n_fragments if cfg.algorithm == "diloco" else 1
    period = cfg.sync_every // n
    delay = cfg.delay if cfg.algorithm == "diloco" else 0
    by_round: dict[tuple[int, int, int], list[tuple[Lineage, Record | None]]] = defaultdict(list)
    position: dict[int, list[tuple[int, int, int]]] = {}
    for lin in lineages:
        keys = _round_keys(lin.records)
        position[id(lin)] = keys
        for key, record in zip(keys, lin.records, strict=True):
            by_round[key].append((lin, record))
    global_at: dict[int, list[tuple[dict[str, torch.Tensor], dict[str, Any]]]] = {}
    gone: set[int] = set()
    for key in sorted(by_round):
        members = by_round[key]
        wanted = members[0][1].participants if members[0][1] else 0
        if len(members) < wanted:
            # A participant that died before it could record the sync: the
            # most recent process of another replica group that recorded
            # nothing after it and did not finish.
            present = {lin.replica for lin, _ in members}
            dead = [
                lin
                for lin in lineages
                if lin.replica not in present
                and not lin.finished
                and id(lin) not in gone
                and all(k < key for k in position[id(lin)])
            ]
            dead.sort(key=lambda lin: (max(position[id(lin)], default=(-1, -1, -1)), lin.attempt))
            members = members + [(lin, None) for lin in dead[-(wanted - len(members)) :]]
            gone.update(id(lin) for lin, rec in members if rec is None)
        assert len(members) == wanted or wanted == 0, (key, len(members), wanted)
        fragment = next(r.fragment for _, r in members if r is not None)
        contributions = []
        for lin, _rec in members:
            lin.train(period - delay, 0)
        # A heal's source: a member at the quorum's step, still at the point
        # where it served its state (the quorum).
        sources = [lin for lin, rec in members if rec is not None and lin.step == key[0]]
        behind_healed = []
        for lin, rec in members:
            behind = lin.step != key[0]
            # A member behind the quorum's step heals in it (one that died
            # before it could record is assumed to have healed).
            healed = rec.healed if rec is not None else behind
            if healed:
                assert cfg.algorithm == "diloco", "LocalSGD heals are not modelled"
                assert sources, f"a heal at {key} without a source"
                _heal(lin, global_at[key[0]], key[0], sources[0])
            behind_healed.append((behind, healed))
        for (lin, rec), (behind, healed) in zip(members, behind_healed, strict=True):
            assert fragment == key[0] % n
            zero = (rec is not None and rec.zeroed) or (behind and not healed)
            if cfg.algorithm == "diloco":
                lin.pseudo = {
                    name: lin.backups[fragment][name] - p.detach()
                    for name, p in lin.block(fragment).named_parameters()
                }
            else:
                lin.pseudo = {name: p.detach().clone() for name, p in lin.model.named_parameters()}
            if zero:
                lin.pseudo = {name: torch.zeros_like(t) for name, t in lin.pseudo.items()}
                assert rec is None or not rec.committed, "a step that failed committed"
            lin.train(delay, period - delay)
            contributions.append(lin.pseudo)
        if wanted == 0:
            averaged: dict[str, torch.Tensor] = {}
        else:
            averaged = {name: _avg([c[name] for c in contributions]) for name in contributions[0]}
        for lin, rec in members:
            if rec is None:
                continue  # died in this sync
            if cfg.algorithm == "localsgd":
                if rec.committed:
                    with torch.no_grad():
                        for name, p in lin.model.named_parameters():
                            p.copy_(averaged[name])
                    lin.step += 1
                continue
            local = {name: p.detach().clone() for name, p in lin.block(fragment).named_parameters()}
            lin.set_block(fragment, lin.backups[fragment])
            outer = lin.outers[fragment]
            if rec.committed:
                for name, p in lin.block(fragment).named_parameters():
                    p.grad = averaged[name].clone()
                outer.step()
                lin.backups[fragment] = {
                    name: p.detach().clone() for name, p in lin.block(fragment).named_parameters()
                }
                if cfg.alpha > 0:
                    with torch.no_grad():
                        for name, p in lin.block(fragment).named_parameters():
                            p.lerp_(local[name], cfg.alpha)
                lin.step += 1
                state = lin.global_state()
                if lin.step in global_at:
                    _assert_same(global_at[lin.step], state, lin.step)
                else:
                    global_at[lin.step] = state
            outer.zero_grad()
    return {(lin.replica, lin.attempt): lin for lin in lineages}


def _heal(
    lin: Lineage,
    state: list[tuple[dict[str, torch.Tensor], dict[str, Any]]],
    step: int,
    source: Lineage,
) -> None:
    """The global state of ``step``, and the source's local weights and inner
    optimizer state (the workers' own state_dict moves those)."""
    for f, (backup, outer_state) in enumerate(state):
        lin.backups[f] = {n: t.clone() for n, t in backup.items()}
        lin.outers[f].load_state_dict(copy.deepcopy(outer_state))
    with torch.no_grad():
        for mine, theirs in zip(lin.model.parameters(), source.model.parameters(), strict=True):
            mine.copy_(theirs)
    lin.inner.load_state_dict(copy.deepcopy(source.inner.state_dict()))
    lin.step = step


def _assert_same(a: Any, b: Any, step: int) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"two global states for step {step}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k], step)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y, step)
    else:
        assert a == b, (a, b, step)
