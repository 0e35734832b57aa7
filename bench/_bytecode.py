"""Byte-compile ftdist before a benchmark times fresh processes.

pip compiles an installed wheel's modules at install time, so torchft's
processes load bytecode. An editable ftdist has no bytecode until a process
writes it, and where ``PYTHONDONTWRITEBYTECODE`` is set (as on this project's
machines) none ever does: every fresh process compiled ftdist's modules from
source again, 100-130 ms that a user's installed ftdist never pays, inside
the very windows (a replacement's start, its ``Manager()``) compared with
torchft's. Compiling first makes the comparison like for like.
"""

from __future__ import annotations

import compileall
import os

import ftdist


def compile_ftdist() -> None:
    """Write bytecode for ftdist's sources (only what is missing or stale)."""
    compileall.compile_dir(os.path.dirname(ftdist.__file__), quiet=1)
