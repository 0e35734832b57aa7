"""
The reconfigurable process group base
=====================================

:class:`ProcessGroup` subclasses ``torch.distributed.ProcessGroup``, so it goes
wherever a standard group goes: ``dist.all_reduce(t, group=pg)``, DDP comm
hooks, functional collectives once :meth:`ProcessGroup.register` is called.
torch's pybind trampoline routes C++ callers to the Python overrides below.

Every collective is normalised here (a tensor or a list, an options object or
a bare ``ReduceOp``/root) and handed to one hook, ``_collective(op, args,
post)``, that a backend kind implements: in-process (:mod:`.wrapper`) or in a
child process (:mod:`.baby`). ``ReduceOp.AVG`` is emulated here, as a SUM and a
division on completion, for backends that lack it (Gloo).

Ranks: an ftdist group is its own rank space. Its ranks are registered with
``torch.distributed`` as their own "global" ranks, so ``src=``/``dst=``
arguments of ``dist.broadcast``/``dist.send``/... mean ranks in this group.
Use ``pg.rank()`` rather than ``dist.get_rank(pg)``, which needs a default group.
"""

# torch's stubs type each collective as its pybind overloads, with pybind's
# parameter names; ftdist's overrides take torch's C++ calling convention (plus
# a bare tensor, ReduceOp or root) in one signature. Where a stub cannot match,
# the line has a `type: ignore` and the reason above it.

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as BaseProcessGroup

from ftdist._advertise import advertised_host
from ftdist.process_group import registry
from ftdist.process_group._store import host_store, parse_store_addr
from ftdist.process_group.reconfigure import (
    DEFAULT_RECONFIGURE_TIMEOUT,
    make_handle,
    rendezvous,
)
from ftdist.process_group.registry import _OwnRanks
from ftdist.process_group.work import CompletedWork

if TYPE_CHECKING:  # recent torch's NewType of str; older torch has none: annotations, casts
    from torch.distributed.distributed_c10d import GroupName

Post = Callable[[], None] | None

_AVG = dist.ReduceOp.AVG
_SUM = dist.ReduceOp.SUM

# Collectives whose backend name differs from the name torch >= 2.8 calls.
# Both spellings are methods of ProcessGroup; the backend is called by the
# right-hand name, which Gloo and NCCL backends expose in every torch >= 2.7.
BACKEND_NAME = {
    "all_gather_single": "_allgather_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "all_to_all_single": "alltoall_base",
}


