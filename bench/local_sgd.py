"""LocalSGD/DiLoCo benchmark: DDP against DiLoCo over a throttled link.

Two replica groups (one process each) train the same ~1M-parameter MLP on
the demo's spirals, each in its own **network namespace**, connected to a
bridge in the root namespace by a veth pair whose both ends are throttled
with ``tc tbf`` (``--rate``, 100 Mbit/s by default; ``--delay-ms`` adds
latency with netem). Everything between the two groups (Gloo's collectives,
the heal transfers, the rendezvous) crosses the throttled links; the
lighthouse and this script's coordination store listen on the bridge in
the root namespace. Each namespace resolves the machine's hostname to its
own address (``/etc/netns/NAME/hosts``), so Gloo binds there.

For each configuration the groups train for the same wall time
(``--seconds``) from the same initial weights:

* ``ddp``: ftdist's ``DistributedDataParallel`` + ``OptimizerWrapper``, an
  allreduce of the gradients every step;
* ``diloco-10`` / ``diloco-100``: :class:`ftdist.local_sgd.DiLoCo`, AdamW
  inner steps and a sync (outer Nesterov SGD) every 10 / 100 steps;
* ``diloco-10-int8``: the same with int8-quantized pseudo-gradients.

The table shows inner steps per second (a DDP step and a DiLoCo inner step
each take one batch), the ratio to DDP measured in the same run, the syncs
committed, and the held-out loss and accuracy of the shared weights (DDP's
model, DiLoCo's global weights) when the time was up. Nothing is asserted.

Needs root (``ip netns``, ``tc``); it says so and exits 2 if namespaces are
unavailable. Everything it creates is named ``ftdsgd-*`` and removed in a
``finally``. Run ``python bench/local_sgd.py`` (about 2 minutes) or
``--quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

PREFIX = "ftdsgd"
SUBNET = "10.79.0"
HOST_IP = f"{SUBNET}.1"
BRIDGE = f"{PREFIX}-br"
NETNS_ETC = "/etc/netns"
GROUPS = 2
HIDDEN = 1024
BATCH = 64
CONFIGS = [
    ("ddp", "ddp", 1, False),
    ("diloco-10", "diloco", 10, False),
    ("diloco-100", "diloco", 100, False),
    ("diloco-10-int8", "diloco", 10, True),
]


def _ns(i: int) -> str:
    return f"{PREFIX}-r{i}"


def _ip(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    return subprocess.run(full, capture_output=True, text=True, check=check, timeout=30)


# -- the network --------------------------------------------------------------------------------
class Network:
    """The bridge, one namespace per replica group, throttled veths; removed on exit."""

    def __init__(self, rate: str, delay_ms: float) -> None:
        self.rate = rate
        self.delay_ms = delay_ms
        self._created_etc = False

    def available(self) -> str | None:
        """Why namespaces cannot be used here, or None."""
        if os.geteuid() != 0:
            return "this benchmark needs root (ip netns, tc): run it with sudo or as root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"{tool!r} (iproute2) is not installed"
        probe = f"{PREFIX}-probe"
        result = _sh("ip", "netns", "add", probe, check=False)
        if result.returncode != 0:
            return f"network namespaces are unavailable: {result.stderr.strip()}"
        _sh("ip", "netns", "del", probe, check=False)
        return None

    def _throttle(self, dev: str, ns: str | None) -> None:
        tbf = ["rate", self.rate, "burst", "64kb", "latency", "200ms"]
        if self.delay_ms > 0:
            _sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                "delay", f"{self.delay_ms}ms", ns=ns)  # fmt: skip
            _sh("tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", "tbf", *tbf,
                ns=ns)  # fmt: skip
        else:
            _sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", *tbf, ns=ns)

    def __enter__(self) -> Network:
        self.teardown()  # leftovers of a run that was killed
        try:
            _sh("ip", "link", "add", BRIDGE, "type", "bridge")
            _sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", BRIDGE)
            _sh("ip", "link", "set", BRIDGE, "up")
            self._created_etc = not os.path.isdir(NETNS_ETC)
            hostname = socket.gethostname()
            for i in range(GROUPS):
                ns, host_end, ns_end = _ns(i), f"{PREFIX}-v{i}", f"{PREFIX}-e{i}"
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                _sh("ip", "link", "set", ns_end, "netns", ns)
                _sh("ip", "link", "set", host_end, "master", BRIDGE, "up")
                _sh("ip", "addr", "add", f"{_ip(i)}/24", "dev", ns_end, ns=ns)
                _sh("ip", "link", "set", ns_end, "up", ns=ns)
                _sh("ip", "link", "set", "lo", "up", ns=ns)
                # Both directions: the namespace's egress and the bridge's.
                self._throttle(host_end, None)
                self._throttle(ns_end, ns)
                os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
                peers = "".join(f"{_ip(j)} {_ns(j)}\n" for j in range(GROUPS) if j != i)
                with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                    f.write(
                        f"127.0.0.1 localhost\n{_ip(i)} {hostname} {ns}\n"
                        f"{HOST_IP} {PREFIX}-host\n{peers}"
                    )
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def teardown(self) -> None:
        for i in range(GROUPS):
            _sh("ip", "netns", "del", _ns(i), check=False)
            _sh("ip", "link", "del", f"{PREFIX}-v{i}", check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, _ns(i)), ignore_errors=True)
        _sh("ip", "link", "del", BRIDGE, check=False)
        if self._created_etc and os.path.isdir(NETNS_ETC) and not os.listdir(NETNS_ETC):
            os.rmdir(NETNS_ETC)


def _spawn(i: int, *args: str, log: Any = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        ["ip", "netns", "exec", _ns(i), sys.executable, os.path.abspath(__file__), *args],
        env=env,
        text=True,
        stdout=log,
        stderr=log,
    )


def measure_link(seconds: float = 2.0) -> float:
    """Mbit/s of one TCP stream from group 1's namespace to group 0's."""
    port = 29000 + os.getpid() % 1000
    receiver = _spawn(0, "--receive", str(port), log=subprocess.DEVNULL)
    time.sleep(1.0)
    sender = subprocess.run(
        ["ip", "netns", "exec", _ns(1), sys.executable, os.path.abspath(__file__),
         "--send", f"{_ip(0)}:{port}", str(seconds)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    receiver.wait(timeout=30)
    return float(sender.stdout.strip().splitlines()[-1])


# -- one configuration ----------------------------------------------------------------------------
def run_config(
    name: str, algo: str, sync_every: int, quantize: bool, seconds: float
) -> dict[str, Any]:
    import torch.distributed as dist

    from ftdist.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind=f"{HOST_IP}:0",
        min_replicas=GROUPS,
        join_timeout_ms=60_000,
        heartbeat_timeout_ms=10_000,
        http_port=-1,
    )
    store = dist.TCPStore(HOST_IP, 0, is_master=True, wait_for_workers=False)
    prefix = f"{name}/{uuid.uuid4().hex[:8]}"
    spec = {
        "lighthouse": lighthouse.address(),
        "store": f"{HOST_IP}:{store.port}",
        "prefix": prefix,
        "algo": algo,
        "sync_every": sync_every,
        "quantize": quantize,
        "seconds": seconds,
    }
    logs = [tempfile.TemporaryFile("w+") for _ in range(GROUPS)]
    procs = [_spawn(i, "--worker", str(i), json.dumps(spec), log=logs[i]) for i in range(GROUPS)]
    try:
        for p in procs:
            p.wait(timeout=seconds + 180)
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        for i in failed:
            logs[i].seek(0)
            print(f"group {i} of {name} failed:\n{logs[i].read()[-4000:]}", file=sys.stderr)
        if failed:
            raise RuntimeError(f"{name}: replica groups {failed} failed")
        results = [json.loads(store.get(f"{prefix}/result/{i}")) for i in range(GROUPS)]
    finally:
        for log in logs:
            log.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    return {
        "name": name,
        "steps_per_s": sum(r["steps"] / r["elapsed"] for r in results) / GROUPS,
        "syncs": results[0]["syncs"],
        "loss": results[0]["loss"],
        "local_loss": results[0]["local_loss"],
        "accuracy": results[0]["accuracy"],
        "steps": results[0]["steps"],
    }


# -- inside a namespace ---------------------------------------------------------------------------
def worker(index: int, spec: dict[str, Any]) -> None:
    import logging

    import torch
    import torch.distributed as dist
    from torch import nn

    from ftdist.demo import task
    from ftdist.manager import Manager
    from ftdist.process_group import ProcessGroupGloo

    logging.getLogger("ftdist").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    host, port = spec["store"].split(":")
    store = dist.PrefixStore(
        spec["prefix"],
        dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120)),
    )
    train = task.make_spirals(20_000, seed=0)
    held_out = task.make_spirals(4_000, seed=1)
    torch.manual_seed(0)  # the same initial weights in both groups
    model = nn.Sequential(
        nn.Linear(2, HIDDEN), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN), nn.SiLU(),
        nn.Linear(HIDDEN, task.CLASSES),
    )  # fmt: skip
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diloco_mode = spec["algo"] == "diloco"
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    manager = Manager(
        pg=pg,
        load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), inner.load_state_dict(sd["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
        min_replica_size=GROUPS,
        use_async_quorum=not diloco_mode,
        init_sync=False,
        replica_id=f"bench{index}",
        lighthouse_addr=spec["lighthouse"],
        rank=0,
        world_size=1,
        hostname=_ip(index),
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
    )
    x_all, y_all = train.tensors
    gen = torch.Generator().manual_seed(100 + index)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(0, len(x_all), (BATCH,), generator=gen)
        return x_all[rows], y_all[rows]

    def barrier(key: str) -> None:
        store.add(key, 1)
        while int(store.add(key, 0)) < GROUPS:
            time.sleep(0.01)

    steps = syncs = 0
    snapshot: dict[str, Any] | None = None
    stop: int | None = None
    try:
        if diloco_mode:
            from ftdist.local_sgd import DiLoCo

            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            algo: Any = DiLoCo(
                manager, model, inner, outer, sync_every=spec["sync_every"],
                should_quantize=spec["quantize"],
            )  # fmt: skip
            shared = algo.original_parameters
            step_fn = inner.step
            zero = inner.zero_grad
            forward: Any = model
        else:
            from ftdist.ddp import DistributedDataParallel
            from ftdist.optim import OptimizerWrapper

            algo = None
            forward = DistributedDataParallel(manager, model)
            opt = OptimizerWrapper(manager, inner)
            shared = dict(model.named_parameters())
            step_fn, zero = opt.step, opt.zero_grad
        barrier("start")
        t0 = time.monotonic()
        ctx = algo if algo is not None else _nothing()
        with ctx:
            while True:
                boundary = algo is None or algo._local_step == 0
                if boundary:
                    if stop is None and store.check(["stop"]):
                        stop = int(store.get("stop"))
                    if stop is not None and manager.current_step() >= stop:
                        break
                before = manager.current_step()
                zero()
                x, y = batch()
                nn.functional.cross_entropy(forward(x), y).backward()
                step_fn()
                steps += 1
                syncs += manager.current_step() > before
                elapsed = time.monotonic() - t0
                if snapshot is None and elapsed >= spec["seconds"]:
                    snapshot = {
                        "steps": steps,
                        "syncs": syncs,
                        "elapsed": elapsed,
                        "weights": {k: v.detach().clone() for k, v in shared.items()},
                        "local": diloco_mode,
                    }
                    if index == 0:  # both groups stop at the same step, a little later
                        store.set("stop", str(manager.current_step() + 2))
        assert snapshot is not None
        local_loss = task.evaluate(model, held_out)[0] if snapshot["local"] else None
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(snapshot["weights"][name])
        loss, accuracy = task.evaluate(model, held_out)
        store.set(
            f"result/{index}",
            json.dumps(
                {
                    "steps": snapshot["steps"],
                    "syncs": snapshot["syncs"],
                    "elapsed": snapshot["elapsed"],
                    "loss": loss,
                    "local_loss": local_loss,
                    "accuracy": accuracy,
                }
            ),
        )
        barrier("done")
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def receive(port: int) -> None:
    with socket.create_server((_ip(0), port)) as server:
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 20):
                pass


def send(target: str, seconds: float) -> None:
    host, port = target.rsplit(":", 1)
    chunk = b"\0" * (1 << 20)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            conn.sendall(chunk)
            sent += len(chunk)
        elapsed = time.monotonic() - start
    print(sent * 8 / elapsed / 1e6)


# -- main -----------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate of each link (default 100mbit)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added one-way latency")
    parser.add_argument("--seconds", type=float, default=20.0, help="training time per config")
    parser.add_argument("--quick", action="store_true", help="6 s per config")
    parser.add_argument("--worker", nargs=2, metavar=("INDEX", "SPEC"), help=argparse.SUPPRESS)
    parser.add_argument("--receive", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--send", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(int(args.worker[0]), json.loads(args.worker[1]))
        return 0
    if args.receive:
        receive(args.receive)
        return 0
    if args.send:
        send(args.send[0], float(args.send[1]))
        return 0
    seconds = 6.0 if args.quick else args.seconds
    net = Network(args.rate, args.delay_ms)
    why = net.available()
    if why is not None:
        print(f"local_sgd bench: cannot run: {why}", file=sys.stderr)
        return 2
    import logging

    import torch

    logging.getLogger("ftdist").setLevel(logging.ERROR)  # the lighthouse's job-token notice
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; {GROUPS} replica groups, one "
          f"process each, each in its own network namespace")  # fmt: skip
    with net:
        mbit = measure_link()
        print(
            f"link between the groups: tc tbf {args.rate}"
            + (f" + {args.delay_ms:g} ms netem delay" if args.delay_ms else "")
            + f"; one TCP stream measured at {mbit:.0f} Mbit/s"
        )
        params = 2 * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * 5 + 5
        print(f"model: MLP 2-{HIDDEN}-{HIDDEN}-5, {params / 1e6:.2f}M parameters "
              f"({params * 4 / 1e6:.1f} MB of fp32 per allreduce); batch {BATCH}; "
              f"{seconds:g} s of training per row")  # fmt: skip
        rows = []
        for name, algo, sync_every, quantize in CONFIGS:
            rows.append(run_config(name, algo, sync_every, quantize, seconds))
            r = rows[-1]
            print(f"  {name}: {r['steps_per_s']:.1f} steps/s, loss {r['loss']:.3f}", flush=True)
    base = rows[0]["steps_per_s"]
    print()
    print(
        f"| config | steps/s | vs DDP | syncs in {seconds:g} s | held-out loss (shared "
        "weights) | accuracy | loss of group 0's local weights |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        local = "-" if r["local_loss"] is None else f"{r['local_loss']:.3f}"
        print(
            f"| {r['name']} | {r['steps_per_s']:.1f} | {r['steps_per_s'] / base:.1f}x | "
            f"{r['syncs']} | {r['loss']:.3f} | {r['accuracy'] * 100:.1f}% | {local} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
