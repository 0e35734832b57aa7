"""
HTTP transport benchmark (torchft's ``http_transport_bench``)
=============================================================

Serves a state of zero-filled float32 tensors from an :class:`HTTPTransport`
and fetches it back from the same process, then prints the throughput::

    python -m ftdist.checkpointing.http_transport_bench --total-size 1000000000

The two-process numbers are in ``bench/recovery.py`` (part d).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch

from ftdist.checkpointing.http_transport import HTTPTransport


def main(argv: list[str]) -> None:
    """Run the benchmark with command-line arguments ``argv``.

    Raises:
        SystemExit: the arguments are invalid (argparse).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--num-chunks", type=int, default=0, help="parallel streams (0: one)")
    parser.add_argument("--device", type=str, default="cpu", help="where the tensors live")
    parser.add_argument("--chunk-size", type=int, default=3_000_000, help="bytes per tensor")
    parser.add_argument("--total-size", type=int, default=12_000_000_000, help="bytes in all")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    numel = max(1, args.chunk_size // 4)
    state = {
        f"chunk/{i}": torch.zeros(numel, dtype=torch.float32, device=device)
        for i in range(0, args.total_size, max(1, args.chunk_size))
    }
    timeout = timedelta(seconds=60)
    transport: HTTPTransport[dict[str, torch.Tensor]] = HTTPTransport(
        timeout, num_chunks=args.num_chunks, hostname="localhost"
    )
    try:
        transport.send_checkpoint([0], 1, state, timeout)
        start = time.perf_counter()
        got = transport.recv_checkpoint(1, transport.metadata(), 1, timeout)
        seconds = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in got.values())
        print(
            f"fetched {len(got)} tensors, {nbytes / 1e9:.3f} GB in {seconds:.3f} s: "
            f"{nbytes / seconds / 1e9:.2f} GB/s (num_chunks={args.num_chunks}, device={device})"
        )
    finally:
        transport.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