def _as_list(tensors: torch.Tensor | Sequence[torch.Tensor], op: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    if isinstance(tensors, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in tensors):
        return list(tensors)
    raise TypeError(f"{op} expects a tensor or a list of tensors, got {type(tensors).__name__}")


def _reduce_op(op: Any) -> Any:
    """The ``RedOpType`` of a ``ReduceOp`` or ``RedOpType``."""
    return op.op if hasattr(op, "op") and not isinstance(op, int) else op


def _check_avg_dtypes(tensors: Sequence[torch.Tensor], op: str) -> None:
    for t in tensors:
        if not (t.is_floating_point() or t.is_complex()):
            raise ValueError(
                f"{op} with ReduceOp.AVG needs floating-point tensors, got dtype {t.dtype}; "
                "use ReduceOp.SUM and divide, or cast to a float dtype"
            )


def _pairs(outputs: Any, inputs: Any, op: str) -> list[tuple[Any, Any]]:
    outputs, inputs = list(outputs), list(inputs)
    if len(outputs) != len(inputs):
        raise ValueError(
            f"{op} needs one output tensor per input tensor, got {len(outputs)} outputs "
            f"for {len(inputs)} inputs"
        )
    return list(zip(outputs, inputs, strict=True))


def validate_topology(rank: Any, world_size: Any) -> None:
    """Check a (rank, world_size) pair for ``configure``.

    Raises:
        TypeError: either is not an int.
        ValueError: ``world_size < 1`` or ``rank`` outside ``[0, world_size)``.
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


class ProcessGroup(BaseProcessGroup):
    """A process group that can be reconfigured and resized at runtime.

    Subclasses implement :meth:`configure`, :meth:`getBackendName` and the
    ``_collective`` hook. Until the first :meth:`configure`, :meth:`size` is 0
    and every collective raises ``RuntimeError``.

    As the size can change at runtime, callers must not cache ``rank()`` or
    ``size()`` across a reconfigure.

    Every collective method returns a ``torch.distributed.Work``.

    Raises:
        RuntimeError: a collective before the first :meth:`configure` (or
            after :meth:`abort`), or one the backend does not support.
        TypeError: tensors or ranks of the wrong type, before communicating.
        ValueError: a peer rank outside the group, or ``ReduceOp.AVG`` of
            integer tensors, before communicating.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            super().__init__(*args, **kwargs)
        else:
            # pybind's (rank, size) constructor, which torch's stub leaves out.
            super().__init__(0, 1)  # type: ignore[call-arg]
        self._rank = 0
        self._world_size = 0
        self._group_name: str | None = None
        self._registered_as: tuple[str, bool] | None = None
        self._config_lock = threading.RLock()
        # torchft's reconfiguration API (see .reconfigure)
        self._reconfigure_id = uuid.uuid4().hex
        self._rendezvous_store: dist.TCPStore | None = None
        self._rendezvous_host = ""
        self._replica_id: str | None = None
        self._group_rank: int | None = None
        self._group_world_size: int | None = None
        self._global_rank: int | None = None
        # Make src=/dst= arguments of torch.distributed mean ranks in this
        # group (see the module docstring).
        from torch.distributed.distributed_c10d import _world

        _world.pg_group_ranks[self] = _OwnRanks(self)

    # -- topology --------------------------------------------------------------
    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Rebuild the group on a new store, rank and world size.

        Every call must use a unique prefixed store address, e.g.
        ``localhost:1234/my/prefix/1``. Blocks until the new backend is ready;
        work in flight on the previous backend fails with
        :class:`~ftdist.ProcessGroupAbortedError`.

        Raises:
            ValueError: malformed ``store_addr`` or an invalid rank/world size
                (before any connection).
            RuntimeError: the backend could not be created (peers missing
                within the timeout, store unreachable).
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement configure()")

    def _check_configure_args(self, store_addr: str, rank: int, world_size: int) -> None:
        parse_store_addr(store_addr)
        validate_topology(rank, world_size)

    def _set_topology(self, rank: int, world_size: int) -> None:
        self._rank = rank
        self._world_size = world_size

    def rank(self) -> int:
        """This process's rank in the group (0 before configure)."""
        return self._rank

    def size(self) -> int:
        """The group's world size (0 before configure)."""
        return self._world_size

    def getRank(self) -> int:
        """Same as :meth:`rank`, for C++ callers."""
        return self.rank()

    def getSize(self) -> int:
        """Same as :meth:`size`, for C++ callers."""
        return self.size()

    def getBackendName(self) -> str:
        """The backend's name, e.g. ``"torchft-gloo"``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement getBackendName()")

    def name(self) -> str:
        """Same as :meth:`getBackendName`."""
        return self.getBackendName()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- torchft's reconfiguration API (see .reconfigure) ----------------------------
    @property
    def supports_reconfigure(self) -> bool:
        """True: every ftdist group can be reconfigured (torchft's Manager checks this)."""
        return True

    def set_rank_info(
        self,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        global_rank: int | None = None,
    ) -> None:
        """Record who this process is; the global rank goes into the reconfigure handle.

        Args:
            replica_id: the replica group's id.
            group_rank: this rank inside its replica group.
            group_world_size: ranks per replica group.
            global_rank: this process's rank in the whole job, if known.
        """
        self._replica_id = replica_id
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._global_rank = global_rank

    def _handle_id(self) -> str:
        return self._reconfigure_id

    def get_reconfigure_handle(self) -> str:
        """This group's handle: JSON of its id, a store it hosts (started now), its global rank.

        Returns:
            The handle.
        """
        with self._config_lock:
            if self._rendezvous_store is None:
                # The handle advertises this host (FTDIST_ADVERTISE_*); the store
                # listens where its peers reach it (FTDIST_STORE_BIND first).
                self._rendezvous_host = host = advertised_host()
                self._rendezvous_store = host_store(host, DEFAULT_RECONFIGURE_TIMEOUT)
            host, port = self._rendezvous_host, self._rendezvous_store.port
        return make_handle(self._handle_id(), host, port, self._global_rank)

    def reconfigure(self, opts: Any) -> dist.Work:
        """Rebuild the group from ordered handles; see :mod:`.reconfigure`. Blocks.

        Args:
            opts: a :class:`~ftdist.process_group.ReconfigureOptions`.

        Returns:
            A completed Work.

        Raises:
            ValueError: ``opts.handles`` is not a list of handles that
                includes this group's own.
            RuntimeError: the backend could not be created (see :meth:`configure`).
        """
        meeting = rendezvous(opts, self._handle_id())
        self.configure(meeting.store_addr, meeting.rank, meeting.world_size)
        return CompletedWork(None)

    # -- naming and registration ---------------------------------------------------
    @property
    def group_name(self) -> GroupName:
        """The group's name in torch's registry.

        Raises:
            ValueError: the group was never registered or named.
        """
        if self._group_name is None:
            raise ValueError("ProcessGroup name not set; call register(name) first")
        return cast("GroupName", self._group_name)

    def getGroupName(self) -> str:
        """Same as :attr:`group_name`, for C++ callers."""
        return self.group_name

    def setGroupName(self, name: str) -> None:
        """Set the group name (C++ callers)."""
        self._group_name = name

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def register(self, name: str) -> ProcessGroup:
        """Register the group so functional collectives (and compiled code) can use it.

        With a default process group, the group goes through
        ``torch.distributed.new_group`` as torchft's does, so torch names it
        after its group counter (``group_name == str(dist.get_pg_count() - 1)``
        right after this call; ``f"{getBackendName()}:{name}"`` is its
        description). Without one (ftdist needs none),
        ``f"{getBackendName()}:{name}"`` is its :attr:`group_name`.
        Reconfiguring a registered group keeps it registered.

        Returns:
            self.

        Raises:
            ValueError: ``name`` is empty, or this group is already registered.
            RuntimeError: another group is registered under the same name.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"register() needs a non-empty name, got {name!r}")
        if self._registered_as is not None:
            raise ValueError(
                f"this group is already registered as {self._registered_as[0]!r}; "
                "call unregister() first"
            )
        self._registered_as = registry.register(self, name)
        # new_group maps torch's global ranks onto this group; keep its own.
        self._own_ranks()
        return self

    def unregister(self) -> None:
        """Undo :meth:`register`; the group keeps working as an unregistered group.

        Raises:
            ValueError: the group is not registered.
        """
        if self._registered_as is None:
            raise ValueError("unregister() called on a group that is not registered")
        (backend_name, through_world), self._registered_as = self._registered_as, None
        name, self._group_name = self._group_name, None
        registry.unregister(self, backend_name, through_world, name or backend_name)
        self._own_ranks()

    def _own_ranks(self) -> None:
        from torch.distributed.distributed_c10d import _world

        _world.pg_group_ranks[self] = _OwnRanks(self)

    # -- lifecycle hooks -------------------------------------------------------------
    def abort(self) -> None:
        """Fail all in-flight work at once and drop the backend.

        The group can be configured again afterwards.
        """

    def shutdown(self) -> None:
        """Release the backend, the rendezvous store and torch's bookkeeping for this group."""
        from torch.distributed.distributed_c10d import _world

        _world.pg_group_ranks.pop(self, None)
        self._rendezvous_store = None

    def errored(self) -> Exception | None:
        """The error that made this group unusable until the next configure, if any."""
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        """Set the collective timeout used from the next configure on."""
        raise NotImplementedError(f"{type(self).__name__} does not support set_timeout()")

    # -- the hook ----------------------------------------------------------------------
    def _collective(self, op: str, args: tuple[Any, ...], post: Post = None) -> dist.Work:
        raise NotImplementedError(f"{type(self).__name__} does not implement {op}")

    def _avg(
        self, opts: Any, outputs: Sequence[torch.Tensor], op: str, only_rank: int | None = None
    ) -> tuple[Any, Post]:
        """Turn an AVG into SUM + division when the backend lacks AVG."""
        if self._native_avg() or _reduce_op(opts.reduceOp) != _AVG:
            return opts, None
        _check_avg_dtypes(outputs, op)
        opts.reduceOp = _SUM
        divisor = self.size()
        if only_rank is not None and only_rank != self.rank():
            return opts, None
        targets = list(outputs)

        def divide() -> None:
            for t in targets:
                t.div_(divisor)

        return opts, divide

    def _native_avg(self) -> bool:
        return False

    # -- collectives ---------------------------------------------------------------------
    # The stub's (tensor(s), op, timeout) overload: ftdist takes no timeout.
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """All-reduce ``tensors`` in place (``opts``: AllreduceOptions or a ReduceOp)."""
        tensors = _as_list(tensors, "allreduce")
        if not isinstance(opts, c10d.AllreduceOptions):
            o = c10d.AllreduceOptions()
            o.reduceOp = c10d.ReduceOp(_SUM) if opts is None else opts
            opts = o
        opts, post = self._avg(opts, tensors, "allreduce")
        return self._collective("allreduce", (tensors, opts), post)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        """All-reduce several tensors as one operation."""
        tensors = _as_list(tensors, "allreduce_coalesced")
        if opts is None:
            opts = c10d.AllreduceCoalescedOptions()
        opts, post = self._avg(opts, tensors, "allreduce_coalesced")
        return self._collective("allreduce_coalesced", (tensors, opts), post)

    # The stub's (tensor, root, timeout) overload: ftdist takes no timeout.
    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Broadcast from ``opts.rootRank`` (or an int root) into ``tensors``."""
        tensors = _as_list(tensors, "broadcast")
        if not isinstance(opts, c10d.BroadcastOptions):
            o = c10d.BroadcastOptions()
            o.rootRank = 0 if opts is None else int(opts)
            opts = o
        self._check_peer(opts.rootRank, "broadcast root")
        return self._collective("broadcast", (tensors, opts))

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Broadcast one tensor from ``root``."""
        return self.broadcast([tensor], root)

    # The stub's (tensor, root, op, timeout) overload: ftdist takes opts or a root.
    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Reduce ``tensors`` onto ``opts.rootRank``."""
        tensors = _as_list(tensors, "reduce")
        if not isinstance(opts, c10d.ReduceOptions):
            o = c10d.ReduceOptions()
            o.rootRank = 0 if opts is None else int(opts)
            opts = o
        self._check_peer(opts.rootRank, "reduce root")
        opts, post = self._avg(opts, tensors, "reduce", only_rank=opts.rootRank)
        return self._collective("reduce", (tensors, opts), post)

    def allgather(self, output_tensors: Any, input_tensor: Any, opts: Any = None) -> dist.Work:
        """Gather every rank's input into ``output_tensors``.

        Accepts torch's ``(list[list[Tensor]], list[Tensor])`` form and the
        single-tensor ``(list[Tensor], Tensor)`` form.
        """
        if isinstance(input_tensor, torch.Tensor):
            output_tensors, input_tensor = [list(output_tensors)], [input_tensor]
        if opts is None:
            opts = c10d.AllgatherOptions()
        return self._collective("allgather", (output_tensors, input_tensor, opts))

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        """All-gather into one flat output tensor (``all_gather_into_tensor``)."""
        return self._collective(
            "all_gather_single", (output, input, opts or c10d.AllgatherOptions())
        )

    _allgather_base = all_gather_single

    def allgather_coalesced(
        self, output_lists: Any, input_list: Any, opts: Any = None
    ) -> dist.Work:
        """Coalesced list all-gather."""
        return self._collective(
            "allgather_coalesced", (output_lists, input_list, opts or c10d.AllgatherOptions())
        )

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> dist.Work:
        """Several ``all_gather_into_tensor`` calls as one operation."""
        opts = opts or c10d.AllgatherOptions()
        return self._collective_many(
            "all_gather_single",
            [(o, i, opts) for o, i in _pairs(outputs, inputs, "allgather_into_tensor_coalesced")],
        )

    # The stub's parameter names are output_lists/input_list; C++ passes them by position.
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    # The stub's (outputs, input, root, timeout) overload: ftdist takes opts only.
    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Gather onto ``opts.rootRank``."""
        opts = opts or c10d.GatherOptions()
        self._check_peer(opts.rootRank, "gather root")
        return self._collective("gather", (output_tensors, input_tensors, opts))

    # The stub's (output, inputs, root, timeout) overload: ftdist takes opts only.
    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Scatter from ``opts.rootRank``."""
        opts = opts or c10d.ScatterOptions()
        self._check_peer(opts.rootRank, "scatter root")
        return self._collective("scatter", (output_tensors, input_tensors, opts))

    # The stub's (output, inputs, op, timeout) overload: ftdist takes opts only.
    def reduce_scatter(  # type: ignore[override]
        self, output_tensors: Any, input_tensors: Any, opts: Any = None
    ) -> dist.Work:
        """Reduce, then scatter a list of inputs."""
        opts = opts or c10d.ReduceScatterOptions()
        opts, post = self._avg(opts, _as_list(output_tensors, "reduce_scatter"), "reduce_scatter")
        return self._collective("reduce_scatter", (output_tensors, input_tensors, opts), post)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        """Reduce-scatter one flat input (``reduce_scatter_tensor``)."""
        opts = opts or c10d.ReduceScatterOptions()
        opts, post = self._avg(opts, [output], "reduce_scatter_tensor")
        return self._collective("reduce_scatter_single", (output, input, opts), post)

    # The stub's parameter names are outputTensor/inputTensor; C++ passes them by position.
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: Any, inputs: Any, opts: Any = None
    ) -> dist.Work:
        """Several ``reduce_scatter_tensor`` calls as one operation."""
        opts = opts or c10d.ReduceScatterOptions()
        opts, post = self._avg(opts, list(outputs), "reduce_scatter_tensor")
        return self._collective_many(
            "reduce_scatter_single",
            [(o, i, opts) for o, i in _pairs(outputs, inputs, "reduce_scatter_tensor_coalesced")],
            post,
        )

    # The stub's parameter names are outputTensors/inputTensors; C++ passes them by position.
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        """``all_to_all_single`` with optional split sizes."""
        return self._collective(
            "all_to_all_single",
            (
                output,
                input,
                list(output_split_sizes),
                list(input_split_sizes),
                opts or c10d.AllToAllOptions(),
            ),
        )

    # The stub's names are output_tensor/input_tensor or output/input; C++ passes by position.
    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:
        """List all-to-all."""
        return self._collective(
            "alltoall", (output_tensors, input_tensors, opts or c10d.AllToAllOptions())
        )

    def send(self, tensors: Any, dst_rank: int, tag: int = 0) -> dist.Work:
        """Send ``tensors`` to ``dst_rank``."""
        self._check_peer(dst_rank, "send destination")
        return self._collective("send", (_as_list(tensors, "send"), dst_rank, tag))

    def recv(self, tensors: Any, src_rank: int, tag: int = 0) -> dist.Work:
        """Receive into ``tensors`` from ``src_rank``."""
        self._check_peer(src_rank, "recv source")
        return self._collective("recv", (_as_list(tensors, "recv"), src_rank, tag))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> dist.Work:
        """Receive into ``tensors`` from whichever rank sends first."""
        return self._collective("recv_anysource", (_as_list(tensors, "recv"), tag))

    def barrier(self, opts: Any = None) -> dist.Work:
        """Block until every rank arrives."""
        return self._collective("barrier", (opts or c10d.BarrierOptions(),))

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier that names the ranks that did not arrive (Gloo only)."""
        self._collective("monitored_barrier", (timeout or timedelta(seconds=60), wait_all_ranks))

    def _collective_many(
        self, op: str, calls: list[tuple[Any, ...]], post: Post = None
    ) -> dist.Work:
        """Run one op per argument tuple and return a Work for all of them."""
        raise NotImplementedError(f"{type(self).__name__} does not implement coalesced {op}")

    def _check_peer(self, peer: Any, what: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise TypeError(f"{what} must be an int rank, got {peer!r}")
        size = self._world_size
        if size and not 0 <= peer < size:
            raise ValueError(f"{what} {peer} is not a rank of this group of size {size}")


__all__ = ["BACKEND_NAME", "ProcessGroup", "validate_topology"]
