"""Path MTU discovery for a link: the largest datagram its path really carries (sans-IO).

Theory of operation
-------------------
Datagrams leave with DF set (the daemon's socket), so a datagram larger
than some hop carries is lost, not fragmented.  Each link therefore finds
the size its path carries itself, as RFC 8899 (DPLPMTUD) describes and
QUIC does it (RFC 9000 §14): it sends messages no larger than a size known
to work (the *PLPMTU*) and tries larger ones with *probes*.  Sizes here are
link bodies, what ``LinkConfig.max_payload`` counts; the datagram is
``wl.OVERHEAD`` bytes more (and the owner's seal, if any).

:class:`Plpmtud` is the state machine of RFC 8899 §5.2, alone:

``DISABLED``
    before the link is established (the peer's largest body unknown).
``BASE``
    the PLPMTU is ``base`` (``LinkConfig.base_payload``: the size the
    operator's configuration assumes every path carries), confirmed by a
    probe of that size.  Entered after a black hole or when the local stack
    refused a datagram no larger than the PLPMTU.
``SEARCHING``
    probes try larger sizes, one in flight at a time, each sent up to
    ``MAX_PROBES`` times, a probe judged lost when the link's retransmission
    timeout passes without its PROBE_ACK (the link's RTT estimate, as QUIC
    judges a probe, not RFC 8899's 15-second PROBE_TIMER, which is for a
    layer without one).  The first probe tries the largest size allowed,
    ``max`` (min of our ``max_payload`` and the peer's, from INIT/INIT_ACK:
    RFC 8899 §5.3.1's MAX_PLPMTU): an operator who sets ``--mtu`` usually
    sets what the path carries.  After that the search halves the range
    between the PLPMTU and the smallest size known too big, until it is
    under ``SEARCH_STEP`` bytes.
``SEARCH_COMPLETE``
    nothing left to try; ``RAISE_INTERVAL_S`` later (RFC 8899's
    PMTU_RAISE_TIMER) the search runs again, in case the path grew.
``ERROR``
    the path did not carry even a ``base`` probe: the PLPMTU falls to
    ``floor`` (``LinkConfig.min_payload``), and a ``base`` probe is tried
    again every ``ERROR_RETRY_S``.

Two signals make the PLPMTU smaller.  The local stack refusing a datagram
as too big (``EMSGSIZE``: the daemon tells the link, ``Link.datagram_refused``)
is RFC 8899's PTB, and trusted as it is: it comes from our own kernel.  A
probe refused so fails at once.  And a *black hole* (§4.3): the
retransmission timer expiring ``BLACK_HOLE_RTOS`` times in a row while the
oldest message waiting is larger than ``base`` means the path may have
stopped carrying what it did; the PLPMTU falls back to ``base``.

A probe is not a message: it carries no data and has no sequence number,
so its loss costs no retransmission, and it never counts as bytes in
flight, so the congestion controller never sees it lost (§4.3: a probe's
loss is no sign of congestion).

:class:`PathProbing` is the link's part (a mixin of ``link.Link``, as
``Handshake`` is): it builds PROBE and PROBE_ACK packets, feeds the machine
the link's events, and keeps ``payload_limit``, the largest message the
owner should queue now (min of the PLPMTU and the peer's largest body).
Messages queued before it fell may be larger (the link sends a message as
it was queued): ``fragment_above`` then names the packet size above which
the owner lets IP fragment them, the way they would have left before DF.
"""

from __future__ import annotations

import enum
from typing import Any

from ..wire import link as wl
from ..wire.errors import WireError
from .records import PathMtu

_U32 = 0xFFFFFFFF
_DATA = wl.PacketType.DATA
_PROBE = wl.PacketType.PROBE
_PROBE_ACK = wl.PacketType.PROBE_ACK
_encode_fields = wl.encode_fields

