"""Process start-up shared by Baby groups, the test harness and the demo."""

from __future__ import annotations

import multiprocessing as mp

# Modules the fork server imports once, so that every process forked from it
# starts with torch ready (tens of milliseconds instead of seconds).
# torch._dynamo is what constructing any torch.optim optimizer imports first:
# 0.7 s of CPU per trainer process otherwise, seconds when several start at
# once on a small machine.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ftdist.process_group"]


def forkserver_context() -> mp.context.ForkServerContext:
    """The ``forkserver`` context with torch preloaded.

    The fork server is a clean process (no threads, no Gloo, no CUDA), so
    forking from it is safe where forking the trainer would not be.
    """
    ctx = mp.get_context("forkserver")
    # Read when the fork server first starts; harmless to repeat.
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
