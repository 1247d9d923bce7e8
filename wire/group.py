"""Process-group membership messages (``Kind.GROUP``) between daemons.

Theory of operation
-------------------
A process group is named by a 32-bit ``group`` id that every member derives
from the group's name and member list (:func:`group_id`), so daemons agree
on it without a coordinator.  When a rank joins on its daemon, that daemon
tells every other member's daemon (``JOIN``); joining completes for a rank
when its daemon has heard of every rank.  A rank that leaves, or whose
process dies, is announced with ``LEAVE``: ``status`` says which, and
``generation`` is the last barrier the rank was released from, so a member
still waiting for that barrier's release is not failed by an announcement
that overtook it.  While a member waits for a lock or a barrier its daemon
sends ``PING`` to the other members' daemons, each of which answers
``PONG``: silence past the group's timeout means that daemon is gone.
One 16-byte layout::

    type u8 | status u8 | reserved u16 (0) | group u32 | rank u32 | generation u32
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple, Sequence

import construct as c
import crc32c

from .errors import WireError
from .fixed import pack_checked, unpack_typed_untrusted


class GroupType(enum.IntEnum):
    JOIN = 1  #: ``rank`` joined (on the sending daemon)
    LEAVE = 2  #: ``rank`` left (``status`` LEFT) or died (DIED) after barrier ``generation``
    PING = 3  #: are you there?  (``rank`` and ``generation`` 0)
    PONG = 4  #: yes


class LeaveStatus(enum.IntEnum):
    LEFT = 0
    DIED = 1


class GroupMessage(NamedTuple):
    gtype: int
    group: int
    rank: int = 0
    generation: int = 0
    status: int = 0


_TYPES = frozenset(GroupType)
_LEAVE_STATUSES = frozenset(LeaveStatus)

GROUP_MESSAGE = c.Struct(
    "type" / c.Int8ub,
    c.Check(lambda ctx: ctx.type in _TYPES),
    "status" / c.Int8ub,
    c.Check(lambda ctx: _status_ok(ctx.type, ctx.status)),
    "reserved" / c.Const(0, c.Int16ub),
    "group" / c.Int32ub,
    "rank" / c.Int32ub,
    "generation" / c.Int32ub,
    c.Terminated,
)

_LAYOUT = struct.Struct("!BBHIII")
GROUP_LEN = _LAYOUT.size  # 16


def _status_ok(gtype: int, status: int) -> bool:
    return status in _LEAVE_STATUSES if gtype == GroupType.LEAVE else status == 0


def encode(m: GroupMessage) -> bytes:
    """Return the 16-byte wire form of ``m``.

    Raises:
        ValueError: unknown type, a status on a message that has none, or a field out of range.
    """
    if m.gtype not in _TYPES or not _status_ok(m.gtype, m.status):
        raise ValueError(f"bad group message {m!r}")
    return pack_checked(_LAYOUT, m.gtype, m.status, 0, m.group, m.rank, m.generation)


def decode_untrusted(body: bytes | bytearray | memoryview) -> GroupMessage:
    """Parse a group message from the network.

    Raises:
        WireError: ``bad_length``, ``bad_type``, ``bad_status`` or ``bad_reserved``; nothing else.
    """
    gtype, status, reserved, group, rank, generation = unpack_typed_untrusted(body, _LAYOUT, _TYPES, "group message")
    if reserved:
        raise WireError("bad_reserved", "group message")
    if not _status_ok(gtype, status):
        raise WireError("bad_status", f"group type {gtype} status {status}")
    return GroupMessage(gtype, group, rank, generation, status)


def group_id(name: str, members: Sequence[tuple[str, int]]) -> int:
    """The 32-bit id every member derives from the group's name and member list."""
    text = name + "\n" + "\n".join(f"{ip} {port}" for ip, port in members)
    return crc32c.crc32c(text.encode())
