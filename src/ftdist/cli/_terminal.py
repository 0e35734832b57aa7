"""Text from the network, made safe to print in a terminal."""

from __future__ import annotations

__all__ = ["clean"]


def clean(value: object) -> str:
    """``value`` as text safe for a terminal.

    Replica ids and addresses come from any client of the lighthouse; control
    characters in them must not move the cursor or recolour the screen.
    """
    text = "" if value is None else str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
