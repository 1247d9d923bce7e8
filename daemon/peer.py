"""A peer link: one reliable link to one peer daemon, and what the QPs on it send.

Theory of operation
-------------------
A :class:`PeerLink` wraps one ``transport.link.Link`` (sans-IO) with what
the daemon's QPs need of it:

- ``send`` queues a message (one DDP segment in its envelope); the pass's
  flush (``flush``) sends what the link then lets leave.
- ``send_alone`` sends a message *now*, when the link would send it alone at
  the end of the pass anyway (a ping-pong's), and records it afterwards: the
  peer waits on the datagram, not on our bookkeeping.  The device then arms
  its receive lane for the answer and hands its CPU over for a moment
  (``PeerHost.handed_over``).
- ``send_tagged_run``/``send_untagged_run`` queue a run of segments of one
  message that the compiled send lane builds in place (``wire/native.py``):
  the payload is copied once, from the registered region to the buffer the
  socket sends from.
- A tagged run whose segments are large (``ZERO_COPY_MIN`` payload bytes
  or more: 64 KB datagrams on loopback or a jumbo path) is not built into a
  buffer: each segment is queued as a ``transport.link.Gather`` (its DDP
  header, and its payload as a view of the registered region), and leaves
  as one ``sendmsg`` of header, region slice and CRC, the CRC taken over
  the region where it lies; the kernel's copy into the socket is the only
  one.  Smaller segments keep the run: per segment, the Python of a queued
  message costs more than the copy it would save.  Not under a cluster key
  (a seal covers the joined datagram: the copy is needed anyway), nor on a
  link of several paths.
- ``send_request`` collects Read and atomic requests queued back to back (an
  ORD window's) into one run of equal messages, which the compiled framer
  frames in one call.

How a stream's message is cut (``segment_size``): a UDP_SEGMENT send and a
GRO batch can only end with a shorter datagram, so a message whose last
segment is short takes a system call of its own at both ends.  A stream's
message (others are queued with it) is cut evenly where two such messages
fit one send, so consecutive messages of one size are datagrams of one size
that ``UdpPort.send_segmented`` joins.  (DDP leaves the cutting to the
sender, each segment within the MULPDU, RFC 5041 §5.2; the receiver places
each by its offset.)
"""

from __future__ import annotations

import collections
import socket
from typing import Any

from ..transport.link import Burst, Gather, Gathered, Link, LinkState, PathMtu, one_per_datagram, run_slots
from ..transport.pmtud import fragmentable
from ..wire import envelope, segment
from ..wire import link as wire_link
from .ports import PeerHost
from .udp import GSO_MAX_BYTES, GSO_MAX_SEGMENTS, NATIVE_U32

#: times one flush hands the link a refused size and sends what follows
#: (each narrows its search: a few suffice from --mtu down to the path's)
MAX_REFUSED_ROUNDS = 16
_U64 = (1 << 64) - 1
#: the shortest segment payload (bytes) a tagged run sends from the
#: registered region without copying it (see the module docstring)
ZERO_COPY_MIN = 32768
#: datagrams a stream's Write or Read Response may take beyond the fewest,
#: to make them equal (a Send's may take none: equal_segment_size)
EQUAL_EXTRA = 2


