"""The RNIC's tables: protection domains, memory regions by STag, the QP state machine.

Theory of operation
-------------------
The ExpEther RNIC keeps an *STag Management Table* (per STag: base, length,
access rights, owner); so do we.  An STag is 32 bits: the upper 24 bits
index the table, the low 8 bits are a *key* (RFC 5040 §2.1 calls the low
byte the consumer key; here the daemon picks it), so a stale STag from a
deregistered region, or a guessed one, does not resolve
(``STagTable.lookup`` returns None).  Neither part is predictable from the
STags seen before (RFC 5040 §8.1.1 wants STags hard to guess): the key is
drawn at random on every registration (never the index's previous key, so
a stale STag fails) and the index is drawn at random from the free ones.

Every check a tagged segment needs (RFC 5040 §6.4 / RFC 5041 §7.2: STag
valid, region belongs to the QP's PD, access allowed, offset + length inside
the region) is one call, ``MemoryRegion.check``, which answers with an error
code instead of raising: the data path turns codes into Terminates and
completion statuses.

The QP state machine is a table in h11's style: ``TRANSITIONS[(cur, new)]``
gives the attribute-mask bits that transition *requires* and those it
*allows* (IB spec 1.2 §11.2.5.2, the kernel's ``qp_state_table``).  A
transition that is not in the table, or a mask with a required bit missing
or an extra bit, is refused with EINVAL and changes nothing.
"""

from __future__ import annotations

import errno
import mmap
import random
from typing import Any

from ..wire.shm import AccessFlags, QPAttrMask as M, QPState as S

STAG_INDEX_BITS = 24
MAX_STAG_INDEX = (1 << STAG_INDEX_BITS) - 1


class TableError(Exception):
    """A control-path request the tables refuse; ``errno`` says why."""

    def __init__(self, errno_: int, text: str) -> None:
        super().__init__(text)
        self.errno = errno_


class ProtectionDomain:
    __slots__ = ("handle", "session", "mrs", "qps")

    def __init__(self, handle: int, session: Any) -> None:
        self.handle = handle
        self.session = session
        self.mrs: set[int] = set()
        self.qps: set[int] = set()


# Check results (0 = allowed); the data path maps them to Terminate codes and WC statuses.
OK = 0
INVALID_STAG = 1
BOUNDS = 2
ACCESS = 3
WRONG_PD = 4


class MemoryRegion:
    """A registered region: the daemon's mapping of the application's memfd.

    ``addr`` is the application's virtual address of the region (what it
    puts in SGEs and advertises as remote_addr); ``view`` is the daemon's
    writable memoryview of the same bytes.
    """

    __slots__ = ("handle", "pd", "access", "addr", "length", "stag", "mm", "view", "valid", "zero_based")

    def __init__(self, handle: int, pd: ProtectionDomain, access: int, addr: int, length: int,
                 mm: mmap.mmap) -> None:
        self.handle = handle
        self.pd = pd
        self.access = access
        self.addr = addr
        self.length = length
        self.mm = mm
        self.view = memoryview(mm)
        self.stag = 0
        self.valid = True
        self.access = int(access)
        self.zero_based = bool(self.access & AccessFlags.IBV_ACCESS_ZERO_BASED)

    def check(self, pd: ProtectionDomain, access: int, to: int, length: int, *, tagged: bool) -> tuple[int, int]:
        """Check one access to this region.

        Takes the accessing QP's PD, the access bit needed (0 for a local
        read), the address (SGE addr, or a tagged offset) and the length.
        Returns ``(code, offset into view)``; code is OK, INVALID_STAG,
        WRONG_PD, ACCESS or BOUNDS.
        """
        if not self.valid:
            return INVALID_STAG, 0
        if pd is not self.pd:
            return WRONG_PD, 0
        if access and not self.access & access:
            return ACCESS, 0
        off = to if (tagged and self.zero_based) else to - self.addr
        if off < 0 or length < 0 or off + length > self.length:
            return BOUNDS, 0
        return OK, off

    def close(self) -> None:
        """Unmap (the STag must already be invalidated)."""
        self.valid = False
        self.view.release()
        try:
            self.mm.close()
        except BufferError:  # a placement view still alive; GC will unmap
            pass


