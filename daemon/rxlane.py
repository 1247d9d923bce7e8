"""The compiled receive lane's glue: runs of segments placed in one C call.

Theory of operation
-------------------
While a peer streams, most of what it sends is more of the same: segments
of one RDMA Write into one region, Read Responses into the ORRQ head's
sink, a Send's segments into one receive, Read or atomic requests, Atomic
Responses.  The receive side remembers what came last from each peer link
(``PeerLink.rx_hint``); from that, :meth:`ReceiveLane.setup` fills the
lane's run description (``udpv_rx_run``, ``wire/native.py``) with what the
next datagrams may be, and the C function ``udpv_rx_write_run`` checks each
datagram of a buffer against it (link header, tag, sequence, CRC, envelope,
DDP/RDMAP header, bounds) and places the payloads, stopping at the first it
does not take.  What it did not take goes the Python path
(``receive.Receiver``), one datagram at a time.

What the lane does not check, :meth:`setup` checks once per call, asking the
QP's responder and completer: the hinted QP still receives on this link;
for a Write, the STag names a region of its PD with remote write access; for
a Read Response, it is the sink of the Read at the ORRQ head, one SGE; for
a Send, a receive of one SGE is under way or posted and no RNR NACK or
Immediate Data is pending.  After the call, :meth:`run_taken` reports what
was placed to the QP (its responder and completer complete receives and
Reads), takes whole requests and Atomic Responses as the Python path does,
and accounts for the run on the link (``Link.data_run_received``).

Arming (:meth:`arm`): at the end of a pass that sent, the lane is set up for
the answer before it comes; the next pass reads the socket and places the
answer in one compiled call (``Receiver.read_armed``).  What the set-up read
may change before then is checked again there.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple

from ..wire import ddp, envelope, rdmap, segment, shm
from ..wire import link as wire_link
from ..wire.rdmap import Opcode
from .opcodes import (
    ANSWERED_BY_DAEMON,
    OP_ATOMIC_REQUEST,
    OP_ATOMIC_RESPONSE,
    OP_READ_RESPONSE,
    OP_WRITE,
    RECEIVING,
    SEND_OPCODE,
    U32,
)
from .atombatch import AtomicScratch, answer_atomics, atomics_answered
from .peer import PeerLink
from .readbatch import ReadScratch, ReadSinks, answer_reads, reads_whole_placed, whole_reads
from .records import PendingRead
from .responder import ATOMIC_REPLAY
from .rxsends import SendBatch, more_sends
from .udp import RX_BUF

# The lane's control bytes: (DDP control of a segment that is not the last,
# RDMAP control[, DDP control of the last])
WRITE_CTRL = (*rdmap.tagged_control(Opcode.RDMA_WRITE, False), rdmap.tagged_control(Opcode.RDMA_WRITE, True)[0])
READ_RESPONSE_CTRL = (*rdmap.tagged_control(Opcode.RDMA_READ_RESPONSE, False),
                      rdmap.tagged_control(Opcode.RDMA_READ_RESPONSE, True)[0])
# The lane never takes a Send with Invalidate's last segment (the STag is
# invalidated in Python before the receive completes), so the control byte
# of the others stands for both.  (A "matches nothing" value would need
# care: 0 is a control byte the decoder refuses, and the lane would accept
# it.)  A plain Send's or a Read Response's last segment ends the lane's
# run, and ``run_taken`` completes the receive or the Read.
SEND_ENDS_IN_LANE = frozenset({int(Opcode.SEND), int(Opcode.SEND_SE)})
SEND_CTRL = {int(op): (ctrl, rctl, rdmap.UNTAGGED_CONTROL[op, True][0] if op in SEND_ENDS_IN_LANE else ctrl)
             for (op, last), (ctrl, rctl, _) in rdmap.UNTAGGED_CONTROL.items()
             if not last and op in SEND_OPCODE.values()}
#: what the lane places by STag (the rest of its runs are Sends or whole requests and responses)
TAGGED_LANE = frozenset({OP_WRITE, OP_READ_RESPONSE})
# Requests and Atomic Responses the lane takes whole, one per run, each of
# its fixed size (RFC 5040 §4.4, RFC 7306 §5.2, §5.3) on its own queue:
# (DDP control of a segment that is not the last, RDMAP control, DDP
# control of the last, QN, body length)
REQUEST_LANE = {int(op): (*rdmap.UNTAGGED_CONTROL[op, False][:2], *rdmap.UNTAGGED_CONTROL[op, True][::2],
                          rdmap.SINGLE_SEGMENT[op]) for op in (*ANSWERED_BY_DAEMON, OP_ATOMIC_RESPONSE)}
#: at most this many of them in one lane call (a GRO buffer holds up to 64 datagrams)
WHOLE_MAX = 64
#: where a segment's DDP header starts in a link packet, and how much follows its payload
_SEGMENT_AT = wire_link.HEADER_LEN + envelope.ENVELOPE_LEN
_CRC_LEN = wire_link.CRC_LEN
_TN = tuple.__new__  # a NamedTuple built without its Python __new__ (see rdmap)
OP_SEND = int(Opcode.SEND)
_WC_RECV = int(shm.WcOpcode.IBV_WC_RECV)
#: where a ring header's consumer index is (its producer index is its first word)
_CONSUMER_AT = shm.ffi.offsetof("struct uv_ring_hdr", "consumer")


class RunSetup(NamedTuple):
    """What :meth:`ReceiveLane.setup` set the lane's run up for, as
    :meth:`ReceiveLane.run_taken` needs it after the call."""

    qp: Any  #: the QueuePair the run is for
    op: int  #: its RDMAP opcode
    view: Any  #: the memory the lane writes into (None: it only checks)
    start: int  #: where in ``view`` the run's offsets count from
    recv: Any  #: a Send's receive (``Responder.send_target``)
    rd: Any  #: Read Responses' PendingRead (``Completer.read_sink``)
    request: Any  #: whole requests' or Atomic Responses' ``REQUEST_LANE`` entry
    msn: Any  #: their first MSN


class LaneCall(NamedTuple):
    """One lane call over Read Responses (``ReceiveLane.next_reads_responses``)."""

    count: int  #: datagrams taken
    nbytes: int  #: payload bytes placed (-1: a call of ``udpv_read_responses``, which ended ``ended`` Reads)
    ended: int  #: the call ended its Read (or how many)
    ack: int  #: the ACK field the datagrams carried
    ts: int  #: the first datagram's timestamp, echo, window and flags
    echo: int
    rwnd: int
    flags: int
    last_ts: int  #: the last datagram's timestamp and window
    last_rwnd: int
    flags_or: int  #: the flags of all of them
    end: int  #: the buffer offset after the call's datagrams


def _call_of(r: Any, count: int, end: int) -> LaneCall:
    return _TN(LaneCall, (count, r.bytes, r.ended, r.first_ack, r.first_ts, r.first_echo, r.first_rwnd,
                          r.first_flags, r.last_ts, r.last_rwnd, r.flags_or, end))


class ReceiveLane:
    """The compiled receive lane's state and the calls around it (see the module docstring)."""

    def __init__(self, native: Any, qps: dict[int, Any], stags: Any, stats: collections.Counter[str],
                 scheduler: Any, eager_answers: bool) -> None:
        ffi = native.ffi
        self.ffi = ffi
        self.lib = native.lib
        self.qps = qps
        self.stags = stags
        self.stats = stats
        self.sched = scheduler
        self.eager_answers = eager_answers
        self.run = ffi.new("udpv_rx_run *")
        self.recv = ffi.new("udpv_rx_recv *")  # the armed read's socket and source (Receiver.read_armed)
        self.buf = ffi.new("uint8_t[]", RX_BUF)
        self.sends = SendBatch(native)  # (rxsends.py)
        #: the armed read of a Send writes its receive's CQE (``read_send``)
        self.cqe_in_read = True
        self.send_cqe = ffi.new("udpv_rx_send_cqe *")
        self.send_cqe.wc_recv = _WC_RECV
        #: the receive CQ ``send_cqe`` is set up for; whether the arming is a
        #: Send's whose CQE the read may write; the CQE the last read wrote
        self.cqe_ring: Any = None
        self.cqe_armed = False
        self.cqe_written = 0
        self.atomics = AtomicScratch(native)  # (atombatch.py)
        self.reads = ReadScratch(native)  # (readbatch.py)
        self.sinks = ReadSinks(native)
        # the lane's memory for whole requests and Atomic Responses: none
        # (the QP reads them in the datagram)
        self.no_mem = ffi.cast("uint8_t *", 0)
        #: what ``run``'s constant settings are for: (rx_hint, region, dest QPN) of
        #: a Write, (rx_hint, dest QPN) of a Send; None: set them
        self.run_key: Any = None
        #: the lane set up ahead for the next datagram (``arm``): (link,
        #: ``setup``'s answer, memory, the link's next sequence, the STag
        #: table's version)
        self.armed: tuple[PeerLink, RunSetup, Any, int, int] | None = None
        #: whether ``arm`` may set the compiled read up: not with a cluster
        #: key, since that read places a datagram before anything could check its tag
        self.may_arm = True

    # -- setting a run up ---------------------------------------------------------
    def setup(self, pl: PeerLink, limit: int, drop: bool = True) -> RunSetup | None:
        """Set the lane's run for what ``pl``'s hint names, after the checks
        the module docstring lists; return what the run's taking needs
        (``run_taken``), or None (the hint dropped, unless ``drop`` is
        False, or the link takes nothing in a run now).  ``limit``: the most
        whole requests one call may take."""
        hint = pl.rx_hint
        qp, stag, op = hint  # type: ignore[misc]
        if qp.state not in RECEIVING or qp.link is not pl or self.qps.get(qp.qpn) is not qp:
            return _no_run(pl, drop)
        if op == OP_WRITE:
            found = self._set_write(qp, stag, hint)
        elif op in SEND_CTRL:
            found = self._set_send(qp, stag, op, hint)
        else:
            self.run_key = None
            request = REQUEST_LANE.get(op)
            found = self._set_whole(qp, op, stag, request) if request is not None else self._set_read_responses(qp)
        if found is None:
            return _no_run(pl, drop)
        expect = pl.link.run_receivable()
        if expect is None:
            return None
        r = self.run
        r.conn_tag, r.seq, r.max_count = expect
        if found.request is not None:
            room = limit if limit < WHOLE_MAX else WHOLE_MAX
            if r.max_count > room:
                r.max_count = room
        return found

    def _set_write(self, qp: Any, stag: int, hint: Any) -> RunSetup | None:
        mr = qp.write_target(stag)
        if mr is None:
            return None
        key = (hint, mr, qp.dest_qpn)
        if self.run_key != key:
            # What the lane reads of a Write's run, the same for every run
            # into this region from this QP: set once, not per datagram
            # (the lane changes none of it).
            r = self.run
            r.untagged = r.qn = r.whole = r.last_fills = r.many = r.last_ends = 0
            r.base, r.length, r.sequential = 0 if mr.zero_based else mr.addr, mr.length, 0
            r.ctrl_more, r.rctl, r.ctrl_last = WRITE_CTRL
            r.w0, r.w1, r.stag = segment.DDP_WORD | qp.qpn, qp.dest_qpn, stag
            self.run_key = key
        return _TN(RunSetup, (qp, OP_WRITE, mr.view, 0, None, None, None, None))

    def _set_send(self, qp: Any, stag: int, op: int, hint: Any) -> RunSetup | None:
        # A receive under way, or the next posted one for a Send that
        # starts here (taken from the ring only if the lane fills it).
        target = qp.send_target()
        if target is None:
            return None
        recv, (view, start, length), next_to = target
        r = self.run
        key = (hint, qp.dest_qpn)
        if self.run_key != key:
            # all of a Send's run settings but the receive's, as for a Write
            r.qn = r.whole = r.last_fills = r.many = r.base = 0
            r.untagged = r.last_ends = r.sequential = 1
            r.ctrl_more, r.rctl, r.ctrl_last = SEND_CTRL[op]
            r.w0, r.w1, r.stag = segment.DDP_WORD | qp.qpn, qp.dest_qpn, stag
            self.run_key = key
        r.length, r.next_to, r.msn = length, next_to, qp.rx_msn
        return _TN(RunSetup, (qp, op, view, start, recv, None, None, None))

    def _set_whole(self, qp: Any, op: int, stag: int, request: tuple[int, ...]) -> RunSetup:
        # A Read or atomic request, or an Atomic Response: the lane checks
        # its packet and its header (queue, MSN, one whole segment of its
        # size) and copies nothing; the QP takes it (take_whole), from the
        # datagram, as the Python path does.
        r = self.run
        r.last_ends = 1
        r.ctrl_more, r.rctl, r.ctrl_last, r.qn, r.length = request
        r.base, r.sequential, r.next_to = 0, 1, 0
        r.untagged = r.whole = r.last_fills = r.many = 1
        r.msn = msn = qp.request_msn(op)
        r.w0, r.w1, r.stag = segment.DDP_WORD | qp.qpn, qp.dest_qpn, stag
        return _TN(RunSetup, (qp, op, None, 0, None, None, request, msn))

    def _set_read_responses(self, qp: Any) -> RunSetup | None:
        # Read Responses into the ORRQ head's sink, in order; the last one
        # (which must fill the sink) ends the run.  Each Read has a sink
        # STag of its own: the lane expects the head's, not the hint's (the
        # Read before it).
        rd = qp.read_sink()
        if rd is None:
            return None
        r = self.run
        r.untagged = r.qn = r.whole = r.many = 0
        r.last_ends = 1
        view, start, _ = rd.gather.pieces[0]
        r.base, r.length, r.sequential, r.next_to = 0, rd.size, 1, rd.placed
        r.last_fills = 1
        r.ctrl_more, r.rctl, r.ctrl_last = READ_RESPONSE_CTRL
        r.w0, r.w1, r.stag = segment.DDP_WORD | qp.qpn, qp.dest_qpn, rd.wr.sink_stag
        return _TN(RunSetup, (qp, OP_READ_RESPONSE, view, start, None, rd, None, None))

    # -- arming ---------------------------------------------------------------------
    def arm(self, pl: PeerLink, links: dict[Any, PeerLink], limit: int) -> None:
        """Set the lane up for the run ``pl``'s hint expects next, before it
        comes (``limit``: the most whole requests it may take): the next
        pass reads the socket and places it in one compiled call
        (``Receiver.read_armed``).

        Done at the end of a pass, the set-up costs the same as when the
        datagram is there, but while the peer is still working on its
        answer.  What the set-up read may change before that pass,
        ``read_armed`` checks (the QP's state, the link's state and next
        sequence, the STag table's version, which moves on every
        registration and invalidation, and so covers the regions the lane
        would write); everything else it read changes only when this
        daemon takes a datagram, which disarms, or when the QP table
        changes.  The memory's address is kept without a buffer export,
        which would keep deregistration from unmapping it: no region the
        arming saw can go without the STag table's version moving.
        """
        self.cqe_armed = False
        if pl.rx_hint is None or not self.may_arm or links.get(pl.addr) is not pl:
            return
        setup = self.setup(pl, limit if pl.rx_hint[2] in ANSWERED_BY_DAEMON else WHOLE_MAX, drop=False)
        if setup is None:
            return
        ffi = self.ffi
        if setup.view is None:
            mem = self.no_mem
        else:
            try:
                held = ffi.from_buffer("uint8_t[]", setup.view, require_writable=True)
            except ValueError:
                return
            mem = ffi.cast("uint8_t *", int(ffi.cast("uintptr_t", held)) + setup.start)
            ffi.release(held)
        rx = self.recv
        rx.peer_addr, rx.peer_port = pl.rx_addr, pl.rx_port
        if setup.recv is not None and self.cqe_in_read and setup.op in SEND_ENDS_IN_LANE:
            self._arm_cqe(setup)
        self.armed = (pl, setup, mem, pl.link.receiver.rcv_nxt, self.stags.version)

    def _arm_cqe(self, setup: RunSetup) -> None:
        """Set ``send_cqe`` up for the receive ``setup`` names: the read
        that ends its Send writes its CQE (``read_send``)."""
        qp = setup.qp
        ring = qp.recv_cq.ring
        c = self.send_cqe
        if self.cqe_ring is not ring:
            ffi = self.ffi
            c.cq = ffi.cast("uint8_t *", ring.slots_addr)
            c.cq_producer = ffi.cast("uint32_t *", ring.hdr_addr)
            c.cq_consumer = ffi.cast("uint32_t *", ring.hdr_addr + _CONSUMER_AT)
            c.cq_mask, c.cq_entry_size, c.cq_entries = ring.mask, ring.entry_size, ring.entries
            self.cqe_ring = ring
        c.wr_id = setup.recv[0]
        c.placed = self.run.next_to
        rq = qp.recv_ring
        c.rq_take = setup.recv is not qp.rx_recv  # (else taken when its first segment came)
        c.rq_consumer = self.ffi.cast("uint32_t *", rq.hdr_addr + _CONSUMER_AT)
        c.rq_next = (rq.cons + 1) & U32
        c.qp_num, c.src_qp = qp.qpn, qp.dest_qpn
        self.cqe_armed = True

    def read_send(self, cq: Any, mem: Any) -> int:
        """The armed read of a Send (``udpv_rx_recv_send``): as
        ``udpv_rx_recv_run``, and the receive's CQE written if the run ends
        the Send (``cqe_written``; ``run_taken`` accounts for it).  The CQ's
        producer index is read now: the pass completes other WRs into it."""
        c = self.send_cqe
        c.cq_prod = cq.ring.prod
        c.on = not cq.overrun
        k = self.lib.udpv_rx_recv_send(self.recv, self.run, c, self.buf, RX_BUF, mem)
        self.cqe_written = c.written
        return k

    # -- placing ----------------------------------------------------------------------
    def place_run(self, pl: PeerLink, data: bytes, off: int, seg: int, now: float, arrived: float,
                  limit: int = WHOLE_MAX, path: int = 0) -> int:
        """Place the run of RDMA Write (or Read Response, or Send) segments
        at ``data[off:]`` that the compiled lane accepts, or take the Read
        or atomic requests, or Atomic Responses, there (at most ``limit``);
        return the bytes it consumed (0: none).  ``path``: the link's path
        the datagrams came on."""
        setup = self.setup(pl, limit)
        if setup is None:
            return 0
        qp, op, view, start = setup[:4]
        r = self.run
        ffi = self.ffi
        if view is None:
            mem = self.no_mem
        else:
            try:
                mem = ffi.from_buffer("uint8_t[]", view, require_writable=True)
            except ValueError:  # a Read's sink deregistered under it: the Python path counts the segment
                pl.rx_hint = None
                return 0
        buf = ffi.from_buffer("uint8_t[]", data)
        more = None
        try:
            k = self.lib.udpv_rx_write_run(r, buf + off, len(data) - off, seg, mem + start)
            if k and r.ended and op == OP_READ_RESPONSE and len(qp.orrq) > 1 and len(data) - off > k * seg:
                more = self.next_reads_responses(qp, view, buf, mem, data, off + k * seg, seg, k)
        finally:
            # no export may outlive the call: deregistration releases the view
            if view is not None:
                ffi.release(mem)
            ffi.release(buf)
        if more is not None:
            return self.reads_responded(pl, qp, more, now, arrived, path, off) - off
        return self.run_taken(pl, setup, k, data, off, len(data), seg, now, arrived, path)

    def run_taken(self, pl: PeerLink, setup: RunSetup, k: int, data: bytes | None, off: int, end: int,
                  seg: int, now: float, arrived: float, path: int = 0) -> int:
        """The lane took ``k`` datagrams at ``data[off:end]`` in the run
        ``setup`` set (arrived on ``path``): complete, answer and account
        for them; return the bytes consumed (``data`` is read only for
        requests, Atomic Responses and what follows the run: None when
        there is none)."""
        if k:
            qp, op, _, _, recv, rd, request, msn = setup
            r = self.run
            sched = self.sched
            # What an application waits on first, the link's accounting of
            # the run (and of the ACK it carries) after: a Send's receive and
            # its CQE, a Read's or an atomic's CQE (a Write's data is in
            # place already).  ``Link.data_run_received`` reads nothing these
            # change.
            sends = op not in TAGGED_LANE and request is None
            if sends:
                written = self.cqe_written
                if written:
                    self.cqe_written = 0
                    self.stats["rx_armed_send_cqes"] += 1
                qp.sends_placed(op, recv, r.bytes, r.ended, written)
                if r.ended:
                    self.stats["rx_native_sends"] += 1
                    sched.qp_changed(qp)  # a Modified ACK is owed
            elif op == OP_READ_RESPONSE:
                qp.read_response_placed(rd, r.bytes, r.ended)
                if r.ended:
                    self.stats["rx_native_reads"] += 1
                    sched.qp_changed(qp)  # the Read completes
                    sched.complete_done(qp)
            elif op == OP_ATOMIC_RESPONSE:
                j = atomics_answered(qp, data, off, seg, k, msn)  # type: ignore[arg-type]
                if j < k:
                    self.take_whole(qp, op, (msn + j) & U32, data, off + j * seg, seg, k - j)  # type: ignore[arg-type]
                sched.complete_done(qp)
            pl.link.data_run_received(k, r.first_ack, r.first_ts, r.first_echo, r.first_rwnd, r.first_flags,
                                      r.last_ts, r.last_rwnd, r.flags_or, now, arrived, path,
                                      min(k * seg, end - off))
            if sends:
                if r.flow_ack:
                    qp.on_flow_ack(r.flow_ack_msn)
            elif op == OP_WRITE:
                qp.writes_placed(r.bytes)
            elif request is not None:
                return self._whole_taken(qp, op, msn, data, off, end, seg, k)  # type: ignore[arg-type]
            sched.delivered = True
            sched.delivered_to = qp
            self.stats["rx_native_datagrams"] += k
        used = k * seg
        if used >= end - off:
            return end - off
        if k and data is not None and setup.op == OP_SEND and self.run.ended:
            # the Sends after it, if they are alike: in one call
            used += more_sends(self.sends, pl, setup.qp, self.stats, data, off + used, end, seg, now, arrived)
            if used >= end - off:
                return end - off
        if self.run.peeked and self._write_rehint(pl):
            # The next message is another QP's or region's Write (Writes
            # over many QPs interleave): the lane takes it too, instead of
            # the Python path taking its first segment to set the hint.
            return used + self.place_run(pl, data, off + used, seg, now, arrived,  # type: ignore[arg-type]
                                         WHOLE_MAX, path)
        return used

    def _whole_taken(self, qp: Any, op: int, msn: int, data: bytes, off: int, end: int, seg: int, k: int) -> int:
        """``run_taken`` for ``k`` whole requests or Atomic Responses; returns the bytes consumed."""
        sched = self.sched
        if op == OP_ATOMIC_RESPONSE:
            at = off + k * seg if off + k * seg < end else end
            self.stats["rx_native_atomic_responses"] += k
            sched.delivered = True  # the original values are in the application's memory
            sched.delivered_to = qp
        else:
            # (an ORD window of atomics or of Reads: applied, or answered, in one call, as far as alike)
            j = answer_atomics(qp, self.atomics, data, off, seg, k, msn, ATOMIC_REPLAY) if op == OP_ATOMIC_REQUEST \
                else answer_reads(qp, self.reads, data, off, seg, k, msn)
            at = self.take_whole(qp, op, (msn + j) & U32, data, off + j * seg, seg, k - j) if j < k \
                else off + k * seg if off + k * seg < end else end
            self.stats["rx_native_requests"] += k
            if k == 1 and at >= end and self.eager_answers:
                # A lone request, the last of what this receive brought
                # (read_lat, atomic_lat): the requester waits on nothing
                # else, so it is answered now, not after the rest of the
                # pass.  A batch's answers leave together when the pass pumps.
                sched.pump(qp, start=False)
        sched.qp_changed(qp)  # the answers go, or the WRs complete, this pass
        self.stats["rx_native_datagrams"] += k
        return at - off

    def take_whole(self, qp: Any, op: int, msn: int, data: bytes, off: int, seg: int, k: int) -> int:
        """Take the ``k`` whole requests or Atomic Responses the lane took
        at ``data[off:]``, MSN by MSN from ``msn``, each as the Python path
        takes it, in order; return the offset after the last."""
        view = memoryview(data)
        at, end = off, len(data)
        response = op == OP_ATOMIC_RESPONSE
        for i in range(k):
            n = seg if end - at > seg else end - at
            raw = view[at + _SEGMENT_AT:at + n - _CRC_LEN]
            at += n
            if i and qp.state not in RECEIVING:
                continue  # the one before failed the QP: as on_segment, drop the rest
            if response:
                qp.on_atomic_response((msn + i) & U32, raw[ddp.UNTAGGED_HEADER_LEN:], raw)
            else:
                qp.on_request(op, (msn + i) & U32, raw[ddp.UNTAGGED_HEADER_LEN:], raw)
        return at

    # -- several Reads' responses in one buffer -----------------------------------------
    def next_reads_responses(self, qp: Any, view: Any, buf: Any, mem: Any, data: bytes, at: int, seg: int,
                             k: int) -> list[LaneCall]:
        """The lane placed the whole response of the Read at the ORRQ head,
        ``k`` datagrams, and more of ``data`` follows at ``at``: place the
        responses of the next Reads there too, while each is one SGE in the
        same region (``view``, exported as ``mem``), one lane call each
        with no new set-up.  Return each call's account, the first call's
        first; the caller accounts for them on the link and completes the
        Reads (``reads_responded``)."""
        r = self.run
        run = self.lib.udpv_rx_write_run
        end = len(data)
        seq, room = r.seq, r.max_count
        calls = [_call_of(r, k, at)]
        orrq = qp.orrq
        i = 1
        while at < end and i < len(orrq):
            seq = (seq + k) & U32
            room -= k
            if room <= 0:
                break
            n = whole_reads(self.sinks, orrq, i, view, room)
            if n >= 2:
                # one-segment responses, one to each of the next Reads: all in one call (readbatch.py)
                r.seq, r.max_count = seq, room
                s = self.sinks.s
                k = self.lib.udpv_read_responses(s, r, buf + at, end - at, seg, mem, n)
                if k:
                    at = min(at + k * seg, end)
                    calls.append(_TN(LaneCall, (k, -1, k, s.ack, s.ts, s.echo, s.rwnd, s.flags, s.last_ts,
                                                s.last_rwnd, s.flags_or, at)))
                    i += k
                    continue
            rd = orrq[i]
            if type(rd) is not PendingRead or len(rd.gather.pieces) != 1:
                break
            piece, start, _ = rd.gather.pieces[0]
            if piece is not view:
                break
            r.seq, r.max_count = seq, room
            r.stag, r.length, r.next_to = rd.wr.sink_stag, rd.size, rd.placed
            k = run(r, buf + at, end - at, seg, mem + start)
            if not k:
                break
            at = min(at + k * seg, end)
            calls.append(_call_of(r, k, at))
            if not r.ended:
                break  # a Read's responses cut short: the rest as without this
            i += 1
        return calls

    def reads_responded(self, pl: PeerLink, qp: Any, calls: list[LaneCall], now: float, arrived: float,
                        path: int = 0, start: int = 0) -> int:
        """Complete the Reads the lane calls of ``next_reads_responses``
        ended (their CQEs first: the application waits on them), then
        account for the calls on ``pl``'s link (their datagrams from offset
        ``start`` of the buffer, arrived on ``path``), as one run per ACK
        field; return the offset in the buffer after the last."""
        link = pl.link
        total = reads = 0
        for call in calls:  # first what the application waits on
            if call.nbytes < 0:
                reads_whole_placed(qp, call.ended)
            else:
                qp.read_response_placed(qp.orrq[0], call.nbytes, call.ended)
            reads += call.ended
        self.sched.complete_done(qp)
        n = len(calls)
        j = 0
        while j < n:
            first = calls[j]
            count, last_ts, last_rwnd, flags_or = first.count, first.last_ts, first.last_rwnd, first.flags_or
            j += 1
            while j < n and calls[j].ack == first.ack:  # the same ACK field: one run for the link
                c = calls[j]
                count += c.count
                last_ts, last_rwnd, flags_or = c.last_ts, c.last_rwnd, flags_or | c.flags_or
                j += 1
            end = calls[j - 1].end
            link.data_run_received(count, first.ack, first.ts, first.echo, first.rwnd, first.flags, last_ts,
                                   last_rwnd, flags_or, now, arrived, path, end - start)
            start = end
            total += count
        self.stats["rx_native_reads"] += reads
        self.stats["rx_native_datagrams"] += total
        self.run.ended = 1 if calls[-1].ended else 0
        sched = self.sched
        sched.qp_changed(qp)  # the Reads complete
        sched.delivered = True
        sched.delivered_to = qp
        return calls[-1].end

    def _write_rehint(self, pl: PeerLink) -> bool:
        """Point ``pl``'s hint at the Write segment where the lane stopped
        (``udpv_rx_run.next_*``), if it is an RDMA Write to a QP of this link
        from that QP's peer, the lane's next call then taking it; False
        (hint unchanged) for anything else."""
        r = self.run
        # A DDP envelope's first word is its kind over the destination QPN:
        # any other kind XORs to a number above every QPN.
        qp = self.qps.get(r.next_w0 ^ segment.DDP_WORD)
        ctrl_more, rctl, ctrl_last = WRITE_CTRL
        if (qp is None or qp.link is not pl or r.next_w1 != qp.dest_qpn or r.next_rctl != rctl
                or (r.next_ctrl != ctrl_more and r.next_ctrl != ctrl_last)):
            return False
        hint = (qp, r.next_stag, OP_WRITE)
        if hint == pl.rx_hint:
            # Not expected (the lane stopped because these words differ from
            # the hint's), but a call on the same hint must not recurse.
            return False
        pl.rx_hint = hint
        return True


def _no_run(pl: PeerLink, drop: bool) -> None:
    """``ReceiveLane.setup``'s answer when the hint no longer holds: it is
    dropped (unless ``drop`` is False: an arming leaves it for the pass
    that reads), and there is no run."""
    if drop:
        pl.rx_hint = None
