"""Tree barrier messages (``Kind.BARRIER``), after RHiNET's binary-tree barrier.

Theory of operation
-------------------
Every participant builds the same tree from the same member list
(``barrier_init`` is local and sends nothing).  A node that has heard
``ARRIVE`` from all its children, and has itself arrived, sends ``ARRIVE`` to
its parent; when the root completes, ``RELEASE`` flows from the root down to
the leaves.  ``generation`` numbers the group's successive barriers, so an ARRIVE of the
next barrier that overtakes a RELEASE is not mistaken for this one's, and
duplicates are recognised.

One 16-byte layout::

    type u8 | reserved u8 (0) | reserved u16 (0) | barrier id u32 |
    generation u32 | rank u32 (the sender's rank in the member list)
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import construct as c

from .errors import WireError
from .fixed import pack_checked, unpack_typed_untrusted


class BarrierType(enum.IntEnum):
    ARRIVE = 1  #: child -> parent: my whole subtree has arrived
    RELEASE = 2  #: parent -> child: everyone has arrived, go on


class BarrierMessage(NamedTuple):
    btype: int
    barrier_id: int
    generation: int
    rank: int


_TYPES = frozenset(BarrierType)

BARRIER_MESSAGE = c.Struct(
    "type" / c.Int8ub,
    c.Check(lambda ctx: ctx.type in _TYPES),
    "reserved" / c.Const(0, c.Int8ub),
    "reserved2" / c.Const(0, c.Int16ub),
    "barrier_id" / c.Int32ub,
    "generation" / c.Int32ub,
    "rank" / c.Int32ub,
    c.Terminated,
)

_LAYOUT = struct.Struct("!BBHIII")
BARRIER_LEN = _LAYOUT.size  # 16


def encode(m: BarrierMessage) -> bytes:
    """Return the 16-byte wire form of ``m``.

    Raises:
        ValueError: unknown type or a field out of range.
    """
    if m.btype not in _TYPES:
        raise ValueError(f"bad barrier message {m!r}")
    return pack_checked(_LAYOUT, m.btype, 0, 0, m.barrier_id, m.generation, m.rank)


def decode_untrusted(body: bytes | bytearray | memoryview) -> BarrierMessage:
    """Parse a barrier message from the network.

    Raises:
        WireError: ``bad_length``, ``bad_type`` or ``bad_reserved``; nothing else.
    """
    btype, r8, r16, barrier_id, generation, rank = unpack_typed_untrusted(body, _LAYOUT, _TYPES, "barrier message")
    if r8 or r16:
        raise WireError("bad_reserved", "barrier message")
    return BarrierMessage(btype, barrier_id, generation, rank)