class STagTable:
    """STag -> MemoryRegion; the index and the 8-bit key of each STag are drawn from ``rng``.

    ``rng``: where the randomness comes from (the daemon passes
    ``secrets.SystemRandom()``, or a seeded ``random.Random`` when it is
    seeded, so that twin devices give equal STags); by default the system's.
    """

    #: indices made free at a time as the table grows, to draw from
    GROW = 64

    def __init__(self, max_entries: int = MAX_STAG_INDEX, rng: random.Random | None = None) -> None:
        if not 0 < max_entries <= MAX_STAG_INDEX:
            raise ValueError("max_entries out of range")
        self._slots: list[MemoryRegion | None] = [None]  # index 0 is never used: STag 0 is invalid
        self._keys: list[int] = [0]
        self._free: list[int] = []
        self._max = max_entries
        self._rng: random.Random = rng if rng is not None else random.SystemRandom()
        self.count = 0
        # moves on every registration and invalidation: what was resolved
        # against the table before still holds while it stays
        self.version = 0

    def register(self, mr: MemoryRegion) -> int:
        """Give ``mr`` an STag (also stored in ``mr.stag``) and return it.

        Raises:
            TableError: ENOMEM when every index is in use.
        """
        free = self._free
        if not free:
            top = len(self._slots)
            n = min(self.GROW, self._max + 1 - top)
            if n <= 0:
                raise TableError(errno.ENOMEM, "STag table full")
            self._slots.extend([None] * n)
            self._keys.extend([0] * n)
            free.extend(range(top, top + n))
        # a random free index (swap it to the end, then pop)
        at = self._rng.randrange(len(free))
        free[at], free[-1] = free[-1], free[at]
        idx = free.pop()
        # A random key, never the previous one at this index: an STag of the
        # previous region here no longer resolves.
        key = (self._keys[idx] + self._rng.randrange(1, 256)) & 0xFF
        self._keys[idx] = key
        self._slots[idx] = mr
        mr.stag = (idx << 8) | key
        self.count += 1
        self.version += 1
        return mr.stag

    def lookup(self, stag: int) -> MemoryRegion | None:
        """The region an STag names, or None (unknown index, stale key, invalidated)."""
        idx = stag >> 8
        if idx >= len(self._slots) or self._keys[idx] != stag & 0xFF:
            return None
        mr = self._slots[idx]
        return mr if mr is not None and mr.valid else None

    def place(self, pd: ProtectionDomain, access: int, stag: int, to: int, data: memoryview) -> int:
        """Place a tagged segment (RFC 5041 §7.1): check, then copy into the region ``stag`` names.

        Returns OK, or the check code (INVALID_STAG, WRONG_PD, ACCESS, BOUNDS)
        with nothing written.
        """
        mr = self.lookup(stag)
        if mr is None:
            return INVALID_STAG
        n = len(data)
        code, off = mr.check(pd, access, to, n, tagged=True)
        if code:
            return code
        if n:
            mr.view[off:off + n] = data
        return OK

    def invalidate(self, stag: int) -> MemoryRegion | None:
        """Remove an STag; return its region (None if it did not resolve)."""
        mr = self.lookup(stag)
        if mr is None:
            return None
        idx = stag >> 8
        self._slots[idx] = None
        self._free.append(idx)
        mr.valid = False
        self.count -= 1
        self.version += 1
        return mr


class Handles:
    """Small integer handles for a kind of object (1, 2, ...; 0 means none)."""

    def __init__(self, limit: int) -> None:
        self._objs: dict[int, Any] = {}
        self._next = 1
        self.limit = limit

    def add(self, obj: Any) -> int:
        """Store ``obj``; return its handle.  Raises TableError(ENOMEM) when full."""
        if len(self._objs) >= self.limit:
            raise TableError(errno.ENOMEM, "table full")
        while self._next in self._objs or self._next == 0:
            self._next = (self._next + 1) & 0xFFFFFF
        h = self._next
        self._next = (self._next + 1) & 0xFFFFFF
        self._objs[h] = obj
        return h

    def get(self, handle: int, session: Any = None) -> Any:
        """The object of ``handle`` (owned by ``session`` when given).

        Raises:
            TableError: ENOENT if there is no such handle for that session.
        """
        obj = self._objs.get(handle)
        if obj is None or (session is not None and getattr(obj, "session", session) is not session):
            raise TableError(errno.ENOENT, f"no such handle {handle}")
        return obj

    def find(self, handle: int) -> Any:
        """The object of ``handle`` or None."""
        return self._objs.get(handle)

    def pop(self, handle: int) -> Any:
        return self._objs.pop(handle, None)

    def values(self) -> list[Any]:
        return list(self._objs.values())

    def __len__(self) -> int:
        return len(self._objs)

    def __contains__(self, handle: int) -> bool:
        return handle in self._objs


