"""Process start-up shared by Baby groups, the test harness and the demo."""

from __future__ import annotations

import multiprocessing as mp
import os

# Modules the fork server imports once, so that every process forked from it
# starts with torch ready (tens of milliseconds instead of seconds).
# torch._dynamo is what constructing any torch.optim optimizer imports first:
# 0.7 s of CPU per trainer process otherwise, seconds when several start at
# once on a small machine.
# ftdist.coordinator (ZeroMQ, the custom ops) is what a launched rank builds
# its parallel groups with: 0.07 s more per rank otherwise.
# ftdist.manager.manager (with the checkpoint transport and the lighthouse
# client it brings in) is what a fault-tolerant rank builds first: a
# replacement's Manager() imported it after the fork, 30 ms from bytecode and
# 130 ms where none is written (PYTHONDONTWRITEBYTECODE), inside its restart.
# Importing gRPC creates no channel or thread and leaves its core
# uninitialised, so forking after it is safe. What these imports read from
# the environment (torch's settings, GRPC_VERBOSITY, GRPC_TRACE, protobuf's)
# is the launcher's, read once here (docs/launch.md); ftdist reads its own
# settings when they are used, so a child may still set them.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "ftdist.process_group",
    "ftdist.coordinator",
    "ftdist.manager.manager",
]


def forkserver_context() -> mp.context.ForkServerContext:
    """The ``forkserver`` context with torch preloaded.

    The fork server is a clean process (no threads, no Gloo, no CUDA), so
    forking from it is safe where forking the trainer would not be.
    """
    ctx = mp.get_context("forkserver")
    # Read when the fork server first starts; harmless to repeat.
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def exit_with_parent(parent_pid: int) -> None:
    """Exit this process as soon as the process ``parent_pid`` is gone.

    A process forked by the fork server has the fork server as its OS
    parent, and the fork server stays up as long as any child does (each
    holds its "alive" pipe), so neither notices a launcher that was
    SIGKILLed; ``PR_SET_PDEATHSIG`` would watch the wrong process. A pidfd on
    the launcher is exact (no pid reuse) and costs one idle daemon thread.
    Without pidfds (old kernels) this does nothing and the launcher's own
    cleanup is all there is.
    """
    import select
    import threading

    try:
        fd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        os._exit(3)  # the launcher is already gone
    except (AttributeError, OSError):
        return

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll()
        os._exit(3)

    threading.Thread(target=watch, name="ftdist-parent-watch", daemon=True).start()
