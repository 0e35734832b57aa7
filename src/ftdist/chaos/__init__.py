"""
``ftdist chaos``: the chaos suite
=================================

Three replica groups (two ranks each by default) train the demo's spiral
classifier for ten minutes while a seeded schedule strikes every 5-15 s:
SIGKILL and SIGSTOP of trainers, SIGKILL of a heal source in the middle of
a heal, SIGKILL of a group while it heals, a lighthouse restart, and network
partitions made with network namespaces (a group cut off from the
lighthouse; a group cut off from its peers). With ``--replicated-lighthouse``
the lighthouse is three replicas on a local etcd cluster, and the schedule
kills, stops and cuts off from etcd the leading replica, and kills an etcd
member, instead of restarting it. The report gives steps committed against
attempted, the worst and median time to recover per kind, divergence (the
final hashes must match), hangs and leaked processes (there must be none),
and whether any step was committed under two quorums of one id (none may be).
``make chaos`` runs it; docs/chaos.md explains it.

Modules: :mod:`~ftdist.chaos.schedule` (the plan and rule, pure),
:mod:`~ftdist.chaos.netns` (namespaces and partitions),
:mod:`~ftdist.chaos.worker` (one trainer), :mod:`~ftdist.chaos.lighthouse`
(the restartable lighthouse), :mod:`~ftdist.chaos.controlplane` (the
replicated one) with :mod:`~ftdist.chaos.proxy` (cutting a replica off from
etcd), :mod:`~ftdist.chaos.supervisor` (processes; the events through
:mod:`ftdist.demo.tracking`), :mod:`~ftdist.chaos.faults` and
:mod:`~ftdist.chaos.failover` (carrying out injections),
:mod:`~ftdist.chaos.quorums` (the quorum of every commit),
:mod:`~ftdist.chaos.report` and :mod:`~ftdist.chaos.run`.
"""

from ftdist.chaos.run import ChaosConfig, run_chaos

__all__ = ["ChaosConfig", "run_chaos"]
