"""A UDP relay between two daemons that keeps a copy of every datagram.

Daemon A is told that B lives at the relay's first socket, and B that A
lives at its second; the relay forwards each datagram to the other daemon
from the socket that stands for the sender, so each daemon sees one
consistent peer.  Its sockets take no UDP_GRO, so a daemon's GSO runs
arrive here one datagram at a time, as the peer's socket would take them.
A capture without root and without tshark.
"""

from __future__ import annotations

import selectors
import socket
import threading


class Relay:
    """``start()``, run traffic, ``stop()``; ``datagrams`` holds ``(sender, bytes)``, sender "A" or "B"."""

    def __init__(self, a: tuple[str, int], b: tuple[str, int], a_side_ip: str = "127.0.0.4",
                 b_side_ip: str = "127.0.0.5") -> None:
        self.a, self.b = a, b
        self.for_a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # what A sends to: B, as A sees it
        self.for_a.bind((a_side_ip, 0))
        self.for_b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # what B sends to: A, as B sees it
        self.for_b.bind((b_side_ip, 0))
        self.datagrams: list[tuple[str, bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)

    @property
    def b_seen_by_a(self) -> tuple[str, int]:
        return self.for_a.getsockname()

    @property
    def a_seen_by_b(self) -> tuple[str, int]:
        return self.for_b.getsockname()

    def start(self) -> "Relay":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.for_a.close()
        self.for_b.close()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.for_a, selectors.EVENT_READ, ("A", self.for_b, self.b))
        sel.register(self.for_b, selectors.EVENT_READ, ("B", self.for_a, self.a))
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.05):
                    sender, out, dest = key.data
                    try:
                        data, src = key.fileobj.recvfrom(65536)  # type: ignore[union-attr]
                    except OSError:  # an ICMP error from an earlier send: nothing to forward
                        continue
                    self.datagrams.append((sender, data))
                    try:
                        out.sendto(data, dest)
                    except OSError:
                        pass  # the daemon is gone: what it would have got is still recorded
        finally:
            sel.close()
