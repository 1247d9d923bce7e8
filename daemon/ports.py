"""What the engine asks of the device it runs in: two small interfaces.

The QP engine (``qp.py`` and its roles) and the peer links (``peer.py``)
never import the device.  They hold an object that has what they need, and
``device.Device`` is that object; a test may hand them another.  So the
engine's modules sit below the device in the import order
(``tests/test_layering.py``), and what crosses the boundary is named here.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

from . import tables


class QPHost(Protocol):
    """What a queue pair needs from its device."""

    #: the STag table: memory regions by STag, and its version
    stags: tables.STagTable
    #: the device's counters (``udpverbs stat`` and ``ctx.query_stats()``)
    stats: collections.Counter[str]
    #: the time of the data loop's pass under way (trio's clock, seconds)
    now: float
    #: the compiled lanes (``wire/native.py``), or None: the Python path only
    native: Any
    #: QPs backing off after an RNR NACK (their ``rnr_until`` bounds the loop's sleep)
    rnr_waiting: set[Any]
    #: QPs holding a Modified ACK for their answer (their hold's deadline bounds the sleep)
    flow_ack_holding: set[Any]

    def qp_changed(self, qp: Any) -> None:
        """``qp`` may have WRs to complete or something to send: visit it in the next pass."""

    def detach_link(self, qp: Any) -> None:
        """``qp`` leaves its peer link (RESET)."""


class PeerHost(Protocol):
    """What a peer link needs from its device: time, the socket, the send
    lane's buffers, and the hand-over after a datagram sent alone."""

    now: float
    stats: collections.Counter[str]
    #: the device's UDP socket (``udp.UdpPort``)
    udp: Any
    #: the compiled send lane's buffers (``peer.SendLane``), or None
    tx_lane: Any
    #: whether a ping-pong's message of several datagrams leaves when it is
    #: queued (True) or at the pass's flush with everything else
    eager_runs: bool
    #: whether a run of large tagged segments leaves from the registered
    #: region without a copy (``peer.ZERO_COPY_MIN``)
    zero_copy: bool

    def clock(self) -> float:
        """The time now (the same clock as ``now``)."""

    def handed_over(self, pl: Any) -> None:
        """A datagram of ``pl``'s left alone, before the link recorded it:
        arm for its answer and let the processes sharing our CPU run."""
