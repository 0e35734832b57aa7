"""
Request limits
==============

What a client may make a lighthouse hold: the size of each field of a quorum
request and how many reconfigure handles it carries. A request past a limit
is refused with ``INVALID_ARGUMENT`` naming the field, before anything is
recorded, so a client that misbehaves cannot grow the lighthouse's memory or
disturb the other clients (docs/security.md).
"""

from __future__ import annotations

from ftdist._rpc._proto import torchft_pb2

__all__ = ["MAX_FIELD_BYTES", "MAX_HANDLES", "MAX_HANDLES_BYTES", "check_member", "too_long"]

MAX_FIELD_BYTES = 4096
"""Largest replica id, address or store address, in UTF-8 bytes."""
MAX_HANDLES_BYTES = 1024 * 1024
"""Largest total size of a request's reconfigure handles."""
MAX_HANDLES = 65536
"""Most reconfigure handles in one request (one per group rank)."""


def too_long(text: str, limit: int) -> int:
    """The UTF-8 size of ``text`` if it exceeds ``limit`` bytes, else 0."""
    # A character is at most 4 bytes; skip encoding when it cannot matter.
    if len(text) * 4 <= limit:
        return 0
    size = len(text.encode())
    return size if size > limit else 0


def check_member(member: torchft_pb2.QuorumMember, max_data_bytes: int) -> str | None:
    """What is wrong with a quorum requester, or None.

    Args:
        member: the requester as decoded.
        max_data_bytes: the largest ``data`` accepted.

    Returns:
        The first problem found, naming the field and the limit; None if none.
    """
    if not member.replica_id:
        return "requester.replica_id must not be empty"
    for name, value in (
        ("replica_id", member.replica_id),
        ("address", member.address),
        ("store_address", member.store_address),
    ):
        size = too_long(value, MAX_FIELD_BYTES)
        if size:
            return f"requester.{name} is {size} bytes; the limit is {MAX_FIELD_BYTES}"
    if member.step < 0:
        return f"requester.step must not be negative (got {member.step})"
    if member.commit_failures < 0:
        return f"requester.commit_failures must not be negative (got {member.commit_failures})"
    size = too_long(member.data, max_data_bytes)
    if size:
        return f"requester.data is {size} bytes; the limit is {max_data_bytes}"
    if len(member.reconfigure_handles) > MAX_HANDLES:
        return (
            f"requester.reconfigure_handles has {len(member.reconfigure_handles)} entries; "
            f"the limit is {MAX_HANDLES}"
        )
    if member.reconfigure_handles:
        size = too_long("".join(member.reconfigure_handles), MAX_HANDLES_BYTES)
        if size:
            return (
                f"requester.reconfigure_handles is {size} bytes; the limit is {MAX_HANDLES_BYTES}"
            )
    return None
