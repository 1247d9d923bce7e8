"""The Read batch: an ORD window of RDMA Reads taken, answered and completed as batches.

Theory of operation
-------------------
A stream of small Reads (perftest's ``read_bw -s 64``) is an ORD window
of Read WQEs that are all alike, whose Read Requests reach the responder
as one GRO buffer, whose one-segment Read Responses come back as one.
Taken one by one, each Read cost the requesting daemon its WQE's Python
(fields, SGE check, request packed and held), the responding one the
request's decoding, the region's check, a response segment packed,
queued and framed alone in Python, and the requester again the response's
placement call and the Read's completion.  Here, as for atomics
(``atombatch.py``, whose structure this follows):

- the requester takes the next Read WQEs that are alike (no flag but
  signaled, one SGE in one region) up to the ORD in one call of
  ``udpv_read_take`` (``wire/_native_read.c``), which builds their Read
  Requests in run slots, each with the next sink STag; the link queues
  them as one run;
- the responder, given the GRO batch of Read Requests the receive lane
  checked, checks once what is the same for all of them (the QP receives,
  the first request's MSN is the expected one, the IRD leaves room: the
  batch is cut where the IRRQ would be full, and the first request's
  STag names a valid region of the QP's PD with remote read access) and
  ``udpv_read_batch`` takes those that ask for the first one's size (one
  segment) of that region within its bounds, building their responses'
  headers in run slots; the IRRQ keeps them as one record, a
  :class:`ReadRun`, and when they leave, ``udpv_read_fill`` copies their
  payloads from the region (as the Python path reads it then) and the
  link queues them as one run, which the compiled framer frames;
- the requester places a buffer of one-segment Read Responses into the
  sinks of the Reads at its ORRQ head in one call of
  ``udpv_read_responses`` (the receive lane's checks, response by
  response) and completes them in one loop (``ReceiveLane.next_reads_responses``).

The first WQE, request or response that differs (another STag, out of
bounds, no access, another size, the IRD reached, a fence, another sink
region, an atomic) stops the batch and takes the per-message path, which
produces the errors and Terminates as before.  Reads and atomics share the
ORD window and the IRRQ in their order: each batch is one kind, taken where
the other kind's batch or message stops.  A device with the batches sends
the same datagrams, at the same points, and completes the same CQEs as one
without them (``tests/daemon/test_read_batch.py``).  Not on a link of
several paths.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..transport.link import run_slots
from ..wire import envelope, rdmap, segment, shm
from ..wire import link as wire_link
from ..wire.rdmap import Opcode
from .atombatch import TAKE_MAX, SQScratch, ord_window, queue_requests
from .opcodes import LOCAL_WRITE, RECEIVING, REMOTE_READ, SEND_SIGNALED, U32, WC_RDMA_READ, WR_READ
from .records import Gather, OutWR, PendingRead

_PREFIX = segment.TAGGED_PREFIX_LEN
#: where a request's body starts in its link packet
_BODY_AT = wire_link.HEADER_LEN + envelope.ENVELOPE_LEN + rdmap.ddp.UNTAGGED_HEADER_LEN
_SIZE = slice(12, 16)  # a Read Request body's RDMA Read Message Size (RFC 5040 §4.4)
_SRC_STAG = slice(16, 20)  # and its Data Source STag


class ReadRun:
    """IRRQ entries: the one-segment Read Responses of a batch, their
    headers built in one buffer (run slots), their payloads ``size`` bytes
    at ``offs`` in the region ``view``.  The IRRQ holds this one object once
    per response, so that its length still counts responses (the IRD
    check) and its order is kept; ``sent`` of them have left."""

    __slots__ = ("buf", "offs", "count", "sent", "size", "view", "stride", "slot", "head")

    def __init__(self, buf: Any, offs: Any, count: int, size: int, view: memoryview) -> None:
        self.buf = buf
        self.offs = offs
        self.count = count
        self.size = size
        self.view = view  # (QueuePair.uses_view: the region stays mapped while responses wait)
        self.sent = 0
        self.stride = _PREFIX + size
        self.head, self.slot = run_slots(self.stride)


class ReadScratch:
    """A device's descriptor for ``udpv_read_batch``."""

    __slots__ = ("ffi", "lib", "a", "hdr", "alloc")

    def __init__(self, native: Any) -> None:
        self.ffi = native.ffi
        self.lib = native.lib
        self.a = self.ffi.new("udpv_reads *")
        self.a.prefix = _PREFIX
        self.hdr = self.ffi.buffer(self.a.hdr)
        # not zeroed: every byte a packet takes is written before it leaves
        self.alloc = self.ffi.new_allocator(should_clear_after_alloc=False)


