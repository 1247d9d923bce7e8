"""The device's egress through a bad network on purpose (``udpverbsd --impair SPEC``).

Theory of operation
-------------------
:class:`ImpairedSocket` stands in for the UDP socket on the send side
(it is ``UdpPort.sock`` while impairment is on): it takes the two calls
``UdpPort`` sends with, ``sendto`` and ``sendmsg`` (a UDP_SEGMENT run, cut
here into its datagrams, as the kernel would cut it), offers each datagram
to a ``transport.impair.Impairment``, and sends what the model releases,
runs of equal datagrams again in one UDP_SEGMENT ``sendmsg``.  Everything
else (reading, options, ``fileno``, ``close``) is the socket's own.  It is the very last step before the socket, so whatever
the daemon put into a datagram (its CRC, any authentication) is what a
corrupted bit damages, as on a real wire.

With ``start`` / ``stop`` in the spec, datagrams sent outside that window
(seconds since the socket was impaired, i.e. since the daemon started) go
straight to the socket: a network that fails for a while, mid-transfer.

Held datagrams (delay, jitter, reordering, a rate) leave from the data
loop: each pass calls :meth:`ImpairedSocket.release`, and the device's
``next_deadline`` includes :meth:`ImpairedSocket.next_deadline`, so the loop
does not sleep past one.  Nothing here raises into the send path: a
datagram the kernel will not take is counted as the socket's own errors
are (its link retransmits it), and a failure of the model drops the
datagram and is counted (``impair_errors``).
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from typing import Any, Callable, Sequence

from ..transport.impair import Impairment, Released
from .udp import GSO_MAX_BYTES, GSO_MAX_SEGMENTS, SOL_UDP, UDP_SEGMENT

log = logging.getLogger("udpverbs.daemon")

#: a UDP_SEGMENT send the kernel will not cut (as ``UdpPort.send_run`` reads it)
_GSO_REFUSED = (errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP)


class ImpairedSocket:
    """The send side of the device's socket, through an impairment model.

    Takes: the socket, the model, the device's clock and its counters.
    """

    def __init__(self, sock: socket.socket, model: Impairment, clock: Callable[[], float],
                 stats: Any, gso: bool) -> None:
        self.sock = sock
        # the receive path's calls, bound once (not looked up per read)
        self.recvmsg = sock.recvmsg
        self.recvfrom = sock.recvfrom
        self.fileno = sock.fileno
        #: release runs of datagrams by UDP_SEGMENT, as the device sends them
        self.gso = gso
        self.model = model
        self.clock = clock
        self.stats = stats
        # the window the model applies in, on the device's clock
        t0 = clock()
        self.start, self.stop = t0 + model.spec.start_s, t0 + model.spec.stop_s

    def __getattr__(self, name: str) -> Any:
        """The socket's own, for everything but sending."""
        return getattr(self.sock, name)

    # -- what UdpPort calls in place of the socket's --------------------------------
    def sendto(self, data: bytes | bytearray | memoryview, addr: tuple[str, int]) -> int:
        """Offer one datagram; send what is due.  Never raises but outside
        the window, where it is the socket's own sendto."""
        now = self.clock()
        if not self.start <= now < self.stop:
            return self.sock.sendto(data, addr)
        try:
            self.model.offer(data, now, addr)
        except Exception:
            self._failed()
            return 0
        self.release(now)
        return len(data)

    def sendmsg(self, buffers: Sequence[bytes | bytearray | memoryview], ancdata: Sequence[tuple[int, int, bytes]],
                flags: int, addr: tuple[str, int]) -> int:
        """Offer the datagrams of a UDP_SEGMENT run (the segment size in
        ``ancdata``; without one, the buffers are one datagram); send what
        is due.  Never raises but outside the window (``sendto``)."""
        now = self.clock()
        if not self.start <= now < self.stop:
            return self.sock.sendmsg(buffers, ancdata, flags, addr)
        try:
            data = memoryview(buffers[0] if len(buffers) == 1 else b"".join(buffers)).cast("B")
            size = len(data)
            for level, kind, value in ancdata:
                if level == SOL_UDP and kind == UDP_SEGMENT:
                    size = int.from_bytes(value, sys.byteorder) or size
            offer = self.model.offer
            for at in range(0, len(data), max(1, size)):
                offer(data[at:at + size], now, addr)
        except Exception:
            self._failed()
            return 0
        self.release(now)
        return len(data)

    def _failed(self) -> None:
        """A failure of the model: what it was given is dropped (its link
        retransmits it), counted, and logged once."""
        self.stats["impair_errors"] += 1
        if self.stats["impair_errors"] == 1:
            log.exception("impairment failed; what it was given is dropped")

    # -- what the device calls ------------------------------------------------------
    def release(self, now: float) -> bool:
        """Send the held datagrams due at ``now``; True if any left.  Never raises."""
        try:
            d = self.model.next_deadline()
            if d is None or d > now:
                return False
            out = self.model.due(now)
        except Exception:
            self._failed()
            return False
        i, n = 0, len(out)
        while i < n:
            i = self._send_run(out, i)
        return True

    def _send_run(self, out: list[Released], i: int) -> int:
        """Send ``out[i]`` and the datagrams after it that may share its
        UDP_SEGMENT sendmsg (one peer, one size, the last may be shorter),
        as the device would have sent them: a run split into datagrams by
        the sender reaches the peer one datagram per read, and its receive
        path is then what the impairment would measure.  Returns where the
        next run starts."""
        _, first, to = out[i]
        size = len(first)
        j, total = i + 1, size
        if self.gso:
            while j < len(out) and j - i < GSO_MAX_SEGMENTS:
                _, d, dest = out[j]
                k = len(d)
                if dest != to or k > size or total + k > GSO_MAX_BYTES:
                    break
                total += k
                j += 1
                if k < size:
                    break
        stats = self.stats
        try:
            if j == i + 1:
                self.sock.sendto(first, to)
            else:
                self.sock.sendmsg([r[1] for r in out[i:j]],
                                  [(SOL_UDP, UDP_SEGMENT, size.to_bytes(2, sys.byteorder))], 0, to)
        except (BlockingIOError, InterruptedError):
            stats["tx_dropped"] += j - i  # their links retransmit them
        except OSError as e:
            if j > i + 1 and e.errno in _GSO_REFUSED:
                stats["tx_gso_refused"] += 1  # the kernel would not cut it: one by one from now on
                self.gso = False
                return i
            stats["tx_oserror"] += j - i
        except Exception:
            self._failed()
        return j

    def next_deadline(self) -> float | None:
        """When a held datagram is next due (None: none is held)."""
        return self.model.next_deadline()

    def counters(self) -> dict[str, int]:
        """The model's counters as ``impair_*``, with ``impair_held`` (held now)."""
        out = {f"impair_{k}": v for k, v in self.model.stats.items()}
        out["impair_held"] = self.model.held
        return out


class ImpairedSockets:
    """Several impaired sockets (a device with several addresses) as one:
    each keeps its own model, so what one path holds never leaves by another."""

    def __init__(self, sockets: list[ImpairedSocket]) -> None:
        self.sockets = sockets

    def release(self, now: float) -> bool:
        """Send what every socket holds that is due at ``now``; True if any left."""
        released = False
        for s in self.sockets:
            if s.release(now):
                released = True
        return released

    def next_deadline(self) -> float | None:
        """The earliest of the sockets' deadlines (None: nothing is held)."""
        due = [d for d in (s.next_deadline() for s in self.sockets) if d is not None]
        return min(due) if due else None

    def counters(self) -> dict[str, int]:
        """The sockets' counters, summed."""
        out: dict[str, int] = {}
        for s in self.sockets:
            for k, v in s.counters().items():
                out[k] = out.get(k, 0) + v
        return out
