"""
Data across replica groups
==========================

Two samplers, for two needs (docs/data.md compares them):

* :class:`DistributedSampler` (:mod:`ftdist.data.sampler`): torchft's, kept
  exactly as it is. Static shards over every rank of every replica group;
  under failures it is lossy, as torchft says: a group that is down does not
  read its shard, and the global batch shrinks.
* :class:`ExactSampler` (:mod:`ftdist.data.exact`): every sample of an epoch
  exactly once and a constant global batch, whatever fails; the cursor moves
  only on commit and heals with the model. Its plan is the pure rule of
  :mod:`ftdist.data.plan`.
"""

from __future__ import annotations

from ftdist.data.exact import ExactSampler
from ftdist.data.plan import Cursor, StepPlan, plan_step
from ftdist.data.sampler import DistributedSampler

__all__ = ["Cursor", "DistributedSampler", "ExactSampler", "StepPlan", "plan_step"]
