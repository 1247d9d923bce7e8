"""The device's UDP socket: options, reading one buffer, sending runs of datagrams.

Theory of operation
-------------------
One non-blocking UDP socket per device.  Where the kernel allows, it
batches both ways: a run of equal-size datagrams leaves in one ``sendmsg``
with UDP_SEGMENT (GSO), up to 64 at a time, and arrives coalesced in one
``recvmsg`` with UDP_GRO, one system call for many datagrams instead of one
each.  Both are optional: without them every datagram is its own system
call, and a kernel that refuses a GSO send is not asked again.  Arrival
times come from the kernel (SO_TIMESTAMPNS), so that a link's RTT samples
measure the path between two kernels, not how long a datagram waited for
a daemon that was not running.

With a cluster key (``clusterkey.py``) the port seals every datagram it
sends and opens every buffer it reads: one call into its ``guard`` on each
path, next to the socket, so nothing can leave or come in around it.  A
UDP_SEGMENT run is sealed datagram by datagram (each segment carries its
own trailer), and runs are kept short enough that the trailers still fit.

Send errors are counters, never exceptions: a datagram the kernel would not
take (a full buffer, ICMP errors reported on the socket) is retransmitted
by its link.  ``sent`` tells the data loop that the pass sent something.

Every datagram leaves with DF set (IP_PMTUDISC_PROBE: whatever the kernel
has learnt of the path), so a path that carries less drops it whole rather
than fragmenting it: each link finds what its path carries itself
(``transport/pmtud.py``).  A datagram longer than this host's interface
takes is refused (EMSGSIZE, counted ``tx_too_long``); ``refused`` keeps
the shortest such for the link that sent it, as RFC 8899's PTB.  Messages
a link cut before its path MTU fell go with fragmentation allowed
(:meth:`UdpPort.send_fragmenting`).
"""

from __future__ import annotations

import collections
import errno
import logging
import select
import socket
import struct
import sys
from typing import Any

from ..transport.link import Burst, Gathered, one_per_datagram
from ..wire.auth import TRAILER_LEN

log = logging.getLogger("udpverbs.daemon")

# Linux UDP segmentation offload (include/uapi/linux/udp.h); the socket
# module of Python 3.11 does not name them.
SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
#: most datagrams one UDP_SEGMENT send may carry (UDP_MAX_SEGMENTS) and the
#: bytes they may add up to (one IP datagram's worth, with room for headers)
GSO_MAX_SEGMENTS = 64
GSO_MAX_BYTES = 65000
#: arrival time of a datagram at the host (asm-generic/socket.h,
#: SO_TIMESTAMPNS_OLD: a native struct timespec, CLOCK_REALTIME)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@qq")
_RX_CMSG_SPACE = socket.CMSG_SPACE(4) + socket.CMSG_SPACE(_TIMESPEC.size)
# A plain int: MSG_* are IntFlag members, and IntFlag's | and & cost
# microseconds per received buffer.
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
_GSO_REFUSED = (errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP)
# DF on every datagram (linux/in.h): IP_PMTUDISC_PROBE sets it and ignores
# the route's learnt path MTU; IP_PMTUDISC_DONT lets IP fragment.
IP_MTU_DISCOVER = 10
IP_PMTUDISC_DONT = 0
IP_PMTUDISC_PROBE = 3
#: the largest buffer one receive reads (a GRO batch is at most 64 KiB)
RX_BUF = 1 << 16
#: socket buffer sizes asked for (the kernel may grant less)
SOCKET_BUFFER_BYTES = 4 << 20
#: an IPv4 address or a port as the compiled armed read holds them (host byte order words)
NATIVE_U32 = struct.Struct("=I")
#: what :meth:`UdpPort.receive` answers for a buffer with nothing to take
#: (an error, or truncated): its length, counted against the pass's budget
_NOTHING = b""


def arrival(stamp: float, now: float) -> float:
    """A kernel arrival stamp on our clock, trusted only between a second
    ago and ``now`` (a wall-clock step between the two reads, a stamp the
    kernel did not set)."""
    return stamp if now - 1.0 < stamp <= now else now


