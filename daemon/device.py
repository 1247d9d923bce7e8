"""The emulated RNIC: tables, links to peer daemons, and the data-path loop.

Theory of operation
-------------------
trio owns the daemon's tasks (control server, sessions, the connection
manager), but the data path is **one tight loop** (``run_data_path``), because
waking a trio task per event costs hundreds of microseconds (measured in
``docs``/shared DESIGN).  Each pass of ``poll_once`` does, without awaiting:

1. read the datagrams waiting on the UDP socket (at most ``_RX_BUDGET``; an
   epoll of the socket alone says before each read whether one waits) and feed them
   to the peer's ``transport.Link`` (a new INIT from an unknown address opens
   a passive link);
   with UDP_GRO one receive may hold many datagrams of one size, split here.
   At most ``rx_dispatch_budget`` of one such batch take the Python path in
   a pass; a pass that left part of a batch starts the next one there,
   before it reads the socket, so the answers to the first part leave
   while the peer still has work (``Device._receive``);
2. dispatch every in-order message the links deliver: DDP segments to their
   QP (``qp.py``), CM messages to the connection manager;
3. fire link timers that are due, react to link events (a failed link fails
   its QPs with IBV_WC_RETRY_EXC_ERR);
4. retire WRs the link acknowledged (CQEs), visiting only QPs that an ACK
   or a message of this pass concerns;
5. if anything reached an application (placed data, a CQE), ``sched_yield``:
   on a shared vCPU the application waiting for it may be next in line, and
   measured on ``write_lat`` it saw its data about 40 µs sooner than when it
   waited for the rest of the pass; it often posts its answer at once, which
   step 6 finds in the same pass, and whose datagram then carries our ACK;
6. let QPs queue segments (bounded by ``link.send_space()``) and flush
   queues of QPs in ERR.  Not every QP: QPs with nothing to send are only
   looked at for a moved SQ producer index; QPs with data wait on their
   link's ready line and take turns while it has room, one RDMA Write per
   turn; QPs something happened to (a message, a state change) are visited
   first (``Device._sq_watch``).  A message that would leave alone at the
   end of the pass (a ping-pong's) is sent at once, and the daemon then
   arms for its answer and hands its vCPU over for a moment before it
   records the message (``Device._hand_over``);
7. send what the links release (paced) on the socket: runs of equal-size
   datagrams go out in one UDP_SEGMENT ``sendmsg`` (GSO), up to 64 at a time.

When a pass finds nothing to do the loop spins for at most ``spin_s`` (with
``os.sched_yield``), then sets ``need_wakeup`` in every client's context page,
looks once more, and sleeps in ``trio.lowlevel.wait_readable`` on one epoll
fd that holds the UDP socket, every client's doorbell eventfd and an internal
wake eventfd (for control-path changes), until the next link deadline.
Applications write their doorbell only when they see ``need_wakeup``, so a
busy daemon costs them no syscall (io_uring's SQ_NEED_WAKEUP).  A periodic
rescan (``max_sleep_s``, 0.25 s) is only a backstop now that both sides
fence between their store and their load of the other's flag; each rescan
costs a wake-up, and at 0.05 s they alone kept an idle daemon at ~1.1% CPU
(0.2-0.25% at 0.25 s, idle link or none).  The loop adds up the wall time of the
passes that found work (``data_busy_us`` among the counters): next to the
process's CPU time, which the spin inflates, it tells a daemon that is
working from one that is waiting (``udpverbs perf --cpu_util``).

Time comes only from ``trio.current_time()``; randomness from one seeded
``random.Random``.
"""

from __future__ import annotations

import collections
import errno
import logging
import operator
import os
import random
import select
import socket
import struct
import sys
import time
from typing import Any, Iterable

import trio
import trio.testing

from ..transport.congestion.base import create as create_cc
from ..transport.link import Burst, Link, LinkConfig, LinkFailed, LinkState, LinkUp, one_per_datagram, run_slots
from ..transport.sockbuf import datagrams_that_fit
from ..wire import ctl, ddp, envelope, rdmap, segment, shm
from ..wire import link as wire_link
from ..wire import native as wire_native
from ..wire.envelope import Kind
from ..wire.errors import WireError
from ..wire.rdmap import Opcode
from ..wire.shm import EventType, QPState as S, WcStatus as W
from . import tables
from .config import check_mtu
from .qp import _OP_READ_RESPONSE, _OP_WRITE, _RECEIVING, _REMOTE_WRITE, _SEND_OPCODE, _U32, QueuePair, _PendingRead

log = logging.getLogger("udpverbs.daemon")

MAX_LINKS = 1024
#: datagrams one pass reads before it dispatches, ACKs and sends: well under
#: a link's receive window (256 packets; more would be dropped as out of
#: window before the drain) and small enough that ACKs keep flowing while a
#: backlog is worked off (a 4 MB socket buffer read in one pass held every
#: ACK for tens of milliseconds, past the sender's RTO)
_RX_BUDGET = 128
#: ... and at most this many bytes: 128 datagrams of 64 KB are 8 MB, several
#: milliseconds of copying, CRC and placement in one pass, and the ACK that
#: waits for the pass's end came after the sender's minimum RTO (4 ms then;
#: DAEMON_MIN_RTO_S now)
_RX_BYTE_BUDGET = 1 << 20
#: messages one QP's turn may queue in a pass.  The link's send space bounds
#: a pass's total and the ready line's rotation shares it between QPs; this
#: bounds one turn's Python (a QP of 2-byte Writes takes a WQE per message).
#: 64 kept a single QP's 1472-byte stream to about 47 datagrams per pass
#: (a 64 KiB Write is 45), whose fixed costs then weighed on each.
_TURN_BUDGET = 256
# The receive lane's control bytes: (DDP control of a segment that is not
# the last, RDMAP control[, DDP control of the last])
_WRITE_CTRL = (*rdmap.tagged_control(Opcode.RDMA_WRITE, False), rdmap.tagged_control(Opcode.RDMA_WRITE, True)[0])
# The lane never takes a Send with Invalidate's last segment (the STag is
# invalidated in Python before the receive completes), so the control byte
# of the others stands for both.  (A "matches nothing" value would need
# care: 0, once used here, is a control byte the decoder refuses and the
# lane then accepted.)  A plain Send's or a Read Response's last segment
# ends the lane's run, and ``_place_run`` completes the receive or the Read.
_READ_RESPONSE_CTRL = (*rdmap.tagged_control(Opcode.RDMA_READ_RESPONSE, False),
                       rdmap.tagged_control(Opcode.RDMA_READ_RESPONSE, True)[0])
_SEND_ENDS_IN_LANE = frozenset({int(Opcode.SEND), int(Opcode.SEND_SE)})
_SEND_CTRL = {int(op): (ctrl, rctl, rdmap.UNTAGGED_CONTROL[op, True][0] if op in _SEND_ENDS_IN_LANE else ctrl)
              for (op, last), (ctrl, rctl, _) in rdmap.UNTAGGED_CONTROL.items()
              if not last and op in _SEND_OPCODE.values()}
#: requests the daemon answers by itself: no application waits on them, so
#: their arrival is no reason to yield the vCPU (measured on read_lat: the
#: responder lost ~25 µs per Read to the yield)
_ANSWERED_BY_DAEMON = frozenset({int(Opcode.RDMA_READ_REQUEST), int(Opcode.ATOMIC_REQUEST)})
_OP_ATOMIC_RESPONSE = int(Opcode.ATOMIC_RESPONSE)
#: what the lane places by STag (the rest of its runs are Sends or whole requests and responses)
_TAGGED_LANE = frozenset({_OP_WRITE, _OP_READ_RESPONSE})
# ... and the lane takes them whole, one per run, each of its fixed size
# (RFC 5040 §4.4, RFC 7306 §5.2) on its own queue, and so the Atomic
# Responses that answer ours (RFC 7306 §5.3): (DDP control of a segment
# that is not the last, RDMAP control, DDP control of the last, QN, body
# length)
_REQUEST_LANE = {int(op): (*rdmap.UNTAGGED_CONTROL[op, False][:2], *rdmap.UNTAGGED_CONTROL[op, True][::2],
                           rdmap.SINGLE_SEGMENT[op]) for op in (*_ANSWERED_BY_DAEMON, _OP_ATOMIC_RESPONSE)}
_OP_READ_REQUEST = int(Opcode.RDMA_READ_REQUEST)
_OP_ATOMIC_REQUEST = int(Opcode.ATOMIC_REQUEST)
#: at most this many of them in one lane call (a GRO buffer holds up to 64 datagrams)
_WHOLE_MAX = 64
#: where a segment's DDP header starts in a link packet, and how much follows its payload
_SEGMENT_AT = wire_link.HEADER_LEN + envelope.ENVELOPE_LEN
_CRC_LEN = wire_link.CRC_LEN
_FLOW_ACK = int(envelope.Flags.FLOW_ACK)
# Linux UDP segmentation offload (include/uapi/linux/udp.h); the socket
# module of Python 3.11 does not name them.
SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
#: most datagrams one UDP_SEGMENT send may carry (UDP_MAX_SEGMENTS) and the
#: bytes they may add up to (one IP datagram's worth, with room for headers)
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65000
#: datagrams a stream's Write or Read Response may take beyond the fewest,
#: to make them equal (a Send's may take none: equal_segment_size)
EQUAL_EXTRA = 2
#: arrival time of a datagram at the host (asm-generic/socket.h,
#: SO_TIMESTAMPNS_OLD: a native struct timespec, CLOCK_REALTIME)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@qq")
_RX_CMSG_SPACE = socket.CMSG_SPACE(4) + socket.CMSG_SPACE(_TIMESPEC.size)
# A plain int: MSG_* are IntFlag members, and IntFlag's | and & cost
# microseconds per received buffer.
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
_GSO_REFUSED = (errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP)
#: the daemon's defaults for LinkConfig.pacing_burst_packets and
#: pacing_burst_s (see link_config)
DAEMON_PACING_BURST_PACKETS = 32.0
DAEMON_PACING_BURST_S = 1e-3
#: the daemon's default for LinkConfig.min_rto_s.  The RTO estimator cannot
#: see how long the peer's daemon left our datagrams in its socket (its echo
#: leaves that out, for the delay signal), and on a loaded host a daemon
#: may not run for several milliseconds: with 4 ms, 3-second write_bw runs
#: had 4-21 RTOs at 1472 B and 1-7 at 65507 B (3 runs each, nothing lost
#: that a 20 ms timer would not have waited out); with 20 ms, none (Linux
#: TCP uses 200 ms).
DAEMON_MIN_RTO_S = 0.02
_RX_BUF = 1 << 16
#: _read_armed: the arming no longer held, and the socket has something to read
_RX_READY = 2
#: when the idle loop arms the lane (Device._arm): after a sched_yield that
#: took longer than an idle application's turn (about 1.5 µs here, switches
#: included), or after this many idle passes
_ARM_AFTER_YIELD_S = 2.5e-6
_ARM_AFTER_IDLE_PASSES = 4
#: after a datagram sent alone, how long the daemon may let other processes
#: have its vCPU before its own bookkeeping (Device._hand_over): the peer's
#: answer is a daemon pass, an application turn and a pass away
_HAND_OVER_S = 20e-6
#: a turn of another process's that did work, not just look: longer than
#: twice the shortest turn of the same hand-over by more than this
_WORK_TURN_MARGIN_S = 0.5e-6
# what a hand-over times its turns with and yields by (tests replace them)
_turn_clock = time.perf_counter
_yield_cpu = os.sched_yield
_NATIVE_U32 = struct.Struct("=I")
_LINK_ESTABLISHED = LinkState.ESTABLISHED
_ERR = S.IBV_QPS_ERR
_RTS = S.IBV_QPS_RTS
_BY_RANK = operator.attrgetter("rank")
_RNR_UNTIL = operator.attrgetter("rnr_until")
_FLOW_ACK_HOLD = operator.attrgetter("flow_hold.until")


