"""The atomic batch: a GRO batch of Atomic Requests applied and answered in one compiled call.

Theory of operation
-------------------
An ORD window of Fetch-and-Adds (perftest's ``atomic_bw``) reaches the
responder as one GRO buffer of Atomic Requests, which the receive lane
checks in one call (``rxlane.py``, ``whole`` and ``many``).  Taken one by
one (``Responder._on_atomic_request``), each then cost the responding
daemon its Python: the request decoded, the region looked up and checked,
the word read, changed and written, the response encoded, and when the
pass pumps, its segment packed and queued and, at the flush, framed in
Python.  Here one call of ``udpv_atomic_batch`` (``wire/_native_atomic.c``)
applies the requests that name the one region checked here and builds
their Atomic Responses in one buffer, each in the place its link packet
will have (``run_slots``); the IRRQ keeps them as one record, an
:class:`AtomicRun`, and the pump queues them as one run (``Link.send_run``),
which the compiled framer frames in one call.

Python stays the control plane.  ``answer_atomics`` checks once what the
Python path checks per request and is the same for all of them: the QP
receives, the first request's MSN is the expected one, the IRD leaves
room (the batch is cut where the IRRQ would be full), and the first
request's STag names a region of the QP's PD with remote atomic access.
The C code stops at the first request that names another STag, an unknown
operation, or a word out of bounds or not 8-byte aligned (RFC 7306 §5.2);
that one and everything after it go the per-request way, which produces
the Terminates.  The replay records (a repeated request is answered again,
never applied twice) are the batch's last responses, as the Python path
leaves them.  A device with the batch sends the same datagrams, at the same
points, as one without it (``tests/daemon/test_atomic_batch.py``).  Not on
a link of several paths.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Any

from ..transport.link import run_slots
from ..wire import envelope, rdmap, segment, shm
from ..wire import link as wire_link
from ..wire.rdmap import Opcode
from .opcodes import ATOMIC_WR, LOCAL_WRITE, REMOTE_ATOMIC, RECEIVING, SEND_SIGNALED, U32, wc_opcode
from .records import AtomicReply, Gather, OutWR, PendingAtomic

_PREFIX = segment.UNTAGGED_PREFIX_LEN
_STRIDE = _PREFIX + rdmap.ATOMIC_RESPONSE_LEN
_HEAD, _SLOT = run_slots(_STRIDE)
#: where a request's body starts in its link packet
_BODY_AT = wire_link.HEADER_LEN + envelope.ENVELOPE_LEN + rdmap.ddp.UNTAGGED_HEADER_LEN
_STAG = slice(8, 12)  # an Atomic Request body's STag (RFC 7306 §5.2)


class AtomicRun:
    """IRRQ entries: the Atomic Responses of a batch, built in one buffer
    (run slots).  The IRRQ holds this one object once per response, so
    that its length still counts responses (the IRD check) and its order
    is kept; ``sent`` of them have left."""

    __slots__ = ("buf", "count", "sent")
    view = None  # touches no region after the operation: nothing to release

    def __init__(self, buf: memoryview, count: int) -> None:
        self.buf = buf
        self.count = count
        self.sent = 0

    def body(self, i: int) -> bytes:
        """The ``i``-th response's body (RFC 7306 §5.3)."""
        at = i * _SLOT + _HEAD + _PREFIX
        return bytes(self.buf[at:at + rdmap.ATOMIC_RESPONSE_LEN])


class AtomicScratch:
    """A device's descriptor for ``udpv_atomic_batch``."""

    __slots__ = ("ffi", "lib", "a", "hdr", "alloc")

    def __init__(self, native: Any) -> None:
        self.ffi = native.ffi
        self.lib = native.lib
        self.a = self.ffi.new("udpv_atomics *")
        self.a.prefix = _PREFIX
        self.hdr = self.ffi.buffer(self.a.hdr)
        # not zeroed: every byte a packet takes is written before it leaves
        self.alloc = self.ffi.new_allocator(should_clear_after_alloc=False)


