"""
The events files
================

Every trainer process of the demo (:mod:`ftdist.demo.worker`) and of the
chaos suite (:mod:`ftdist.chaos.worker`) appends JSON lines to an events
file of its own, one flushed line per event, and the supervisor in the
parent follows those files. This module is their format, defined once: one
frozen dataclass per kind of event, the writer (:class:`EventLog`), what a
line reads as (:func:`parse`) and the reader that follows a run's files
(:class:`EventReader`).

Each line is ``{"kind": ..., "t": <wall time>, <the event's fields>}``.
The kinds:

* ``up``: the process started (:class:`UpEvent`);
* ``take``: the samples it is about to train on at a step, written before
  its gradient can reach the step's allreduce (:class:`TakeEvent`, the
  demo's data ledger);
* ``step``: it finished a step, committed or not (:class:`StepEvent`);
* ``heal_start``: it starts receiving a heal (:class:`HealStartEvent`,
  chaos only);
* ``serve``: it starts serving its state to a healing peer
  (:class:`ServeEvent`, chaos only);
* ``heal``: the phases of one heal it received or served
  (:class:`HealEvent`);
* ``final``: it stopped at the run's stop step, with the hash of its state
  there (:class:`FinalEvent`).

Reading is lenient, as a supervisor of processes that die mid-write must
be: a line that is not a JSON object, or that lacks a field of its kind, is
skipped; fields nobody knows are ignored; a kind nobody knows reads as an
:class:`UnknownEvent` (it still shows that the process is alive).
"""

from __future__ import annotations

import glob
import json
import os
import re
import threading
import time
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import IO, Any, ClassVar, NamedTuple

# A field with this metadata is left out of the line while it is None (it
# belongs to one writer only: the demo's or the chaos suite's).
_OMIT_IF_NONE = {"omit_if_none": True}
_FILE = re.compile(r"replica(\d+)\.attempt(\d+)\.jsonl")


