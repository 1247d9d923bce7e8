"""The receive step of a pass: datagrams read, fed to their links, messages routed.

Theory of operation
-------------------
Each pass reads what waits on the UDP socket (at most ``RX_BUDGET``
buffers and ``RX_BYTE_BUDGET`` bytes, so that ACKs keep flowing while a
backlog is worked off) and feeds every buffer to the link of the peer it
came from; a new INIT from an unknown address opens a passive link (the
device decides).  With UDP_GRO one buffer may hold many datagrams of one
size, cut here.

While a peer streams, runs of datagrams go to the compiled receive lane
(``rxlane.py``); the datagrams it does not take go through the link one by
one, and whatever they deliver is dispatched at once (:meth:`Receiver.dispatch`):
a later segment must not be placed before an earlier message has had its
effect (a Send with Invalidate, say).  Dispatch routes DDP and FLOW
messages to their QP (checked against the link and the peer QP) and CM
messages to the connection manager, and sets the link's hint for the lane.

At most ``rx_dispatch_budget`` datagrams of one buffer take the Python path
in a pass; the rest is kept (``rest``) for the next pass, which finishes it
before it reads the socket again.  The pass in between sends the answers
to the first part (atomic and Read responses, ACKs), so the peer works on
those while we work on the rest: otherwise a batch of requests and a batch
of answers alternate between two daemons that each idle half the time.

When the lane is armed (``ReceiveLane.arm``), the pass reads the socket
through it (:meth:`Receiver.read_armed`): one compiled call reads the
datagram and places it.

A device with several addresses (``paths.py``) has a socket for each; the
pass reads them together (:meth:`Receiver.read_paths`), the next buffer
always from the socket whose first datagram comes next in its link's
stream, so that a link's stretches on different paths come in order.
The first socket and a peer's first address are each link's path 0, found
by the peer's address as ever; every other (socket, peer address) pair is
a path of its own, found in the path map, and what comes on it is fed
to its link as the first socket's is, runs to the lane, with its path id
(``Link.data_run_received(..., path=p)``).  A datagram on a pair the map
does not know may open a path: the device decides (``Device._new_path``).
"""

from __future__ import annotations

import collections
import errno
import logging
import socket
import time
from typing import Any, Callable

from ..transport.link import LinkState
from ..wire import envelope, segment
from ..wire.envelope import Kind
from ..wire.link import PacketType
from ..wire.errors import WireError
from .opcodes import ANSWERED_BY_DAEMON, FLOW_ACK, OP_ATOMIC_RESPONSE, OP_READ_RESPONSE, OP_WRITE, RECEIVING
from .peer import PeerLink
from .rxlane import SEND_CTRL, SEND_ENDS_IN_LANE, WHOLE_MAX, ReceiveLane
from .scheduler import QPScheduler
from .udp import NATIVE_U32, RX_BUF, UdpPort, arrival

log = logging.getLogger("udpverbs.daemon")

#: datagram buffers one pass reads before it dispatches, ACKs and sends:
#: well under a link's receive window (more would be dropped as out of
#: window before the drain) and small enough that ACKs keep flowing while
#: a backlog is worked off (a 4 MB socket buffer read in one pass held
#: every ACK past the sender's RTO)
RX_BUDGET = 128
#: ... and at most this many bytes: 128 buffers of 64 KB would be several
#: milliseconds of copying, CRC and placement before the pass's ACK
RX_BYTE_BUDGET = 1 << 20
#: read_armed: the arming no longer held, and the socket has something to read
_RX_READY = 2
_LINK_ESTABLISHED = LinkState.ESTABLISHED
#: a link packet's type byte (``wire/link.py``) for INIT, which opens a link
_INIT = int(PacketType.INIT)
_DATA = int(PacketType.DATA)
#: what ``Receiver._head`` peeks at: a link header up to its sequence number
_HEAD_LEN = 12
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT
_U32 = 0xFFFFFFFF


