"""
etcd
====

etcd support for the replicated lighthouse (:mod:`ftdist.lighthouse.replica`):

* :mod:`~ftdist.etcd.client`: :class:`~ftdist.etcd.client.EtcdClient`, the
  etcd v3 calls ftdist needs over gRPC (KV, Lease, Status), with failover
  between endpoints and TLS.
* :mod:`~ftdist.etcd.local`: :class:`~ftdist.etcd.local.LocalEtcdCluster`, a
  real etcd cluster of local processes (tests, ``ftdist demo
  --replicated-lighthouse``), and :func:`~ftdist.etcd.local.find_etcd_binary`.
"""

from __future__ import annotations

from ftdist.etcd.client import EtcdClient, KeyValue, Lease, MemberStatus, parse_endpoints
from ftdist.etcd.local import ETCD_BIN_ENV, MAX_MEMBERS, LocalEtcdCluster, find_etcd_binary

__all__ = [
    "ETCD_BIN_ENV",
    "MAX_MEMBERS",
    "EtcdClient",
    "KeyValue",
    "Lease",
    "LocalEtcdCluster",
    "MemberStatus",
    "find_etcd_binary",
    "parse_endpoints",
]
