"""Lighthouse benchmark: quorum latency against the number of replica groups.

N simulated replica groups live in this one asyncio process, each with its own
gRPC channel (as each real ManagerServer has its own connection). Every round,
all N send a ``Heartbeat`` and then a ``Quorum`` request at the same time; the
round ends when the last of them holds the new quorum. The first round measures
the first quorum (min_replicas = N, so it forms when the last group joins);
the following rounds measure the steady state, where the fast quorum fires as
soon as the last previous member asks again.

The lighthouse runs in its own process, started fresh for each N, so that the
client and the server do not share an interpreter. By default that is
``ftdist lighthouse``; ``--server-cmd`` benchmarks any other lighthouse with
the same client, for example torchft's::

    python bench/lighthouse.py --server-cmd \\
        "torchft_lighthouse --bind 127.0.0.1:{port} --min_replicas {n}"

Run it: ``python bench/lighthouse.py [--sizes 2,8,64,256,1024] [--rounds R]``.

``--token both`` runs every N twice, against a lighthouse without and with a
job token, and prints the ratio of the steady p50s: the lighthouse's cost of
checking the token. The clients send ``authorization: Bearer ...`` in both
runs (a lighthouse without a token ignores it), so that the ratio measures
the check and not the clients. ``--token on`` runs with the token only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time

import grpc
import grpc.aio

from ftdist._rpc._proto import torchft_pb2 as pb

_QUORUM = "/torchft.LighthouseService/Quorum"
_HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
_DEFAULT_SERVER = (
    f"{shlex.quote(sys.executable)} -m ftdist.cli lighthouse --bind 127.0.0.1:{{port}} "
    "--min-replicas {n} --http-port -1"
)


# Steady-round p50 of torchft's Rust lighthouse on the project's 2-core
# machine under this kind of client, as quoted in the lighthouse issue.
_TORCHFT_P50_MS = {2: 1.4, 64: 19.0, 256: 129.0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_BENCH_TOKEN = "bench-job-token-0123456789abcdef"


class _Replica:
    """One simulated replica group: a channel plus its two RPC stubs."""

    def __init__(self, address: str, replica_id: str, token: str | None) -> None:
        self.replica_id = replica_id
        self.metadata = None if token is None else (("authorization", f"Bearer {token}"),)
        self.channel = grpc.aio.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        self.heartbeat = self.channel.unary_unary(
            _HEARTBEAT,
            request_serializer=pb.LighthouseHeartbeatRequest.SerializeToString,
            response_deserializer=pb.LighthouseHeartbeatResponse.FromString,
        )
        self.quorum = self.channel.unary_unary(
            _QUORUM,
            request_serializer=pb.LighthouseQuorumRequest.SerializeToString,
            response_deserializer=pb.LighthouseQuorumResponse.FromString,
        )
        self.heartbeat_request = pb.LighthouseHeartbeatRequest(replica_id=replica_id)

    async def round(self, step: int, timeout: float) -> int:
        await self.heartbeat(self.heartbeat_request, timeout=timeout, metadata=self.metadata)
        request = pb.LighthouseQuorumRequest(
            requester=pb.QuorumMember(
                replica_id=self.replica_id,
                address=f"http://127.0.0.1:1/{self.replica_id}",
                store_address="127.0.0.1:2",
                step=step,
                world_size=1,
            )
        )
        response = await self.quorum(request, timeout=timeout, metadata=self.metadata)
        return len(response.quorum.participants)


async def _run_size(
    address: str, n: int, rounds: int, timeout: float, token: str | None
) -> tuple[float, list[float]]:
    replicas = [_Replica(address, f"replica_{i:04d}", token) for i in range(n)]
    try:
        await asyncio.gather(*(r.channel.channel_ready() for r in replicas))
        latencies: list[float] = []
        for step in range(rounds + 1):
            start = time.perf_counter()
            sizes = await asyncio.gather(*(r.round(step, timeout) for r in replicas))
            latencies.append(time.perf_counter() - start)
            if any(size != n for size in sizes):
                raise RuntimeError(f"round {step}: expected {n} members, got {set(sizes)}")
        return latencies[0], latencies[1:]
    finally:
        await asyncio.gather(*(r.channel.close() for r in replicas))


def _wait_ready(address: str, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    channel = grpc.insecure_channel(address)
    try:
        end = time.monotonic() + deadline_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"lighthouse exited with {proc.returncode} before serving")
            try:
                grpc.channel_ready_future(channel).result(timeout=0.2)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() > end:
                    raise RuntimeError(
                        f"lighthouse at {address} not ready after {deadline_s} s"
                    ) from None
    finally:
        channel.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2,8,64,256,1024", help="comma-separated N values")
    parser.add_argument(
        "--rounds", type=int, default=0, help="steady rounds per N (default: by N, 20 to 300)"
    )
    parser.add_argument(
        "--server-cmd",
        default=_DEFAULT_SERVER,
        help="lighthouse command; {port} and {n} are substituted (default: ftdist lighthouse)",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="per-RPC timeout, seconds")
    parser.add_argument(
        "--token",
        choices=["off", "on", "both"],
        default="off",
        help="run without a job token, with one, or both (then the p50 ratio is the "
        "token check's cost) [default: off]",
    )
    args = parser.parse_args()

    print(
        f"{'N':>5} {'token':>5} {'first quorum':>13} {'p50 round':>10} {'p99 round':>10} "
        f"{'rounds':>7}  {'mean':>9}  vs torchft p50 (issue)"
    )
    # "both" runs off, on, on, off: the machine drifts during a run (the
    # second of two runs is often the slower), and the order cancels that.
    both = [None, _BENCH_TOKEN, _BENCH_TOKEN, None]
    modes = {"off": [None], "on": [_BENCH_TOKEN], "both": both}[args.token]
    for n in (int(x) for x in args.sizes.split(",")):
        rounds = args.rounds or max(20, min(300, 6000 // n))
        p50s: dict[bool, list[float]] = {False: [], True: []}
        for token in modes:
            steady, line = _measure(args, n, rounds, token, send=args.token == "both" or token)
            p50s[token is not None].append(_percentile(steady, 0.5))
            print(line, flush=True)
        if args.token == "both":
            ratio = statistics.fmean(p50s[True]) / statistics.fmean(p50s[False])
            print(f"{n:>5} token check: mean p50 with / without = {ratio:.3f}", flush=True)
    return 0


def _measure(
    args: argparse.Namespace, n: int, rounds: int, token: str | None, send: object
) -> tuple[list[float], str]:
    port = _free_port()
    cmd = shlex.split(args.server_cmd.format(port=port, n=n))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTDIST_JOB_TOKEN")}
    if token is not None:
        env["FTDIST_JOB_TOKEN"] = token
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        address = f"127.0.0.1:{port}"
        _wait_ready(address, proc, deadline_s=30.0)
        sent = _BENCH_TOKEN if send else None
        first, steady = asyncio.run(_run_size(address, n, rounds, args.timeout, sent))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    p50_ms = _percentile(steady, 0.5) * 1e3
    reference = _TORCHFT_P50_MS.get(n)
    versus = f"{reference:g} ms -> {p50_ms / reference:.2f}x" if reference else "-"
    line = (
        f"{n:>5} {'on' if token else 'off':>5} {first * 1e3:>10.1f} ms {p50_ms:>7.2f} ms "
        f"{_percentile(steady, 0.99) * 1e3:>7.2f} ms {len(steady):>7}  "
        f"{statistics.fmean(steady) * 1e3:>6.2f} ms  {versus}"
    )
    return steady, line


if __name__ == "__main__":
    sys.exit(main())
