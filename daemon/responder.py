"""The responder: what the peer sends to this QP, checked and placed.

Theory of operation
-------------------
``on_segment`` takes one DDP segment addressed to the QP (the Python path;
the compiled receive lane in ``rxlane.py`` places runs of them and asks the
methods at the end of this class what it may place, then reports what it
did).  Every tagged segment is checked (RFC 5040 §6.4: STag, PD, access,
bounds) *before* a byte is written; a violation writes nothing, sends a
Terminate (RFC 5040 §4.8) carrying the offending DDP header, and moves the
QP to ERR.

A Send (§5.3, with Invalidate and/or Solicited Event) is untagged
segments on queue 0 that are scattered into the next posted receive, in
MSN order, each at its message offset; Immediate Data (RFC 7306 §4)
completes a Send with Immediate's receive, or consumes one of its own after
an RDMA Write with Immediate.  A Read Request (queue 1) is answered from the
source region by the daemon alone, bounded by IRD; an Atomic Request (queue
1 as well, in the same MSN sequence) is applied to its 8-byte word at once
and its response (queue 3) queued behind earlier Read Responses on the
IRRQ; a repeated one is answered from the replay record, never applied
twice.

Modified ACK/NACK (RHiNET/PM, ``wire/flow.py``), the receiver's side: a
queue-0 message that finds no posted receive is NACKed with our
``min_rnr_timer`` as back-off hint and every later queue-0 segment dropped
until that MSN comes again from MO 0; a RESUME goes as soon as a receive is
posted.  Accepted messages are ACKed cumulatively, by a FLOW message or,
when our own answer follows soon, by a trailer on that answer
(``transport/ackhold.py``'s rule).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

from ..transport.ackhold import AckHold
from ..wire import envelope, flow, rdmap, segment, shm
from ..wire.envelope import Kind
from ..wire.flow import FlowMessage, FlowType
from ..wire.rdmap import AtomicOp, Opcode
from ..wire.shm import EventType, WcFlags, WcOpcode, WcStatus as W
from . import tables
from .atombatch import AtomicRun, send_atomic_run
from .readbatch import ReadRun, send_read_run
from .opcodes import (
    LOCAL_WRITE,
    OP_READ_RESPONSE,
    OP_SEND_SE,
    OP_WRITE,
    Q0_OPCODES,
    RECEIVING,
    REMOTE_ATOMIC,
    REMOTE_READ,
    REMOTE_WRITE,
    TERM_CODE,
    U32,
    U64,
    WC_RECV,
    WC_SUCCESS,
    HOST_ORDER,
    IMM_FOLLOWS,
)
from .records import AtomicReply, Gather, ReadResponse, lane_run

#: IB's RNR timer encoding (IBA table 45): min_rnr_timer code -> microseconds.
RNR_TIMER_US = (655360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840, 5120,
                7680, 10240, 15360, 20480, 30720, 40960, 61440, 81920, 122880, 163840, 245760, 327680, 491520)
#: Atomic responses a responder keeps to answer a repeated request without applying it twice.
ATOMIC_REPLAY = 16
_TAGGED_PREFIX = segment.TAGGED_PREFIX_LEN
_RECV_WQE_HEAD = shm.RECV_WQE_HEAD
_RECV_SG_OFFSET = shm.RECV_WQE_SG_OFFSET
_UNTAGGED_ERROR = {"layer": rdmap.TermLayer.DDP, "etype": rdmap.DdpErrorType.UNTAGGED_BUFFER}
_REMOTE_OPERATION = {"etype": rdmap.RdmapErrorType.REMOTE_OPERATION}


class Responder:
    """The responder's methods of a QueuePair (see the module docstring)."""

    def reset_responder(self) -> None:
        """The responder's state, as a new (or reset) QP has it."""
        self.irrq: deque[ReadResponse | AtomicReply] = deque()  # answers to the peer's requests, in order
        self.term_msn = 1
        self.atomic_resp_msn = 1
        self.rx_write_bytes = 0  # placed by RDMA Writes since the last Immediate Data (its CQE's byte_len)
        self.rx_msn = 1  # next MSN expected on untagged queue 0 (Send, Immediate Data)
        self.rx_recv: tuple[int, Gather | None] | None = None  # receive WQE being filled
        self.rx_placed = 0
        # (ring consumer index, STag table version, peek_receive's answer) of the last look
        self._rx_peeked: tuple[int, int, tuple[int, Gather | None]] | None = None
        self.rx_imm_pending = False  # a Send with IMM_FOLLOWS placed; its Immediate Data completes it
        self.rx_rnr = False  # NACKed rx_msn: drop queue-0 messages until it comes again from MO 0
        self.rx_resume_sent = False
        self.flow_ack_due = False
        # Our answers carry our Modified ACKs (envelope FLOW_ACK): once this
        # QP is seen to Send soon after it takes a Send, an owed ACK waits
        # for the answer (up to the link's delayed-ACK time) instead of
        # leaving alone at once (transport/ackhold.py).
        self.flow_hold = AckHold()
        # the MSN of the next Read or Atomic Request (queue 1, one sequence
        # for both: RFC 7306), as the compiled lane expects it
        self.rx_read_msn = 1
        self.rx_atomic_resp_msn = 1  # and of the next Atomic Response (queue 3)
        self.atomic_replay: OrderedDict[int, bytes] = OrderedDict()
        self.terminated = False

    def on_segment(self, hdr: Any, payload: memoryview, raw: memoryview, flags: int = 0) -> None:
        """Handle one DDP segment addressed to this QP.

        ``raw``: the segment from its DDP header; ``flags``: its envelope flags.
        """
        if self.state not in RECEIVING:
            return
        op = hdr.opcode
        if op == OP_WRITE:
            code = self.device.stags.place(self.pd, REMOTE_WRITE, hdr.stag, hdr.to, payload)
            if code:
                self.terminate(TERM_CODE[code], raw, len(payload))
                return
            self.rx_write_bytes += len(payload)
        elif op == OP_READ_RESPONSE:
            self.on_read_response(hdr, payload, raw)
        elif op in Q0_OPCODES:
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
            self.on_terminate(payload)
        else:  # pragma: no cover - the decoder admits no other opcode
            self.terminate(rdmap.RdmapErrorCode.UNEXPECTED_OPCODE, raw, len(payload), **_REMOTE_OPERATION)

    # -- Read and atomic requests ----------------------------------------------
    def on_request(self, op: int, msn: int, payload: memoryview, raw: memoryview) -> None:
        """A Read Request or an Atomic Request, message ``msn`` of its queue:
        check it and queue its answer (the Python path's segment, or one the
        compiled lane took whole: ``raw`` from the DDP header, as for
        :meth:`on_segment`)."""
        if op == Opcode.RDMA_READ_REQUEST:
            # Where the compiled lane expects the next one.  This path does
            # not hold a request to it (the link delivers in order): one
            # the lane refuses for its MSN is answered here.
            self.rx_read_msn = (msn + 1) & U32
            self._on_read_request(payload, raw)
        else:
            self._on_atomic_request(msn, payload, raw)

    def _on_read_request(self, payload: memoryview, raw: memoryview) -> None:
        try:
            req = rdmap.decode_read_request_untrusted(payload)
        except Exception:  # decoder raises WireError only; keep the daemon up regardless
            self.terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload), **_REMOTE_OPERATION)
            return
        if len(self.irrq) >= self.ird:
            # RFC 5040 §6.5: more outstanding Reads than IRD is a remote operation error.
            self.terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload), rdmap_header=bytes(payload),
                           **_REMOTE_OPERATION)
            return
        mr = self.device.stags.lookup(req.src_stag)
        code, off = (tables.INVALID_STAG, 0) if mr is None else mr.check(
            self.pd, REMOTE_READ, req.src_to, req.size, tagged=True)
        if code:
            self.terminate(TERM_CODE[code], raw, len(payload), rdmap_header=bytes(payload))
            return
        # responses queued ahead make this one part of a stream
        seg = self.link.segment_size(req.size, bool(self.irrq))
        self.irrq.append(ReadResponse(mr.view, off, req.size, req.sink_stag, req.sink_to, seg))

    def _on_atomic_request(self, msn: int, payload: memoryview, raw: memoryview) -> None:
        """RFC 7306 §5: apply an atomic to an 8-byte word and queue its response.

        The data loop is one thread, so an atomic is indivisible with respect to
        every other atomic and every RDMA Write on this daemon, from any QP.
        """
        try:
            req = rdmap.decode_atomic_request_untrusted(payload)
        except Exception:  # WireError only
            self.terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload), **_REMOTE_OPERATION)
            return
        if msn != self.rx_read_msn:
            cached = self.atomic_replay.get(msn)
            if cached is None:
                self.terminate(rdmap.DdpUntaggedErrorCode.INVALID_MSN_RANGE, raw, len(payload), **_UNTAGGED_ERROR)
                return
            # A repeated request (its response was lost on some path): answer it
            # again from the record, never apply it a second time.
            self.device.stats["atomic_replayed"] += 1
            self.irrq.append(AtomicReply(cached))
            return
        if len(self.irrq) >= self.ird:
            self.terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload), **_REMOTE_OPERATION)
            return
        mr = self.device.stags.lookup(req.stag)
        code, off = (tables.INVALID_STAG, 0) if mr is None else mr.check(
            self.pd, REMOTE_ATOMIC, req.to, 8, tagged=True)
        if code:
            self.terminate(TERM_CODE[code], raw, len(payload))
            return
        if req.to & 7:
            # RFC 7306 §5.2: the target must be 8-byte aligned.
            self.terminate(rdmap.RdmapErrorCode.BASE_OR_BOUNDS_VIOLATION, raw, len(payload))
            return
        word = mr.view[off:off + 8]
        orig = int.from_bytes(word, HOST_ORDER)
        word[:] = apply_atomic(req, orig).to_bytes(8, HOST_ORDER)
        body = rdmap.encode_atomic_response(rdmap.AtomicResponse(req.req_id, orig))
        self.rx_read_msn = (msn + 1) & U32
        self.atomic_replay[msn] = body
        if len(self.atomic_replay) > ATOMIC_REPLAY:
            self.atomic_replay.popitem(last=False)
        self.irrq.append(AtomicReply(body))

    def send_response(self, room: int) -> int:
        """Send the next segments (at most ``room``) of the IRRQ head, a Read
        Response or an Atomic Response; return how many."""
        r = self.irrq[0]
        if type(r) is ReadRun:
            return send_read_run(self, r, room)
        if type(r) is AtomicRun:
            return send_atomic_run(self, r, room)
        if type(r) is AtomicReply:
            self.irrq.popleft()
            self.send_untagged(Opcode.ATOMIC_RESPONSE, self.atomic_resp_msn, r.body)
            self.atomic_resp_msn += 1
            return 1
        remaining = r.size - r.sent
        seg = r.seg
        link = self.link
        if self.device.native is not None and remaining > seg:
            k, last_len, ends = lane_run(remaining, remaining, seg, room, link.link.send_space())
            if k:
                link.send_tagged_run(Opcode.RDMA_READ_RESPONSE, self.dest_qpn, self.qpn, r.sink_stag,
                                     (r.sink_to + r.sent) & U64, r.view, r.off + r.sent, k, seg, last_len, ends)
                r.sent += (k - 1) * seg + last_len
                if ends:
                    self.irrq.popleft()
                return k
        n = min(seg, remaining)
        last = r.sent + n == r.size
        buf = bytearray(_TAGGED_PREFIX + n)
        segment.pack_tagged_into(buf, 0, self.dest_qpn, self.qpn, Opcode.RDMA_READ_RESPONSE, last, r.sink_stag,
                                 (r.sink_to + r.sent) & U64)
        start = r.off + r.sent
        buf[_TAGGED_PREFIX:] = r.view[start:start + n]
        if last:
            self.irrq.popleft()
        if last and not r.sent:
            self.send_or_queue(buf)
        else:
            link.send(buf)
        r.sent += n
        return 1

    # -- Sends and Immediate Data on queue 0 --------------------------------------
    def _take_receive(self, hdr: Any, raw: memoryview, seglen: int) -> bool:
        """Start the next queue-0 message: check its MSN, take the next receive WQE.

        Returns False when the message cannot start: an MSN out of order ends
        in a Terminate; no posted receive in an RNR NACK (``rx_rnr`` set).
        """
        if hdr.msn != self.rx_msn or hdr.mo != 0:
            # RFC 5041 §7.2: MSN out of range / bad MO for the untagged queue.
            self.terminate(rdmap.DdpUntaggedErrorCode.INVALID_MSN_RANGE, raw, seglen, **_UNTAGGED_ERROR)
            return False
        recv = self.peek_receive()
        if recv is None:
            # Receiver not ready (RHiNET/PM Modified ACK/NACK): NACK this MSN and
            # drop the rest of queue 0 until the sender comes back to it.  The
            # back-off hint is our min_rnr_timer, as an IB RNR NAK carries it.
            self.rx_rnr = True
            self.rx_resume_sent = False
            self.device.stats["rnr_nack_sent"] += 1
            self.rnr_nacks_sent += 1
            code = int(self.attrs["min_rnr_timer"])
            self._send_flow(FlowType.RNR_NACK, self.rx_msn, RNR_TIMER_US[code if 0 <= code < 32 else 0])
            return False
        self.take_receive(recv)
        return True

    def peek_receive(self) -> tuple[int, Gather | None] | None:
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
        recv = wr_id, self.resolve(rq.buf, at + _RECV_SG_OFFSET, n, LOCAL_WRITE) if n <= self.max_recv_sge else None
        self._rx_peeked = (rq.cons, version, recv)
        return recv

    def prefetch_receive(self) -> None:
        """Resolve the next posted receive now, if a Send may come for it:
        called after a pass's datagrams left, when nothing waits on us (a
        Send ping-pong's answer comes a round trip later), so that its
        resolution is off the path of the pass that places the Send."""
        if self.rx_recv is None and self.state in RECEIVING and not self.rx_rnr:
            self.peek_receive()

    def take_receive(self, recv: tuple[int, Gather | None]) -> None:
        """Start the next queue-0 message in ``recv``, the receive
        ``peek_receive`` returned just before: take it from the ring."""
        self.rx_recv = recv
        self.rx_placed = 0
        self.recv_ring.pop()
        if self.srq is not None:
            self.srq.took_one()

    def _finish_receive(self, status: int, opcode: int, byte_len: int, imm: int = 0, flags: int = 0,
                        solicited: bool = False, written: bool = False) -> None:
        """Complete the receive under way; ``written``: its (successful)
        CQE is in the ring already, written by the armed read."""
        wr_id, _ = self.rx_recv  # type: ignore[misc]
        self.rx_recv = None
        self.rx_imm_pending = False
        self.rx_msn = (self.rx_msn + 1) & U32
        if status == WC_SUCCESS:
            self.flow_ack_due = True  # Modified ACK: the sender may complete the WR
        if written:
            self.recv_cq.pushed(1, solicited)
            return
        self.recv_cq.push(wr_id, status, opcode, byte_len if status == 0 else 0, self.qpn, self.dest_qpn,
                          imm, flags, solicited=solicited)

    def _on_send(self, hdr: Any, payload: memoryview, raw: memoryview, flags: int) -> None:
        n = len(payload)
        if self.rx_recv is None:
            if not self._take_receive(hdr, raw, n):
                return
        elif self.rx_imm_pending or hdr.msn != self.rx_msn or hdr.mo != self.rx_placed:
            self.terminate(rdmap.DdpUntaggedErrorCode.INVALID_MO, raw, n, **_UNTAGGED_ERROR)
            return
        _, gather = self.rx_recv  # type: ignore[misc]
        if gather is None:
            # The receive's own SGEs are bad: a local error at this end (verbs
            # LOC_PROT_ERR on the receive), and the sender learns by Terminate.
            self._finish_receive(W.IBV_WC_LOC_PROT_ERR, WcOpcode.IBV_WC_RECV, 0)
            self.terminate(rdmap.RdmapErrorCode.CATASTROPHIC_LOCALIZED, raw, n, **_REMOTE_OPERATION)
            return
        if self.rx_placed + n > gather.total:
            self._finish_receive(W.IBV_WC_LOC_LEN_ERR, WcOpcode.IBV_WC_RECV, 0)
            self.terminate(rdmap.DdpUntaggedErrorCode.MESSAGE_TOO_LONG, raw, n, **_UNTAGGED_ERROR)
            return
        if n:
            gather.scatter(self.rx_placed, payload)
        self.rx_placed += n
        if hdr.last:
            self._send_ended(hdr, raw, n, flags)

    def _send_ended(self, hdr: Any, raw: memoryview, n: int, flags: int) -> None:
        """The last segment of a Send is placed: invalidate its STag if it
        carries one, then complete its receive (or, with IMM_FOLLOWS, wait
        for the Immediate Data)."""
        wc_flags = 0
        inv = hdr.inv_stag
        op = hdr.opcode
        if op == Opcode.SEND_INVALIDATE or op == Opcode.SEND_SE_INVALIDATE:
            # RFC 5040 §5.3 / §6.x: the STag is invalid before the receive completes.
            mr = self.device.stags.lookup(inv)
            if mr is None or mr.pd is not self.pd:
                self._finish_receive(W.IBV_WC_LOC_PROT_ERR, WcOpcode.IBV_WC_RECV, 0)
                self.terminate(rdmap.RdmapErrorCode.STAG_CANNOT_BE_INVALIDATED, raw, n, **_REMOTE_OPERATION)
                return
            self.device.stags.invalidate(inv)
            self.device.stats["stag_remote_invalidated"] += 1
            wc_flags = WcFlags.IBV_WC_WITH_INV
        if flags & IMM_FOLLOWS and not wc_flags:
            # Send with Immediate: the receive completes with the Immediate Data next.
            self.rx_imm_pending = True
            self.rx_msn = (self.rx_msn + 1) & U32
            return
        self._finish_receive(W.IBV_WC_SUCCESS, WcOpcode.IBV_WC_RECV, self.rx_placed, inv if wc_flags else 0,
                             wc_flags, solicited=op == Opcode.SEND_SE or op == Opcode.SEND_SE_INVALIDATE)

    def _on_immediate(self, hdr: Any, payload: memoryview, raw: memoryview) -> None:
        try:
            imm = rdmap.decode_immediate_data_untrusted(payload)
        except Exception:
            self.terminate(rdmap.RdmapErrorCode.UNSPECIFIED, raw, len(payload), **_REMOTE_OPERATION)
            return
        solicited = hdr.opcode == Opcode.IMMEDIATE_DATA_SE
        if self.rx_imm_pending:
            if hdr.msn != self.rx_msn:
                self.terminate(rdmap.DdpUntaggedErrorCode.INVALID_MSN_RANGE, raw, len(payload), **_UNTAGGED_ERROR)
                return
            # The second half of a Send with Immediate: one receive, the Send's length.
            self._finish_receive(W.IBV_WC_SUCCESS, WcOpcode.IBV_WC_RECV, self.rx_placed, imm & U32,
                                 WcFlags.IBV_WC_WITH_IMM, solicited=solicited)
            return
        if self.rx_recv is not None:
            self.terminate(rdmap.DdpUntaggedErrorCode.INVALID_MSN_RANGE, raw, len(payload), **_UNTAGGED_ERROR)
            return
        if not self._take_receive(hdr, raw, len(payload)):
            return
        # RFC 7306 §4: Immediate Data consumes a receive; verbs reports the Write's length.
        self._finish_receive(W.IBV_WC_SUCCESS, WcOpcode.IBV_WC_RECV_RDMA_WITH_IMM, self.rx_write_bytes,
                             imm & U32, WcFlags.IBV_WC_WITH_IMM, solicited=solicited)
        self.rx_write_bytes = 0

    # -- Modified ACK/NACK, the receiver's side (wire/flow.py) ------------------
    def _send_flow(self, ftype: int, msn: int, backoff_us: int = 0) -> None:
        if self.link is None or not self.link.up:
            return  # the link is gone: the QP is failing anyway
        # The peer's link need not ACK a Modified ACK at once: nothing waits
        # for that ACK but our retransmission state, and in a Send ping-pong
        # each one drew a datagram back that this daemon then had to take.
        self.link.send(envelope.encode(Kind.FLOW, self.dest_qpn, self.qpn,
                                       flow.encode(FlowMessage(ftype, msn & U32, backoff_us))),
                       ack_now=ftype != FlowType.ACK)

    def send_flow_control(self) -> None:
        """Once per pump: the cumulative ACK of accepted queue-0 messages
        (unless it waits for our answer to carry it), and a RESUME once a
        receive is posted after an RNR NACK."""
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

    def flow_ack_sent(self, carried: bool) -> None:
        """One of our messages' last segment is queued, ``carried``: with the
        Modified ACK we owed on it."""
        if carried:
            self.flow_ack_due = False
            self.device.stats["flow_ack_carried"] += 1
        self.flow_hold.answered(self.device.now, carried)

    # -- Terminate (RFC 5040 §4.8, §7.1) ------------------------------------------
    def terminate(self, ecode: int, raw: memoryview, seglen: int, *,
                  layer: int = rdmap.TermLayer.RDMAP, etype: int = rdmap.RdmapErrorType.REMOTE_PROTECTION,
                  rdmap_header: bytes = b"") -> None:
        """Answer a violation: nothing placed, Terminate to the peer, QP to ERR (RFC 5040 §7.1)."""
        self.device.stats["terminate_sent"] += 1
        hlen = rdmap.ddp.TAGGED_HEADER_LEN if raw[0] & rdmap.ddp.T_FLAG else rdmap.ddp.UNTAGGED_HEADER_LEN
        term = rdmap.Terminate(layer, etype, ecode, True, min(seglen + hlen, 0xFFFF), bytes(raw[:hlen]),
                               rdmap_header)
        if self.link is not None and self.link.up:
            self.send_untagged(Opcode.TERMINATE, self.term_msn, rdmap.encode_terminate(term))
        self.term_msn += 1
        self.terminated = True
        self.fatal(f"sent Terminate layer={layer} etype={etype} ecode={ecode:#x}",
                   EventType.IBV_EVENT_QP_ACCESS_ERR)

    # -- what the compiled receive lane asks, and what it reports (rxlane.py) ----
    def write_target(self, stag: int) -> tables.MemoryRegion | None:
        """The region an RDMA Write to ``stag`` may be placed into by the
        lane (in this QP's PD, remote write allowed; the lane checks the
        bounds of each segment); None: not by the lane."""
        mr = self.device.stags.lookup(stag)
        if mr is None or mr.pd is not self.pd or not mr.access & REMOTE_WRITE:
            return None
        return mr

    def send_target(self) -> tuple[tuple[int, Gather | None], tuple[memoryview, int, int], int] | None:
        """Where the lane may place the next Send segments: (the receive
        under way or the next posted one, its one SGE piece, the message
        offset reached); None when the lane may not (no receive, one of
        several SGEs, or a NACK or Immediate Data pending)."""
        if self.rx_imm_pending or self.rx_rnr:
            return None
        recv = self.rx_recv or self.peek_receive()
        gather = None if recv is None else recv[1]
        if gather is None or len(gather.pieces) != 1:
            return None
        return recv, gather.pieces[0], 0 if recv is not self.rx_recv else self.rx_placed  # type: ignore[return-value]

    def writes_placed(self, nbytes: int) -> None:
        """The lane placed ``nbytes`` of RDMA Writes (counted for a Write with Immediate's receive)."""
        self.rx_write_bytes += nbytes

    def sends_placed(self, op: int, recv: tuple[int, Gather | None], nbytes: int, ended: bool,
                     written: bool = False) -> None:
        """The lane placed ``nbytes`` of Send segments into ``recv`` (which
        ``send_target`` named): take it from the ring if the run started it,
        and complete it if the run ended a plain Send (or Send with
        Solicited Event) ``op`` (``written``: the armed read wrote its CQE)."""
        if recv is not self.rx_recv:
            self.take_receive(recv)
        self.rx_placed += nbytes
        if ended:
            self._finish_receive(WC_SUCCESS, WC_RECV, self.rx_placed, solicited=op == OP_SEND_SE, written=written)

    def request_msn(self, op: int) -> int:
        """The MSN the next whole request (or Atomic Response) ``op`` must carry."""
        return self.rx_atomic_resp_msn if op == Opcode.ATOMIC_RESPONSE else self.rx_read_msn


def apply_atomic(req: rdmap.AtomicRequest, orig: int) -> int:
    """The new value of the target word (RFC 7306 §5.2, masked operations)."""
    if req.aop == AtomicOp.FETCH_ADD:
        mask = req.add_swap_mask
        if not mask:
            return (orig + req.add_swap_data) & U64
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
    return (orig & ~req.add_swap_mask & U64) | (req.add_swap_data & req.add_swap_mask)