def answer_atomics(qp: Any, scratch: AtomicScratch, data: bytes, off: int, seg: int, k: int, msn: int,
                   replay_keep: int) -> int:
    """Apply and answer the first of the ``k`` whole Atomic Requests the
    lane took at ``data[off:]`` (``seg`` bytes apart, MSN by MSN from
    ``msn``) that the batch may take; return how many (0: none, the
    Python path takes them all)."""
    if k < 2 or qp.state not in RECEIVING or msn != qp.rx_read_msn or qp.link is None or qp.link.link.multipath:
        return 0
    irrq = qp.irrq
    k = min(k, qp.ird - len(irrq))  # the one that finds the IRRQ full: the Python path's Terminate
    if k < 2:
        return 0
    body = off + _BODY_AT
    stag = int.from_bytes(data[body + _STAG.start:body + _STAG.stop], "big")
    mr = qp.device.stags.lookup(stag)
    if mr is None or mr.pd is not qp.pd or not mr.access & REMOTE_ATOMIC or not mr.valid:
        return 0
    a = scratch.a
    a.stag = stag
    a.base = 0 if mr.zero_based else mr.addr
    a.len = mr.length
    segment.pack_untagged_into(scratch.hdr, 0, qp.dest_qpn, qp.qpn, Opcode.ATOMIC_RESPONSE, True, 0, 0)
    # the responses queued ahead of these take the MSNs before theirs
    a.msn = (qp.atomic_resp_msn + sum(1 for r in irrq if type(r) is AtomicRun or type(r) is AtomicReply)) & U32
    ffi = scratch.ffi
    out = scratch.alloc("uint8_t[]", k * _SLOT)
    src = ffi.from_buffer(data)
    mem = ffi.from_buffer("uint8_t[]", mr.view)
    try:
        n = scratch.lib.udpv_atomic_batch(a, src + body, k, seg, mem, out + _HEAD, _SLOT)
    finally:
        ffi.release(mem)  # no export may outlive the call: deregistration releases the view
        ffi.release(src)
    if not n:
        return 0
    run = AtomicRun(memoryview(ffi.buffer(out))[:n * _SLOT], n)
    replay = qp.atomic_replay
    for i in range(max(0, n - replay_keep), n):
        replay[(msn + i) & U32] = run.body(i)
    while len(replay) > replay_keep:
        replay.popitem(last=False)
    qp.rx_read_msn = (msn + n) & U32
    irrq.extend([run] * n)
    qp.device.stats["rx_atomic_batched"] += n
    return n


def send_atomic_run(qp: Any, r: AtomicRun, room: int) -> int:
    """Send the next responses (at most ``room``) of the batch ``r`` at the
    IRRQ head; return how many.  One alone goes as the Python path sends
    an Atomic Response (it may leave at once); more go as one run."""
    irrq: deque[Any] = qp.irrq
    pl = qp.link
    j = min(r.count - r.sent, room, pl.link.send_space())
    if j <= 1:
        irrq.popleft()
        qp.send_untagged(Opcode.ATOMIC_RESPONSE, qp.atomic_resp_msn, r.body(r.sent))
        qp.atomic_resp_msn += 1
        r.sent += 1
        return 1
    if pl.requests:
        pl.flush_requests()  # as PeerLink.send: requests queued before go first
    pl.link.send_run(r.buf[r.sent * _SLOT:(r.sent + j) * _SLOT], _STRIDE, j, _STRIDE)
    for _ in range(j):
        irrq.popleft()
    qp.atomic_resp_msn += j
    r.sent += j
    return j


# -- the requester's side: an ORD window of atomic WQEs taken in one call ---------
_SGE = shm.SGE
_SG_OFFSET = shm.SEND_WQE_SG_OFFSET
_REQ_STRIDE = _PREFIX + rdmap.ATOMIC_REQUEST_LEN
_REQ_HEAD, _REQ_SLOT = run_slots(_REQ_STRIDE)
#: the most WQEs one call takes (an ORD window of the device's default 128 takes two)
TAKE_MAX = 64


