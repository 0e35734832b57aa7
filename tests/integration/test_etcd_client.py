"""ftdist's etcd v3 client (ftdist.etcd.client) against real etcd servers: the
calls the replicated lighthouse relies on, failover between members (killed
or stopped), fencing by create revision, and TLS with client certificates."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftdist.errors import EtcdError
from ftdist.etcd.client import (
    EtcdClient,
    create_revision_is,
    get_op,
    put_op,
)
from ftdist.etcd.local import LocalEtcdCluster, find_etcd_binary
from ftdist.lighthouse.client import LighthouseClient
from ftdist.lighthouse.config import resolve_lighthouse_config
from ftdist.lighthouse.server import LighthouseServer
from tests import _diagnostics
from tests.etcd_fixtures import NO_ETCD, etcd_cluster  # noqa: F401

pytestmark = pytest.mark.timeout(90)


def test_kv_txn_and_leases(etcd_cluster: LocalEtcdCluster) -> None:  # noqa: F811
    with EtcdClient(etcd_cluster.endpoint_arg, timeout=5) as client:
        revision = client.put(b"/t/a", b"1")
        found = client.get(b"/t/a")
        assert found is not None and found.value == b"1" and found.create_revision == revision
        client.put(b"/t/b", b"2")
        assert [kv.key for kv in client.range(b"/t/", prefix=True)] == [b"/t/a", b"/t/b"]
        assert [kv.key for kv in client.range(b"/t/", prefix=True, limit=1, newest_first=True)] == [
            b"/t/b"
        ]
        lease = client.grant(1)
        assert lease.ttl_s >= 1  # etcd raises it to its minimum (2 s with the defaults)
        # Create-if-absent: the election's transaction.
        won = client.txn(
            [create_revision_is(b"/t/leader", 0)],
            [put_op(b"/t/leader", b"me", lease.id), get_op(b"/t/a")],
            [get_op(b"/t/leader")],
        )
        assert won.succeeded and won.ranges[0][0].value == b"1"
        lost = client.txn(
            [create_revision_is(b"/t/leader", 0)],
            [put_op(b"/t/leader", b"other")],
            [get_op(b"/t/leader")],
        )
        assert not lost.succeeded and lost.ranges[0][0].lease == lease.id
        # Fencing: a write guarded by the leader key's create revision.
        token = lost.ranges[0][0].create_revision
        assert client.txn(
            [create_revision_is(b"/t/leader", token)], [put_op(b"/t/q", b"1")]
        ).succeeded
        assert client.keep_alive(lease.id) >= 1
        client.revoke(lease.id)
        client.revoke(lease.id)  # gone already: not an error
        assert client.get(b"/t/leader") is None  # its key went with it
        assert client.keep_alive(lease.id) == 0
        assert not client.txn(
            [create_revision_is(b"/t/leader", token)], [put_op(b"/t/q", b"2")]
        ).succeeded
        assert client.delete(b"/t/", prefix=True) == 3
        with pytest.raises(EtcdError, match="lease not found"):
            client.put(b"/t/x", b"y", lease=lease.id)
        statuses = [client.member_status(e) for e in etcd_cluster.endpoints]
        assert all(s.ok and s.version.startswith("3.") for s in statuses), statuses
        assert sum(s.is_leader for s in statuses) == 1, statuses


def test_calls_move_to_a_live_member(etcd_cluster: LocalEtcdCluster) -> None:  # noqa: F811
    with EtcdClient(etcd_cluster.endpoint_arg, timeout=5) as client:
        client.put(b"/f/a", b"1")
        etcd_cluster.kill_member(0)
        # Member 0 was the first tried: the call moves on within its deadline.
        found = client.get(b"/f/a")
        assert found is not None and found.value == b"1"
        etcd_cluster.stop_member(1)
        try:
            began = time.monotonic()
            found = client.get(b"/f/a", timeout=5)
            # Member 2 alone is no majority: its read cannot be linearized, so
            # the call fails within its deadline rather than hang.
        except EtcdError as exc:
            assert time.monotonic() - began < 10, exc
        finally:
            etcd_cluster.continue_member(1)
        assert client.get(b"/f/a", timeout=10) is not None
        status = client.member_status(etcd_cluster.endpoints[0], timeout=0.5)
        assert not status.ok and status.error


def test_nothing_answers_in_time() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with EtcdClient(f"http://127.0.0.1:{port}", timeout=0.5) as client:
        began = time.monotonic()
        with pytest.raises(EtcdError, match=f"no answer within 0.5 s from .*127.0.0.1:{port}"):
            client.get(b"/x")
        assert time.monotonic() - began < 3


# -- TLS ------------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _pki(tmp: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    if _which("openssl") is None:
        pytest.skip("the openssl command is not available")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ca, ca_key = tmp / "ca.pem", tmp / "ca.key"
    _openssl(
        "req",
        "-x509",
        *ec,
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
    )
    files = {"ca": str(ca)}
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        key, csr, cert, extfile = (tmp / f"{name}.{s}" for s in ("key", "csr", "pem", "ext"))
        extfile.write_text(ext + "\n")
        _openssl("req", "-new", *ec, "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(csr))
        _openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            str(extfile),
            "-out",
            str(cert),
        )
        files[name] = str(cert)
        files[f"{name}_key"] = str(key)
    return files


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """One etcd member serving clients over TLS, requiring client certificates."""
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(NO_ETCD)
    pki = _pki(tmp_path)
    client_port, peer_port = _free_port(), _free_port()
    url = f"https://127.0.0.1:{client_port}"
    log = tmp_path / "etcd-tls.log"
    _diagnostics.watch(str(log), "TLS etcd log")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                "--name",
                "tls0",
                "--data-dir",
                str(tmp_path / "data"),
                "--listen-client-urls",
                url,
                "--advertise-client-urls",
                url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer_port}",
                "--initial-cluster",
                f"tls0=http://127.0.0.1:{peer_port}",
                "--cert-file",
                pki["server"],
                "--key-file",
                pki["server_key"],
                "--trusted-ca-file",
                pki["ca"],
                "--client-cert-auth",
                "--log-level",
                "warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        with EtcdClient(url, ca=pki["ca"], cert=pki["client"], key=pki["client_key"]) as client:
            while True:
                try:
                    client.get(b"/ready", timeout=1)
                    break
                except EtcdError:
                    assert proc.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.1)
        yield url, pki
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_tls_with_a_client_certificate(tls_etcd: tuple[str, dict[str, str]]) -> None:
    url, pki = tls_etcd
    with EtcdClient(url, ca=pki["ca"], cert=pki["client"], key=pki["client_key"]) as client:
        client.put(b"/tls", b"ok")
        found = client.get(b"/tls")
        assert found is not None and found.value == b"ok"
    # No client certificate: etcd refuses the handshake.
    with EtcdClient(url, ca=pki["ca"], timeout=1) as client, pytest.raises(EtcdError):
        client.get(b"/tls")
    # A lighthouse replica reaches it with the same files, and leads.
    config = resolve_lighthouse_config(
        bind="127.0.0.1:0",
        min_replicas=1,
        http_port=-1,
        etcd=url,
        job="tls",
        etcd_ca=pki["ca"],
        etcd_cert=pki["client"],
        etcd_key=pki["client_key"],
        environ={},
    )
    with (
        LighthouseServer(config=config) as lighthouse,
        LighthouseClient(lighthouse.address(), 10) as status_client,
    ):
        deadline = time.monotonic() + 20
        # The etcd members' health is probed by a thread of its own: it may
        # land after the replica starts serving.
        while not (
            (replication := status_client.status()["replication"])["serving"]
            and replication["etcd"]
        ):
            assert time.monotonic() < deadline, replication
            time.sleep(0.05)
        assert replication["etcd"][0]["ok"], replication
