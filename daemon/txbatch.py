"""The batch take: a stream's small messages from the SQ to the link in one compiled call.

Theory of operation
-------------------
A stream of small RDMA Writes or Sends (perftest's ``write_bw -s 64``) is
WQEs that are all alike: one opcode, a payload inline or in one SGE of one
registered region, all of one length, that fits one DDP segment (a Write's
may take several, where the per-WQE path cuts it evenly: ``-s 4096``).  Taken
one by one (``Requester.start_next``) each costs the sending daemon a few
microseconds of Python: the WQE's fields, the SGE's check, a segment built
and queued on the link, and at the flush a link packet framed in Python.
Here one call of ``udpv_tx_take_small`` (``wire/_native_batch.c``) takes
all the next WQEs that are alike and builds their segments in one buffer,
each in the place its link packet will have (``run_slots``): the link
queues them as one run (``Link.send_run``) and the compiled framer frames
the run in one call when it leaves, in one ``UDP_SEGMENT`` send.  What is
left per message is its records (``OutWR``, a Send's ``Q0Message``).

Python stays the control plane.  The batch is taken only where the
per-WQE path would do exactly this for every WQE of it (``take_batch``
checks that once): the QP in RTS with nothing under way, no response,
re-send or Modified ACK owed, the first WQE's region valid for the QP,
a link of one path.  The C code stops at the first WQE that differs (another
opcode, a flag such as fence or solicited, several SGEs, another region,
out of bounds, another length); that one and everything after it go the
per-WQE way, which produces the errors.  A batch of fewer than two is
dropped (nothing was taken): alone, a message may leave at once
(``PeerLink.send_alone``), which a run does not.  ``FLUSH_EVERY`` bounds a
batch as it bounds the per-WQE loop, so both send the same datagrams at
the same points: ``tests/daemon/test_native_send_lane.py`` checks byte
for byte, link state and completions, against a device without the
compiled lanes.
"""

from __future__ import annotations

import struct
from typing import Any

from ..transport.link import run_slots
from ..wire import segment, shm
from ..wire.rdmap import Opcode
from .atombatch import SQScratch, take_atomics
from .opcodes import (
    ATOMIC_WR,
    SEND_INLINE,
    SEND_OPCODE,
    SEND_SIGNALED,
    U32,
    WC_RDMA_WRITE,
    WC_SEND,
    WR_READ,
    WR_WRITE,
)
from .peer import PeerLink
from .readbatch import take_reads
from .records import Gather, OutWR, Q0Message

_WR_SEND = int(shm.WrOpcode.IBV_WR_SEND)
_SG_OFFSET = shm.SEND_WQE_SG_OFFSET
_SGE = shm.SGE
#: opcode, send_flags, num_sge of ``struct uv_send_wqe`` (its SEND_WQE_HEAD twin from ``opcode`` on)
_OP_FLAGS_NSGE = struct.Struct("=III")
_OP_AT = shm.ffi.offsetof("struct uv_send_wqe", "opcode")
_INLINE_LEN_AT = shm.ffi.offsetof("struct uv_send_wqe", "inline_len")
_U32_AT = struct.Struct("=I")
_TAGGED_PREFIX = segment.TAGGED_PREFIX_LEN
_UNTAGGED_PREFIX = segment.UNTAGGED_PREFIX_LEN
#: flags a batched WQE may have: any other (fence, solicited) takes the per-WQE path
_FLAGS_OK = SEND_SIGNALED | SEND_INLINE
_NO_REGION = 0xFFFFFFFFFFFFFFFF  # src_off of an inline payload
#: the most segments one call builds (the per-WQE loop flushes every FLUSH_EVERY WQEs anyway)
MAX_BATCH = 64
_NONE = (0, 0)


class BatchScratch(SQScratch):
    """One QP's descriptor and per-WQE outputs for ``udpv_tx_take_small``."""

    __slots__ = ("more", "wr_id", "raddr", "rkey", "src_off", "signaled")

    def __init__(self, native: Any) -> None:
        super().__init__(native, "udpv_tx_take *")
        ffi, t = self.ffi, self.t
        self.more = ffi.buffer(t.more)
        # the arrays live as long as this object: t only points at them
        self.wr_id = t.wr_id = ffi.new("uint64_t[]", MAX_BATCH)
        self.raddr = t.raddr = ffi.new("uint64_t[]", MAX_BATCH)
        self.rkey = t.rkey = ffi.new("uint32_t[]", MAX_BATCH)
        self.src_off = t.src_off = ffi.new("uint64_t[]", MAX_BATCH)
        self.signaled = t.signaled = ffi.new("uint8_t[]", MAX_BATCH)
        t.sg_at = _SG_OFFSET
        t.flags_ok = _FLAGS_OK
        t.inline_flag = SEND_INLINE
        t.signaled_flag = SEND_SIGNALED