class SQScratch:
    """A compiled take's descriptor (cffi ``ctype``, with a segment header
    ``hdr`` and an SQ's ``slots``) and the allocator of its runs."""

    __slots__ = ("ffi", "lib", "t", "hdr", "alloc", "ring")

    def __init__(self, native: Any, ctype: str) -> None:
        ffi = self.ffi = native.ffi
        self.lib = native.lib
        self.t = ffi.new(ctype)
        self.hdr = ffi.buffer(self.t.hdr)
        # a run's buffer is not zeroed: every byte a packet takes is written before it leaves
        self.alloc = ffi.new_allocator(should_clear_after_alloc=False)
        self.ring: Any = None  # the SQ whose slots t points at

    def point_at(self, sq: shm.Ring) -> None:
        """Point the descriptor at ``sq``'s slots (they never move while the QP lives)."""
        if self.ring is not sq:
            self.t.slots = self.ffi.cast("uint8_t *", int(shm.ffi.cast("uintptr_t", sq._slots)))
            self.ring = sq

    def describe(self, qp: Any, avail: int, mr: Any) -> None:
        """Describe ``qp``'s SQ (``avail`` WQEs posted) and the local region
        ``mr`` every WQE's sink must lie in (an ORD window's take)."""
        sq = qp.sq
        self.point_at(sq)
        t = self.t
        t.cons, t.mask, t.entry_size, t.avail = sq.cons, sq.mask, sq.entry_size, avail
        t.sig_all = 1 if qp.sq_sig_all else 0
        t.lkey, t.addr, t.len = mr.stag, mr.addr, mr.length


def ord_window(qp: Any, wqes: int, avail: int) -> tuple[int, Any, int, int]:
    """How many of the next ``wqes`` WQEs (``avail`` posted) an ORD window's
    take may take now, and the first one's SGE: ``(count, its region or
    None, its address, its length)``; a count under 2: none."""
    k = min(wqes, avail, qp.ord - len(qp.orrq), TAKE_MAX)  # the one past the ORD waits, as start_next makes it
    if k < 2:
        return 0, None, 0, 0
    sq = qp.sq
    addr, n, lkey = _SGE.unpack_from(sq.buf, sq.slot_offset() + _SG_OFFSET)
    return k, qp.device.stags.lookup(lkey), addr, n


def queue_requests(qp: Any, pl: Any, b: SQScratch, out: Any, k: int, stride: int, slot: int, counter: str) -> None:
    """The ``k`` requests a take built in ``out`` (run slots of ``slot``
    bytes, each ``stride`` long) leave the SQ and go on ``pl``'s link as one run."""
    qp.sq.pop(k)
    qp.device.stats[counter] += k
    if pl.requests:
        pl.flush_requests()  # requests queued before go first, as they would in one run
    pl.link.send_run(memoryview(b.ffi.buffer(out))[:k * slot], stride, k, stride, ack_carrier=False)


class AtomicTake(SQScratch):
    """A QP's descriptor and per-WQE outputs for ``udpv_atomic_take``."""

    __slots__ = ("wr_id", "raddr", "sink_off", "rkey", "signaled")

    def __init__(self, native: Any) -> None:
        super().__init__(native, "udpv_atomic_wqes *")
        ffi, t = self.ffi, self.t
        # the arrays live as long as this object: t only points at them
        self.wr_id = t.wr_id = ffi.new("uint64_t[]", TAKE_MAX)
        self.raddr = t.raddr = ffi.new("uint64_t[]", TAKE_MAX)
        self.sink_off = t.sink_off = ffi.new("uint64_t[]", TAKE_MAX)
        self.rkey = t.rkey = ffi.new("uint32_t[]", TAKE_MAX)
        self.signaled = t.signaled = ffi.new("uint8_t[]", TAKE_MAX)
        t.sg_at = _SG_OFFSET
        t.flags_ok = SEND_SIGNALED
        t.signaled_flag = SEND_SIGNALED
        t.prefix = _PREFIX


