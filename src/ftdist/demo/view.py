"""
The demo's terminal view
========================

On a terminal, :class:`LiveView` redraws a block in place about four times a
second: a progress bar, one table row per replica group (step, state, quorum
id, participants, loss, failures injected, heals done) and the latest
events. When stdout is not a terminal (CI, a pipe, a log file) it prints
each event as a plain line and a one-line status every few seconds instead,
so the output stays readable there.
"""

from __future__ import annotations

import collections
import re
import shutil
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ftdist.demo.supervisor import Supervisor

BAR_WIDTH = 32
RECENT_EVENTS = 7
PLAIN_STATUS_EVERY_S = 5.0

_COLORS = {
    "training": "32",
    "finished": "32",
    "healing": "33",
    "starting": "33",
    "killed": "31",
    "stopped": "31",
    "exited": "31",
}


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def clip(line: str, width: int) -> str:
    """``line`` cut to ``width`` visible characters (color codes do not count)."""
    if len(_ANSI.sub("", line)) <= width:
        return line
    return _ANSI.sub("", line)[: width - 1] + "~"


def progress_bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A text progress bar, ``fraction`` clamped to [0, 1]."""
    fraction = min(1.0, max(0.0, fraction))
    full = int(fraction * width)
    return "[" + "#" * full + "-" * (width - full) + f"] {fraction * 100:3.0f}%"


def table_rows(sup: Supervisor, color: bool = False) -> list[str]:
    """The replica table: a header and one row per replica group."""
    n = len(sup.replicas)
    rows = [
        f"{'replica':<9} {'pid':>7} {'state':<9} {'step':>6} {'quorum':>6} "
        f"{'particip.':>9} {'loss':>7} {'failures':>8} {'heals':>5}"
    ]
    for rs in sup.replicas:
        state = f"{rs.state:<9}"
        if color and rs.state in _COLORS:
            state = f"\x1b[{_COLORS[rs.state]}m{state}\x1b[0m"
        loss = f"{rs.loss:7.3f}" if rs.loss is not None else f"{'-':>7}"
        quorum = str(rs.quorum_id) if rs.quorum_id >= 0 else "-"
        rows.append(
            f"{'replica' + str(rs.replica):<9} {rs.pid or '-':>7} {state} {rs.step:>6} "
            f"{quorum:>6} {f'{rs.participants}/{n}':>9} {loss} {rs.failures:>8} "
            f"{rs.heals:>5}"
        )
    return rows


def _progress(sup: Supervisor) -> float:
    if sup.duration_s:
        return sup.train_elapsed() / sup.duration_s
    stop = sup.record.stop_step
    return sup.max_step() / stop if stop else 0.0


class LiveView:
    """Renders a run's progress to ``stream``; see the module docstring.

    Args:
        stream: where to write (usually ``sys.stdout``).
        interactive: redraw in place (a terminal) instead of plain lines.
    """

    def __init__(self, stream: TextIO, interactive: bool) -> None:
        self._out = stream
        self._interactive = interactive
        self._recent: collections.deque[str] = collections.deque(maxlen=RECENT_EVENTS)
        self._drawn = 0
        self._last_plain = 0.0

    def message(self, text: str) -> None:
        """Print a line above the live block (or plainly)."""
        self._clear()
        self._out.write(text + "\n")
        self._out.flush()

    def event(self, line: str) -> None:
        """Record an event line: kept in the block's recent list, or printed."""
        if self._interactive:
            self._recent.append(line)
        else:
            self._out.write(line + "\n")
            self._out.flush()

    def tick(self, sup: Supervisor) -> None:
        """Redraw the block (terminal) or print a periodic status line."""
        if not self._interactive:
            now = time.monotonic()
            if now - self._last_plain >= PLAIN_STATUS_EVERY_S or sup.phase == "done":
                self._last_plain = now
                parts = ", ".join(
                    f"replica{rs.replica} {rs.state} step {rs.step}" for rs in sup.replicas
                )
                self._out.write(
                    f"[{sup.elapsed():6.1f}s] {sup.record.name} "
                    f"{progress_bar(_progress(sup), 20)}: {parts}\n"
                )
                self._out.flush()
            return
        quorum = max((rs.quorum_id for rs in sup.replicas), default=-1)
        lines = [
            f"{sup.record.name} run  {progress_bar(_progress(sup))}  {sup.train_elapsed():5.1f} s  "
            f"step {max(sup.max_step(), 0)}  quorum {quorum if quorum >= 0 else '-'}  "
            f"({sup.phase})",
            *table_rows(sup, color=True),
            "",
            *(self._recent or ["(no events yet)"]),
        ]
        # A line wider than the terminal wraps onto two rows, and the
        # cursor-up count of the next redraw would fall short of the block.
        width = max(20, shutil.get_terminal_size().columns - 1)
        lines = [clip(line, width) for line in lines]
        self._clear()
        self._out.write("\n".join(lines) + "\n")
        self._out.flush()
        self._drawn = len(lines)

    def close(self) -> None:
        """Leave the last block on screen and start printing below it."""
        self._drawn = 0
        self._recent.clear()

    def _clear(self) -> None:
        if self._interactive and self._drawn:
            # Cursor up to the block's first line, then clear to the end.
            self._out.write(f"\x1b[{self._drawn}F\x1b[J")
            self._drawn = 0