def answer_reads(qp: Any, scratch: ReadScratch, data: bytes, off: int, seg: int, k: int, msn: int) -> int:
    """Answer the first of the ``k`` whole Read Requests the lane took at
    ``data[off:]`` (``seg`` bytes apart, MSN by MSN from ``msn``) that the
    batch may take; return how many (0: none, the Python path takes them all)."""
    if k < 2 or qp.state not in RECEIVING or msn != qp.rx_read_msn or qp.link is None or qp.link.link.multipath:
        return 0
    k = min(k, qp.ird - len(qp.irrq))  # the one that finds the IRRQ full: the Python path's Terminate
    if k < 2:
        return 0
    body = off + _BODY_AT
    size = int.from_bytes(data[body + _SIZE.start:body + _SIZE.stop], "big")
    stag = int.from_bytes(data[body + _SRC_STAG.start:body + _SRC_STAG.stop], "big")
    mr = qp.device.stags.lookup(stag)
    if (size == 0 or size > qp.link.max_data or mr is None or mr.pd is not qp.pd or not mr.access & REMOTE_READ
            or not mr.valid):
        return 0
    a = scratch.a
    a.stag = stag
    a.base = 0 if mr.zero_based else mr.addr
    a.len = mr.length
    a.size = size
    segment.pack_tagged_into(scratch.hdr, 0, qp.dest_qpn, qp.qpn, Opcode.RDMA_READ_RESPONSE, True, 0, 0)
    ffi = scratch.ffi
    head, slot = run_slots(_PREFIX + size)
    out = scratch.alloc("uint8_t[]", k * slot)
    offs = a.src_off = scratch.alloc("uint64_t[]", k)
    src = ffi.from_buffer(data)
    try:
        n = scratch.lib.udpv_read_batch(a, src + body, k, seg, out + head, slot)
    finally:
        ffi.release(src)
    if not n:
        return 0
    run = ReadRun(out, offs, n, size, mr.view)
    qp.rx_read_msn = (msn + n) & U32
    qp.irrq.extend([run] * n)
    qp.device.stats["rx_read_batched"] += n
    return n


def send_read_run(qp: Any, r: ReadRun, room: int) -> int:
    """Send the next responses (at most ``room``) of the batch ``r`` at the
    IRRQ head; return how many.  One alone goes as the Python path sends a
    one-segment Read Response (it may leave at once); more go as one run."""
    irrq: deque[Any] = qp.irrq
    pl = qp.link
    i = r.sent
    j = min(r.count - i, room, pl.link.send_space())
    ffi = qp.device.native.ffi
    if j <= 1:
        irrq.popleft()
        at = r.head + i * r.slot
        buf = bytearray(ffi.buffer(r.buf + at, r.stride))
        src = r.offs[i]
        buf[_PREFIX:] = r.view[src:src + r.size]
        r.sent = i + 1
        qp.send_or_queue(buf)
        return 1
    mem = ffi.from_buffer("uint8_t[]", r.view)
    try:
        # the region's bytes as they are now, when the responses leave
        qp.device.native.lib.udpv_read_fill(r.buf + r.head + i * r.slot, r.slot, _PREFIX, mem, r.offs + i, j,
                                            r.size)
    finally:
        ffi.release(mem)  # no export may outlive the call: deregistration releases the view
    if pl.requests:
        pl.flush_requests()  # as PeerLink.send: requests queued before go first
    pl.link.send_run(memoryview(ffi.buffer(r.buf))[i * r.slot:(i + j) * r.slot], r.stride, j, r.stride)
    for _ in range(j):
        irrq.popleft()
    r.sent = i + j
    return j


# -- the requester's side: an ORD window of Read WQEs taken in one call --------------
_SG_OFFSET = shm.SEND_WQE_SG_OFFSET
_REQ_PREFIX = segment.UNTAGGED_PREFIX_LEN
_REQ_STRIDE = _REQ_PREFIX + rdmap.READ_REQUEST_LEN
_REQ_HEAD, _REQ_SLOT = run_slots(_REQ_STRIDE)


class ReadTake(SQScratch):
    """A QP's descriptor and per-WQE outputs for ``udpv_read_take``."""

    __slots__ = ("wr_id", "raddr", "sink_off", "rkey", "length", "signaled")

    def __init__(self, native: Any) -> None:
        super().__init__(native, "udpv_read_wqes *")
        ffi, t = self.ffi, self.t
        # the arrays live as long as this object: t only points at them
        self.wr_id = t.wr_id = ffi.new("uint64_t[]", TAKE_MAX)
        self.raddr = t.raddr = ffi.new("uint64_t[]", TAKE_MAX)
        self.sink_off = t.sink_off = ffi.new("uint64_t[]", TAKE_MAX)
        self.rkey = t.rkey = ffi.new("uint32_t[]", TAKE_MAX)
        self.length = t.length = ffi.new("uint32_t[]", TAKE_MAX)
        self.signaled = t.signaled = ffi.new("uint8_t[]", TAKE_MAX)
        t.sg_at = _SG_OFFSET
        t.opcode = WR_READ
        t.flags_ok = SEND_SIGNALED
        t.signaled_flag = SEND_SIGNALED
        t.prefix = _REQ_PREFIX
        t.max_len = shm.MAX_MSG_SZ


