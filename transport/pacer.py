"""A pacer: spreads a window over the RTT instead of sending it in one burst.

Theory of operation
-------------------
The congestion controller names a rate (``cwnd / rtt * gain``); the pacer
turns it into a release time.  It keeps one number, ``next_send_s``, the
earliest time the next packet may leave; sending ``size`` bytes pushes it
``size / rate`` later.  Idle time accrues credit, but at most
``burst_bytes`` worth, so a flow that was quiet may send a short burst and no
more (a token bucket, written as a virtual clock).  Bursts matter here: an
unpaced sender on loopback lost 3-40% of its datagrams to receive-buffer
overflow (DESIGN.md, measured facts), and on a shared bottleneck a window
sent at once is a queue.
"""

from __future__ import annotations

INF = float("inf")


class Pacer:
    """Virtual-clock token bucket.

    Args:
        burst_bytes: the credit an idle sender may accumulate.
    """

    __slots__ = ("rate_Bps", "next_send_s", "burst_bytes")

    def __init__(self, burst_bytes: float) -> None:
        self.rate_Bps = INF
        self.next_send_s = -INF
        self.burst_bytes = burst_bytes

    def can_send(self, now: float) -> bool:
        """True if a packet may leave at ``now``."""
        return now >= self.next_send_s

    def on_sent(self, size: int, now: float) -> None:
        """Account ``size`` bytes sent at ``now``."""
        rate = self.rate_Bps
        if rate == INF:
            return
        floor = now - self.burst_bytes / rate  # credit for idle time, capped
        t = self.next_send_s
        self.next_send_s = (t if t > floor else floor) + size / rate
