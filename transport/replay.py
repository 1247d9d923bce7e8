"""Packet numbers of a sending daemon, and the receiver's anti-replay window.

Theory of operation
-------------------
With a cluster key (``wire/auth.py``) every datagram a daemon sends carries
a 64-bit packet number, one more than its last datagram's to any peer
(retransmissions included: a datagram sent again is a new datagram).  A
receiver keeps, per sending daemon, the sliding window of RFC 4303 §3.4.3:
the highest number it has accepted and a bitmap of which of the ``size``
numbers below it it has seen.  A number above the top moves the window up;
one inside it is accepted once; one below it is too old.  The bitmap is a
Python int (bit ``i`` = top - ``i`` seen), which plays RFC 6479's
word ring: shifting it costs about as much as indexing one.  Numbers from
one sender arrive with gaps (those sent to other peers), so the window is
a span of numbers, not of datagrams received.  A window is updated only
after the datagram's tag has checked, so a forger cannot move it.

Restarts.  A restarted sender must not count again from where it counted
before, or the receiver, whose window still stands at the old top, would
drop everything it sends; and numbers must never run backwards past a
point an attacker holds captures of.  So a sender's first number is taken
from the wall clock, ``microseconds since the epoch × 1024``
(:func:`first_packet_number`), and counts up by one from there.  No daemon
sends 1,024 datagrams in a microsecond, so its numbers stay below the
clock's value at any moment, and a daemon started later starts above
every number the earlier one used, without storing anything.  The cost is
a dependency on a clock that does not step back across a restart (by
more than the restart takes): if it does, the receivers drop the
restarted daemon's datagrams as replays (counted as ``auth_replayed``)
until its clock passes the old numbers, and its links fail and are
remade.  A *receiver* that restarts has no window for anyone; it takes
the first valid number from each sender as the top.  A datagram captured
before that restart and replayed into it passes this check but not the
link's: every link the restarted daemon accepts is a new handshake with
random tags and a fresh cookie key, which no old datagram carries.
"""

from __future__ import annotations

#: numbers a window spans below its top (RFC 4303's default is 32 or 64;
#: ours must also cover what the sender interleaves to other peers)
DEFAULT_WINDOW = 2048


def first_packet_number(wall_ns: int) -> int:
    """The first packet number of a daemon started at ``wall_ns`` (wall-clock
    nanoseconds since the epoch): microseconds × 1024 (see the module
    docstring), which fits 64 bits until the year 2540."""
    return (wall_ns // 1000) << 10


class ReplayWindow:
    """The numbers one receiver has accepted from one sender (RFC 4303 §3.4.3)."""

    __slots__ = ("size", "top", "bits", "_mask")

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        if size < 1:
            raise ValueError("a replay window spans at least one number")
        self.size = size
        self.top = -1  # nothing accepted yet
        self.bits = 0  # bit i: top - i was accepted
        self._mask = (1 << size) - 1

    def fresh(self, pn: int) -> bool:
        """Whether ``pn`` may be accepted: above the top, or inside the
        window and not seen.  Changes nothing."""
        d = self.top - pn
        if d < 0:
            return True
        return d < self.size and not (self.bits >> d) & 1

    def accept(self, pn: int) -> bool:
        """Accept ``pn`` if :meth:`fresh`; True if it was (then the window holds it)."""
        d = self.top - pn
        if d < 0:
            # above the top: slide up, the new top seen
            self.bits = 1 if -d >= self.size else ((self.bits << -d) | 1) & self._mask
            self.top = pn
            return True
        if d >= self.size or (self.bits >> d) & 1:
            return False  # too old, or seen
        self.bits |= 1 << d
        return True
