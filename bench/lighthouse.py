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
the same client.

**Side by side with torchft.** Where torchft is installed, every N is run
against ``ftdist lighthouse`` and torchft's Rust ``torchft_lighthouse`` in the
order ftdist, torchft, torchft, ftdist (this shared machine drifts, and the
order cancels a drift), and the line ``ratio`` is ftdist's mean steady p50
over torchft's (``--against none`` skips torchft).

**Clients.** ``--client native`` (the default where torchft is installed) is
torchft's own ``LighthouseClient`` (Rust, one per replica group, each called
from its own thread, as torchft's managers call it); ``--client ftdist`` is
ftdist's ``LighthouseClient`` (Python, the client ftdist's manager servers
use), threaded the same way; ``--client own`` gives each lighthouse its own
project's client (ftdist's against ftdist's lighthouse, torchft's native one
against torchft's), so the ratio is of the two whole stacks a user gets;
``--client aio`` is N ``grpc.aio`` channels in one asyncio loop. The native clients run in
ceil(N / 128) processes (``--client-procs K`` picks K; 1 keeps them all in
this one). Real managers are separate processes; in one process the N
threads that turn N-member quorums into Python objects all queue for one
GIL, and at N = 1024 that queue, not the lighthouse, set the round time: the
same ftdist lighthouse took 1.84-1.92 s per round with every client in one
process and 0.67-0.74 s with them in eight (torchft's 1.49-1.61 and
1.25-1.28 s).

**Server CPU.** Each line also shows the lighthouse process's CPU time per
steady round (user + system, all its threads, read from ``/proc`` before and
after the rounds; Linux only), and each cycle's ratio line and the summary
compare them: on this shared machine the CPU a round costs moves far less
from run to run than the latency does.

Run it: ``python bench/lighthouse.py [--sizes 2,64,256,512,1024] [--rounds R]``.

``--token both`` runs every N twice, against a lighthouse without and with a
job token, and prints the ratio of the steady p50s: the lighthouse's cost of
checking the token. The clients send ``authorization: Bearer ...`` in both
runs (a lighthouse without a token ignores it), so that the ratio measures
the check and not the clients. ``--token on`` runs with the token only.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio

from ftdist._rpc._proto import torchft_pb2 as pb

_QUORUM = "/torchft.LighthouseService/Quorum"
_HEARTBEAT = "/torchft.LighthouseService/Heartbeat"
_DEFAULT_SERVER = (
    f"{shlex.quote(sys.executable)} -m ftdist.cli lighthouse --bind 127.0.0.1:{{port}} "
    "--min-replicas {n} --http-port -1"
)
_TORCHFT_SERVER = "{torchft} --bind 127.0.0.1:{{port}} --min_replicas {{n}}"