class TxBatch:
    """The batch take's methods of a QueuePair (see the module docstring)."""

    _txb: BatchScratch | None

    def take_batch(self, pl: PeerLink, wqes: int, room: int) -> tuple[int, int]:
        """Take up to ``wqes`` RDMA Writes or one-segment Sends that are
        alike off the SQ in one compiled call, their segments at most
        ``room``, and queue them on ``pl`` as one run; return how many WQEs
        and segments (0 WQEs: none taken, the per-WQE path goes on).  The
        caller has checked that nothing else is under way or owed."""
        sq = self.sq
        try:
            avail = sq.available()
        except shm.RingError:
            return _NONE  # the per-WQE path reports it
        if avail < 2 or pl.link.multipath:  # several paths: the general path
            return _NONE
        buf = sq.buf
        at = sq.slot_offset()
        opcode, flags, num_sge = _OP_FLAGS_NSGE.unpack_from(buf, at + _OP_AT)
        if opcode in ATOMIC_WR:
            # an ORD window (atombatch.py): requests are held for one run,
            # not counted as segments, as start_next's are
            return (take_atomics(self, pl, opcode, wqes, avail), 0) if not flags & ~SEND_SIGNALED else _NONE
        if opcode == WR_READ:
            # an ORD window of Reads, the same way (readbatch.py)
            return (take_reads(self, pl, wqes, avail), 0) if not flags & ~SEND_SIGNALED else _NONE
        if room < 2:
            return _NONE
        if opcode == WR_WRITE:
            untagged, max_len = False, pl.max_data
        elif opcode == _WR_SEND and not self.flow_ack_due:
            # (a Modified ACK owed rides on the first Send: the per-WQE path)
            untagged, max_len = True, pl.max_data - (_UNTAGGED_PREFIX - _TAGGED_PREFIX)
        else:
            return _NONE
        if flags & ~_FLAGS_OK:
            return _NONE
        mr = None
        if flags & SEND_INLINE:
            n = _U32_AT.unpack_from(buf, at + _INLINE_LEN_AT)[0]
        elif num_sge == 1:
            addr, n, lkey = _SGE.unpack_from(buf, at + _SG_OFFSET)
            mr = self.device.stags.lookup(lkey)
            if mr is None or mr.check(self.pd, 0, addr, n, tagged=False)[0]:
                return _NONE
        else:
            return _NONE
        seg = n
        if n > max_len:
            # A Write of several segments: only where the per-WQE path cuts
            # it evenly (a stream's, with another WR outstanding), so that
            # all segments are of one size.  That path takes the WQE that
            # reaches FLUSH_EVERY, flushes, then queues its segments: the
            # batch leaves that one to it.
            if untagged or mr is None or not self.outstanding:
                return _NONE
            seg = pl.segment_size(n, True)
            wqes -= 1
        if n == 0 or n % seg:
            return _NONE
        m = n // seg
        k = min(avail, wqes, room // m, MAX_BATCH // m)
        if k < 2:
            return _NONE
        k = self._take(pl, sq, k, opcode, untagged, n, seg, mr)
        return k, k * m

    def _take(self, pl: PeerLink, sq: shm.Ring, room: int, opcode: int, untagged: bool, n: int, seg: int,
              mr: Any) -> int:
        """``take_batch`` once the first WQE is known to fit: the compiled
        call (up to ``room`` WQEs, messages of ``n`` bytes in segments of
        ``seg``), then the ring, the link and the records; returns the WQEs taken."""
        b = self._txb
        if b is None:
            b = self._txb = BatchScratch(self.device.native)
        b.point_at(sq)
        t = b.t
        t.cons = sq.cons
        t.mask = sq.mask
        t.entry_size = sq.entry_size
        t.avail = room
        t.opcode = opcode
        t.sig_all = 1 if self.sq_sig_all else 0
        # (a message of several segments is never inline: longer than one segment)
        t.max_inline = min(shm.MAX_INLINE, self.caps["max_inline_data"]) if seg == n else 0
        t.length = n
        t.seg = seg
        if mr is not None:
            t.lkey, t.addr, t.len = mr.stag, mr.addr, mr.length
        else:
            t.lkey, t.addr, t.len = 0, 0, 0  # an inline first WQE: SGEs go the per-WQE way
        if untagged:
            prefix = _UNTAGGED_PREFIX
            segment.pack_untagged_into(b.hdr, 0, self.dest_qpn, self.qpn, SEND_OPCODE[False, False], True, 0, 0)
            t.msn = self.send_msn & U32
        else:
            prefix = _TAGGED_PREFIX
            segment.pack_tagged_into(b.hdr, 0, self.dest_qpn, self.qpn, Opcode.RDMA_WRITE, True, 0, 0)
            segment.pack_tagged_into(b.more, 0, self.dest_qpn, self.qpn, Opcode.RDMA_WRITE, False, 0, 0)
        t.prefix = prefix
        t.untagged = untagged
        stride = prefix + seg
        m = n // seg
        head, slot = run_slots(stride)
        ffi = b.ffi
        dst = b.alloc("uint8_t[]", room * m * slot)
        mem = ffi.from_buffer("uint8_t[]", mr.view) if mr is not None else ffi.NULL
        try:
            k = b.lib.udpv_tx_take_small(t, mem, dst + head, room, slot)
        finally:
            if mr is not None:
                ffi.release(mem)  # no export may outlive the call: deregistration releases the view
        if k < 2:
            return 0
        sq.pop(k)
        self.device.stats["tx_batched_wqes"] += k
        if pl.requests:
            pl.flush_requests()  # as PeerLink.send: requests queued before go first
        run = memoryview(ffi.buffer(dst))
        # A Send completes on the peer's Modified ACK, which carries the
        # link's ACK too: its messages ask for no ACK at once.
        n0 = pl.link.send_run(run, stride, k * m, stride, ack_now=not untagged)
        if untagged:
            self._sends_taken(b, k, n, n0, run, head + prefix, slot, mr)
        else:
            self._writes_taken(b, pl, k, n, n0 + m - 1, m)
        return k

    def _writes_taken(self, b: BatchScratch, pl: PeerLink, k: int, n: int, last: int, m: int) -> None:
        """The records of ``k`` RDMA Writes of ``n`` bytes, ``m`` segments
        each, the first one's last queued as link message ``last``: each
        completes once the link has its last acknowledged."""
        ffi = b.ffi
        ids, raddrs, rkeys, sig = (ffi.unpack(b.wr_id, k), ffi.unpack(b.raddr, k), ffi.unpack(b.rkey, k),
                                   ffi.unpack(b.signaled, k))
        outstanding = self.outstanding
        waiters = pl.ack_waiters
        for i in range(k):
            wr = OutWR(ids[i], WC_RDMA_WRITE, sig[i] != 0, n)
            wr.rkey = rkeys[i]
            wr.raddr = raddrs[i]
            wr.last_n = last
            outstanding.append(wr)
            waiters.append((last, self))
            last += m

    def _sends_taken(self, b: BatchScratch, k: int, n: int, n0: int, run: memoryview, first: int, slot: int,
                     mr: Any) -> None:
        """The records of ``k`` one-segment Sends of ``n`` bytes: each kept on
        queue 0 until the peer's Modified ACK (an RNR NACK has it sent
        again, from its SGE, or an inline one from the bytes that left,
        at ``first`` + i * ``slot`` in ``run``)."""
        ffi = b.ffi
        ids, raddrs, rkeys, sig, offs = (ffi.unpack(b.wr_id, k), ffi.unpack(b.raddr, k), ffi.unpack(b.rkey, k),
                                         ffi.unpack(b.signaled, k), ffi.unpack(b.src_off, k))
        outstanding = self.outstanding
        q0 = self.q0
        msn = self.send_msn
        send_op = SEND_OPCODE[False, False]
        view = mr.view if mr is not None else None
        for i in range(k):
            wr = OutWR(ids[i], WC_SEND, sig[i] != 0, n)
            wr.rkey = rkeys[i]
            wr.raddr = raddrs[i]
            outstanding.append(wr)
            off = offs[i]
            g = Gather([(run, first + i * slot, n)] if off == _NO_REGION else [(view, off, n)])
            m = Q0Message(msn, wr, g, send_op)
            m.sent = n
            q0.append(m)
            wr.q0_last = msn
            msn += 1
        self.send_msn = msn
        self.q0_cursor += k
        self.flow_ack_sent(False)