class QPTable(dict):  # type: ignore[type-arg]
    """The device's QPN -> QueuePair table, which counts its changes.

    The data loop does not walk the table on each pass (with 64 QPs that
    walk was half of a receiving daemon's pass); it keeps its own lists and
    rebuilds them when ``version`` moves.
    """

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def __setitem__(self, key: int, value: "QueuePair") -> None:
        super().__setitem__(key, value)
        self.version += 1

    def __delitem__(self, key: int) -> None:
        super().__delitem__(key)
        self.version += 1

    def pop(self, key: int, *default: Any) -> Any:
        self.version += 1
        return super().pop(key, *default)

    def clear(self) -> None:
        self.version += 1
        super().clear()


#: word of struct uv_ring_hdr holding the consumer index (the producer's is word 0)
_CONSUMER_WORD = shm.ffi.offsetof("struct uv_ring_hdr", "consumer") // 4
#: watching this many QPs or fewer, a Python step per QP is cheaper than the
#: compiled call's setup (watching one QP in the in-process write_lat
#: ping-pong: 3.2-3.5 us per pass in Python, 4.3-4.5 through the call)
_PY_WATCH_MAX = 4


class SQWatch:
    """The idle QPs of a pass (see ``Device._sq_watch``): looked at only for
    a moved SQ producer index.

    ``qps`` is the device's QP table in order (a QP's ``rank`` is its place).
    With the compiled module one call compares the ring headers of all
    watched QPs (a mask says which); without it, or for a handful, a Python
    step per QP.
    Built anew whenever the table changes: it holds raw pointers into the
    QPs' rings, which a destroyed QP unmaps.
    """

    def __init__(self, qps: list[QueuePair], native: Any) -> None:
        self.qps = qps
        self.members: dict[QueuePair, tuple[Any, shm.Ring]] = {}  # QP: (its SQ's header, its SQ)
        self._lib = None
        if native is not None and qps:
            ffi = native.ffi
            self._hdrs = ffi.new("uint32_t *[]", [
                ffi.cast("uint32_t *", int(shm.ffi.cast("uintptr_t", qp.sq.hdr))) for qp in qps])
            self._mask = ffi.new("uint8_t[]", len(qps))
            self._found = ffi.new("uint32_t[]", len(qps))
            self._lib = native.lib

    def __contains__(self, qp: QueuePair) -> bool:
        return qp in self.members

    def add(self, qp: QueuePair) -> None:
        self.members[qp] = (qp.sq.hdr, qp.sq)
        if self._lib is not None:
            self._mask[qp.rank] = 1

    def discard(self, qp: QueuePair) -> None:
        if qp in self.members:
            del self.members[qp]
            if self._lib is not None:
                self._mask[qp.rank] = 0

    def take_posted(self) -> list[QueuePair]:
        """The watched QPs with new WQEs, in table order, no longer watched."""
        if not self.members:
            return []
        if self._lib is not None and len(self.members) > _PY_WATCH_MAX:
            k = self._lib.udpv_rings_moved(self._hdrs, self._mask, len(self.qps), _CONSUMER_WORD, self._found)
            if not k:
                return []
            found = [self.qps[i] for i in self._found[0:k]]
        else:
            found = [qp for qp, (hdr, sq) in self.members.items() if hdr.producer != sq.cons]
            if not found:
                return found
            if len(found) > 1:
                found.sort(key=_BY_RANK)
        for qp in found:
            self.discard(qp)
        return found


