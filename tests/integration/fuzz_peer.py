"""A peer daemon played by a test, and datagrams forged from anywhere on loopback.

``FakePeer`` runs the project's own sans-IO ``transport.link.Link`` over a
UDP socket of the test process: it opens a link to a real daemon (the
daemon's COOKIE answered as any daemon answers it) and then carries
whatever messages the test gives it inside valid link framing, so they
reach the daemon's DDP/RDMAP dispatch as a real peer's would.  It answers
keep-alives and restart probes, and records what the daemon sends back.

``spoof`` sends a UDP datagram with any source address and port from a raw
socket (``IP_HDRINCL``; root, loopback only).
"""

from __future__ import annotations

import os
import random
import select
import socket
import struct
import time

from udpverbs.transport.link import Link, LinkConfig, LinkFailed, LinkState
from udpverbs.wire import link as wl


class PeerGone(Exception):
    """The daemon did not acknowledge in time, or the link failed."""


class FakePeer:
    """One link to ``target`` from ``(ip, ephemeral port)``, driven by hand (see the module docstring)."""

    def __init__(self, ip: str, target: tuple[str, int], seed: int, mtu: int = 1472) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((ip, 0))
        self.sock.setblocking(False)
        self.addr: tuple[str, int] = self.sock.getsockname()
        self.target = target
        self.mtu = mtu
        self.rng = random.Random(seed)
        self.link = self._new_link()
        self.received: list[bytes] = []  # what the daemon delivered to us, in order
        self.failures: list[str] = []  # LinkFailed reasons seen

    def _new_link(self) -> Link:
        cfg = LinkConfig(max_payload=self.mtu - wl.OVERHEAD)
        return Link(cfg, rng=self.rng, incarnation=self.rng.getrandbits(63) | 1)

    @property
    def max_payload(self) -> int:
        return self.link.peer_max_payload

    def open(self, timeout_s: float = 10.0) -> None:
        """Open the link (INIT, the daemon's COOKIE, INIT again with it, INIT_ACK).

        Raises:
            PeerGone: not established within ``timeout_s``.
        """
        if self.link.state != LinkState.IDLE:
            self.link = self._new_link()
        self.link.connect(time.monotonic())
        self.pump_until(lambda: self.link.state == LinkState.ESTABLISHED, timeout_s)

    def send(self, messages: list[bytes], timeout_s: float = 10.0) -> None:
        """Queue ``messages`` on the link and pump until the daemon acknowledged them all.

        The daemon acknowledges a message in the pass that dispatched it, so
        on return it has had its effect on the daemon's state.

        Raises:
            PeerGone: not acknowledged within ``timeout_s``, or the link failed.
        """
        last = -1
        for m in messages:
            self.pump(0.0)
            last = self.link.send(m, time.monotonic())
        self.pump_until(lambda: self.link.acked > last, timeout_s)

    def pump_until(self, done: object, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not done():  # type: ignore[operator]
            if self.link.state >= LinkState.CLOSED:
                raise PeerGone(f"link {self.link.state.name}: {self.failures}")
            left = end - time.monotonic()
            if left <= 0:
                raise PeerGone(f"no progress in {timeout_s} s (state {self.link.state.name}, acked "
                               f"{self.link.acked}, stats {self.link.stats})")
            self.pump(min(left, 0.05))

    def pump(self, wait_s: float) -> None:
        """Send what the link lets leave, wait up to ``wait_s`` (or its timer) for
        datagrams, feed them, fire its timer, collect messages and events."""
        link = self.link
        now = time.monotonic()
        for d in link.datagrams_to_send(now):
            self.sock.sendto(d, self.target)
        deadline = link.next_deadline()
        wait = wait_s if deadline is None else max(0.0, min(wait_s, deadline - now))
        if select.select([self.sock], [], [], wait)[0]:
            while True:
                try:
                    data = self.sock.recv(65536)
                except (BlockingIOError, ConnectionRefusedError):
                    break
                link.datagram_received(data, time.monotonic())
        now = time.monotonic()
        deadline = link.next_deadline()
        if deadline is not None and deadline <= now:
            link.timer_fired(now)
        self.received.extend(bytes(m) for m in link.drain_received())
        while (ev := link.next_event()) is not None:
            if isinstance(ev, LinkFailed):
                self.failures.append(ev.reason)
        for d in link.datagrams_to_send(time.monotonic()):
            self.sock.sendto(d, self.target)

    def close(self) -> None:
        self.sock.close()


def raw_sender() -> socket.socket:
    """A raw IPv4 socket that sends whole packets, header included (root)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_HDRINCL, 1)
    return s


def spoof(raw: socket.socket, src: tuple[str, int], dst: tuple[str, int], payload: bytes) -> None:
    """Send ``payload`` as a UDP datagram from ``src`` to ``dst`` (loopback only)."""
    assert src[0].startswith("127.") and dst[0].startswith("127.")
    udp = struct.pack("!HHHH", src[1], dst[1], 8 + len(payload), 0) + payload  # checksum 0: none (RFC 768)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src[0]), socket.inet_aton(dst[0]))  # the kernel fills the checksum
    raw.sendto(ip + udp, (dst[0], 0))


def can_spoof() -> bool:
    return os.geteuid() == 0