class Receiver:
    """The receive step (see the module docstring)."""

    def __init__(self, udp: UdpPort, links: dict[tuple[str, int], PeerLink], qps: dict[int, Any],
                 scheduler: QPScheduler, lane: ReceiveLane | None, stats: collections.Counter[str],
                 dispatch_budget: int, open_passive: Callable[[tuple[str, int], bytes], PeerLink | None]) -> None:
        self.udp = udp
        self.links = links
        self.qps = qps
        self.sched = scheduler
        self.lane = lane
        self.stats = stats
        #: datagrams of one buffer the Python path takes in a pass (0: no limit)
        self.dispatch_budget = dispatch_budget
        self.open_passive = open_passive
        self.cm: Any = None  # the connection manager (set by it, through the device)
        self.groups: Any = None  # the process groups (likewise)
        #: the part of a GRO buffer a pass left for the next: (link, buffer,
        #: offset, segment size, arrival time, path)
        self.rest: tuple[PeerLink, bytes, int, int, float, int] | None = None
        #: the link that last received, to arm the lane for; the links an
        #: armed read fed, for the pass's dispatch
        self.arm_link: PeerLink | None = None
        self.touched: set[PeerLink] = set()
        #: (socket index, port) of every socket but the first (None: one socket)
        self.others: list[tuple[int, UdpPort]] | None = None
        self.paths: Any = None  # the path map (paths.PathMap) with several sockets
        self.new_path: Callable[[int, tuple[str, int], bytes], tuple[PeerLink, int] | None] | None = None

    def more_ports(self, ports: list[UdpPort], paths: Any,
                   new_path: Callable[[int, tuple[str, int], bytes], tuple[PeerLink, int] | None]) -> None:
        """Read ``ports[1:]`` too, each pass; ``paths`` maps their datagrams
        to links and paths, ``new_path(index, addr, datagram)`` opens a path
        for a pair it does not know (or answers None)."""
        self.others = list(enumerate(ports))[1:]
        self.paths = paths
        self.new_path = new_path

    # -- the step -----------------------------------------------------------------
    def step(self, now: float) -> bool:
        """The pass's receive step; True if anything was read."""
        if self.rest is not None:
            # Finish the buffer a pass left before reading the socket again:
            # what it holds arrived first.
            self.receive_rest(now)
            return True
        udp = self.udp
        if udp.sock is None:
            return False
        lane = self.lane
        rx = udp.rx_epoll
        got = self.read_armed(now) if lane is not None and lane.armed is not None \
            else _RX_READY if rx is None or rx.poll(0) else 0
        if not got:
            return self.others is not None and self.read_paths(now, set(), now - time.time())
        touched = self.touched  # the armed read's link, if it read
        self.touched = set()
        # now - realtime: converts a kernel stamp to our clock (computed per
        # pass, so a step of the wall clock corrupts one pass at most)
        rt_to_now = now - time.time()
        if self.others is not None:
            # the rest from every socket, in stream order (unless the armed
            # read left part of a buffer for the next pass)
            return self.read_paths(now, touched, rt_to_now) if self.rest is None else self.dispatch_all(touched)
        # After the armed read, the loop asks the epoll first (and reads
        # nothing while that read left part of a buffer for the next pass).
        budget = RX_BUDGET if got == _RX_READY else 0 if self.rest is not None else RX_BUDGET - 1
        byte_budget = RX_BYTE_BUDGET
        while budget > 0 and byte_budget > 0:
            if budget < RX_BUDGET and rx is not None and not rx.poll(0):
                break  # drained: asking is far cheaper than a recvmsg that fails
            budget -= 1
            buffer = udp.receive(now, rt_to_now)
            if buffer is None:
                break
            data, addr, seg, arrived = buffer
            byte_budget -= len(data)
            if seg < 0:
                continue
            if seg < len(data):
                budget -= len(data) // seg
            self.received(addr, data, seg, now, arrived, touched)
            if self.rest is not None:
                break  # the rest of that buffer first, next pass
        return self.dispatch_all(touched)

    def dispatch_all(self, touched: set[PeerLink]) -> bool:
        """Dispatch what every link in ``touched`` (those that received in
        this pass) delivered; True if there was any such link."""
        if not touched:
            return False
        for pl in touched:
            for msg in pl.link.drain_received():
                self.dispatch(pl, msg)
        return True

    def read_paths(self, now: float, touched: set[PeerLink], rt_to_now: float) -> bool:
        """With several sockets: read them all, together within the pass's
        budgets, the next buffer always from the socket whose first datagram
        comes first in its link's stream (``_head``), then dispatch what
        every link that received in this pass delivered (``touched``); True
        if any link received.

        A link's paths carry stretches of one stream, each in order: read
        socket by socket, a stretch that left after one on another path
        would often come first, and a hole keeps every datagram behind it
        out of the compiled lane (``Link.run_receivable``) until it closes."""
        ports = dict(self.others)  # type: ignore[arg-type]
        ports[0] = self.udp
        budget, byte_budget = RX_BUDGET, RX_BYTE_BUDGET
        heads = {}
        for index, udp in ports.items():
            key = self._head(index, udp)
            if key is not None:
                heads[index] = key
        while heads and self.rest is None:
            index = min(heads, key=heads.__getitem__)
            udp = ports[index]
            buffer = udp.receive(now, rt_to_now)
            key = None
            if buffer is not None:
                data, addr, seg, arrived = buffer
                budget -= 1 + (len(data) // seg if 0 < seg < len(data) else 0)
                byte_budget -= len(data)
                if seg > 0:
                    if index:
                        self.received_on(index, addr, data, seg, now, arrived, touched)
                    else:
                        self.received(addr, data, seg, now, arrived, touched)
                if budget <= 0 or byte_budget <= 0:
                    break
                key = self._head(index, udp)
            if key is None:
                del heads[index]
            else:
                heads[index] = key
        return self.dispatch_all(touched)

    def _head(self, index: int, udp: UdpPort) -> int | None:
        """How far ahead of its link's next expected message the first
        datagram waiting on socket ``index`` lies (a peek; 0 for anything
        but a link's DATA), or None if nothing waits."""
        rx = udp.rx_epoll
        if udp.sock is None or rx is not None and not rx.poll(0):
            return None
        try:
            head, addr = udp.sock.recvfrom(_HEAD_LEN, _PEEK)
        except BlockingIOError:
            return None
        except OSError:
            return 0  # (the read that follows counts it)
        if len(head) < _HEAD_LEN or head[1] != _DATA:
            return 0
        pl = self.links.get(addr) if index == 0 else None
        if pl is None:
            found = self.paths.get(index, addr)
            if found is None:
                return 0
            pl = found[0]
        r = pl.link.receiver
        return (int.from_bytes(head[8:12], "big") - r.peer_isn - r.rcv_nxt) & _U32

    def received_on(self, index: int, addr: tuple[str, int], data: bytes, seg: int, now: float, arrived: float,
                    touched: set[PeerLink]) -> None:
        """Feed a buffer read on socket ``index`` (or on the first, from an
        address that is no link's path 0) from ``addr`` to the path it came
        on: known, or opened now; dropped and counted if neither."""
        if self.lane is not None:
            self.lane.armed = None
        found = self.paths.get(index, addr)
        if found is None:
            start = 0
            while True:  # judged datagram by datagram, as an unknown peer's
                found = self.new_path(index, addr, data[start:start + seg])  # type: ignore[misc]
                if found is not None or start + seg >= len(data):
                    break
                start += seg
            if found is None:
                return
            data = data[start:]
        pl, path = found
        pl.rx_bytes += len(data)
        self.receive(pl, data, seg, now, arrived, 0, 0, path)
        touched.add(pl)

    def received(self, addr: tuple[str, int], data: bytes, seg: int, now: float, arrived: float,
                 touched: set[PeerLink]) -> None:
        """Feed a buffer read from ``addr`` to its link (``receive``), or
        to a new passive one; add the link to ``touched``."""
        if self.lane is not None:
            self.lane.armed = None  # set up for what the link expected before this
        pl = self.links.get(addr)
        if pl is None and self.paths is not None and (self.paths.get(0, addr) is not None
                                                      or len(data) > 1 and data[1] != _INIT):
            # a peer's other address: a path to our first one (an INIT opens a link instead)
            self.received_on(0, addr, data, seg, now, arrived, touched)
            return
        if pl is None:
            # Each datagram from an unknown peer is judged (and
            # counted) alone until one opens a link.
            start = 0
            while True:
                pl = self.open_passive(addr, data[start:start + seg])
                if pl is not None or start + seg >= len(data):
                    break
                start += seg
            if pl is None:
                return
            if start:
                data = data[start:]
        self.arm_link = pl
        pl.rx_bytes += len(data)
        self.receive(pl, data, seg, now, arrived)
        touched.add(pl)

    def read_armed(self, now: float) -> int:
        """Read the socket once through the armed lane: 1 if something was
        read (the caller reads on while the socket has more), 0 if nothing
        was; if the arming no longer holds, ``_RX_READY`` when the socket
        has something for the usual way to read, else 0."""
        lane = self.lane
        pl, setup, mem, rcv_nxt, version = lane.armed  # type: ignore[union-attr,misc]
        link = pl.link
        # (a link leaves the table only when it ends: its state covers that)
        if setup.qp.state not in RECEIVING or link.receiver.rcv_nxt != rcv_nxt or link.state != _LINK_ESTABLISHED \
                or lane.stags.version != version:
            lane.armed = None
            self.stats["rx_armed_stale"] += 1
            return _RX_READY if self.udp.readable() else 0
        rx = lane.recv
        if lane.cqe_armed:
            k = lane.read_send(setup.qp.recv_cq, mem)  # and the receive's CQE
        else:
            k = lane.lib.udpv_rx_recv_run(rx, lane.run, lane.buf, RX_BUF, mem)
        if k < 0:
            if rx.err == errno.EAGAIN or rx.err == errno.EINTR:
                return 0  # still armed
            lane.armed = None
            self.stats["rx_oserror"] += 1  # e.g. ICMP port unreachable reported on the socket
            return 1
        lane.armed = None
        self.stats["rx_armed"] += 1
        n = rx.n
        if rx.truncated:
            self.stats["rx_truncated"] += 1
            return 1
        arrived = now
        if rx.ts_sec:
            arrived = arrival(rx.ts_sec + rx.ts_nsec * 1e-9 + (now - time.time()), now)
        seg = rx.seg
        if seg < n:
            self.stats["rx_gro_batches"] += 1
        if not rx.from_peer:
            addr = (socket.inet_ntoa(NATIVE_U32.pack(rx.src_addr)), socket.ntohs(rx.src_port))
            self.received(addr, lane.ffi.buffer(lane.buf, n)[:], seg, now, arrived, self.touched)
            return 1
        self.touched.add(pl)
        self.arm_link = pl
        pl.rx_bytes += n
        # From the armed peer: account for what the lane took, then the rest
        # as ``receive`` goes on after a lane call.
        data = None
        if k == 0 or k * seg < n or setup.request is not None:
            # the Python path, or a request's answer, reads the datagrams:
            # a copy, since the next read reuses the buffer
            data = lane.ffi.buffer(lane.buf, n)[:]  # type: ignore[union-attr]
        if k:
            used = lane.run_taken(pl, setup, k, data, 0, n, seg, now, arrived)  # type: ignore[union-attr]
        else:
            # What the lane did not take goes the Python path, as in receive.
            pl.link.datagram_received(memoryview(data)[:seg], now, arrived)  # type: ignore[arg-type]
            used = seg
            for msg in pl.link.drain_received():
                self.dispatch(pl, msg)
        if used < n:
            # the requests the lane took count against the pass's budget
            spent = k if k and setup.op in ANSWERED_BY_DAEMON else 0
            self.receive(pl, data, seg, now, arrived, used, spent)  # type: ignore[arg-type]
        return 1

    def receive_rest(self, now: float) -> None:
        """Go on with the buffer an earlier pass left (``rest``), within the budget again."""
        assert self.rest is not None
        pl, data, off, seg, arrived, path = self.rest
        self.rest = None
        if self.lane is not None:
            self.lane.armed = None
        if self.links.get(pl.addr) is not pl:
            return  # the link went away in between: what it held goes with it
        self.receive(pl, data, seg, now, arrived, off, 0, path)
        for msg in pl.link.drain_received():
            self.dispatch(pl, msg)

    def receive(self, pl: PeerLink, data: bytes, seg: int, now: float, arrived: float, off: int = 0,
                spent: int = 0, path: int = 0) -> None:
        """Feed one received buffer to ``pl``'s link from offset ``off``: a
        datagram, or (``seg`` < its length) datagrams of ``seg`` bytes
        coalesced by GRO; runs of them to the lane where it takes them.
        ``spent``: requests of this buffer the armed read took already;
        ``path``: the link's path it came on.  What the dispatch budget
        leaves is kept in ``rest``."""
        link = pl.link
        n = len(data)
        # Without a hint, a GRO buffer still goes datagram by datagram where
        # the lane exists: the Python path's first segment of a Send (or of
        # a Read's responses) sets the hint for the rest of the buffer.
        if n == 0 or pl.rx_hint is None and (seg >= n or self.lane is None):
            if seg >= n:
                link.datagram_received(data, now, arrived, path)
            else:
                view = memoryview(data)
                for at in range(off, n, seg):
                    link.datagram_received(view[at:at + seg], now, arrived, path)
            return
        budget = (self.dispatch_budget or n) - spent
        if spent and budget <= 0:
            self.rest = (pl, data, off, seg, arrived, path)
            return
        view = memoryview(data)
        lane = self.lane
        while off < n:
            hint = pl.rx_hint
            if hint is not None:
                # requests as many as the budget has left; anything else, no limit
                answered = hint[2] in ANSWERED_BY_DAEMON
                limit = budget if answered else WHOLE_MAX
                used = lane.place_run(pl, data, off, seg, now, arrived, limit, path)  # type: ignore[union-attr]
                off += used
                if off >= n:
                    break
                if used and lane.run.ended:  # type: ignore[union-attr]
                    # A message ended the run (a Send, a Read, requests):
                    # the next may be another, for the lane again.  A
                    # request's answer is this pass's work, as on the
                    # Python path, so each counts against the budget.
                    if answered:
                        budget -= -(-used // seg)
                        if budget <= 0:
                            self.rest = (pl, data, off, seg, arrived, path)
                            return
                    continue
            link.datagram_received(view[off:off + seg], now, arrived, path)
            off += seg
            for msg in link.drain_received():
                self.dispatch(pl, msg)
            budget -= 1
            if not budget and off < n:
                self.rest = (pl, data, off, seg, arrived, path)
                return

    # -- routing a delivered message ----------------------------------------------------
    def dispatch(self, pl: PeerLink, msg: bytes) -> None:
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
                self.sched.qp_changed(qp)
                if kind == Kind.DDP:
                    self._segment(pl, qp, env, hdr, payload, msg)
                else:
                    qp.on_flow(payload)  # what it completes, the completion step reports
            elif kind == Kind.CM and self.cm is not None:
                self.cm.on_message(pl, payload)
            elif kind >= Kind.LOCK and self.groups is not None:  # LOCK, BARRIER, GROUP
                self.groups.on_message(pl, kind, payload)
            else:
                self.stats["rx_unhandled_kind"] += 1
        except Exception:  # an engine bug must not take the daemon down
            self.stats["rx_exception"] += 1
            log.exception("error handling a message from %s:%d", *pl.addr)

    def _segment(self, pl: PeerLink, qp: Any, env: Any, hdr: Any, payload: memoryview, msg: bytes) -> None:
        """A DDP segment for ``qp``: to its responder, then the lane's hint
        for what may come next from this link."""
        raw = memoryview(msg)[envelope.ENVELOPE_LEN:]
        if env.flags & FLOW_ACK:
            qp.on_flow_ack(envelope.flow_ack_msn(msg))
            raw = raw[:-envelope.FLOW_ACK_LEN]
        qp.on_segment(hdr, payload, raw, env.flags)
        op = hdr.opcode
        if op == OP_READ_RESPONSE or op == OP_ATOMIC_RESPONSE:
            self.sched.complete_done(qp)  # as the lane does
        if op in ANSWERED_BY_DAEMON:
            if self.lane is not None:
                pl.rx_hint = (qp, 0, op)  # the next request
            return
        sched = self.sched
        sched.delivered = True
        sched.delivered_to = qp
        if self.lane is None:
            return
        if op == OP_WRITE or op == OP_READ_RESPONSE:
            pl.rx_hint = (qp, hdr.stag, op)
        elif op == OP_ATOMIC_RESPONSE:
            pl.rx_hint = (qp, 0, op)  # the next one
        elif op in SEND_CTRL and (qp.rx_recv is not None if not hdr.last else op in SEND_ENDS_IN_LANE):
            # the rest of this Send, or the next one
            pl.rx_hint = (qp, hdr.inv_stag, op)