def _count(buffers: list[bytes | memoryview], size: int) -> int:
    """The datagrams ``buffers`` make, each cut into ``size``-byte ones."""
    return sum(-(-len(b) // size) for b in buffers)


def equal_segment_size(total: int, max_data: int, overhead: int, extra: int = EQUAL_EXTRA) -> int:
    """The payload of each segment a stream's message of ``total`` bytes is
    cut into: ``total`` split evenly over the fewest segments of at most
    ``max_data`` bytes, or over up to ``extra`` more, if two such messages
    (``overhead`` bytes more a datagram) fit one UDP_SEGMENT send; else
    ``max_data``, the last segment shorter.

    A UDP_SEGMENT send, and a GRO batch, can only end with a shorter
    datagram, so a message whose last segment is short takes a system call
    of its own at both ends.  Cut evenly, a stream's consecutive messages
    of one size are datagrams of one size, which ``Device._send_segmented``
    joins: in the thirty-third round's alternations 4 and 8 KiB Write
    streams moved 13-23% more, 2 KiB ones 0-17%, and the receiving daemon
    spent about a quarter as long on each datagram (in one process).
    Where two messages cannot share a send nothing pays for an even cut.
    A datagram more paid for Writes, not for Sends: a 4 KiB Send stream cut
    in quarters saved the sender as much system time as its fourth datagram
    cost in Python (send_bw -s 4096 unchanged; -s 2048, in halves, 45.5 ->
    51.4 MB/s over 10 rounds), so a Send is cut evenly only over the
    fewest segments.  (DDP leaves the cutting to the sender, each segment
    within the MULPDU, RFC 5041 §5.2; the receiver places each by its
    offset.)
    """
    k = -(-total // max_data)
    if 1 < k and 2 * k <= GSO_MAX_SEGMENTS:
        for n in range(k, min(k + extra, GSO_MAX_SEGMENTS // 2) + 1):
            if total % n == 0:
                # more segments only add bytes: the first that divides decides
                if 2 * (total + n * overhead) <= GSO_MAX_BYTES:
                    return total // n
                break
    return max_data


def _no_run(pl: "PeerLink", drop: bool) -> None:
    """``Device._run_setup``'s answer when the hint no longer holds: it is
    dropped (unless ``drop`` is False: an arming leaves it for the pass
    that reads), and there is no run."""
    if drop:
        pl.rx_hint = None


class PeerLink:
    """One reliable link to one peer daemon, and the QPs that use it."""

    __slots__ = ("device", "addr", "link", "qps", "up", "max_data", "failed_reason", "rx_hint", "ack_waiters",
                 "ready", "requests", "rx_addr", "rx_port")

    def __init__(self, device: "Device", addr: tuple[str, int], link: Link) -> None:
        self.device = device
        self.addr = addr
        self.link = link
        self.qps: set[QueuePair] = set()
        self.up = True  # messages may be queued before the handshake ends
        self.failed_reason = ""
        # (QP, STag, RDMAP opcode) of the last RDMA Write or Read Response
        # segment received, or of a Send's segment that was not its last
        # (the STag: its Invalidate STag): what the compiled receive lane
        # may place next (revalidated per call)
        self.rx_hint: tuple[QueuePair, int, int] | None = None
        # the peer as the compiled read compares a datagram's source (``Device._arm``)
        try:
            self.rx_addr: int = _NATIVE_U32.unpack(socket.inet_aton(addr[0]))[0]
        except OSError:
            self.rx_addr = 0
        self.rx_port: int = socket.htons(addr[1])
        # (link message number, QP): an RDMA Write's last segment, queued in
        # number order; the QP may complete once the link acknowledges it
        self.ack_waiters: collections.deque[tuple[int, QueuePair]] = collections.deque()
        # QPs with data to send on this link, served round robin while the
        # link takes more (a dict as an ordered set)
        self.ready: dict[QueuePair, None] = {}
        # Read and atomic requests queued back to back, not yet on the link
        # (``send_request``)
        self.requests: list[bytearray] = []
        # payload bytes per DDP segment: link body minus envelope + tagged header
        self.max_data = link.config.max_payload - segment.TAGGED_PREFIX_LEN

    def segment_size(self, total: int, stream: bool, untagged: bool = False) -> int:
        """The payload of each segment of a message of ``total`` bytes, tagged
        (an RDMA Write's or a Read Response's) or ``untagged`` (a Send's):
        cut evenly where that lets a stream's messages share system calls
        (``stream``: others are queued with it; :func:`equal_segment_size`),
        else as many bytes as fit, the last segment shorter, as a message
        sent alone (a ping-pong's) always is."""
        prefix = segment.UNTAGGED_PREFIX_LEN if untagged else segment.TAGGED_PREFIX_LEN
        max_data = self.max_data + segment.TAGGED_PREFIX_LEN - prefix
        if stream and self.device.gso:
            return equal_segment_size(total, max_data, wire_link.OVERHEAD + prefix, 0 if untagged else EQUAL_EXTRA)
        return max_data

    def send(self, message: bytes | bytearray, ack_now: bool = True, ack_carrier: bool = True) -> int:
        """Queue one message on the link; return its message number
        (``ack_now``, ``ack_carrier``: as for ``Link.send``)."""
        if self.requests:
            self.flush_requests()
        return self.link.send(message, self.device.now, ack_now, ack_carrier)

    def send_alone(self, message: bytes | bytearray, ack_now: bool = True, ack_carrier: bool = True) -> int | None:
        """Send ``message`` now, in a datagram of its own, if the link would
        send it alone at the end of this pass anyway; return its number, or
        None (then nothing happened: queue it with :meth:`send`)."""
        dev = self.device
        sock = dev.sock
        if self.requests or sock is None:
            return None
        now = dev._clock()
        link = self.link
        d = link.frame_alone(message, now, ack_now)
        if d is None:
            return None
        try:
            sock.sendto(d, self.addr)
        except (BlockingIOError, InterruptedError):
            dev.stats["tx_dropped"] += 1  # the link retransmits it
        except OSError:
            dev.stats["tx_oserror"] += 1
        dev.stats["tx_alone"] += 1
        dev._sent = True
        dev._hand_over(self)
        return link.sent_alone(message, len(d), now, ack_carrier)

    def send_request(self, message: bytearray) -> None:
        """Queue a Read or atomic request (as ``send(message,
        ack_carrier=False)``).  Requests queued back to back, an ORD
        window's, go on the link together as one run of equal messages
        when anything else is queued or the device sends (``flush_requests``):
        the compiled framer then frames them in one call, where each alone
        cost ``Link.bursts_to_send`` a packet encoded in Python."""
        self.requests.append(message)

    def flush_requests(self) -> None:
        """Put the requests ``send_request`` holds on the link, in order
        (dropped if the link has ended since: its QPs fail with it)."""
        requests = self.requests
        self.requests = []
        if self.link.state >= LinkState.CLOSED:
            return
        size = len(requests[0])
        if len(requests) == 1 or self.device.native is None or any(len(m) != size for m in requests):
            for m in requests:
                self.link.send(m, self.device.now, True, False)
            return
        head, slot = run_slots(size)
        buf = bytearray(len(requests) * slot)
        at = head
        for m in requests:
            buf[at:at + size] = m
            at += slot
        self.link.send_run(buf, size, len(requests), size, ack_carrier=False)

    def send_tagged_run(self, opcode: int, dst_qpn: int, src_qpn: int, stag: int, to: int, src: memoryview,
                        start: int, count: int, seg: int, last_len: int, ends: bool) -> int:
        """Queue ``count`` tagged segments of one message (RFC 5041 §4.1: an
        RDMA Write or Read Response), payload from ``src[start:]`` (``seg``
        bytes each, at most ``max_data``, the last ``last_len``), built by
        the compiled send lane; return the last one's message number.

        ``ends``: the last of them is the message's last segment.
        """
        if self.requests:
            self.flush_requests()
        dev = self.device
        segment.pack_tagged_into(dev.tx_more, 0, dst_qpn, src_qpn, opcode, False, stag, 0)
        segment.pack_tagged_into(dev.tx_last, 0, dst_qpn, src_qpn, opcode, True, stag, 0)
        t = dev.tx_segments
        t.prefix, t.off_at, t.off_len, t.off = segment.TAGGED_PREFIX_LEN, segment.TO_AT, 8, to
        t.tail_len = 0
        return self._send_segments(src, start, count, last_len, ends, segment.TAGGED_PREFIX_LEN + seg)

    def send_untagged_run(self, opcode: int, dst_qpn: int, src_qpn: int, msn: int, mo: int, inv_stag: int,
                          flags: int, src: memoryview, start: int, count: int, seg: int, last_len: int, ends: bool,
                          flow_ack: int | None = None) -> int:
        """As :meth:`send_tagged_run`, for untagged segments (RFC 5041 §4.2:
        a Send's) of message ``msn`` from offset ``mo``; ``flags``, the
        envelope flags, go on the message's last segment only, and so does
        ``flow_ack``, a Modified ACK's MSN, as the FLOW_ACK trailer after
        its payload (``flags`` then has FLOW_ACK)."""
        if self.requests:
            self.flush_requests()
        dev = self.device
        segment.pack_untagged_into(dev.tx_more, 0, dst_qpn, src_qpn, opcode, False, msn, 0, inv_stag, 0)
        segment.pack_untagged_into(dev.tx_last, 0, dst_qpn, src_qpn, opcode, True, msn, 0, inv_stag, flags)
        t = dev.tx_segments
        t.prefix, t.off_at, t.off_len, t.off = segment.UNTAGGED_PREFIX_LEN, segment.MO_AT, 4, mo
        t.tail_len = 0 if flow_ack is None else envelope.pack_flow_ack_into(dev.tx_tail, 0, flow_ack)
        return self._send_segments(src, start, count, last_len, ends, segment.UNTAGGED_PREFIX_LEN + seg)

    def _send_segments(self, src: memoryview, start: int, count: int, last_len: int, ends: bool, stride: int) -> int:
        """The bodies of the segments whose headers ``dev.tx_segments`` holds,
        ``stride`` bytes each but the last, queued on the link."""
        dev = self.device
        ffi = dev.native.ffi
        prefix = dev.tx_segments.prefix
        # the k-th body: its header, its payload and (a message's last) its tail
        last_body = prefix + last_len + (dev.tx_segments.tail_len if ends else 0)
        # each body where its link packet will be, so the framer leaves it there
        head, slot = run_slots(stride)
        dst = dev.tx_alloc("uint8_t[]", (count - 1) * slot + slot - stride + last_body)
        mem = ffi.from_buffer("uint8_t[]", src)
        try:
            dev.native.lib.udpv_tx_bodies(dev.tx_segments, dst + head, mem + start, count, stride, last_len, ends,
                                          slot)
        finally:
            ffi.release(mem)  # no export may outlive the call: deregistration releases the view
        buf = memoryview(ffi.buffer(dst))
        link = self.link
        # A whole message on a link with nothing queued or unacknowledged (a
        # ping-pong's, of several datagrams) leaves now, the vCPU is handed
        # over, and the link records it after that, as for a message of one
        # datagram (send_alone); it used to wait for the pass's flush, behind
        # its bookkeeping (2 KiB write_lat 52 µs, 44 with the flush at once,
        # 38 with the bookkeeping after).  In a stream something is always
        # in flight, and the flush sends runs together.
        if ends and dev.run_at_once and dev.sock is not None and link.quiet():
            now = dev._clock()
            view = link.frame_run_alone(buf, stride, count, last_body, prefix, now)
            if view is not None:
                burst = Burst(view, stride + wire_link.OVERHEAD)
                if dev.gso:
                    dev._send_segmented([burst], self.addr)
                else:
                    dev._send_each(burst.datagrams(), self.addr)
                dev.stats["tx_run_alone"] += 1
                dev._sent = True
                dev._hand_over(self)
                return link.sent_run_alone(buf, stride, count, last_body, now) + count - 1
        return link.send_run(buf, stride, count, last_body, built=prefix) + count - 1


class DeviceConfig:
    """What a device is: name, UDP address, limits (filled from flags/TOML)."""

    def __init__(self, *, name: str = "uv0", addr: str = "127.0.0.1", port: int = 18515,
                 mtu: int = 1472, spin_us: float = 200.0, max_sleep_s: float = 0.25,
                 max_qp: int = 4096, max_cq: int = 4096, max_mr: int = 65536, max_pd: int = 4096,
                 max_qp_wr: int = 16384, max_cqe: int = 65536, max_qp_rd_atom: int = 16,
                 seed: int | None = None, cc: str = "efe-host", link: dict[str, Any] | None = None,
                 gso: bool = True, native: bool = True, rx_dispatch_budget: int = 8) -> None:
        self.name = name
        self.addr = addr
        self.port = port
        self.mtu = check_mtu(mtu)
        self.spin_s = spin_us * 1e-6
        self.max_sleep_s = max_sleep_s
        self.max_qp = max_qp
        self.max_cq = max_cq
        self.max_mr = max_mr
        self.max_pd = max_pd
        self.max_qp_wr = max_qp_wr
        self.max_cqe = max_cqe
        self.max_qp_rd_atom = max_qp_rd_atom
        self.seed = seed
        self.cc = cc
        self.link = dict(link or {})
        self.gso = gso
        #: the compiled lanes for tagged segments, receive and send (wire/native.py)
        self.native = native
        if rx_dispatch_budget < 0:
            raise ValueError("rx_dispatch_budget must be 0 (no limit) or more")
        #: the most datagrams of one GRO buffer that go through the Python
        #: path in one pass (0: no limit); the rest wait for the next pass,
        #: so that the answers to the first leave before the rest are worked
        #: through (see Device._receive)
        self.rx_dispatch_budget = rx_dispatch_budget


def _arrival(stamp: float, now: float) -> float:
    """A kernel arrival stamp on our clock, trusted only between a second
    ago and ``now`` (a wall-clock step between the two reads, a stamp the
    kernel did not set)."""
    return stamp if now - 1.0 < stamp <= now else now


def may_share_a_cpu(pids: Iterable[int]) -> bool:
    """Whether any process in ``pids`` may run on a CPU this one may run on
    (by their affinity masks).  A mask that cannot be read (the process is
    gone, or not ours) counts as shared: that is the safe guess, since it only
    costs a ``sched_yield`` that was not needed."""
    try:
        mine = os.sched_getaffinity(0)
        for pid in pids:
            if mine & os.sched_getaffinity(pid):
                return True
    except OSError:
        return True
    return False


def link_config(config: DeviceConfig) -> LinkConfig:
    """The LinkConfig of a device: MTU and congestion control, plus ``--link`` overrides.

    Raises:
        ValueError: an unknown LinkConfig field or a value of the wrong type.
    """
    # The pacer's burst must cover the time between two passes of the data
    # loop, in which the pacer's rate would release many packets: a 2-packet
    # burst (LinkConfig's default, right for a sender that can act every
    # microsecond) capped a 1472-byte Write stream at about 3 packets per
    # pass (16 MB/s in one process; 49 MB/s with 32), and 32 packets capped
    # it at 157 MB/s with 300 µs passes.  So the burst is also a time: 1 ms
    # at the pacing rate.
    lc = LinkConfig(max_payload=config.mtu - wire_link.OVERHEAD, cc=config.cc,
                    pacing_burst_packets=DAEMON_PACING_BURST_PACKETS, pacing_burst_s=DAEMON_PACING_BURST_S,
                    min_rto_s=DAEMON_MIN_RTO_S)
    create_cc(config.cc, config.mtu)  # raises ValueError for an unknown name, now rather than per link
    for key, value in config.link.items():
        if key not in LinkConfig.__dataclass_fields__ or key in ("cc_params",):
            raise ValueError(f"unknown link setting {key!r}")
        current = getattr(lc, key)
        setattr(lc, key, type(current)(value) if not isinstance(current, bool) else str(value) == "true")
    return lc


class Device:
    """The RNIC: every table, the UDP socket, links, and the data-path loop."""

    def __init__(self, config: DeviceConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.incarnation = self.rng.getrandbits(63) | 1
        self.node_guid = self.rng.getrandbits(64)
        self.link_config = link_config(config)
        self.stags = tables.STagTable()
        self.pds = tables.Handles(config.max_pd)
        self.mrs = tables.Handles(config.max_mr)
        self.cqs = tables.Handles(config.max_cq)
        self.channels = tables.Handles(config.max_cq)
        self.srqs = tables.Handles(config.max_qp)
        self.qps = QPTable()
        self._next_qpn = 1
        # What the QP steps of a pass visit, instead of every QP.  For
        # completions: the QPs a message or an ACK concerned.  For sending,
        # each QP waits in one place: idle in ``_sq_watch`` (looked at only
        # for new WQEs), ready on its link's ``ready`` (data to send, served
        # round robin while the link has room), or in ``_to_pump``: visited
        # on every pass in table order (``rank``) until it settles, because
        # something happened to it (a message, a state change), or it is in
        # ERR (new WQEs to flush) or owes a RESUME (its RQ is watched).
        self._qps_seen = -1
        self._sq_watch = SQWatch([], None)
        self._to_complete: dict[QueuePair, None] = {}
        self._to_pump: dict[QueuePair, None] = {}
        self._prefetch: list[QueuePair] = []  # QPs whose next receive to resolve once the pass's sends left
        # Answer a lone request the compiled lane takes at once (``_place_run``).
        # The Python path answers when the pass pumps, so tests that compare
        # the two datagram for datagram turn this off.
        self.answer_at_once = True
        # Send a run of segments the compiled lane built on a quiet link (a
        # ping-pong's) when it is queued (``PeerLink._send_segments``).  The
        # Python path queues segments one by one and sends them at the pass's
        # flush; the same tests turn this off.
        self.run_at_once = True
        # UDPVERBS_CHECK_PASSES=1 (the test suite sets it): check after every
        # pass that no QP it left out had work (``check_pass``)
        self.check_passes = os.environ.get("UDPVERBS_CHECK_PASSES", "") not in ("", "0")
        self.links: dict[tuple[str, int], PeerLink] = {}
        self.sessions: set[Any] = set()
        self.stats: collections.Counter[str] = collections.Counter()
        #: wall time of the data loop's passes that found work (the rest of
        #: its time it spins or sleeps): what a run keeps the daemon busy
        self.busy_s = 0.0
        #: the part of a GRO buffer a pass left for the next (Device._receive):
        #: (link, buffer, offset, segment size, arrival time)
        self._rx_rest: tuple[PeerLink, bytes, int, int, float] | None = None
        self.now = 0.0
        self.sock: socket.socket | None = None
        self._rx_epoll: select.epoll | None = None  # the socket alone (bind); None: just try to read
        self.gso = False  # UDP_SEGMENT sends (set by bind; dropped if the kernel refuses one)
        self.gro = False  # UDP_GRO receives (set by bind)
        self.rx_stamps = False  # SO_TIMESTAMPNS arrival times (set by bind)
        self.native = wire_native.load() if config.native else None
        self._rx_run: Any = None
        #: what _rx_run's constant settings are for: (rx_hint, region, dest QPN) of
        #: a Write, (rx_hint, dest QPN) of a Send; None: set them
        self._rx_run_key: Any = None
        #: the lane set up ahead for the next datagram (``_arm``): (link,
        #: ``_run_setup``'s answer, memory, the link's next sequence, the
        #: STag table's version); the link that last received, to arm for
        #: it; the links an armed read fed, for the pass's dispatch
        self._armed: tuple[Any, ...] | None = None
        self._arm_link: PeerLink | None = None
        self._touched: set[PeerLink] = set()
        self._sent = False  # this pass sent a datagram
        if self.native is not None:
            self._rx_run = self.native.ffi.new("udpv_rx_run *")
            self._rx_recv = self.native.ffi.new("udpv_rx_recv *")
            self._rx_buf = self.native.ffi.new("uint8_t[]", _RX_BUF)
            # the lane's buffer for whole requests and Atomic Responses: none
            # (the QP reads them in the datagram)
            self._no_mem = self.native.ffi.cast("uint8_t *", 0)
            # the send lane's segment headers, packed in place by wire/segment.py
            self.tx_segments = self.native.ffi.new("udpv_tx_segments *")
            self.tx_more = self.native.ffi.buffer(self.tx_segments.more)
            self.tx_last = self.native.ffi.buffer(self.tx_segments.last)
            self.tx_tail = self.native.ffi.buffer(self.tx_segments.tail)
            # A run's buffer is not zeroed: every byte a packet takes is
            # written before it leaves (the bodies by udpv_tx_bodies, the
            # headers and CRCs by the framer), and zeroing 64 KiB cost about
            # 1 µs a message.
            self.tx_alloc = self.native.ffi.new_allocator(should_clear_after_alloc=False)
        self.gid = ctl.gid_from_ip(config.addr)
        self.epoll = select.epoll()
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.epoll.register(self.wake_fd, select.EPOLLIN)
        self._doorbells: set[int] = set()
        self._watched: set[int] = set()
        self.cm: Any = None  # set by the connection manager
        self._sleeping = False
        self._delivered = False  # a message reached a QP since the last yield to applications
        #: the QP this pass last delivered to, whose application may answer
        #: before the pass reaches the SQ watch (``_answer_early``)
        self._delivered_to: QueuePair | None = None
        # Yield after a delivery only if an application may be waiting on one
        # of our CPUs (sessions_changed).
        self.yield_on_delivery = True
        self.rnr_waiting: set[QueuePair] = set()  # QPs backing off after an RNR NACK
        self.flow_ack_holding: set[QueuePair] = set()  # QPs holding a Modified ACK for their answer
        self.inflight_spin_s = max(config.spin_s, 0.002) if config.spin_s > 0 else 0.0
        #: the longest ``_hand_over`` (none where the daemon is not to spin)
        self.hand_over_s = min(_HAND_OVER_S, config.spin_s)
        # trio's clock, read without trio.current_time()'s run-context lookup
        # (0.1 vs 0.4 µs; it is read on every pass); bound in run_data_path.
        self._clock = trio.current_time

    # -- setup ----------------------------------------------------------------
    def bind(self) -> tuple[str, int]:
        """Bind the UDP socket.  Raises OSError (EADDRINUSE: another daemon has it)."""
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((self.config.addr, self.config.port))
            s.setblocking(False)
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                try:
                    s.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
                except OSError:
                    pass
        except BaseException:
            s.close()
            raise
        self.sock = s
        self.config.port = s.getsockname()[1]
        # Flow control must keep what a peer may have in flight inside our
        # socket buffer, or a blasting sender loses datagrams to overflow.
        rcvbuf = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.link_config.rwnd_packets = datagrams_that_fit(rcvbuf, self.config.mtu,
                                                           high=self.link_config.rwnd_packets)
        # Kernel arrival stamps: a link's RTT samples then measure the path
        # between the two kernels, not how long a datagram waited in a socket
        # for a daemon that was not running (see _arrival).
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            self.rx_stamps = True
        except OSError:
            log.warning("no SO_TIMESTAMPNS here: RTT samples include this daemon's scheduling delay")
        # Batching: a run of equal-size datagrams leaves in one sendmsg
        # (UDP_SEGMENT) and arrives coalesced in one recvmsg (UDP_GRO), one
        # system call for up to 64 segments instead of one each.  Both are
        # optional: without them every datagram is its own system call.
        if self.config.gso:
            # Probe both: a kernel without UDP_SEGMENT (before 4.18) ignores
            # the control message and sends a run as one big datagram.
            try:
                s.setsockopt(SOL_UDP, UDP_SEGMENT, 0)
                self.gso = True
            except OSError:
                log.warning("no UDP_SEGMENT here: one system call per datagram sent")
            try:
                s.setsockopt(SOL_UDP, UDP_GRO, 1)
                self.gro = True
            except OSError:
                pass
        self.epoll.register(s.fileno(), select.EPOLLIN)
        # "Anything to read?" for every pass: epoll_wait(0) on the socket
        # alone costs 0.35 µs, a recvmsg that fails with EAGAIN 2.2 µs (a
        # third of an idle pass).
        self._rx_epoll = select.epoll()
        self._rx_epoll.register(s.fileno(), select.EPOLLIN)
        if self.native is not None:
            self._rx_recv.fd = s.fileno()
        return s.getsockname()

    def sessions_changed(self) -> None:
        """Recheck, as a session opens or closes, whether the yield after a
        delivery can help: only if some client application may run on a CPU
        of ours.  Pinned apart (``taskset``, or ``udpverbs perf --local``,
        which puts each daemon on a CPU where only the other side's
        application runs) the yield only hands the CPU to a process that is
        not waiting for this delivery: on 2 vCPUs pinned, write_bw moved 411
        against 357 MB/s without it (medians of 7 alternating runs), while
        unpinned it helps (write_lat 194 against 222 µs, 3 runs).  An
        application that moves to other CPUs later is seen at the next
        session change."""
        self.yield_on_delivery = may_share_a_cpu(s.pid for s in self.sessions)

    def close(self) -> None:
        """Tear everything down (links ABORT, sessions closed)."""
        now = self.now
        log.info("stats: %s", self.dump_stats())
        for pl in list(self.links.values()):
            log.info("link %s:%d cwnd %.0f srtt %s", pl.addr[0], pl.addr[1], pl.link.cwnd_bytes, pl.link.srtt_s)
            try:
                pl.link.close(now)
                self.flush_link(pl)
            except Exception:  # closing must not fail on a broken link
                pass
        self.announce_fatal()
        for sess in list(self.sessions):
            sess.teardown()
        if self._rx_epoll is not None:
            self._rx_epoll.close()
            self._rx_epoll = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.epoll.close()
        os.close(self.wake_fd)

    def announce_fatal(self) -> None:
        """Tell every application the device is going away (IBV_EVENT_DEVICE_FATAL)."""
        for sess in list(self.sessions):
            if not sess.closed and not sess.fatal_sent:
                sess.fatal_sent = True
                sess.device_fatal()
                sess.async_event(EventType.IBV_EVENT_DEVICE_FATAL, 0)

    def wake(self) -> None:
        """Make the data loop look again (after a control-path change)."""
        if self._sleeping:
            try:
                os.eventfd_write(self.wake_fd, 1)
            except OSError:
                pass

    def add_doorbell(self, fd: int) -> None:
        self.epoll.register(fd, select.EPOLLIN)
        self._doorbells.add(fd)

    def remove_doorbell(self, fd: int) -> None:
        if fd in self._doorbells:
            self._doorbells.discard(fd)
            try:
                self.epoll.unregister(fd)
            except OSError:
                pass

    # -- QPs and links ----------------------------------------------------------
    def alloc_qpn(self) -> int:
        """A free QPN (1 .. 2**24-1; 0 is the connection manager)."""
        if len(self.qps) >= self.config.max_qp:
            raise tables.TableError(errno.ENOMEM, "QP table full")
        while True:
            qpn = self._next_qpn
            self._next_qpn = qpn % envelope.MAX_QPN + 1
            if qpn not in self.qps:
                return qpn

    def get_link(self, addr: tuple[str, int]) -> PeerLink:
        """The link to ``addr``, opened (active) if there is none."""
        pl = self.links.get(addr)
        if pl is None:
            if len(self.links) >= MAX_LINKS:
                raise tables.TableError(errno.ENOMEM, "too many peer links")
            link = Link(self.link_config, rng=self.rng, incarnation=self.incarnation, framer=self.native)
            link.connect(self._time())
            pl = PeerLink(self, addr, link)
            self.links[addr] = pl
            self.wake()
        return pl

    def attach_link(self, qp: QueuePair, addr: tuple[str, int]) -> None:
        """Bind ``qp`` to the link to ``addr`` (at INIT -> RTR)."""
        pl = self.get_link(addr)
        qp.link = pl
        pl.qps.add(qp)

    def detach_link(self, qp: QueuePair) -> None:
        if qp.link is not None:
            qp.link.qps.discard(qp)
            qp.link = None

    def _time(self) -> float:
        self.now = self._clock()
        return self.now

    # -- the data path ----------------------------------------------------------
    def poll_once(self) -> bool:
        """One pass over sockets, links and queues; True if anything happened.

        An idle pass is the daemon's spin (and, on a shared vCPU, the
        latency every other process on that vCPU waits out), so each step
        first asks the cheapest question that proves it has nothing to do.
        """
        now = self.now = self._clock()
        progress = False
        if self.qps.version != self._qps_seen:
            self._qps_changed()
        sock = self.sock
        links = self.links
        rx = self._rx_epoll
        if self._rx_rest is not None:
            # Finish the buffer a pass left before reading the socket again:
            # what it holds arrived first.
            self._receive_rest(now)
            progress = True
        elif sock is not None and (got := self._read_armed(now) if self._armed is not None
                                   else _RX_READY if rx is None or rx.poll(0) else 0):
            touched = self._touched  # the armed read's link, if it read
            self._touched = set()
            gro = self.gro
            cmsgs = gro or self.rx_stamps
            recv = sock.recvmsg if cmsgs else sock.recvfrom
            # now - realtime: converts a kernel stamp to our clock (computed
            # per pass, so a step of the wall clock corrupts one pass at most)
            rt_to_now = now - time.time()
            # After the armed read, the loop asks the epoll first (and reads
            # nothing while that read left part of a buffer for the next pass).
            budget = _RX_BUDGET if got == _RX_READY else 0 if self._rx_rest is not None else _RX_BUDGET - 1
            byte_budget = _RX_BYTE_BUDGET
            while budget > 0 and byte_budget > 0:
                if budget < _RX_BUDGET and rx is not None and not rx.poll(0):
                    # Drained.  Asking the epoll costs a third of a recvmsg
                    # that fails with EAGAIN (and its exception): about 1 us
                    # of every receiving pass, 2-3% of a ping-pong's hop.
                    break
                budget -= 1
                try:
                    if cmsgs:
                        data, anc, msg_flags, addr = recv(_RX_BUF, _RX_CMSG_SPACE)
                    else:
                        data, addr = recv(_RX_BUF)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # e.g. ICMP port unreachable reported on the socket
                    self.stats["rx_oserror"] += 1
                    continue
                arrived = now
                seg = 0
                byte_budget -= len(data)
                if cmsgs:
                    if msg_flags & _TRUNCATED:
                        # Larger than any datagram we send, or a GRO size we
                        # cannot read (so neither can we split the buffer).
                        self.stats["rx_truncated"] += 1
                        continue
                    for level, kind, value in anc:
                        if level == SOL_UDP and kind == UDP_GRO and len(value) >= 4:
                            seg = int.from_bytes(value[:4], sys.byteorder)
                        elif level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(value) >= _TIMESPEC.size:
                            sec, nsec = _TIMESPEC.unpack_from(value)
                            arrived = _arrival(sec + nsec * 1e-9 + rt_to_now, now)
                # Coalesced by GRO: equal-size datagrams back to back (the
                # last may be shorter), the size in the control message.
                if 0 < seg < len(data):
                    self.stats["rx_gro_batches"] += 1
                    budget -= len(data) // seg
                else:
                    seg = len(data)
                self._received(addr, data, seg, now, arrived, touched)
                if self._rx_rest is not None:
                    break  # the rest of that buffer first, next pass
            if touched:
                progress = True
                for pl in touched:
                    for msg in pl.link.drain_received():
                        self._dispatch(pl, msg)
        if self._delivered_to is not None and self._answer_early(self._delivered_to):
            self._delivered_to = None
        to_complete = self._to_complete
        for pl in list(links.values()):
            link = pl.link
            d = link.next_deadline()
            if d is not None and d <= now:
                link.timer_fired(now)
            if link.has_events:
                ev = link.next_event()
                while ev is not None:
                    self._link_event(pl, ev)
                    ev = link.next_event()
                progress = True
            waiters = pl.ack_waiters
            if waiters:
                acked = link.acked
                while waiters and waiters[0][0] < acked:
                    to_complete[waiters.popleft()[1]] = None
        if self._delivered_to is not None and self._answer_early(self._delivered_to):
            self._delivered_to = None
        delivered = self._delivered
        if to_complete:
            self._to_complete = {}
            for qp in sorted(to_complete, key=_BY_RANK):
                # Completions first: they only need what this pass received.
                if qp.outstanding and qp.link is not None:
                    try:
                        if qp.complete_acked(qp.link.link.acked):
                            delivered = True
                    except Exception:  # an engine bug ends this QP, never the daemon
                        self._qp_failed(qp)
        if delivered:
            # Something the application waits for (placed data, a CQE) is now
            # in its memory.  On a shared vCPU the application may be the
            # task waiting behind us: let it run now, not after this pass's
            # sends.  It often posts its answer at once, which the pump below
            # then finds, and whose datagram carries our ACK.
            self._delivered = False
            progress = True
            if self.yield_on_delivery:
                self.stats["delivery_yields"] += 1
                os.sched_yield()
        answerer, self._delivered_to = self._delivered_to, None
        to_pump = self._to_pump
        for qp in self._sq_watch.take_posted():
            if qp.link is not None:
                qp.link.ready[qp] = None
            else:
                to_pump[qp] = None
        if to_pump:
            for qp in sorted(to_pump, key=_BY_RANK):
                del to_pump[qp]
                if qp.state == _ERR:
                    if qp.flush_rings():
                        progress = True
                elif qp.link is not None and self._pump(qp):
                    progress = True
                self._settle(qp)
        for pl in list(links.values()):
            ready = pl.ready
            if not ready:
                continue
            link = pl.link
            for qp in list(ready):
                if not link.send_space():
                    break  # the rest wait their turn, in order
                # A turn: the Write under way, if any, is finished and nothing
                # new is taken; else new WQEs are taken and the last one
                # taken is finished on the next passes.  So each Write's
                # segments leave in one run (the peer's compiled lane places
                # a run per QP) and no QP holds the link for more.
                if self._pump(qp, start=qp.sending is None):
                    progress = True
                if qp.sending is not None and qp.state != _ERR:
                    continue  # keeps its turn
                del ready[qp]
                self._settle(qp)  # back at the end of the line if it has more
        # Stamp what leaves with the time it leaves, not when this pass began
        # (a pass that placed data, yielded and pumped took a while): the
        # peer's RTT sample should hold the path, not our pass.
        self.now = self._clock()
        for pl in list(links.values()):
            if self.flush_link(pl):
                progress = True
        if self._prefetch:
            prefetch, self._prefetch = self._prefetch, []
            for qp in prefetch:
                try:
                    qp.prefetch_receive()
                except Exception:  # an engine bug ends this QP, never the daemon
                    self._qp_failed(qp)
        if answerer is not None:
            self._answer_early(answerer)  # posted after the SQ watch looked: sent now, not a pass later
        if self._sent:
            self._sent = False
            if self.yield_on_delivery and self._armed is None and self._arm_link is not None:
                # Our application may share our vCPU: it waits for the
                # peer's answer to what we just sent, so the rest of our
                # pass delays nobody.  Arm now (see run_data_path otherwise).
                self._arm(self._arm_link)
        if self.check_passes:
            self.check_pass()
        return progress

    def _received(self, addr: tuple[str, int], data: bytes, seg: int, now: float, arrived: float,
                  touched: set[PeerLink]) -> None:
        """Feed a buffer read from ``addr`` to its link (``_receive``), or
        to a new passive one; add the link to ``touched``."""
        self._armed = None  # set up for what the link expected before this
        pl = self.links.get(addr)
        if pl is None:
            # Each datagram from an unknown peer is judged (and
            # counted) alone until one opens a link.
            start = 0
            while True:
                pl = self._passive_link(addr, data[start:start + seg])
                if pl is not None or start + seg >= len(data):
                    break
                start += seg
            if pl is None:
                return
            if start:
                data = data[start:]
        self._arm_link = pl
        self._receive(pl, data, seg, now, arrived)
        touched.add(pl)

    def _arm(self, pl: PeerLink) -> None:
        """Set the lane up for the run ``pl``'s hint expects next, before it
        comes: the next pass reads the socket and places it in one compiled
        call (``_read_armed``).

        In a ping-pong the set-up (``_run_setup``) and the Python read of
        the socket were 6 µs of each hop between the datagram's arrival and
        its data in place.  Done here, at the end of a pass, they cost the
        same, but while the peer is still working on its answer.  What the
        set-up read may change before that pass; ``_read_armed`` checks it
        (the QP's state, the link's state and next sequence, the STag
        table's version, which moves on every registration and
        invalidation, and so covers the regions the lane would write);
        everything else it read changes only when this daemon takes a
        datagram, which disarms (``_received``), or when the QP table
        changes (``_qps_changed``).  The memory's address is kept without a
        buffer export, which would keep deregistration from unmapping it:
        no region the arming saw can go without the STag table's version
        moving.
        """
        if pl.rx_hint is None or self.native is None or self.links.get(pl.addr) is not pl:
            return
        limit = (self.config.rx_dispatch_budget or _WHOLE_MAX) if pl.rx_hint[2] in _ANSWERED_BY_DAEMON else _WHOLE_MAX
        setup = self._run_setup(pl, limit, drop=False)
        if setup is None:
            return
        view, start = setup[2], setup[3]
        ffi = self.native.ffi
        if view is None:
            mem = self._no_mem
        else:
            try:
                held = ffi.from_buffer("uint8_t[]", view, require_writable=True)
            except ValueError:
                return
            mem = ffi.cast("uint8_t *", int(ffi.cast("uintptr_t", held)) + start)
            ffi.release(held)
        rx = self._rx_recv
        rx.peer_addr, rx.peer_port = pl.rx_addr, pl.rx_port
        self._armed = (pl, setup, mem, pl.link.rcv_nxt, self.stags.version)

    def _hand_over(self, pl: PeerLink) -> None:
        """Right after ``pl``'s datagram left alone (``PeerLink.send_alone``),
        before this pass records it: arm the lane for the answer, then let
        the processes that share our vCPU run until one of them has done
        some work, or until ``hand_over_s`` has passed when a yield returns
        (the scheduler decides when that is: a turn of a spinning
        application's can run well past it, 15–23 µs in ``send_lat``).

        With the applications on the other side's daemons' vCPUs (``udpverbs
        perf --local`` places them so) the process next to us is the peer's
        application, and what it waits for is our datagram, placed by its
        daemon a few microseconds from now.  It used to wait behind the rest
        of our pass (the link's record of the datagram, the WR's, the flush:
        10 µs of a Write's 22 µs pass in one process) and behind the arming
        after it.  Its answer is a turn of its own and a pass of its
        daemon's away, time enough for our bookkeeping; and the lane armed
        now is ready before that answer comes.  A turn in which the other process found nothing to do is
        short, about 1.5 µs here for a spinning application, 3.4 µs for one
        polling a CQ in Python; the turn in which it took our data and
        answered is longer, and ends the hand-over.  So does a readable
        socket.  A yield that returns at once does not: the scheduler
        (EEVDF) does not pick a process that has had more than its share,
        which a spinning application often has.
        """
        if self._armed is None:
            self._arm(pl)
        if not self.hand_over_s:
            return
        rx = self._rx_epoll
        clock = _turn_clock
        yield_cpu = _yield_cpu
        start = clock()
        shortest, longest = 1.0, 0.0
        while True:
            t0 = clock()
            yield_cpu()
            t1 = clock()
            turn = t1 - t0
            if turn < shortest:
                shortest = turn
            if turn > longest:
                longest = turn
            if longest > 2 * shortest + _WORK_TURN_MARGIN_S:
                self.stats["hand_over_answered"] += 1
                return
            if t1 - start > self.hand_over_s or rx is not None and rx.poll(0):
                return

    def _read_armed(self, now: float) -> int:
        """Read the socket once through the armed lane (``_arm``): 1 if
        something was read (the caller reads on while the socket has more),
        0 if nothing was; if the arming no longer holds, ``_RX_READY`` when
        the socket has something for the usual way to read, else 0."""
        pl, setup, mem, rcv_nxt, version = self._armed  # type: ignore[misc]
        qp = setup[0]
        link = pl.link
        # (a link leaves the table only when it ends: its state covers that)
        if qp.state not in _RECEIVING or link.rcv_nxt != rcv_nxt or link.state != _LINK_ESTABLISHED \
                or self.stags.version != version:
            self._armed = None
            self.stats["rx_armed_stale"] += 1
            return _RX_READY if self._rx_epoll is None or self._rx_epoll.poll(0) else 0
        rx = self._rx_recv
        k = self.native.lib.udpv_rx_recv_run(rx, self._rx_run, self._rx_buf, _RX_BUF, mem)
        if k < 0:
            if rx.err == errno.EAGAIN or rx.err == errno.EINTR:
                return 0  # still armed
            self._armed = None
            self.stats["rx_oserror"] += 1  # e.g. ICMP port unreachable reported on the socket
            return 1
        self._armed = None
        self.stats["rx_armed"] += 1
        n = rx.n
        if rx.truncated:
            self.stats["rx_truncated"] += 1
            return 1
        arrived = now
        if rx.ts_sec:
            arrived = _arrival(rx.ts_sec + rx.ts_nsec * 1e-9 + (now - time.time()), now)
        seg = rx.seg
        if seg < n:
            self.stats["rx_gro_batches"] += 1
        touched = self._touched
        if not rx.from_peer:
            addr = (socket.inet_ntoa(_NATIVE_U32.pack(rx.src_addr)), socket.ntohs(rx.src_port))
            self._received(addr, self.native.ffi.buffer(self._rx_buf, n)[:], seg, now, arrived, touched)
            return 1
        touched.add(pl)
        self._arm_link = pl
        data = None
        if k == 0 or k * seg < n or setup[6] is not None:
            # the Python path, or a request's answer, reads the datagrams:
            # a copy, since the next read reuses the buffer
            data = self.native.ffi.buffer(self._rx_buf, n)[:]
        if k:
            used = self._run_taken(pl, setup, k, data, 0, n, seg, now, arrived)
        else:
            # What the lane did not take goes the Python path, as in _receive.
            link.datagram_received(memoryview(data)[:seg], now, arrived)  # type: ignore[arg-type]
            used = seg
            for msg in link.drain_received():
                self._dispatch(pl, msg)
        if used < n:
            # the rest as _receive goes on after a lane call, the requests
            # the lane took counted against the pass's budget
            spent = k if k and setup[1] in _ANSWERED_BY_DAEMON else 0
            self._receive(pl, data, seg, now, arrived, used, spent)  # type: ignore[arg-type]
        return 1

    def _receive_rest(self, now: float) -> None:
        """Go on with the buffer an earlier pass left (``_rx_rest``), within the budget again."""
        assert self._rx_rest is not None
        pl, data, off, seg, arrived = self._rx_rest
        self._rx_rest = None
        self._armed = None
        if self.links.get(pl.addr) is not pl:
            return  # the link went away in between: what it held goes with it
        self._receive(pl, data, seg, now, arrived, off)
        for msg in pl.link.drain_received():
            self._dispatch(pl, msg)

    def _receive(self, pl: PeerLink, data: bytes, seg: int, now: float, arrived: float, off: int = 0,
                 spent: int = 0) -> None:
        """Feed one received buffer to ``pl``'s link from offset ``off``: a
        datagram, or (``seg`` < its length) datagrams of ``seg`` bytes
        coalesced by GRO.

        While the peer streams an RDMA Write or Read Responses, runs of their
        segments go to the compiled lane (``_place_run``), and so do Sends
        (all of a plain Send's segments; a Send with Invalidate's but its
        last), Read and atomic requests and Atomic Responses.  The datagrams it does not take go
        through the link one by one, and whatever they deliver is dispatched
        at once: a later segment must not be placed before an earlier
        message has had its effect (a Send with Invalidate, say).

        At most ``rx_dispatch_budget`` datagrams of the buffer take that
        Python path in one call; the rest is kept in ``_rx_rest`` for the
        next pass, which finishes it before it reads the socket again.  The
        pass in between sends the answers to the first (atomic and Read
        responses, ACKs), so the peer works on those while we work on the
        rest: without it, a batch of requests and a batch of answers
        alternate between two daemons that each idle half the time
        (atomic_bw; the README's "Which daemon sets the pace").
        """
        link = pl.link
        n = len(data)
        # Without a hint, a GRO buffer still goes datagram by datagram where
        # the lane exists: the Python path's first segment of a Send (or of
        # a Read's responses) sets the hint for the rest of the buffer.
        if n == 0 or pl.rx_hint is None and (seg >= n or self.native is None):
            if seg >= n:
                link.datagram_received(data, now, arrived)
            else:
                view = memoryview(data)
                for at in range(off, n, seg):
                    link.datagram_received(view[at:at + seg], now, arrived)
            return
        view = memoryview(data)
        budget = self.config.rx_dispatch_budget or n
        if spent:
            # the armed read took requests of this buffer already (_read_armed)
            budget -= spent
            if budget <= 0:
                self._rx_rest = (pl, data, off, seg, arrived)
                return
        while off < n:
            hint = pl.rx_hint
            if hint is not None:
                # requests as many as the budget has left; anything else, no limit
                used = self._place_run(pl, data, off, seg, now, arrived,
                                       budget if hint[2] in _ANSWERED_BY_DAEMON else _WHOLE_MAX)
                off += used
                if off >= n:
                    break
                if used and self._rx_run.ended:
                    # A message ended the run (a Send, a Read, requests):
                    # the next may be another, for the lane again.  A
                    # request's answer is this pass's work, as on the
                    # Python path, so each counts against the budget.
                    if hint[2] in _ANSWERED_BY_DAEMON:
                        budget -= -(-used // seg)
                        if budget <= 0:
                            self._rx_rest = (pl, data, off, seg, arrived)
                            return
                    continue
            link.datagram_received(view[off:off + seg], now, arrived)
            off += seg
            for msg in link.drain_received():
                self._dispatch(pl, msg)
            budget -= 1
            if not budget and off < n:
                self._rx_rest = (pl, data, off, seg, arrived)
                return

    def _run_setup(self, pl: PeerLink, limit: int, drop: bool = True) -> tuple[Any, ...] | None:
        """Set the lane's run (``_rx_run``) for what ``pl``'s hint names,
        after the checks ``_place_run`` describes; return what the run's
        taking needs (``_run_taken``), or None (the hint dropped, unless
        ``drop`` is False, or the link takes nothing in a run now)."""
        hint = pl.rx_hint
        qp, stag, op = hint  # type: ignore[misc]
        if qp.state not in _RECEIVING or qp.link is not pl or self.qps.get(qp.qpn) is not qp:
            return _no_run(pl, drop)
        r = self._rx_run
        request = recv = rd = msn = None
        if op == _OP_WRITE:
            mr = self.stags.lookup(stag)
            if mr is None or mr.pd is not qp.pd or not mr.access & _REMOTE_WRITE:
                return _no_run(pl, drop)
            view, start = mr.view, 0
            key: Any = (hint, mr, qp.dest_qpn)
            if self._rx_run_key != key:
                # What the lane reads of a Write's run, the same for every
                # run into this region from this QP: set once, not per
                # datagram (the lane changes none of it).
                r.untagged = r.qn = r.whole = r.last_fills = r.many = r.last_ends = 0
                r.base, r.length, r.sequential = 0 if mr.zero_based else mr.addr, mr.length, 0
                r.ctrl_more, r.rctl, r.ctrl_last = _WRITE_CTRL
                r.w0, r.w1, r.stag = segment._DDP_WORD | qp.qpn, qp.dest_qpn, stag
                self._rx_run_key = key
        elif op in _SEND_CTRL:
            # A receive under way, or the next posted one for a Send that
            # starts here (taken from the ring only if the lane fills it).
            recv = None if qp.rx_imm_pending or qp.rx_rnr else qp.rx_recv or qp.peek_receive()
            gather = None if recv is None else recv[1]
            if gather is None or len(gather.pieces) != 1:
                return _no_run(pl, drop)
            view, start, length = gather.pieces[0]
            key = (hint, qp.dest_qpn)
            if self._rx_run_key != key:
                # all of a Send's run settings but the receive's, as for a Write
                r.qn = r.whole = r.last_fills = r.many = r.base = 0
                r.untagged = r.last_ends = r.sequential = 1
                r.ctrl_more, r.rctl, r.ctrl_last = _SEND_CTRL[op]
                r.w0, r.w1, r.stag = segment._DDP_WORD | qp.qpn, qp.dest_qpn, stag
                self._rx_run_key = key
            r.length, r.next_to, r.msn = length, 0 if recv is not qp.rx_recv else qp.rx_placed, qp.rx_msn
        else:
            self._rx_run_key = None
            r.untagged = r.qn = r.whole = r.last_fills = r.many = 0
            r.last_ends = 1
            request = _REQUEST_LANE.get(op)
            if request is not None:
                # A Read or atomic request, or an Atomic Response: the lane
                # checks its packet and its header (queue, MSN, one whole
                # segment of its size) and copies nothing; the QP takes it
                # below, from the datagram, as the Python path does.
                r.ctrl_more, r.rctl, r.ctrl_last, r.qn, r.length = request
                view, start = None, 0
                r.base, r.sequential, r.next_to = 0, 1, 0
                r.untagged = r.whole = r.last_fills = r.many = 1
                r.msn = msn = (qp.rx_read_msn if op == _OP_READ_REQUEST else qp.rx_atomic_msn
                               if op == _OP_ATOMIC_REQUEST else qp.rx_atomic_resp_msn)
            else:
                # Read Responses into the ORRQ head's sink, in order; the last
                # one (which must fill the sink) ends the run.  Each Read has a
                # sink STag of its own: the lane expects the head's, not the
                # hint's (the Read before it).
                rd = qp.orrq[0] if qp.orrq else None
                if type(rd) is not _PendingRead or len(rd.gather.pieces) != 1:
                    return _no_run(pl, drop)
                stag = rd.wr.sink_stag
                view, start, _ = rd.gather.pieces[0]
                r.base, r.length, r.sequential, r.next_to = 0, rd.size, 1, rd.placed
                r.last_fills = 1
                r.ctrl_more, r.rctl, r.ctrl_last = _READ_RESPONSE_CTRL
            r.w0, r.w1, r.stag = segment._DDP_WORD | qp.qpn, qp.dest_qpn, stag
        link = pl.link
        expect = link.run_receivable()
        if expect is None:
            return None
        r.conn_tag, r.seq, r.max_count = expect
        if request is not None:
            room = limit if limit < _WHOLE_MAX else _WHOLE_MAX
            if r.max_count > room:
                r.max_count = room
        return qp, op, view, start, recv, rd, request, msn

    def _place_run(self, pl: PeerLink, data: bytes, off: int, seg: int, now: float, arrived: float,
                   limit: int = _WHOLE_MAX) -> int:
        """Place the run of RDMA Write (or Read Response, or Send) segments
        at ``data[off:]`` that the compiled lane accepts, or take the Read
        or atomic requests, or Atomic Responses, there (at most ``limit``);
        return the bytes it consumed (0: none).

        What the lane does not check, checked here once per call: the
        hinted QP still receives on this link; for a Write, the STag still
        names a region in its PD with remote write access; for a Read
        Response, it is the sink STag of the Read at the ORRQ head, whose
        sink is one SGE; for a Send, a receive of one SGE is under way and
        no RNR NACK or Immediate Data is pending (the MSN and the message
        offset the lane checks against the QP's).  A request the QP answers,
        and an Atomic Response it takes, as the Python path does, with all
        of that path's checks.
        """
        setup = self._run_setup(pl, limit)
        if setup is None:
            return 0
        qp, op, view, start = setup[:4]
        r = self._rx_run
        ffi = self.native.ffi
        if view is None:
            mem = self._no_mem
        else:
            try:
                mem = ffi.from_buffer("uint8_t[]", view, require_writable=True)
            except ValueError:  # a Read's sink deregistered under it: the Python path counts the segment
                pl.rx_hint = None
                return 0
        buf = ffi.from_buffer("uint8_t[]", data)
        more = None
        try:
            k = self.native.lib.udpv_rx_write_run(r, buf + off, len(data) - off, seg, mem + start)
            if k and r.ended and op == _OP_READ_RESPONSE and len(qp.orrq) > 1 and len(data) - off > k * seg:
                more = self._next_reads_responses(qp, view, buf, mem, data, off + k * seg, seg, k)
        finally:
            # no export may outlive the call: deregistration releases the view
            if view is not None:
                ffi.release(mem)
            ffi.release(buf)
        if more is not None:
            return self._reads_responded(pl, qp, more, now, arrived) - off
        return self._run_taken(pl, setup, k, data, off, len(data), seg, now, arrived)

    def _run_taken(self, pl: PeerLink, setup: tuple[Any, ...], k: int, data: bytes | None, off: int, end: int,
                   seg: int, now: float, arrived: float) -> int:
        """The lane took ``k`` datagrams at ``data[off:end]`` in the run
        ``setup`` set: complete, answer and account for them; return the
        bytes consumed (``data`` is read only for requests, Atomic
        Responses and what follows the run: None when there is none)."""
        qp, op, view, start, recv, rd, request, msn = setup
        r = self._rx_run
        link = pl.link
        if k:
            # What an application waits on first, the link's accounting of
            # the run (and of the ACK it carries) after: a Send's receive
            # and its CQE, a Read's or an atomic's CQE (a Write's data is
            # in place already).  ``Link.data_run_received`` reads nothing
            # these change.
            sends = op not in _TAGGED_LANE and request is None
            if sends:
                self._sends_placed(qp, op, recv, r)
            elif op == _OP_READ_RESPONSE:
                rd.placed += r.bytes
                if r.ended:
                    qp.read_placed()
                    self.stats["rx_native_reads"] += 1
                    self.qp_changed(qp)  # the Read completes
                    self._complete_now(qp)
            elif op == _OP_ATOMIC_RESPONSE:
                at = self._take_whole(qp, op, msn, data, off, seg, k)
                self._complete_now(qp)
            link.data_run_received(k, r.first_ack, r.first_ts, r.first_echo, r.first_rwnd, r.first_flags,
                                   r.last_ts, r.last_rwnd, r.flags_or, now, arrived)
            if sends:
                if r.flow_ack:
                    qp.on_flow_ack(r.flow_ack_msn)
            elif op == _OP_WRITE:
                qp.rx_write_bytes += r.bytes
            elif request is not None:
                if op == _OP_ATOMIC_RESPONSE:
                    self.stats["rx_native_atomic_responses"] += k
                    self._delivered = True  # the original values are in the application's memory
                    self._delivered_to = qp
                else:
                    at = self._take_whole(qp, op, msn, data, off, seg, k)
                    self.stats["rx_native_requests"] += k
                    if k == 1 and at >= end and self.answer_at_once:
                        # A lone request, the last of what this receive
                        # brought (read_lat, atomic_lat): the requester
                        # waits on nothing else, so it is answered now, not
                        # after the rest of the pass (5 us of each round
                        # trip).  A batch's answers leave together when the
                        # pass pumps.
                        self._pump(qp, start=False)
                self.qp_changed(qp)  # the answers go, or the WRs complete, this pass
                self.stats["rx_native_datagrams"] += k
                return at - off
            self._delivered = True
            self._delivered_to = qp
            self.stats["rx_native_datagrams"] += k
        used = k * seg
        if used >= end - off:
            return end - off
        if r.peeked and self._write_rehint(pl):
            # The next message is another QP's or region's Write (Writes
            # over many QPs interleave): the lane takes it too, instead of
            # the Python path taking its first segment to set the hint.
            return used + self._place_run(pl, data, off + used, seg, now, arrived)
        return used

    def _take_whole(self, qp: QueuePair, op: int, msn: int, data: bytes, off: int, seg: int, k: int) -> int:
        """Take the ``k`` whole requests or Atomic Responses the lane took
        at ``data[off:]``, MSN by MSN from ``msn``, each as the Python path
        takes it, in order; return the offset after the last."""
        view = memoryview(data)
        at, end = off, len(data)
        response = op == _OP_ATOMIC_RESPONSE
        for i in range(k):
            n = seg if end - at > seg else end - at
            raw = view[at + _SEGMENT_AT:at + n - _CRC_LEN]
            at += n
            if i and qp.state not in _RECEIVING:
                continue  # the one before failed the QP: as on_segment, drop the rest
            if response:
                qp.on_atomic_response((msn + i) & _U32, raw[ddp.UNTAGGED_HEADER_LEN:], raw)
            else:
                qp.on_request(op, (msn + i) & _U32, raw[ddp.UNTAGGED_HEADER_LEN:], raw)
        return at

    def _complete_now(self, qp: QueuePair) -> None:
        """Retire the WRs at the head of ``qp``'s SQ that a response has
        just completed (a Read's, an atomic's), as soon as it is taken,
        and before the link accounts for the lane's run: the application
        waits on their CQEs.  Only WRs marked done: what an ACK retires
        waits for the completion step of the pass, so the lane and the
        Python path, whose ACK processing comes at different points,
        retire everything at the same points."""
        try:
            if qp.outstanding:
                qp.complete_acked(-1)
        except Exception:  # an engine bug ends this QP, never the daemon
            self._qp_failed(qp)

    def _sends_placed(self, qp: QueuePair, op: int, recv: Any, r: Any) -> None:
        """The lane placed a run of Send segments into ``recv``: take the
        receive from the ring if the run started it, and complete it if the
        run ended the Send."""
        if recv is not qp.rx_recv:
            qp.take_receive(recv)
        qp.rx_placed += r.bytes
        if r.ended:
            qp.send_placed(op)
            self.stats["rx_native_sends"] += 1
            self.qp_changed(qp)  # a Modified ACK is owed

    def _next_reads_responses(self, qp: QueuePair, view: Any, buf: Any, mem: Any, data: bytes, at: int, seg: int,
                              k: int) -> list[tuple[int, ...]]:
        """The lane placed the whole response of the Read at the ORRQ head,
        ``k`` datagrams, and more of ``data`` follows at ``at``: place the
        responses of the next Reads there too, while each is one SGE in the
        same region (``view``, exported as ``mem``), one lane call each
        with no new set-up.  Return each call's ``(count, bytes, ended,
        ACK field, first packet's timestamp, echo, window, flags, last
        packet's timestamp, window, flags of all, end offset)``, the first
        call's first; the caller accounts for them on the link and
        completes the Reads (``_reads_responded``)."""
        r = self._rx_run
        run = self.native.lib.udpv_rx_write_run
        end = len(data)
        seq, room = r.seq, r.max_count
        calls = [(k, r.bytes, 1, r.first_ack, r.first_ts, r.first_echo, r.first_rwnd, r.first_flags, r.last_ts,
                  r.last_rwnd, r.flags_or, at)]
        orrq = qp.orrq
        i = 1
        while at < end and i < len(orrq):
            seq = (seq + k) & _U32
            room -= k
            rd = orrq[i]
            if room <= 0 or type(rd) is not _PendingRead or len(rd.gather.pieces) != 1:
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
            calls.append((k, r.bytes, r.ended, r.first_ack, r.first_ts, r.first_echo, r.first_rwnd, r.first_flags,
                          r.last_ts, r.last_rwnd, r.flags_or, at))
            if not r.ended:
                break  # a Read's responses cut short: the rest as without this
            i += 1
        return calls

    def _reads_responded(self, pl: PeerLink, qp: QueuePair, calls: list[tuple[int, ...]], now: float,
                         arrived: float) -> int:
        """Complete the Reads the lane calls of ``_next_reads_responses``
        ended (their CQEs first: the application waits on them), then
        account for the calls on ``pl``'s link, as one run per ACK field;
        return the offset in the buffer after the last."""
        link = pl.link
        total = reads = 0
        for call in calls:  # first what the application waits on
            rd = qp.orrq[0]
            rd.placed += call[1]
            if call[2]:
                qp.read_placed()
                reads += 1
        self._complete_now(qp)
        n = len(calls)
        j = 0
        while j < n:
            count, _, _, ack, ts, echo, rwnd, flags, last_ts, last_rwnd, flags_or, _ = calls[j]
            j += 1
            while j < n and calls[j][3] == ack:  # the same ACK field: one run for the link
                c = calls[j]
                count += c[0]
                last_ts, last_rwnd, flags_or = c[8], c[9], flags_or | c[10]
                j += 1
            link.data_run_received(count, ack, ts, echo, rwnd, flags, last_ts, last_rwnd, flags_or, now, arrived)
            total += count
        self.stats["rx_native_reads"] += reads
        self.stats["rx_native_datagrams"] += total
        self._rx_run.ended = calls[-1][2]
        self.qp_changed(qp)  # the Reads complete
        self._delivered = True
        self._delivered_to = qp
        return calls[-1][11]

    def _write_rehint(self, pl: PeerLink) -> bool:
        """Point ``pl``'s hint at the Write segment where the lane stopped
        (``udpv_rx_run.next_*``), if it is an RDMA Write to a QP of this link
        from that QP's peer, the lane's next call then taking it; False
        (hint unchanged) for anything else."""
        r = self._rx_run
        # A DDP envelope's first word is its kind over the destination QPN:
        # any other kind XORs to a number above every QPN.
        qp = self.qps.get(r.next_w0 ^ segment._DDP_WORD)
        ctrl_more, rctl, ctrl_last = _WRITE_CTRL
        if (qp is None or qp.link is not pl or r.next_w1 != qp.dest_qpn or r.next_rctl != rctl
                or (r.next_ctrl != ctrl_more and r.next_ctrl != ctrl_last)):
            return False
        hint = (qp, r.next_stag, _OP_WRITE)
        if hint == pl.rx_hint:
            # Not expected (the lane stopped because these words differ from
            # the hint's), but a call on the same hint must not recurse.
            return False
        pl.rx_hint = hint
        return True

    def _qp_failed(self, qp: QueuePair) -> None:
        self.stats["qp_exception"] += 1
        log.exception("QP %d failed", qp.qpn)
        qp.fatal("internal error")

    def _pump(self, qp: QueuePair, start: bool = True) -> bool:
        try:
            sent = qp.pump(_TURN_BUDGET, start)
        except Exception:  # an engine bug ends this QP, never the daemon
            self._qp_failed(qp)
            return True
        if sent and qp.q0 and qp.rx_recv is None and self.native is None:
            # Our Sends are out: the peer's may answer them, into our next receive
            self._prefetch.append(qp)
        return bool(sent)

    def _answer_early(self, qp: QueuePair) -> bool:
        """Take the answer to what this pass delivered to ``qp`` as soon as
        the application has posted it, not when the pass reaches the SQ
        watch; False if nothing is posted yet (the caller looks again later).

        In a ping-pong the application sees the data (or the CQE) at once and
        posts its answer while this pass goes on with the ACK the message
        carried, the links' timers and the completions; the pass looks here
        between those steps, and at its end for an answer posted after the
        SQ watch.  Only a QP on a link where no other QP waits its turn
        (anything else keeps its order), and either watched (nothing of it
        pending) or due a visit this pass for what was just delivered to
        it (a Send leaves it owing a Modified ACK, a response completed a
        Read or an atomic) with at most one WR outstanding, a ping-pong's:
        the answer carries that ACK.  A stream's QP (an ORD window of
        atomics) keeps its new WQEs for the pump, after the completions:
        taken here they split the pass's batch (``atomic_bw`` 56,600 →
        53,000 operations/s).
        """
        sq = qp.sq
        if sq.hdr.producer == sq.cons:
            return False
        pl = qp.link
        if pl is not None and not pl.ready and qp.state == _RTS and (
                qp in self._sq_watch or qp in self._to_pump and len(qp.outstanding) <= 1):
            self._sq_watch.discard(qp)
            self._to_pump.pop(qp, None)
            self.stats["answered_early"] += 1
            self._pump(qp)
            self._settle(qp)
        return True

    def _settle(self, qp: QueuePair) -> None:
        """Put ``qp``, just visited, where it waits for its next visit (see
        ``_sq_watch``)."""
        # In ERR, new WQEs (SQ or RQ) are to be flushed; owing a RESUME, the
        # RQ is watched for a receive: either way, every pass.
        every_pass = qp.state == _ERR or (qp.rx_rnr and not qp.rx_resume_sent)
        pl = qp.link
        ready = pl is not None and qp.state != _ERR and (qp.has_send_work() or qp.sq.hdr.producer != qp.sq.cons)
        if ready:
            pl.ready[qp] = None  # keeps its place if it is already in line
        elif pl is not None:
            pl.ready.pop(qp, None)
        if every_pass:
            self._to_pump[qp] = None
        elif not ready:
            # Idle: out of the every-pass set too (it may have been put
            # there earlier in this pass, before this visit found it done).
            self._to_pump.pop(qp, None)
            self._sq_watch.add(qp)

    def qp_changed(self, qp: QueuePair) -> None:
        """``qp`` may have WRs to complete or something to send: the next
        pass visits it.  Called on a state change and on every message for
        it; a QP not named here is visited only for new WQEs or its ACKs."""
        self._to_complete[qp] = None
        self._to_pump[qp] = None
        self._sq_watch.discard(qp)

    def _qps_changed(self) -> None:
        """A QP came or went: forget where QPs wait, and visit each once."""
        self._armed = None
        qps = list(self.qps.values())
        for i, qp in enumerate(qps):
            qp.rank = i
        for pl in self.links.values():
            pl.ready.clear()
        self._sq_watch = SQWatch(qps, self.native)
        self._to_complete = dict.fromkeys(qps)
        self._to_pump = dict.fromkeys(qps)
        self._qps_seen = self.qps.version

    def check_pass(self) -> None:
        """Raise AssertionError if the last pass left a QP where no later
        pass would find its work: a completable WR nobody will complete,
        something to send while it sits idle, or in no place at all.  A
        test hook (``check_passes``): it walks every QP."""
        for qp in self.qps.values():
            on_link = qp.link is not None and qp in qp.link.ready
            places = (qp in self._sq_watch) + (qp in self._to_pump) + on_link
            assert places, f"QP {qp.qpn} waits nowhere"
            assert qp not in self._sq_watch or places == 1, f"QP {qp.qpn} is both idle and busy"
            if qp.link is None:
                continue
            if qp.has_send_work():
                assert qp in self._to_pump or on_link, f"QP {qp.qpn} idle with work to send"
            if qp.outstanding and qp not in self._to_complete:
                wr = qp.outstanding[0]
                assert not (wr.done or 0 <= wr.last_n < qp.link.link.acked), \
                    f"QP {qp.qpn} left out with WR {wr.wr_id} to complete"

    def flush_link(self, pl: PeerLink) -> bool:
        """Send what ``pl``'s link lets leave now (its queued requests
        first); True if anything was sent."""
        if pl.requests:
            pl.flush_requests()
        link = pl.link
        gso = self.gso
        out = (link.bursts_to_send if gso else link.datagrams_to_send)(self.now, self._clock)
        if not out or self.sock is None:
            return False
        if gso and (len(out) > 1 or type(out[0]) is Burst):
            self._send_segmented(out, pl.addr)
        else:
            self._send_each(out, pl.addr)  # type: ignore[arg-type]
        self._sent = True
        return True

    def _send_each(self, out: list[bytes | memoryview], addr: tuple[str, int]) -> None:
        """One ``sendto`` per datagram."""
        assert self.sock is not None
        sendto = self.sock.sendto
        for d in out:
            try:
                sendto(d, addr)
            except (BlockingIOError, InterruptedError):
                self.stats["tx_dropped"] += 1  # the link retransmits it
            except OSError:
                self.stats["tx_oserror"] += 1

    def _send_segmented(self, out: list[bytes | Burst], addr: tuple[str, int]) -> None:
        """Send ``out`` in runs of equal-size datagrams, one UDP_SEGMENT sendmsg per run.

        A run is datagrams of one size, at most GSO_MAX_SEGMENTS and
        GSO_MAX_BYTES, and may end with one shorter datagram (what the kernel
        cuts the buffer into): a :class:`Burst` in as few such runs as it
        takes, consecutive bursts of whole datagrams of one size (a stream's
        messages cut evenly) in one, or datagrams queued one by one,
        grouped.  A run of one goes by plain sendto.
        """
        i = 0
        n = len(out)
        while i < n:
            first = out[i]
            if type(first) is Burst:
                view, size = first.view, first.size
                step = max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // size)) * size
                total = len(view)
                j = i + 1
                if total < step and total % size == 0:
                    # Whole datagrams: the next bursts of this size join its
                    # sendmsg (a stream's messages of equal segments, see
                    # equal_segment_size) up to one that ends shorter.
                    while j < n:
                        d = out[j]
                        if type(d) is not Burst or d.size != size or total + len(d.view) > step:
                            break
                        total += len(d.view)
                        j += 1
                        if total % size:
                            break
                if j > i + 1:
                    if not self._send_run([b.view for b in out[i:j]], size, addr):  # type: ignore[union-attr]
                        self._send_each(one_per_datagram(out[j:]), addr)
                        return
                    i = j
                    continue
                for at in range(0, total, step):
                    if not self._send_run([view[at:at + step]], size, addr):
                        self._send_each(one_per_datagram([Burst(view[at + step:], size), *out[i + 1:]]), addr)
                        return
                i += 1
                continue
            size = len(first)
            j = i + 1
            total = size
            while j < n and j - i < GSO_MAX_SEGMENTS:
                d = out[j]
                if type(d) is Burst:
                    break
                k = len(d)
                if k > size or total + k > GSO_MAX_BYTES:
                    break
                total += k
                j += 1
                if k < size:
                    break  # a shorter datagram can only end a run
            if not self._send_run(out[i:j], size, addr):  # type: ignore[arg-type]
                self._send_each(one_per_datagram(out[j:]), addr)
                return
            i = j

    def _send_run(self, buffers: list[bytes | memoryview], size: int, addr: tuple[str, int]) -> bool:
        """Send ``buffers`` (datagrams of ``size`` bytes, the last may be
        shorter, in one or more buffers) by one UDP_SEGMENT sendmsg, or by
        sendto if they are one datagram.  False: GSO is off from now on and
        the caller sends the rest one by one (this run is sent)."""
        sock = self.sock
        assert sock is not None
        stats = self.stats
        one = len(buffers) == 1 and len(buffers[0]) <= size
        try:
            if one:
                sock.sendto(buffers[0], addr)
            else:
                sock.sendmsg(buffers, [(SOL_UDP, UDP_SEGMENT, size.to_bytes(2, sys.byteorder))], 0, addr)
                stats["tx_gso_sends"] += 1
        except (BlockingIOError, InterruptedError):
            stats["tx_dropped"] += _count(buffers, size)  # the link retransmits them
        except OSError as e:
            if not one and e.errno in _GSO_REFUSED:
                # The kernel would not cut this run (EINVAL: e.g. a segment
                # larger than this route's MTU allows): send it one by one.
                # A kernel that cannot segment at all (EIO, ENOPROTOOPT,
                # EOPNOTSUPP) is not asked again.
                stats["tx_gso_refused"] += 1
                if e.errno != errno.EINVAL:
                    log.warning("UDP_SEGMENT refused (%s): sending datagrams one by one", e)
                    self.gso = False
                self._send_each([d for b in buffers for d in Burst(memoryview(b), size).datagrams()], addr)
                return self.gso
            stats["tx_oserror"] += _count(buffers, size)
        return True

    def _passive_link(self, addr: tuple[str, int], data: bytes) -> PeerLink | None:
        # Only an INIT opens a link: garbage from anywhere must not cost state.
        try:
            h, _ = wire_link.decode_untrusted(data)
        except WireError:
            self.stats["rx_garbage"] += 1
            return None
        if h.ptype != wire_link.PacketType.INIT or len(self.links) >= MAX_LINKS:
            self.stats["rx_unknown_peer"] += 1
            return None
        pl = PeerLink(self, addr, Link(self.link_config, rng=self.rng, incarnation=self.incarnation,
                                       framer=self.native))
        self.links[addr] = pl
        log.info("link from %s:%d", *addr)
        return pl

    def _dispatch(self, pl: PeerLink, msg: bytes) -> None:
        """Route one delivered message.  Never raises: bad input is a counter."""
        try:
            env, hdr, payload = segment.decode_untrusted(msg)
        except WireError as e:
            self.stats["rx_" + e.reason] += 1
            return
        try:
            kind = env.kind
            if kind == Kind.DDP or kind == Kind.FLOW:
                qp = self.qps.get(env.dst_qpn)
                if qp is None or qp.link is not pl or qp.dest_qpn != env.src_qpn:
                    self.stats["rx_no_qp"] += 1
                    return
                self.qp_changed(qp)
                if kind == Kind.DDP:
                    raw = memoryview(msg)[envelope.ENVELOPE_LEN:]
                    if env.flags & _FLOW_ACK:
                        qp.on_flow_ack(envelope.flow_ack_msn(msg))
                        raw = raw[:-envelope.FLOW_ACK_LEN]
                    qp.on_segment(hdr, payload, raw, env.flags)
                    op = hdr.opcode
                    if op == _OP_READ_RESPONSE or op == _OP_ATOMIC_RESPONSE:
                        self._complete_now(qp)  # as the lane does
                    if op in _ANSWERED_BY_DAEMON:
                        if self.native is not None:
                            pl.rx_hint = (qp, 0, op)  # the next request
                    else:
                        self._delivered = True
                        self._delivered_to = qp
                        if self.native is not None:
                            if op == _OP_WRITE or op == _OP_READ_RESPONSE:
                                pl.rx_hint = (qp, hdr.stag, op)
                            elif op == _OP_ATOMIC_RESPONSE:
                                pl.rx_hint = (qp, 0, op)  # the next one
                            elif op in _SEND_CTRL and (qp.rx_recv is not None if not hdr.last
                                                       else op in _SEND_ENDS_IN_LANE):
                                # the rest of this Send, or the next one
                                pl.rx_hint = (qp, hdr.inv_stag, op)
                else:
                    qp.on_flow(payload)  # what it completes, the completion step reports
            elif kind == Kind.CM and self.cm is not None:
                self.cm.on_message(pl, payload)
            else:
                self.stats["rx_unhandled_kind"] += 1
        except Exception:  # an engine bug must not take the daemon down
            self.stats["rx_exception"] += 1
            log.exception("error handling a message from %s:%d", *pl.addr)

    def _link_event(self, pl: PeerLink, ev: Any) -> None:
        if isinstance(ev, LinkUp):
            log.info("link to %s:%d up", *pl.addr)
            return
        reason = ev.reason if isinstance(ev, LinkFailed) else "closed"
        # The peer closing its end (shutdown) is routine; anything else is worth a warning.
        level = logging.INFO if reason in ("abort_received", "closed") else logging.WARNING
        log.log(level, "link to %s:%d ended: %s", pl.addr[0], pl.addr[1], reason)
        pl.up = False
        pl.failed_reason = reason
        if self.links.get(pl.addr) is pl:
            del self.links[pl.addr]
        for qp in list(pl.qps):
            self.qp_changed(qp)
            # The retry budget is gone: the oldest unfinished WR gets RETRY_EXC_ERR.
            for wr in qp.outstanding:
                if not wr.done and not (0 <= wr.last_n < pl.link.acked):
                    wr.status = W.IBV_WC_RETRY_EXC_ERR
                    wr.done = True
                    break
            qp.fatal(f"link {reason}")
        if self.cm is not None:
            self.cm.on_link_failed(pl)

    def _awaiting_peer(self) -> bool:
        for pl in self.links.values():
            if pl.link.bytes_in_flight:
                return True
        return False

    def next_deadline(self) -> float:
        t = self.now + self.config.max_sleep_s
        for pl in self.links.values():
            d = pl.link.next_deadline()
            if d is not None and d < t:
                t = d
        # QPs with a deadline of their own: a back-off after an RNR NACK, a held Modified ACK
        for waiting, until in ((self.rnr_waiting, _RNR_UNTIL), (self.flow_ack_holding, _FLOW_ACK_HOLD)):
            for qp in list(waiting):
                d = until(qp)
                if d is None or qp.state == S.IBV_QPS_ERR or self.qps.get(qp.qpn) is not qp:
                    waiting.discard(qp)
                elif d < t:
                    t = d
        return t

    async def run_data_path(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The data-path loop (see the module docstring).  Runs until cancelled."""
        spin_s = self.config.spin_s
        self._clock = trio.lowlevel.current_clock().current_time
        task_status.started()
        busy = 0
        clock = self._clock
        while True:
            t0 = clock()
            if self.poll_once():
                self.busy_s += clock() - t0
                busy += 1
                if busy >= 16:
                    busy = 0
                    await trio.lowlevel.checkpoint()  # let the control plane in
                continue
            # Idle: spin a little (a doorbell or datagram usually follows soon);
            # longer while our data is in flight, since its ACK is due within an
            # RTT and sleeping would add a vCPU wake-up to every round trip.
            spin_end = self.now + (self.inflight_spin_s if self._awaiting_peer() else spin_s)
            found = False
            idle = 0
            while clock() < spin_end:
                t0 = clock()
                os.sched_yield()
                t1 = clock()
                if self.poll_once():
                    self.busy_s += clock() - t1
                    found = True
                    break
                idle += 1
                if self._armed is None and self._arm_link is not None and \
                        (t1 - t0 > _ARM_AFTER_YIELD_S or idle == _ARM_AFTER_IDLE_PASSES):
                    # Arm while nobody waits on us.  With our applications on
                    # other vCPUs (``udpverbs perf --local`` pins each daemon
                    # where the other side's application runs), the end of a
                    # pass is not such a time: the application sharing our
                    # vCPU may be about to see what our peer placed.  A long
                    # yield is: it ran a turn with work in it (in a
                    # ping-pong, its next message posted), and waits a hop
                    # now.  On a vCPU of our own, a few idle passes are.
                    self._arm(self._arm_link)
            if found:
                continue
            await self._sleep()

    async def _sleep(self) -> None:
        for sess in self.sessions:
            sess.set_need_wakeup(1)
        self._sleeping = True
        shm.full_fence()  # need_wakeup must be visible before we look at the rings once more
        try:
            if self.poll_once():
                return
            # Let every other trio task (control plane) run until all are blocked.
            # A bare checkpoint is not enough: a task woken in the same scheduler
            # batch as us is neither runnable-counted nor run yet, and it may hold
            # a request already read from its socket, which our epoll cannot see.
            await trio.testing.wait_all_tasks_blocked()
            if self.poll_once():
                return
            stats = trio.lowlevel.current_statistics()
            timeout = min(self.next_deadline() - trio.current_time(), stats.seconds_to_next_deadline)
            if timeout < 0.002:
                return  # epoll_wait counts whole milliseconds: keep spinning for a deadline this close
            # Block in our own epoll, not through trio: a trio wake-up per event
            # costs ~300 µs here, a direct epoll_wait a vCPU wake (~60 µs).  The
            # epoll also watches the control sockets (``watch``), so a client
            # request wakes us and the checkpoint above lets trio serve it; trio
            # timers are honoured through seconds_to_next_deadline.
            self.epoll.poll(timeout - 0.001)  # rounded up to ms by epoll_wait: wake no later than due
        finally:
            self._sleeping = False
            for sess in self.sessions:
                sess.set_need_wakeup(0)
            # Consume the eventfd counts so the epoll fd stops being readable.
            for fd, _ in self.epoll.poll(0):
                if fd == self.wake_fd or fd in self._doorbells:
                    try:
                        os.eventfd_read(fd)
                    except OSError:
                        pass

    def watch(self, fd: int) -> None:
        """Wake the data loop when ``fd`` (a control socket trio owns) becomes readable."""
        self.epoll.register(fd, select.EPOLLIN | select.EPOLLRDHUP)
        self._watched.add(fd)

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd``; call before the fd is closed."""
        if fd in self._watched:
            self._watched.discard(fd)
            try:
                self.epoll.unregister(fd)
            except OSError:
                pass

    def dump_stats(self) -> dict[str, int]:
        out = dict(self.stats)
        out["data_busy_us"] = int(self.busy_s * 1e6)
        for pl in self.links.values():
            if pl.link.framed_datagrams:
                out["tx_native_datagrams"] = out.get("tx_native_datagrams", 0) + pl.link.framed_datagrams
            for k, v in pl.link.stats.as_dict().items():
                out[f"link_{k}"] = out.get(f"link_{k}", 0) + v
        return out