def _torchft_server_cmd() -> str | None:
    """torchft's Rust lighthouse, next to this interpreter or on PATH (None: not installed)."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = beside if os.access(beside, os.X_OK) else shutil.which("torchft_lighthouse")
    return _TORCHFT_SERVER.format(torchft=shlex.quote(found)) if found else None


def _has_native_client() -> bool:
    try:
        from torchft._torchft import LighthouseClient  # noqa: F401
    except ImportError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_BENCH_TOKEN = "bench-job-token-0123456789abcdef"
# Client threads per process by default (see "Clients" above).
_GROUPS_PER_PROCESS = 128


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


def _new_client(kind: str, address: str, deadline: timedelta) -> Any:
    """A threaded client of ``kind``: "torchft" (the native one) or "ftdist"."""
    if kind == "ftdist":
        from ftdist.lighthouse.client import LighthouseClient as FtdistClient

        return FtdistClient(f"http://{address}", deadline)
    from torchft._torchft import LighthouseClient

    return LighthouseClient(f"http://{address}", deadline)


def _native_round(client: Any, replica_id: str, step: int, deadline: timedelta) -> int:
    """One group's round with torchft's native client: a heartbeat, then a quorum; its size."""
    client.heartbeat(replica_id, timeout=deadline)
    quorum = client.quorum(
        replica_id=replica_id,
        timeout=deadline,
        address=f"http://127.0.0.1:1/{replica_id}",
        store_address="127.0.0.1:2",
        step=step,
        world_size=1,
    )
    return len(quorum.participants)


def _run_size_native(
    address: str, n: int, rounds: int, timeout: float, kind: str
) -> tuple[float, list[float]]:
    """The rounds with threaded clients of ``kind``, one thread per replica group."""
    deadline = timedelta(seconds=timeout)
    clients = [_new_client(kind, address, deadline) for _ in range(n)]
    go = threading.Barrier(n + 1, timeout=timeout)
    done = threading.Barrier(n + 1, timeout=timeout)
    ends = [0.0] * n
    sizes = [0] * n
    errors: list[BaseException] = []

    def member(i: int) -> None:
        replica_id = f"replica_{i:04d}"
        try:
            for step in range(rounds + 1):
                go.wait()
                try:
                    sizes[i] = _native_round(clients[i], replica_id, step, deadline)
                except Exception as exc:  # reported by the main thread
                    errors.append(exc)
                ends[i] = time.perf_counter()
                done.wait()
        except threading.BrokenBarrierError:
            return

    threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    latencies: list[float] = []
    try:
        for step in range(rounds + 1):
            go.wait()
            start = time.perf_counter()
            done.wait()
            latencies.append(max(ends) - start)
            if errors:
                raise RuntimeError(f"round {step}: {errors[0]!r}")
            if any(size != n for size in sizes):
                raise RuntimeError(f"round {step}: expected {n} members, got {set(sizes)}")
    finally:
        go.abort()
        done.abort()
        for thread in threads:
            thread.join(timeout)
    return latencies[0], latencies[1:]


def _member_process(
    address: str,
    first: int,
    count: int,
    rounds: int,
    timeout: float,
    go: Any,
    done: Any,
    reports: Any,
    expected: int,
    kind: str,
) -> None:
    """One client process: ``count`` groups from ``first``, reporting each round's last end.

    Every quorum must hold ``expected`` members; the clients are of ``kind``.
    """
    deadline = timedelta(seconds=timeout)
    ids = [f"replica_{i:04d}" for i in range(first, first + count)]
    clients = [_new_client(kind, address, deadline) for _ in ids]
    start = threading.Barrier(count + 1, timeout=timeout)
    end = threading.Barrier(count + 1, timeout=timeout)
    ends = [0.0] * count
    faults: list[str] = []

    def member(i: int) -> None:
        for step in range(rounds + 1):
            start.wait()
            try:
                members = _native_round(clients[i], ids[i], step, deadline)
                if members != expected:
                    faults.append(f"round {step}: expected {expected} members, got {members}")
            except Exception as exc:  # reported to the parent
                faults.append(f"round {step}: {exc!r}")
            ends[i] = time.perf_counter()
            end.wait()

    threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for _ in range(rounds + 1):
        go.wait()
        start.wait()
        end.wait()
        reports.put((max(ends), list(faults)))
        faults.clear()
        done.wait()
    for thread in threads:
        thread.join(timeout)


def _run_size_procs(
    address: str, n: int, rounds: int, timeout: float, procs: int, kind: str
) -> tuple[float, list[float]]:
    """The rounds with clients of ``kind`` in ``procs`` processes, a thread per group."""
    ctx = multiprocessing.get_context("spawn")
    procs = max(1, min(procs, n))
    go = ctx.Barrier(procs + 1, timeout=timeout)
    done = ctx.Barrier(procs + 1, timeout=timeout)
    queue = ctx.Queue()
    shares = [n // procs + (1 if k < n % procs else 0) for k in range(procs)]
    children = []
    first = 0
    for share in shares:
        child = ctx.Process(
            target=_member_process,
            args=(address, first, share, rounds, timeout, go, done, queue, n, kind),
            daemon=True,
        )
        child.start()
        children.append(child)
        first += share
    latencies: list[float] = []
    try:
        for step in range(rounds + 1):
            go.wait()
            begin = time.perf_counter()
            reports = [queue.get(timeout=timeout) for _ in children]
            done.wait()
            latencies.append(max(end for end, _ in reports) - begin)
            faults = [fault for _, found in reports for fault in found]
            if faults:
                raise RuntimeError(f"round {step}: {faults[0]}")
    except BaseException:
        # (Not after the last round: a child not yet woken from it would
        # see the barrier broken.)
        go.abort()
        done.abort()
        raise
    finally:
        for child in children:
            child.join(timeout)
            if child.is_alive():
                child.kill()
    return latencies[0], latencies[1:]


def _wait_ready(address: str, proc: subprocess.Popen[bytes], deadline_s: float) -> None:
    """Wait until the lighthouse accepts connections (both servers listen only once serving).

    A plain TCP connect: grpcio's ready future polls on a thread of its own
    that can outlive ``channel.close()`` and print a "Channel closed!" trace.
    """
    host, _, port = address.rpartition(":")
    end = time.monotonic() + deadline_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"lighthouse exited with {proc.returncode} before serving")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > end:
                raise RuntimeError(
                    f"lighthouse at {address} not ready after {deadline_s} s"
                ) from None
            time.sleep(0.05)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="2,8,64,256,512,1024", help="comma-separated N values")
    parser.add_argument(
        "--rounds", type=int, default=0, help="steady rounds per N (default: by N, 20 to 300)"
    )
    parser.add_argument(
        "--server-cmd",
        default=_DEFAULT_SERVER,
        help="lighthouse command; {port} and {n} are substituted (default: ftdist lighthouse)",
    )
    parser.add_argument(
        "--against",
        choices=["torchft", "none"],
        default="torchft" if _torchft_server_cmd() else "none",
        help="also run torchft's Rust lighthouse for every N and print the ratio "
        "[default: torchft where installed]",
    )
    parser.add_argument(
        "--client",
        choices=["native", "ftdist", "own", "aio"],
        default="native" if _has_native_client() else "aio",
        help="torchft's native LighthouseClient per group, ftdist's LighthouseClient, "
        "each lighthouse's own project's client, or grpc.aio channels "
        "[default: native where torchft is installed]",
    )
    parser.add_argument(
        "--client-procs",
        type=int,
        default=0,
        help="with --client native: spread the N clients over this many processes "
        f"[default: one per {_GROUPS_PER_PROCESS} groups]",
    )
    parser.add_argument(
        "--cycles",
        type=int,
        default=1,
        help="with --against torchft: run the ftdist, torchft, torchft, ftdist cycle this "
        "many times per N; the summary takes the median of the cycles' ratios (at N = 2 "
        "one cycle's ratio moved from 1.14x to 1.41x within an hour) [default: 1]",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="per-RPC timeout, seconds")
    parser.add_argument(
        "--token",
        choices=["off", "on", "both"],
        default="off",
        help="run without a job token, with one, or both (then the p50 ratio is the "
        "token check's cost) [default: off]; needs --client aio",
    )
    args = parser.parse_args()
    if args.cycles < 1:
        parser.error(f"--cycles {args.cycles}: give at least 1")
    if args.token != "off" and args.client != "aio":
        parser.error("--token needs --client aio (the threaded clients send no bench token)")
    if args.client in ("native", "own") and not _has_native_client():
        parser.error(f"--client {args.client}: torchft's native client is not installed")
    if args.against == "torchft" and _torchft_server_cmd() is None:
        parser.error("--against torchft: torchft_lighthouse is not installed")

    spread = (
        f" in {args.client_procs} process(es)"
        if args.client_procs
        else f" in one process per {_GROUPS_PER_PROCESS} groups"
    )
    threaded = args.client in ("native", "ftdist", "own")
    print(f"client: {args.client}{spread if threaded else ''}; {_load()}")
    print(
        f"{'N':>5} {'server':>7} {'token':>5} {'first quorum':>13} {'p50 round':>10} "
        f"{'p99 round':>10} {'rounds':>7}  {'mean':>9}  {'server CPU/round':>16}"
    )
    # "both" runs off, on, on, off: the machine drifts during a run (the
    # second of two runs is often the slower), and the order cancels that.
    both: list[str | None] = [None, _BENCH_TOKEN, _BENCH_TOKEN, None]
    choices: dict[str, list[str | None]] = {"off": [None], "on": [_BENCH_TOKEN], "both": both}
    modes = choices[args.token]
    ratios: dict[int, float] = {}
    # The lighthouse process's CPU time per round (all its threads), ftdist's
    # over torchft's: far steadier on this shared machine than the latency.
    cpu_ratios: dict[int, float] = {}
    for n in (int(x) for x in args.sizes.split(",")):
        rounds = args.rounds or max(20, min(300, 6000 // n))
        if args.against == "torchft":
            torchft_cmd = _torchft_server_cmd()
            assert torchft_cmd is not None
            cycle_ratios = []
            cycle_cpu_ratios: list[float] = []
            for _ in range(args.cycles):
                p50s: dict[str, list[float]] = {"ftdist": [], "torchft": []}
                cpus: dict[str, list[float]] = {"ftdist": [], "torchft": []}
                for name in ("ftdist", "torchft", "torchft", "ftdist"):
                    cmd = args.server_cmd if name == "ftdist" else torchft_cmd
                    steady, line, cpu = _measure(args, cmd, name, n, rounds, None, send=False)
                    p50s[name].append(_percentile(steady, 0.5))
                    if cpu is not None:
                        cpus[name].append(cpu)
                    print(line, flush=True)
                ratio = statistics.fmean(p50s["ftdist"]) / statistics.fmean(p50s["torchft"])
                cycle_ratios.append(ratio)
                cpu_note = ""
                if len(cpus["ftdist"]) == 2 and len(cpus["torchft"]) == 2:
                    cpu_ratio = statistics.fmean(cpus["ftdist"]) / statistics.fmean(cpus["torchft"])
                    cycle_cpu_ratios.append(cpu_ratio)
                    cpu_note = f"; server CPU per round {cpu_ratio:.2f}x"
                print(
                    f"{n:>5} ratio: ftdist / torchft mean steady p50 = {ratio:.2f}x "
                    f"({statistics.fmean(p50s['ftdist']) * 1e3:.2f} / "
                    f"{statistics.fmean(p50s['torchft']) * 1e3:.2f} ms){cpu_note}",
                    flush=True,
                )
            ratios[n] = statistics.median(cycle_ratios)
            if cycle_cpu_ratios:
                cpu_ratios[n] = statistics.median(cycle_cpu_ratios)
            if args.cycles > 1:
                shown = " ".join(f"{r:.2f}x" for r in cycle_ratios)
                print(f"{n:>5} median of {args.cycles} cycles: {ratios[n]:.2f}x ({shown})")
            continue
        token_p50s: dict[bool, list[float]] = {False: [], True: []}
        for token in modes:
            send = args.token == "both" or token
            steady, line, _ = _measure(args, args.server_cmd, "ftdist", n, rounds, token, send)
            token_p50s[token is not None].append(_percentile(steady, 0.5))
            print(line, flush=True)
        if args.token == "both":
            ratio = statistics.fmean(token_p50s[True]) / statistics.fmean(token_p50s[False])
            print(f"{n:>5} token check: mean p50 with / without = {ratio:.3f}", flush=True)
    if ratios:
        same = "each lighthouse with its own client" if args.client == "own" else "same client"
        cycles = f", median of {args.cycles} cycles" if args.cycles > 1 else ""
        print(f"\nsummary (ftdist / torchft steady p50, same run, {same}{cycles}):")
        print("  " + "  ".join(f"N={n}: {r:.2f}x" for n, r in ratios.items()))
        if cpu_ratios:
            print(
                "  the lighthouse's CPU time per round (all threads), ftdist / torchft: "
                + "  ".join(f"N={n}: {r:.2f}x" for n, r in cpu_ratios.items())
            )
        worst = max(ratios.values())
        print(
            f"  {'PASS' if worst <= 1.0 else 'MISS'}  at most 1.0x at every N: worst {worst:.2f}x"
        )
    return 0


def _client_kind(client: str, server: str) -> str | None:
    """The threaded client a run of ``server`` uses under ``--client client`` (None: aio)."""
    if client == "own":
        return "ftdist" if server == "ftdist" else "torchft"
    return {"native": "torchft", "ftdist": "ftdist"}.get(client)


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load unknown"
    return f"{os.cpu_count()} cores, load average {one:.2f} (1 min), {five:.2f} (5 min)"


def _measure(
    args: argparse.Namespace,
    server_cmd: str,
    name: str,
    n: int,
    rounds: int,
    token: str | None,
    send: object,
) -> tuple[list[float], str, float | None]:
    """One server's run: steady round times, the table line, and the server
    process's CPU seconds per round (None where /proc cannot tell)."""
    port = _free_port()
    cmd = shlex.split(server_cmd.format(port=port, n=n))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTDIST_JOB_TOKEN")}
    if token is not None:
        env["FTDIST_JOB_TOKEN"] = token
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        address = f"127.0.0.1:{port}"
        _wait_ready(address, proc, deadline_s=30.0)
        run: Callable[[], tuple[float, list[float]]]
        procs = args.client_procs or -(-n // _GROUPS_PER_PROCESS)
        kind = _client_kind(args.client, name)
        if kind is not None and procs > 1:
            run = lambda: _run_size_procs(address, n, rounds, args.timeout, procs, kind)  # noqa: E731
        elif kind is not None:
            run = lambda: _run_size_native(address, n, rounds, args.timeout, kind)  # noqa: E731
        else:
            sent = _BENCH_TOKEN if send else None
            run = lambda: asyncio.run(_run_size(address, n, rounds, args.timeout, sent))  # noqa: E731
        cpu_before = _cpu_seconds(proc.pid)
        first, steady = run()
        cpu_after = _cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    line = (
        f"{n:>5} {name:>7} {'on' if token else 'off':>5} {first * 1e3:>10.1f} ms "
        f"{_percentile(steady, 0.5) * 1e3:>7.2f} ms {_percentile(steady, 0.99) * 1e3:>7.2f} ms "
        f"{len(steady):>7}  {statistics.fmean(steady) * 1e3:>6.2f} ms"
    )
    cpu = None
    if cpu_before is not None and cpu_after is not None:
        cpu = (cpu_after - cpu_before) / (len(steady) + 1)
        line += f"  {cpu * 1e6:>13.0f} us"
    return steady, line, cpu


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` and all its threads (None off Linux).

    The server command's own process: a wrapper (a shell, ``strace``) that
    runs the lighthouse as its child reports only itself.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields follow the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
