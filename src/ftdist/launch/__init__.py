"""
Launching processes
===================

* :mod:`~ftdist.launch.ranks`: N rank processes of a function, forked from a
  warm fork server that has already imported torch, meeting on a TCPStore;
  the demo, the benchmarks and the tests start their ranks with it.
"""