#: tries of one probe size before it counts as too big (RFC 8899 §5.1.2's MAX_PROBES)
MAX_PROBES = 3
#: the search stops when the range left is narrower than this (bytes)
SEARCH_STEP = 32
#: how long a completed search holds before it runs again (PMTU_RAISE_TIMER, RFC 8899 §5.1.1)
RAISE_INTERVAL_S = 600.0
#: how often ERROR tries the base size again
ERROR_RETRY_S = 1.0
#: retransmission timeouts in a row, the oldest message larger than base, that mean a black hole
BLACK_HOLE_RTOS = 2


def fragmentable(datagram: bytes | memoryview, above: int) -> bool:
    """Whether the owner lets IP fragment ``datagram`` (DF clear): a DATA
    packet longer than ``above`` (a link's ``fragment_above``, nonzero).
    A probe never is: what it asks is whether the path carries it whole."""
    return len(datagram) > above and datagram[1] == _DATA


class PmtudState(enum.IntEnum):
    """RFC 8899 §5.2's states (see the module docstring)."""

    DISABLED = 0
    BASE = 1
    SEARCHING = 2
    SEARCH_COMPLETE = 3
    ERROR = 4


class Plpmtud:
    """The search for the largest body a path carries (see the module docstring).

    Every method that may start a probe takes ``timeout`` (how long until an
    unanswered probe counts as lost) and returns the size of the probe to
    send now, or 0.  ``deadline`` is when :meth:`timer` must run (None:
    never).

    Args:
        floor: the PLPMTU in ERROR.
        base: the PLPMTU at the start, assumed carried.
        top: the largest size ever tried (our ``max_payload``).
    """

    def __init__(self, floor: int, base: int, top: int) -> None:
        self.top = top
        self.base = min(base, top)
        self.floor = min(floor, self.base)
        self.max = self.top
        self.state = PmtudState.DISABLED
        self.plpmtu = self.base
        self.upper = self.max  # the largest size not known to be too big
        self.probed = 0  # the size of the probe in flight, 0: none
        self.probe_count = 0
        self.deadline: float | None = None
        self.lost = 0  # probes judged lost (a counter for the owner)

    def start(self, peer_max: int, now: float, timeout: float) -> int:
        """The link is established; the peer takes bodies up to ``peer_max``."""
        self.max = max(min(self.top, peer_max), wl.PROBE_MIN_BODY)
        self.base = min(self.base, self.max)
        self.floor = min(self.floor, self.base)
        self.plpmtu = self.base
        self.upper = self.max
        return self._search(now, timeout)

    def _probe(self, size: int, now: float, timeout: float) -> int:
        if size != self.probed:
            self.probe_count = 0
        self.probed = size
        self.deadline = now + timeout
        return size

    def _search(self, now: float, timeout: float) -> int:
        """SEARCHING from the PLPMTU: the next size to try, or SEARCH_COMPLETE."""
        lo, hi = self.plpmtu, self.upper
        if hi - lo < SEARCH_STEP:
            self.state = PmtudState.SEARCH_COMPLETE
            self.probed = 0
            self.deadline = now + RAISE_INTERVAL_S if self.plpmtu < self.max else None
            return 0
        self.state = PmtudState.SEARCHING
        # the largest allowed first (what --mtu says), then halve the range
        return self._probe(hi if hi == self.max else (lo + hi + 1) // 2, now, timeout)

    def _fall_to_base(self, now: float, timeout: float) -> int:
        """BASE: the PLPMTU is ``base`` until a probe of it comes back."""
        self.state = PmtudState.BASE
        self.plpmtu = self.base
        return self._probe(self.base, now, timeout)

    def probe_acked(self, size: int, now: float, timeout: float) -> int:
        """The probe of ``size`` bytes in flight came back."""
        if not self.probed or size != self.probed:
            return 0
        self.probed = 0
        if self.state == PmtudState.SEARCHING:
            self.plpmtu = size
        else:  # BASE or ERROR: the base is carried again
            self.plpmtu = self.base
        return self._search(now, timeout)

    def timer(self, now: float, timeout: float) -> int:
        """The deadline passed: a probe lost, or time to search again."""
        state = self.state
        if state == PmtudState.SEARCH_COMPLETE:
            self.upper = self.max  # the path may carry more now (PMTU_RAISE_TIMER)
            return self._search(now, timeout)
        if not self.probed:
            self.deadline = None
            return 0
        self.lost += 1
        self.probe_count += 1
        if state == PmtudState.ERROR:
            return self._probe(self.base, now, max(timeout, ERROR_RETRY_S))
        if self.probe_count < MAX_PROBES:
            return self._probe(self.probed, now, timeout)
        if state == PmtudState.BASE:
            # not even the base size gets through: the smallest we may send
            self.state = PmtudState.ERROR
            self.plpmtu = self.floor
            return self._probe(self.base, now, max(timeout, ERROR_RETRY_S))
        self.upper = self.probed - 1
        self.probed = 0
        return self._search(now, timeout)

    def too_big(self, size: int, now: float, timeout: float) -> int:
        """The local stack refused a datagram of a ``size``-byte body as too
        big (RFC 8899 §4.6's PTB, from our own kernel)."""
        if size > self.upper:
            return 0  # no news
        self.upper = size - 1
        if size > self.plpmtu:
            if self.probed >= size:  # the probe in flight failed at once
                self.probed = 0
                return self._search(now, timeout)
            return 0
        # data the PLPMTU allowed was refused: the path (as our host sees it) shrank
        if self.base < size:
            self.plpmtu = self.base
            self.state = PmtudState.SEARCHING
            return self._search(now, timeout)
        self.state = PmtudState.ERROR
        self.plpmtu = self.floor
        return self._probe(self.base, now, max(timeout, ERROR_RETRY_S))

    def black_hole(self, now: float, timeout: float) -> int:
        """Messages larger than ``base`` stopped getting through (§4.3):
        back to BASE; the search that follows tries the whole range again."""
        self.upper = self.max
        return self._fall_to_base(now, timeout)


class PathProbing:
    """The link's part of path MTU discovery (a mixin of ``link.Link``; see
    the module docstring).  Needs the link's state, timers and output queue."""

    config: Any
    stats: Any
    rtt: Any
    recovery: Any
    receiver: Any
    path_id: int
    peer_tag: int
    peer_max_payload: int
    isn: int
    _snd_nxt: int
    _out: Any
    _events: Any
    _consecutive_rto: int
    _echo: Any  # the builder's echo rule

    def _pmtud_init(self) -> None:
        c = self.config
        top = c.max_payload
        base = min(c.base_payload, top) if c.base_payload else top
        self.pmtud = Plpmtud(c.min_payload or base, base, top)
        #: the largest message the owner should queue now
        self.payload_limit = self.pmtud.plpmtu
        #: 0, or the packet size above which the owner must let IP fragment
        #: (messages queued before ``payload_limit`` fell)
        self.fragment_above = 0
        self._payload_high = self.payload_limit  # the largest limit messages were cut at
        #: the longest packet the send loop builds: SACK blocks that would
        #: make a DATA packet longer are left out (no limit without discovery)
        self._packet_cap = self.payload_limit + wl.OVERHEAD if c.base_payload else 1 << 31
        self._pmtu_deadline: float | None = None
        self._probe_id = 0
        self._search_reported = False  # the search's end was reported (a PathMtu event)

    @property
    def plpmtu(self) -> int:
        """The largest body the path is known to carry (RFC 8899's PLPMTU)."""
        return self.pmtud.plpmtu

    def _probe_timeout(self) -> float:
        return float(self.rtt.rto_s)

    def _pmtud_did(self, size: int, now: float) -> None:
        """After the machine moved: send the probe it asked for, and tell the
        owner if the largest message changed or a search ended."""
        m = self.pmtud
        if size:
            self._probe_id = (self._probe_id + 1) & _U32
            ack, rwnd, _ = self.receiver.feedback()
            # No SACK blocks: the probe's size must be exactly the one tried.
            self._out.append(_encode_fields(_PROBE, 0, self.path_id, self.peer_tag,
                                            (self.isn + self._snd_nxt) & _U32, ack, int(now * 1e6) & _U32,
                                            self._echo(now), rwnd, wl.encode_probe(self._probe_id, size)))
            self.stats.pmtu_probes_sent += 1
        self._pmtu_deadline = m.deadline
        limit = min(m.plpmtu, self.peer_max_payload)
        changed = limit != self.payload_limit
        if changed:
            self.payload_limit = limit
            self._packet_cap = limit + wl.OVERHEAD
            if limit > self._payload_high:
                self._payload_high = limit
            self.fragment_above = limit + wl.OVERHEAD if limit < self._payload_high else 0
        # a search that ended short of what we allow is news once (the owner warns)
        ended = m.state == PmtudState.SEARCH_COMPLETE
        short = ended and not self._search_reported and limit < self.config.max_payload
        self._search_reported = ended
        if changed or short:
            self._events.append(PathMtu(limit, m.state.name, m.max))

    def _pmtud_start(self, now: float) -> None:
        """The link is established: the peer's largest body is known."""
        self._pmtud_did(self.pmtud.start(self.peer_max_payload, now, self._probe_timeout()), now)

    def _pmtud_timer(self, now: float) -> None:
        m = self.pmtud
        lost = m.lost
        size = m.timer(now, self._probe_timeout())
        self.stats.pmtu_probes_lost += m.lost - lost
        self._pmtud_did(size, now)

    def _pmtud_rto(self, now: float) -> None:
        """The retransmission timer expired (``Link._on_rto``): a black hole?"""
        m = self.pmtud
        if self._consecutive_rto < BLACK_HOLE_RTOS or m.plpmtu <= m.base or m.state == PmtudState.DISABLED:
            return
        rec = self.recovery
        try:
            oldest = len(rec.message(rec.una))
        except KeyError:
            return
        if oldest > m.base:
            self.stats.pmtu_black_holes += 1
            self._pmtud_did(m.black_hole(now, self._probe_timeout()), now)

    def datagram_refused(self, size: int, now: float, path: int = 0) -> None:
        """The local stack would not send a link packet of ``size`` bytes as
        too big (``EMSGSIZE``): a PTB for this path (RFC 8899 §4.6), which
        our own kernel gives, so it is believed as it is.  A probe of that
        size fails at once; a message that size was lost (the link resends
        it, smaller messages follow).  ``path``: the path whose socket
        refused it (the limit is the link's, for every path: ``paths.py``)."""
        m = self.pmtud
        if m.state == PmtudState.DISABLED:
            return
        self.stats.pmtu_too_big += 1
        self._pmtud_did(m.too_big(size - wl.OVERHEAD, now, self._probe_timeout()), now)

    def _probe_packet(self, ptype: int, body: memoryview, now: float) -> None:
        """A PROBE (answered at once, whatever its size) or a PROBE_ACK."""
        try:
            if ptype == _PROBE:
                probe_id = wl.decode_probe_untrusted(body)
            else:
                probe_id, size = wl.decode_probe_ack_untrusted(body)
        except WireError:
            self.stats.malformed += 1
            return
        if ptype == _PROBE:
            ack, rwnd, sack = self.receiver.feedback()
            self._out.append(_encode_fields(_PROBE_ACK, 0, self.path_id, self.peer_tag,
                                            (self.isn + self._snd_nxt) & _U32, ack, int(now * 1e6) & _U32,
                                            self._echo(now), rwnd, wl.encode_probe_ack(probe_id, len(body)),
                                            sack))
            self.stats.pmtu_probes_answered += 1
            return
        m = self.pmtud
        if probe_id != self._probe_id or not m.probed or size != m.probed:
            self.stats.unexpected += 1  # late (judged lost already), or not ours
            return
        self.stats.pmtu_probes_acked += 1
        self._pmtud_did(m.probe_acked(size, now, self._probe_timeout()), now)
