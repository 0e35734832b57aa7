"""
gRPC plumbing (private)
=======================

What the lighthouse and the manager servers share: the wire protocol
(``proto/*.proto``, compiled into ``_proto`` by ``make proto``), channel and
server options, the mapping from gRPC status to ftdist's exceptions
(:mod:`~ftdist._rpc.common`), and the single-threaded completion-queue server
the lighthouse runs on (:mod:`~ftdist._rpc.cq_server`).
"""