def take_reads(qp: Any, pl: Any, wqes: int, avail: int) -> int:
    """Take up to ``wqes`` Read WQEs that are alike off ``qp``'s SQ
    (``avail`` posted) in one compiled call, as far as the ORD lets them
    go, and queue their requests on ``pl`` as one run; return how many (0:
    none, the per-WQE path goes on).  The caller has checked that nothing
    else is under way or owed, and the first WQE's flags."""
    k, mr, addr, n = ord_window(qp, wqes, avail)
    if k < 2 or n == 0 or mr is None or mr.check(qp.pd, LOCAL_WRITE, addr, n, tagged=False)[0]:
        return 0
    b = qp._rtake
    if b is None:
        b = qp._rtake = ReadTake(qp.device.native)
    b.describe(qp, avail, mr)
    t = b.t
    segment.pack_untagged_into(b.hdr, 0, qp.dest_qpn, qp.qpn, Opcode.RDMA_READ_REQUEST, True, 0, 0)
    msn, sink = qp.read_msn, qp.next_sink
    t.msn, t.sink = msn & U32, sink
    out = b.alloc("uint8_t[]", k * _REQ_SLOT)
    k = b.lib.udpv_read_take(t, out + _REQ_HEAD, k, _REQ_SLOT)
    if k < 2:
        return 0
    queue_requests(qp, pl, b, out, k, _REQ_STRIDE, _REQ_SLOT, "tx_batched_reads")
    _reads_taken(qp, b, k, mr.view, sink)
    qp.read_msn = msn + k
    qp.next_sink = t.sink
    return k


def _reads_taken(qp: Any, b: ReadTake, k: int, view: memoryview, sink: int) -> None:
    """The records of ``k`` Reads taken, the first one's sink STag
    ``sink``: each waits on the ORRQ for its responses, placed into its
    sink in ``view``."""
    ffi = b.ffi
    ids, raddrs, rkeys, sig, offs, lens = (ffi.unpack(b.wr_id, k), ffi.unpack(b.raddr, k), ffi.unpack(b.rkey, k),
                                           ffi.unpack(b.signaled, k), ffi.unpack(b.sink_off, k),
                                           ffi.unpack(b.length, k))
    outstanding = qp.outstanding
    orrq = qp.orrq
    for i in range(k):
        n = lens[i]
        wr = OutWR(ids[i], WC_RDMA_READ, sig[i] != 0, n)
        wr.rkey = rkeys[i]
        wr.raddr = raddrs[i]
        wr.sink_stag = sink
        sink = (sink + 1) & U32 or 1
        outstanding.append(wr)
        orrq.append(PendingRead(wr, Gather([(view, offs[i], n)])))


# -- the requester's side: a buffer of one-segment Read Responses placed in one call ---------
#: the most Reads one call places
PLACE_MAX = 64


class ReadSinks:
    """A lane's descriptor and sink arrays for ``udpv_read_responses``."""

    __slots__ = ("ffi", "lib", "s", "stag", "size", "off")

    def __init__(self, native: Any) -> None:
        ffi = self.ffi = native.ffi
        self.lib = native.lib
        self.s = ffi.new("udpv_read_sinks *")
        # the arrays live as long as this object: s only points at them
        self.stag = self.s.stag = ffi.new("uint32_t[]", PLACE_MAX)
        self.size = self.s.size = ffi.new("uint32_t[]", PLACE_MAX)
        self.off = self.s.off = ffi.new("uint64_t[]", PLACE_MAX)


def whole_reads(b: ReadSinks, orrq: deque[Any], i: int, view: Any, room: int) -> int:
    """Fill ``b``'s arrays with the sinks of the Reads from ``orrq[i]`` on
    whose responses ``udpv_read_responses`` may place (each one SGE in
    ``view``, nothing placed yet; at most ``room``); return how many."""
    n = 0
    lim = min(len(orrq) - i, PLACE_MAX, room)
    stag, size, off = b.stag, b.size, b.off
    while n < lim:
        rd = orrq[i + n]
        if type(rd) is not PendingRead or rd.placed:
            break
        pieces = rd.gather.pieces
        if len(pieces) != 1 or pieces[0][0] is not view:
            break
        stag[n] = rd.wr.sink_stag
        size[n] = rd.size
        off[n] = pieces[0][1]
        n += 1
    return n


def reads_whole_placed(qp: Any, n: int) -> None:
    """The lane placed the whole responses of the ``n`` Reads at the ORRQ
    head (``udpv_read_responses``): they complete."""
    orrq = qp.orrq
    for _ in range(n):
        rd = orrq.popleft()
        rd.placed = rd.size
        rd.wr.done = True
    qp.device.stats["rx_read_responses_batched"] += n
