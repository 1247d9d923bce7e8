"""Completion queues, completion channels and shared receive queues: the daemon's side.

A ``CompletionQueue`` is a ring of CQEs in a shared-memory segment
(``wire/shm.py``) that the daemon produces into and the application
consumes from; after each CQE the daemon fences and, if the application
armed the CQ (``req_notify``), signals one eventfd: the CQ's own or its
``CompChannel``'s.  A full ring is an overrun: the CQE is dropped and
IBV_EVENT_CQ_ERR raised once (verbs semantics).  A ``SharedReceiveQueue``
is a ring of receive WQEs that several QPs take from.
"""

from __future__ import annotations

import os
from typing import Any

from ..wire import shm
from ..wire.shm import EventType
from . import tables
from .opcodes import U32 as _U32

_CQE = shm.CQE


class CompChannel:
    """A completion channel: one eventfd that several CQs signal."""

    def __init__(self, handle: int, session: Any) -> None:
        self.handle = handle
        self.session = session
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.cqs: set[int] = set()

    def close(self) -> None:
        if self.eventfd >= 0:
            os.close(self.eventfd)
            self.eventfd = -1


class CompletionQueue:
    """The daemon's side of a CQ: it produces CQEs into the shared ring."""

    def __init__(self, handle: int, session: Any, cqe: int, channel: CompChannel | None) -> None:
        self.handle = handle
        self.session = session
        self.entries = shm.round_entries(cqe)
        self.fd, self.mm = shm.new_segment(shm.page_round(shm.ring_bytes(self.entries, shm.CQE_SIZE)), "uv-cq")
        try:
            self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError:  # out of fds: give the ring back, the client gets the error
            os.close(self.fd)
            self.mm.close()
            raise
        self.ring = shm.Ring(self.mm, 0, "struct uv_cqe", self.entries, init=True)
        self.channel = channel
        self.overrun = False
        self.users = 0  # QPs that complete into this CQ

    def push(self, wr_id: int, status: int, opcode: int, byte_len: int, qp_num: int,
             src_qp: int = 0, imm_data: int = 0, wc_flags: int = 0, vendor_err: int = 0,
             solicited: bool = False) -> bool:
        """Write one CQE and wake a waiter if the CQ is armed.

        A CQ armed with ``solicited_only`` wakes only for a solicited receive
        (Send with SE, RFC 5040 §5.3) or an error completion (verbs semantics).

        Returns False (and raises IBV_EVENT_CQ_ERR once) if the ring is full.
        """
        r = self.ring
        try:
            free = r.free()
        except shm.RingError:
            free = 0
        if free == 0 or self.overrun:
            if not self.overrun:
                self.overrun = True
                r.hdr.overrun = 1
                self.session.async_event(EventType.IBV_EVENT_CQ_ERR, self.handle)
            return False
        _CQE.pack_into(r.buf, r.next_slot_offset(), wr_id, status, opcode, vendor_err, byte_len & _U32, imm_data,
                       qp_num, src_qp, wc_flags)
        r.push()
        self._publish(solicited or status != 0)
        return True

    def pushed(self, count: int, solicited: bool = False) -> None:
        """``count`` successful CQEs (unsolicited, unless ``solicited``) were
        written after the producer index (by the compiled Send batch or the
        armed read, within ``ring.free()``): publish them and wake a waiter
        as ``push`` does."""
        r = self.ring
        r.prod = (r.prod + count) & _U32
        self._publish(solicited)

    def _publish(self, wakes: bool) -> None:
        """Publish the producer index; wake a waiter if the CQ is armed for
        what was pushed (``wakes``: a solicited or error completion)."""
        r = self.ring
        r.publish()
        shm.full_fence()  # the CQE must be visible before we read ``armed`` (the app does the mirror)
        hdr = r.hdr
        if hdr.armed and (wakes or not hdr.solicited_only):
            # Armed by req_notify: one event, then disarmed (verbs semantics).
            hdr.armed = 0
            if self.channel is not None:
                hdr.event_pending = 1
                _signal(self.channel.eventfd)
            else:
                _signal(self.eventfd)

    def close(self) -> None:
        self.fd = release_segment(self.fd, self.mm, self.ring)
        if self.eventfd >= 0:
            os.close(self.eventfd)
            self.eventfd = -1


def _signal(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except OSError:  # counter saturated or fd gone: the waiter wakes anyway
        pass


class SharedReceiveQueue:
    """An SRQ (verbs ``ibv_srq``): one ring of receive WQEs that many QPs take from.

    ``limit`` > 0 arms IBV_EVENT_SRQ_LIMIT_REACHED: raised once when fewer
    WQEs than that remain, then disarmed (verbs semantics).
    """

    def __init__(self, handle: int, session: Any, pd: tables.ProtectionDomain, max_wr: int, max_sge: int,
                 limit: int) -> None:
        self.handle = handle
        self.session = session
        self.pd = pd
        self.entries = shm.round_entries(max_wr)
        self.max_sge = max_sge
        self.limit = limit
        self.fd, self.mm = shm.new_segment(shm.page_round(shm.ring_bytes(self.entries, shm.RECV_WQE_SIZE)), "uv-srq")
        self.ring = shm.Ring(self.mm, 0, "struct uv_recv_wqe", self.entries, init=True)
        self.users = 0  # QPs that take from it

    def took_one(self) -> None:
        if self.limit:
            try:
                left = self.ring.available()
            except shm.RingError:
                left = 0
            if left < self.limit:
                self.limit = 0
                self.session.async_event(EventType.IBV_EVENT_SRQ_LIMIT_REACHED, self.handle)

    def close(self) -> None:
        self.fd = release_segment(self.fd, self.mm, self.ring)


def release_segment(fd: int, mm: Any, *rings: shm.Ring) -> int:
    """Drop the rings' views, close the memfd and unmap (a view still alive defers that to GC); returns -1."""
    for r in rings:
        r.release()
    if fd >= 0:
        os.close(fd)
    try:
        mm.close()
    except BufferError:
        pass
    return -1