# --- QP state machine (IB spec §11.2.5.2; RC only) -----------------------------

_RTS_OPT = M.IBV_QP_CUR_STATE | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_MIN_RNR_TIMER | M.IBV_QP_ALT_PATH | M.IBV_QP_PATH_MIG_STATE
_SQD_OPT = (
    M.IBV_QP_CUR_STATE | M.IBV_QP_AV | M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_PKEY_INDEX
    | M.IBV_QP_MIN_RNR_TIMER | M.IBV_QP_PATH_MIG_STATE | M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT
    | M.IBV_QP_RNR_RETRY | M.IBV_QP_MAX_QP_RD_ATOMIC | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_PORT
)
_ANY = (S.IBV_QPS_RESET, S.IBV_QPS_INIT, S.IBV_QPS_RTR, S.IBV_QPS_RTS, S.IBV_QPS_SQD, S.IBV_QPS_SQE, S.IBV_QPS_ERR)

#: (current, next) -> (required attr_mask bits besides IBV_QP_STATE, allowed optional bits)
TRANSITIONS: dict[tuple[int, int], tuple[int, int]] = {
    (S.IBV_QPS_RESET, S.IBV_QPS_INIT): (M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS, 0),
    (S.IBV_QPS_INIT, S.IBV_QPS_INIT): (0, M.IBV_QP_PKEY_INDEX | M.IBV_QP_PORT | M.IBV_QP_ACCESS_FLAGS),
    (S.IBV_QPS_INIT, S.IBV_QPS_RTR): (
        M.IBV_QP_AV | M.IBV_QP_PATH_MTU | M.IBV_QP_DEST_QPN | M.IBV_QP_RQ_PSN
        | M.IBV_QP_MAX_DEST_RD_ATOMIC | M.IBV_QP_MIN_RNR_TIMER,
        M.IBV_QP_ALT_PATH | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_PKEY_INDEX,
    ),
    (S.IBV_QPS_RTR, S.IBV_QPS_RTS): (
        M.IBV_QP_SQ_PSN | M.IBV_QP_TIMEOUT | M.IBV_QP_RETRY_CNT | M.IBV_QP_RNR_RETRY | M.IBV_QP_MAX_QP_RD_ATOMIC,
        _RTS_OPT,
    ),
    (S.IBV_QPS_RTS, S.IBV_QPS_RTS): (0, _RTS_OPT),
    (S.IBV_QPS_RTS, S.IBV_QPS_SQD): (0, M.IBV_QP_EN_SQD_ASYNC_NOTIFY),
    (S.IBV_QPS_SQD, S.IBV_QPS_RTS): (0, _RTS_OPT),
    (S.IBV_QPS_SQD, S.IBV_QPS_SQD): (0, _SQD_OPT),
    (S.IBV_QPS_SQE, S.IBV_QPS_RTS): (0, M.IBV_QP_CUR_STATE | M.IBV_QP_ACCESS_FLAGS | M.IBV_QP_MIN_RNR_TIMER),
    **{(s, S.IBV_QPS_RESET): (0, 0) for s in _ANY},
    **{(s, S.IBV_QPS_ERR): (0, 0) for s in _ANY},
}


def check_transition(cur: int, attr_mask: int, new_state: int) -> int:
    """Validate a modify_qp: return the state the QP moves to.

    Takes the current state, the attribute mask and ``attr.qp_state`` (used
    only if IBV_QP_STATE is in the mask; otherwise the QP stays in ``cur``).

    Raises:
        TableError: EINVAL for a transition not in the table, a required bit
            missing or a bit the transition does not allow.
    """
    new = new_state if attr_mask & M.IBV_QP_STATE else cur
    rule = TRANSITIONS.get((cur, new))
    if rule is None:
        raise TableError(errno.EINVAL, f"invalid QP transition {S(cur).name} -> {_state_name(new)}")
    required, optional = rule
    rest = attr_mask & ~M.IBV_QP_STATE
    if rest & required != required:
        missing = M(required & ~rest)
        raise TableError(errno.EINVAL, f"{S(cur).name} -> {S(new).name} needs {missing!r}")
    extra = rest & ~(required | optional)
    if extra:
        raise TableError(errno.EINVAL, f"{S(cur).name} -> {S(new).name} does not take {M(extra)!r}")
    return new


def _state_name(s: int) -> str:
    try:
        return S(s).name
    except ValueError:
        return str(s)
