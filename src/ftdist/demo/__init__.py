"""
``ftdist demo``: the main job
=============================

A real training run with injected failures that shows fault tolerance end
to end, on one machine: an embedded lighthouse with its dashboard, several
replica-group processes training a spiral classifier with ftdist's DDP,
OptimizerWrapper and ExactSampler, a seeded schedule of SIGKILLs (each
victim restarted and healed live) and a SIGSTOP that hangs a group past the
failure-detection window, a live terminal view, and a report whose verdict
is whether every replica ended with bit-identical weights, having read
every sample of each epoch once.

Modules: :mod:`~ftdist.demo.task` (data and model), :mod:`~ftdist.demo.worker`
(one replica group), :mod:`~ftdist.demo.batches` (what it reads),
:mod:`~ftdist.demo.ledger` (what the run read),
:mod:`~ftdist.demo.events` (the events files),
:mod:`~ftdist.demo.schedule` (the failure plan and rule),
:mod:`~ftdist.demo.supervisor` (processes and failures),
:mod:`~ftdist.demo.tracking` (what the events tell; the chaos suite's
supervisor uses it too), :mod:`~ftdist.demo.view`,
:mod:`~ftdist.demo.report`, :mod:`~ftdist.demo.plot` and
:mod:`~ftdist.demo.run` (``ftdist demo``).
"""

from ftdist.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
