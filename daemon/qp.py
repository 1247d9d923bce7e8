"""Completion queues and queue pairs: the RDMAP engine (RFC 5040) of the emulated RNIC.

Theory of operation
-------------------
A ``QueuePair`` owns its SQ and RQ rings (shared memory, ``wire/shm.py``)
and the two read queues of the ExpEther RNIC: the ORRQ (Read Requests this
QP sent, waiting for their Read Responses) and the IRRQ (Read Requests the
peer sent, whose responses this QP still has to send).

Requester side, driven by ``pump``: take the next send WQE, check its local
SGEs (lkey valid, same PD, bounds; a violation completes the WR with
IBV_WC_LOC_PROT_ERR and moves the QP to ERR), then cut the message lazily
into DDP segments that fit the link (``link.send_space()`` bounds how many
are queued, so a 1 GiB Write holds no more memory than the link's window).
A Write (RFC 5040 §5.1) is tagged segments with the peer's STag and the
tagged offset; Write with Immediate adds RFC 7306's Immediate Data message,
which consumes a receive WQE at the target.  A Send (§5.3, with Invalidate
and/or Solicited Event) is untagged segments on queue 0 (MSN per message, MO
per segment) that the target scatters into the next posted receive, in MSN
order; Send with Immediate is a Send followed by Immediate Data, the envelope
flag IMM_FOLLOWS telling the target both fill one receive.  A Read (§5.2) is
one Read Request on untagged queue 1 naming a *sink STag* private to this
ORRQ entry (the sink is the requester's SGE list, so several SGEs work).  An
atomic (RFC 7306 §5) is one Atomic Request on queue 3; it shares the ORRQ
and the ORD/IRD budget with Reads, and its response lands the old value in
the requester's 8-byte SGE in host byte order.

Modified ACK/NACK (RHiNET/PM, ``wire/flow.py``) guards queue 0, the only
queue that needs a posted receive.  The requester keeps every queue-0 message
(``q0``: a reference to the WR's SGEs, not a copy) until the target ACKs it;
a Send WR completes on that ACK, not on the link's, because the target may
have NACKed it.  A target without a posted receive NACKs the MSN with its
``min_rnr_timer`` as back-off hint and drops every later queue-0 segment until
that MSN comes again from MO 0; the requester rewinds to it, waits a back-off
that doubles per try (or until the target's RESUME, sent as soon as a receive
is posted), re-sends, and starts nothing new until the NACKed message is
accepted.  ``rnr_retry`` NACKs (7 = forever) end the WR with
IBV_WC_RNR_RETRY_EXC_ERR.  Tagged Writes and Reads are never NACKed: their
placement needs no receive, and verbs orders only their completions.

Completions keep SQ order (verbs RC semantics): ``outstanding`` is the
in-flight WRs in posting order; a Write is complete when the link has
acknowledged its last message (``link.acked``), a Read when its last Read
Response segment is placed.  Unsignaled successful WRs produce no CQE;
errors always do.

Responder side, driven by ``on_segment``: every tagged segment is checked
(RFC 5040 §6.4: STag, PD, access, bounds) *before* a byte is written; a
violation writes nothing, sends a Terminate (RFC 5040 §4.8) carrying the
offending DDP header, and moves the QP to ERR.  Read Requests are answered
from the source region by the daemon alone, bounded by IRD.

ERR is sticky: every outstanding and later-posted WR completes with
IBV_WC_WR_FLUSH_ERR (send and receive queues alike).
"""

from __future__ import annotations

import collections
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from ..transport.ackhold import AckHold
from ..wire import envelope, flow, rdmap, segment, shm
from ..wire.envelope import Kind
from ..wire.flow import FlowMessage, FlowType
from ..wire.rdmap import AtomicOp, Opcode
from ..wire.shm import (
    AccessFlags as A,
    EventType,
    QPState as S,
    SendFlags,
    WcFlags,
    WcOpcode,
    WcStatus as W,
    WrOpcode,
)
from . import tables

if TYPE_CHECKING:
    from .device import Device, PeerLink

log = logging.getLogger("udpverbs.daemon")

_TAGGED_PREFIX = segment.TAGGED_PREFIX_LEN
_UNTAGGED_PREFIX = segment.UNTAGGED_PREFIX_LEN
_UNTAGGED_EXTRA = _UNTAGGED_PREFIX - _TAGGED_PREFIX  # an untagged header is 4 bytes longer
#: WQEs a pump turn takes before it sends what it has queued.  Without it a
#: turn took a whole window of small Sends (128) and sent them at its end;
#: the receiver read them in one pass and sent one Modified ACK for all, so
#: the application could post again only when the whole window had gone
#: round (send_bw -s 64: 61,000 Sends/s, neither daemon more than half
#: busy).  Every 32: 87,000; every 64 (a full UDP_SEGMENT call): 76,000.
#: Large messages take a few WQEs per turn and never reach it.
_FLUSH_EVERY = 32
_U32 = 0xFFFFFFFF
_RECEIVING = (S.IBV_QPS_RTR, S.IBV_QPS_RTS, S.IBV_QPS_SQD)
# Plain ints on the per-segment path: IntFlag's & costs microseconds.
_SEND_WR = (WrOpcode.IBV_WR_SEND, WrOpcode.IBV_WR_SEND_WITH_IMM, WrOpcode.IBV_WR_SEND_WITH_INV)
_ATOMIC_WR = {WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD: AtomicOp.FETCH_ADD,
              WrOpcode.IBV_WR_ATOMIC_CMP_AND_SWP: AtomicOp.CMP_SWAP}
_SUPPORTED_WR = (WrOpcode.IBV_WR_RDMA_WRITE, WrOpcode.IBV_WR_RDMA_WRITE_WITH_IMM, WrOpcode.IBV_WR_RDMA_READ,
                 *_SEND_WR, *_ATOMIC_WR)
#: (invalidate, solicited) -> RDMAP opcode of a Send (RFC 5040 §5.3)
_SEND_OPCODE = {(False, False): Opcode.SEND, (False, True): Opcode.SEND_SE,
                (True, False): Opcode.SEND_INVALIDATE, (True, True): Opcode.SEND_SE_INVALIDATE}
_Q0_OPCODES = frozenset({Opcode.SEND, Opcode.SEND_SE, Opcode.SEND_INVALIDATE, Opcode.SEND_SE_INVALIDATE,
                         Opcode.IMMEDIATE_DATA, Opcode.IMMEDIATE_DATA_SE})
_IMM_FOLLOWS = int(envelope.Flags.IMM_FOLLOWS)
_FLOW_ACK = int(envelope.Flags.FLOW_ACK)
_FLOW_ACK_LEN = envelope.FLOW_ACK_LEN
_REMOTE_ATOMIC = int(A.IBV_ACCESS_REMOTE_ATOMIC)
_U64 = 0xFFFFFFFFFFFFFFFF
_HOST_ORDER = sys.byteorder  # atomics operate on host-order words, as verbs applications expect
#: IB's RNR timer encoding (IBA table 45): min_rnr_timer code -> microseconds.
RNR_TIMER_US = (655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120,
                7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520)
#: The longest RNR back-off a sender waits before it tries again (a RESUME ends it sooner).
RNR_BACKOFF_MAX_S = 1.0
#: Atomic responses a responder keeps to answer a repeated request without applying it twice.
ATOMIC_REPLAY = 16
_REMOTE_WRITE = int(A.IBV_ACCESS_REMOTE_WRITE)
_REMOTE_READ = int(A.IBV_ACCESS_REMOTE_READ)
_LOCAL_WRITE = int(A.IBV_ACCESS_LOCAL_WRITE)
_RTS = int(S.IBV_QPS_RTS)
_OP_WRITE = int(Opcode.RDMA_WRITE)
_SEND_FENCE = int(SendFlags.IBV_SEND_FENCE)
_SEND_SIGNALED = int(SendFlags.IBV_SEND_SIGNALED)
_SEND_INLINE = int(SendFlags.IBV_SEND_INLINE)
_SEND_SOLICITED = int(SendFlags.IBV_SEND_SOLICITED)
_WR_READ = int(WrOpcode.IBV_WR_RDMA_READ)
_WR_WRITE = int(WrOpcode.IBV_WR_RDMA_WRITE)
_WR_SEND_WITH_INV = int(WrOpcode.IBV_WR_SEND_WITH_INV)
#: Sends that are one queue-0 message (with Immediate Data, two)
_ONE_MESSAGE_SEND = (int(WrOpcode.IBV_WR_SEND), _WR_SEND_WITH_INV)
_WC_SUCCESS = int(W.IBV_WC_SUCCESS)
_WC_RECV = int(WcOpcode.IBV_WC_RECV)
_OP_SEND_SE = int(Opcode.SEND_SE)
_SEND_WQE_HEAD = shm.SEND_WQE_HEAD
_SG_OFFSET = shm.SEND_WQE_SG_OFFSET
_SGE = shm.SGE
_SGE_SIZE = shm.SGE_SIZE
_RECV_WQE_HEAD = shm.RECV_WQE_HEAD
_RECV_SG_OFFSET = shm.RECV_WQE_SG_OFFSET
_CQE = shm.CQE
_OP_READ_RESPONSE = int(Opcode.RDMA_READ_RESPONSE)
_OP_READ_REQUEST = int(Opcode.RDMA_READ_REQUEST)
_OP_ATOMIC_REQUEST = int(Opcode.ATOMIC_REQUEST)


def _send_rdmap(opcode: int, flags: int, imm: int) -> tuple[int, int]:
    """The RDMAP opcode of a one-message Send WR (IBV_WR_SEND, or
    IBV_WR_SEND_WITH_INV with the STag in ``imm``) and the STag it
    invalidates (0: none)."""
    inv = opcode == _WR_SEND_WITH_INV
    return _SEND_OPCODE[inv, bool(flags & _SEND_SOLICITED)], imm if inv else 0