def take_atomics(qp: Any, pl: Any, opcode: int, wqes: int, avail: int) -> int:
    """Take up to ``wqes`` atomic WQEs of ``opcode`` that are alike off
    ``qp``'s SQ (``avail`` posted) in one compiled call, as far as the ORD
    lets them go, and queue their requests on ``pl`` as one run; return how
    many (0: none, the per-WQE path goes on).  The caller has checked that
    nothing else is under way or owed, and the first WQE's flags."""
    k, mr, addr, n = ord_window(qp, wqes, avail)
    if k < 2 or n != 8 or mr is None or mr.check(qp.pd, LOCAL_WRITE, addr, 8, tagged=False)[0]:
        return 0
    b = qp._atake
    if b is None:
        b = qp._atake = AtomicTake(qp.device.native)
    b.describe(qp, avail, mr)
    t = b.t
    t.opcode = opcode
    t.aop = ATOMIC_WR[opcode]
    segment.pack_untagged_into(b.hdr, 0, qp.dest_qpn, qp.qpn, Opcode.ATOMIC_REQUEST, True, 0, 0)
    msn, req_id = qp.read_msn, qp.next_req_id
    t.msn, t.req_id = msn & U32, req_id
    out = b.alloc("uint8_t[]", k * _REQ_SLOT)
    k = b.lib.udpv_atomic_take(t, out + _REQ_HEAD, k, _REQ_SLOT)
    if k < 2:
        return 0
    queue_requests(qp, pl, b, out, k, _REQ_STRIDE, _REQ_SLOT, "tx_batched_atomics")
    _atomics_taken(qp, b, k, wc_opcode(opcode), mr.view, msn, req_id)
    return k


def _atomics_taken(qp: Any, b: AtomicTake, k: int, wc_op: int, view: memoryview, msn: int, req_id: int) -> None:
    """The records of ``k`` atomics taken, the first one's request MSN
    ``msn`` and identifier ``req_id``: each waits on the ORRQ for its
    Atomic Response, whose original value lands in its sink in ``view``."""
    ffi = b.ffi
    ids, raddrs, rkeys, sig, offs = (ffi.unpack(b.wr_id, k), ffi.unpack(b.raddr, k), ffi.unpack(b.rkey, k),
                                     ffi.unpack(b.signaled, k), ffi.unpack(b.sink_off, k))
    outstanding = qp.outstanding
    orrq = qp.orrq
    for i in range(k):
        wr = OutWR(ids[i], wc_op, sig[i] != 0, 8)
        wr.rkey = rkeys[i]
        wr.raddr = raddrs[i]
        wr.atomic_msn = msn + i
        outstanding.append(wr)
        orrq.append(PendingAtomic(wr, Gather([(view, offs[i], 8)]), (req_id + i) & U32))
    qp.read_msn = msn + k
    qp.next_req_id = (req_id + k) & U32


# -- the requester's side: a GRO batch of Atomic Responses completed in one loop -----
_RESPONSE = struct.Struct("!IQ")  # RFC 7306 §5.3: request identifier, original value
_HOST_U64 = struct.Struct("=Q")  # the original value lands in host byte order, as an RNIC's DMA leaves it


def atomics_answered(qp: Any, data: bytes, off: int, seg: int, k: int, msn: int) -> int:
    """Complete the atomics at the ORRQ head that the first of the ``k``
    whole Atomic Responses the lane took at ``data[off:]`` (``seg`` bytes
    apart, MSN by MSN from ``msn``) answer, as ``Completer.on_atomic_response``
    does, while each answers the atomic at the head and its sink is one
    8-byte piece; return how many (the rest, a mismatch's Terminate
    included, are the Python path's)."""
    orrq = qp.orrq
    if qp.state not in RECEIVING or qp.link is None or qp.link.link.multipath:
        return 0
    at = off + _BODY_AT
    unpack = _RESPONSE.unpack_from
    pack = _HOST_U64.pack_into
    i = 0
    while i < k and orrq:
        rd = orrq[0]
        if type(rd) is not PendingAtomic:
            break
        req_id, orig = unpack(data, at)
        pieces = rd.gather.pieces
        if req_id != rd.req_id or len(pieces) != 1 or pieces[0][2] != 8:
            break
        view, base, _ = pieces[0]
        pack(view, base, orig)
        orrq.popleft()
        rd.wr.done = True
        at += seg
        i += 1
    if i:
        qp.rx_atomic_resp_msn = (msn + i) & U32
        qp.device.stats["rx_atomic_responses_batched"] += i
    return i