@dataclass(frozen=True, kw_only=True)
class _Event:
    """What every event has: its kind (per class) and its wall time ``t``."""

    kind: ClassVar[str]
    t: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        """The event as its JSON line holds it."""
        out: dict[str, Any] = {"kind": self.kind, "t": self.t}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "t" and not (value is None and f.metadata.get("omit_if_none")):
                out[f.name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class UpEvent(_Event):
    """The process is up (its Manager made), before its first step.

    Attributes:
        pid: its process id.
        attempt: its replica group's restart count (0 for the first process).
        replica_id: its Manager's replica id.
        group: its replica group (chaos).
        rank: its rank in the group (chaos).
        checkpoint: its checkpoint transport's address, which a healing peer
            names in ``heal_start`` (chaos).
    """

    kind: ClassVar[str] = "up"
    pid: int
    attempt: int
    replica_id: str
    group: int | None = field(default=None, metadata=_OMIT_IF_NONE)
    rank: int | None = field(default=None, metadata=_OMIT_IF_NONE)
    checkpoint: str | None = field(default=None, metadata=_OMIT_IF_NONE)


@dataclass(frozen=True, kw_only=True)
class StepEvent(_Event):
    """A step finished, committed or not.

    Attributes:
        step: the step (the Manager's step when it began).
        ok: whether it committed.
        loss: its training loss (DiLoCo: the mean over the sync's inner steps).
        quorum_id: the quorum it ran in.
        participants: replica groups that took part.
        participating: whether this one took part (False while it healed).
        error: the first line of the Manager's error, for a step not committed.
    """

    kind: ClassVar[str] = "step"
    step: int
    ok: bool
    loss: float
    quorum_id: int
    participants: int
    participating: bool
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class TakeEvent(_Event):
    """The samples a replica group reads at a step (the demo's data ledger).

    Written after the step's quorum is known and before the backward: a
    group whose gradient went into a committed step has written it, even
    when it was killed before its ``step`` line (:mod:`ftdist.demo.ledger`).

    Attributes:
        step: the Manager's step it reads for.
        quorum_id: the quorum of the step's round.
        epoch: the data epoch the step belongs to.
        participating: whether its gradient counts (False while it heals).
        ids: the dataset indices it reads, in order.
    """

    kind: ClassVar[str] = "take"
    step: int
    quorum_id: int
    epoch: int
    participating: bool
    ids: list[int]


@dataclass(frozen=True, kw_only=True)
class HealStartEvent(_Event):
    """A heal's transfer begins (logged by the chaos trainers' transport).

    Attributes:
        step: the step healed to.
        src_rank: the source's replica rank.
        source: the source's checkpoint address (its ``up`` event's ``checkpoint``).
    """

    kind: ClassVar[str] = "heal_start"
    step: int
    src_rank: int
    source: str


@dataclass(frozen=True, kw_only=True)
class ServeEvent(_Event):
    """This process starts serving its state to healing peers (chaos).

    Attributes:
        step: the step served.
        dst: the receivers' replica ranks.
    """

    kind: ClassVar[str] = "serve"
    step: int
    dst: list[int]


@dataclass(frozen=True, kw_only=True)
class HealEvent(_Event):
    """The phases of one heal (a :class:`~ftdist.manager.heal.HealTimeline`).

    Attributes:
        step: the step healed to.
        quorum_id: the quorum in which it happened.
        role: ``"receive"`` (this process healed) or ``"send"`` (it served).
        peers: the replica ranks on the other side.
        quorum_s: waiting for the quorum.
        reconfigure_s: rebuilding the process group.
        transfer_bytes: state bytes moved.
        transfer_s: time moving them.
        load_s: applying the received state.
        total_s: the sum of the phases.
        route: how the bytes travelled (``"tcp"``, ``"local"``, ``"direct"``, ``"process
            group"``; "" when not received, or in a log written before it was
            recorded).
        reserved_bytes: received bytes that landed in memory populated during
            the quorum wait (0 in a log written before it was recorded).
    """

    kind: ClassVar[str] = "heal"
    step: int
    quorum_id: int
    role: str
    peers: list[int]
    quorum_s: float
    reconfigure_s: float
    transfer_bytes: int
    transfer_s: float
    load_s: float
    total_s: float
    route: str = ""
    reserved_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class FinalEvent(_Event):
    """The process stopped at the stop step; the hash of its state there.

    Attributes:
        step: the step it stopped at.
        hash: SHA-256 of its state.
        what: what the hash covers (demo).
        eval_loss: held-out loss.
        accuracy: held-out accuracy.
    """

    kind: ClassVar[str] = "final"
    step: int
    hash: str
    what: str | None = field(default=None, metadata=_OMIT_IF_NONE)
    eval_loss: float
    accuracy: float


@dataclass(frozen=True)
class UnknownEvent:
    """A line of a kind this module does not know (skipped, but a sign of life)."""

    kind: str
    t: float


Event = (
    UpEvent
    | StepEvent
    | TakeEvent
    | HealStartEvent
    | ServeEvent
    | HealEvent
    | FinalEvent
    | UnknownEvent
)
KINDS: dict[str, type[_Event]] = {
    cls.kind: cls
    for cls in (UpEvent, StepEvent, TakeEvent, HealStartEvent, ServeEvent, HealEvent, FinalEvent)
}
_HINTS = {kind: typing.get_type_hints(cls) for kind, cls in KINDS.items()}


def _convert(hint: Any, value: Any) -> Any:
    """``value`` as the field's type: ``int``, ``float``, ``bool``, ``str``,
    ``list[int]``, or one of them or None.

    Raises:
        TypeError: ``value`` does not fit.
        ValueError: ``value`` does not fit.
    """
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise TypeError(f"{value!r} is not a list")
        (item,) = typing.get_args(hint)
        return [_convert(item, v) for v in value]
    return hint(value)


def parse(line: str) -> Event | None:
    """The event one line holds; None for a line that is not one (see the module docstring)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    try:
        t = float(obj.get("t", 0.0))
        kind = obj.get("kind")
        cls = KINDS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            return UnknownEvent(str(kind), t)
        hints = _HINTS[cls.kind]
        values = {
            f.name: _convert(hints[f.name], obj[f.name])
            for f in fields(cls)
            if f.name != "t" and (f.name in obj or f.default is MISSING)
        }
        return typing.cast(Event, cls(t=t, **values))
    except (KeyError, TypeError, ValueError):
        return None


def events_path(events_dir: str, process: int, attempt: int) -> str:
    """The events file of one process: ``process`` of the run, its ``attempt``.

    ``process`` is the demo's replica group, or the chaos suite's global rank.
    """
    return os.path.join(events_dir, f"replica{process}.attempt{attempt}.jsonl")


class EventLog:
    """Appends events to one events file, one flushed line each; threads may share it.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self._file: IO[str] = open(path, "a", buffering=1)
        self._lock = threading.Lock()

    def write(self, event: _Event) -> None:
        """Append ``event`` as one line.

        Raises:
            OSError: the events file cannot be written.
        """
        line = json.dumps(event.as_dict()) + "\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()


class EventLine(NamedTuple):
    """One event read, with the process that wrote it.

    ``process`` is the demo's replica group, or the chaos suite's global rank;
    ``attempt`` its restart count (0 for the first process).
    """

    process: int
    attempt: int
    event: Event


class EventReader:
    """Follows the events files of a run, yielding the events of complete new lines."""

    def __init__(self, events_dir: str) -> None:
        self._dir = events_dir
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, str] = {}

    def read(self) -> list[EventLine]:
        """The events written since the last read, in time order."""
        out: list[EventLine] = []
        for path in sorted(glob.glob(os.path.join(self._dir, "replica*.jsonl"))):
            name = _FILE.fullmatch(os.path.basename(path))
            if name is None:
                continue
            process, attempt = int(name.group(1)), int(name.group(2))
            with open(path, encoding="utf-8") as f:
                f.seek(self._offsets.get(path, 0))
                chunk = f.read()
                self._offsets[path] = f.tell()
            lines = (self._partial.pop(path, "") + chunk).split("\n")
            if lines[-1]:
                # A writer killed mid-line leaves a fragment; keep it until
                # (if ever) the line completes.
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                event = parse(line) if line.strip() else None
                if event is not None:
                    out.append(EventLine(process, attempt, event))
        out.sort(key=lambda item: item.event.t)
        return out


__all__ = [
    "KINDS",
    "Event",
    "EventLine",
    "EventLog",
    "EventReader",
    "FinalEvent",
    "HealEvent",
    "HealStartEvent",
    "ServeEvent",
    "StepEvent",
    "TakeEvent",
    "UnknownEvent",
    "UpEvent",
    "events_path",
    "parse",
]
