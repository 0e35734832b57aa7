"""Finding processes through /proc, for the tests' leak checks and cleanup (Linux)."""

from __future__ import annotations

import os


def _stat_fields(pid: str) -> list[str]:
    # The command name (2nd field) may hold spaces and parentheses; what
    # follows its last ")" splits cleanly: state, ppid, ...
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def children(of: int | None = None) -> dict[int, str]:
    """The children of process ``of`` (default: this one): pid to state letter ("Z": zombie)."""
    parent = str(os.getpid() if of is None else of)
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat_fields(entry)
        except OSError:
            continue  # gone
        if fields[1] == parent:
            found[int(entry)] = fields[0]
    return found


def processes_with(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment holds the entry ``marker`` ("KEY=value")."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            if _stat_fields(entry)[0] == "Z":
                continue
        except OSError:
            continue  # gone, or not ours
        found.append(int(entry))
    return found
