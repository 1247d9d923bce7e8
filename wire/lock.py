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

Processes are ranks of a process group (``group`` names it on the wire);
an acquisition is ``(proc, seq)``: the rank and its sequence number for this
acquisition, echoed in every message about it, so a ``LOCK_FORW`` that
arrives after the acquisition it names was released is recognised as such
(the released holder grants the successor at once).  A ``LOCK_FORW`` names
two acquisitions: the target ``(proc, seq)`` and its successor
``(succ_proc, succ_seq)``; the others carry zeros there.  One 28-byte layout::

    type u8 | status u8 | reserved u16 (0) | group u32 | lock id u32 |
    proc u32 | seq u32 | succ proc u32 | succ seq u32

``status`` is 0 except on ``TRYLOCK_REPLY`` (GRANTED or BUSY), on
``LOCK_REPLY`` from a manager whose table is full (``REFUSED``), and on the
``LOCK_REPLY`` that passes on the lock of a holder that died
(``OWNER_DIED``, with that rank in ``succ proc``: the successor's wait ends
in an error, as a robust mutex's EOWNERDEAD warns, since what the lock
protected may be half-updated).
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
    LOCK_FORW = 2  #: manager -> previous last requester: ``succ`` is your successor
    LOCK_REPLY = 3  #: holder -> successor (or manager -> requester): you hold the lock
    UNLOCK = 4  #: holder without successor -> manager
    TRYLOCK_REQ = 5  #: requester -> manager
    TRYLOCK_REPLY = 6  #: manager -> requester, with a LockStatus


class LockStatus(enum.IntEnum):
    GRANTED = 0
    BUSY = 1  #: TRYLOCK_REPLY: somebody holds or waits
    REFUSED = 2  #: LOCK_REPLY / TRYLOCK_REPLY from the manager: its lock table is full
    OWNER_DIED = 3  #: LOCK_REPLY passing on the lock of a holder that died (``succ_proc``)


class LockMessage(NamedTuple):
    ltype: int
    group: int
    lock_id: int
    proc: int
    seq: int
    succ_proc: int = 0
    succ_seq: int = 0
    status: int = LockStatus.GRANTED


_TYPES = frozenset(LockType)
_WITH_STATUS = {LockType.TRYLOCK_REPLY: frozenset((LockStatus.GRANTED, LockStatus.BUSY, LockStatus.REFUSED)),
                LockType.LOCK_REPLY: frozenset((LockStatus.GRANTED, LockStatus.REFUSED, LockStatus.OWNER_DIED))}

LOCK_MESSAGE = c.Struct(
    "type" / c.Int8ub,
    c.Check(lambda ctx: ctx.type in _TYPES),
    "status" / c.Int8ub,
    c.Check(lambda ctx: _status_ok(ctx.type, ctx.status)),
    "reserved" / c.Const(0, c.Int16ub),
    "group" / c.Int32ub,
    "lock_id" / c.Int32ub,
    "proc" / c.Int32ub,
    "seq" / c.Int32ub,
    "succ_proc" / c.Int32ub,
    "succ_seq" / c.Int32ub,
    c.Check(lambda ctx: _succ_ok(ctx.type, ctx.status, ctx.succ_proc, ctx.succ_seq)),
    c.Terminated,
)

_LAYOUT = struct.Struct("!BBHIIIIII")
LOCK_LEN = _LAYOUT.size  # 28


def _succ_ok(ltype: int, status: int, succ_proc: int, succ_seq: int) -> bool:
    if ltype == LockType.LOCK_FORW:
        return True
    if ltype == LockType.LOCK_REPLY and status == LockStatus.OWNER_DIED:
        return succ_seq == 0  # succ_proc: the rank that died holding the lock
    return succ_proc == succ_seq == 0


def _status_ok(ltype: int, status: int) -> bool:
    allowed = _WITH_STATUS.get(ltype)  # type: ignore[call-overload]
    return status == 0 if allowed is None else status in allowed


def encode(m: LockMessage) -> bytes:
    """Return the 28-byte wire form of ``m``.

    Raises:
        ValueError: unknown type, a status on a message that has none, a
            successor on a message other than LOCK_FORW, or a field out of range.
    """
    if m.ltype not in _TYPES or not _status_ok(m.ltype, m.status) \
            or not _succ_ok(m.ltype, m.status, m.succ_proc, m.succ_seq):
        raise ValueError(f"bad lock message {m!r}")
    return pack_checked(_LAYOUT, m.ltype, m.status, 0, m.group, m.lock_id, m.proc, m.seq, m.succ_proc, m.succ_seq)


def decode_untrusted(body: bytes | bytearray | memoryview) -> LockMessage:
    """Parse a lock message from the network.

    Raises:
        WireError: ``bad_length``, ``bad_type``, ``bad_status`` or
            ``bad_reserved``; nothing else.
    """
    ltype, status, reserved, group, lock_id, proc, seq, succ_proc, succ_seq = \
        unpack_typed_untrusted(body, _LAYOUT, _TYPES, "lock message")
    if not _status_ok(ltype, status):
        raise WireError("bad_status", f"lock type {ltype} status {status}")
    if reserved or not _succ_ok(ltype, status, succ_proc, succ_seq):
        raise WireError("bad_reserved", "lock message")
    return LockMessage(ltype, group, lock_id, proc, seq, succ_proc, succ_seq, status)