def equal_segment_size(total: int, max_data: int, overhead: int, extra: int = EQUAL_EXTRA) -> int:
    """The payload of each segment a stream's message of ``total`` bytes is
    cut into: ``total`` split evenly over the fewest segments of at most
    ``max_data`` bytes, or over up to ``extra`` more, if two such messages
    (``overhead`` bytes more a datagram) fit one UDP_SEGMENT send; else
    ``max_data``, the last segment shorter.

    See the module docstring for why.  Where two messages cannot share a
    send nothing pays for an even cut.  A datagram more pays for Writes, not
    for Sends: a Send's extra datagram costs the sender as much Python as
    the system call it saves, so a Send is cut evenly only over the fewest
    segments (``extra`` 0).
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


class SendLane:
    """The compiled send lane's buffers (``wire/native.py``), shared by a device's peer links."""

    def __init__(self, native: Any) -> None:
        ffi = native.ffi
        self.ffi = ffi
        self.lib = native.lib
        # the segment headers of a run, packed in place by wire/segment.py
        self.segments = ffi.new("udpv_tx_segments *")
        self.more = ffi.buffer(self.segments.more)
        self.last = ffi.buffer(self.segments.last)
        self.tail = ffi.buffer(self.segments.tail)
        # A run's buffer is not zeroed: every byte a packet takes is written
        # before it leaves (the bodies by udpv_tx_bodies, the headers and
        # CRCs by the framer), and zeroing 64 KiB cost about a microsecond
        # a message.
        self.alloc = ffi.new_allocator(should_clear_after_alloc=False)


class PeerLink:
    """One reliable link to one peer daemon, and the QPs that use it."""

    __slots__ = ("host", "addr", "link", "qps", "up", "max_data", "failed_reason", "rx_hint", "ack_waiters",
                 "ready", "requests", "rx_addr", "rx_port", "tx_bytes", "rx_bytes", "warned", "routes")

    def __init__(self, host: PeerHost, addr: tuple[str, int], link: Link) -> None:
        self.host = host
        self.addr = addr
        self.link = link
        self.qps: set[Any] = set()  # the QueuePairs bound to this link
        self.up = True  # messages may be queued before the handshake ends
        self.failed_reason = ""
        # (QP, STag, RDMAP opcode) of the last RDMA Write or Read Response
        # segment received, or of a Send's segment that was not its last
        # (the STag: its Invalidate STag): what the compiled receive lane
        # may place next (revalidated per call; rxlane.py)
        self.rx_hint: tuple[Any, int, int] | None = None
        # the peer as the compiled read compares a datagram's source (rxlane.py)
        try:
            self.rx_addr: int = NATIVE_U32.unpack(socket.inet_aton(addr[0]))[0]
        except OSError:
            self.rx_addr = 0
        self.rx_port: int = socket.htons(addr[1])
        # (link message number, QP): an RDMA Write's last segment, queued in
        # number order; the QP may complete once the link acknowledges it
        self.ack_waiters: collections.deque[tuple[int, Any]] = collections.deque()
        # QPs with data to send on this link, served round robin while the
        # link takes more (a dict as an ordered set; scheduler.py)
        self.ready: dict[Any, None] = {}
        # Read and atomic requests queued back to back, not yet on the link
        # (``send_request``)
        self.requests: list[bytearray] = []
        # payload bytes per DDP segment: the link's largest message (what its
        # path carries, path_mtu) minus envelope + tagged header
        self.max_data = link.payload_limit - segment.TAGGED_PREFIX_LEN
        self.warned = False  # the log said once that the path carries less than --mtu
        # UDP payload bytes sent to the peer and received from it on this
        # link (what the operator's tools show; the link counts datagrams)
        self.tx_bytes = 0
        self.rx_bytes = 0
        #: path id -> (the port it leaves by, the peer's address) once the
        #: link has more paths than path 0 (``add_route``); None: one path
        self.routes: dict[int, tuple[Any, tuple[str, int]]] | None = None

    def add_route(self, path: int, port: Any, addr: tuple[str, int]) -> None:
        """Send what the link puts on ``path`` by ``port`` (a ``UdpPort``) to ``addr``."""
        if self.routes is None:
            self.routes = {0: (self.host.udp, self.addr)}
        self.routes[path] = (port, addr)

    def route_names(self, path: int) -> tuple[str, str]:
        """``path``'s local and peer address, as ``ip:port`` (``?`` for a path not known)."""
        route = (self.routes or {0: (self.host.udp, self.addr)}).get(path)
        if route is None or route[0].sock is None:
            return "?", "?"
        local = route[0].sock.getsockname()
        return f"{local[0]}:{local[1]}", f"{route[1][0]}:{route[1][1]}"

    def segment_size(self, total: int, stream: bool, untagged: bool = False) -> int:
        """The payload of each segment of a message of ``total`` bytes, tagged
        (an RDMA Write's or a Read Response's) or ``untagged`` (a Send's):
        cut evenly where that lets a stream's messages share system calls
        (``stream``: others are queued with it; :func:`equal_segment_size`),
        else as many bytes as fit, the last segment shorter, as a message
        sent alone (a ping-pong's) always is."""
        prefix = segment.UNTAGGED_PREFIX_LEN if untagged else segment.TAGGED_PREFIX_LEN
        max_data = self.max_data + segment.TAGGED_PREFIX_LEN - prefix
        if stream and self.host.udp.gso:
            return equal_segment_size(total, max_data, wire_link.OVERHEAD + prefix, 0 if untagged else EQUAL_EXTRA)
        return max_data

    def path_mtu(self, ev: PathMtu) -> None:
        """The link's largest message changed: messages are cut to it from
        now on (those already cut leave as they are: ``_fragment``)."""
        self.max_data = ev.payload - segment.TAGGED_PREFIX_LEN

    # -- queueing and sending ----------------------------------------------------
    def send(self, message: bytes | bytearray, ack_now: bool = True, ack_carrier: bool = True) -> int:
        """Queue one message on the link; return its message number
        (``ack_now``, ``ack_carrier``: as for ``Link.send``)."""
        if self.requests:
            self.flush_requests()
        return self.link.send(message, self.host.now, ack_now, ack_carrier)

    def send_alone(self, message: bytes | bytearray, ack_now: bool = True, ack_carrier: bool = True) -> int | None:
        """Send ``message`` now, in a datagram of its own, if the link would
        send it alone at the end of this pass anyway; return its number, or
        None (then nothing happened: queue it with :meth:`send`)."""
        host = self.host
        udp = host.udp
        if self.requests or udp.sock is None:
            return None
        now = host.clock()
        link = self.link
        d = link.frame_alone(message, now, ack_now)
        if d is None:
            return None
        udp.sendto(d, self.addr)
        self.tx_bytes += len(d)
        host.stats["tx_alone"] += 1
        host.handed_over(self)
        n = link.sent_alone(message, len(d), now, ack_carrier)
        if udp.refused:
            self._refused()
        return n

    def flush(self) -> bool:
        """Send what the link lets leave now (its queued requests first);
        True if anything was sent."""
        if self.requests:
            self.flush_requests()
        if self.routes is not None:
            return self._flush_paths()
        host = self.host
        udp = host.udp
        link = self.link
        gso = udp.gso
        out = (link.bursts_to_send if gso else link.datagrams_to_send)(host.now, host.clock)
        if not out or udp.sock is None:
            return False
        n = 0
        for d in out:
            n += len(d.view) if type(d) is Burst else len(d)
        self.tx_bytes += n
        if link.fragment_above:
            out = self._fragment(out)
        if gso and (len(out) > 1 or out and type(out[0]) is Burst):
            udp.send_segmented(out, self.addr)
        elif out:
            udp.send_each(out, self.addr)
        udp.sent = True
        if udp.refused:
            self._refused()
        return True

    def _flush_paths(self) -> bool:
        """``flush`` for a link of several paths: what leaves on each path by
        its own socket to its own peer address; a datagram a path's socket
        refuses as too long is that path's to learn from (``Link.datagram_refused``)."""
        host = self.host
        link = self.link
        routes = self.routes
        sent = False
        for _ in range(MAX_REFUSED_ROUNDS):
            refused = False
            for path, out in link.bursts_by_path(host.now, host.clock):
                route = routes.get(path)  # type: ignore[union-attr]
                if not out or route is None or route[0].sock is None:
                    continue
                udp, addr = route
                self.tx_bytes += sum(len(d.view) if type(d) is Burst else len(d) for d in out)
                if link.fragment_above:
                    out = self._fragment(out, udp, addr)
                if udp.gso:
                    udp.send_segmented(out, addr)
                else:
                    udp.send_each(one_per_datagram(out), addr)
                sent = True
                if udp.refused:
                    link.datagram_refused(udp.refused, host.now, path=path)
                    udp.refused = 0
                    refused = True
            if not refused:
                break
        if sent:
            host.udp.sent = True
        return sent

    def _fragment(self, out: list[bytes | Burst], udp: Any = None, addr: Any = None) -> list[bytes | Burst]:
        """Send the DATA packets of ``out`` longer than the link's path now
        carries with fragmentation allowed (messages cut before its path
        MTU fell: the link sends a message as it was cut), by ``udp`` to
        ``addr`` (default: path 0's); return the rest."""
        above = self.link.fragment_above
        rest: list[bytes | Burst] = []
        big: list[bytes | memoryview] = []
        for d in out:
            if type(d) is Burst:
                if d.size > above:
                    big.extend(d.datagrams())
                else:
                    rest.append(d)
            elif type(d) is Gathered:
                if len(d) > above:
                    big.append(bytes(d))
                else:
                    rest.append(d)  # type: ignore[arg-type]
            elif fragmentable(d, above):  # type: ignore[arg-type]
                big.append(d)  # type: ignore[arg-type]
            else:
                rest.append(d)
        if big:
            (udp or self.host.udp).send_fragmenting(big, addr or self.addr)
        return rest

    def _refused(self) -> None:
        """The kernel refused a datagram as too long for this path: tell the
        link (RFC 8899's PTB) and send what it then has, its next probe at once."""
        host = self.host
        udp = host.udp
        link = self.link
        for _ in range(MAX_REFUSED_ROUNDS):
            size = udp.refused
            if not size:
                return
            udp.refused = 0
            link.datagram_refused(size, host.now)
            out: list[Any] = link.datagrams_to_send(host.now)
            if out:
                self.tx_bytes += sum(len(d) for d in out)
                if link.fragment_above:
                    out = self._fragment(out)
                udp.send_each(out, self.addr)
        udp.refused = 0

    def send_request(self, message: bytearray) -> None:
        """Queue a Read or atomic request (as ``send(message,
        ack_carrier=False)``).  Requests queued back to back, an ORD
        window's, go on the link together as one run of equal messages
        when anything else is queued or the device sends (``flush_requests``):
        the compiled framer then frames them in one call, where each alone
        would take a packet encoded in Python."""
        self.requests.append(message)

    def flush_requests(self) -> None:
        """Put the requests ``send_request`` holds on the link, in order
        (dropped if the link has ended since: its QPs fail with it)."""
        requests = self.requests
        if not requests:
            return
        self.requests = []
        if self.link.state >= LinkState.CLOSED:
            return
        size = len(requests[0])
        if len(requests) == 1 or self.host.tx_lane is None or any(len(m) != size for m in requests):
            for m in requests:
                self.link.send(m, self.host.now, True, False)
            return
        head, slot = run_slots(size)
        buf = bytearray(len(requests) * slot)
        at = head
        for m in requests:
            buf[at:at + size] = m
            at += slot
        self.link.send_run(buf, size, len(requests), size, ack_carrier=False)

    # -- runs of segments built by the compiled send lane -------------------------
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
        if seg >= ZERO_COPY_MIN and self._gathers(ends):
            return self._send_gathered(opcode, dst_qpn, src_qpn, stag, to, src, start, count, seg, last_len, ends)
        lane = self.host.tx_lane
        segment.pack_tagged_into(lane.more, 0, dst_qpn, src_qpn, opcode, False, stag, 0)
        segment.pack_tagged_into(lane.last, 0, dst_qpn, src_qpn, opcode, True, stag, 0)
        t = lane.segments
        t.prefix, t.off_at, t.off_len, t.off = segment.TAGGED_PREFIX_LEN, segment.TO_AT, 8, to
        t.tail_len = 0
        return self._send_segments(src, start, count, last_len, ends, segment.TAGGED_PREFIX_LEN + seg)

    def _gathers(self, ends: bool) -> bool:
        """Whether a tagged run leaves from the region (zero copy): the
        device allows it, no cluster key, one path, and not a ping-pong's
        whole message, which the run sends at once (``_send_segments``)."""
        host = self.host
        return (host.zero_copy and host.udp.guard is None and self.routes is None
                and not (ends and host.eager_runs and self.link.quiet()))

    def _send_gathered(self, opcode: int, dst_qpn: int, src_qpn: int, stag: int, to: int, src: memoryview,
                       start: int, count: int, seg: int, last_len: int, ends: bool) -> int:
        """``send_tagged_run`` with each segment queued as a ``Gather``: its
        header packed here, its payload a view of ``src``."""
        link = self.link
        num = 0
        last = count - 1
        for i in range(count):
            lead = bytearray(segment.TAGGED_PREFIX_LEN)
            segment.pack_tagged_into(lead, 0, dst_qpn, src_qpn, opcode, ends and i == last, stag, (to + i * seg) & _U64)
            at = start + i * seg
            num = link.send(Gather(bytes(lead), src[at:at + (last_len if i == last else seg)]), self.host.now)
        self.host.stats["tx_gather_segments"] += count
        return num

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
        lane = self.host.tx_lane
        segment.pack_untagged_into(lane.more, 0, dst_qpn, src_qpn, opcode, False, msn, 0, inv_stag, 0)
        segment.pack_untagged_into(lane.last, 0, dst_qpn, src_qpn, opcode, True, msn, 0, inv_stag, flags)
        t = lane.segments
        t.prefix, t.off_at, t.off_len, t.off = segment.UNTAGGED_PREFIX_LEN, segment.MO_AT, 4, mo
        t.tail_len = 0 if flow_ack is None else envelope.pack_flow_ack_into(lane.tail, 0, flow_ack)
        # A Send completes on the peer's Modified ACK, which carries the
        # link's ACK too: its segments ask for no ACK at once (as queued one by one).
        return self._send_segments(src, start, count, last_len, ends, segment.UNTAGGED_PREFIX_LEN + seg, False)

    def _send_segments(self, src: memoryview, start: int, count: int, last_len: int, ends: bool, stride: int,
                       ack_now: bool = True) -> int:
        """The bodies of the segments whose headers the send lane holds,
        ``stride`` bytes each but the last, queued on the link (or, a
        ping-pong's whole message, sent at once; ``ack_now`` as for ``Link.send``)."""
        host = self.host
        lane = host.tx_lane
        ffi = lane.ffi
        prefix = lane.segments.prefix
        # the k-th body: its header, its payload and (a message's last) its tail
        last_body = prefix + last_len + (lane.segments.tail_len if ends else 0)
        # each body where its link packet will be, so the framer leaves it there
        head, slot = run_slots(stride)
        dst = lane.alloc("uint8_t[]", (count - 1) * slot + slot - stride + last_body)
        mem = ffi.from_buffer("uint8_t[]", src)
        try:
            lane.lib.udpv_tx_bodies(lane.segments, dst + head, mem + start, count, stride, last_len, ends, slot)
        finally:
            ffi.release(mem)  # no export may outlive the call: deregistration releases the view
        buf = memoryview(ffi.buffer(dst))
        link = self.link
        # A whole message on a link with nothing queued or unacknowledged (a
        # ping-pong's, of several datagrams) leaves now, the CPU is handed
        # over, and the link records it after that, as for a message of one
        # datagram (send_alone).  In a stream something is always in
        # flight, and the flush sends runs together.
        if ends and host.eager_runs and host.udp.sock is not None and link.quiet():
            now = host.clock()
            view = link.frame_run_alone(buf, stride, count, last_body, prefix, now)
            if view is not None:
                self._send_burst_now(Burst(view, stride + wire_link.OVERHEAD))
                n = link.sent_run_alone(buf, stride, count, last_body, now) + count - 1
                if host.udp.refused:
                    self._refused()  # after the bookkeeping: the link's state is as framed until then
                return n
        return link.send_run(buf, stride, count, last_body, built=prefix, ack_now=ack_now) + count - 1

    def _send_burst_now(self, burst: Burst) -> None:
        """Send a run framed alone (``Link.frame_run_alone``) and hand the CPU over."""
        host = self.host
        udp = host.udp
        if udp.gso:
            udp.send_segmented([burst], self.addr)
        else:
            udp.send_each(burst.datagrams(), self.addr)
        self.tx_bytes += len(burst.view)
        udp.sent = True
        host.stats["tx_run_alone"] += 1
        host.handed_over(self)