# tables check codes -> (Terminate error code, requester WC status)
_TERM_CODE = {
    tables.INVALID_STAG: rdmap.RdmapErrorCode.INVALID_STAG,
    tables.BOUNDS: rdmap.RdmapErrorCode.BASE_OR_BOUNDS_VIOLATION,
    tables.ACCESS: rdmap.RdmapErrorCode.ACCESS_RIGHTS_VIOLATION,
    tables.WRONG_PD: rdmap.RdmapErrorCode.STAG_NOT_ASSOCIATED_WITH_STREAM,
}


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
        self.ring = shm.Ring(self.mm, 0, "struct uv_cqe", self.entries, init=True)
        self.eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
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
        r.publish()
        shm.full_fence()  # the CQE must be visible before we read ``armed`` (the app does the mirror)
        hdr = r.hdr
        if hdr.armed and (solicited or status or not hdr.solicited_only):
            # Armed by req_notify: one event, then disarmed (verbs semantics).
            hdr.armed = 0
            if self.channel is not None:
                hdr.event_pending = 1
                _signal(self.channel.eventfd)
            else:
                _signal(self.eventfd)
        return True

    def close(self) -> None:
        self.fd = _release_segment(self.fd, self.mm, self.ring)
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
        self.fd = _release_segment(self.fd, self.mm, self.ring)


def _release_segment(fd: int, mm: Any, *rings: shm.Ring) -> int:
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


class OutWR:
    """A send WR between being taken from the SQ and its completion."""

    __slots__ = ("wr_id", "wc_opcode", "signaled", "byte_len", "last_n", "done", "status",
                 "rkey", "raddr", "sink_stag", "q0_last", "atomic_msn")

    def __init__(self, wr_id: int, wc_opcode: int, signaled: bool, byte_len: int) -> None:
        self.wr_id = wr_id
        self.wc_opcode = wc_opcode
        self.signaled = signaled
        self.byte_len = byte_len
        self.last_n = -1  # link message number of the last message; -1 until all are queued
        self.done = False  # complete regardless of link acks (Read placed, or failed)
        self.status = _WC_SUCCESS
        self.rkey = 0
        self.raddr = 0
        self.sink_stag = -1
        # MSN of the WR's last queue-0 message (Send, Immediate Data): such a WR
        # completes when the receiver accepts that message (Modified ACK), not
        # when the link acknowledges it, because the receiver may NACK it.
        self.q0_last = -1
        self.atomic_msn = -1  # queue-3 MSN of an Atomic Request


