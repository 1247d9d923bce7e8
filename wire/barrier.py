"""Barrier messages (``Kind.BARRIER``), after RHiNET's binary-tree barrier.

Theory of operation
-------------------
Every member builds the same structure from the same member list
(``barrier_init`` was local and sent nothing; so is joining here).  The
structure is over *daemons*, not ranks: the ranks one daemon serves are
combined there first, so each edge carries one message per barrier.  A
daemon that has heard ``ARRIVE`` from all its children, and whose own ranks
have all arrived, sends ``ARRIVE`` to its parent; when the root completes,
``RELEASE`` flows from the root down to the leaves (``Algorithm.TREE``,
``arity`` children per node).  ``CENTRAL`` is the one-level tree (every
daemon's ARRIVE to the root, the root's RELEASE to every daemon).
``DISSEMINATION`` has no release: in round ``r`` daemon ``i`` sends ARRIVE
to daemon ``i + 2**r`` and waits for the one from ``i - 2**r`` (mod the
number of daemons); after ⌈log2 m⌉ rounds everyone has arrived.

``generation`` numbers the group's successive barriers (1, 2, …), so an
ARRIVE of the next barrier that overtakes a RELEASE is not mistaken for this
one's.  ``sender`` is the sending daemon's index in the group (daemons
numbered in the order they first appear in the member list).  Every member
must call each barrier with the same algorithm and arity; both travel in
every message so a disagreement is detected, not hung on: the daemon that
sees it sends ABORT to every other, and the barrier fails everywhere.  One 16-byte layout::

    type u8 | algorithm u8 | arity u8 | round u8 | group u32 |
    generation u32 | sender u32
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import construct as c

from .errors import WireError
from .fixed import pack_checked, unpack_typed_untrusted


class BarrierType(enum.IntEnum):
    ARRIVE = 1  #: child -> parent (tree), daemon -> root (central), round partner (dissemination)
    RELEASE = 2  #: parent -> child: everyone has arrived, go on
    ABORT = 3  #: to every daemon: members disagree on this barrier (the sender's algorithm and arity)


class Algorithm(enum.IntEnum):
    TREE = 1
    DISSEMINATION = 2
    CENTRAL = 3


#: the largest arity of a tree barrier, and the most rounds a dissemination
#: barrier can have (2**32 daemons would need 32)
MAX_ARITY = 255
MAX_ROUND = 31


class BarrierMessage(NamedTuple):
    btype: int
    algorithm: int
    arity: int
    round: int
    group: int
    generation: int
    sender: int


_TYPES = frozenset(BarrierType)
_ALGORITHMS = frozenset(Algorithm)

BARRIER_MESSAGE = c.Struct(
    "type" / c.Int8ub,
    c.Check(lambda ctx: ctx.type in _TYPES),
    "algorithm" / c.Int8ub,
    c.Check(lambda ctx: ctx.algorithm in _ALGORITHMS),
    "arity" / c.Int8ub,
    "round" / c.Int8ub,
    c.Check(lambda ctx: _fields_ok(ctx.type, ctx.algorithm, ctx.arity, ctx.round)),
    "group" / c.Int32ub,
    "generation" / c.Int32ub,
    "sender" / c.Int32ub,
    c.Terminated,
)

_LAYOUT = struct.Struct("!BBBBIII")
BARRIER_LEN = _LAYOUT.size  # 16


def _fields_ok(btype: int, algorithm: int, arity: int, rnd: int) -> bool:
    if algorithm == Algorithm.TREE:
        return 2 <= arity <= MAX_ARITY and rnd == 0
    if algorithm == Algorithm.DISSEMINATION:
        return arity == 0 and (rnd <= MAX_ROUND if btype == BarrierType.ARRIVE else btype == BarrierType.ABORT and rnd == 0)
    return arity == 0 and rnd == 0


def encode(m: BarrierMessage) -> bytes:
    """Return the 16-byte wire form of ``m``.

    Raises:
        ValueError: unknown type or algorithm, an arity or round the
            algorithm does not have, or a field out of range.
    """
    if m.btype not in _TYPES or m.algorithm not in _ALGORITHMS or not _fields_ok(m.btype, m.algorithm, m.arity, m.round):
        raise ValueError(f"bad barrier message {m!r}")
    return pack_checked(_LAYOUT, m.btype, m.algorithm, m.arity, m.round, m.group, m.generation, m.sender)


def decode_untrusted(body: bytes | bytearray | memoryview) -> BarrierMessage:
    """Parse a barrier message from the network.

    Raises:
        WireError: ``bad_length``, ``bad_type`` or ``bad_reserved`` (an
            unknown algorithm, or an arity or round it does not have); nothing else.
    """
    btype, algorithm, arity, rnd, group, generation, sender = \
        unpack_typed_untrusted(body, _LAYOUT, _TYPES, "barrier message")
    if algorithm not in _ALGORITHMS or not _fields_ok(btype, algorithm, arity, rnd):
        raise WireError("bad_reserved", "barrier message")
    return BarrierMessage(btype, algorithm, arity, rnd, group, generation, sender)
