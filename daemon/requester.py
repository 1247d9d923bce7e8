"""The requester: send WQEs taken off the SQ and cut into DDP segments.

Theory of operation
-------------------
``pump_messages`` takes the next send WQE (``start_next``), checks its
local SGEs (lkey valid, same PD, bounds; a violation completes the WR with
IBV_WC_LOC_PROT_ERR and moves the QP to ERR), then cuts the message lazily
into DDP segments that fit the link (``link.send_space()`` bounds how many
are queued, so a 1 GiB Write holds no more memory than the link's window).

- An RDMA Write (RFC 5040 §5.1) is tagged segments with the peer's STag and
  the tagged offset; Write with Immediate adds RFC 7306's Immediate Data
  message, which consumes a receive WQE at the target.
- A Send (§5.3, with Invalidate and/or Solicited Event) is untagged
  segments on queue 0 (MSN per message, MO per segment); Send with
  Immediate is a Send followed by Immediate Data, the envelope flag
  IMM_FOLLOWS telling the target both fill one receive.  Every queue-0
  message is kept (``q0``: a reference to the WR's SGEs, not a copy) until
  the target's Modified ACK, because the target may NACK it (receiver not
  ready) and then it is sent again; nothing new starts meanwhile.
- A Read (§5.2) is one Read Request on untagged queue 1 naming a *sink STag*
  private to its ORRQ entry (the sink is the requester's SGE list, so
  several SGEs work).  An atomic (RFC 7306 §5) is one Atomic Request on
  the same queue 1, in the same MSN sequence as Read Requests; it shares
  the ORRQ and the ORD budget with Reads.

A message of one segment is built straight from the WQE and handed to the
link before the WR's own bookkeeping (the peer waits on the datagram, not on
our records); where it would leave alone anyway, the link sends it at once
(``PeerLink.send_alone``).  Runs of two segments or more within one SGE go
through the compiled send lane (``PeerLink.send_tagged_run``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..wire import envelope, rdmap, segment, shm
from ..wire.rdmap import AtomicOp, Opcode
from ..wire.shm import EventType, WcStatus as W
from .opcodes import (
    ATOMIC_WR,
    FLOW_ACK,
    IMM_FOLLOWS,
    LOCAL_WRITE,
    ONE_MESSAGE_SEND,
    OP_ATOMIC_REQUEST,
    OP_READ_REQUEST,
    RTS,
    SEND_FENCE,
    SEND_INLINE,
    SEND_OPCODE,
    SEND_SIGNALED,
    SEND_SOLICITED,
    SEND_WR,
    SUPPORTED_WR,
    U32,
    U64,
    WC_RDMA_WRITE,
    WC_SEND,
    WC_SUCCESS,
    WR_READ,
    WR_SEND_WITH_IMM,
    WR_SEND_WITH_INV,
    WR_WRITE,
    WR_WRITE_WITH_IMM,
    send_rdmap,
    wc_opcode,
)
from .peer import PeerLink
from .records import Gather, OutgoingWrite, OutWR, PendingAtomic, PendingRead, Q0Message, lane_run

_TAGGED_PREFIX = segment.TAGGED_PREFIX_LEN
_UNTAGGED_PREFIX = segment.UNTAGGED_PREFIX_LEN
_UNTAGGED_EXTRA = _UNTAGGED_PREFIX - _TAGGED_PREFIX  # an untagged header is 4 bytes longer
_FLOW_ACK_LEN = envelope.FLOW_ACK_LEN
#: WQEs a pump turn takes before it sends what it has queued.  Without it a
#: turn took a whole window of small Sends and sent them at its end; the
#: receiver read them in one pass and sent one Modified ACK for all, so the
#: application could post again only when the whole window had been acknowledged.
#: 32 kept both daemons busiest on a 64-byte Send stream (64, a whole
#: UDP_SEGMENT call, less so).  Large messages never reach it.
FLUSH_EVERY = 32
_SEND_WQE_HEAD = shm.SEND_WQE_HEAD
_SG_OFFSET = shm.SEND_WQE_SG_OFFSET
_SGE = shm.SGE
_SGE_SIZE = shm.SGE_SIZE
#: what _take_payload answers for a WQE it refuses
_REFUSED_QP_OP = (W.IBV_WC_LOC_QP_OP_ERR, None, None, 0, 0)
_REFUSED_LEN = (W.IBV_WC_LOC_LEN_ERR, None, None, 0, 0)
_REFUSED_PROT = (W.IBV_WC_LOC_PROT_ERR, None, None, 0, 0)


class Requester:
    """The requester's methods of a QueuePair (see the module docstring)."""

    link: PeerLink | None

    def reset_requester(self) -> None:
        """The requester's state, as a new (or reset) QP has it."""
        self.outstanding: deque[OutWR] = deque()  # in posting order, until completed (completer.py)
        self.sending: OutgoingWrite | None = None  # the RDMA Write being cut into segments
        self.orrq: deque[PendingRead | PendingAtomic] = deque()  # Reads and atomics awaiting their response
        # RFC 5041 §5.3: MSN starts at 1 on each untagged queue.  Kept
        # unwrapped here; the wire carries the low 32 bits.
        self.read_msn = 1  # queue 1: Read Requests and Atomic Requests (RFC 7306)
        self.send_msn = 1
        self.next_req_id = 1
        self.next_sink = 1
        # Modified ACK/NACK: queue-0 messages not yet accepted by the peer,
        # the index of the next one (or segment) to send, and the back-off
        # after an RNR NACK (nothing new goes until the NACKed MSN is accepted)
        self.q0: deque[Q0Message] = deque()
        self.q0_cursor = 0
        self.rnr_until: float | None = None
        self.rnr_blocked_msn = -1
        self.rnr_tries = 0
        # (SGE, access, STag table version, pieces) of the last one-SGE WQE list resolved (``resolve``)
        self._resolved: tuple[tuple[int, int, int], int, int, list[tuple[memoryview, int, int]]] | None = None
        # the Write segment header packer for the current peer QP (segment.tagged_packer)
        self._write_packer: Any = None
        self._write_packer_dest = -1

    # -- resolving SGE lists ---------------------------------------------------
    def resolve(self, buf: memoryview, sg_offset: int, n: int, access: int, keep: bool = False) -> Gather | None:
        """Resolve the SGE list at ``buf[sg_offset:]`` against the STag table; None on violation.

        ``keep`` (a WQE's list): a one-SGE list that is the last one kept,
        with the table unchanged since, gets that answer again.  An
        application posts the same buffer over and over (perftest does),
        and the lookup and the check were a large part of a one-SGE list's
        resolution.  The QP's PD never changes, and a registration or an
        invalidation moves the table's version.  A receive's list is not
        kept: it is resolved ahead, in the hand-over after a Send, where a
        cheaper resolution does not pay."""
        stags = self.device.stags
        version = stags.version
        if keep and n == 1:
            sge = _SGE.unpack_from(buf, sg_offset)
            kept = self._resolved
            if kept is not None and kept[0] == sge and kept[1] == access and kept[2] == version:
                return Gather(kept[3])
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
        return Gather(pieces)

    # -- taking a WQE ----------------------------------------------------------
    def start_next(self) -> int:
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
        reads_remote = opcode == WR_READ or opcode in ATOMIC_WR
        if reads_remote and len(self.orrq) >= self.ord:
            return -1  # ORD reached: wait for a response (RFC 5040 §6.5; atomics share it, RFC 7306 §6)
        if flags & SEND_FENCE and self.orrq:
            return -1  # fence: earlier Reads and atomics must finish first
        signaled = bool(self.sq_sig_all or flags & SEND_SIGNALED)
        status, gather, msg, send_op, inv_stag = self._take_payload(buf, at, opcode, flags, num_sge, imm, rkey,
                                                                    raddr, inline_len, reads_remote)
        if msg is not None:
            # A one-segment RDMA Write or Send: queued (or sent) now, with no
            # gather list or message under way for the pump to come back to,
            # and before the WR's bookkeeping, which the peer does not wait for.
            n = gather.total if gather is not None else inline_len
            if opcode != WR_WRITE:
                return self._start_one_send(msg, wr_id, signaled, n, rkey, raddr, gather, send_op, inv_stag)
            num = self.send_or_queue(msg, taking=1)
            wr = OutWR(wr_id, WC_RDMA_WRITE, signaled, n)
            self._taken(wr, rkey, raddr)
            self._write_queued(wr, num)  # type: ignore[arg-type]
            return 1
        wr = OutWR(wr_id, wc_opcode(opcode), signaled, 0 if gather is None else gather.total)
        if reads_remote and status == WC_SUCCESS and gather is not None:
            # A Read or atomic request leaves before the WR's bookkeeping
            # too: the responder answers it at once.
            if opcode == WR_READ:
                self._send_read_request(wr, gather, rkey, raddr)
            else:
                self._send_atomic_request(wr, gather, ATOMIC_WR[opcode], rkey, raddr, compare_add, swap)
            self._taken(wr, rkey, raddr)
            return 0
        self._taken(wr, rkey, raddr)
        if status != WC_SUCCESS or gather is None:
            wr.status = status if status != WC_SUCCESS else W.IBV_WC_GENERAL_ERR
            wr.done = True
            self.fatal(f"local error on wr {wr.wr_id}: {W(wr.status).name}", EventType.IBV_EVENT_QP_REQ_ERR)
            return 0
        self._start_message(wr, gather, opcode, flags, imm)
        return 0

    def _take_payload(self, buf: memoryview, at: int, opcode: int, flags: int, num_sge: int, imm: int, rkey: int,
                      raddr: int, inline_len: int, reads_remote: bool) -> tuple[Any, Gather | None, Any, int, int]:
        """Check the payload of the WQE at ``buf[at:]``: ``(status, gather,
        msg, send_op, inv_stag)``.  ``gather``: the SGEs resolved (or a copy
        of inline bytes); ``msg``: the only segment of a one-segment RDMA
        Write or Send, built here (``send_op``, ``inv_stag``: such a Send's
        RDMAP opcode and the STag it invalidates), else None."""
        if opcode not in SUPPORTED_WR:
            return _REFUSED_QP_OP
        max_data = self.link.max_data  # type: ignore[union-attr]
        if flags & SEND_INLINE and not reads_remote:
            n = inline_len
            start = at + _SG_OFFSET
            if n > min(shm.MAX_INLINE, self.caps["max_inline_data"]):
                return _REFUSED_LEN
            if opcode == WR_WRITE and n <= max_data:
                # straight from the WQE, before its slot goes back to the application
                msg = self._write_segment(n, rkey, raddr)
                msg[_TAGGED_PREFIX:] = buf[start:start + n]
                return WC_SUCCESS, None, msg, 0, 0
            if opcode in ONE_MESSAGE_SEND and n <= max_data - _UNTAGGED_EXTRA and self.q0_cursor == len(self.q0):
                send_op, inv_stag = send_rdmap(opcode, flags, imm)
                msg = self._send_segment(send_op, inv_stag, n)
                msg[_UNTAGGED_PREFIX:_UNTAGGED_PREFIX + n] = buf[start:start + n]
                return WC_SUCCESS, None, msg, send_op, inv_stag
            data = bytes(buf[start:start + n])
            return WC_SUCCESS, Gather([(memoryview(data), 0, n)] if n else []), None, 0, 0
        if num_sge > self.caps["max_send_sge"]:
            return _REFUSED_LEN
        gather = self.resolve(buf, at + _SG_OFFSET, num_sge, LOCAL_WRITE if reads_remote else 0, keep=True)
        if gather is None:
            return _REFUSED_PROT
        total = gather.total
        if total > shm.MAX_MSG_SZ or opcode in ATOMIC_WR and total != 8:
            # longer than the port's max_msg_sz, or not an atomic's one 64-bit word
            return W.IBV_WC_LOC_LEN_ERR, gather, None, 0, 0
        if opcode == WR_WRITE and total <= max_data:
            msg = self._write_segment(total, rkey, raddr)
            gather.copy_out(msg, _TAGGED_PREFIX, total)
            return WC_SUCCESS, gather, msg, 0, 0
        if opcode in ONE_MESSAGE_SEND and self.q0_cursor == len(self.q0) and total <= max_data - _UNTAGGED_EXTRA:
            send_op, inv_stag = send_rdmap(opcode, flags, imm)
            msg = self._send_segment(send_op, inv_stag, total)
            gather.copy_out(msg, _UNTAGGED_PREFIX, total)
            return WC_SUCCESS, gather, msg, send_op, inv_stag
        return WC_SUCCESS, gather, None, 0, 0

    def _start_one_send(self, msg: bytearray, wr_id: int, signaled: bool, n: int, rkey: int, raddr: int,
                        gather: Gather | None, send_op: int, inv_stag: int) -> int:
        """A one-segment Send (``msg``, ``n`` payload bytes): queued (or
        sent) now, as ``start_next`` does a one-segment Write.  Returns 1
        (messages queued)."""
        # A Send completes on the peer's Modified ACK, which carries the
        # link's ACK too: the link need not ask for one at once.
        self.send_or_queue(msg, ack_now=False, taking=1)
        wr = OutWR(wr_id, WC_SEND, signaled, n)
        self._taken(wr, rkey, raddr)
        # kept until the Modified ACK: an RNR NACK has it sent again
        if gather is None:  # inline: the bytes that left
            gather = Gather([(memoryview(msg), _UNTAGGED_PREFIX, n)])
        m = Q0Message(self.send_msn, wr, gather, send_op, inv_stag)
        m.sent = n
        self._queue_q0(m)
        self.q0_cursor += 1
        return 1

    def _start_message(self, wr: OutWR, gather: Gather, opcode: int, flags: int, imm: int) -> None:
        """A Send or an RDMA Write of several segments (or with Immediate
        Data) begins: queued on queue 0, or under way in ``sending``, for
        the pump to cut."""
        solicited = bool(flags & SEND_SOLICITED)
        link = self.link
        assert link is not None
        if opcode in SEND_WR:
            # RFC 5040 §5.3: Send, with Invalidate (the STag rides in the header)
            # and/or Solicited Event; with Immediate it is followed by RFC 7306
            # Immediate Data that completes the same receive (envelope IMM_FOLLOWS).
            inv = opcode == WR_SEND_WITH_INV
            with_imm = opcode == WR_SEND_WITH_IMM
            # A stream's Send may be cut evenly, unless we owe the peer a
            # Modified ACK: its last segment should carry it, and in an
            # equal cut the trailer does not fit (_send_q0_segments).
            stream = len(self.outstanding) > 1 and not self.flow_ack_due
            seg = link.segment_size(gather.total, stream, untagged=True)
            self._queue_q0(Q0Message(self.send_msn, wr, gather, SEND_OPCODE[inv, solicited and not with_imm],
                                     imm if inv else 0, IMM_FOLLOWS if with_imm else 0, seg=seg))
            if with_imm:
                self._queue_q0(Q0Message(self.send_msn, wr, None,
                                         Opcode.IMMEDIATE_DATA_SE if solicited else Opcode.IMMEDIATE_DATA, imm=imm))
        else:
            # another WR outstanding: a stream's message, which may be cut evenly
            seg = link.segment_size(gather.total, len(self.outstanding) > 1)
            self.sending = OutgoingWrite(wr, gather, opcode == WR_WRITE_WITH_IMM, imm, solicited, seg)

    def _taken(self, wr: OutWR, rkey: int, raddr: int) -> None:
        """The WQE ``wr`` was made from leaves the SQ; the WR waits for its completion."""
        self.sq.pop()
        wr.rkey, wr.raddr = rkey, raddr
        self.outstanding.append(wr)

    # -- building segments -----------------------------------------------------
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
        """The only segment of a Send (RDMAP ``send_op``, ``send_rdmap``'s)
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
        segment.pack_untagged_into(buf, 0, self.dest_qpn, self.qpn, opcode, last, msn & U32, mo, inv_stag,
                                   (flags | FLOW_ACK if carry else flags) if last else 0)
        if last:
            if carry:
                envelope.pack_flow_ack_into(buf, _UNTAGGED_PREFIX + n, self.rx_msn)
            self.flow_ack_sent(carry)
        return buf

    def untagged_segment(self, opcode: int, msn: int, n: int) -> bytearray:
        """A single-segment untagged message with room for an ``n``-byte
        body at ``_UNTAGGED_PREFIX``, its header packed."""
        buf = bytearray(_UNTAGGED_PREFIX + n)
        segment.pack_untagged_into(buf, 0, self.dest_qpn, self.qpn, opcode, True, msn & U32, 0)
        return buf

    # -- handing messages to the link --------------------------------------------
    def _write_queued(self, wr: OutWR, num: int) -> None:
        """The last segment of the RDMA Write ``wr`` (no Immediate Data) is
        queued as link message ``num``: it completes once the link has it
        acknowledged."""
        wr.last_n = num
        assert self.link is not None
        self.link.ack_waiters.append((num, self))

    def _queue_q0(self, m: Q0Message) -> None:
        self.q0.append(m)
        m.wr.q0_last = m.msn
        self.send_msn += 1

    def send_untagged(self, opcode: int, msn: int, body: bytes) -> None:
        """Queue a single-segment untagged message from its body (Immediate
        Data, an Atomic Response, Terminate; requests are packed in place)."""
        assert self.link is not None
        buf = self.untagged_segment(opcode, msn, len(body))
        buf[_UNTAGGED_PREFIX:] = body
        if opcode == Opcode.TERMINATE:
            # Found while receiving: it leaves with the pass's other
            # datagrams, after the ACK of everything the pass received.
            self.link.send(buf)
        else:
            self.send_or_queue(buf)

    def send_or_queue(self, buf: bytearray, ack_now: bool = True, request: bool = False,
                      taking: int = 0) -> int | None:
        """Queue the whole message ``buf`` on the link, or, when it is the
        last thing this QP has to send for now, send it at once if the link
        would send it alone anyway (``PeerLink.send_alone``): in a ping-pong
        the peer waits on this datagram, and the rest of the pass (the
        link's bookkeeping included) can come after it.  Returns its link
        message number (None for a request queued with ``send_request``).
        ``taking``: WQEs still on the SQ that are this message's (1 while
        ``start_next`` has not popped the one it builds from)."""
        link = self.link
        assert link is not None
        if not self.irrq and self.q0_cursor >= len(self.q0) and (self.sq.hdr.producer - self.sq.cons) & U32 == taking:
            num = link.send_alone(buf, ack_now, not request)
            if num is not None:
                return num
        if request:
            link.send_request(buf)
            return None
        return link.send(buf, ack_now)

    def _send_read_request(self, wr: OutWR, gather: Gather, rkey: int, raddr: int) -> None:
        sink = self.next_sink
        self.next_sink = (sink + 1) & U32 or 1
        wr.sink_stag = sink
        # header and body packed into one buffer: no ReadRequest tuple, no copy
        buf = self.untagged_segment(OP_READ_REQUEST, self.read_msn, rdmap.READ_REQUEST_LEN)
        rdmap.pack_read_request_into(buf, _UNTAGGED_PREFIX, sink, 0, gather.total, rkey, raddr)
        # The peer's daemon answers it itself, after taking the ACK it
        # carries: not an answer to hold our ACK for (transport/link.py).
        self.send_or_queue(buf, request=True, taking=1)
        self.read_msn += 1  # a Read completes when placed, not when its request is acked
        self.orrq.append(PendingRead(wr, gather))

    def _send_atomic_request(self, wr: OutWR, gather: Gather, aop: int, rkey: int, raddr: int,
                             compare_add: int, swap: int) -> None:
        # RFC 7306 §5.2: verbs' plain FetchAdd is a masked add with no field
        # boundaries (mask 0); CmpSwap compares and swaps all 64 bits.
        buf = self.untagged_segment(OP_ATOMIC_REQUEST, self.read_msn, rdmap.ATOMIC_REQUEST_LEN)
        if aop == AtomicOp.FETCH_ADD:
            rdmap.pack_atomic_request_into(buf, _UNTAGGED_PREFIX, aop, self.next_req_id, rkey, raddr, compare_add,
                                           0, 0, 0)
        else:
            rdmap.pack_atomic_request_into(buf, _UNTAGGED_PREFIX, aop, self.next_req_id, rkey, raddr, swap, U64,
                                           compare_add, U64)
        wr.atomic_msn = self.read_msn
        self.send_or_queue(buf, request=True, taking=1)  # as a Read Request
        self.read_msn += 1
        self.orrq.append(PendingAtomic(wr, gather, self.next_req_id))
        self.next_req_id = (self.next_req_id + 1) & U32

    # -- the pump ----------------------------------------------------------------
    def pump_messages(self, link: PeerLink, budget: int, start: bool) -> int:
        """Queue up to ``budget`` messages on ``link`` (responses first, then
        queue 0, then the Write under way or new WQEs unless ``start`` is
        False); return how many."""
        sent = 0
        lane = self.device.native is not None
        taken = 0
        while sent < budget and link.link.send_space() > 0:
            if taken >= FLUSH_EVERY:
                # A long turn sends what it has so far: the peer starts on
                # it, and its acknowledgments (a Send's completes on the
                # Modified ACK) come back while the turn goes on.
                link.flush()
                taken = 0
            # Read and atomic responses first: the peer is waiting on us.
            if self.irrq:
                sent += self.send_response(budget - sent)
                continue
            if self.state != RTS:
                break
            if self.rnr_until is not None:
                if self.device.now < self.rnr_until:
                    break  # receiver not ready: back off (a RESUME ends this early)
                self.rnr_until = None
            if self.q0_cursor < len(self.q0):
                sent += self._send_q0_segments(link.max_data - _UNTAGGED_EXTRA, budget - sent, lane)
                continue
            if self.rnr_blocked_msn >= 0:
                break  # Modified ACK/NACK: nothing new until the NACKed message is accepted
            s = self.sending
            if s is None:
                if lane and start:
                    # a stream's small messages that are alike: all in one call
                    k, segments = self.take_batch(link, FLUSH_EVERY - taken, min(budget - sent,
                                                                                 link.link.send_space()))
                    if k:
                        sent += segments
                        taken += k
                        continue
                queued = self.start_next() if start else -1
                if queued < 0:
                    break
                sent += queued
                taken += 1
                if self.state != RTS:
                    break
                continue
            sent += self._send_write_segments(s, link, budget - sent, lane)
        return sent

    def _send_write_segments(self, s: OutgoingWrite, link: PeerLink, room: int, lane: bool) -> int:
        """Queue the next segments (at most ``room``) of the RDMA Write ``s``
        (RFC 5040 §5.1: tagged segments into the peer's STag); return how many."""
        remaining = s.gather.total - s.sent
        seg = s.seg
        if lane and remaining > seg:
            # Two segments or more: the run within the current SGE goes
            # through the compiled send lane.
            g = s.gather
            view, base, length = g.pieces[g.idx]
            k, last_len, ends = lane_run(remaining, length - g.off, seg, room, link.link.send_space())
            if k:
                num = link.send_tagged_run(Opcode.RDMA_WRITE, self.dest_qpn, self.qpn, s.wr.rkey,
                                           (s.wr.raddr + s.sent) & U64, view, base + g.off, k, seg,
                                           last_len, ends)
                nbytes = (k - 1) * seg + last_len
                g.skip(nbytes)
                s.sent += nbytes
                if ends:
                    self._write_sent(s, num)
                return k
        n = min(seg, remaining)
        last = s.sent + n == s.gather.total
        buf = bytearray(_TAGGED_PREFIX + n)
        self._tagged_packer()(buf, last, s.wr.rkey, (s.wr.raddr + s.sent) & U64)
        if n:
            s.gather.copy_out(buf, _TAGGED_PREFIX, n)
        # (a one-segment Write without Immediate Data never gets here:
        # start_next sends it)
        num = link.send(buf)
        s.sent += n
        if last:
            self._write_sent(s, num)
        return 1

    def _write_sent(self, s: OutgoingWrite, num: int) -> None:
        """The last segment of the RDMA Write ``s`` is queued as message ``num``."""
        self.sending = None
        if s.with_imm:
            # RFC 7306 §4: Immediate Data follows the Write on queue 0 and
            # consumes a receive, so it is subject to RNR like a Send.
            self._queue_q0(Q0Message(self.send_msn, s.wr, None,
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
            self.send_untagged(m.opcode, m.msn, rdmap.encode_immediate_data(m.imm))
            self.q0_cursor += 1
            return 1
        link = self.link
        assert link is not None
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
            k, last_len, ends = lane_run(remaining, length - g.off, max_data, room, link.link.send_space())
            if k:
                # the Modified ACK we owe rides on the message's last segment
                # when it fits, as _q0_segment puts it there
                carry = ends and self.flow_ack_due and last_len + _FLOW_ACK_LEN <= max_data
                link.send_untagged_run(m.opcode, self.dest_qpn, self.qpn, m.msn & U32, m.sent, m.inv_stag,
                                       m.flags | FLOW_ACK if carry else m.flags, view, base + g.off, k,
                                       max_data, last_len, ends, self.rx_msn if carry else None)
                nbytes = (k - 1) * max_data + last_len
                g.skip(nbytes)
                m.sent += nbytes
                if ends:
                    self.q0_cursor += 1
                    self.flow_ack_sent(carry)
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
            self.send_or_queue(buf, ack_now=False)
        else:
            link.send(buf, ack_now=False)
        return 1
