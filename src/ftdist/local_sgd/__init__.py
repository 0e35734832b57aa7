"""
Semi-synchronous training: LocalSGD, DiLoCo and streaming DiLoCo
================================================================

Over a slow link (across racks or data centres) an allreduce every step
costs more than the step. These algorithms let each replica group train on
its own and synchronise only every ``sync_every`` steps, fault tolerantly,
through a :class:`~ftdist.manager.Manager` (torchft's ``torchft.local_sgd``):

* :class:`LocalSGD` averages the weights (:mod:`ftdist.local_sgd.local_sgd`);
* :class:`DiLoCo` steps an outer optimizer on the averaged pseudo-gradients,
  optionally fragment by fragment in the background
  (:mod:`ftdist.local_sgd.diloco`, :mod:`ftdist.local_sgd.fragment`).

Guarantees, on top of the Manager's:

* **A sync is all or nothing.** The new weights (and the outer optimizer's
  step) are applied only after every rank of the replica group voted to
  commit; a sync that fails leaves the global state as it was.
* **The global state is the same everywhere.** What must be identical on
  every replica at the same step (DiLoCo's global weights and outer
  optimizer state, LocalSGD's weights after a sync) is registered with the
  Manager: it moves with a heal and is compared across replicas. The local
  weights, which differ by design, are not compared.
* **A restarted replica group catches up at its first sync**: it heals the
  global state from a peer, and its local weights restart from it.

See docs/local_sgd.md for the algorithms, the fault-tolerance semantics and
where ftdist deliberately differs from torchft (the sign of the
pseudo-gradient, what a healed replica contributes).
"""

from __future__ import annotations

from ftdist.local_sgd.diloco import DiLoCo, SyncAction, sync_action
from ftdist.local_sgd.fragment import _StreamingDiLoCoFragment
from ftdist.local_sgd.local_sgd import USE_BUCKETIZATION_ENV, LocalSGD, extract_local_tensor

__all__ = [
    "USE_BUCKETIZATION_ENV",
    "DiLoCo",
    "LocalSGD",
    "SyncAction",
    "_StreamingDiLoCoFragment",
    "extract_local_tensor",
    "sync_action",
]