def _lane_run(remaining: int, contiguous: int, max_data: int, room: int, space: int) -> tuple[int, int, bool]:
    """How many of a message's next segments the send lane builds in one go:
    ``(count, the last one's payload length, whether it is the message's
    last)``; count 0 (fewer than two): the per-segment path.

    ``remaining``: the message's bytes not yet sent, ``contiguous`` of them
    in one buffer; ``room``, ``space``: segments the pump and the link take.
    """
    if remaining <= contiguous:
        segments = -(-remaining // max_data)
    else:
        segments = contiguous // max_data  # whole segments: the one spanning two SGEs goes by copy_out
    k = min(segments, room, space)
    if k < 2:
        return 0, 0, False
    if k == segments and remaining <= contiguous:
        return k, remaining - (k - 1) * max_data, True
    return k, max_data, False


class _Gather:
    """A resolved SGE list: (view, offset, length) pieces and a cursor."""

    __slots__ = ("pieces", "total", "idx", "off")

    def __init__(self, pieces: list[tuple[memoryview, int, int]]) -> None:
        self.pieces = pieces
        total = 0
        for p in pieces:  # a generator under sum() cost 0.17 µs of every WQE's and receive's resolution
            total += p[2]
        self.total = total
        self.idx = 0
        self.off = 0

    def rewind(self) -> None:
        """Start gathering from the first byte again (a NACKed Send is re-sent whole)."""
        self.idx = 0
        self.off = 0

    def skip(self, n: int) -> None:
        """Move the cursor ``n`` bytes on, within the current piece (the send
        lane copied them)."""
        self.off += n
        if self.off == self.pieces[self.idx][2]:
            self.idx += 1
            self.off = 0

    def copy_out(self, buf: bytearray, pos: int, n: int) -> None:
        """Copy the next ``n`` bytes of the gather list into ``buf[pos:]``."""
        pieces = self.pieces
        while n:
            view, base, length = pieces[self.idx]
            k = min(n, length - self.off)
            buf[pos:pos + k] = view[base + self.off:base + self.off + k]
            pos += k
            n -= k
            self.off += k
            if self.off == length:
                self.idx += 1
                self.off = 0

    def scatter(self, offset: int, data: memoryview) -> None:
        """Place ``data`` at message offset ``offset`` (bounds checked by the caller)."""
        n = len(data)
        pos = 0
        for view, base, length in self.pieces:
            if offset >= length:
                offset -= length
                continue
            k = min(n - pos, length - offset)
            view[base + offset:base + offset + k] = data[pos:pos + k]
            pos += k
            offset = 0
            if pos == n:
                return


class _Sending:
    """The RDMA Write the requester is segmenting now."""

    __slots__ = ("wr", "gather", "sent", "with_imm", "imm", "solicited", "seg")

    def __init__(self, wr: OutWR, gather: _Gather, with_imm: bool, imm: int, solicited: bool, seg: int) -> None:
        self.wr = wr
        self.gather = gather
        self.sent = 0
        self.with_imm = with_imm
        self.imm = imm
        self.solicited = solicited
        self.seg = seg  # each segment's payload (PeerLink.segment_size)


class _Q0Msg:
    """A queue-0 message (Send, or Immediate Data when ``gather`` is None) kept
    until the receiver accepts it, so a receiver-not-ready NACK can have it re-sent."""

    __slots__ = ("msn", "wr", "gather", "opcode", "inv_stag", "flags", "imm", "sent", "seg")

    def __init__(self, msn: int, wr: OutWR, gather: _Gather | None, opcode: int, inv_stag: int = 0,
                 flags: int = 0, imm: int = 0, seg: int = 0) -> None:
        self.msn = msn  # unwrapped; the wire carries msn & 0xFFFFFFFF
        self.wr = wr
        self.gather = gather
        self.opcode = opcode
        self.inv_stag = inv_stag
        self.flags = flags
        self.imm = imm
        self.sent = 0
        self.seg = seg  # each segment's payload (PeerLink.segment_size); 0: as many as fit


class _PendingAtomic:
    """An ORRQ entry for an Atomic Request: where the original value goes."""

    __slots__ = ("wr", "gather", "req_id")

    def __init__(self, wr: OutWR, gather: _Gather, req_id: int) -> None:
        self.wr = wr
        self.gather = gather
        self.req_id = req_id


class _AtomicReply:
    """An IRRQ entry: an Atomic Response body waiting its turn behind earlier Read Responses."""

    __slots__ = ("body",)
    view = None  # touches no region after the operation: nothing to release

    def __init__(self, body: bytes) -> None:
        self.body = body


class _PendingRead:
    """An ORRQ entry: a Read Request sent, its responses being placed."""

    __slots__ = ("wr", "gather", "size", "placed")

    def __init__(self, wr: OutWR, gather: _Gather) -> None:
        self.wr = wr
        self.gather = gather
        self.size = gather.total
        self.placed = 0


class _ReadResponse:
    """An IRRQ entry: a Read Request accepted, its response being sent."""

    __slots__ = ("view", "off", "size", "sink_stag", "sink_to", "sent", "seg")

    def __init__(self, view: memoryview, off: int, size: int, sink_stag: int, sink_to: int, seg: int) -> None:
        self.view = view
        self.off = off
        self.size = size
        self.sink_stag = sink_stag
        self.sink_to = sink_to
        self.sent = 0
        self.seg = seg  # each segment's payload (PeerLink.segment_size)


class QueuePair:
    """One RC queue pair: rings, attributes, state, and the RDMAP engine."""

    def __init__(self, device: "Device", qpn: int, session: Any, pd: tables.ProtectionDomain,
                 send_cq: CompletionQueue, recv_cq: CompletionQueue, caps: dict[str, int],
                 sq_sig_all: bool, srq: SharedReceiveQueue | None = None) -> None:
        self.device = device
        self.qpn = qpn
        self.session = session
        self.pd = pd
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.caps = caps
        self.sq_sig_all = sq_sig_all
        layout = shm.QPLayout(shm.round_entries(caps["max_send_wr"]), shm.round_entries(caps["max_recv_wr"]))
        self.layout = layout
        self.fd, self.mm = shm.new_segment(layout.size, "uv-qp")
        self.sq = shm.Ring(self.mm, layout.sq_offset, "struct uv_send_wqe", layout.sq_entries, init=True)
        self.rq = shm.Ring(self.mm, layout.rq_offset, "struct uv_recv_wqe", layout.rq_entries, init=True)
        self.srq = srq
        # Where receives come from: the QP's own RQ, or its SRQ (then the RQ stays empty).
        self.recv_ring = srq.ring if srq is not None else self.rq
        self.max_recv_sge = srq.max_sge if srq is not None else caps["max_recv_sge"]
        self.state = S.IBV_QPS_RESET
        self.attrs: dict[str, Any] = {
            "qp_access_flags": 0, "pkey_index": 0, "port_num": 1, "path_mtu": 5, "timeout": 14,
            "retry_cnt": 7, "rnr_retry": 7, "min_rnr_timer": 0, "rq_psn": 0, "sq_psn": 0,
            "max_rd_atomic": 1, "max_dest_rd_atomic": 1, "dest_qp_num": 0, "dlid": 0,
            "dgid": bytes(16), "sq_draining": 0,
        }
        self.link: PeerLink | None = None
        self.dest_qpn = 0
        self.rank = 0  # place in the device's QP table (the order in which a pass visits QPs)
        self._reset_engine()

    def _reset_engine(self) -> None:
        self.outstanding: collections.deque[OutWR] = collections.deque()
        self.sending: _Sending | None = None
        self.orrq: collections.deque[_PendingRead] = collections.deque()
        self.irrq: collections.deque[_ReadResponse] = collections.deque()
        # RFC 5041 §5.3: MSN starts at 1 on each untagged queue.  Kept unwrapped
        # here; the wire carries the low 32 bits.
        self.read_msn = 1
        self.send_msn = 1
        self.term_msn = 1
        self.atomic_msn = 1
        self.atomic_resp_msn = 1
        self.next_req_id = 1
        # Requester side of Modified ACK/NACK: queue-0 messages not yet accepted.
        self.q0: collections.deque[_Q0Msg] = collections.deque()
        self.q0_cursor = 0  # index in q0 of the next message (or segment) to send
        self.rnr_until: float | None = None  # backing off after an RNR NACK until then
        self.rnr_blocked_msn = -1  # NACKed MSN: nothing new goes until it is accepted
        self.rnr_tries = 0
        self.next_sink = 1
        self.rx_write_bytes = 0
        self.rx_msn = 1  # next MSN expected on untagged queue 0 (Send, Immediate Data)
        self.rx_recv: tuple[int, _Gather | None] | None = None  # receive WQE being filled
        # (ring consumer index, STag table version, peek_receive's answer) of the last look
        self._rx_peeked: tuple[int, int, tuple[int, _Gather | None]] | None = None
        # (SGE, access, STag table version, pieces) of the last one-SGE WQE list resolved (``_resolve``)
        self._resolved: tuple[tuple[int, int, int], int, int, list[tuple[memoryview, int, int]]] | None = None
        self.rx_placed = 0
        self.rx_imm_pending = False  # a Send with IMM_FOLLOWS placed; its Immediate Data completes it
        # Responder side of Modified ACK/NACK.
        self.rx_rnr = False  # NACKed rx_msn: drop queue-0 messages until it comes again from MO 0
        self.rx_resume_sent = False
        self.flow_ack_due = False
        # Our answers carry our Modified ACKs (envelope FLOW_ACK): once this
        # QP is seen to Send soon after it takes a Send, an owed ACK waits
        # for the answer (up to the link's delayed-ACK time) instead of
        # leaving alone at once (transport/ackhold.py).
        self.flow_hold = AckHold()
        # the Write segment header packer for the current peer QP (segment.tagged_packer)
        self._write_packer: Any = None
        self._write_packer_dest = -1
        self.rx_atomic_msn = 1
        self.rx_read_msn = 1  # the MSN of the next Read Request (queue 1), as the compiled lane expects it
        self.rx_atomic_resp_msn = 1  # and of the next Atomic Response (queue 4)
        self.atomic_replay: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self.terminated = False

    # -- control path -------------------------------------------------------
    @property
    def ord(self) -> int:
        return max(1, int(self.attrs["max_rd_atomic"]))

    @property
    def ird(self) -> int:
        return max(1, int(self.attrs["max_dest_rd_atomic"]))

    def set_state(self, new: int) -> None:
        """Enter ``new`` (already validated): RESET discards, ERR flushes."""
        old = self.state
        self.state = new
        self.device.qp_changed(self)
        if new == S.IBV_QPS_RESET:
            # Discard whatever is queued: RESET empties both work queues.
            try:
                self.sq.pop(self.sq.available())
                self.rq.pop(self.rq.available())
            except shm.RingError:
                pass
            self._reset_engine()
            self.device.detach_link(self)
        elif new == S.IBV_QPS_ERR and old != S.IBV_QPS_ERR:
            self.flush()

    def fatal(self, reason: str, event: int = EventType.IBV_EVENT_QP_FATAL) -> None:
        """Move to ERR after a protocol or local error; tell the app asynchronously."""
        if self.state == S.IBV_QPS_ERR:
            return
        log.info("qp %d -> ERR: %s", self.qpn, reason)
        self.set_state(S.IBV_QPS_ERR)
        self.session.async_event(event, self.qpn)

    def uses_view(self, view: memoryview) -> bool:
        """True if an in-flight WR or Read Response references ``view`` (an MR's mapping)."""
        if self.sending is not None and any(p[0] is view for p in self.sending.gather.pieces):
            return True
        if any(p[0] is view for m in self.q0 if m.gather is not None for p in m.gather.pieces):
            return True
        if any(p[0] is view for rd in self.orrq for p in rd.gather.pieces):
            return True
        return any(r.view is view for r in self.irrq)

    def close(self) -> None:
        self.fd = _release_segment(self.fd, self.mm, self.sq, self.rq)

    # -- completions --------------------------------------------------------
    def _complete(self, wr: OutWR) -> None:
        if wr.status != _WC_SUCCESS or wr.signaled:
            self.send_cq.push(wr.wr_id, wr.status, wr.wc_opcode, wr.byte_len if wr.status == 0 else 0,
                              self.qpn, self.dest_qpn)

    def complete_acked(self, acked: int) -> bool:
        """Retire WRs at the head of the SQ that are done or that the link
        acknowledged below ``acked`` (-1: only those done); return True if any."""
        q = self.outstanding
        progressed = False
        while q:
            wr = q[0]
            if not (wr.done or (0 <= wr.last_n < acked)):
                break
            q.popleft()
            self._complete(wr)
            progressed = True
        return progressed

    def flush(self) -> None:
        """Complete everything outstanding and queued with IBV_WC_WR_FLUSH_ERR."""
        for wr in self.outstanding:
            if wr.status == W.IBV_WC_SUCCESS:
                wr.status = W.IBV_WC_WR_FLUSH_ERR
            self._complete(wr)
        self.outstanding.clear()
        self.sending = None
        self.q0.clear()
        self.q0_cursor = 0
        self.rnr_until = None
        self.rnr_blocked_msn = -1
        if self.rx_recv is not None:  # a receive half filled by a Send
            self.recv_cq.push(self.rx_recv[0], W.IBV_WC_WR_FLUSH_ERR, WcOpcode.IBV_WC_RECV, 0, self.qpn,
                              self.dest_qpn)
            self.rx_recv = None
        self.orrq.clear()
        self.irrq.clear()
        self.flush_rings()

    def flush_rings(self) -> bool:
        """In ERR: complete newly posted WQEs with FLUSH_ERR.  Returns True if any."""
        did = False
        try:
            n = self.sq.available()
        except shm.RingError:
            n = 0
        for i in range(n):
            w = self.sq.peek(i)
            self.send_cq.push(w.wr_id, W.IBV_WC_WR_FLUSH_ERR, _wc_opcode(w.opcode), 0, self.qpn, self.dest_qpn)
        if n:
            self.sq.pop(n)
            did = True
        try:
            n = self.rq.available()
        except shm.RingError:
            n = 0
        for i in range(n):
            w = self.rq.peek(i)
            self.recv_cq.push(w.wr_id, W.IBV_WC_WR_FLUSH_ERR, WcOpcode.IBV_WC_RECV, 0, self.qpn, self.dest_qpn)
        if n:
            self.rq.pop(n)
            did = True
        return did

    # -- requester ----------------------------------------------------------
    def _resolve(self, buf: memoryview, sg_offset: int, n: int, access: int, keep: bool = False) -> _Gather | None:
        """Resolve the SGE list at ``buf[sg_offset:]`` against the STag table; None on violation.

        ``keep`` (a WQE's list): a one-SGE list that is the last one kept,
        with the table unchanged since, gets that answer again.  An
        application posts the same buffer over and over (perftest does),
        and the lookup and the check were about 1.2 µs of a one-SGE list's
        resolution (timed on a receive's, in one process; send_bw 1,009 →
        1,057 MB/s, write_bw 1,186 → 1,208).  The QP's PD never
        changes, and a registration or an invalidation moves the table's
        version.  A receive's list is not kept: it is resolved ahead, in
        the hand-over after a Send (``Device._arm``), and a cheaper one
        there made ``send_lat`` 0.5–2.4 µs slower (the history's thirtieth round)."""
        stags = self.device.stags
        version = stags.version
        if keep and n == 1:
            sge = _SGE.unpack_from(buf, sg_offset)
            kept = self._resolved
            if kept is not None and kept[0] == sge and kept[1] == access and kept[2] == version:
                return _Gather(kept[3])
        pieces = []
        unpack_sge = _SGE.unpack_from
        for i in range(n):
            addr, length, lkey = unpack_sge(buf, sg_offset + i * _SGE_SIZE)
            if length == 0:
                continue
            mr = stags.lookup(lkey)
            if mr is None:
                return None
            code, off = mr.check(self.pd, access, addr, length, tagged=False)
            if code:
                return None
            pieces.append((mr.view, off, length))
        if keep and n == 1:
            self._resolved = (sge, access, version, pieces)
        return _Gather(pieces)

    def _start_next(self) -> int:
        """Take the next WQE off the SQ if the engine can; return how many
        link messages that queued (a one-segment RDMA Write's or Send's
        segment is queued, or sent, at once; other WQEs' messages as the
        pump comes back to them), or -1 if no WQE was taken."""
        sq = self.sq
        try:
            if not sq.available():
                return -1
        except shm.RingError as e:
            self.fatal(f"send queue corrupt: {e}")
            return 0
        buf = sq.buf
        at = sq.slot_offset()
        # One unpack for the whole WQE header: cffi would cost a call per field.
        (wr_id, raddr, opcode, flags, num_sge, imm, rkey, inline_len, compare_add,
         swap) = _SEND_WQE_HEAD.unpack_from(buf, at)
        reads_remote = opcode == _WR_READ or opcode in _ATOMIC_WR
        if reads_remote and len(self.orrq) >= self.ord:
            return -1  # ORD reached: wait for a response (RFC 5040 §6.5; atomics share it, RFC 7306 §6)
        if flags & _SEND_FENCE and self.orrq:
            return -1  # fence: earlier Reads and atomics must finish first
        signaled = bool(self.sq_sig_all or flags & _SEND_SIGNALED)
        status = _WC_SUCCESS
        gather = None
        msg = None  # a one-segment RDMA Write's or Send's segment, built here (see below)
        send_op = inv_stag = 0  # such a Send's RDMAP opcode and the STag it invalidates
        if opcode not in _SUPPORTED_WR:
            status = W.IBV_WC_LOC_QP_OP_ERR
        elif flags & _SEND_INLINE and not reads_remote:
            n = inline_len
            if n > min(shm.MAX_INLINE, self.caps["max_inline_data"]):
                status = W.IBV_WC_LOC_LEN_ERR
            elif opcode == _WR_WRITE and n <= self.link.max_data:  # type: ignore[union-attr]
                # straight from the WQE, before its slot goes back to the application
                msg = self._write_segment(n, rkey, raddr)
                msg[_TAGGED_PREFIX:] = buf[at + _SG_OFFSET:at + _SG_OFFSET + n]
            elif opcode in _ONE_MESSAGE_SEND and n <= self.link.max_data - _UNTAGGED_EXTRA \
                    and self.q0_cursor == len(self.q0):  # type: ignore[union-attr]
                send_op, inv_stag = _send_rdmap(opcode, flags, imm)
                msg = self._send_segment(send_op, inv_stag, n)
                msg[_UNTAGGED_PREFIX:_UNTAGGED_PREFIX + n] = buf[at + _SG_OFFSET:at + _SG_OFFSET + n]
            else:
                data = bytes(buf[at + _SG_OFFSET:at + _SG_OFFSET + n])
                gather = _Gather([(memoryview(data), 0, n)] if n else [])
        elif num_sge > self.caps["max_send_sge"]:
            status = W.IBV_WC_LOC_LEN_ERR
        else:
            gather = self._resolve(buf, at + _SG_OFFSET, num_sge, _LOCAL_WRITE if reads_remote else 0, keep=True)
            if gather is None:
                status = W.IBV_WC_LOC_PROT_ERR
            elif gather.total > shm.MAX_MSG_SZ:
                status = W.IBV_WC_LOC_LEN_ERR  # longer than the port's max_msg_sz
            elif opcode in _ATOMIC_WR and gather.total != 8:
                status = W.IBV_WC_LOC_LEN_ERR  # the original value is one 64-bit word
        if gather is not None and status == _WC_SUCCESS:
            if opcode == _WR_WRITE and gather.total <= self.link.max_data:  # type: ignore[union-attr]
                msg = self._write_segment(gather.total, rkey, raddr)
                gather.copy_out(msg, _TAGGED_PREFIX, gather.total)
            elif (opcode in _ONE_MESSAGE_SEND and self.q0_cursor == len(self.q0)
                    and gather.total <= self.link.max_data - _UNTAGGED_EXTRA):  # type: ignore[union-attr]
                send_op, inv_stag = _send_rdmap(opcode, flags, imm)
                msg = self._send_segment(send_op, inv_stag, gather.total)
                gather.copy_out(msg, _UNTAGGED_PREFIX, gather.total)
        if msg is not None:
            # A one-segment RDMA Write or Send: queued (or sent) now, with no
            # gather list or message under way for the pump to come back to
            # (a Write: 3 µs of an inline write_lat hop in one process, 1 µs
            # with an SGE), and before the WR's bookkeeping, which the peer
            # does not wait for.
            if opcode == _WR_WRITE:
                num = self._send_or_queue(msg, taking=1)
                wr = OutWR(wr_id, _wc_opcode(opcode), signaled, len(msg) - _TAGGED_PREFIX)
                self._taken(wr, rkey, raddr)
                self._write_queued(wr, num)  # type: ignore[arg-type]
                return 1
            # A Send completes on the peer's Modified ACK, which carries the
            # link's ACK too: the link need not ask for one at once.
            self._send_or_queue(msg, ack_now=False, taking=1)
            n = gather.total if gather is not None else inline_len
            wr = OutWR(wr_id, _WC_SEND, signaled, n)
            self._taken(wr, rkey, raddr)
            # kept until the Modified ACK: an RNR NACK has it sent again
            if gather is None:  # inline: the bytes that left
                gather = _Gather([(memoryview(msg), _UNTAGGED_PREFIX, n)])
            m = _Q0Msg(self.send_msn, wr, gather, send_op, inv_stag)
            m.sent = n
            self._queue_q0(m)
            self.q0_cursor += 1
            return 1
        wr = OutWR(wr_id, _wc_opcode(opcode), signaled, 0 if gather is None else gather.total)
        if reads_remote and status == _WC_SUCCESS and gather is not None:
            # A Read or atomic request leaves before the WR's bookkeeping
            # too: the responder answers it at once.
            if opcode == _WR_READ:
                self._send_read_request(wr, gather, rkey, raddr)
            else:
                self._send_atomic_request(wr, gather, _ATOMIC_WR[opcode], rkey, raddr, compare_add, swap)
            self._taken(wr, rkey, raddr)
            return 0
        self._taken(wr, rkey, raddr)
        if status != _WC_SUCCESS or gather is None:
            wr.status = status if status != _WC_SUCCESS else W.IBV_WC_GENERAL_ERR
            wr.done = True
            self.fatal(f"local error on wr {wr.wr_id}: {W(wr.status).name}", EventType.IBV_EVENT_QP_REQ_ERR)
            return 0
        solicited = bool(flags & _SEND_SOLICITED)
        if opcode in _SEND_WR:
            # RFC 5040 §5.3: Send, with Invalidate (the STag rides in the header)
            # and/or Solicited Event; with Immediate it is followed by RFC 7306
            # Immediate Data that completes the same receive (envelope IMM_FOLLOWS).
            inv = opcode == WrOpcode.IBV_WR_SEND_WITH_INV
            with_imm = opcode == WrOpcode.IBV_WR_SEND_WITH_IMM
            # A stream's Send may be cut evenly, unless we owe the peer a
            # Modified ACK: its last segment should carry it, and in an
            # equal cut the trailer does not fit (_send_q0_segments).
            stream = len(self.outstanding) > 1 and not self.flow_ack_due
            seg = self.link.segment_size(gather.total, stream, untagged=True)  # type: ignore[union-attr]
            self._queue_q0(_Q0Msg(self.send_msn, wr, gather, _SEND_OPCODE[inv, solicited and not with_imm],
                                  imm if inv else 0, _IMM_FOLLOWS if with_imm else 0, seg=seg))
            if with_imm:
                self._queue_q0(_Q0Msg(self.send_msn, wr, None,
                                      Opcode.IMMEDIATE_DATA_SE if solicited else Opcode.IMMEDIATE_DATA, imm=imm))
        else:
            # another WR outstanding: a stream's message, which may be cut evenly
            seg = self.link.segment_size(gather.total, len(self.outstanding) > 1)  # type: ignore[union-attr]
            self.sending = _Sending(wr, gather, opcode == WrOpcode.IBV_WR_RDMA_WRITE_WITH_IMM, imm, solicited, seg)
        return 0

    def _taken(self, wr: OutWR, rkey: int, raddr: int) -> None:
        """The WQE ``wr`` was made from leaves the SQ; the WR waits for its completion."""
        self.sq.pop()
        wr.rkey, wr.raddr = rkey, raddr
        self.outstanding.append(wr)

    def _tagged_packer(self) -> Any:
        """The header packer of this QP's RDMA Write segments (``segment.tagged_packer``)."""
        if self._write_packer_dest != self.dest_qpn:
            self._write_packer = segment.tagged_packer(self.dest_qpn, self.qpn, Opcode.RDMA_WRITE)
            self._write_packer_dest = self.dest_qpn
        return self._write_packer

    def _write_segment(self, n: int, rkey: int, raddr: int) -> bytearray:
        """The only segment of an RDMA Write of ``n`` bytes, its header
        packed; the caller copies the payload in."""
        msg = bytearray(_TAGGED_PREFIX + n)
        self._tagged_packer()(msg, True, rkey, raddr)
        return msg

    def _send_segment(self, send_op: int, inv_stag: int, n: int) -> bytearray:
        """The only segment of a Send (RDMAP ``send_op``, ``_send_rdmap``'s)
        of ``n`` bytes, MSN ``send_msn``, its header packed; the caller
        copies the payload in."""
        return self._q0_segment(send_op, True, self.send_msn, 0, inv_stag, 0, n,
                                self.link.max_data - _UNTAGGED_EXTRA)  # type: ignore[union-attr]

    def _q0_segment(self, opcode: int, last: bool, msn: int, mo: int, inv_stag: int, flags: int, n: int,
                    max_data: int) -> bytearray:
        """A queue-0 segment with room for ``n`` payload bytes at
        ``_UNTAGGED_PREFIX``, its header packed (RFC 5041 §5.3: MSN numbers
        the message, MO is this segment's offset in it; ``flags``, the
        envelope's, on a message's last segment only).  The Modified ACK we
        owe the peer's Sends rides on the end of a message's last segment
        when it fits in ``max_data``."""
        carry = last and self.flow_ack_due and n + _FLOW_ACK_LEN <= max_data
        buf = bytearray(_UNTAGGED_PREFIX + n + (_FLOW_ACK_LEN if carry else 0))
        segment.pack_untagged_into(buf, 0, self.dest_qpn, self.qpn, opcode, last, msn & _U32, mo, inv_stag,
                                   (flags | _FLOW_ACK if carry else flags) if last else 0)
        if last:
            if carry:
                envelope.pack_flow_ack_into(buf, _UNTAGGED_PREFIX + n, self.rx_msn)
            self._flow_ack_sent(carry)
        return buf

    def _flow_ack_sent(self, carried: bool) -> None:
        """A message's last segment is queued, ``carried``: with the Modified
        ACK we owed on it."""
        if carried:
            self.flow_ack_due = False
            self.device.stats["flow_ack_carried"] += 1
        self.flow_hold.answered(self.device.now, carried)

    def _write_queued(self, wr: OutWR, num: int) -> None:
        """The last segment of the RDMA Write ``wr`` (no Immediate Data) is
        queued as link message ``num``: it completes once the link has it
        acknowledged."""
        wr.last_n = num
        assert self.link is not None
        self.link.ack_waiters.append((num, self))

    def _queue_q0(self, m: _Q0Msg) -> None:
        self.q0.append(m)
        m.wr.q0_last = m.msn
        self.send_msn += 1

    def _send_untagged(self, opcode: int, msn: int, body: bytes) -> None:
        """Queue a single-segment untagged message from its body (Immediate
        Data, an Atomic Response, Terminate; requests are packed in place)."""
        assert self.link is not None
        buf = self._untagged_segment(opcode, msn, len(body))
        buf[_UNTAGGED_PREFIX:] = body
        if opcode == Opcode.TERMINATE:
            # Found while receiving: it leaves with the pass's other
            # datagrams, after the ACK of everything the pass received.
            self.link.send(buf)
        else:
            self._send_or_queue(buf)

    def _untagged_segment(self, opcode: int, msn: int, n: int) -> bytearray:
        """A single-segment untagged message with room for an ``n``-byte
        body at ``_UNTAGGED_PREFIX``, its header packed."""
        buf = bytearray(_UNTAGGED_PREFIX + n)
        segment.pack_untagged_into(buf, 0, self.dest_qpn, self.qpn, opcode, True, msn & _U32, 0)
        return buf

    def _send_or_queue(self, buf: bytearray, ack_now: bool = True, request: bool = False,
                       taking: int = 0) -> int | None:
        """Queue the whole message ``buf`` on the link, or, when it is the
        last thing this QP has to send for now, send it at once if the link
        would send it alone anyway (``PeerLink.send_alone``): in a ping-pong
        the peer waits on this datagram, and the rest of the pass (the
        link's bookkeeping included) can come after it.  Returns its link
        message number (None for a request queued with ``send_request``).
        ``taking``: WQEs still on the SQ that are this message's (1 while
        ``_start_next`` has not popped the one it builds from)."""
        link = self.link
        assert link is not None
        if not self.irrq and self.q0_cursor >= len(self.q0) and (self.sq.hdr.producer - self.sq.cons) & _U32 == taking:
            num = link.send_alone(buf, ack_now, not request)
            if num is not None:
                return num
        if request:
            link.send_request(buf)
            return None
        return link.send(buf, ack_now)

    def _send_read_request(self, wr: OutWR, gather: _Gather, rkey: int, raddr: int) -> None:
        sink = self.next_sink
        self.next_sink = (sink + 1) & _U32 or 1
        wr.sink_stag = sink
        # header and body packed into one buffer: no ReadRequest tuple, no copy
        buf = self._untagged_segment(_OP_READ_REQUEST, self.read_msn, rdmap.READ_REQUEST_LEN)
        rdmap.pack_read_request_into(buf, _UNTAGGED_PREFIX, sink, 0, gather.total, rkey, raddr)
        # The peer's daemon answers it itself, after taking the ACK it
        # carries: not an answer to hold our ACK for (transport/link.py).
        self._send_or_queue(buf, request=True, taking=1)
        self.read_msn += 1  # a Read completes when placed, not when its request is acked
        self.orrq.append(_PendingRead(wr, gather))

    def _send_atomic_request(self, wr: OutWR, gather: _Gather, aop: int, rkey: int, raddr: int,
                             compare_add: int, swap: int) -> None:
        # RFC 7306 §5.2: verbs' plain FetchAdd is a masked add with no field
        # boundaries (mask 0); CmpSwap compares and swaps all 64 bits.
        buf = self._untagged_segment(_OP_ATOMIC_REQUEST, self.atomic_msn, rdmap.ATOMIC_REQUEST_LEN)
        if aop == AtomicOp.FETCH_ADD:
            rdmap.pack_atomic_request_into(buf, _UNTAGGED_PREFIX, aop, self.next_req_id, rkey, raddr, compare_add,
                                           0, 0, 0)
        else:
            rdmap.pack_atomic_request_into(buf, _UNTAGGED_PREFIX, aop, self.next_req_id, rkey, raddr, swap, _U64,
                                           compare_add, _U64)
        wr.atomic_msn = self.atomic_msn
        self._send_or_queue(buf, request=True, taking=1)  # as a Read Request
        self.atomic_msn += 1
        self.orrq.append(_PendingAtomic(wr, gather, self.next_req_id))
        self.next_req_id = (self.next_req_id + 1) & _U32

    def pump(self, budget: int, start: bool = True) -> int:
        """Queue up to ``budget`` messages on the link; return how many were
        queued.  ``start=False``: take no new WQE (finish what is under way)."""
        link = self.link
        if link is None or not link.up:
            return 0
        if not self.has_send_work() and self.sq.hdr.producer == self.sq.cons:
            return 0  # nothing to send
        if not link.link.send_space() and not self.flow_ack_due and not self.rx_rnr:
            # The link takes nothing more this pass (another QP filled it) and
            # no flow-control message is owed: with 64 QPs streaming, going
            # further for each one cost more than their datagrams.
            return 0
        try:
            return self._pump_messages(link, budget, start)
        finally:
            # After our own messages: a flow message is shorter than any
            # segment, so it ends their UDP_SEGMENT run and leaves in the same
            # system call (a Send ping-pong sends both every time).  In a
            # finally: receives already completed here must be ACKed even if
            # this QP's send side fails now.
            self._send_flow_control()

    def has_send_work(self) -> bool:
        """Something to send besides new WQEs: responses, a Write or Send in
        progress, flow control owed (the device pumps such a QP every pass)."""
        return bool(self.irrq or self.sending is not None or self.q0_cursor < len(self.q0) or self.flow_ack_due
                    or (self.rx_rnr and not self.rx_resume_sent))

    def _pump_messages(self, link: "PeerLink", budget: int, start: bool) -> int:
        sent = 0
        max_data = link.max_data
        lane = self.device.native is not None
        taken = 0
        while sent < budget and link.link.send_space() > 0:
            if taken >= _FLUSH_EVERY:
                # A long turn sends what it has so far: the peer starts on
                # it, and its acknowledgments (a Send's completes on the
                # Modified ACK) come back while the turn goes on.
                self.device.flush_link(link)
                taken = 0
            # Read and atomic responses first: the peer is waiting on us.
            if self.irrq:
                sent += self._send_response(budget - sent)
                continue
            if self.state != _RTS:
                break
            if self.rnr_until is not None:
                if self.device.now < self.rnr_until:
                    break  # receiver not ready: back off (a RESUME ends this early)
                self.rnr_until = None
            if self.q0_cursor < len(self.q0):
                sent += self._send_q0_segments(max_data - _UNTAGGED_EXTRA, budget - sent, lane)
                continue
            if self.rnr_blocked_msn >= 0:
                break  # Modified ACK/NACK: nothing new until the NACKed message is accepted
            s = self.sending
            if s is None:
                queued = self._start_next() if start else -1
                if queued < 0:
                    break
                sent += queued
                taken += 1
                if self.state != _RTS:
                    break
                continue
            # RFC 5040 §5.1: an RDMA Write is tagged segments into the peer's STag.
            remaining = s.gather.total - s.sent
            seg = s.seg
            if lane and remaining > seg:
                # Two segments or more: the run within the current SGE goes
                # through the compiled send lane.
                g = s.gather
                view, base, length = g.pieces[g.idx]
                k, last_len, ends = _lane_run(remaining, length - g.off, seg, budget - sent,
                                              link.link.send_space())
                if k:
                    num = link.send_tagged_run(Opcode.RDMA_WRITE, self.dest_qpn, self.qpn, s.wr.rkey,
                                               (s.wr.raddr + s.sent) & _U64, view, base + g.off, k, seg,
                                               last_len, ends)
                    nbytes = (k - 1) * seg + last_len
                    g.skip(nbytes)
                    s.sent += nbytes
                    sent += k
                    if ends:
                        self._write_sent(s, num)
                    continue
            n = min(seg, remaining)
            last = s.sent + n == s.gather.total
            buf = bytearray(_TAGGED_PREFIX + n)
            self._tagged_packer()(buf, last, s.wr.rkey, (s.wr.raddr + s.sent) & _U64)
            if n:
                s.gather.copy_out(buf, _TAGGED_PREFIX, n)
            # (a one-segment Write without Immediate Data never gets here:
            # _start_next sends it)
            num = link.send(buf)
            s.sent += n
            sent += 1
            if last:
                self._write_sent(s, num)
        return sent

    def _write_sent(self, s: Any, num: int) -> None:
        """The last segment of the RDMA Write ``s`` is queued as message ``num``."""
        self.sending = None
        if s.with_imm:
            # RFC 7306 §4: Immediate Data follows the Write on queue 0 and
            # consumes a receive, so it is subject to RNR like a Send.
            self._queue_q0(_Q0Msg(self.send_msn, s.wr, None,
                                  Opcode.IMMEDIATE_DATA_SE if s.solicited else Opcode.IMMEDIATE_DATA,
                                  imm=s.imm))
        else:
            self._write_queued(s.wr, num)

    def _send_q0_segments(self, max_data: int, room: int, lane: bool) -> int:
        """Send the next segments (at most ``room``) of the queue-0 message at
        the cursor, each ``max_data`` bytes (or the message's own cut); return
        how many."""
        m = self.q0[self.q0_cursor]
        if m.gather is None:
            self._send_untagged(m.opcode, m.msn, rdmap.encode_immediate_data(m.imm))
            self.q0_cursor += 1
            return 1
        assert self.link is not None
        total = m.gather.total
        remaining = total - m.sent
        # The Modified ACK trailer rides on the last segment when it fits
        # in the cut: an evenly cut run's datagrams are all one size, and a
        # longer last one would be cut wrongly by UDP_SEGMENT.
        max_data = m.seg or max_data
        if lane and remaining > max_data:
            # Two segments or more: the run within the current SGE goes
            # through the compiled send lane, as a Write's does.
            g = m.gather
            view, base, length = g.pieces[g.idx]
            k, last_len, ends = _lane_run(remaining, length - g.off, max_data, room, self.link.link.send_space())
            if k:
                # the Modified ACK we owe rides on the message's last segment
                # when it fits, as _q0_segment puts it there
                carry = ends and self.flow_ack_due and last_len + _FLOW_ACK_LEN <= max_data
                self.link.send_untagged_run(m.opcode, self.dest_qpn, self.qpn, m.msn & _U32, m.sent, m.inv_stag,
                                            m.flags | _FLOW_ACK if carry else m.flags, view, base + g.off, k,
                                            max_data, last_len, ends, self.rx_msn if carry else None)
                nbytes = (k - 1) * max_data + last_len
                g.skip(nbytes)
                m.sent += nbytes
                if ends:
                    self.q0_cursor += 1
                    self._flow_ack_sent(carry)
                return k
        n = min(max_data, remaining)
        last = m.sent + n == total
        buf = self._q0_segment(m.opcode, last, m.msn, m.sent, m.inv_stag, m.flags, n, max_data)
        if n:
            m.gather.copy_out(buf, _UNTAGGED_PREFIX, n)
        m.sent += n
        if last:
            self.q0_cursor += 1
        # A Send completes on the peer's Modified ACK, not on the link's ACK:
        # the link need not ask for one at once (the Modified ACK carries it).
        if last and m.sent == n:
            self._send_or_queue(buf, ack_now=False)
        else:
            self.link.send(buf, ack_now=False)
        return 1

    def _send_response(self, room: int) -> int:
        """Send the next segments (at most ``room``) of the IRRQ head, a Read
        Response or an Atomic Response; return how many."""
        assert self.link is not None
        r = self.irrq[0]
        if type(r) is _AtomicReply:
            self.irrq.popleft()
            self._send_untagged(Opcode.ATOMIC_RESPONSE, self.atomic_resp_msn, r.body)
            self.atomic_resp_msn += 1
            return 1
        remaining = r.size - r.sent
        seg = r.seg
        if self.device.native is not None and remaining > seg:
            k, last_len, ends = _lane_run(remaining, remaining, seg, room, self.link.link.send_space())
            if k:
                self.link.send_tagged_run(Opcode.RDMA_READ_RESPONSE, self.dest_qpn, self.qpn, r.sink_stag,
                                          (r.sink_to + r.sent) & _U64, r.view, r.off + r.sent, k, seg, last_len,
                                          ends)
                r.sent += (k - 1) * seg + last_len
                if ends:
                    self.irrq.popleft()
                return k
        n = min(seg, remaining)
        last = r.sent + n == r.size
        buf = bytearray(_TAGGED_PREFIX + n)
        segment.pack_tagged_into(buf, 0, self.dest_qpn, self.qpn, Opcode.RDMA_READ_RESPONSE, last,
                                 r.sink_stag, (r.sink_to + r.sent) & _U64)
        start = r.off + r.sent
        buf[_TAGGED_PREFIX:] = r.view[start:start + n]
        if last:
            self.irrq.popleft()
        if last and not r.sent:
            self._send_or_queue(buf)
        else:
            self.link.send(buf)
        r.sent += n
        return 1

    # -- Modified ACK/NACK (wire/flow.py) -------------------------------------
    def _send_flow(self, ftype: int, msn: int, backoff_us: int = 0) -> None:
        if self.link is None or not self.link.up:
            return  # the link is gone: the QP is failing anyway
        # The peer's link need not ACK a Modified ACK at once: nothing waits
        # for that ACK but our retransmission state, and in a Send ping-pong
        # each one drew a datagram back that this daemon then had to take.
        self.link.send(envelope.encode(Kind.FLOW, self.dest_qpn, self.qpn,
                                       flow.encode(FlowMessage(ftype, msn & _U32, backoff_us))),
                       ack_now=ftype != FlowType.ACK)

    def _send_flow_control(self) -> None:
        """Receiver side, once per pass: the cumulative ACK of accepted queue-0
        messages (unless it waits for our answer to carry it), and a RESUME
        once a receive is posted after an RNR NACK."""
        if self.flow_ack_due:
            now = self.device.now
            delay = self.link.link.config.max_ack_delay_s if self.link is not None else 0.0
            hold = self.flow_hold
            held = hold.until is not None
            if held and now >= hold.until:  # type: ignore[operator]
                hold.stop()  # no answer in time: ACK at once until one comes quickly again
                self.device.stats["flow_ack_hold_expired"] += 1
            if hold.owe(now, delay):
                if not held:
                    self.device.flow_ack_holding.add(self)  # its deadline counts in the loop's sleep
            else:
                self.flow_ack_due = False
                self._send_flow(FlowType.ACK, self.rx_msn)
        if self.rx_rnr and not self.rx_resume_sent:
            try:
                posted = self.recv_ring.available()
            except shm.RingError:
                posted = 0
            if posted:
                # Beyond the RHiNET paper: say "go" at once instead of letting
                # the sender sit out its back-off.
                self.rx_resume_sent = True
                self.device.stats["rnr_resume_sent"] += 1
                self._send_flow(FlowType.RESUME, self.rx_msn)

    def _unwrap_msn(self, wire_msn: int) -> int:
        """The unwrapped MSN of a queue-0 message we sent, from its 32-bit wire form."""
        base = self.q0[0].msn if self.q0 else self.send_msn
        return base + ((wire_msn - base) & _U32) if (wire_msn - base) & _U32 < 1 << 31 \
            else base - ((base - wire_msn) & _U32)

    def on_flow(self, payload: memoryview) -> None:
        """A Modified ACK/NACK message from the peer QP (never raises on bad input)."""
        try:
            m = flow.decode_untrusted(payload)
        except Exception:  # WireError only; a bad message is a counter, not a crash
            self.device.stats["rx_bad_flow"] += 1
            return
        if self.state == S.IBV_QPS_ERR:
            return
        msn = self._unwrap_msn(m.msn)
        stats = self.device.stats
        if m.ftype == FlowType.ACK:
            self._flow_acked(msn)
        elif m.ftype == FlowType.RNR_NACK:
            stats["rnr_nack_received"] += 1
            idx = next((i for i, e in enumerate(self.q0) if e.msn == msn), -1)
            if idx < 0 or idx >= self.q0_cursor and self.q0[idx].sent == 0:
                stats["rnr_nack_stale"] += 1
                return
            retry = int(self.attrs["rnr_retry"])
            if retry != 7 and self.rnr_tries >= retry:  # verbs: 7 means retry forever
                stats["rnr_retry_exceeded"] += 1
                wr = self.q0[idx].wr
                wr.status = W.IBV_WC_RNR_RETRY_EXC_ERR
                wr.done = True
                self.fatal(f"RNR retry count ({retry}) exceeded at MSN {msn}")
                return
            self.rnr_tries += 1
            # Go back to the NACKed message: it and everything after it on queue 0
            # was dropped by the receiver (RHiNET's Modified ACK/NACK).
            for i in range(idx, len(self.q0)):
                e = self.q0[i]
                e.sent = 0
                if e.gather is not None:
                    e.gather.rewind()
            self.q0_cursor = idx
            self.rnr_blocked_msn = msn
            backoff_s = max(m.backoff_us, 10) * 1e-6 * (1 << min(self.rnr_tries - 1, 16))
            self.rnr_until = self.device.now + min(backoff_s, RNR_BACKOFF_MAX_S)
            self.device.rnr_waiting.add(self)
        elif m.ftype == FlowType.RESUME:
            stats["rnr_resume_received"] += 1
            if self.rnr_blocked_msn == msn:
                self.rnr_until = None  # the receiver has a buffer now: re-send at once

    def on_flow_ack(self, wire_msn: int) -> None:
        """A Modified ACK carried by a DDP message (envelope FLOW_ACK)."""
        if self.state != S.IBV_QPS_ERR:
            self._flow_acked(self._unwrap_msn(wire_msn))

    def _flow_acked(self, msn: int) -> None:
        """Every queue-0 message below ``msn`` was placed: their WRs may complete."""
        q = self.q0
        popped = 0
        while q and q[0].msn < msn and popped < self.q0_cursor:
            e = q.popleft()
            popped += 1
            if e.msn == e.wr.q0_last:
                e.wr.done = True
        self.q0_cursor -= popped
        if self.rnr_blocked_msn >= 0 and (not q or q[0].msn > self.rnr_blocked_msn):
            self.rnr_blocked_msn = -1  # the NACKed message got in: new messages may go
            self.rnr_tries = 0
            self.rnr_until = None

    # -- responder ----------------------------------------------------------
    def on_segment(self, hdr: Any, payload: memoryview, raw: memoryview, flags: int = 0) -> None:
        """Handle one DDP segment addressed to this QP.

        ``raw``: the segment from its DDP header; ``flags``: its envelope flags.
        """
        if self.state not in _RECEIVING:
            return
        op = hdr.opcode
        if op == _OP_WRITE:
            code = self.device.stags.place(self.pd, _REMOTE_WRITE, hdr.stag, hdr.to, payload)
            if code:
                self._terminate(_TERM_CODE[code], raw, len(payload))
                return
            self.rx_write_bytes += len(payload)
        elif op == _OP_READ_RESPONSE:
            self._on_read_response(hdr, payload, raw)
        elif op in _Q0_OPCODES:
            if self.rx_rnr:
                # Modified ACK/NACK: after a NACK, every queue-0 segment is dropped
                # until the NACKed message comes again from its first byte.
                if hdr.msn != self.rx_msn or hdr.mo != 0:
                    self.device.stats["rnr_dropped"] += 1
                    return
                self.rx_rnr = False
            if op == Opcode.IMMEDIATE_DATA or op == Opcode.IMMEDIATE_DATA_SE:
                self._on_immediate(hdr, payload, raw)
            else:
                self._on_send(hdr, payload, raw, flags)
        elif op == Opcode.RDMA_READ_REQUEST or op == Opcode.ATOMIC_REQUEST:
            self.on_request(op, hdr.msn, payload, raw)
        elif op == Opcode.ATOMIC_RESPONSE:
            self.on_atomic_response(hdr.msn, payload, raw)
        elif op == Opcode.TERMINATE:
            self._on_terminate(payload)
        else:  # pragma: no cover - the decoder admits no other opcode
            self._terminate(rdmap.RdmapErrorCode.UNEXPECTED_OPCODE, raw, len(payload),
                            etype=rdmap.RdmapErrorType.REMOTE_OPERATION)

    def on_request(self, op: int, msn: int, payload: memoryview, raw: memoryview) -> None:
        """A Read Request or an Atomic Request, message ``msn`` of its queue:
        check it and queue its answer (the Python path's segment, or one the
        compiled lane took whole: ``raw`` from the DDP header, as for
        :meth:`on_segment`)."""
        if op == Opcode.RDMA_READ_REQUEST:
            # Where the compiled lane expects the next one.  This path does
            # not hold a request to it (the link delivers in order): one
            # the lane refuses for its MSN is answered here, as before the
            # lane took requests.
            self.rx_read_msn = (msn + 1) & _U32
            self._on_read_request(payload, raw)
        else:
            self._on_atomic_request(msn, payload, raw)

    def _on_read_request(self, payload: memoryview, raw: memoryview) -> None:
        try:
            req = rdmap.decode_read_request_untrusted(payload)
        except Exception:  # decoder raises WireError only; keep the daemon up regardless
            self._terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload),
                            etype=rdmap.RdmapErrorType.REMOTE_OPERATION)
            return
        if len(self.irrq) >= self.ird:
            # RFC 5040 §6.5: more outstanding Reads than IRD is a remote operation error.
            self._terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload),
                            etype=rdmap.RdmapErrorType.REMOTE_OPERATION, rdmap_header=bytes(payload))
            return
        mr = self.device.stags.lookup(req.src_stag)
        code, off = (tables.INVALID_STAG, 0) if mr is None else mr.check(
            self.pd, _REMOTE_READ, req.src_to, req.size, tagged=True)
        if code:
            self._terminate(_TERM_CODE[code], raw, len(payload), rdmap_header=bytes(payload))
            return
        # responses queued ahead make this one part of a stream
        seg = self.link.segment_size(req.size, bool(self.irrq))  # type: ignore[union-attr]
        self.irrq.append(_ReadResponse(mr.view, off, req.size, req.sink_stag, req.sink_to, seg))

    def _on_read_response(self, hdr: Any, payload: memoryview, raw: memoryview) -> None:
        n = len(payload)
        rd = self.orrq[0] if self.orrq else None
        if rd is None or hdr.stag != rd.wr.sink_stag or hdr.to != rd.placed or rd.placed + n > rd.size \
                or (hdr.last and rd.placed + n != rd.size):
            # A response we did not ask for, or outside the sink: RFC 5041 §7.2 tagged buffer error.
            if rd is not None:
                rd.wr.status = W.IBV_WC_BAD_RESP_ERR
                rd.wr.done = True
            self._terminate(rdmap.DdpTaggedErrorCode.INVALID_STAG, raw, n, layer=rdmap.TermLayer.DDP,
                            etype=rdmap.DdpErrorType.TAGGED_BUFFER)
            return
        if n:
            rd.gather.scatter(rd.placed, payload)
        rd.placed += n
        if hdr.last:
            self.read_placed()

    def read_placed(self) -> None:
        """The last Read Response of the Read at the ORRQ head is placed: it completes."""
        self.orrq.popleft().wr.done = True

    def _take_receive(self, hdr: Any, raw: memoryview, seglen: int) -> bool:
        """Start the next queue-0 message: check its MSN, take the next receive WQE.

        Returns False when the message cannot start: an MSN out of order ends
        in a Terminate; no posted receive in an RNR NACK (``rx_rnr`` set).
        """
        if hdr.msn != self.rx_msn or hdr.mo != 0:
            # RFC 5041 §7.2: MSN out of range / bad MO for the untagged queue.
            self._terminate(rdmap.DdpUntaggedErrorCode.INVALID_MSN_RANGE, raw, seglen,
                            layer=rdmap.TermLayer.DDP, etype=rdmap.DdpErrorType.UNTAGGED_BUFFER)
            return False
        recv = self.peek_receive()
        if recv is None:
            # Receiver not ready (RHiNET/PM Modified ACK/NACK): NACK this MSN and
            # drop the rest of queue 0 until the sender comes back to it.  The
            # back-off hint is our min_rnr_timer, as an IB RNR NAK carries it.
            self.rx_rnr = True
            self.rx_resume_sent = False
            self.device.stats["rnr_nack_sent"] += 1
            code = int(self.attrs["min_rnr_timer"])
            self._send_flow(FlowType.RNR_NACK, self.rx_msn, RNR_TIMER_US[code if 0 <= code < 32 else 0])
            return False
        self.take_receive(recv)
        return True

    def peek_receive(self) -> tuple[int, _Gather | None] | None:
        """The next posted receive, resolved but left in the ring: (wr_id,
        gather; None if its SGEs are bad); None if none is posted.

        The resolution is kept for as long as the receive stays at the
        ring's head and the STag table does not change, so a receive
        looked at ahead of its Send (``prefetch_receive``) is not resolved
        again when the Send comes."""
        rq = self.recv_ring
        try:
            if not rq.available():
                return None
        except shm.RingError:
            return None
        version = self.device.stags.version
        kept = self._rx_peeked
        if kept is not None and kept[0] == rq.cons and kept[1] == version:
            recv = kept[2]
            if recv[1] is not None:
                recv[1].rewind()
            return recv
        at = rq.slot_offset()
        wr_id, n = _RECV_WQE_HEAD.unpack_from(rq.buf, at)
        recv = wr_id, self._resolve(rq.buf, at + _RECV_SG_OFFSET, n, _LOCAL_WRITE) if n <= self.max_recv_sge else None
        self._rx_peeked = (rq.cons, version, recv)
        return recv

    def prefetch_receive(self) -> None:
        """Resolve the next posted receive now, if a Send may come for it:
        called after a pass's datagrams left, when nothing waits on us (a
        Send ping-pong's answer comes a round trip later), so that its
        resolution is off the path of the pass that places the Send."""
        if self.rx_recv is None and self.state in _RECEIVING and not self.rx_rnr:
            self.peek_receive()

    def take_receive(self, recv: tuple[int, _Gather | None]) -> None:
        """Start the next queue-0 message in ``recv``, the receive
        ``peek_receive`` returned just before: take it from the ring."""
        self.rx_recv = recv
        self.rx_placed = 0
        self.recv_ring.pop()
        if self.srq is not None:
            self.srq.took_one()

    def _finish_receive(self, status: int, opcode: int, byte_len: int, imm: int = 0, flags: int = 0,
                        solicited: bool = False) -> None:
        wr_id, _ = self.rx_recv  # type: ignore[misc]
        self.rx_recv = None
        self.rx_imm_pending = False
        self.rx_msn = (self.rx_msn + 1) & _U32
        if status == _WC_SUCCESS:
            self.flow_ack_due = True  # Modified ACK: the sender may complete the WR
        self.recv_cq.push(wr_id, status, opcode, byte_len if status == 0 else 0, self.qpn, self.dest_qpn,
                          imm, flags, solicited=solicited)

    def _on_send(self, hdr: Any, payload: memoryview, raw: memoryview, flags: int) -> None:
        n = len(payload)
        if self.rx_recv is None:
            if not self._take_receive(hdr, raw, n):
                return
        elif self.rx_imm_pending or hdr.msn != self.rx_msn or hdr.mo != self.rx_placed:
            self._terminate(rdmap.DdpUntaggedErrorCode.INVALID_MO, raw, n,
                            layer=rdmap.TermLayer.DDP, etype=rdmap.DdpErrorType.UNTAGGED_BUFFER)
            return
        _, gather = self.rx_recv  # type: ignore[misc]
        if gather is None:
            # The receive's own SGEs are bad: a local error at this end (verbs
            # LOC_PROT_ERR on the receive), and the sender learns by Terminate.
            self._finish_receive(W.IBV_WC_LOC_PROT_ERR, WcOpcode.IBV_WC_RECV, 0)
            self._terminate(rdmap.RdmapErrorCode.CATASTROPHIC_LOCALIZED, raw, n,
                            etype=rdmap.RdmapErrorType.REMOTE_OPERATION)
            return
        if self.rx_placed + n > gather.total:
            self._finish_receive(W.IBV_WC_LOC_LEN_ERR, WcOpcode.IBV_WC_RECV, 0)
            self._terminate(rdmap.DdpUntaggedErrorCode.MESSAGE_TOO_LONG, raw, n,
                            layer=rdmap.TermLayer.DDP, etype=rdmap.DdpErrorType.UNTAGGED_BUFFER)
            return
        if n:
            gather.scatter(self.rx_placed, payload)
        self.rx_placed += n
        if not hdr.last:
            return
        wc_flags = 0
        inv = hdr.inv_stag
        op = hdr.opcode
        if op == Opcode.SEND_INVALIDATE or op == Opcode.SEND_SE_INVALIDATE:
            # RFC 5040 §5.3 / §6.x: the STag is invalid before the receive completes.
            mr = self.device.stags.lookup(inv)
            if mr is None or mr.pd is not self.pd:
                self._finish_receive(W.IBV_WC_LOC_PROT_ERR, WcOpcode.IBV_WC_RECV, 0)
                self._terminate(rdmap.RdmapErrorCode.STAG_CANNOT_BE_INVALIDATED, raw, n,
                                etype=rdmap.RdmapErrorType.REMOTE_OPERATION)
                return
            self.device.stags.invalidate(inv)
            self.device.stats["stag_remote_invalidated"] += 1
            wc_flags = WcFlags.IBV_WC_WITH_INV
        if flags & _IMM_FOLLOWS and not wc_flags:
            # Send with Immediate: the receive completes with the Immediate Data next.
            self.rx_imm_pending = True
            self.rx_msn = (self.rx_msn + 1) & _U32
            return
        self._finish_receive(W.IBV_WC_SUCCESS, WcOpcode.IBV_WC_RECV, self.rx_placed, inv if wc_flags else 0,
                             wc_flags, solicited=op == Opcode.SEND_SE or op == Opcode.SEND_SE_INVALIDATE)

    def send_placed(self, op: int) -> None:
        """The compiled lane placed the last segment of a plain Send (or
        Send with Solicited Event) ``op``: its receive completes."""
        self._finish_receive(_WC_SUCCESS, _WC_RECV, self.rx_placed, solicited=op == _OP_SEND_SE)

    def _on_immediate(self, hdr: Any, payload: memoryview, raw: memoryview) -> None:
        try:
            imm = rdmap.decode_immediate_data_untrusted(payload)
        except Exception:
            self._terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload),
                            etype=rdmap.RdmapErrorType.REMOTE_OPERATION)
            return
        solicited = hdr.opcode == Opcode.IMMEDIATE_DATA_SE
        if self.rx_imm_pending:
            if hdr.msn != self.rx_msn:
                self._terminate(rdmap.DdpUntaggedErrorCode.INVALID_MSN_RANGE, raw, len(payload),
                                layer=rdmap.TermLayer.DDP, etype=rdmap.DdpErrorType.UNTAGGED_BUFFER)
                return
            # The second half of a Send with Immediate: one receive, the Send's length.
            self._finish_receive(W.IBV_WC_SUCCESS, WcOpcode.IBV_WC_RECV, self.rx_placed, imm & _U32,
                                 WcFlags.IBV_WC_WITH_IMM, solicited=solicited)
            return
        if self.rx_recv is not None:
            self._terminate(rdmap.DdpUntaggedErrorCode.INVALID_MSN_RANGE, raw, len(payload),
                            layer=rdmap.TermLayer.DDP, etype=rdmap.DdpErrorType.UNTAGGED_BUFFER)
            return
        if not self._take_receive(hdr, raw, len(payload)):
            return
        # RFC 7306 §4: Immediate Data consumes a receive; verbs reports the Write's length.
        self._finish_receive(W.IBV_WC_SUCCESS, WcOpcode.IBV_WC_RECV_RDMA_WITH_IMM, self.rx_write_bytes,
                             imm & _U32, WcFlags.IBV_WC_WITH_IMM, solicited=solicited)
        self.rx_write_bytes = 0

    def _on_atomic_request(self, msn: int, payload: memoryview, raw: memoryview) -> None:
        """RFC 7306 §5: apply an atomic to an 8-byte word and queue its response.

        The data loop is one thread, so an atomic is indivisible with respect to
        every other atomic and every RDMA Write on this daemon, from any QP.
        """
        try:
            req = rdmap.decode_atomic_request_untrusted(payload)
        except Exception:  # WireError only
            self._terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload),
                            etype=rdmap.RdmapErrorType.REMOTE_OPERATION)
            return
        if msn != self.rx_atomic_msn:
            cached = self.atomic_replay.get(msn)
            if cached is None:
                self._terminate(rdmap.DdpUntaggedErrorCode.INVALID_MSN_RANGE, raw, len(payload),
                                layer=rdmap.TermLayer.DDP, etype=rdmap.DdpErrorType.UNTAGGED_BUFFER)
                return
            # A repeated request (its response was lost on some path): answer it
            # again from the record, never apply it a second time.
            self.device.stats["atomic_replayed"] += 1
            self.irrq.append(_AtomicReply(cached))
            return
        if len(self.irrq) >= self.ird:
            self._terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload),
                            etype=rdmap.RdmapErrorType.REMOTE_OPERATION)
            return
        mr = self.device.stags.lookup(req.stag)
        code, off = (tables.INVALID_STAG, 0) if mr is None else mr.check(
            self.pd, _REMOTE_ATOMIC, req.to, 8, tagged=True)
        if code:
            self._terminate(_TERM_CODE[code], raw, len(payload))
            return
        if req.to & 7:
            # RFC 7306 §5.2: the target must be 8-byte aligned.
            self._terminate(rdmap.RdmapErrorCode.BASE_OR_BOUNDS_VIOLATION, raw, len(payload))
            return
        word = mr.view[off:off + 8]
        orig = int.from_bytes(word, _HOST_ORDER)
        word[:] = _apply_atomic(req, orig).to_bytes(8, _HOST_ORDER)
        body = rdmap.encode_atomic_response(rdmap.AtomicResponse(req.req_id, orig))
        self.rx_atomic_msn = (msn + 1) & _U32
        self.atomic_replay[msn] = body
        if len(self.atomic_replay) > ATOMIC_REPLAY:
            self.atomic_replay.popitem(last=False)
        self.irrq.append(_AtomicReply(body))

    def on_atomic_response(self, msn: int, payload: memoryview, raw: memoryview) -> None:
        """The Atomic Response (message ``msn`` of queue 4) to the atomic at
        the ORRQ head: the Python path's segment or one the compiled lane
        took whole (``raw`` from the DDP header, as for :meth:`on_segment`)."""
        # Where the compiled lane expects the next one.  As for Read
        # Requests, this path holds no response to it: the link delivers in
        # order, and the ORRQ head and request identifier decide.
        self.rx_atomic_resp_msn = (msn + 1) & _U32
        rd = self.orrq[0] if self.orrq else None
        try:
            resp = rdmap.decode_atomic_response_untrusted(payload)
        except Exception:
            resp = None
        if type(rd) is not _PendingAtomic or resp is None or resp.req_id != rd.req_id:
            if rd is not None:
                rd.wr.status = W.IBV_WC_BAD_RESP_ERR
                rd.wr.done = True
            self._terminate(rdmap.RdmapErrorCode.UNEXPECTED_OPCODE, raw, len(payload),
                            etype=rdmap.RdmapErrorType.REMOTE_OPERATION)
            return
        # The original value lands in host byte order, as an RNIC's DMA leaves it.
        rd.gather.scatter(0, memoryview(resp.orig_value.to_bytes(8, _HOST_ORDER)))
        self.orrq.popleft()
        rd.wr.done = True

    def _terminate(self, ecode: int, raw: memoryview, seglen: int, *,
                   layer: int = rdmap.TermLayer.RDMAP, etype: int = rdmap.RdmapErrorType.REMOTE_PROTECTION,
                   rdmap_header: bytes = b"") -> None:
        """Answer a violation: nothing placed, Terminate to the peer, QP to ERR (RFC 5040 §7.1)."""
        self.device.stats["terminate_sent"] += 1
        hlen = rdmap.ddp.TAGGED_HEADER_LEN if raw[0] & rdmap.ddp.T_FLAG else rdmap.ddp.UNTAGGED_HEADER_LEN
        term = rdmap.Terminate(layer, etype, ecode, True, min(seglen + hlen, 0xFFFF), bytes(raw[:hlen]),
                               rdmap_header)
        if self.link is not None and self.link.up:
            self._send_untagged(Opcode.TERMINATE, self.term_msn, rdmap.encode_terminate(term))
        self.term_msn += 1
        self.terminated = True
        self.fatal(f"sent Terminate layer={layer} etype={etype} ecode={ecode:#x}",
                   EventType.IBV_EVENT_QP_ACCESS_ERR)

    def _on_terminate(self, payload: memoryview) -> None:
        """The peer found a violation in something we sent: fail that WR, then ERR."""
        try:
            t = rdmap.decode_terminate_untrusted(payload)
        except Exception:
            t = rdmap.Terminate(rdmap.TermLayer.RDMAP, rdmap.RdmapErrorType.REMOTE_OPERATION, 0xFF)
        status = _terminate_status(t)
        victim = self._find_victim(t)
        if victim is not None:
            victim.status = status
            # In-order processing at the peer: everything before the victim was
            # placed, so it completes normally; everything after it is flushed.
            q = self.outstanding
            while q:
                wr = q.popleft()
                if wr is not victim:
                    wr.done = True
                self._complete(wr)
                if wr is victim:
                    break
        self.fatal(f"received Terminate layer={t.layer} etype={t.etype} ecode={t.ecode:#x}")

    def _find_victim(self, t: rdmap.Terminate) -> OutWR | None:
        """The outstanding WR the peer rejected, from the headers the Terminate copies."""
        if t.rdmap_header:
            try:
                req = rdmap.decode_read_request_untrusted(t.rdmap_header)
            except Exception:
                req = None
            if req is not None:
                for wr in self.outstanding:
                    if wr.sink_stag == req.sink_stag:
                        return wr
        h = t.ddp_header
        if len(h) == rdmap.ddp.TAGGED_HEADER_LEN:
            _, rctl, stag, to = rdmap.ddp.TAGGED.unpack(h)
            if rctl & 0x0F == Opcode.RDMA_WRITE:
                for wr in self.outstanding:
                    if wr.sink_stag < 0 and wr.rkey == stag and wr.raddr <= to <= wr.raddr + wr.byte_len:
                        return wr
        elif len(h) == rdmap.ddp.UNTAGGED_HEADER_LEN:
            qn, msn = rdmap.ddp.UNTAGGED.unpack(h)[3:5]
            if qn == rdmap.QueueNumber.ATOMIC_REQUEST:
                for wr in self.outstanding:
                    if wr.atomic_msn >= 0 and wr.atomic_msn & _U32 == msn:
                        return wr
            # A Send or Immediate Data: the oldest unfinished WR that is not a Read.
            for wr in self.outstanding:
                if wr.sink_stag < 0 and wr.atomic_msn < 0 and not wr.done:
                    return wr
        for wr in self.outstanding:
            if not wr.done:
                return wr
        return None


