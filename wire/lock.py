"""RHiNET distributed queue lock messages (``Kind.LOCK``), with trylock.

Theory of operation
-------------------
The lock's *manager* remembers only the last requester.  ``LOCK_REQ`` goes
to the manager, which forwards it (``LOCK_FORW``) to the previous last
requester and records the newcomer; that process stores the newcomer as its
successor.  Unlock hands the lock straight to the successor (``LOCK_REPLY``,
the grant).  A holder with no successor sends ``UNLOCK`` to the manager,
which clears its record if the holder is still the last requester; if a
``LOCK_FORW`` crossed it, the holder grants to that newcomer instead.  Load
does not concentrate on the manager.

The paper's gap is trylock: the manager does not know who holds the lock.
It does know whether *anyone* holds or waits (its last-requester record is
set), which is all trylock needs: ``TRYLOCK_REQ`` to the manager is answered
``TRYLOCK_REPLY`` with ``LockStatus.GRANTED`` (the record was empty; the
requester now holds the lock and is the last requester) or ``BUSY``.

One 16-byte layout::

    type u8 | status u8 | reserved u16 (0) | lock id u32 | proc u32 | seq u32

``proc`` is the requesting process (daemon id and local process packed by
the lock engine): the one that wants, is forwarded, or is granted the lock.
``seq`` is the requester's sequence number for this acquisition, echoed in
every message about it, so late duplicates are recognised.  ``status`` is 0
except on ``TRYLOCK_REPLY``.
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import construct as c

from .errors import WireError
from .fixed import pack_checked, unpack_typed_untrusted


class LockType(enum.IntEnum):
    LOCK_REQ = 1  #: requester -> manager
    LOCK_FORW = 2  #: manager -> previous last requester: ``proc`` is your successor
    LOCK_REPLY = 3  #: holder -> successor (or manager -> requester): you hold the lock
    UNLOCK = 4  #: holder without successor -> manager
    TRYLOCK_REQ = 5  #: requester -> manager
    TRYLOCK_REPLY = 6  #: manager -> requester, with a LockStatus


class LockStatus(enum.IntEnum):
    GRANTED = 0
    BUSY = 1


class LockMessage(NamedTuple):
    ltype: int
    lock_id: int
    proc: int
    seq: int
    status: int = LockStatus.GRANTED


_TYPES = frozenset(LockType)
_STATUSES = frozenset(LockStatus)

LOCK_MESSAGE = c.Struct(
    "type" / c.Int8ub,
    c.Check(lambda ctx: ctx.type in _TYPES),
    "status" / c.Int8ub,
    c.Check(lambda ctx: ctx.status in _STATUSES if ctx.type == LockType.TRYLOCK_REPLY else ctx.status == 0),
    "reserved" / c.Const(0, c.Int16ub),
    "lock_id" / c.Int32ub,
    "proc" / c.Int32ub,
    "seq" / c.Int32ub,
    c.Terminated,
)

_LAYOUT = struct.Struct("!BBHIII")
LOCK_LEN = _LAYOUT.size  # 16


def _status_ok(ltype: int, status: int) -> bool:
    return status in _STATUSES if ltype == LockType.TRYLOCK_REPLY else status == 0


def encode(m: LockMessage) -> bytes:
    """Return the 16-byte wire form of ``m``.

    Raises:
        ValueError: unknown type, a status on a message that has none, or a
            field out of range.
    """
    if m.ltype not in _TYPES or not _status_ok(m.ltype, m.status):
        raise ValueError(f"bad lock message {m!r}")
    return pack_checked(_LAYOUT, m.ltype, m.status, 0, m.lock_id, m.proc, m.seq)


def decode_untrusted(body: bytes | bytearray | memoryview) -> LockMessage:
    """Parse a lock message from the network.

    Raises:
        WireError: ``bad_length``, ``bad_type``, ``bad_status`` or
            ``bad_reserved``; nothing else.
    """
    ltype, status, reserved, lock_id, proc, seq = unpack_typed_untrusted(body, _LAYOUT, _TYPES, "lock message")
    if reserved:
        raise WireError("bad_reserved", "lock message")
    if not _status_ok(ltype, status):
        raise WireError("bad_status", f"lock type {ltype} status {status}")
    return LockMessage(ltype, lock_id, proc, seq, status)