def _count(buffers: list[bytes | memoryview], size: int) -> int:
    """The datagrams ``buffers`` make, each cut into ``size``-byte ones."""
    return sum(-(-len(b) // size) for b in buffers)


class UdpPort:
    """The device's UDP socket (None until :meth:`bind`), and how it sends and reads."""

    def __init__(self, stats: collections.Counter[str]) -> None:
        self.stats = stats
        self.sock: socket.socket | None = None
        self.rx_epoll: select.epoll | None = None  # the socket alone (bind); None: just try to read
        self.gso = False  # UDP_SEGMENT sends (set by bind; dropped if the kernel refuses one)
        self.gro = False  # UDP_GRO receives (set by bind)
        self.rx_stamps = False  # SO_TIMESTAMPNS arrival times (set by bind)
        self.sent = False  # something was sent since the data loop last cleared this
        #: the cluster key's guard (clusterkey.Guard): None, or it seals and opens every datagram
        self.guard: Any = None
        #: the most bytes a UDP_SEGMENT run may add up to before it is sealed
        self.gso_max_bytes = GSO_MAX_BYTES
        self.df = False  # datagrams leave with DF set (set by bind)
        #: the shortest datagram (as its link built it, before any seal) the
        #: kernel refused as too long since the sender last looked; 0: none
        self.refused = 0
        self._seal_len = 0  # bytes a seal adds to each datagram

    def bind(self, addr: str, port: int, batching: bool) -> tuple[str, int]:
        """Bind to ``(addr, port)`` (0: any free port) and set the socket up;
        ``batching``: try UDP_SEGMENT and UDP_GRO.  Returns the address bound.

        Raises:
            OSError: the address cannot be bound (EADDRINUSE: another daemon has it).
        """
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((addr, port))
            s.setblocking(False)
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                try:
                    s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
                except OSError:
                    pass
        except BaseException:
            s.close()
            raise
        self.sock = s
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            self.rx_stamps = True
        except OSError:
            log.warning("no SO_TIMESTAMPNS here: RTT samples include this daemon's scheduling delay")
        try:
            s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)
            self.df = True
        except OSError:
            log.warning("cannot set DF here: datagrams larger than a path carries are fragmented")
        if batching:
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
        # "Anything to read?" for every pass: epoll_wait(0) on the socket
        # alone is several times cheaper than a recvmsg that fails with
        # EAGAIN (and its exception), a large part of an idle pass.
        self.rx_epoll = select.epoll()
        self.rx_epoll.register(s.fileno(), select.EPOLLIN)
        return s.getsockname()  # type: ignore[no-any-return]

    def seal_with(self, guard: Any) -> None:
        """Seal every datagram sent and open every buffer read with ``guard``
        (a ``clusterkey.Guard``), leaving room in each UDP_SEGMENT run for
        its datagrams' trailers."""
        self.guard = guard
        self.gso_max_bytes = GSO_MAX_BYTES - GSO_MAX_SEGMENTS * TRAILER_LEN
        self._seal_len = TRAILER_LEN

    def receive_buffer_bytes(self) -> int:
        """The socket's receive buffer as the kernel granted it."""
        assert self.sock is not None
        return self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)

    def close(self) -> None:
        """Close the socket (safe twice)."""
        if self.rx_epoll is not None:
            self.rx_epoll.close()
            self.rx_epoll = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    # -- reading ------------------------------------------------------------------
    def readable(self) -> bool:
        """Whether a datagram waits (True when the socket cannot be asked: just try)."""
        rx = self.rx_epoll
        return rx is None or bool(rx.poll(0))

    def receive(self, now: float, rt_to_now: float) -> tuple[bytes, Any, int, float] | None:
        """Read one buffer: ``(data, source address, datagram size, arrival
        time)``, where a GRO batch holds datagrams of that size back to back
        (the last may be shorter); None when nothing waits.  Datagram size
        -1: nothing to take from this buffer (an error, or a truncated
        buffer: counted), ``data`` then being what it cost the pass.
        ``rt_to_now`` converts a kernel stamp (wall clock) to ``now``'s clock.
        """
        sock = self.sock
        assert sock is not None
        try:
            if self.gro or self.rx_stamps:
                data, anc, msg_flags, addr = sock.recvmsg(RX_BUF, _RX_CMSG_SPACE)
            else:
                data, addr = sock.recvfrom(RX_BUF)
                if self.guard is not None:
                    return self.guard.open(data, addr, len(data), now)  # type: ignore[no-any-return]
                return data, addr, len(data), now
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:  # e.g. ICMP port unreachable reported on the socket
            self.stats["rx_oserror"] += 1
            return _NOTHING, None, -1, now
        if msg_flags & _TRUNCATED:
            # Larger than any datagram we send, or a GRO size we cannot read
            # (so neither can we split the buffer).
            self.stats["rx_truncated"] += 1
            return data, addr, -1, now
        seg, arrived = 0, now
        for level, kind, value in anc:
            if level == SOL_UDP and kind == UDP_GRO and len(value) >= 4:
                seg = int.from_bytes(value[:4], sys.byteorder)
            elif level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(value) >= _TIMESPEC.size:
                sec, nsec = _TIMESPEC.unpack_from(value)
                arrived = arrival(sec + nsec * 1e-9 + rt_to_now, now)
        # Coalesced by GRO: equal-size datagrams back to back (the last may
        # be shorter), the size in the control message.
        if 0 < seg < len(data):
            self.stats["rx_gro_batches"] += 1
        else:
            seg = len(data)
        if self.guard is not None:
            return self.guard.open(data, addr, seg, arrived)  # type: ignore[no-any-return]
        return data, addr, seg, arrived

    # -- sending --------------------------------------------------------------------
    def _too_long(self, size: int, count: int = 1) -> None:
        """The kernel refused ``count`` datagrams of ``size`` bytes (sealed) as too long."""
        self.stats["tx_too_long"] += count
        size -= self._seal_len
        if not self.refused or size < self.refused:
            self.refused = size

    def sendto(self, datagram: bytes | memoryview, addr: tuple[str, int]) -> None:
        """Send one datagram now (errors counted: its link retransmits it)."""
        if self.guard is not None:
            datagram = self.guard.seal(datagram, addr)
        try:
            self.sock.sendto(datagram, addr)  # type: ignore[union-attr]
        except (BlockingIOError, InterruptedError):
            self.stats["tx_dropped"] += 1
        except OSError as e:
            if e.errno == errno.EMSGSIZE:
                self._too_long(len(datagram))
            else:
                self.stats["tx_oserror"] += 1
        self.sent = True

    def send_fragmenting(self, out: list[bytes | memoryview], addr: tuple[str, int]) -> None:
        """One ``sendto`` per datagram, IP allowed to fragment them (DF
        clear): messages a link cut before its path MTU fell, which it
        must still deliver as they are."""
        sock = self.sock
        assert sock is not None
        if self.df:
            sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DONT)
        try:
            self.send_each(out, addr)
        finally:
            if self.df:
                sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_PROBE)
        self.stats["tx_fragmenting"] += len(out)

    def send_each(self, out: list[bytes | memoryview | Gathered], addr: tuple[str, int]) -> None:
        """One ``sendto`` per datagram (a :class:`Gathered` one: one ``sendmsg`` of its parts)."""
        sock = self.sock
        assert sock is not None
        if self.guard is not None:
            # A seal covers the whole datagram: a gathered one is joined first.
            out = self.guard.seal_each([bytes(d) if type(d) is Gathered else d for d in out], addr)
        sendto = sock.sendto
        for d in out:
            try:
                if type(d) is Gathered:
                    sock.sendmsg(d.parts, (), 0, addr)  # type: ignore[union-attr]
                    self.stats["tx_gathered"] += 1
                else:
                    sendto(d, addr)
            except (BlockingIOError, InterruptedError):
                self.stats["tx_dropped"] += 1  # the link retransmits it
            except OSError as e:
                if e.errno == errno.EMSGSIZE:
                    self._too_long(len(d))
                else:
                    self.stats["tx_oserror"] += 1

    def send_segmented(self, out: list[bytes | Burst], addr: tuple[str, int]) -> None:
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
            t = type(out[i])
            if t is Burst:
                i = self._send_bursts(out, i, addr)
            elif t is Gathered:
                # a datagram in parts is one sendmsg of its own (a large
                # payload read from registered memory: nothing to join it with)
                self.send_each(out[i:i + 1], addr)
                i += 1
            else:
                i = self._send_loose(out, i, addr)
            if i < 0:
                return

    def _send_bursts(self, out: list[Any], i: int, addr: tuple[str, int]) -> int:
        """``send_segmented`` for the :class:`Burst` at ``out[i]`` and the
        bursts that may join its sendmsg; returns where to go on (-1: GSO
        failed, the rest went one by one)."""
        first = out[i]
        view, size = first.view, first.size
        step = max(1, min(GSO_MAX_SEGMENTS, self.gso_max_bytes // size)) * size
        total = len(view)
        n = len(out)
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
            if not self.send_run([b.view for b in out[i:j]], size, addr):
                self.send_each(one_per_datagram(out[j:]), addr)
                return -1
            return j
        for at in range(0, total, step):
            if not self.send_run([view[at:at + step]], size, addr):
                self.send_each(one_per_datagram([Burst(view[at + step:], size), *out[i + 1:]]), addr)
                return -1
        return i + 1

    def _send_loose(self, out: list[Any], i: int, addr: tuple[str, int]) -> int:
        """``send_segmented`` for the datagrams queued one by one from
        ``out[i]``, grouped into one run; returns where to go on (-1 as
        for ``_send_bursts``)."""
        size = len(out[i])
        n = len(out)
        j = i + 1
        total = size
        while j < n and j - i < GSO_MAX_SEGMENTS:
            d = out[j]
            if type(d) is Burst or type(d) is Gathered:
                break
            k = len(d)
            if k > size or total + k > self.gso_max_bytes:
                break
            total += k
            j += 1
            if k < size:
                break  # a shorter datagram can only end a run
        if not self.send_run(out[i:j], size, addr):
            self.send_each(one_per_datagram(out[j:]), addr)
            return -1
        return j

    def send_run(self, buffers: list[bytes | memoryview], size: int, addr: tuple[str, int]) -> bool:
        """Send ``buffers`` (datagrams of ``size`` bytes, the last may be
        shorter, in one or more buffers) by one UDP_SEGMENT sendmsg, or by
        sendto if they are one datagram.  False: GSO is off from now on and
        the caller sends the rest one by one (this run is sent)."""
        sock = self.sock
        assert sock is not None
        stats = self.stats
        plain, plain_size = buffers, size
        if self.guard is not None:
            buffers, size = self.guard.seal_run(buffers, size, addr)
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
                self.send_each([d for b in plain for d in Burst(memoryview(b), plain_size).datagrams()], addr)
                return self.gso
            if e.errno == errno.EMSGSIZE:
                self._too_long(size, _count(buffers, size))  # larger than this route takes: the link learns
            else:
                stats["tx_oserror"] += _count(buffers, size)
        return True