def _apply_atomic(req: rdmap.AtomicRequest, orig: int) -> int:
    """The new value of the target word (RFC 7306 §5.2, masked operations)."""
    if req.aop == AtomicOp.FETCH_ADD:
        mask = req.add_swap_mask
        if not mask:
            return (orig + req.add_swap_data) & _U64
        # Masked Fetch-and-Add: a set mask bit ends a field, so no carry leaves it.
        out, carry = 0, 0
        a, b = orig, req.add_swap_data
        for bit in range(64):
            s = ((a >> bit) & 1) + ((b >> bit) & 1) + carry
            out |= (s & 1) << bit
            carry = 0 if (mask >> bit) & 1 else s >> 1
        return out
    if req.aop == AtomicOp.CMP_SWAP and (orig ^ req.compare_data) & req.compare_mask:
        return orig  # compare failed: the word stays, the original value still returns
    return (orig & ~req.add_swap_mask & _U64) | (req.add_swap_data & req.add_swap_mask)


def _terminate_status(t: rdmap.Terminate) -> int:
    """The requester's WC status for a received Terminate (RFC 5040 §4.8 layer/etype)."""
    if t.layer == rdmap.TermLayer.RDMAP:
        if t.etype == rdmap.RdmapErrorType.REMOTE_PROTECTION:
            return W.IBV_WC_REM_ACCESS_ERR
        if t.etype == rdmap.RdmapErrorType.REMOTE_OPERATION:
            return W.IBV_WC_REM_OP_ERR
        return W.IBV_WC_REM_ABORT_ERR
    if t.layer == rdmap.TermLayer.DDP:
        if t.etype == rdmap.DdpErrorType.TAGGED_BUFFER:
            return W.IBV_WC_REM_ACCESS_ERR
        if t.etype == rdmap.DdpErrorType.UNTAGGED_BUFFER and t.ecode == rdmap.DdpUntaggedErrorCode.INVALID_MSN_NO_BUFFER:
            return W.IBV_WC_RNR_RETRY_EXC_ERR
        if t.etype == rdmap.DdpErrorType.UNTAGGED_BUFFER and t.ecode == rdmap.DdpUntaggedErrorCode.MESSAGE_TOO_LONG:
            return W.IBV_WC_REM_INV_REQ_ERR  # verbs: the receive buffer was too small
        return W.IBV_WC_REM_OP_ERR
    return W.IBV_WC_REM_ABORT_ERR


_WC_OF_WR = {
    WrOpcode.IBV_WR_RDMA_WRITE: WcOpcode.IBV_WC_RDMA_WRITE,
    WrOpcode.IBV_WR_RDMA_WRITE_WITH_IMM: WcOpcode.IBV_WC_RDMA_WRITE,
    WrOpcode.IBV_WR_SEND: WcOpcode.IBV_WC_SEND,
    WrOpcode.IBV_WR_SEND_WITH_IMM: WcOpcode.IBV_WC_SEND,
    WrOpcode.IBV_WR_RDMA_READ: WcOpcode.IBV_WC_RDMA_READ,
    WrOpcode.IBV_WR_ATOMIC_CMP_AND_SWP: WcOpcode.IBV_WC_COMP_SWAP,
    WrOpcode.IBV_WR_ATOMIC_FETCH_AND_ADD: WcOpcode.IBV_WC_FETCH_ADD,
}


_WC_OF_WR_INT = {int(k): int(v) for k, v in _WC_OF_WR.items()}
_WC_SEND = int(WcOpcode.IBV_WC_SEND)


def _wc_opcode(wr_opcode: int) -> int:
    return _WC_OF_WR_INT.get(wr_opcode, _WC_SEND)
